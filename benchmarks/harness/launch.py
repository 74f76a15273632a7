"""Child processes of the benchmarks: a free local port, and N local ranks with a hard timeout.

``free_port`` is the project's one helper (``twinkle_megatron.ports``); the benchmarks import
nothing from ``tests/`` or from private helpers of the training job.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from twinkle_megatron.ports import free_port  # noqa: F401  (re-exported for the benchmarks)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment of a child benchmark process: this checkout first on ``PYTHONPATH``, so
    ``benchmarks`` and the project's packages import from a checkout that is not installed."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra or {})
    return env


@dataclass
class Rank:
    rank: int
    returncode: int
    output: str  # stdout and stderr together


class LaunchTimeout(RuntimeError):
    pass


def launch_ranks(argv: Sequence[str], nprocs: int, *, timeout: float, env: Optional[Dict[str, str]] = None,
                 cwd: str = ROOT) -> List[Rank]:
    """Runs ``python argv...`` on ``nprocs`` local ranks (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT`` set; one free port), each in its own process group.

    Returns every rank's exit code and output. A rank that outlives ``timeout`` seconds gets every
    rank killed and raises :class:`LaunchTimeout` with the output tails: a hung rank fails the
    benchmark, it never hangs it.
    """
    port = str(free_port())
    procs, logs = [], []
    start = time.monotonic()
    for r in range(nprocs):
        rank_env = child_env(env)
        rank_env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=port)
        log = tempfile.TemporaryFile("w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, *argv], env=rank_env, cwd=cwd, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    timed_out = False
    try:
        for p in procs:
            p.wait(timeout=max(timeout - (time.monotonic() - start), 0.1))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    if timed_out:
        tails = "\n".join(f"--- rank {i} ---\n{t[-3000:]}" for i, t in enumerate(texts))
        raise LaunchTimeout(f"{nprocs} ranks of {' '.join(argv)} did not finish within {timeout:.0f} s:\n{tails}")
    return [Rank(r, p.returncode, t) for r, (p, t) in enumerate(zip(procs, texts))]
