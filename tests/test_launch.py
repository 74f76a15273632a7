"""twinkle_megatron.parallel.launch: the one local multi-rank launcher (the training job's --nproc,
the tests' workers, the benchmarks' multi-rank rows)."""
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
