"""Timing and peak-memory measurement: the one timing loop of every benchmark here.

Timing (:func:`time_fn`): after warm-up, the callable runs repeatedly until ``max_reps`` runs
or ``budget_s`` seconds have passed (at least ``min_reps``); the result is the median, the
20th/80th percentiles (:func:`quantile`, linear interpolation, the one rounding used
everywhere) and the minimum of the per-run times. CUDA runs are timed with CUDA events around
each run; CPU runs with ``time.perf_counter`` (and the process CPU time of all threads,
steadier on a shared machine). An optional ``before`` callable runs before each timed run,
outside the timed region (an L2 flush, resetting gradients).

Comparisons (:func:`interleaved`, :func:`time_interleaved`): the sides of a comparison are
timed in alternating rounds and each side's runs pooled, so that load that comes and goes on
a shared machine falls on all of them.

Peak memory:
- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus what
  was allocated before the call (exact for the caching allocator's view).
- CPU: there is no allocator statistic, so :class:`LiveTensorTracker` (a
  ``TorchDispatchMode``) sees every tensor an aten op returns during the call, keeps a weak
  reference to its storage, and samples the bytes still alive after every op; the peak is
  the largest sample. It counts storages created inside the call only (inputs and saved
  tensors from earlier calls are excluded), sampled at op boundaries. It does not see
  scratch memory a C++ kernel allocates and frees internally, nor allocator caching or
  fragmentation: a lower bound of the true footprint, precise for tensors.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int
    min_ms: float = float("nan")
    times: List[float] = field(default_factory=list)  # every timed run, ms
    cpu_times: List[float] = field(default_factory=list)  # process CPU time of each run, ms (CPU runs only)

    def as_dict(self) -> dict:
        """The summary figures (no per-run lists), for JSON rows."""
        return {"median_ms": self.median_ms, "p20_ms": self.p20_ms, "p80_ms": self.p80_ms, "min_ms": self.min_ms,
                "reps": self.reps}

    @property
    def cpu(self) -> Optional["Timing"]:
        """The same statistics over the process CPU times (None where they were not taken)."""
        return summarize(self.cpu_times) if self.cpu_times else None


def summarize(times: List[float], cpu_times: Optional[List[float]] = None) -> Timing:
    """Median / p20 / p80 / min of run times in ms (pooled over rounds, say)."""
    return Timing(statistics.median(times), quantile(times, 0.2), quantile(times, 0.8), len(times), min(times),
                  list(times), list(cpu_times or []))


def split_kw(kw: dict, rounds: int) -> dict:
    """time_fn keywords for one of ``rounds`` interleaved rounds that together spend ``kw``'s budget."""
    # at least one run per round: rounds == reps is a round robin of single runs
    return dict(kw, min_reps=max(1, -(-kw.get("min_reps", 3) // rounds)),
                max_reps=max(1, -(-kw.get("max_reps", 50) // rounds)), budget_s=kw.get("budget_s", 1.0) / rounds)


def interleaved(sides: Dict[Hashable, Callable[[dict], List[float]]], kw: dict, rounds: int, *,
                alternate: bool = False) -> Tuple[Dict[Hashable, Timing], Dict[Hashable, BaseException]]:
    """Times several sides of a comparison in ``rounds`` alternating rounds and pools each
    side's runs, so that load that comes and goes on a shared machine falls on all of them.

    ``sides[key](round_kw)`` runs one round and returns its run times in ms (``round_kw``: the
    :func:`time_fn` keywords of one round, :func:`split_kw` of ``kw``). A side that raises is
    left out of later rounds; returns ``(timings, errors)`` keyed like ``sides``. With
    ``alternate``, every other round runs the sides in reverse order, so that no side always
    runs first (or right after a particular other one).
    """
    per_round = split_kw(kw, rounds)
    times: Dict[Hashable, List[float]] = {k: [] for k in sides}
    errors: Dict[Hashable, BaseException] = {}
    for r in range(rounds):
        order = list(sides.items())
        for key, side in (order[::-1] if alternate and r % 2 else order):
            if key in errors:
                continue
            try:
                times[key] += side(per_round)
            except Exception as e:
                errors[key] = e
    return {k: summarize(v) for k, v in times.items() if k not in errors}, errors


def time_interleaved(fns: Dict[Hashable, Callable[[], object]], device: torch.device, kw: dict, rounds: int, *,
                     before: Optional[Callable[[], object]] = None, alternate: bool = False
                     ) -> Tuple[Dict[Hashable, Timing], Dict[Hashable, BaseException]]:
    """:func:`time_fn` of each of ``fns`` in ``rounds`` interleaved rounds (:func:`interleaved`),
    each round spending ``1 / rounds`` of ``kw``'s budget and repetitions (``rounds`` equal to
    the repetitions: a round robin of single runs); CPU times pooled as well."""
    cpu: Dict[Hashable, List[float]] = {k: [] for k in fns}

    def side(key, fn):
        def one_round(round_kw):
            t = time_fn(fn, device, before=before, **round_kw)
            cpu[key] += t.cpu_times
            return t.times
        return one_round

    timings, errors = interleaved({k: side(k, fn) for k, fn in fns.items()}, kw, rounds, alternate=alternate)
    for k, t in timings.items():
        t.cpu_times = cpu[k]
    return timings, errors


def quantile(xs: List[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` by linear interpolation between order statistics (numpy's
    default), the one percentile rounding of every benchmark here."""
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":  # pragma: no cover - needs torch_npu
        torch.npu.synchronize()


def time_fn(fn: Callable[[], object], device: torch.device, *, warmup: int = 2, min_reps: int = 3,
            max_reps: int = 50, budget_s: float = 1.0, before: Optional[Callable[[], object]] = None) -> Timing:
    """Median / p20 / p80 of ``fn()`` in milliseconds.

    ``before()`` (if given) runs before every run, warm-up included, outside the timed region:
    on CUDA it is enqueued before the start event, on the CPU it runs before the clock starts.
    """
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    synchronize(device)
    times: List[float] = []
    cpu_times: List[float] = []
    t_start = time.perf_counter()
    if device.type == "cuda":
        while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - t_start < budget_s):
            if before is not None:
                before()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - t_start < budget_s):
            if before is not None:
                before()
            synchronize(device)
            c0 = time.process_time()  # read outside the wall-clock interval (it is a system call)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            t1 = time.perf_counter()
            times.append((t1 - t0) * 1e3)
            if device.type == "cpu":
                cpu_times.append((time.process_time() - c0) * 1e3)
    return summarize(times, cpu_times)


class LiveTensorTracker(TorchDispatchMode):
    """Peak bytes of tensor storages created while the mode is active (CPU method, see module doc)."""

    def __init__(self):
        super().__init__()
        self._live = {}  # storage data_ptr -> (nbytes, weak ref)
        self.peak = 0

    def _sample(self) -> int:
        dead = [k for k, (_, ref) in self._live.items() if ref.expired()]
        for k in dead:
            del self._live[k]
        return sum(n for n, _ in self._live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef

        out = func(*args, **(kwargs or {}))
        # an output sharing an input's storage that was not created under the mode (a view of,
        # or an in-place write to, a tensor that existed before) allocates nothing
        inputs = set()
        for t in tree_flatten((args, kwargs or {}))[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                try:
                    inputs.add(t.untyped_storage().data_ptr())
                except Exception:
                    pass
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                try:
                    st = t.untyped_storage()
                except Exception:  # tensors without storage (sparse, nested)
                    continue
                key = st.data_ptr()
                if key and key not in self._live and key not in inputs:
                    self._live[key] = (st.nbytes(), StorageWeakRef(st))
        self.peak = max(self.peak, self._sample())
        return out


CPU_MEMORY_METHOD = "live-tensor tracking (TorchDispatchMode), lower bound"
CUDA_MEMORY_METHOD = "max_memory_allocated minus allocated before (device caching allocator)"


def peak_memory(fn: Callable[[], object], device: torch.device) -> Optional[int]:
    """Peak bytes allocated by one call of ``fn`` above what was allocated before it."""
    if device.type in ("cuda", "npu"):
        mod = torch.cuda if device.type == "cuda" else getattr(torch, "npu")  # torch_npu mirrors torch.cuda
        synchronize(device)
        base = mod.memory_allocated(device)
        mod.reset_peak_memory_stats(device)
        out = fn()
        synchronize(device)
        peak = mod.max_memory_allocated(device) - base
        del out
        return int(peak)
    if device.type == "cpu":
        with LiveTensorTracker() as tracker:
            out = fn()
            del out
        return int(tracker.peak)
    return None


def memory_method(device: torch.device) -> str:
    return {"cuda": CUDA_MEMORY_METHOD, "npu": CUDA_MEMORY_METHOD, "cpu": CPU_MEMORY_METHOD}.get(device.type,
                                                                                                "not measured")
