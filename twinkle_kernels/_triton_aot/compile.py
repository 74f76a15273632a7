"""Compiling recorded launches for a CUDA target, without a GPU, and reading their resources.

``triton.compile`` runs the whole pipeline down to a cubin with the ptxas that ships in the
Triton wheel. Registers and stack come from the cubin (``cuobjdump --dump-resource-usage``,
also in the wheel: its ptxas is too old for ``-v`` on Triton's PTX); shared memory is the
compiled kernel's ``metadata.shared`` (the dynamic shared memory a launch requests), checked
against the arch's per-block limit. Must run without ``TRITON_INTERPRET``.
"""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import resource
import tempfile
from dataclasses import dataclass
from typing import Optional

from .record import Launch

# Largest dynamic shared memory one block may use, per compute capability (CUDA's
# sharedMemPerBlockOptin): A100 and H100/H200, plus the consumer Ada/Ampere parts.
SHARED_LIMIT = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}


@dataclass
class Result:
    """One launch compiled for one arch; ``error`` set when the compile failed."""
    arch: int
    regs: Optional[int] = None
    stack: Optional[int] = None
    shared: Optional[int] = None
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    error: Optional[str] = None
    seconds: float = 0.0       # CPU time of the compile (ptxas included): wall time on an idle core

    @property
    def limit(self) -> int:
        return SHARED_LIMIT[self.arch]

    @property
    def overflow(self) -> bool:
        return self.shared is not None and self.shared > self.limit


def jit_function(kernel: str):
    """The ``JITFunction`` named ``module:qualname`` (unwrapping autotune/heuristics wrappers)."""
    from triton.runtime.jit import JITFunction

    module, _, qualname = kernel.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    while not isinstance(obj, JITFunction) and hasattr(obj, "fn"):
        obj = obj.fn
    if not isinstance(obj, JITFunction):
        raise TypeError(f"{kernel} is a {type(obj).__name__}, not a triton.jit kernel "
                        "(is TRITON_INTERPRET set in this process?)")
    return obj


def _source(launch: Launch):
    from triton.backends.compiler import BaseBackend
    from triton.compiler import ASTSource

    fn = jit_function(launch.kernel)
    names = fn.arg_names
    recorded = [n for n, _ in launch.signature]
    if recorded != list(names):
        raise ValueError(f"{launch.kernel} takes ({', '.join(names)}) now; the launch was recorded with "
                         f"({', '.join(recorded)})")
    consts = dict(launch.constexprs, **launch.folded)
    return ASTSource(fn=fn, signature=dict(launch.signature),
                     constexprs={(names.index(k),): v for k, v in consts.items()},
                     attrs={(names.index(k),): BaseBackend.parse_attr(v) for k, v in launch.attrs.items()})


def cuobjdump() -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resource_usage(cubin: bytes):
    """(registers, stack bytes) per thread of the one kernel in ``cubin``."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([cuobjdump(), "--dump-resource-usage", path], capture_output=True, text=True,
                             check=True).stdout
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)", out)
    if m is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{out}")
    return int(m.group(1)), int(m.group(2))


def _cpu_seconds() -> float:
    # this process and its finished children (ptxas, cuobjdump): a loaded machine stretches wall
    # time, not this
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def compile_launch(launch: Launch, arch: int) -> Result:
    """Compile ``launch`` for ``sm_<arch>`` with its own options; never raises for a kernel's fault."""
    import triton
    from triton.backends.compiler import GPUTarget

    t0 = _cpu_seconds()
    try:
        k = triton.compile(_source(launch), target=GPUTarget("cuda", arch, 32), options=dict(launch.options))
        regs, stack = resource_usage(k.asm["cubin"])
        md = k.metadata
        return Result(arch, regs, stack, int(md.shared), int(md.num_warps), int(md.num_stages),
                      seconds=_cpu_seconds() - t0)
    except Exception as e:  # one failing launch must not hide the others
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        return Result(arch, error=f"{type(e).__name__}: {lines[-1] if lines else ''}"[:300],
                      seconds=_cpu_seconds() - t0)


def _worker_init():
    os.environ.pop("TRITON_INTERPRET", None)
    import warnings
    # Triton 3.9 warns once per process that its fp-fusion default will change; the lane
    # compiles with today's default, as a launch would.
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")


def _job(args):
    launch_json, arch = args
    return compile_launch(Launch.from_json(launch_json), arch)


def compile_all(launches, archs, jobs: int = 2, on_result=None):
    """``[(launch, [Result per arch])]``, compiled in ``jobs`` processes (spawned, so none inherits
    an interpreter-mode Triton). ``on_result(launch, result)`` is called as each one finishes, in order."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    tasks = [(launch.to_json(), arch) for launch in launches for arch in archs]
    results = []

    def take(stream):
        for i, r in enumerate(stream):
            results.append(r)
            if on_result is not None:
                on_result(launches[i // len(archs)], r)
    if jobs <= 1:
        _worker_init()
        take(_job(t) for t in tasks)
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_worker_init) as pool:
            take(pool.map(_job, tasks, chunksize=1))
    n = len(archs)
    return [(launch, results[i * n:(i + 1) * n]) for i, launch in enumerate(launches)]
