"""Robustness of the megatron facade: bad inputs refused on every rank before any collective,
a refused step that does not block the next, checkpoints that are verified, safe to load and
complete, and stalled or dead peers that make the survivor exit within the timeout.

The multi-process checks run tests/megatron_workers/fault_worker.py on 2 gloo ranks (tiny Qwen3,
TP=2 unless said otherwise), all refusals in one launch; each fault scenario is its own launch.
"""
import json
import os

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.megatron_workers.protocol import ROOT, launch, launch_until_exit  # noqa: E402
from twinkle_megatron.parallel.launch import LaunchTimeout  # noqa: E402

WORKER = os.path.join(ROOT, "tests", "megatron_workers", "fault_worker.py")
TIMEOUT_S = 5.0         # initialize(timeout_s=...) in the fault scenarios
EXIT_SLACK_S = 15.0     # start-up of the error path and exit, on a loaded 2-core machine


# ---- in-process ------------------------------------------------------------------------------

class Payload:
    """Pickles to a call that writes the marker file: what a crafted checkpoint could carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('code ran')",))


def test_truncated_config_json_names_the_file(tmp_path):
    import twinkle_megatron as tm
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "qwen3", "vocab_size": 64})[:20])
    with pytest.raises(ValueError, match=r"model_dir_or_config: .*config\.json.* is not valid JSON"):
        tm.MegatronModel(str(tmp_path), device_mesh=tm.DeviceMesh.from_sizes(world_size=1))


@pytest.mark.parametrize("field, value", [("num_hidden_layers", 0), ("vocab_size", -8),
                                          ("hidden_size", 0), ("num_attention_heads", -1)])
def test_configs_that_describe_no_model_are_refused(field, value):
    """Refused before anything is initialised (so in this process, without a process group)."""
    import twinkle_megatron as tm
    cfg = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    cfg[field] = value
    with pytest.raises(ValueError, match=rf"config {field}={value} must be a positive integer"):
        tm.MegatronModel(cfg, device_mesh=tm.DeviceMesh.from_sizes(world_size=1))


def test_check_batch_messages_name_the_argument():
    from twinkle_megatron import validate
    ids = torch.randint(0, 10, (2, 4))
    ok = {"input_ids": ids, "labels": ids.clone()}
    assert validate.check_batch(ok, 10) is None
    assert validate.check_batch({**ok, "labels": torch.full((2, 4), -100)}, 10) is None
    cases = [({**ok, "input_ids": ids + 10}, "inputs['input_ids'] holds 1"),
             ({**ok, "labels": ids - 20}, "inputs['labels'] holds -"),
             ({**ok, "position_ids": ids.float()}, "inputs['position_ids'] must hold integers"),
             ({**ok, "position_ids": ids - 5}, "inputs['position_ids'] holds -"),
             ({**ok, "attention_mask": ids}, "inputs['attention_mask'] must hold only 0 and 1")]
    for batch, words in cases:
        message = validate.check_batch(batch, 10)
        assert message is not None and words in message, (words, message)
    assert "micro_batch_size" in validate.check_micro_batch_size(True, 4)
    assert "not divisible" in validate.check_micro_batch_size(3, 4)
    assert validate.check_micro_batch_size(2, 4) is None


def test_weights_only_load_refuses_a_payload_and_keeps_real_state(tmp_path):
    """The unpickler itself, without a process group: real optimizer-state shapes load, a
    reduce-to-exec payload is refused and never runs."""
    from twinkle_megatron.checkpoint import core
    real = {"optimizer": [{"state": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
                                     "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0],
                                                       "wd_mult": 1.0, "is_expert_parallel": False}]},
                           "main_params": [torch.zeros(2)]}],
            "lr_scheduler": {"max_lr": 1e-3, "lr_decay_style": "cosine", "num_steps": 3},
            "rng": {"torch": torch.get_rng_state(), "tracker": {"model-parallel-rng": torch.get_rng_state()}}}
    torch.save(real, tmp_path / "real.pt")
    back = core.load_rank_state(str(tmp_path / "real.pt"))
    assert torch.equal(back["optimizer"][0]["main_params"][0], torch.zeros(2))
    assert back["optimizer"][0]["state"]["param_groups"][0]["betas"] == (0.9, 0.999)
    marker = tmp_path / "ran"
    torch.save({"optimizer": Payload(str(marker))}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match=r"evil\.pt.* is refused .*GLOBAL exec"):
        core.load_rank_state(str(tmp_path / "evil.pt"))
    assert not marker.exists()


# ---- one launch: refusals on every rank ------------------------------------------------------

@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    root = tmp_path_factory.mktemp("fault_checks")
    spec = {"mode": "checks", "timeout_s": 30.0, "root": str(root / "ckpts")}
    os.makedirs(spec["root"])
    try:
        results, rcs, logs, elapsed = launch(2, spec, str(root / "run"), timeout=240, script=WORKER)
    except LaunchTimeout as e:
        pytest.fail(f"a rank hung: {e}")
    assert rcs == [0, 0] and all(r and "crashed" not in r for r in results), \
        (rcs, [r and r.get("crashed") for r in results], "\n".join(l[-3000:] for l in logs))
    print(f"[fault checks: {elapsed:.1f}s]")
    return results


def _refused(checks, name, words_by_rank, error_type=None):
    for rank, words in enumerate(words_by_rank):
        rec = checks[rank][name]
        assert not rec["ok"], (name, rank, rec)
        assert words in rec["error"], (name, rank, rec)
        if error_type:
            assert rec["type"] == error_type, (name, rank, rec)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, words", [
    ("ids_too_large", "inputs['input_ids'] holds 64, outside the vocabulary [0, 64)"),
    ("ids_negative", "inputs['input_ids'] holds -1, outside the vocabulary"),
    ("labels_too_large", "inputs['labels'] holds 67: labels must be in [0, 64) or -100"),
    ("labels_negative", "inputs['labels'] holds -5"),
    ("ids_float", "inputs['input_ids'] must hold integers, got dtype torch.float32"),
    ("ids_bool", "inputs['input_ids'] must hold integers, got dtype torch.bool"),
    ("empty_batch", "inputs['input_ids'] is empty (shape (0, 8))"),
    ("empty_sequence", "inputs['input_ids'] is empty (shape (2, 0))"),
    ("micro_batch_size_negative", "micro_batch_size must be None or a positive int, got -1"),
    ("micro_batch_size_zero", "micro_batch_size must be None or a positive int, got 0"),
    ("forward_only_ids_too_large", "outside the vocabulary"),
    ("logits_ids_too_large", "outside the vocabulary"),
])
def test_bad_inputs_are_refused_on_every_rank(checks, name, words):
    _refused(checks, name, [words, words], error_type="ValueError")


@pytest.mark.multiprocess
def test_bad_input_on_one_rank_stops_every_rank(checks):
    _refused(checks, "ids_too_large_on_rank1",
             ["rank 1 refused its inputs: inputs['input_ids'] holds 65", "holds 65"],
             error_type="ValueError")
    _refused(checks, "shape_error_on_rank1",
             ["rank 1 refused its inputs", "inputs['labels'] has shape (2, 7)"])
    # under data parallelism too (TP=1: it used to be a bare IndexError on rank 1, a hang on rank 0)
    for rank, words in enumerate(["rank 1 refused its inputs", "outside the vocabulary [0, 64)"]):
        rec = checks[rank]["dp"]["ids_too_large_on_rank1"]
        assert not rec["ok"] and words in rec["error"], rec


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, field", [("seq_differs_on_rank1", "seq"),
                                         ("ids_differ_on_rank1", "input_ids"),
                                         ("labels_differ_on_rank1", "labels")])
def test_tensor_parallel_ranks_given_different_inputs_are_refused(checks, name, field):
    words = "ranks 0 and 1 are in data-parallel replica 0 and must be given the same inputs, but differ in " + field
    _refused(checks, name, [words, words], error_type="InputMismatchError")


@pytest.mark.multiprocess
def test_processes_are_usable_after_the_refusals(checks):
    for rank in range(2):
        assert checks[rank]["after_errors"]["ok"], checks[rank]["after_errors"]
        assert checks[rank]["dp"]["seq_differs_on_rank1_is_fine"]["ok"]   # DP replicas may differ
    assert checks[0]["after_errors"]["value"] == checks[1]["after_errors"]["value"]


@pytest.mark.multiprocess
def test_refused_step_zeroes_grads_and_the_next_step_runs(checks):
    for rank in range(2):
        rec = checks[rank]
        assert not rec["nan_step"]["ok"] and rec["nan_step"]["type"] == "NonFiniteGradientError", rec["nan_step"]
        assert rec["unchanged_after_refusal"]
        assert rec["clean_norm"]["ok"] and rec["next_step"]["ok"], (rec["clean_norm"], rec["next_step"])
        clean = rec["clean_norm"]["value"]
        # clip_grad_and_step's one-pass step takes the norm of the unscaled grads times 1 / tokens
        # (clip_grad_norm: of the grads scaled in fp32): the same norm up to that rounding
        assert clean == pytest.approx(rec["next_step"]["value"][1], rel=1e-7) and clean == clean and clean > 0


# ---- checkpoints ---------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.parametrize("name, words", [
    ("flipped_weights", "model-rank00000.safetensors' does not match its sha256"),
    ("flipped_optimizer_rank1", "rank00001.pt' does not match its sha256"),
    ("truncated_optimizer_rank1", "rank00001.pt' has "),
    ("truncated_weights", "model-rank00000.safetensors' has "),
    ("truncated_config", "config.json' has "),
    ("changed_cur_step", "trainer_state.json' does not match its sha256"),
    ("no_manifest", "is not a complete checkpoint (no manifest.json"),
    ("partial", "is not a complete checkpoint (no manifest.json"),
    ("pickle_payload", "rank00000.pt' holds a type a checkpoint never contains and is refused "
                       "(unpickled with weights_only=True): Unsupported global: GLOBAL exec"),
])
def test_corrupt_or_crafted_checkpoints_are_refused_on_every_rank(checks, name, words):
    for rank in range(2):
        rec = checks[rank][name]
        assert not rec["ok"], (rank, rec)
        # the rank that read the bad file names it; the other says which rank refused and why
        assert words in rec["error"], (rank, rec)
    assert not checks[0]["payload_ran"] and not checks[1]["payload_ran"]


@pytest.mark.multiprocess
def test_adapter_checkpoints_are_verified_and_loaded_safely(checks):
    for rank in range(2):
        rec = checks[rank]["lora"]
        assert rec["good"]["ok"], rec["good"]
        assert not rec["pickle_payload"]["ok"] and "rank00001.pt' holds a type a checkpoint never contains" \
            in rec["pickle_payload"]["error"], rec["pickle_payload"]
        assert not rec["flipped_weights"]["ok"] and "adapter_model.safetensors' does not match its sha256" \
            in rec["flipped_weights"]["error"], rec["flipped_weights"]
        assert not rec["payload_ran"]


@pytest.mark.multiprocess
def test_interrupted_swap_is_finished_on_resume(checks):
    older, good = checks[0]["saved_steps"]
    for rank in range(2):
        assert checks[rank]["swapped"]["ok"] and checks[rank]["swapped"]["value"]["cur_step"] == good
        assert checks[rank]["swapped_dirs"] == ["swapped"]
        assert checks[rank]["only_old"]["ok"] and checks[rank]["only_old"]["value"]["cur_step"] == older
        assert checks[rank]["good"]["ok"] and checks[rank]["good"]["value"]["cur_step"] == good
        assert checks[rank]["after_checkpoint_errors"]["ok"]


# ---- a stalled or dead peer --------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.parametrize("kind, phase, mesh", [
    ("stop", "forward_backward", "tp2"), ("kill", "forward_backward", "tp2"),
    ("stop", "step", "tp2"), ("kill", "step", "tp2"),
    ("stop", "save", "tp2"), ("kill", "save", "tp2"),
    # pipeline p2p (send/recv) rather than all-reduces. megatron-core sends one direction of a
    # 2-stage pipeline over the default group, so here initialize creates that group too
    ("stop", "forward_backward", "pp2"),
])
def test_survivor_exits_within_the_timeout(tmp_path, kind, phase, mesh):
    """Rank 1 is SIGSTOPped (or dies) inside ``phase``; rank 0 must raise and exit non-zero within
    ``timeout_s`` plus start-up slack (before: >900 s with a stopped peer, megatron's 30-minute
    group default)."""
    spec = {"mode": "fault", "phase": phase, "kind": kind, "timeout_s": TIMEOUT_S, "root": str(tmp_path / "ckpt"),
            "mesh": {"tp2": {"tp_size": 2}, "pp2": {"pp_size": 2}}[mesh], "own_group": mesh == "pp2"}
    for attempt in range(2):
        run = tmp_path / f"run{attempt}"
        results, rcs, logs, exited = launch_until_exit(2, spec, str(run), wait_for=[0], timeout=150,
                                                       script=WORKER)
        # start-up, not the fault: the free port taken by another process before rank 0 binds it,
        # or (with own_group's 5 s rendezvous) ranks started far apart on a loaded machine
        startup = ("EADDRINUSE", "connectFullMesh", "DistNetworkError", "DistStoreError")
        if (run / "fault_time").exists() or not any(w in log for w in startup for log in logs):
            break
    fault_file = run / "fault_time"
    assert fault_file.exists(), "rank 1 never reached the fault:\n" + logs[1][-3000:]
    after_fault = exited[0] - float(fault_file.read_text())
    rec = results[0]
    assert rcs[0] != 0 and rec and "error" in rec and not rec.get("finished"), (rcs, rec, logs[0][-3000:])
    print(f"[{kind} during {phase} ({mesh}): rank 0 raised {rec['raised'] - float(fault_file.read_text()):.1f}s and "
          f"exited {after_fault:.1f}s after the fault: {rec['error'][:160]}]")
    assert after_fault <= TIMEOUT_S + EXIT_SLACK_S, (after_fault, rec)
    if phase == "save":   # the checkpoint being overwritten is still complete and verifies
        from twinkle_megatron import checkpoint
        from twinkle_megatron.checkpoint import core
        path = tmp_path / "ckpt" / "ckpt"
        manifest = core.read_manifest(str(path))
        for rank in range(2):
            core.verify_files(str(path), manifest, rank, 1, load_optimizer=True)
        assert json.load(open(path / "trainer_state.json"))["cur_step"] == 2
        assert not (tmp_path / "ckpt" / "ckpt.tmp" / core.MANIFEST).exists()
        with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
            checkpoint.load(None, str(tmp_path / "ckpt" / "ckpt.tmp"))
