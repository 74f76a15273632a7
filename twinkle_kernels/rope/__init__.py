"""Rotary position embedding (Hugging Face ``apply_rotary_pos_emb``), full and partial."""
from __future__ import annotations

from typing import Optional

import torch

from .. import _checks, _dispatch
from .._verifiers import cpu_reason, triton_reason
from ..npu import ops as npu_ops
from . import _library
from .reference import apply_rotary_pos_emb_reference, rotate_half

__all__ = ["apply_rotary_pos_emb", "apply_rotary_pos_emb_reference", "rotate_half"]

_ROPE = _dispatch.op("apply_rotary_pos_emb")

_ROPE.register("reference")(
    lambda q, k, cos, sin, unsqueeze_dim: apply_rotary_pos_emb_reference(q, k, cos, sin, unsqueeze_dim))


def _normalize_dim(name: str, dim: int, ndim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name} must be an int, got {type(dim).__name__}")
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name}={dim} is out of range for cos with {ndim - 1} dims")
    return dim % ndim


def _broadcasts_into(small: tuple, big: tuple) -> bool:
    """Whether ``small`` broadcasts to exactly ``big`` (``torch.broadcast_shapes(big, small) == big``),
    by hand: ``torch.broadcast_shapes`` cost more than the rotary kernel at small head counts."""
    if len(small) > len(big):
        return False
    return all(a == 1 or a == b for a, b in zip(reversed(small), reversed(big)))


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1, *, backend: Optional[str] = None):
    """Rotary embedding of q and k, Hugging Face convention (``rotate_half``).

    Args:
        q: ``[B, Hq, S, D]`` (``unsqueeze_dim=1``) or ``[B, S, Hq, D]`` (``unsqueeze_dim=2``);
            any layout where ``cos.unsqueeze(unsqueeze_dim)`` broadcasts against q.
        k: like q, with its own head count (GQA).
        cos: ``[B or 1, S, R]`` with ``R <= D`` even. When ``R < D`` (partial rotary) the
            first R channels rotate and the rest pass through unchanged.
        sin: like cos.
        unsqueeze_dim: where the head dim is inserted into cos / sin.

    Returns ``(q_embed, k_embed)`` in q's and k's dtypes; differentiable in q and k (and in
    cos / sin on the reference backend, which is chosen when they require grad).

    Example::

        q, k = apply_rotary_pos_emb(q, k, cos, sin)  # as in transformers' modeling files
    """
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        _checks.tensor(name, t, ndim_min=1)
    _checks.same_device(("q", "k", "cos", "sin"), (q, k, cos, sin))
    _checks.same_shape(("cos", "sin"), (cos, sin))
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head dim, got {q.shape[-1]} and {k.shape[-1]}")
    rot = cos.shape[-1]
    if rot % 2 or rot == 0 or rot > q.shape[-1]:
        raise ValueError(f"cos.shape[-1] (the rotary dim, {rot}) must be even, positive and at most "
                         f"the head dim {q.shape[-1]}")
    if q.dtype != k.dtype:
        raise TypeError(f"q has dtype {q.dtype} but k has {k.dtype}; they must match")
    ud = _normalize_dim("unsqueeze_dim", unsqueeze_dim, cos.dim() + 1)
    cos_u = cos.shape[:ud] + (1,) + cos.shape[ud:]   # cos.unsqueeze(ud).shape, without making the view
    for name, t in (("q", q), ("k", k)):
        if not _broadcasts_into(cos_u, t.shape[:-1] + (rot,)):   # incompatible, or would enlarge q / k
            raise ValueError(f"cos/sin of shape {tuple(cos.shape)} unsqueezed at {unsqueeze_dim} do not broadcast "
                             f"against {name} of shape {tuple(t.shape)}")
    if torch.compiler.is_compiling():  # one opaque op in the graph; cos / sin are not differentiated there
        return _library.apply_rotary_pos_emb(q, k, cos, sin, ud, backend)
    return _ROPE(q.device, backend, q, k, cos, sin, ud)


def _fast_reason(q, k, cos, sin, unsqueeze_dim) -> Optional[str]:
    """Layouts the cpu and triton kernels take (device and dtype are checked before)."""
    if cos.requires_grad or sin.requires_grad:
        return "cos/sin require grad; only the reference differentiates them"
    if q.dim() != cos.dim() + 1 or k.dim() != cos.dim() + 1:
        return "q/k must have exactly one more dim than cos for the fast paths"
    if unsqueeze_dim == cos.dim():
        return "the head dim (unsqueeze_dim) must not be the last dim for the fast paths"
    for t in (q, k):
        frame = t.shape[:unsqueeze_dim] + t.shape[unsqueeze_dim + 1:-1]
        if any(c != f and c != 1 for c, f in zip(cos.shape[:-1], frame)):
            return "cos/sin broadcast would enlarge q/k; only the reference serves that"
    return None


def _cpu_reason(q, k, cos, sin, unsqueeze_dim):
    return cpu_reason(q) or _fast_reason(q, k, cos, sin, unsqueeze_dim)


def _triton_reason(q, k, cos, sin, unsqueeze_dim):
    return triton_reason(q) or _fast_reason(q, k, cos, sin, unsqueeze_dim)


@_ROPE.register("cpu", verify=_cpu_reason)
def _rope_cpu(q, k, cos, sin, unsqueeze_dim):
    from . import _cpu
    return _cpu.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


@_ROPE.register("triton", verify=_triton_reason)
def _rope_triton(q, k, cos, sin, unsqueeze_dim):
    from . import _triton
    return _triton.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


# The backward kernels for the custom op under torch.compile (_library): the op is linear in q and
# k, so the backward needs cos / sin only; reference and npu have no backward kernel of their own.
for _b in ("cpu", "triton"):
    _ROPE.register_stages(_b, None, _dispatch.lazy(f"{__name__}._{_b}", "apply_rotary_pos_emb_backward"))
del _b

# torch_npu's npu_rotary_mul (twinkle_kernels.npu.ops imports torch_npu on its first call)
_ROPE.register("npu", verify=npu_ops.rope_reason)(npu_ops.apply_rotary_pos_emb)
