"""The Gated DeltaNet ops as ``torch.library`` custom ops
(the rules: :mod:`twinkle_kernels._custom_ops`).

Custom ops return tensors, never None, so the optional outputs and gradients are shape-static
stand-ins that the public functions turn back into None:

- ``twinkle::chunk_gated_delta_rule`` / ``twinkle::fused_recurrent_gated_delta_rule`` return
  ``(o [B, T, HV, V] in v's dtype, final_state)``; ``final_state`` is ``[N, HV, K, V]`` (fp32, float64
  for float64 inputs) with ``output_final_state`` and an empty ``[0]`` tensor without it.
  ``N = B``, or ``cu_seqlens.shape[0] - 1`` when packed: a shape, not a value, so no dynamic size.
- their backward ops return ``(dq, dk, dv, dg, dbeta, d_initial_state)``, the last one empty when
  there is no initial state; ``causal_conv1d_backward`` returns an empty ``dbias`` without a bias.
- ``twinkle::causal_conv1d_update`` **mutates** ``conv_state`` (declared in ``mutates_args``) and
  returns a new tensor. It is forward only (decoding); torch.library has no autograd for
  mutating ops, so a compiled call that needs gradients traces the pure-torch reference instead.

The value checks of ``cu_seqlens`` (start at 0, non-decreasing, end at T) read the data: under
``torch.compile`` the public functions check its dtype and shape only and the op checks the values
when it runs, with the same ValueError as eager.

``causal_conv1d_backward`` calls the selected backend's own backward kernels (cpu, triton; the
conv saves only its inputs). The delta rule's backward ops rerun the selected backend's forward
with autograd (one more forward) and take its vector-Jacobian product. Not yet stat-based: their
backward kernels need the forward's per-chunk states, ``sum(ceil(length / chunk_size))`` of them (a
count that depends on cu_seqlens' values: a fixed-shape output would have to be padded to
``ceil(T / chunk_size) + N``), the backends' Python wrappers differentiate the qk-l2norm and the
dtype casts around the kernels with autograd, which the backward op would have to replay, and the cpu
backend computes a call with non-finite inputs or results by the recurrence instead (a choice made
from values, which the backward would have to learn from the forward). The recurrent form's fast backends are forward only: its backward op
always recomputes on the reference (an eager call with gradients runs the reference throughout;
under compile the forward may run on a fast backend, since the op's forward never records a graph).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._custom_ops import NS, autograd_inside, new_like, op_entry, select
from . import _args

_NONE = (0,)  # the shape of the stand-in for an absent tensor


def _empty(t: torch.Tensor, dtype=None) -> torch.Tensor:
    return t.new_empty(_NONE, dtype=dtype or t.dtype)


def _state_dtype(v: torch.Tensor) -> torch.dtype:
    return torch.float64 if v.dtype == torch.float64 else torch.float32


def _num_seqs(q: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _check_cu(cu_seqlens, q) -> None:
    if cu_seqlens is not None:
        _args.cu_seqlens(cu_seqlens, q.shape[0], q.shape[1], q.device)


def _grads(fn, inputs, grads, wrt):
    """Like ``_custom_ops.vjp`` but ``inputs`` may hold None (absent optional tensors): their
    gradient is an empty stand-in; outputs whose incoming gradient is None or empty are skipped."""
    with autograd_inside(), torch.enable_grad():
        xs = [None if t is None else t.detach().requires_grad_(i in wrt) for i, t in enumerate(inputs)]
        outs = fn(*xs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grads) if o is not None and g is not None and g.numel()]
        live = [i for i in wrt if xs[i] is not None]
        got = torch.autograd.grad([o for o, _ in pairs], [xs[i] for i in live], [g for _, g in pairs],
                                  allow_unused=True) if pairs and live else [None] * len(live)
    by_index = dict(zip(live, got))
    res = []
    for i in wrt:
        t = inputs[i]
        if t is None:
            res.append(_empty(inputs[0]))
        else:
            g = by_index[i]
            res.append(torch.zeros_like(t) if g is None else g.contiguous())
    return tuple(res)


# -- the gated delta rule, chunked and recurrent ----------------------------------------------------

def _gdr_forward(name, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                 cu_seqlens, chunk_size, backend):
    _check_cu(cu_seqlens, q)
    o, s = op_entry(name)(q.device, backend, q, k, v, g, beta, scale, initial_state, output_final_state,
                          use_qk_l2norm_in_kernel, cu_seqlens, chunk_size)
    return o.contiguous(), (s.contiguous() if output_final_state else _empty(q, _state_dtype(v)))


def _gdr_fake(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens):
    o = new_like(v)
    if not output_final_state:
        return o, _empty(q, _state_dtype(v))
    return o, q.new_empty((_num_seqs(q, cu_seqlens), v.shape[2], q.shape[3], v.shape[3]), dtype=_state_dtype(v))


def _gdr_backward(name, do, ds, q, k, v, g, beta, scale, initial_state, output_final_state,
                  use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, backend):
    op = op_entry(name)

    def f(q_, k_, v_, g_, b_, h0):
        return op(q_.device, backend, q_, k_, v_, g_, b_, scale, h0, output_final_state, use_qk_l2norm_in_kernel,
                  cu_seqlens, chunk_size)
    return _grads(f, (q, k, v, g, beta, initial_state), (do, ds if output_final_state else None),
                  (0, 1, 2, 3, 4, 5))


def _gdr_backward_fake(q, k, v, g, beta, initial_state):
    return (new_like(q), new_like(k), new_like(v), new_like(g), new_like(beta),
            new_like(initial_state) if initial_state is not None else _empty(q))


def _gdr_setup(ctx, inputs, output):
    q, k, v, g, beta, ctx.scale, initial_state, ctx.output_final_state, ctx.l2, cu, ctx.chunk_size, ctx.backend = \
        inputs
    ctx.has_h0, ctx.has_cu = initial_state is not None, cu is not None
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu)


def _saved(ctx, do, ds):
    q, k, v, g, beta, h0, cu = ctx.saved_tensors
    # an output nobody used may come back as None: the backward ops take tensors
    do = torch.zeros_like(v) if do is None else do
    ds = _empty(q) if ds is None else ds
    return do, ds, q, k, v, g, beta, (h0 if ctx.has_h0 else None), (cu if ctx.has_cu else None)


@torch.library.custom_op(f"{NS}::chunk_gated_delta_rule", mutates_args=())
def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: float, initial_state: Optional[torch.Tensor], output_final_state: bool,
                           use_qk_l2norm_in_kernel: bool, cu_seqlens: Optional[torch.Tensor], chunk_size: int,
                           backend: Optional[str]) -> Tuple[torch.Tensor, torch.Tensor]:
    return _gdr_forward("chunk_gated_delta_rule", q, k, v, g, beta, scale, initial_state, output_final_state,
                        use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, backend)


@chunk_gated_delta_rule.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, chunk_size,
      backend):
    return _gdr_fake(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens)


@torch.library.custom_op(f"{NS}::chunk_gated_delta_rule_backward", mutates_args=())
def chunk_gated_delta_rule_backward(
        do: torch.Tensor, ds: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
        beta: torch.Tensor, scale: float, initial_state: Optional[torch.Tensor], output_final_state: bool,
        use_qk_l2norm_in_kernel: bool, cu_seqlens: Optional[torch.Tensor], chunk_size: int, backend: Optional[str]
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _gdr_backward("chunk_gated_delta_rule", do, ds, q, k, v, g, beta, scale, initial_state,
                         output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, backend)


@chunk_gated_delta_rule_backward.register_fake
def _(do, ds, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
      chunk_size, backend):
    return _gdr_backward_fake(q, k, v, g, beta, initial_state)


def _chunk_bwd(ctx, do, ds):
    do, ds, q, k, v, g, beta, h0, cu = _saved(ctx, do, ds)
    *grads, dh0 = chunk_gated_delta_rule_backward(do, ds, q, k, v, g, beta, ctx.scale, h0, ctx.output_final_state,
                                                  ctx.l2, cu, ctx.chunk_size, ctx.backend)
    return (*grads, None, dh0 if ctx.has_h0 else None, None, None, None, None, None)


chunk_gated_delta_rule.register_autograd(_chunk_bwd, setup_context=_gdr_setup)


@torch.library.custom_op(f"{NS}::fused_recurrent_gated_delta_rule", mutates_args=())
def fused_recurrent_gated_delta_rule(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
        initial_state: Optional[torch.Tensor], output_final_state: bool, use_qk_l2norm_in_kernel: bool,
        cu_seqlens: Optional[torch.Tensor], backend: Optional[str]) -> Tuple[torch.Tensor, torch.Tensor]:
    return _gdr_forward("fused_recurrent_gated_delta_rule", q, k, v, g, beta, scale, initial_state,
                        output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, None, backend)


@fused_recurrent_gated_delta_rule.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, backend):
    return _gdr_fake(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens)


@torch.library.custom_op(f"{NS}::fused_recurrent_gated_delta_rule_backward", mutates_args=())
def fused_recurrent_gated_delta_rule_backward(
        do: torch.Tensor, ds: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
        beta: torch.Tensor, scale: float, initial_state: Optional[torch.Tensor], output_final_state: bool,
        use_qk_l2norm_in_kernel: bool, cu_seqlens: Optional[torch.Tensor], backend: Optional[str]
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # the fast backends of the recurrent form are forward only: its gradients are the reference's,
    # whichever backend ran the forward (an eager call with gradients runs the reference throughout)
    return _gdr_backward("fused_recurrent_gated_delta_rule", do, ds, q, k, v, g, beta, scale, initial_state,
                         output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, None, "reference")


@fused_recurrent_gated_delta_rule_backward.register_fake
def _(do, ds, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
      backend):
    return _gdr_backward_fake(q, k, v, g, beta, initial_state)


def _recur_setup(ctx, inputs, output):
    _gdr_setup(ctx, (*inputs[:10], None, inputs[10]), output)


def _recur_bwd(ctx, do, ds):
    do, ds, q, k, v, g, beta, h0, cu = _saved(ctx, do, ds)
    *grads, dh0 = fused_recurrent_gated_delta_rule_backward(do, ds, q, k, v, g, beta, ctx.scale, h0,
                                                            ctx.output_final_state, ctx.l2, cu, ctx.backend)
    return (*grads, None, dh0 if ctx.has_h0 else None, None, None, None, None)


fused_recurrent_gated_delta_rule.register_autograd(_recur_bwd, setup_context=_recur_setup)


# -- causal conv1d ----------------------------------------------------------------------------------

@torch.library.custom_op(f"{NS}::causal_conv1d", mutates_args=())
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], activation: Optional[str],
                  cu_seqlens: Optional[torch.Tensor], backend: Optional[str]) -> torch.Tensor:
    if cu_seqlens is not None:
        _args.cu_seqlens(cu_seqlens, x.shape[0], x.shape[2], x.device)
    return op_entry("causal_conv1d")(x.device, backend, x, weight, bias, activation, cu_seqlens).contiguous()


@causal_conv1d.register_fake
def _(x, weight, bias, activation, cu_seqlens, backend):
    return new_like(x)


@torch.library.custom_op(f"{NS}::causal_conv1d_backward", mutates_args=())
def causal_conv1d_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           activation: Optional[str], cu_seqlens: Optional[torch.Tensor], backend: Optional[str]
                           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    op, chosen, stages = select("causal_conv1d", x.device, backend, x, weight, bias, activation, cu_seqlens)
    if stages is None:
        fn = op.impls[chosen].fn
        return _grads(lambda a, w, b: fn(a, w, b, activation, cu_seqlens), (x, weight, bias), (dy,), (0, 1, 2))
    dx, dw, db = stages.backward(dy, x, weight, bias, activation, cu_seqlens)
    return dx.contiguous(), dw.contiguous(), (_empty(x) if db is None else db.contiguous())


@causal_conv1d_backward.register_fake
def _(dy, x, weight, bias, activation, cu_seqlens, backend):
    return new_like(x), new_like(weight), (new_like(bias) if bias is not None else _empty(x))


def _conv_setup(ctx, inputs, output):
    x, weight, bias, ctx.activation, cu, ctx.backend = inputs
    ctx.has_bias, ctx.has_cu = bias is not None, cu is not None
    ctx.save_for_backward(x, weight, bias, cu)


def _conv_bwd(ctx, dy):
    x, weight, bias, cu = ctx.saved_tensors
    dx, dw, db = causal_conv1d_backward(dy, x, weight, bias if ctx.has_bias else None, ctx.activation,
                                        cu if ctx.has_cu else None, ctx.backend)
    return dx, dw, (db if ctx.has_bias else None), None, None, None


causal_conv1d.register_autograd(_conv_bwd, setup_context=_conv_setup)


@torch.library.custom_op(f"{NS}::causal_conv1d_update", mutates_args=("conv_state",))
def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: Optional[torch.Tensor], activation: Optional[str],
                         backend: Optional[str]) -> torch.Tensor:
    y = op_entry("causal_conv1d_update")(x.device, backend, x, conv_state, weight, bias, activation)
    return y.contiguous()


@causal_conv1d_update.register_fake
def _(x, conv_state, weight, bias, activation, backend):
    return new_like(x)


OPS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d", "causal_conv1d_update")
