"""NPU implementations of the row-wise ops over torch_npu's fused operators.

torch_npu registers autograd for ``npu_rms_norm``, ``npu_rotary_mul`` and ``npu_swiglu``,
so gradients flow through them directly. Documented semantics relied on here:

- ``npu_rms_norm(x, gamma, epsilon) -> (y, rstd)``: ``y = x * rsqrt(mean(x^2) + eps) * gamma``.
- ``npu_rotary_mul(x, r1, r2)`` ("half" mode): ``r1 * x + r2 * cat(-x2, x1)`` on 4-D x
  (BNSD, BSND or SBND) with r1/r2 broadcast on the batch/head dims.
- ``npu_swiglu(x, dim=-1)``: ``silu(A) * B`` where A, B are the halves of x along dim;
  contiguous, non-empty input.

Where torch_npu's kernels need a layout they lack (partial rotary, non-4-D q), the
argument marshalling below adapts it or the verifier routes the call elsewhere with a reason.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .._dtypes import FAST_DTYPES


def torch_npu_module():
    """The torch_npu module (imported on first use, never at package import)."""
    import torch_npu

    return torch_npu


def on_npu(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on an NPU (one place, so CPU tests can simulate an NPU device)."""
    return t.device.type == "npu"


def tensor_reason(t: torch.Tensor) -> Optional[str]:
    """None when torch_npu's kernels take ``t`` (an NPU tensor of a fast dtype, not empty), else why not."""
    if not on_npu(t):
        return f"the npu backend needs NPU tensors (got {t.device.type})"
    if t.dtype not in FAST_DTYPES:
        return f"dtype {t.dtype} is not supported by the torch_npu kernels"
    if t.numel() == 0:
        return "torch_npu kernels reject empty tensors"
    return None


# -- RMSNorm family ---------------------------------------------------------------------------

def rms_norm(x, weight, eps, offset):
    if offset == 0.0 and weight.dtype == x.dtype:
        return torch_npu_module().npu_rms_norm(x, weight, epsilon=eps)[0]
    # (offset + w) rounded to bf16 would lose small w (1 + 1e-3 == 1 in bf16): keep the
    # gamma in fp32 and normalise in fp32, as Qwen3.5's own norm does.
    gamma = offset + weight.float()
    return torch_npu_module().npu_rms_norm(x.float(), gamma, epsilon=eps)[0].to(x.dtype)


def gated_rms_norm(x, gate, weight, eps):
    y = torch_npu_module().npu_rms_norm(x.float(), weight.float(), epsilon=eps)[0]
    return (y * F.silu(gate.float())).to(x.dtype)


# -- rotary -----------------------------------------------------------------------------------

def _rotate(x, cos_u, sin_u):
    rot = cos_u.shape[-1]
    if rot == x.shape[-1]:
        return torch_npu_module().npu_rotary_mul(x.contiguous(), cos_u, sin_u)
    x_rot = x[..., :rot].contiguous()
    return torch.cat((torch_npu_module().npu_rotary_mul(x_rot, cos_u, sin_u), x[..., rot:]), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim):
    cos_u = cos.unsqueeze(unsqueeze_dim).to(q.dtype)
    sin_u = sin.unsqueeze(unsqueeze_dim).to(q.dtype)
    return _rotate(q, cos_u, sin_u), _rotate(k, cos_u, sin_u)


def rope_reason(q, k, cos, sin, unsqueeze_dim):
    """The rope op's npu verifier: None when :func:`apply_rotary_pos_emb` here takes the call, else why not."""
    why = tensor_reason(q)
    if why:
        return why
    if q.dim() != 4 or k.dim() != 4:
        return "npu_rotary_mul needs 4-D q and k (BNSD, BSND or SBND)"
    if cos.requires_grad or sin.requires_grad:
        return "cos/sin require grad; only the reference differentiates them"
    if unsqueeze_dim not in (1, 2):
        return f"npu_rotary_mul broadcasts cos over dim 1 or 2, not {unsqueeze_dim}"
    return None


# -- SwiGLU -----------------------------------------------------------------------------------

SWIGLU_SILU_ONLY = ("torch_npu's npu_swiglu is SiLU only (activation={!r}); the reference "
                    "(pure torch, on the NPU) serves it")


def swiglu_reason(t: torch.Tensor, activation: str = "silu") -> Optional[str]:
    """The swiglu ops' npu verifier: None when ``npu_swiglu`` takes the call, else why not."""
    why = tensor_reason(t)
    if why is None and activation != "silu":
        why = SWIGLU_SILU_ONLY.format(activation)
    return why


def _silu_only(activation: str) -> None:
    if activation != "silu":  # the verifier routes these elsewhere; a direct call must not compute silu
        raise ValueError(SWIGLU_SILU_ONLY.format(activation))


def swiglu(gate, up, activation="silu"):
    _silu_only(activation)
    return torch_npu_module().npu_swiglu(torch.cat((gate, up), dim=-1), dim=-1)


def swiglu_packed(x, activation="silu"):
    _silu_only(activation)
    return torch_npu_module().npu_swiglu(x.contiguous(), dim=-1)
