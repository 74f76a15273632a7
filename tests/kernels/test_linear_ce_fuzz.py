"""Property test of fused_linear_cross_entropy: the cpu and reference backends against a float64
ground truth written here from the definitions (not the module's reference), on random calls.

Each example draws small shapes (N = 0 and 1 included, V = 1 included), a dtype, a reduction, an
ignore_index and a pattern of ignored labels (none, some, all), label_smoothing, softcap,
temperature, bias, the per-token outputs asked for, chunk_size, and for the cpu backend the
vocabulary block of its bf16 / fp16 path (down to one row per block, so the online softmax merges
every row of the vocabulary). Outputs and the gradients of a random combination of them are
compared with the fp64 truth within the dtype tolerance table. The budget is the hypothesis
profile's (``tests/conftest.py``): a few seconds in ``ci``.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import twinkle_kernels as tk
from twinkle_kernels import testing

from conftest import cpu_backend_available

BACKENDS = ["reference"] + (["cpu"] if cpu_backend_available() else [])
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _truth(h, w, b, y, ignore_index, reduction, eps, cap, temp):
    """loss, logp, entropy in float64 from the definitions (torch's cross entropy with label
    smoothing; mean over the counted labels, NaN when there are none, as torch's 0 / 0)."""
    x = h @ w.T
    if b is not None:
        x = x + b
    z = x / temp
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    lsm = torch.log_softmax(z, dim=-1)
    valid = y != ignore_index
    picked = lsm.gather(1, torch.where(valid, y, 0).unsqueeze(1)).squeeze(1)
    zero = torch.zeros_like(picked)
    per = torch.where(valid, -(1 - eps) * picked - eps * lsm.mean(-1), zero)
    if reduction == "none":
        loss = per
    elif reduction == "sum":
        loss = per.sum()
    else:
        loss = per.sum() / valid.sum()
    logp = torch.where(valid, picked, zero)
    ent = torch.where(valid, -(lsm.exp() * lsm).sum(-1), zero)
    return loss, logp, ent


def _labels(draw, gen, N, V, ignore_index):
    y = torch.randint(0, V, (N,), generator=gen)
    pattern = draw(st.sampled_from(["none", "some", "some", "all"]))
    if pattern == "all":
        y[:] = ignore_index
    elif pattern == "some" and N:
        y[torch.rand(N, generator=gen) < 0.3] = ignore_index
    return y


@pytest.mark.parametrize("backend", BACKENDS)
@FUZZ
@given(data=st.data())
def test_linear_ce_against_fp64_truth(backend, data):
    draw = data.draw
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    N = draw(st.sampled_from([0, 1, 2, 5, 17, 40]))
    H = draw(st.sampled_from([1, 3, 8, 33]))
    V = draw(st.sampled_from([1, 2, 7, 64, 129]))
    reduction = draw(st.sampled_from(["mean", "sum", "none"]))
    ignore_index = draw(st.sampled_from([-100, -1, 0]))
    eps = draw(st.sampled_from([0.0, 0.0, 0.1, 0.6, 1.0]))
    cap = draw(st.sampled_from([None, None, 0.7, 4.0]))
    temp = draw(st.sampled_from([1.0, 1.0, 0.7, 2.0]))
    want_logps, want_ent, with_bias = draw(st.booleans()), draw(st.booleans()), draw(st.booleans())
    chunk = draw(st.one_of(st.none(), st.integers(1, max(N, 1) + 2)))
    vocab_block = draw(st.sampled_from([0, 0, 1, 3, 8, 64]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    h = torch.randn(N, H, generator=gen, dtype=torch.float64).to(dtype)
    w = (torch.randn(V, H, generator=gen, dtype=torch.float64) * 2 / math.sqrt(H)).to(dtype)
    b = (torch.randn(V, generator=gen, dtype=torch.float64) * 0.5).to(dtype) if with_bias else None
    y = _labels(draw, gen, N, V, ignore_index)
    kw = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=eps, logit_softcap=cap,
              temperature=temp)
    n_out = 1 + want_logps + want_ent
    coefs = [torch.randn(N if (i or reduction == "none") else (), generator=gen, dtype=torch.float64)
             for i in range(n_out)]

    # the truth, on the same (rounded) inputs in float64
    leaves = [t.double().requires_grad_(True) if t is not None else None for t in (h, w, b)]
    loss, logp, ent = _truth(*leaves, y, ignore_index, reduction, eps, cap, temp)
    exp_outs = [loss] + ([logp] if want_logps else []) + ([ent] if want_ent else [])
    nan_loss = bool(torch.isnan(loss).any())  # mean over no counted label
    total = sum((o * c).sum() for i, (o, c) in enumerate(zip(exp_outs, coefs)) if not (i == 0 and nan_loss))
    exp_grads = torch.autograd.grad(total, [t for t in leaves if t is not None], allow_unused=True) \
        if torch.is_tensor(total) and total.requires_grad else [None] * sum(t is not None for t in leaves)

    from twinkle_kernels.linear_ce import _cpu
    old = _cpu.ENGINE.vocab_block
    _cpu.ENGINE.vocab_block = vocab_block
    try:
        got_leaves = [t.clone().requires_grad_(True) if t is not None else None for t in (h, w, b)]
        out = tk.fused_linear_cross_entropy(got_leaves[0], got_leaves[1], y, bias=got_leaves[2],
                                            return_logps=want_logps, return_entropy=want_ent, chunk_size=chunk,
                                            backend=backend, **kw)
        outs = list(out) if isinstance(out, tuple) else [out]
        total = sum((o.double() * c).sum() for o, c in zip(outs, coefs))
        params = [t for t in got_leaves if t is not None]
        got_grads = torch.autograd.grad(total, params, allow_unused=True) if total.requires_grad \
            else [None] * len(params)
    finally:
        _cpu.ENGINE.vocab_block = old

    assert len(outs) == n_out
    for i, (g, e) in enumerate(zip(outs, exp_outs)):
        assert g.dtype == torch.float32 and g.shape == e.shape, (i, g.dtype, g.shape, e.shape)
        if i == 0 and nan_loss:
            assert torch.isnan(g).all(), "mean over all-ignored labels: torch's NaN"
            continue
        testing.assert_close(g.detach(), e.detach(), dtype, name=f"output {i}", scale=testing.reduction_scale(H))
    for name, g, e, n, t in zip(("d hidden", "d weight", "d bias"), got_grads, exp_grads, (V, N, N), params):
        assert g is None or g.dtype == dtype
        g = torch.zeros_like(t) if g is None else g
        e = torch.zeros_like(t, dtype=torch.float64) if e is None else e
        # entries that are sums of many rounded products: widen atol by the typical size
        testing.assert_close(g, e, dtype, name=name, scale=testing.reduction_scale(n),
                             atol_scale=testing.rms_atol_scale(e) if dtype != torch.float32 else 1.0)
