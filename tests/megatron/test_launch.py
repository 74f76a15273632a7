"""twinkle_megatron.parallel.launch: the one local multi-rank launcher (the training job's --nproc,
the tests' workers, the benchmarks' multi-rank rows)."""
import os
import time

import pytest

from twinkle_megatron.parallel.launch import LaunchTimeout, LocalRanks, run_ranks, supervise


def test_every_rank_gets_the_rendezvous_environment():
    code = "import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['MASTER_PORT'])"
    ranks = LocalRanks(["-c", code], 3)
    try:
        assert len(ranks.wait(60)) == 3
    finally:
        ranks.kill()
    rows = [t.split() for t in ranks.outputs()]
    assert [r[:2] for r in rows] == [["0", "3"], ["1", "3"], ["2", "3"]]
    assert len({r[2] for r in rows}) == 1 and ranks.returncodes == [0, 0, 0]


def test_fail_fast_returns_when_one_rank_fails_and_kill_stops_the_rest():
    code = "import os, sys, time; r = int(os.environ['RANK']); time.sleep(0 if r == 1 else 60); sys.exit(3)"
    seen = []
    start = time.monotonic()
    ranks = LocalRanks(["-c", code], 2)
    try:
        exited = ranks.wait(60, fail_fast=True, on_failure=lambda r, rc: seen.append((r, rc)))
    finally:
        ranks.kill()
    assert time.monotonic() - start < 30
    assert seen == [(1, 3)] and list(exited) == [1]
    assert ranks.returncodes[1] == 3 and ranks.returncodes[0] != 0   # killed


def test_timeout_leaves_the_hung_rank_out_of_the_exited_set():
    ranks = LocalRanks(["-c", "import os, time; time.sleep(0 if os.environ['RANK'] == '0' else 60)"], 2)
    try:
        exited = ranks.wait(3)
    finally:
        ranks.kill()
    assert list(exited) == [0]


def test_run_ranks_returns_every_rank_and_a_hung_rank_raises_after_the_kill():
    code = "import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['MASTER_PORT'])"
    ranks = run_ranks(["-c", code], 2, timeout=60)
    assert [r.returncode for r in ranks] == [0, 0] and [r.rank for r in ranks] == [0, 1]
    fields = [r.output.split() for r in ranks]
    assert [f[:2] for f in fields] == [["0", "2"], ["1", "2"]] and fields[0][2] == fields[1][2]
    t0 = time.monotonic()
    hang = "import os, time; print('rank', os.environ['RANK'], flush=True); time.sleep(0 if os.environ['RANK'] == '0' else 60)"
    with pytest.raises(LaunchTimeout, match=r"ranks \[1\] of 2 .* did not finish within 3 s") as e:
        run_ranks(["-c", hang], 2, timeout=3)
    assert time.monotonic() - t0 < 30
    assert "--- rank 1 ---\nrank 1" in str(e.value)   # the output tails come with the error


def test_run_ranks_wait_for_kills_the_ranks_not_waited_for(tmp_path):
    code = "import os, time; time.sleep(0 if os.environ['RANK'] == '0' else 60)"
    t0 = time.monotonic()
    ranks = run_ranks(["-c", code], 2, timeout=60, wait_for=[0], log_dir=str(tmp_path))
    assert time.monotonic() - t0 < 30
    assert ranks[0].returncode == 0 and ranks[0].exited_at is not None
    assert ranks[1].returncode < 0 and ranks[1].exited_at is None   # killed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.log", "rank1.log"]


def test_supervise_stops_the_others_when_one_rank_fails(capfd):
    code = "import os, sys, time; r = int(os.environ['RANK']); time.sleep(0 if r == 1 else 60); sys.exit(5)"
    t0 = time.monotonic()
    assert supervise(["-c", code], 2, name="job") == 5
    assert time.monotonic() - t0 < 30
    assert "[job] rank 1 exited with code 5; stopping the others" in capfd.readouterr().err
    assert supervise(["-c", "import sys; sys.exit(0)"], 2) == 0


