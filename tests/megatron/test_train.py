"""The training job (python -m twinkle_megatron.job): a short 2-process TP2 run on CPU whose
loss falls, whose HF checkpoint loads in transformers and generates, and whose failing rank does
not leave the other hanging."""
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, run_in_own_group

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")


def _run(args, timeout=240, unset=()):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    for name in ("RANK", *unset):
        env.pop(name, None)
    return run_in_own_group([sys.executable, "-m", "twinkle_megatron.job", *args], cwd=ROOT, env=env,
                            timeout=timeout, what="the training job (a hung rank?)")


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("train"))
    rc, out = _run(["--steps", "12", "--log-every", "1", "--seq-len", "32", "--batch-size", "8",
                    "--output-dir", out_dir, "--sample-prompt", "12+34="])
    return rc, out, out_dir


def test_short_tp2_run_loss_decreases(short_run):
    rc, out, _ = short_run
    assert rc == 0, out[-4000:]
    assert "tp=2" in out
    losses = [float(x) for x in re.findall(r"step \d+/12 loss ([0-9.]+)", out)]
    assert len(losses) == 12, out[-3000:]
    assert all(x == x for x in losses)
    # Byte-level uniform loss is ln(320) = 5.77; the formats are learned within a few steps.
    assert losses[0] > 5.0
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses
    for key in ("grad_norm", "lr", "tokens/s"):
        assert re.search(rf"step 12/12 .*{key} [0-9.e+-]+", out), key


def _first_line_is_the_header(out, model_type="qwen3"):
    """The job's header (``get_train_configs``: ``model: ...``, ``mesh: ...``) is the first line
    it prints, stdout and stderr together: no warning or log line of megatron-core or torch the
    user did not ask for comes before it."""
    lines = out.splitlines()
    assert lines and lines[0].startswith(f"model: {model_type} layers=4 "), "\n".join(lines[:12])
    assert lines[1].startswith("mesh: "), "\n".join(lines[:12])


def test_the_readme_command_prints_its_header_first(short_run):
    """The README's command (two local ranks, TP2, launched by the job)."""
    rc, out, _ = short_run
    assert rc == 0, out[-4000:]
    _first_line_is_the_header(out)


def test_a_single_rank_prints_its_header_first(tmp_path):
    """One rank in the launching process (as a torchrun rank runs), where the launcher's
    ``PYTHONWARNINGS=ignore`` for its ranks does not apply: megatron-core's import-time warnings
    and those of the model build are the job's to keep quiet. The cheapest run the job has."""
    rc, out = _run(["--tp", "1", "--steps", "2", "--seq-len", "16", "--batch-size", "2", "--no-sample",
                    "--output-dir", str(tmp_path)], timeout=180, unset=("PYTHONWARNINGS",))
    assert rc == 0, out[-4000:]
    _first_line_is_the_header(out)
    assert "world=1 " in out


def test_checkpoint_loads_in_transformers_and_generates(short_run):
    rc, out, out_dir = short_run
    assert rc == 0, out[-4000:]
    from transformers import AutoModelForCausalLM
    from twinkle_megatron.job import configs, job
    from twinkle_megatron.job import data as train_data
    path = os.path.join(out_dir, "final")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.vocab_size == configs.PADDED_VOCAB
    # The trained model predicts the task tokens far better than chance on fresh task lines.
    rows = train_data.pack(train_data.synthetic_texts(64, seed=123), 32)
    with torch.no_grad():
        loss = hf(input_ids=rows, labels=rows).loss.item()
    assert loss < 4.0, loss
    text = job.generate(path, train_data.ByteTokenizer(), "12+34=", max_new_tokens=6)
    assert isinstance(text, str) and len(text) > 0
    # The job printed the same greedy sample (24 new tokens, of which these are the first 6).
    printed = re.search(r"sample \(transformers, greedy\): '12\+34=' -> '(.*)'$", out, re.M).group(1)
    assert printed.startswith(text), (printed, text)


