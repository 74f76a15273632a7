"""Run a worker script on N local processes (gloo, free port) with a hard timeout.

A hung or crashed rank fails the caller: on timeout every rank's process group is killed. The
ranks are started by the project's one launcher, :class:`twinkle_megatron.ranks.LocalRanks`.
"""
from __future__ import annotations

import json
import os
import time

from twinkle_megatron.ports import free_port  # noqa: F401  (re-exported for the tests)
from twinkle_megatron.ranks import LocalRanks, tails

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "megatron_workers", "worker.py")


class LaunchError(RuntimeError):
    pass


def _start(nprocs: int, spec: dict, workdir: str, script: str) -> LocalRanks:
    os.makedirs(workdir, exist_ok=True)
    spec_path = os.path.join(workdir, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TWINKLE_TEST_OUT=workdir)
    return LocalRanks([script, spec_path], nprocs, env=env, cwd=ROOT, log_dir=workdir)


def _results(nprocs: int, workdir: str):
    results = []
    for rank in range(nprocs):
        path = os.path.join(workdir, f"result{rank}.json")
        results.append(json.load(open(path)) if os.path.exists(path) else None)
    return results


def launch(nprocs: int, spec: dict, workdir: str, timeout: float = 240.0, script: str = WORKER):
    """Run ``script spec.json`` on ``nprocs`` ranks; returns (per-rank results, returncodes, logs,
    elapsed seconds). Raises LaunchError on timeout (after killing every rank)."""
    start = time.monotonic()
    ranks = _start(nprocs, spec, workdir, script)
    try:
        exited = ranks.wait(timeout)
    finally:
        ranks.kill()
    elapsed = time.monotonic() - start
    texts = ranks.outputs()
    if len(exited) < nprocs:
        raise LaunchError(f"ranks did not finish within {timeout}s; logs:\n" + tails(texts))
    return _results(nprocs, workdir), ranks.returncodes, texts, elapsed


def launch_until_exit(nprocs: int, spec: dict, workdir: str, wait_for, timeout: float, script: str):
    """Like :func:`launch`, but waits only for the ranks in ``wait_for`` and then kills the rest
    (e.g. a rank that stopped itself). Returns (results, returncodes of ``wait_for``, logs,
    {rank: wall-clock time.time() at which it was seen to exit}). Raises LaunchError if a rank in
    ``wait_for`` is still running after ``timeout`` seconds."""
    ranks = _start(nprocs, spec, workdir, script)
    try:
        exited = ranks.wait(timeout, wait_for=wait_for)
    finally:
        ranks.kill()
    texts = ranks.outputs()
    if len(exited) < len(wait_for):
        raise LaunchError(f"ranks {sorted(set(wait_for) - set(exited))} did not exit within "
                          f"{timeout}s; logs:\n" + tails(texts))
    codes = ranks.returncodes
    return _results(nprocs, workdir), {r: codes[r] for r in wait_for}, texts, exited
