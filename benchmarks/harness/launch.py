"""Child processes of the benchmarks: a free local port, and N local ranks with a hard timeout.

``free_port`` and the rank launcher are the project's own (``twinkle_megatron.ports``,
``twinkle_megatron.ranks``); the benchmarks import
nothing from ``tests/`` or from private helpers of the training job.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from twinkle_megatron.ports import free_port  # noqa: F401  (re-exported for the benchmarks)
from twinkle_megatron.ranks import LocalRanks, tails

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
    ranks = LocalRanks(argv, nprocs, env=child_env(env), cwd=cwd)
    try:
        exited = ranks.wait(timeout)
    finally:
        ranks.kill()
    texts = ranks.outputs()
    if len(exited) < nprocs:
        raise LaunchTimeout(f"{nprocs} ranks of {' '.join(argv)} did not finish within {timeout:.0f} s:\n"
                            + tails(texts))
    return [Rank(r, code, t) for r, (code, t) in enumerate(zip(ranks.returncodes, texts))]
