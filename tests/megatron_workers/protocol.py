"""The workers' protocol: ``spec.json`` in, ``result<rank>.json`` out, over the project's one
local multi-rank launcher (:func:`twinkle_megatron.parallel.launch.run_ranks`: gloo rendezvous,
a free port per run, a hard timeout after which every rank is killed and
:class:`~twinkle_megatron.parallel.launch.LaunchTimeout` is raised). Ranks are forked from a server
that has imported torch, megatron-core and transformers once (:mod:`.preloaded`) unless the launch
sets environment of its own.
"""
from __future__ import annotations

import json
import os
import time

from twinkle_megatron.parallel.launch import run_ranks

from . import preloaded

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "megatron_workers", "worker.py")


def _run(nprocs: int, spec: dict, workdir: str, timeout: float, script: str, wait_for=None, env=None):
    os.makedirs(workdir, exist_ok=True)
    for rank in range(nprocs):   # a reused workdir: no rank may be read as done from an earlier launch
        stale = os.path.join(workdir, f"result{rank}.json")
        if os.path.exists(stale):
            os.remove(stale)
    spec_path = os.path.join(workdir, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    full = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1",
                PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TWINKLE_TEST_OUT=workdir,
                **(env or {}))
    if preloaded.usable(env):
        ranks = preloaded.run_ranks(script, [spec_path], nprocs, timeout=timeout, env=full, cwd=ROOT,
                                    log_dir=workdir, wait_for=wait_for)
    else:
        ranks = run_ranks([script, spec_path], nprocs, timeout=timeout, env=full, cwd=ROOT, log_dir=workdir,
                          wait_for=wait_for)
    results = []
    for rank in range(nprocs):
        path = os.path.join(workdir, f"result{rank}.json")
        results.append(json.load(open(path)) if os.path.exists(path) else None)
    return results, ranks


def launch(nprocs: int, spec: dict, workdir: str, timeout: float = 240.0, script: str = WORKER,
           env: dict = None):
    """Run ``script spec.json`` on ``nprocs`` ranks, with ``env`` added to this process's
    environment; returns (per-rank results, returncodes, logs, elapsed seconds). Raises
    LaunchTimeout on timeout (after killing every rank)."""
    start = time.monotonic()
    results, ranks = _run(nprocs, spec, workdir, timeout, script, env=env)
    return results, [r.returncode for r in ranks], [r.output for r in ranks], time.monotonic() - start


def launch_until_exit(nprocs: int, spec: dict, workdir: str, wait_for, timeout: float, script: str):
    """Like :func:`launch`, but waits only for the ranks in ``wait_for`` and then kills the rest
    (e.g. a rank that stopped itself). Returns (results, returncodes of ``wait_for``, logs,
    {rank: wall-clock time.time() at which it was seen to exit}). Raises LaunchTimeout if a rank in
    ``wait_for`` is still running after ``timeout`` seconds."""
    results, ranks = _run(nprocs, spec, workdir, timeout, script, wait_for=wait_for)
    return (results, {r: ranks[r].returncode for r in wait_for}, [r.output for r in ranks],
            {r: ranks[r].exited_at for r in wait_for})
