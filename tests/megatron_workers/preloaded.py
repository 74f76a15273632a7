"""Test ranks forked from one server that has imported torch, megatron-core and transformers once.

A rank started as ``python worker.py`` spends about 5 s of CPU importing torch, megatron-core and
transformers before it does anything, and the suite starts over a hundred ranks in each
megatron-core lane. Here a ``multiprocessing`` forkserver imports them once per pytest session;
each rank is a fork of it, made to look like the subprocess it replaces:

- its own session (``setsid``), so a timeout kills its children too, as ``run_ranks`` does;
- stdout and stderr to ``log_dir/rank<i>.log``;
- the rank's environment (``RANK``, ``MASTER_PORT``, ...), ``sys.argv``, ``sys.path`` (the
  ``PYTHONPATH`` entries and the script's folder) and working directory;
- the script run as ``__main__``, with outputs poisoned (``twinkle_kernels.testing.poison_outputs``)
  as in the test process; its exit code (``SystemExit``, 1 on an exception, minus the
  signal number when killed) and ``atexit`` handlers as the interpreter would have them.

As with any ``multiprocessing`` start method but fork, each rank imports the launching
process's main script as ``__mp_main__``: a script that launches ranks needs an
``if __name__ == "__main__":`` guard (pytest's entry points have one).

What a process reads once at start cannot follow a fork: glibc's ``MALLOC_*`` and torch's
``THP_MEM_ALLOC_ENABLE`` (allocator set-up), ``OMP_NUM_THREADS`` (the server is started with 1,
which every worker launch asks for). :func:`usable` therefore takes only launches whose
environment adds nothing to the protocol's own; the others start a fresh interpreter.
"""
from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
import runpy
import signal
import sys
import time
from typing import Dict, List, Optional, Sequence

from twinkle_megatron.parallel.launch import LaunchTimeout, Rank, free_port, rank_env, tails

# what every worker imports; a module missing here (an optional one) is imported by the rank itself
PRELOAD = ["torch", "torch.distributed", "transformers", "megatron.core", "megatron.core.models.gpt",
           "megatron.core.optimizer", "megatron.core.pipeline_parallel", "megatron.core.distributed",
           "twinkle_megatron", "twinkle_megatron.model", "tests.megatron_workers.serve"]
# set in the server's environment when it starts (read once per process, see the module docstring)
SERVER_ENV = {"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}

_context = None


def usable(extra_env: Optional[Dict[str, str]]) -> bool:
    """Whether a launch can be forked from the server: it adds no environment of its own, and
    ``TWINKLE_TEST_PRELOAD=0`` (read per call; for debugging a worker in a fresh interpreter) is
    not set."""
    return not extra_env and os.environ.get("TWINKLE_TEST_PRELOAD", "1") != "0"


def _server():
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        from multiprocessing import forkserver
        saved = {k: os.environ.get(k) for k in SERVER_ENV}
        os.environ.update(SERVER_ENV)
        try:
            forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _context = ctx
    return _context


def _rank_main(script: str, argv: List[str], env: Dict[str, str], cwd: str, log_path: str) -> None:
    # the preloaded modules' objects (torch, megatron-core, transformers) live as long as the rank:
    # out of the cyclic garbage collector's reach, its full collections stop walking them
    gc.freeze()
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script, *argv]
    extra = [os.path.dirname(os.path.abspath(script))]
    extra += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [p for p in extra if p not in sys.path]
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from twinkle_kernels import testing
    try:
        # the ranks poison as the test process does (tests/conftest.py): an output a fast path
        # allocates but never writes, or a stale grad buffer a writer adds to, comes out NaN
        with testing.poison_outputs(True):
            runpy.run_path(script, run_name="__main__")
    finally:
        # what the interpreter does on exit; multiprocessing's child skips it (os._exit)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


def run_ranks(script: str, args: Sequence[str], nprocs: int, *, timeout: float, env: Dict[str, str], cwd: str,
              log_dir: str, wait_for: Optional[Sequence[int]] = None) -> List[Rank]:
    """:func:`twinkle_megatron.parallel.launch.run_ranks` for ``python script args...``, with each
    rank forked from the preloaded server: the same rendezvous environment, timeout, kill of the
    ranks not waited for, :class:`Rank` records and :class:`LaunchTimeout`."""
    ctx = _server()
    port = free_port()
    want = list(range(nprocs)) if wait_for is None else sorted(wait_for)
    logs = [os.path.join(log_dir, f"rank{r}.log") for r in range(nprocs)]
    for path in logs:
        open(path, "w").close()   # a rank killed before it opens its log still has one
    procs = []
    try:
        for r in range(nprocs):
            p = ctx.Process(target=_rank_main, args=(script, list(args), rank_env(r, nprocs, port, env), cwd, logs[r]),
                            daemon=False)
            p.start()
            procs.append(p)
        start = time.monotonic()
        exited: Dict[int, float] = {}
        while len(exited) < len(want) and time.monotonic() - start < timeout:
            for r in want:
                if r not in exited and procs[r].exitcode is not None:
                    exited[r] = time.time()
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.exitcode is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
            p.join()
    texts = []
    for path in logs:
        with open(path) as f:
            texts.append(f.read())
    if len(exited) < len(want):
        hung = sorted(set(want) - set(exited))
        raise LaunchTimeout(f"ranks {hung} of {nprocs} ({script} {' '.join(args)}) did not finish within "
                            f"{timeout:.0f} s:\n" + tails(texts))
    return [Rank(r, procs[r].exitcode, texts[r], exited.get(r)) for r in range(nprocs)]
