"""The rotary position embedding as ``torch.library`` custom ops
(the rules: :mod:`twinkle_kernels._custom_ops`).

The op is linear in q and k, so its backward op takes only cos / sin. Shapes and dtypes: as the
public function (``apply_rotary_pos_emb``: (q, k) -> same shapes, in q's and k's dtypes).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._custom_ops import NS, new_like, op_entry, select, vjp

# -- apply_rotary_pos_emb ------------------------------------------------------------------------

@torch.library.custom_op(f"{NS}::apply_rotary_pos_emb", mutates_args=())
def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int,
                         backend: Optional[str]) -> Tuple[torch.Tensor, torch.Tensor]:
    qo, ko = op_entry("apply_rotary_pos_emb")(q.device, backend, q, k, cos, sin, unsqueeze_dim)
    return qo.contiguous(), ko.contiguous()


@apply_rotary_pos_emb.register_fake
def _(q, k, cos, sin, unsqueeze_dim, backend):
    return new_like(q), new_like(k)  # in q's and k's dtypes, whatever cos / sin hold


@torch.library.custom_op(f"{NS}::apply_rotary_pos_emb_backward", mutates_args=())
def apply_rotary_pos_emb_backward(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                  unsqueeze_dim: int, backend: Optional[str]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The op is linear in q and k: its vector-Jacobian product does not depend on them, so the
    backward takes cos / sin only (dq / dk stand in for q / k in the selection and the rerun)."""
    op, chosen, stages = select("apply_rotary_pos_emb", dq.device, backend, dq, dk, cos, sin, unsqueeze_dim)
    if stages is None:
        fn = op.impls[chosen].fn
        return vjp(lambda a, b: fn(a, b, cos, sin, unsqueeze_dim), (dq, dk), (dq, dk), (0, 1))
    gq, gk = stages.backward(dq, dk, cos, sin, unsqueeze_dim)
    return gq.contiguous(), gk.contiguous()


@apply_rotary_pos_emb_backward.register_fake
def _(dq, dk, cos, sin, unsqueeze_dim, backend):
    return new_like(dq), new_like(dk)


def _rope_setup(ctx, inputs, output):
    _, _, cos, sin, ctx.unsqueeze_dim, ctx.backend = inputs
    ctx.save_for_backward(cos, sin)


def _rope_bwd(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    # cos / sin are not differentiated, as in the cpu and triton backends (transformers computes
    # them from buffers under no_grad)
    gq, gk = apply_rotary_pos_emb_backward(dq, dk, cos, sin, ctx.unsqueeze_dim, ctx.backend)
    return gq, gk, None, None, None, None


apply_rotary_pos_emb.register_autograd(_rope_bwd, setup_context=_rope_setup)

OPS = ("apply_rotary_pos_emb",)
