"""examples/grpo_megatron.py, short: SFT a few steps, then GRPO steps on two processes (TP2), with
full-parameter training and with a LoRA adapter."""
import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from tests.megatron_workers.protocol import ROOT  # noqa: E402
from twinkle_megatron.parallel.launch import free_port  # noqa: E402


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    """The example's SFT checkpoint: made by the first run, reused by the second."""
    return tmp_path_factory.mktemp("grpo") / "sft"


@pytest.mark.multiprocess
@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_grpo_example_runs_finite_and_clips(tmp_path, sft_dir, lora_rank):
    log = tmp_path / "grpo.json"
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), os.path.join(ROOT, "examples", "grpo_megatron.py"),
           "--tp", "2", "--steps", "3", "--prompts", "4", "--group", "4", "--updates", "2",
           "--max-new-tokens", "8", "--lr", "1e-3", "--epsilon", "0.05", "--sft-steps", "12",
           "--sft-dir", str(sft_dir), "--lora-rank", str(lora_rank), "--log-json", str(log), "--plot", str(tmp_path / "r.png")]
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
                             start_new_session=True)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the GRPO example did not finish in 400 s:\n{(e.stdout or '')[-3000:]}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    history = json.load(open(log))["history"]
    assert len(history) == 3
    for row in history:
        for k in ("reward", "kl", "clip_frac", "entropy", "loss"):
            assert math.isfinite(row[k]), row
        assert 0.0 <= row["reward"] <= 1.0
    assert max(r["clip_frac"] for r in history) > 0, history
    assert "step   3 reward" in out.stdout
    assert ("adapter 'default': LoRA r=4" in out.stdout) == bool(lora_rank), out.stdout[:2000]
    assert (tmp_path / "r.png").stat().st_size > 1000
