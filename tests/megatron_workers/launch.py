"""Run a worker script on N local processes (gloo, free port) with a hard timeout.

A hung or crashed rank fails the caller: on timeout every rank's process group is killed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from twinkle_megatron.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "megatron_workers", "worker.py")


class LaunchError(RuntimeError):
    pass


def launch(nprocs: int, spec: dict, workdir: str, timeout: float = 240.0, script: str = WORKER):
    """Run ``script spec.json`` on ``nprocs`` ranks; returns (per-rank results, returncodes, logs,
    elapsed seconds). Raises LaunchError on timeout (after killing every rank)."""
    os.makedirs(workdir, exist_ok=True)
    spec_path = os.path.join(workdir, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    port = free_port()
    procs, logs = [], []
    start = time.monotonic()
    for rank in range(nprocs):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHDYNAMO_DISABLE="1",
                   OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   TWINKLE_TEST_OUT=workdir)
        log = open(os.path.join(workdir, f"rank{rank}.log"), "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, script, spec_path], env=env, cwd=ROOT,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    timed_out = False
    try:
        for p in procs:
            remaining = timeout - (time.monotonic() - start)
            p.wait(timeout=max(remaining, 0.1))
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
    elapsed = time.monotonic() - start
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    if timed_out:
        raise LaunchError(f"ranks did not finish within {timeout}s; logs:\n" + _tail(texts))
    results = []
    for rank in range(nprocs):
        path = os.path.join(workdir, f"result{rank}.json")
        results.append(json.load(open(path)) if os.path.exists(path) else None)
    return results, [p.returncode for p in procs], texts, elapsed


def _tail(texts, n=3000):
    return "\n".join(f"--- rank {i} ---\n{t[-n:]}" for i, t in enumerate(texts))