def test_failing_rank_stops_the_job(tmp_path):
    # An impossible mesh (tp=2 with 3 processes) fails on every rank; the launcher returns non-zero
    # promptly instead of waiting on a rank blocked in a collective.
    rc, out = _run(["--nproc", "3", "--steps", "2", "--output-dir", str(tmp_path)], timeout=120)
    assert rc != 0
    assert "world_size=3" in out


def test_bad_flags_are_refused():
    rc, out = _run(["--tp", "0"], timeout=60)
    assert rc != 0 and "--tp must be at least 1" in out


def test_user_model_dir_and_jsonl_data_with_dp2_local_spec(tmp_path):
    import json
    from twinkle_megatron.job.configs import tiny_qwen3_config
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(tiny_qwen3_config(num_layers=2)))
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"line {i}: " + "abc" * (i % 7)}) for i in range(200)))
    rc, out = _run(["--tp", "1", "--dp", "2", "--steps", "3", "--log-every", "1", "--seq-len", "16",
                    "--batch-size", "4", "--model-dir", str(model_dir), "--data", str(data),
                    "--no-twinkle-kernels", "--no-sample", "--output-dir", str(tmp_path / "out")],
                   timeout=180)
    assert rc == 0, out[-4000:]
    assert "dp=2" in out and f"file {data}" in out and "twinkle kernels: off" in out
    assert len(re.findall(r"step \d+/3 loss [0-9.]+", out)) == 3
    assert os.path.isfile(tmp_path / "out" / "final" / "config.json")


def test_sigterm_to_the_launcher_stops_every_rank(tmp_path):
    import time
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    p = subprocess.Popen([sys.executable, "-m", "twinkle_megatron.job", "--steps", "100000",
                          "--log-every", "1", "--seq-len", "16", "--batch-size", "4",
                          "--output-dir", str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        for line in p.stdout:
            if "step 2/" in line or time.monotonic() > deadline:
                break
        assert "step 2/" in line, "the job never reached step 2"
        p.send_signal(signal.SIGTERM)          # the launcher only, not its group
        p.wait(timeout=30)
        time.sleep(1)
        with pytest.raises(ProcessLookupError):  # no rank left in the launcher's group
            os.killpg(p.pid, 0)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def test_hybrid_packed_tp2_run_trains_and_its_checkpoint_generates(tmp_path):
    """``--hybrid --packed``: the embedded Qwen3.5 hybrid (Gated DeltaNet + gated attention) on
    packed samples, TP2 + sequence parallelism on 2 processes."""
    rc, out = _run(["--hybrid", "--packed", "--sequence-parallel", "--steps", "12", "--log-every", "1",
                    "--seq-len", "32", "--batch-size", "8", "--output-dir", str(tmp_path),
                    "--sample-prompt", "12+34="])
    assert rc == 0, out[-4000:]
    _first_line_is_the_header(out, "qwen3_5_text")
    assert "TwinkleGatedDeltaNet x3" in out, out[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+/12 loss ([0-9.]+)", out)]
    assert len(losses) == 12 and losses[0] > 5.0
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"), dtype=torch.float32)
    assert hf.config.model_type == "qwen3_5_text"
    assert hf.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert re.search(r"sample \(transformers, greedy\): '12\+34=' -> '.+'$", out, re.M), out[-2000:]


def test_sample_positions_restart_at_bos():
    from twinkle_megatron.job.job import sample_positions
    x = torch.tensor([[5, 1, 7, 7, 1, 3], [1, 2, 3, 4, 5, 6]])
    assert sample_positions(x, bos=1).tolist() == [[0, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5]]


def test_hybrid_and_model_dir_are_exclusive(tmp_path):
    rc, out = _run(["--hybrid", "--model-dir", str(tmp_path)], timeout=60)
    assert rc != 0 and "--hybrid" in out
