"""N local ranks of one command: the torch.distributed rendezvous environment, one free port,
and a wait that never hangs.

The one launcher behind the training job's ``--nproc`` (:func:`twinkle_megatron.train.spawn`),
the tests' gloo workers and the benchmarks' multi-rank rows. Every rank gets ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and one free
``MASTER_PORT``. :meth:`LocalRanks.wait` returns when the ranks asked for have exited, when one
fails (``fail_fast``) or at the timeout; the caller then :meth:`~LocalRanks.kill`\\ s the rest,
so a hung rank fails its caller instead of hanging it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

from .ports import free_port


def rank_env(rank: int, nprocs: int, port: int, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """``base`` (default: this process's environment) plus the rendezvous variables of ``rank``."""
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs),
               LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


class LocalRanks:
    """``python args...`` started on ``nprocs`` local ranks.

    ``env``: the ranks' base environment (default: this process's). ``log_dir``: each rank's
    stdout and stderr go to ``log_dir/rank<i>.log``; ``capture=True`` without ``log_dir``: to a
    temporary file; ``capture=False``: to this process's terminal. ``own_group=True`` puts each
    rank in a process group of its own (so :meth:`kill` takes the rank's children too);
    ``False`` keeps them in the caller's group, so whoever signals the caller's group reaches them.
    """

    def __init__(self, args: Sequence[str], nprocs: int, *, env: Optional[Dict[str, str]] = None,
                 cwd: Optional[str] = None, log_dir: Optional[str] = None, capture: bool = True,
                 own_group: bool = True):
        if nprocs < 1:
            raise ValueError(f"nprocs must be >= 1, got {nprocs}")
        port = free_port()
        self.procs: List[subprocess.Popen] = []
        self._logs = []
        for rank in range(nprocs):
            out = None
            if log_dir is not None:
                out = open(os.path.join(log_dir, f"rank{rank}.log"), "w+")
            elif capture:
                out = tempfile.TemporaryFile("w+")
            self._logs.append(out)
            self.procs.append(subprocess.Popen(
                [sys.executable, *args], env=rank_env(rank, nprocs, port, env), cwd=cwd,
                stdout=out, stderr=None if out is None else subprocess.STDOUT,
                start_new_session=own_group))
        self._own_group = own_group

    def wait(self, timeout: Optional[float] = None, *, wait_for: Optional[Sequence[int]] = None,
             fail_fast: bool = False, on_failure=None) -> Dict[int, float]:
        """Wait for the ranks in ``wait_for`` (default: all) to exit, at most ``timeout`` seconds
        (None: no limit). ``fail_fast``: stop waiting as soon as any rank exits non-zero
        (``on_failure(rank, returncode)`` is called first). Returns ``{rank: time.time() it was
        seen to exit}`` for the ranks in ``wait_for`` that exited; fewer than asked means timeout
        (or a failure with ``fail_fast``)."""
        want = list(range(len(self.procs))) if wait_for is None else list(wait_for)
        start = time.monotonic()
        exited: Dict[int, float] = {}
        while len(exited) < len(want):
            for r, p in enumerate(self.procs):
                rc = p.poll()
                if rc is None:
                    continue
                if r in want and r not in exited:
                    exited[r] = time.time()
                if fail_fast and rc != 0:
                    if on_failure is not None:
                        on_failure(r, rc)
                    return exited
            if timeout is not None and time.monotonic() - start >= timeout:
                break
            time.sleep(0.05)
        return exited

    @property
    def returncodes(self) -> List[Optional[int]]:
        return [p.poll() for p in self.procs]

    def kill(self) -> None:
        """SIGKILL every rank still running (its process group with ``own_group``) and reap all."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    if self._own_group:
                        os.killpg(p.pid, signal.SIGKILL)
                    else:
                        p.kill()
                except ProcessLookupError:
                    pass
            p.wait()

    def outputs(self) -> List[str]:
        """Each rank's captured output ('' where it went to the terminal); closes the logs."""
        texts = []
        for log in self._logs:
            if log is None:
                texts.append("")
                continue
            log.seek(0)
            texts.append(log.read())
            log.close()
        return texts


def tails(texts: Sequence[str], n: int = 3000) -> str:
    """The last ``n`` characters of each rank's output, headed by its rank."""
    return "\n".join(f"--- rank {i} ---\n{t[-n:]}" for i, t in enumerate(texts))