def test_preloaded_ranks_behave_as_fresh_interpreters(tmp_path):
    """The gloo tests' ranks forked from the preloaded server (tests/megatron_workers/preloaded.py)
    get what ``python script args`` would: argv, the rendezvous environment, the working directory,
    ``__main__``, their exit codes (normal, ``sys.exit``, an exception, a signal), ``atexit`` handlers
    and captured output; a hung rank raises LaunchTimeout after its whole session (a child it
    started too) is killed."""
    from tests.megatron_workers import preloaded
    script = tmp_path / "rank.py"
    script.write_text(
        "import atexit, os, subprocess, sys, time\n"
        "r = int(os.environ['RANK'])\n"
        "atexit.register(lambda: print('atexit', r, flush=True))\n"
        "print(__name__, sys.argv[1:], os.environ['WORLD_SIZE'], os.environ['TEST_KEY'], os.getcwd(), flush=True)\n"
        "if r == 1: sys.exit(3)\n"
        "if r == 2: raise RuntimeError('rank two fails')\n"
        "if r == 3: os.kill(os.getpid(), 9)\n")
    env = dict(os.environ, TEST_KEY="k")
    ranks = preloaded.run_ranks(str(script), ["a", "b"], 4, timeout=120, env=env, cwd=str(tmp_path),
                                log_dir=str(tmp_path))
    assert [r.returncode for r in ranks] == [0, 3, 1, -9]
    for r in ranks:
        assert r.output.startswith(f"__main__ ['a', 'b'] 4 k {tmp_path}"), r.output
    assert "atexit 0" in ranks[0].output and "atexit 1" in ranks[1].output
    assert "RuntimeError: rank two fails" in ranks[2].output
    hung = tmp_path / "hung.py"
    pid_file = tmp_path / "child.pid"
    hung.write_text("import subprocess, sys, time\n"
                    "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                    f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
                    "time.sleep(600)\n")
    start = time.monotonic()
    with pytest.raises(LaunchTimeout, match=r"ranks \[0\] of 1"):
        preloaded.run_ranks(str(hung), [], 1, timeout=5, env=env, cwd=str(tmp_path), log_dir=str(tmp_path))
    assert time.monotonic() - start < 60
    child = int(pid_file.read_text())
    for _ in range(100):   # the rank's own child went with its session
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the hung rank's child {child} outlived the kill")


def test_exclusive_memory_makes_two_sessions_take_turns(tmp_path, monkeypatch):
    """CI's two pytest sessions (.ci/run, .ci/lanes) hold one lock file around their largest tests:
    while this process holds it, another process cannot take it; afterwards it can."""
    import subprocess
    import sys

    from conftest import exclusive_memory
    probe = ("import fcntl, sys; f = open(sys.argv[1], 'a')\n"
             "try:\n    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(7)\n")
    lock = str(tmp_path / "memory.lock")

    def other_process_rc():
        return subprocess.run([sys.executable, "-c", probe, lock], timeout=60).returncode
    monkeypatch.delenv("TWINKLE_TEST_MEMORY_LOCK", raising=False)
    with exclusive_memory():   # no lock file named: the block just runs
        assert not os.path.exists(lock)
    monkeypatch.setenv("TWINKLE_TEST_MEMORY_LOCK", lock)
    with exclusive_memory():
        assert other_process_rc() == 7
    assert other_process_rc() == 0


def test_free_port_is_bindable_and_outside_the_ephemeral_range(monkeypatch):
    """Outgoing connections (any gloo job's pairs) draw from the kernel's ephemeral range: a port
    from there could be taken before the rendezvous server binds it (EADDRINUSE in CI). Processes
    that seeded ``random`` alike still pick different ports."""
    import random
    import socket

    from twinkle_megatron.parallel import launch

    lo, hi = launch._ephemeral_range()
    seen = set()
    for _ in range(20):
        random.seed(0)
        port = launch.free_port()
        assert not lo <= port <= hi and 1024 < port <= 65535, (port, lo, hi)
        with socket.socket() as s:
            s.bind(("", port))   # free now
        seen.add(port)
    assert len(seen) > 1
    # A range that leaves no room outside it: the OS's pick, still a free port.
    monkeypatch.setattr(launch, "_ephemeral_range", lambda: (1024, 65535))
    port = launch.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    # A port taken below the range is not returned: every candidate but the taken one is refused.
    monkeypatch.setattr(launch, "_ephemeral_range", lambda: (32768, 60999))
    with socket.socket() as held:
        held.bind(("", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(launch, "_bindable", lambda p: p != taken)
        monkeypatch.setattr(random.SystemRandom, "randint", lambda self, a, b: taken)
        assert launch.free_port() != taken   # falls back to the OS's pick after the tries
