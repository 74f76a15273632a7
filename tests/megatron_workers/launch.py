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


def _start(nprocs: int, spec: dict, workdir: str, script: str):
    os.makedirs(workdir, exist_ok=True)
    spec_path = os.path.join(workdir, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    port = free_port()
    procs, logs = [], []
    for rank in range(nprocs):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHDYNAMO_DISABLE="1",
                   OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   TWINKLE_TEST_OUT=workdir)
        log = open(os.path.join(workdir, f"rank{rank}.log"), "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, script, spec_path], env=env, cwd=ROOT,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return procs, logs


def _kill_all(procs):
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def _read_logs(logs):
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    return texts


def launch(nprocs: int, spec: dict, workdir: str, timeout: float = 240.0, script: str = WORKER):
    """Run ``script spec.json`` on ``nprocs`` ranks; returns (per-rank results, returncodes, logs,
    elapsed seconds). Raises LaunchError on timeout (after killing every rank)."""
    start = time.monotonic()
    procs, logs = _start(nprocs, spec, workdir, script)
    timed_out = False
    try:
        for p in procs:
            remaining = timeout - (time.monotonic() - start)
            p.wait(timeout=max(remaining, 0.1))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        _kill_all(procs)
    elapsed = time.monotonic() - start
    texts = _read_logs(logs)
    if timed_out:
        raise LaunchError(f"ranks did not finish within {timeout}s; logs:\n" + _tail(texts))
    results = []
    for rank in range(nprocs):
        path = os.path.join(workdir, f"result{rank}.json")
        results.append(json.load(open(path)) if os.path.exists(path) else None)
    return results, [p.returncode for p in procs], texts, elapsed


def launch_until_exit(nprocs: int, spec: dict, workdir: str, wait_for, timeout: float, script: str):
    """Like :func:`launch`, but waits only for the ranks in ``wait_for`` and then kills the rest
    (e.g. a rank that stopped itself). Returns (results, returncodes of ``wait_for``, logs,
    {rank: wall-clock time.time() at which it was seen to exit}). Raises LaunchError if a rank in
    ``wait_for`` is still running after ``timeout`` seconds."""
    start = time.monotonic()
    procs, logs = _start(nprocs, spec, workdir, script)
    exited = {}
    try:
        while len(exited) < len(wait_for) and time.monotonic() - start < timeout:
            for r in wait_for:
                if r not in exited and procs[r].poll() is not None:
                    exited[r] = time.time()
            time.sleep(0.05)
    finally:
        _kill_all(procs)
    texts = _read_logs(logs)
    if len(exited) < len(wait_for):
        raise LaunchError(f"ranks {sorted(set(wait_for) - set(exited))} did not exit within "
                          f"{timeout}s; logs:\n" + _tail(texts))
    results = []
    for rank in range(nprocs):
        path = os.path.join(workdir, f"result{rank}.json")
        results.append(json.load(open(path)) if os.path.exists(path) else None)
    return results, {r: procs[r].returncode for r in wait_for}, texts, exited


def _tail(texts, n=3000):
    return "\n".join(f"--- rank {i} ---\n{t[-n:]}" for i, t in enumerate(texts))
