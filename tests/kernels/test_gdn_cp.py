"""Context-parallel Gated DeltaNet ops (twinkle_kernels.gdn.cp) against the unsplit ops.

Ranks are simulated by threads in this process (cp.simulate; one rank computes at a time), and
once for real: two gloo processes (this file run as a script is the worker). Equality is checked
in float64 on the reference to 1e-10 (forward, final states and every gradient), and in fp32 on the
cpu and triton backends (which serve fp32, not float64) against the same backend's unsplit op.
"""
import json
import os
import random
import sys

import pytest
import torch
import torch.nn.functional as F

import twinkle_kernels as tk
from twinkle_kernels.gdn import cp

TOL64 = 1e-10


def _backends():
    from conftest import available_backends
    return available_backends()


def _inputs(T, H, HV, K, V, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.randn(1, T, H, K, generator=gen, dtype=torch.float64)
    v = torch.randn(1, T, HV, V, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(1, T, HV, generator=gen, dtype=torch.float64) + 2)
    beta = torch.rand(1, T, HV, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, g, beta)]


def _local_index(segs_r):
    return torch.cat([torch.arange(a, a + n) for a, n in segs_r] + [torch.zeros(0, dtype=torch.long)])


def _first_seq(cu, pos):
    """The non-empty sequence starting at pos, or None."""
    starts = [n for n in range(len(cu) - 1) if cu[n] == pos and cu[n + 1] > pos]
    return starts[0] if starts else None


