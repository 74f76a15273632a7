"""twinkle_megatron.ranks: the one local multi-rank launcher (train --nproc, test workers, benchmarks)."""
import time

from twinkle_megatron.ranks import LocalRanks


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
