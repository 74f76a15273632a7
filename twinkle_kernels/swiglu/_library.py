"""The gated linear units (split and packed) as ``torch.library`` custom ops
(the rules: :mod:`twinkle_kernels._custom_ops`).

The backward ops need the inputs only. Shapes and dtypes: as the public functions (``swiglu``:
gate, up same shape; ``swiglu_packed``: ``[..., 2n]`` -> ``[..., n]``); ``activation`` is one of
:data:`twinkle_kernels._activations.ACTIVATIONS` (checked by the public functions), last with its default so
the ops keep their earlier call form.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._custom_ops import NS, new_like, op_entry, select, vjp

# -- swiglu ------------------------------------------------------------------------------------

@torch.library.custom_op(f"{NS}::swiglu", mutates_args=())
def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: Optional[str], activation: str = "silu") -> torch.Tensor:
    return op_entry("swiglu")(gate.device, backend, gate, up, activation).contiguous()


@swiglu.register_fake
def _(gate, up, backend, activation="silu"):
    return new_like(gate)


@torch.library.custom_op(f"{NS}::swiglu_backward", mutates_args=())
def swiglu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                    backend: Optional[str], activation: str = "silu") -> Tuple[torch.Tensor, torch.Tensor]:
    op, chosen, stages = select("swiglu", gate.device, backend, gate, up, activation)
    if stages is None:
        fn = op.impls[chosen].fn
        return vjp(lambda g, u: fn(g, u, activation), (gate, up), (dy,), (0, 1))
    dg, du = stages.backward(dy, gate, up, activation)
    return dg.contiguous(), du.contiguous()


@swiglu_backward.register_fake
def _(dy, gate, up, backend, activation="silu"):
    return new_like(gate), new_like(up)


def _swiglu_setup(ctx, inputs, output):
    gate, up, ctx.backend, ctx.activation = inputs
    ctx.save_for_backward(gate, up)


def _swiglu_bwd(ctx, dy):
    gate, up = ctx.saved_tensors
    return (*swiglu_backward(dy, gate, up, ctx.backend, ctx.activation), None, None)


swiglu.register_autograd(_swiglu_bwd, setup_context=_swiglu_setup)


@torch.library.custom_op(f"{NS}::swiglu_packed", mutates_args=())
def swiglu_packed(x: torch.Tensor, backend: Optional[str], activation: str = "silu") -> torch.Tensor:
    return op_entry("swiglu_packed")(x.device, backend, x, activation).contiguous()


@swiglu_packed.register_fake
def _(x, backend, activation="silu"):
    return new_like(x, (*x.shape[:-1], x.shape[-1] // 2))


@torch.library.custom_op(f"{NS}::swiglu_packed_backward", mutates_args=())
def swiglu_packed_backward(dy: torch.Tensor, x: torch.Tensor, backend: Optional[str],
                           activation: str = "silu") -> torch.Tensor:
    op, chosen, stages = select("swiglu_packed", x.device, backend, x, activation)
    if stages is None:
        fn = op.impls[chosen].fn
        return vjp(lambda t: fn(t, activation), (x,), (dy,), (0,))[0]
    return stages.backward(dy, x, activation).contiguous()


@swiglu_packed_backward.register_fake
def _(dy, x, backend, activation="silu"):
    return new_like(x)


def _packed_setup(ctx, inputs, output):
    x, ctx.backend, ctx.activation = inputs
    ctx.save_for_backward(x)


def _packed_bwd(ctx, dy):
    (x,) = ctx.saved_tensors
    return swiglu_packed_backward(dy, x, ctx.backend, ctx.activation), None, None


swiglu_packed.register_autograd(_packed_bwd, setup_context=_packed_setup)

OPS = ("swiglu", "swiglu_packed")
