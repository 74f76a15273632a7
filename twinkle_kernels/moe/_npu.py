"""NPU ``grouped_matmul`` and ``moe_experts`` over ``torch_npu.npu_grouped_matmul``.

Written against the torch_npu API reference (PyTorch 2.1+ signature; torch_npu 7.0.0 docs)::

    npu_grouped_matmul(x: List[Tensor], weight: List[Tensor], *, bias=None, ..., group_list=None,
                       split_item=0, group_type=-1, group_list_type=0, ...) -> List[Tensor]

The call used here is the "single x, single y, one weight per group" form:

- ``x = [x]`` with x ``[M, K]``, rows grouped by expert;
- ``weight = [w[0], ..., w[E-1]]``, each ``[K, N]`` (2-D weights in a list work on every
  documented version; the 3-D single-weight form is newer). At most 128 groups (documented);
- ``group_list``: int64 tensor of cumulative end rows (``group_list_type=0``, the same meaning
  as twinkle's ``offsets``); ``group_type=0`` splits the M axis;
- ``split_item=2``: y comes back as one ``[M, N]`` tensor (the list holds one tensor).

torch_npu registers no backward for this call, so :class:`_GroupedMatmulNpu` supplies it:

- ``dx = gmm(dy, w^T)``: the same grouped call with each expert's weight transposed;
- ``dw[e] = x_e^T @ dy_e``: one matmul per expert over its row range (a *per-expert loop*).
  The K-split form (``group_type=2``) would do this in one launch, but its availability and
  argument form differ across CANN releases; the loop is correct on every release and costs
  E small launches. Experts with no rows get a zero gradient.

Token permutation: ``torch_npu.npu_moe_token_permute`` / ``npu_moe_token_unpermute`` when the
installed torch_npu has them (checked with ``hasattr`` at call time, since older CANN releases
lack them), else twinkle's generic routing (:mod:`twinkle_kernels.moe.routing`).

Nothing here has run on Ascend hardware; tests/npu/ checks the argument marshalling against an
emulation of the documented semantics, and holds the smoke tests for a real NPU.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..npu import ops as _ops
from .. import _activations

MAX_GROUPS = 128  # npu_grouped_matmul's documented TensorList limit


def _gmm_call(x: torch.Tensor, weights, group_list: torch.Tensor) -> torch.Tensor:
    """One ``npu_grouped_matmul`` call: x ``[M, K]``, weights E x ``[K, N]`` -> ``[M, N]``."""
    return _ops.torch_npu_module().npu_grouped_matmul([x], list(weights), group_list=group_list, split_item=2,
                                                      group_type=0, group_list_type=0)[0]


class _GroupedMatmulNpu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets):
        group_list = offsets.to(torch.int64)
        y = _gmm_call(x.contiguous(), [w[e].contiguous() for e in range(w.shape[0])], group_list)
        ctx.save_for_backward(x, w, group_list)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, group_list = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _gmm_call(dy, [w[e].t().contiguous() for e in range(w.shape[0])], group_list)
        if ctx.needs_input_grad[1]:
            dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            start = 0
            for e, end in enumerate(group_list.tolist()):  # host bounds: one sync per backward
                if end > start:
                    dw[e] = x[start:end].t().float() @ dy[start:end].float()
                start = end
            dw = dw.to(w.dtype)
            if w.stride() != dw.stride():  # hand the gradient back in w's layout (e.g. a transposed view)
                dw = torch.empty_strided(w.shape, w.stride(), dtype=w.dtype, device=w.device).copy_(dw)
        return dx, dw, None


def grouped_matmul(x, w, offsets):
    """x ``[M, K]``, w ``[E, K, N]`` (any strides), offsets int32 ``[E]`` cumulative -> ``[M, N]``."""
    return _GroupedMatmulNpu.apply(x, w, offsets)


def gmm_reason(x, w, offsets) -> Optional[str]:
    why = _ops.tensor_reason(x)
    if why is None and w.shape[0] > MAX_GROUPS:
        why = f"npu_grouped_matmul takes at most {MAX_GROUPS} groups (got E = {w.shape[0]})"
    return why


# -- moe_experts --------------------------------------------------------------------------------

def has_fused_permute(npu=None) -> bool:
    """Whether the installed torch_npu has the fused token permute / unpermute (newer CANN)."""
    npu = npu if npu is not None else _ops.torch_npu_module()
    return hasattr(npu, "npu_moe_token_permute") and hasattr(npu, "npu_moe_token_unpermute")


def moe_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation="silu"):
    """Hugging Face experts semantics (see :func:`twinkle_kernels.moe_experts`) on the NPU. The
    activation between the two grouped matmuls is plain torch, so every ``activation`` runs here."""
    num_experts = gate_up_proj.shape[0]
    idx = top_k_index.to(torch.int64)
    counts = torch.bincount(idx.reshape(-1), minlength=num_experts)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    npu = _ops.torch_npu_module()
    if has_fused_permute(npu):
        # documented: rows come grouped by ascending expert id; sorted_indices[t*k + j] is the
        # permuted row of (token t, slot j), which unpermute reads back.
        xp, sorted_indices = npu.npu_moe_token_permute(hidden_states, idx)
        plan = None
    else:
        from .routing import make_routing_plan, permute_tokens
        plan = make_routing_plan(idx, num_experts)
        xp = permute_tokens(hidden_states, plan)
    h = grouped_matmul(xp, gate_up_proj.transpose(1, 2), offsets)
    gate, up = h.chunk(2, dim=-1)
    a = _activations.apply(gate, activation) * up
    yp = grouped_matmul(a, down_proj.transpose(1, 2), offsets)
    if plan is None:
        return npu.npu_moe_token_unpermute(yp, sorted_indices, probs=top_k_weights.to(yp.dtype))
    from .routing import unpermute_tokens
    return unpermute_tokens(yp, top_k_weights, plan)


def moe_reason(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation="silu") -> Optional[str]:
    why = _ops.tensor_reason(hidden_states)
    if why is None and gate_up_proj.shape[0] > MAX_GROUPS:
        why = f"npu_grouped_matmul takes at most {MAX_GROUPS} groups (got E = {gate_up_proj.shape[0]})"
    return why
