"""The benchmark loop: rooflines, then per op x shape x dtype x provider a correctness gate and,
for providers that pass it, timing and peak memory of each mode.

Row statuses: ``ok`` (gated and timed), ``wrong`` (outputs or gradients outside the
tolerance table of :mod:`twinkle_kernels.testing` against the float64 reference: not timed,
not ranked), ``missing`` (the provider or op does not exist here; the reason is kept),
``error`` (it raised; the message is kept).

What a timed region contains: the op call with inputs that require grad, as in training
(``fwd``: the autograd graph is recorded), ``torch.autograd.grad`` on a retained
graph (``bwd``), or both (``fwd+bwd``). Inputs, layout conversions of peers and gradient
seeds are built outside it. The public APIs allocate their outputs (and autograd its
gradients), so those allocations are inside; the ``copy (fresh alloc)`` roofline, measured
in the same run, shows what allocation costs on this machine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import env, timing
from .ops import MODES, OPS, Case, OpSpec, shape_str
from .providers import EAGER, Prepared, Provider, providers_for


@dataclass
class Config:
    ops: Sequence[str] = tuple(OPS)
    backends: Sequence[str] = ("cpu", "triton", "npu")
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16)
    modes: Sequence[str] = MODES
    providers: Optional[Sequence[str]] = None  # None: all; else names to keep (eager is always kept)
    quick: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    model_step: bool = True
    model_steps: Optional[Sequence[str]] = None  # names in model_step.MODEL_STEPS (None: all)
    compile_backend: str = "inductor"  # torch.compile backend of the compiled model-step variants
    hf_variants: Optional[Sequence[str]] = None  # names in model_step.HF_VARIANTS (None: its defaults)
    progress: bool = True
    shapes: Optional[Dict[str, List[dict]]] = None  # per-op override of the shape set (tests)

    @property
    def shape_set(self) -> str:
        return "quick" if self.quick else "full"

    def timing_kw(self) -> dict:
        if self.quick:
            return dict(warmup=1, min_reps=5, max_reps=30, budget_s=0.3)
        return dict(warmup=3, min_reps=5, max_reps=100, budget_s=2.0)


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _seed_all(seed: int = 0) -> None:
    torch.manual_seed(seed)


# --- rooflines --------------------------------------------------------------------------------
def measure_rooflines(cfg: Config) -> List[dict]:
    """Device-to-device copy (bytes read + written, into a preallocated buffer), the same copy
    into a fresh allocation, and a large square matmul per dtype."""
    dev = cfg.device
    tk = cfg.timing_kw()
    nbytes = (32 << 20) if cfg.quick else (256 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)
    rows = []
    for name, fn in (("copy", lambda: dst.copy_(src)), ("copy (fresh alloc)", lambda: src.clone())):
        t = timing.time_fn(fn, dev, **tk)
        rows.append(dict(kind="roofline", op=name, provider="torch", dtype="float32", mode="fwd", status="ok",
                         shape=f"bytes={nbytes}", metric="GB/s", bytes=2 * nbytes,
                         achieved=2 * nbytes / (t.median_ms * 1e-3) / 1e9,
                         median_ms=t.median_ms, p20_ms=t.p20_ms, p80_ms=t.p80_ms, min_ms=t.min_ms, reps=t.reps))
    del src, dst
    n = 512 if (cfg.quick and dev.type == "cpu") else (2048 if dev.type == "cpu" else 8192)
    for dt in cfg.dtypes:
        a = torch.randn(n, n, device=dev).to(dt)
        b = torch.randn(n, n, device=dev).to(dt)
        out = torch.empty(n, n, device=dev, dtype=dt)
        t = timing.time_fn(lambda: torch.matmul(a, b, out=out), dev, **tk)
        flops = 2 * n ** 3
        rows.append(dict(kind="roofline", op="matmul", provider="torch", dtype=_dtype_name(dt), mode="fwd",
                         status="ok", shape=f"n={n}", metric="TFLOP/s", flops=flops,
                         achieved=flops / (t.median_ms * 1e-3) / 1e12,
                         median_ms=t.median_ms, p20_ms=t.p20_ms, p80_ms=t.p80_ms, min_ms=t.min_ms, reps=t.reps))
    return rows


# --- the correctness gate ---------------------------------------------------------------------
def _to64(case: Case) -> Case:
    args = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in case.args]
    return Case(args, case.diff, dict(case.kwargs))


def _outputs_and_grads(p: Prepared, seeds: Optional[List[torch.Tensor]], with_grads: bool):
    outs = tuple(p.to_canonical(p.call()))
    if seeds is None:
        gen = torch.Generator().manual_seed(1)
        seeds = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device) for o in outs]
    grads: list = []
    if with_grads:
        loss = sum((o.double() * s).sum() for o, s in zip(outs, seeds))
        grads = list(torch.autograd.grad(loss, p.leaves, allow_unused=True))
        grads = list(p.grads_to_canonical(grads))
    return [o.detach() for o in outs], grads, seeds


@dataclass
class Reference:
    outs: List[torch.Tensor]
    grads: List[Optional[torch.Tensor]]
    seeds: List[torch.Tensor]


def reference(spec: OpSpec, case: Case, with_grads: bool) -> Reference:
    p = EAGER.prepare(spec, _to64(case))
    outs, grads, seeds = _outputs_and_grads(p, None, with_grads)
    return Reference(outs, grads, seeds)


def gate(spec: OpSpec, provider: Provider, case: Case, ref: Reference, dtype: torch.dtype,
         with_grads: bool) -> Tuple[str, str, float, float]:
    """(status, reason, max fwd error, max grad error) of ``provider`` against the float64 reference."""
    from twinkle_kernels import testing
    p = provider.prepare(spec, case)
    outs, grads, _ = _outputs_and_grads(p, ref.seeds, with_grads)
    fwd_err = grad_err = 0.0
    problems = []
    if len(outs) != len(ref.outs):
        return "wrong", f"{len(outs)} outputs, expected {len(ref.outs)}", math.nan, math.nan
    for i, (o, r) in enumerate(zip(outs, ref.outs)):
        fwd_err = max(fwd_err, testing.max_error(o, r))
        try:
            testing.assert_close(o, r, dtype, op=spec.api, name=f"output {i}")
        except AssertionError as e:
            problems.append(str(e).splitlines()[0])
    out_numel = max(o.numel() for o in ref.outs)
    for i, (g, r) in enumerate(zip(grads, ref.grads)):
        if r is None:
            continue
        if g is None:
            problems.append(f"no gradient for input {i}")
            continue
        grad_err = max(grad_err, testing.max_error(g, r))
        if spec.grad_scale is not None:
            scale = spec.grad_scale(case, i)
        else:  # weight-like gradients sum over rows: widen by sqrt(rows), as the self-check does
            scale = max(1.0, (out_numel / max(g.numel(), 1)) ** 0.5)
        atol_scale = spec.grad_atol_scale(case, i, r) if spec.grad_atol_scale is not None else 1.0
        try:
            testing.assert_close(g, r, dtype, op=spec.api, name=f"grad {i}", scale=scale, atol_scale=atol_scale)
        except AssertionError as e:
            problems.append(str(e).splitlines()[0])
    if problems:
        return "wrong", "; ".join(problems)[:400], fwd_err, grad_err
    return "ok", "", fwd_err, grad_err


# --- timing one provider -----------------------------------------------------------------------
def _mode_fn(p: Prepared, mode: str):
    if mode == "fwd":
        return p.call
    if mode == "nograd":
        def forward_alone():
            with torch.no_grad():
                return p.call()
        return forward_alone
    outs = p.call()
    diff_outs = [o for o in outs if o.requires_grad]
    seeds = [torch.randn_like(o) for o in diff_outs]
    if mode == "bwd":
        return lambda: torch.autograd.grad(diff_outs, p.leaves, seeds, retain_graph=True, allow_unused=True)
    return lambda: torch.autograd.grad([o for o in p.call() if o.requires_grad], p.leaves, seeds,
                                       allow_unused=True)


def _error_text(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


TIMING_ROUNDS = 3  # interleaved timing rounds per case (see _measure_interleaved)


def run(cfg: Config, extra_providers: Optional[Dict[str, List[Provider]]] = None) -> dict:
    """Run the benchmark; returns ``{"meta": ..., "rows": [...]}`` (see :mod:`.report`)."""
    from twinkle_kernels import BackendUnavailableError
    dev = cfg.device
    meta = env.describe(dev)
    meta.update(shape_set=cfg.shape_set, memory_method=timing.memory_method(dev), timing=cfg.timing_kw(),
                dtypes=[_dtype_name(d) for d in cfg.dtypes], modes=list(cfg.modes))
    rows: List[dict] = measure_rooflines(cfg)
    copy_gbs = next(r["achieved"] for r in rows if r["op"] == "copy")
    mm_tflops = {r["dtype"]: r["achieved"] for r in rows if r["op"] == "matmul"}

    plan = []
    for name in cfg.ops:
        spec = OPS[name]
        provs = providers_for(spec, cfg.backends) + list((extra_providers or {}).get(name, []))
        if cfg.providers is not None:
            provs = [p for p in provs if p.name == "eager" or p.name in cfg.providers]
        for shape in (cfg.shapes or {}).get(name) or spec.shapes[cfg.shape_set]:
            for dt in cfg.dtypes:
                plan.append((spec, shape, dt, provs))
    total = sum(len(p[3]) for p in plan)
    bar = _progress(total, cfg.progress)
    with_grads = any(m not in ("fwd", "nograd") for m in cfg.modes)
    for spec, shape, dt, provs in plan:
        base = dict(kind="op", op=spec.name, shape=shape["label"], dims=shape_str(shape), dtype=_dtype_name(dt),
                    device=dev.type, metric="GB/s" if spec.bound == "memory" else "TFLOP/s")
        ref = case = gate_case = None
        ref_error = None
        if EAGER.unavailable(spec, dev) is None:
            try:
                _seed_all()
                gate_case = spec.make(spec.gate_shape(shape), dt, dev)
                ref = reference(spec, gate_case, with_grads)
                _seed_all()
                case = spec.make(shape, dt, dev)
            except Exception as e:
                ref_error = "reference failed: " + _error_text(e)
        timed: List[tuple] = []  # (provider, mode, row) that passed the gate, timed below
        for prov in provs:
            bar.set_postfix_str(f"{spec.name} {_dtype_name(dt)} {prov.name}"[:60], refresh=False)
            bar.update(1)
            why, status = prov.unavailable(spec, dev), "missing"
            if why is None and ref is None:
                # no ungated timing: without twinkle's reference nothing can be checked
                why = ref_error or f"not gated: twinkle_kernels has no {spec.api} reference yet"
                status = "error" if ref_error else "missing"
            if why:
                for mode in cfg.modes:
                    rows.append(dict(base, provider=prov.name, family=prov.family, mode=mode, status=status,
                                     reason=why))
                continue
            try:
                status, reason, fe, ge = gate(spec, prov, gate_case, ref, dt, with_grads)
            except (BackendUnavailableError, NotImplementedError) as e:
                status, reason, fe, ge = "missing", _error_text(e), math.nan, math.nan
            except ImportError as e:  # a backend registered before its module landed
                status, reason, fe, ge = "missing", "not implemented here: " + _error_text(e), math.nan, math.nan
            except Exception as e:
                status, reason, fe, ge = "error", _error_text(e), math.nan, math.nan
            for mode in cfg.modes:
                row = dict(base, provider=prov.name, family=prov.family, mode=mode, status=status, reason=reason,
                           fwd_max_err=fe, grad_max_err=ge)
                if status == "ok":
                    timed.append((prov, mode, row))
                rows.append(row)
        _measure_interleaved(spec, timed, case, shape, dt, cfg, copy_gbs, mm_tflops)
        eager_ms = {mode: row["median_ms"] for prov, mode, row in timed
                    if prov.name == "eager" and row["status"] == "ok"}
        for row in rows:
            if row.get("kind") == "op" and row["op"] == spec.name and row["shape"] == shape["label"] \
                    and row["dtype"] == _dtype_name(dt) and row["status"] == "ok" and row["mode"] in eager_ms:
                row["vs_eager"] = eager_ms[row["mode"]] / row["median_ms"]
    bar.close()
    _rank(rows)
    if cfg.model_step:
        from . import model_step
        rows.extend(model_step.run(cfg))
    return {"meta": meta, "rows": rows}


def _measure_interleaved(spec, timed, case, shape, dt, cfg, copy_gbs, mm_tflops) -> None:
    """Times every gated (provider, mode) of one case in TIMING_ROUNDS interleaved rounds and
    pools each one's runs, so that load that comes and goes on a shared machine falls on all
    providers alike (timed one after the other, the same bf16 MoE case read twinkle 11.8 ms vs
    transformers 15.8 ms in one run and 16.8 vs 11.1 in the next; interleaved, they are equal).
    Fills each row with the timing, the derived rate and roofline fraction, and peak memory."""
    dev = cfg.device
    fns = {}
    for prov, mode, row in timed:
        try:
            fns[id(row)] = _mode_fn(prov.prepare(spec, case), mode)
        except Exception as e:
            row.update(status="error", reason=f"{mode}: {_error_text(e)}")
    timings, errors = timing.time_interleaved(fns, dev, cfg.timing_kw(), TIMING_ROUNDS)
    for prov, mode, row in timed:
        fn = fns.pop(id(row), None)
        if fn is None:
            continue
        if id(row) in errors:
            row.update(status="error", reason=f"{mode}: {_error_text(errors[id(row)])}")
            continue
        t = timings[id(row)]
        row.update(median_ms=t.median_ms, p20_ms=t.p20_ms, p80_ms=t.p80_ms, min_ms=t.min_ms, reps=t.reps)
        cost = spec.cost(shape, dt, "fwd" if mode == "nograd" else mode)
        if spec.bound == "memory":
            row.update(bytes=cost, achieved=cost / (t.median_ms * 1e-3) / 1e9)
            row["roofline_fraction"] = row["achieved"] / copy_gbs
        else:
            row.update(flops=cost, achieved=cost / (t.median_ms * 1e-3) / 1e12)
            peak = mm_tflops.get(_dtype_name(dt))
            row["roofline_fraction"] = row["achieved"] / peak if peak else None
        try:
            row["peak_mem_bytes"] = timing.peak_memory(fn, dev)
        except Exception as e:  # a memory probe failure is not a benchmark failure
            row["peak_mem_bytes"] = None
            row["reason"] = f"peak memory not measured: {_error_text(e)}"
        del fn  # the retained graph of a bwd-mode function


def _rank(rows: List[dict]) -> None:
    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        if r.get("kind") == "op" and r["status"] == "ok":
            groups.setdefault((r["op"], r["shape"], r["dtype"], r["mode"]), []).append(r)
    for g in groups.values():
        for i, r in enumerate(sorted(g, key=lambda r: r["median_ms"])):
            r["rank"] = i + 1


class _NoBar:
    def set_postfix_str(self, *a, **k):
        pass

    def update(self, n=1):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc="benchmarks", unit="case", dynamic_ncols=True)
