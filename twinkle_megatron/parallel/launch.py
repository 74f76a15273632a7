"""The one local multi-rank launcher: N ranks of one Python command on this machine.

Every rank gets the torch.distributed rendezvous environment (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``) and one free ``MASTER_PORT``,
chosen per run. Nothing here waits without a bound or a way out, so a hung rank fails its caller
instead of hanging it:

- :func:`run_ranks`: run to completion within a timeout, output captured; on timeout every rank
  is killed and :class:`LaunchTimeout` carries each rank's output tail (the tests' gloo workers,
  the benchmarks' multi-rank rows);
- :func:`supervise`: the training job's ``--nproc`` (``python -m twinkle_megatron.job``):
  output on the terminal, and a rank that fails stops the others at once;
- :class:`LocalRanks`: the ranks themselves, for callers that need their own wait.
"""
from __future__ import annotations

import dataclasses
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple


# Ports below the kernel's ephemeral range: connect() never hands these out on its own, so
# between free_port() and the rendezvous server's bind only another explicit bind can take one.
# (Ports from bind(0) are ephemeral: the gloo pair connections of any other job on the machine
# draw from the same pool, and one took a port free_port() had just returned, EADDRINUSE.)
_LOWEST_PORT = 10000


def _ephemeral_range() -> Tuple[int, int]:
    """The kernel's ``ip_local_port_range`` (Linux), else IANA's dynamic range."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 49152, 65535


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))   # every address, no SO_REUSEADDR: stricter than the server's bind
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port nothing is bound to right now, outside the kernel's ephemeral range when that
    leaves room (random, from the OS's randomness, so processes that seeded ``random`` alike do not
    pick alike). Another process may still bind it before the caller does; an outgoing
    connection cannot."""
    lo, hi = _ephemeral_range()
    below, above = (_LOWEST_PORT, lo - 1), (hi + 1, 65535)
    spans = [(a, b) for a, b in (below, above) if b - a >= 1000]
    pick = random.SystemRandom()
    for _ in range(64 if spans else 0):
        a, b = pick.choice(spans)
        port = pick.randint(a, b)
        if _bindable(port):
            return port
    with socket.socket() as s:   # no room outside the range, or none of it free: the OS picks
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class LaunchTimeout(RuntimeError):
    """Ranks of :func:`run_ranks` still running at its timeout (all of them were then killed)."""


@dataclasses.dataclass
class Rank:
    """One finished rank of :func:`run_ranks`."""
    rank: int
    returncode: int               # negative: killed by that signal (a rank not waited for)
    output: str                   # stdout and stderr together
    exited_at: Optional[float]    # time.time() it was seen to exit (None: not waited for)


def run_ranks(argv: Sequence[str], nprocs: int, *, timeout: float, env: Optional[Dict[str, str]] = None,
              cwd: Optional[str] = None, log_dir: Optional[str] = None,
              wait_for: Optional[Sequence[int]] = None) -> List[Rank]:
    """Run ``python argv...`` on ``nprocs`` local ranks, each in its own process group, and wait
    for the ranks in ``wait_for`` (default: all) at most ``timeout`` seconds; every rank still
    running then is killed (with ``wait_for``: the ranks not waited for, e.g. one that stopped
    itself, are killed once the others exit).

    ``env``: the ranks' base environment (default: this process's); ``log_dir``: each rank's output
    also stays in ``log_dir/rank<i>.log``. Returns one :class:`Rank` per rank. Raises
    :class:`LaunchTimeout` naming the ranks that outlived ``timeout``, with every rank's output
    tail: a hung rank fails the caller, it never hangs it."""
    want = list(range(nprocs)) if wait_for is None else sorted(wait_for)
    ranks = LocalRanks(argv, nprocs, env=env, cwd=cwd, log_dir=log_dir)
    try:
        exited = ranks.wait(timeout, wait_for=want)
    finally:
        ranks.kill()
    texts = ranks.outputs()
    if len(exited) < len(want):
        hung = sorted(set(want) - set(exited))
        raise LaunchTimeout(f"ranks {hung} of {nprocs} ({' '.join(argv)}) did not finish within "
                            f"{timeout:.0f} s:\n" + tails(texts))
    codes = ranks.returncodes
    return [Rank(r, codes[r], texts[r], exited.get(r)) for r in range(nprocs)]


def supervise(argv: Sequence[str], nprocs: int, *, env: Optional[Dict[str, str]] = None,
              name: str = "launcher") -> int:
    """Run ``python argv...`` on ``nprocs`` local ranks with their output on this terminal, until
    all exit or one fails: a failing rank stops the others at once (reported on stderr as
    ``[name] rank i exited with code c``), and so does SIGTERM or Ctrl-C on this process (exit
    code 130). The ranks stay in this process's group, so whoever kills that group kills them
    too. Returns the first non-zero exit code, 0 if every rank succeeded."""
    ranks = LocalRanks(argv, nprocs, env=env, capture=False, own_group=False)
    failed = []

    def _report(rank, rc):
        failed.append(rc)
        print(f"[{name}] rank {rank} exited with code {rc}; stopping the others", file=sys.stderr, flush=True)

    def _terminate(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        ranks.wait(fail_fast=True, on_failure=_report)
        code = failed[0] if failed else next((rc for rc in ranks.returncodes if rc), 0)
    except KeyboardInterrupt:
        code = 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        ranks.kill()
    return code