def gdn_errors(world, cu, segs, *, backend="reference", dtype=torch.float64, H=1, HV=2, K=5, V=3, l2=True,
               chunk_size=16, seed=0):
    """Max abs differences (o, final states, every gradient) between the CP op on ``world``
    simulated ranks and the unsplit op, with initial states for every rank whose first token
    starts a sequence; also returns the reference's max abs values for relative tolerances."""
    T, N = cu[-1], len(cu) - 1
    cut = torch.tensor(cu)
    xs = _inputs(T, H, HV, K, V, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    h0 = torch.zeros(N, HV, K, V, dtype=dtype)
    inits = {}
    for r in range(world):
        n = _first_seq(cu, segs[r][0][0]) if segs[r] and segs[r][0][1] else None
        if n is not None:
            inits[r] = torch.randn(1, HV, K, V, generator=gen, dtype=torch.float64).to(dtype)
            h0[n] = inits[r][0]
    do = torch.randn(1, T, HV, V, generator=gen, dtype=torch.float64).to(dtype)
    dfin = torch.randn(N, HV, K, V, generator=gen, dtype=torch.float64).to(torch.float64 if dtype == torch.float64
                                                                          else torch.float32)
    leaves = [x.clone().requires_grad_() for x in xs] + [h0.clone().requires_grad_()]
    o, fin = tk.chunk_gated_delta_rule(*leaves[:5], None, leaves[5], True, l2, cut, chunk_size=chunk_size,
                                       backend=backend)
    ref = torch.autograd.grad((o * do).sum() + (fin * dfin).sum(), leaves)

    def rank(r, comm):
        idx = _local_index(segs[r])
        loc = [x[:, idx].clone().requires_grad_() for x in xs]
        init = inits[r].clone().requires_grad_() if r in inits else None
        o_r, f_r = cp.chunk_gated_delta_rule_cp(*loc, None, init, True, l2, cu_seqlens=cut, segments=segs,
                                                group=comm, chunk_size=chunk_size, backend=backend)
        ends = cp.plan(cut, segs, r, world).ends
        wrt = loc + ([init] if init is not None else [])
        gs = torch.autograd.grad((o_r * do[:, idx]).sum() + (f_r * dfin[ends]).sum(), wrt)
        return idx, o_r.detach(), f_r.detach(), ends, gs, comm.bytes_sent

    res = cp.simulate(world, rank)
    err = {k: 0.0 for k in ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dinit")}
    seen_ends, covered = [], torch.zeros(T, dtype=torch.bool)
    for r, (idx, o_r, f_r, ends, gs, _) in enumerate(res):
        covered[idx] = True
        seen_ends += ends
        if len(idx):
            err["o"] = max(err["o"], (o_r - o[:, idx]).abs().max().item())
            for name, gr, rg in zip(("dq", "dk", "dv", "dg", "dbeta"), gs, ref):
                err[name] = max(err[name], (gr - rg[:, idx]).abs().max().item())
        if ends:
            err["final"] = max(err["final"], (f_r - fin[ends]).abs().max().item())
        if r in inits:
            n = _first_seq(cu, segs[r][0][0])
            err["dinit"] = max(err["dinit"], (gs[5][0] - ref[5][n]).abs().max().item())
    assert covered.all() and sorted(seen_ends) == list(range(N)), "every token and every final state once"
    scale = max([o.abs().max().item(), fin.abs().max().item()] + [g.abs().max().item() for g in ref])
    return err, scale, res


def random_packing(T, segs, rng):
    """Offsets with empty and length-1 sequences, boundaries on some segment edges and one off
    them by a token, and long sequences crossing several segments."""
    edges = sorted({a for r in segs for a, n in r if 0 < a < T})
    cuts = []
    for e in edges:
        roll = rng.random()
        if roll < 0.25:
            cuts.append(e)                     # a sequence starts exactly at a segment start
        elif roll < 0.5:
            cuts += [e, e]                     # ... after an empty sequence
        elif roll < 0.7:
            cuts.append(min(T, e + rng.choice((-1, 1))))
    p = rng.randrange(1, T - 1)
    cuts += [p, p + 1]                         # a length-1 sequence
    cuts += [rng.randrange(0, T + 1) for _ in range(2)]
    return [0] + sorted(cuts) + [T] + ([T] if rng.random() < 0.5 else [])


# -- the fold ------------------------------------------------------------------------------------------

def test_fold_hand_made():
    # one value head, K = 2, V = 1; segment 0 starts the sequence, 1 and 2 pass it through, 3 ends it
    I = torch.eye(2, dtype=torch.float64)[None]
    M = [None, 2 * I, torch.tensor([[[0.0, 1.0], [1.0, 0.0]]], dtype=torch.float64), None]
    S = [torch.tensor([[[1.0], [2.0]]], dtype=torch.float64), torch.tensor([[[10.0], [0.0]]], dtype=torch.float64),
         torch.tensor([[[0.0], [100.0]]], dtype=torch.float64), None]
    s_in = cp.fold_states(M, S, [None, 0, 1, 2])
    assert s_in[0] is None
    assert s_in[1].flatten().tolist() == [1.0, 2.0]
    assert s_in[2].flatten().tolist() == [12.0, 4.0]            # 2 * [1, 2] + [10, 0]
    assert s_in[3].flatten().tolist() == [4.0, 112.0]           # swap([12, 4]) + [0, 100]
    # backward: dS_in[j] = A[j] + M[j]^T dS_out[j], dS_out[prev[j]] = dS_in[j]
    A = [None, torch.tensor([[[1.0], [0.0]]], dtype=torch.float64), torch.tensor([[[0.0], [1.0]]], dtype=torch.float64),
         torch.tensor([[[5.0], [7.0]]], dtype=torch.float64)]
    d_out = cp.fold_state_grads(M, A, [None, 0, 1, 2])
    assert d_out[3] is None
    assert d_out[2].flatten().tolist() == [5.0, 7.0]
    assert d_out[1].flatten().tolist() == [7.0, 6.0]             # [0, 1] + swap^T [5, 7]
    assert d_out[0].flatten().tolist() == [15.0, 12.0]           # [1, 0] + 2 [7, 6]
    # two chains side by side: nothing flows between them
    s_in = cp.fold_states([None, None], S[:2], [None, None])
    assert s_in == [None, None]


def test_fold_matches_autograd():
    gen = torch.Generator().manual_seed(3)
    M = [None] + [torch.randn(2, 3, 3, generator=gen, dtype=torch.float64) for _ in range(3)]
    S = [torch.randn(2, 3, 4, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(4)]
    prev = [None, 0, 1, 2]
    s_in = cp.fold_states(M, S, prev)
    A = [None] + [torch.randn(2, 3, 4, generator=gen, dtype=torch.float64) for _ in range(3)]
    # the loss sum_j <A[j], S_in[j]> as seen by the segments: its gradient in S_ext[j] is dS_out[j]
    loss = sum((a * s).sum() for a, s in zip(A[1:], s_in[1:]))
    want = torch.autograd.grad(loss, S[:3])
    got = cp.fold_state_grads(M, A, prev)
    for w, g_ in zip(want, got[:3]):
        assert (w - g_).abs().max().item() < 1e-12


# -- the delta rule, simulated ranks ---------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3, 4])
def test_long_sequence_float64(world):
    """One sequence over every rank: the middle ranks' segments are passed through; the first
    sequence takes initial_state, its final state comes back on rank 0 (it holds the last chunk)."""
    T = 4 * world * 2
    err, scale, _ = gdn_errors(world, [0, T], cp.zigzag_segments(T, world), K=4, V=3)
    assert max(err.values()) < TOL64 * max(1.0, scale), err


@pytest.mark.parametrize("world", [2, 3, 4])
def test_random_packings_float64(world):
    rng = random.Random(world)
    for trial in range(3):
        T = 2 * world * rng.choice((3, 5))
        segs = cp.zigzag_segments(T, world) if trial < 2 else _ragged_segments(T, world, rng)
        cu = random_packing(T, segs, rng)
        err, scale, _ = gdn_errors(world, cu, segs, seed=trial, l2=trial != 1, H=1 if trial else 2,
                                   HV=2 if trial else 4)
        assert max(err.values()) < TOL64 * max(1.0, scale), (cu, segs, err)


def _ragged_segments(T, world, rng):
    """Unequal pieces, two or three per rank, in shuffled ownership (rank order not stream order)."""
    cuts = sorted(rng.sample(range(1, T), 2 * world + world // 2))
    pieces = list(zip([0] + cuts, cuts + [T]))
    owners = [r for r in range(world) for _ in range(2)]
    owners += [rng.randrange(world) for _ in range(len(pieces) - 2 * world)]
    rng.shuffle(owners)
    segs = [[] for _ in range(world)]
    for (a, b), r in zip(pieces, owners):
        segs[r].append((a, b - a))
    return segs


def test_k256_and_gva_float64():
    T = 12
    err, scale, _ = gdn_errors(2, [0, 3, 12], cp.zigzag_segments(T, 2), H=1, HV=2, K=256, V=2, chunk_size=16)
    assert max(err.values()) < TOL64 * max(1.0, scale), err


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_fast_backends_fp32(backend):
    if backend not in _backends():
        pytest.skip(f"{backend} backend unavailable here")
    if backend == "cpu":
        cases = [(2, [0, 64], cp.zigzag_segments(64, 2), dict(K=32, V=16, chunk_size=16)),
                 (3, [0, 1, 9, 9, 20, 31, 48], cp.zigzag_segments(48, 3), dict(H=2, HV=4, K=16, V=8, chunk_size=16))]
    else:   # the Triton interpreter on CPU: small
        cases = [(2, [0, 5, 32], cp.zigzag_segments(32, 2), dict(K=16, V=16, chunk_size=16))]
    for world, cu, segs, kw in cases:
        err, scale, _ = gdn_errors(world, cu, segs, backend=backend, dtype=torch.float32, **kw)
        assert max(err.values()) < 2e-6 * max(1.0, scale), (backend, cu, err)


def test_bytes_sent_match_formula():
    """Zigzag CP2 over one sequence: rank 0 sends S_ext of chunk 0, rank 1 [M | S_ext] of chunks
    1-2 (merged: they are adjacent); both pad to rank 1's payload; backward sends dS_in [HV, K, V]."""
    HV, K, V, T = 2, 5, 3, 16
    _, _, res = gdn_errors(2, [0, T], cp.zigzag_segments(T, 2), HV=HV, K=K, V=V)
    fwd = HV * K * (K + V) * 8
    bwd = HV * K * V * 8
    for r in range(2):
        assert res[r][5] == fwd + bwd   # (world - 1) * payload, float64


# -- the causal conv1d -----------------------------------------------------------------------------------

def conv_errors(world, cu, segs, *, W=4, D=5, backend="reference", dtype=torch.float64, bias=True):
    T = cu[-1]
    cut = torch.tensor(cu)
    gen = torch.Generator().manual_seed(7)
    x, w, b, dy = (torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)
                   for s in ((1, D, T), (D, W), (D,), (1, D, T)))
    b = b if bias else None
    ins = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
    y = tk.causal_conv1d(ins[0], ins[1], ins[2] if bias else None, "silu", cut, backend=backend)
    ref = torch.autograd.grad((y * dy).sum(), ins)

    def rank(r, comm):
        idx = _local_index(segs[r])
        loc = [x[:, :, idx].clone().requires_grad_()] + [t.clone().requires_grad_() for t in (w, b) if t is not None]
        y_r = cp.causal_conv1d_cp(loc[0], loc[1], loc[2] if bias else None, "silu", cu_seqlens=cut, segments=segs,
                                  group=comm, backend=backend)
        return idx, y_r.detach(), torch.autograd.grad((y_r * dy[:, :, idx]).sum(), loc)

    res = cp.simulate(world, rank)
    err = {"y": 0.0, "dx": 0.0}
    for idx, y_r, gs in res:
        if len(idx):
            err["y"] = max(err["y"], (y_r - y[:, :, idx]).abs().max().item())
            err["dx"] = max(err["dx"], (gs[0] - ref[0][:, :, idx]).abs().max().item())
    # weight and bias: each rank holds its share; summed over the group (the data-parallel
    # all-reduce megatron does) they are the unsplit op's
    err["dweight"] = (sum(r[2][1] for r in res) - ref[1]).abs().max().item()
    if bias:
        err["dbias"] = (sum(r[2][2] for r in res) - ref[2]).abs().max().item()
    return err


@pytest.mark.parametrize("world", [2, 3, 4])
def test_conv_float64(world):
    rng = random.Random(10 + world)
    T = 2 * world * 4
    zig = cp.zigzag_segments(T, world)
    for cu, segs, W in (([0, T], zig, 4), (random_packing(T, zig, rng), zig, 4),
                        (random_packing(T, zig, rng), _ragged_segments(T, world, rng), 6)):
        err = conv_errors(world, cu, segs, W=W, bias=W == 4)
        assert max(err.values()) < TOL64, (cu, segs, err)


def test_conv_segments_shorter_than_the_window():
    # rank 1's pieces are 1 token: a halo spans several segments on several ranks
    segs = [[(0, 2), (28, 2)], [(2, 1), (27, 1)], [(3, 24)]]
    for cu in ([0, 30], [0, 3, 30], [0, 2, 2, 28, 30]):
        err = conv_errors(3, cu, segs, W=4)
        assert max(err.values()) < TOL64, (cu, err)


def test_conv_cpu_fp32():
    if "cpu" not in _backends():
        pytest.skip("cpu backend unavailable here")
    segs = cp.zigzag_segments(48, 3)
    err = conv_errors(3, [0, 1, 9, 9, 20, 31, 48], segs, W=4, D=16, backend="cpu", dtype=torch.float32)
    assert max(err.values()) < 1e-5, err


# -- one thread, every rank (the one-GPU check's path) -----------------------------------------------------

def test_lockstep_equals_threads():
    world, T, H, HV, K, V, D, W = 3, 30, 1, 2, 4, 3, 6, 4
    cu = [0, 4, 4, 5, 17, 30]
    segs = cp.zigzag_segments(T, world)
    cut = torch.tensor(cu)
    err, scale, res = gdn_errors(world, cu, segs, H=H, HV=HV, K=K, V=V, l2=True)
    xs = _inputs(T, H, HV, K, V, torch.float64)
    gen = torch.Generator().manual_seed(1)
    inits = {r: torch.randn(1, HV, K, V, generator=gen, dtype=torch.float64) for r in range(world)
             if _first_seq(cu, segs[r][0][0]) is not None}
    do = torch.randn(1, T, HV, V, generator=gen, dtype=torch.float64)
    dfin = torch.randn(len(cu) - 1, HV, K, V, generator=gen, dtype=torch.float64)
    x, w, b, dy = (torch.randn(*s, dtype=torch.float64) for s in ((1, D, T), (D, W), (D,), (1, D, T)))
    inputs, cots = [], []
    for r in range(world):
        idx = _local_index(segs[r])
        ends = cp.plan(cut, segs, r, world).ends
        inputs.append(dict(zip(("q", "k", "v", "g", "beta"), (t[:, idx] for t in xs)), initial_state=inits.get(r),
                           x=x[:, :, idx], weight=w, bias=b))
        cots.append(dict(do=do[:, idx], dfinal=dfin[ends], dy=dy[:, :, idx]))
    out = cp.lockstep(inputs, cots, cu_seqlens=cut, segments=segs, use_qk_l2norm_in_kernel=True, chunk_size=16)
    # against the unsplit ops
    leaves = [t.clone().requires_grad_() for t in xs]
    h0 = torch.zeros(len(cu) - 1, HV, K, V, dtype=torch.float64)
    for r, s in inits.items():
        h0[_first_seq(cu, segs[r][0][0])] = s[0]
    h0.requires_grad_()
    o, fin = tk.chunk_gated_delta_rule(*leaves, None, h0, True, True, cut, chunk_size=16)
    ref = torch.autograd.grad((o * do).sum() + (fin * dfin).sum(), leaves + [h0])
    xl, wl, bl = (t.clone().requires_grad_() for t in (x, w, b))
    y = tk.causal_conv1d(xl, wl, bl, "silu", cut)
    cref = torch.autograd.grad((y * dy).sum(), (xl, wl, bl))
    worst = 0.0
    for r in range(world):
        idx = _local_index(segs[r])
        ends = cp.plan(cut, segs, r, world).ends
        got = out[r]
        pairs = [(got["o"], o[:, idx]), (got["final_state"], fin[ends]), (got["y"], y[:, :, idx]),
                 (got["dx"], cref[0][:, :, idx])]
        pairs += [(got[n], g_[:, idx]) for n, g_ in zip(("dq", "dk", "dv", "dg", "dbeta"), ref)]
        if r in inits:
            pairs.append((got["dinitial_state"][0], ref[5][_first_seq(cu, segs[r][0][0])]))
        worst = max([worst] + [(a - b_).abs().max().item() for a, b_ in pairs if a.numel()])
    worst = max(worst, (sum(out[r]["dweight"] for r in range(world)) - cref[1]).abs().max().item(),
                (sum(out[r]["dbias"] for r in range(world)) - cref[2]).abs().max().item())
    assert worst < TOL64, worst


def test_gpu_check_function_on_cpu():
    """benchmarks.scripts.gdn_cp.check (what gpu_check.sh runs on one GPU), at a small CPU shape."""
    from benchmarks.scripts.gdn_cp import check
    res = check("cpu", T=48, H=1, HV=2, K=8, V=8, D=4, worlds=(2, 3))
    assert set(res) == {"cp2_long", "cp2_packed", "cp3_long", "cp3_packed"}
    assert max(res.values()) < 1e-5, res


# -- the tests that must fail on a wrong port ----------------------------------------------------------------

def test_zigzag_handling_matters(monkeypatch):
    """With the pieces taken as one contiguous shard per rank (stream order = rank order, what a
    port of a contiguous-split scheme does), the result is wrong: this suite would catch it."""
    T = 16
    segs = cp.zigzag_segments(T, 2)
    err, scale, _ = gdn_errors(2, [0, T], segs)
    assert max(err.values()) < TOL64 * max(1.0, scale)
    monkeypatch.setattr(cp, "_global_order", lambda segs_: sorted(segs_, key=lambda s: (s.rank, s.local)))
    err, scale, _ = gdn_errors(2, [0, T], segs)
    assert err["o"] > 1e-3 and err["dv"] > 1e-3, err


def test_misplaced_boundary_is_detected():
    """A packed boundary one token off (here: where a segment starts) changes the outputs."""
    T, world = 24, 3
    segs = cp.zigzag_segments(T, world)
    right = [0, 4, 13, 24]          # 4 is the start of rank 1's first segment
    for wrong in ([0, 5, 13, 24], [0, 3, 13, 24], [0, 4, 12, 24]):
        xs = _inputs(T, 1, 2, 4, 3, torch.float64)
        o_ref, _ = tk.chunk_gated_delta_rule(*xs, cu_seqlens=torch.tensor(right))

        def rank(r, comm):
            idx = _local_index(segs[r])
            return idx, cp.chunk_gated_delta_rule_cp(*(t[:, idx] for t in xs), cu_seqlens=torch.tensor(wrong),
                                                     segments=segs, group=comm)[0]
        diff = max((o_r - o_ref[:, idx]).abs().max().item() for idx, o_r in cp.simulate(world, rank))
        assert diff > 1e-3, wrong
        y_ref = tk.causal_conv1d(xs[0][0, :, 0, :].T[None][:, :2], torch.ones(2, 4, dtype=torch.float64), None, None,
                                 torch.tensor(right))

        def conv_rank(r, comm):
            idx = _local_index(segs[r])
            x_r = xs[0][0, :, 0, :].T[None][:, :2, idx]
            return idx, cp.causal_conv1d_cp(x_r, torch.ones(2, 4, dtype=torch.float64), None, None,
                                            cu_seqlens=torch.tensor(wrong), segments=segs, group=comm)
        diff = max((y_r - y_ref[:, :, idx]).abs().max().item() for idx, y_r in cp.simulate(world, conv_rank))
        assert diff > 1e-3, wrong


# -- bad input -------------------------------------------------------------------------------------------

def _call(world, cu, segs, rank=0, T_local=None, init=False, conv=False):
    class Fake(cp.Collective):
        def __init__(self):
            super().__init__()
            self.rank, self.world = rank, world

        def _all_gather(self, t):
            raise AssertionError("no collective may run on bad input")

    n = T_local if T_local is not None else sum(l for _, l in segs[rank]) if rank < len(segs) else 4
    xs = _inputs(n, 1, 1, 4, 3, torch.float64)
    if conv:
        return cp.causal_conv1d_cp(xs[0][0, :, 0, :].T[None], torch.ones(4, 3, dtype=torch.float64),
                                   cu_seqlens=torch.tensor(cu), segments=segs, group=Fake())
    h0 = torch.zeros(1, 1, 4, 3, dtype=torch.float64) if init else None
    return cp.chunk_gated_delta_rule_cp(*xs, initial_state=h0, cu_seqlens=torch.tensor(cu), segments=segs,
                                        group=Fake())


@pytest.mark.parametrize("conv", [False, True])
def test_bad_input(conv):
    zig = cp.zigzag_segments(8, 2)
    with pytest.raises(ValueError, match="segments overlap"):
        _call(2, [0, 8], [[(0, 3), (6, 2)], [(2, 4)]], conv=conv)
    with pytest.raises(ValueError, match="segments leave a gap"):
        _call(2, [0, 8], [[(0, 2), (6, 2)], [(3, 3)]], conv=conv)
    with pytest.raises(ValueError, match="cu_seqlens ends at 9"):
        _call(2, [0, 4, 9], zig, conv=conv)
    with pytest.raises(ValueError, match="group has 3 ranks but segments describes 2"):
        _call(3, [0, 8], zig, conv=conv)
    with pytest.raises(ValueError, match="holds 3 tokens but rank 0's segments hold 4"):
        _call(2, [0, 8], zig, T_local=3, conv=conv)
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        _call(2, [0, 5, 4, 8], zig, conv=conv)
    with pytest.raises(ValueError, match=r"segments\[1\]\[0\]"):
        _call(2, [0, 8], [[(0, 4)], [(4, -1)]], conv=conv)


def test_initial_state_needs_a_sequence_start():
    zig = cp.zigzag_segments(8, 2)
    with pytest.raises(ValueError, match="initial_state is given, but rank 1's first token"):
        _call(2, [0, 8], zig, rank=1, init=True)
    with pytest.raises(ValueError, match=r"initial_state must have shape \[1, HV, K, V\]"):
        cp.chunk_gated_delta_rule_cp(*_inputs(4, 1, 1, 4, 3, torch.float64),
                                     initial_state=torch.zeros(2, 1, 4, 3, dtype=torch.float64),
                                     cu_seqlens=torch.tensor([0, 8]), segments=zig, group=_single(2, 0))


def _single(world, rank):
    class Fake(cp.Collective):
        def __init__(self):
            super().__init__()
            self.rank, self.world = rank, world
    return Fake()


# -- two real gloo processes -------------------------------------------------------------------------------

def test_gloo_two_processes(tmp_path):
    from tests.megatron_workers.protocol import launch
    results, rcs, logs, _ = launch(2, {}, str(tmp_path), timeout=180, script=os.path.abspath(__file__))
    assert rcs == [0, 0], "\n".join(t[-3000:] for t in logs)
    for r, res in enumerate(results):
        assert res["o"] < TOL64 and res["grads"] < TOL64 and res["conv"] < TOL64, (r, res)
        assert res["bytes"] == res["bytes_formula"], (r, res)
        if "cpu" in res:
            assert res["cpu"] < 1e-5, (r, res)


def _worker():
    """One gloo rank: the CP ops on torch.distributed against the unsplit ops (every rank builds
    the same global inputs), float64 reference (and fp32 cpu where built); errors to result<rank>.json."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    T, H, HV, K, V = 24, 1, 2, 4, 3
    cu = [0, 1, 7, 7, 15, 24]
    segs = cp.zigzag_segments(T, world)
    cut = torch.tensor(cu)
    idx = _local_index(segs[rank])
    out = {}
    group = cp.TorchCollective()
    for backend, dtype in (("reference", torch.float64), ("cpu", torch.float32)):
        if backend == "cpu":
            from twinkle_kernels import _cpu_ext
            if _cpu_ext.unavailable_reason() is not None:
                continue
        xs = _inputs(T, H, HV, K, V, dtype)
        gen = torch.Generator().manual_seed(5)
        do = torch.randn(1, T, HV, V, generator=gen, dtype=torch.float64).to(dtype)
        leaves = [t.clone().requires_grad_() for t in xs]
        o, _ = tk.chunk_gated_delta_rule(*leaves, None, None, False, True, cut, chunk_size=16, backend=backend)
        ref = torch.autograd.grad((o * do).sum(), leaves)
        loc = [t[:, idx].clone().requires_grad_() for t in xs]
        before = group.bytes_sent
        o_r, _ = cp.chunk_gated_delta_rule_cp(*loc, None, None, False, True, cu_seqlens=cut, segments=segs,
                                              group=group, chunk_size=16, backend=backend)
        gs = torch.autograd.grad((o_r * do[:, idx]).sum(), loc)
        e_o = (o_r - o[:, idx]).abs().max().item()
        e_g = max((a - b[:, idx]).abs().max().item() for a, b in zip(gs, ref))
        if backend == "reference":
            out["o"], out["grads"] = e_o, e_g
            # chunks of 6: rank 0 holds [0, 6) and [18, 24), rank 1 [6, 18) (merged). Forward: rank 0
            # sends S_ext of [0, 6), rank 1 S_ext of [6, 18) (sequences start inside it: no M);
            # backward: dS_in of [6, 18) and of [18, 24). One [HV, K, V] float64 payload each way.
            out["bytes"] = group.bytes_sent - before
            out["bytes_formula"] = (HV * K * V + HV * K * V) * 8
        else:
            out["cpu"] = max(e_o, e_g)
        # the conv on the same layout
        if backend == "reference":
            D, W = 5, 4
            gen = torch.Generator().manual_seed(9)
            x, w, b, dy = (torch.randn(*s, generator=gen, dtype=torch.float64)
                           for s in ((1, D, T), (D, W), (D,), (1, D, T)))
            ins = [t.clone().requires_grad_() for t in (x, w, b)]
            y = tk.causal_conv1d(*ins, "silu", cut)
            cref = torch.autograd.grad((y * dy).sum(), ins)
            loc = [x[:, :, idx].clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()]
            y_r = cp.causal_conv1d_cp(*loc, "silu", cu_seqlens=cut, segments=segs, group=group)
            cg = torch.autograd.grad((y_r * dy[:, :, idx]).sum(), loc)
            dwb = torch.cat([cg[1].flatten(), cg[2]])
            dist.all_reduce(dwb)
            out["conv"] = max((y_r - y[:, :, idx]).abs().max().item(), (cg[0] - cref[0][:, :, idx]).abs().max().item(),
                              (dwb - torch.cat([cref[1].flatten(), cref[2]])).abs().max().item())
    with open(os.path.join(os.environ["TWINKLE_TEST_OUT"], f"result{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.argv = sys.argv[:1]
    _worker()
