"""The mixture-of-experts ops as ``torch.library`` custom ops
(the rules: :mod:`twinkle_kernels._custom_ops`).

``twinkle::grouped_matmul(x [M, K], w [E, K, N], offsets int32 [E], backend) -> [M, N]`` in x's dtype;
``twinkle::moe_experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k],
gate_up_proj [E, 2I, H], down_proj [E, H, I], backend, activation="silu") -> [T, H]`` in hidden_states' dtype.

Both output shapes follow from the input shapes alone (routing changes which rows go where, never
how many), so the fake implementations need no dynamic sizes. The checks on *values* (offsets
non-decreasing and ending at M, expert ids in ``[0, E)``) need the data: under ``torch.compile`` the
public functions check shapes only and these ops check the values when they run, raising the same
ValueError as eager calls.

``grouped_matmul_backward`` calls the selected backend's own backward kernels (dx and dw, two
grouped GEMMs, as eager); ``reference`` and ``npu`` rerun their forward with autograd and take its
vector-Jacobian product. ``moe_experts_backward`` still reruns the selected backend's forward (the
routing, two grouped GEMMs and the activation) with autograd: its fast backends are compositions
of autograd Functions whose intermediates (permuted tokens, the gate/up and expert outputs) the
forward op does not return. That is one more forward of the experts (the forward is matmul bound:
a compiled training step pays ~4/3 of the eager experts' matmul time); the gradients are those of
the backend that ran the forward. Gradients come back contiguous; autograd gives a
transposed weight view (``proj.transpose(1, 2)``) its gradient in the parameter's own layout.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._custom_ops import NS, new_like, op_entry, select, vjp
from ._values import check_expert_ids, check_offset_values


def _contiguous(ts):
    return tuple(t.contiguous() for t in ts)


# -- grouped_matmul ------------------------------------------------------------------------------

@torch.library.custom_op(f"{NS}::grouped_matmul", mutates_args=())
def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, backend: Optional[str]) -> torch.Tensor:
    check_offset_values(offsets, x.shape[0])
    return op_entry("grouped_matmul")(x.device, backend, x, w, offsets).contiguous()


@grouped_matmul.register_fake
def _(x, w, offsets, backend):
    return new_like(x, (x.shape[0], w.shape[2]))


def grouped_matmul_vjp(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                       backend: Optional[str]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) from the selected backend's backward kernels (cpu, triton: dw in w's strides), or
    the vector-Jacobian product of its forward (reference, npu)."""
    op, chosen, stages = select("grouped_matmul", x.device, backend, x, w, offsets)
    if stages is None:
        fn = op.impls[chosen].fn
        return vjp(lambda a, b: fn(a, b, offsets), (x, w), (dy,), (0, 1))
    return tuple(stages.backward(dy, x, w, offsets))


@torch.library.custom_op(f"{NS}::grouped_matmul_backward", mutates_args=())
def grouped_matmul_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                            backend: Optional[str]) -> Tuple[torch.Tensor, torch.Tensor]:
    return _contiguous(grouped_matmul_vjp(dy, x, w, offsets, backend))


@grouped_matmul_backward.register_fake
def _(dy, x, w, offsets, backend):
    return new_like(x), new_like(w)


def _gmm_setup(ctx, inputs, output):
    x, w, offsets, ctx.backend = inputs
    ctx.save_for_backward(x, w, offsets)


def _gmm_bwd(ctx, dy):
    x, w, offsets = ctx.saved_tensors
    dx, dw = grouped_matmul_backward(dy, x, w, offsets, ctx.backend)
    return dx, dw, None, None


grouped_matmul.register_autograd(_gmm_bwd, setup_context=_gmm_setup)


# -- moe_experts ---------------------------------------------------------------------------------

@torch.library.custom_op(f"{NS}::moe_experts", mutates_args=())
def moe_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, backend: Optional[str],
                activation: str = "silu") -> torch.Tensor:
    check_expert_ids(top_k_index, gate_up_proj.shape[0])
    return op_entry("moe_experts")(hidden_states.device, backend, hidden_states, top_k_index, top_k_weights,
                                   gate_up_proj, down_proj, activation).contiguous()


@moe_experts.register_fake
def _(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, backend, activation="silu"):
    return new_like(hidden_states)


@torch.library.custom_op(f"{NS}::moe_experts_backward", mutates_args=())
def moe_experts_backward(dy: torch.Tensor, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                         backend: Optional[str], activation: str = "silu"
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    op = op_entry("moe_experts")

    def f(x, tw, gu, dp):
        return op(x.device, backend, x, top_k_index, tw, gu, dp, activation)
    return _contiguous(vjp(f, (hidden_states, top_k_weights, gate_up_proj, down_proj), (dy,), (0, 1, 2, 3)))


@moe_experts_backward.register_fake
def _(dy, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, backend, activation="silu"):
    return new_like(hidden_states), new_like(top_k_weights), new_like(gate_up_proj), new_like(down_proj)


def _moe_setup(ctx, inputs, output):
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, ctx.backend, ctx.activation = inputs
    ctx.save_for_backward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)


def _moe_bwd(ctx, dy):
    x, idx, tw, gu, dp = ctx.saved_tensors
    dx, dtw, dgu, ddp = moe_experts_backward(dy, x, idx, tw, gu, dp, ctx.backend, ctx.activation)
    return dx, None, dtw, dgu, ddp, None, None


moe_experts.register_autograd(_moe_bwd, setup_context=_moe_setup)

# the public ones (twinkle_kernels.grouped_matmul_backward too: its results are not differentiable)
OPS = ("grouped_matmul", "grouped_matmul_backward", "moe_experts")
