"""CPU benchmark of the row-wise ops (RMSNorm, gated RMSNorm, RoPE, SwiGLU) on the C++ backend.

For every op, dtype and pass (forward, forward+backward) it times, in one interleaved run:

- ``cpu``     : the public function (``backend="cpu"``); outputs are freshly allocated per call;
- ``cpu-raw`` : the raw C++ ops writing into outputs allocated once, before timing;
- ``eager``   : the pure-torch reference (``*_reference``), run eagerly;
- ``compile`` : ``torch.compile`` of the same reference;
- ``copy``    : ``dst.copy_(src)`` of one activation-sized tensor into a preallocated buffer.

Why two C++ rows: on this machine a fresh large allocation is served by ``mmap`` and
first-touch page faults (~8 GB/s), which dominates memory-bound timings (docs/design.md).
``cpu-raw`` is the kernel; ``cpu`` is what a caller gets, allocation included.

Bytes moved are the minimum each pass must read and write (``_bytes_*`` below), and GB/s
uses them for every implementation alike, so GB/s ratios are time ratios. The machine is
shared, so every figure is a median (with p20 / p80) over many repetitions (the harness's
``timing.time_fn``), and the implementations are timed in alternating rounds so that load
from other users hits them equally.

    python -m benchmarks.scripts.rowwise_cpu                 # full run, writes benchmarks/results/
    python -m benchmarks.scripts.rowwise_cpu --quick         # small shapes, no torch.compile, < 30 s
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

import twinkle_kernels as tk
from benchmarks.harness import timing
from benchmarks.harness.env import cpu_model
from twinkle_kernels import registry
from twinkle_kernels.norm import gated_rms_norm_reference, rms_norm_reference
from twinkle_kernels.rope import apply_rotary_pos_emb_reference
from twinkle_kernels.swiglu import swiglu_reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Case:
    """One op at one shape and dtype: callables per implementation and the bytes each pass moves."""
    op: str
    shape: str
    dtype: str
    fwd: Dict[str, Callable[[], object]] = field(default_factory=dict)
    fwdbwd: Dict[str, Callable[[], object]] = field(default_factory=dict)
    bytes_fwd: int = 0
    bytes_fwdbwd: int = 0


def _fwdbwd(fn, inputs, dy):
    """A callable running fn(*inputs) forward and backward with upstream grad(s) dy."""
    def run():
        out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, dy)
        for t in inputs:
            t.grad = None
    return run


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _compiled(fn):
    return torch.compile(fn, dynamic=False)


# -- minimum bytes per pass (e = element size of the activations; weights in fp32 where noted) ---
def _bytes_rms(m, n, e):
    # fwd: read x, write y (+ weight). bwd: read x, dy, write dx (+ weight, dw).
    return 2 * m * n * e + 4 * n, 5 * m * n * e + 12 * n


def _bytes_gated(m, n, e):
    # fwd: read x, gate, write y. bwd: read x, gate, dy, write dx, dgate.
    return 3 * m * n * e + 4 * n, 8 * m * n * e + 12 * n


def _bytes_rope(nq, nk, ncos, e):
    # fwd: read q, k, cos, sin; write q_out, k_out. bwd: the same again with the grads.
    one = 2 * (nq + nk) * e + 2 * ncos * e
    return one, 2 * one


def _bytes_swiglu(m, n, e):
    # fwd: read gate, up, write y. bwd: read dy, gate, up, write dgate, dup.
    return 3 * m * n * e, 8 * m * n * e


def case_rms(m, n, dt, compile_ref):
    ops = registry.cpu_kernels()
    x = torch.randn(m, n, dtype=dt)
    w = torch.randn(n, dtype=torch.float32)
    dy = torch.randn(m, n, dtype=dt)
    e = x.element_size()
    c = Case("rms_norm", f"{m}x{n}", str(dt).replace("torch.", ""))
    c.bytes_fwd, c.bytes_fwdbwd = _bytes_rms(m, n, e)
    y, rstd, dx = torch.empty_like(x), torch.empty(m), torch.empty_like(x)
    scratch = torch.zeros(torch.get_num_threads(), n)

    def raw_fwd():
        ops.rms_norm_fwd(x, w, 1e-6, 0.0, y, rstd)

    def raw_fwdbwd():
        ops.rms_norm_fwd(x, w, 1e-6, 0.0, y, rstd)
        scratch.zero_()
        ops.rms_norm_bwd(dy, x, w, rstd, 0.0, dx, scratch)
        scratch.sum(0)

    pub = lambda a, b: tk.rms_norm(a, b, 1e-6, backend="cpu")  # noqa: E731
    ref = lambda a, b: rms_norm_reference(a, b, 1e-6)  # noqa: E731
    xl, wl = _leaf(x), _leaf(w)
    c.fwd = {"cpu": lambda: pub(x, w), "cpu-raw": raw_fwd, "eager": lambda: ref(x, w)}
    c.fwdbwd = {"cpu": _fwdbwd(pub, (xl, wl), dy), "cpu-raw": raw_fwdbwd, "eager": _fwdbwd(ref, (xl, wl), dy)}
    if compile_ref:
        cf = _compiled(ref)
        c.fwd["compile"] = lambda: cf(x, w)
        c.fwdbwd["compile"] = _fwdbwd(_compiled(ref), (xl, wl), dy)
    return c


def case_gated(m, n, dt, compile_ref):
    ops = registry.cpu_kernels()
    x, g, dy = (torch.randn(m, n, dtype=dt) for _ in range(3))
    w = torch.randn(n, dtype=torch.float32)
    c = Case("gated_rms_norm", f"{m}x{n}", str(dt).replace("torch.", ""))
    c.bytes_fwd, c.bytes_fwdbwd = _bytes_gated(m, n, x.element_size())
    y, rstd, dx, dg = torch.empty_like(x), torch.empty(m), torch.empty_like(x), torch.empty_like(x)
    scratch = torch.zeros(torch.get_num_threads(), n)

    def raw_fwd():
        ops.gated_rms_norm_fwd(x, g, w, 1e-6, y, rstd)

    def raw_fwdbwd():
        ops.gated_rms_norm_fwd(x, g, w, 1e-6, y, rstd)
        scratch.zero_()
        ops.gated_rms_norm_bwd(dy, x, g, w, rstd, dx, dg, scratch)
        scratch.sum(0)

    pub = lambda a, b, c_: tk.gated_rms_norm(a, b, c_, 1e-6, backend="cpu")  # noqa: E731
    ref = lambda a, b, c_: gated_rms_norm_reference(a, b, c_, 1e-6)  # noqa: E731
    leaves = (_leaf(x), _leaf(g), _leaf(w))
    c.fwd = {"cpu": lambda: pub(x, g, w), "cpu-raw": raw_fwd, "eager": lambda: ref(x, g, w)}
    c.fwdbwd = {"cpu": _fwdbwd(pub, leaves, dy), "cpu-raw": raw_fwdbwd, "eager": _fwdbwd(ref, leaves, dy)}
    if compile_ref:
        cf = _compiled(ref)
        c.fwd["compile"] = lambda: cf(x, g, w)
        c.fwdbwd["compile"] = _fwdbwd(_compiled(ref), leaves, dy)
    return c


def case_rope(b, hq, hk, s, d, dt, compile_ref):
    """Qwen3-like: q [B, Hq, S, D], k [B, Hk, S, D], cos/sin [B, S, D] in the activation dtype."""
    ops = registry.cpu_kernels()
    q = torch.randn(b, hq, s, d, dtype=dt)
    k = torch.randn(b, hk, s, d, dtype=dt)
    ang = torch.randn(b, s, d // 2)
    cos = torch.cat([ang.cos()] * 2, -1).to(dt)
    sin = torch.cat([ang.sin()] * 2, -1).to(dt)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    c = Case("rope", f"q{b}x{hq}x{s}x{d},k{hk}h", str(dt).replace("torch.", ""))
    c.bytes_fwd, c.bytes_fwdbwd = _bytes_rope(q.numel(), k.numel(), cos.numel(), q.element_size())
    c32, s32 = cos.float(), sin.float()
    qo, ko, gq, gk = (torch.empty_like(t) for t in (q, k, q, k))

    def raw_fwd():
        ops.rope_fwd(q, k, c32, s32, qo, ko)

    def raw_fwdbwd():
        ops.rope_fwd(q, k, c32, s32, qo, ko)
        ops.rope_bwd(dq, dk, c32, s32, gq, gk)

    pub = lambda a, b_: tk.apply_rotary_pos_emb(a, b_, cos, sin, 1, backend="cpu")  # noqa: E731
    ref = lambda a, b_: apply_rotary_pos_emb_reference(a, b_, cos, sin, 1)  # noqa: E731
    leaves = (_leaf(q), _leaf(k))
    c.fwd = {"cpu": lambda: pub(q, k), "cpu-raw": raw_fwd, "eager": lambda: ref(q, k)}
    c.fwdbwd = {"cpu": _fwdbwd(pub, leaves, (dq, dk)), "cpu-raw": raw_fwdbwd,
                "eager": _fwdbwd(ref, leaves, (dq, dk))}
    if compile_ref:
        cf = _compiled(ref)
        c.fwd["compile"] = lambda: cf(q, k)
        c.fwdbwd["compile"] = _fwdbwd(_compiled(ref), leaves, (dq, dk))
    return c


def case_swiglu(m, n, dt, compile_ref):
    ops = registry.cpu_kernels()
    g, u, dy = (torch.randn(m, n, dtype=dt) for _ in range(3))
    c = Case("swiglu", f"{m}x{n}", str(dt).replace("torch.", ""))
    c.bytes_fwd, c.bytes_fwdbwd = _bytes_swiglu(m, n, g.element_size())
    y, dg, du = torch.empty_like(g), torch.empty_like(g), torch.empty_like(g)

    def raw_fwd():
        ops.swiglu_fwd(g, u, y)

    def raw_fwdbwd():
        ops.swiglu_fwd(g, u, y)
        ops.swiglu_bwd(dy, g, u, dg, du)

    pub = lambda a, b: tk.swiglu(a, b, backend="cpu")  # noqa: E731
    leaves = (_leaf(g), _leaf(u))
    c.fwd = {"cpu": lambda: pub(g, u), "cpu-raw": raw_fwd, "eager": lambda: swiglu_reference(g, u)}
    c.fwdbwd = {"cpu": _fwdbwd(pub, leaves, dy), "cpu-raw": raw_fwdbwd, "eager": _fwdbwd(swiglu_reference, leaves, dy)}
    if compile_ref:
        cf = _compiled(swiglu_reference)
        c.fwd["compile"] = lambda: cf(g, u)
        c.fwdbwd["compile"] = _fwdbwd(_compiled(swiglu_reference), leaves, dy)
    return c


def copy_fn(numel, dt):
    """dst.copy_(src) into a preallocated buffer; moves 2 * numel * element_size bytes."""
    src = torch.randn(numel, dtype=dt)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * numel * src.element_size()


@dataclass
class Row:
    op: str
    shape: str
    dtype: str
    pass_: str
    impl: str
    med_ms: float
    p20_ms: float
    p80_ms: float
    gbs: float


ROUNDS = 3  # interleaved timing rounds per (op, dtype, pass), as in the harness


def run_case(case: Case, reps: int, warmup: int, copy_numel: int, budget_s: float = 1e9,
             min_reps: int = 1) -> List[Row]:
    """Times each pass's implementations and the copy with :func:`benchmarks.harness.timing.time_interleaved`:
    up to ``reps`` runs each (at least ``min_reps``) in ``ROUNDS`` alternating rounds, ``budget_s``
    seconds per pass shared by its implementations."""
    rows = []
    copy, copy_bytes = copy_fn(copy_numel, DTYPES[{"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[case.dtype]])
    for pass_, fns, nbytes in (("fwd", case.fwd, case.bytes_fwd), ("fwd+bwd", case.fwdbwd, case.bytes_fwdbwd)):
        allf = dict(fns)
        allf["copy"] = copy
        kw = dict(warmup=warmup, min_reps=min_reps, max_reps=reps, budget_s=budget_s / len(allf))
        timings, errors = timing.time_interleaved(allf, torch.device("cpu"), kw, ROUNDS)
        if errors:
            raise RuntimeError(f"{case.op} {case.dtype} {pass_}: " + "; ".join(
                f"{k}: {type(e).__name__}: {e}" for k, e in errors.items()))
        for impl, t in timings.items():
            b = copy_bytes if impl == "copy" else nbytes
            rows.append(Row(case.op, case.shape, case.dtype, pass_, impl, t.median_ms, t.p20_ms, t.p80_ms,
                            b / (t.median_ms * 1e-3) / 1e9))
    return rows


def ratios(rows: List[Row]) -> List[dict]:
    """Per (op, dtype, pass): speed-ups of cpu-raw and cpu over eager / compile, and % of copy GB/s."""
    out = []
    keys = sorted({(r.op, r.shape, r.dtype, r.pass_) for r in rows}, key=lambda k: (k[0], k[2], k[3]))
    for key in keys:
        by = {r.impl: r for r in rows if (r.op, r.shape, r.dtype, r.pass_) == key}
        d = {"op": key[0], "dtype": key[2], "pass": key[3]}
        for impl in ("cpu-raw", "cpu"):
            if impl not in by:
                continue
            t = by[impl].med_ms
            d[f"{impl} / eager"] = by["eager"].med_ms / t
            if "compile" in by:
                d[f"{impl} / compile"] = by["compile"].med_ms / t
            d[f"{impl} % copy"] = 100 * by[impl].gbs / by["copy"].gbs
        out.append(d)
    return out




def format_tables(rows: List[Row], rat: List[dict]) -> str:
    lines = ["| op | shape | dtype | pass | impl | median ms | p20 ms | p80 ms | GB/s |",
             "|---|---|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.op} | {r.shape} | {r.dtype} | {r.pass_} | {r.impl} | {r.med_ms:.3f} | {r.p20_ms:.3f} | "
                     f"{r.p80_ms:.3f} | {r.gbs:.1f} |")
    cols = ["cpu-raw / eager", "cpu-raw / compile", "cpu-raw % copy", "cpu / eager", "cpu / compile", "cpu % copy"]
    lines += ["", "Ratios (medians; targets for the C++ kernel: >= 3x eager, >= 1.0x compile, >= 50% of copy):", "",
              "| op | dtype | pass | " + " | ".join(cols) + " |", "|---|---|---|" + "---:|" * len(cols)]
    for d in rat:
        cells = [f"{d[c]:.2f}" if c in d and "copy" not in c else (f"{d[c]:.0f}%" if c in d else "-") for c in cols]
        lines.append(f"| {d['op']} | {d['dtype']} | {d['pass']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes, fp32 only, no torch.compile (< 30 s)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per implementation")
    p.add_argument("--dtypes", default=None, help="comma list of fp32,bf16,fp16")
    p.add_argument("--ops", default="rms_norm,gated_rms_norm,rope,swiglu")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--budget", type=float, default=60.0,
                   help="seconds per (op, dtype, pass), shared by its implementations, after which timing "
                        "stops once 8 runs of each are done")
    p.add_argument("--out", default=None, help="markdown file to write (default: benchmarks/results/"
                   "rowwise_cpu_<date>.md for full runs, none for --quick)")
    args = p.parse_args(argv)

    why = registry.backend_status("cpu")
    if why is not None:
        print(f"the cpu backend is unavailable: {why}", file=sys.stderr)
        return 1
    quick = args.quick
    m, n = (256, 1024) if quick else (4096, 4096)
    rope_shape = (1, 4, 256, 128, 1) if quick else (1, 32, 4096, 128, 8)  # b, hq, s, d, hk
    reps = args.reps or (3 if quick else 30)
    warmup = 1 if quick else 3
    dtypes = (args.dtypes or ("fp32" if quick else "fp32,bf16")).split(",")
    compile_ref = not (quick or args.no_compile)
    ops = args.ops.split(",")

    t_start = time.time()
    rows: List[Row] = []
    for dname in dtypes:
        dt = DTYPES[dname]
        for op in ops:
            if op == "rms_norm":
                c = case_rms(m, n, dt, compile_ref)
            elif op == "gated_rms_norm":
                c = case_gated(m, n, dt, compile_ref)
            elif op == "rope":
                b, hq, s, d, hk = rope_shape
                c = case_rope(b, hq, hk, s, d, dt, compile_ref)
            elif op == "swiglu":
                c = case_swiglu(m, n, dt, compile_ref)
            else:
                raise SystemExit(f"unknown op {op!r}")
            new = run_case(c, reps, warmup, m * n, args.budget, min(reps, 8))
            rows += new
            print(f"  done {op} {dname} ({time.time() - t_start:.0f} s)", file=sys.stderr, flush=True)
            print(format_tables(new, ratios(new)), file=sys.stderr, flush=True)
            del c

    rat = ratios(rows)
    cmd = "python -m benchmarks.scripts.rowwise_cpu " + " ".join(argv if argv is not None else sys.argv[1:])
    header = [f"# Row-wise ops on the C++ CPU backend ({datetime.date.today().isoformat()})", "",
              f"- command: `{cmd.strip()}` (from the repository root, extension built in place)",
              f"- CPU: {cpu_model()}, {os.cpu_count()} logical CPUs, torch threads {torch.get_num_threads()}, "
              f"ISA build `{registry.cpu_isa()}`",
              f"- torch {torch.__version__}, Python {platform.python_version()}",
              f"- up to {reps} timed repetitions per implementation in {ROUNDS} interleaved rounds (+{warmup} "
              f"warm-up each), fewer (>= 8) when a pass exceeds {args.budget:.0f} s; medians with p20/p80.",
              "  The machine is shared with other users, so single figures are noisy; compare medians.",
              "- `cpu` = public function (fresh output allocation per call, included); `cpu-raw` = the C++ ops "
              "writing into preallocated outputs; `copy` = `dst.copy_(src)` of one activation "
              "(bytes read + written) in the same run.",
              "- GB/s = minimum bytes the pass must move (see `_bytes_*` in the script) / median time.",
              f"- wall time {time.time() - t_start:.0f} s", ""]
    text = "\n".join(header) + format_tables(rows, rat) + "\n"
    print(text)
    out = args.out
    if out is None and not quick:
        out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results",
                           f"rowwise_cpu_{datetime.date.today().isoformat()}.md")
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text)
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
