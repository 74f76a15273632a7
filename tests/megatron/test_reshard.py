"""Resuming a run on a different mesh from megatron's sharded checkpoint
(``save(..., save_optimizer=True, sharded=True)``, dist_checkpointing's torch_dist format).

One 2-rank gloo launch of tests/megatron_workers/reshard_worker.py (tiny Qwen3, fp32): 3 steps
under TP2, saved; resumed under PP2 and under DP2 with the distributed optimizer (the TP2 run
had the plain one), 3 more steps. Each must equal 6 uninterrupted steps on the second mesh from
the same initial weights, within 1e-6 relative (losses, lr, final weights); the difference left
is the first 3 steps' reduction order on TP2 against the second mesh. Also: a LoRA adapter
resharded TP2 -> PP2, an MoE model EP2 -> TP2 + SP (megatron chains a dense and an expert
optimizer on both meshes: under TP2 + SP the default expert-TP 1 keeps whole experts on every TP
rank, reduced over the expert data-parallel group) and a LoRA adapter on its routed experts
EP2 -> TP2 + SP, a control resume without optimizer state that
must not match, a bf16 checkpoint (fp32 main params) that survives the reshard tensor for
tensor, a crafted common.pt and a corrupted shard refused naming the file; and a 4-layer model
saved and resumed across PP2 with virtual stages and TP2 with use_twinkle_kernels.
"""
import os

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.megatron_workers.protocol import ROOT, launch  # noqa: E402

WORKER = os.path.join(ROOT, "tests", "megatron_workers", "reshard_worker.py")
TOL = 1e-6


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    work = tmp_path_factory.mktemp("reshard")
    res, rcs, logs, _ = launch(2, {"root": str(work / "ckpt")}, str(work), timeout=400.0, script=WORKER)
    assert rcs == [0, 0], "\n".join(f"rank {i}:\n{log[-3000:]}" for i, log in enumerate(logs)) + \
        "\n".join(str((r or {}).get("error")) for r in res)
    assert res[0] is not None and res[1] is not None
    return res


def _check_resumed(run):
    ref, resumed = run["ref"], run["resumed"]
    assert len(ref) == 6 and len(resumed) == 3
    for (ref_loss, ref_lr), (loss, lr) in zip(ref[3:], resumed):
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (loss, ref_loss)
        assert lr == pytest.approx(ref_lr, rel=1e-12)    # the LR schedule resumed at step 3
    assert run["progress"] == {"consumed_train_samples": 12, "cur_step": 3}
    assert run["weights_max_rel"] <= TOL


@pytest.mark.parametrize("mesh, kind", [("pp2", "dense"), ("pp2", "lora"), ("dp2_distopt", "dense"),
                                        ("tp2", "moe"), ("tp2", "moe_lora")])
def test_resume_on_another_mesh_equals_uninterrupted_run(results, mesh, kind):
    for rank_result in results:
        _check_resumed(rank_result[mesh][kind])


@pytest.mark.parametrize("mesh", ["vpp2", "twinkle"])
def test_virtual_stages_and_the_twinkle_spec_save_and_resume(results, mesh):
    """A 4-layer model under PP2 with two virtual stages per rank (local spec: the interleaved
    schedule, four one-row micro-batches) and under TP2 with use_twinkle_kernels (the twinkle
    spec's modules): each resumes the checkpoint the other saved after 3 steps, and its 3 more
    steps equal its own uninterrupted run's within 1e-6 relative (losses, lr, final weights:
    5.1e-7 measured, from the first three steps' other kernels and accumulation order)."""
    for r in results:
        run = r[mesh]["deep"]
        ref, resumed = run["ref"], run["resumed"]
        for (ref_loss, ref_lr), (loss, lr) in zip(ref[3:], resumed):
            assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (loss, ref_loss)
            assert lr == pytest.approx(ref_lr, rel=1e-12)
        assert run["progress"] == {"consumed_train_samples": 12, "cur_step": 3}
        assert run["weights_max_rel"] <= TOL
        assert [loss for loss, _ in run["saved_by"]] == pytest.approx([loss for loss, _ in ref[:3]], rel=TOL)
    assert results[0]["vpp2"]["deep"]["chunks"] == 2 and results[0]["twinkle"]["deep"]["chunks"] == 1
    # the twinkle spec's own modules (norms, attention, MLP) hold the resharded weights
    assert {"TwinkleMLP", "TwinkleRMSNorm"} <= set(results[0]["twinkle"]["deep"]["twinkle_modules"])
    assert "TwinkleMLP" not in results[0]["vpp2"]["deep"]["twinkle_modules"]


def test_expert_adapter_is_in_the_comparison(results):
    """The routed experts' LoRA factors (peft's fused lora_A / lora_B of gate_up_proj and
    down_proj per layer) are among the weights compared after the EP2 -> TP2 resume."""
    keys = results[0]["tp2"]["moe_lora"]["expert_keys"]
    assert len(keys) == 8 and all(".mlp.experts." in k and ".lora_" in k for k in keys), keys


def test_lora_rows_as_checkpoint_fragments():
    """A TP rank's LoRA rows in Hugging Face order as fragments of the full factor: one block of
    a plain projection; a routed expert's fused gate_up_proj under expert-TP 2 (24 gate rows,
    then 24 up rows: rank 1 holds gate 12..23 and up 36..47, fragments 1 and 3 of 4)."""
    from twinkle_megatron.checkpoint.sharded import _runs
    assert _runs(torch.arange(16, 32), 32, "q") == [(1, 2, 16)]
    rank1 = torch.cat([torch.arange(12, 24), torch.arange(36, 48)])
    assert _runs(rank1, 48, "gate_up_proj") == [(1, 4, 12), (3, 4, 12)]
    with pytest.raises(NotImplementedError, match="gate_up_proj: this rank's LoRA rows are not equal aligned"):
        _runs(torch.cat([torch.arange(0, 12), torch.arange(30, 40)]), 48, "gate_up_proj")
    with pytest.raises(NotImplementedError, match="k_proj"):
        _runs(torch.arange(4, 12), 16, "k_proj")    # length 8 not at a multiple of 8


def test_the_check_can_fail_without_optimizer_state(results):
    """The same resume with resume_only_model=True (the same weights; Adam's moments and the LR
    schedule start afresh) ends far outside the tolerance: the comparison above can fail."""
    assert results[0]["pp2"]["dense"]["model_only_weights_max_rel"] > 100 * TOL


def test_first_mesh_trained(results):
    """The TP2 steps the checkpoint holds are the uninterrupted run's first three (another
    reduction order, so within the tolerance, not bit-identical)."""
    for r in results:
        for kind in ("dense", "lora"):
            tp2 = [loss for loss, _ in r[f"tp2_{kind}"]]
            pp2 = [loss for loss, _ in r["pp2"][kind]["ref"][:3]]
            assert tp2 == pytest.approx(pp2, rel=TOL)


def test_corrupted_shard_is_refused_naming_the_file(results):
    for r in results:
        out = r["pp2"]["corrupt"]
        assert not out["ok"]
        path = results[0]["pp2"]["corrupted_file"]
        assert os.path.basename(path).endswith(".distcp")
        assert path in out["error"] and "sha256" in out["error"], out["error"]


def test_bf16_main_params_and_moments_survive_the_reshard(results):
    """bf16 weights with fp32 main params: resumed on PP2 from TP2 and saved again at once, every
    tensor of the second checkpoint (weights, fp32 main params, both moments) equals the first's."""
    for r in results:
        bf16 = r["pp2"]["bf16"]
        assert bf16["same_keys"]
        assert any(k.startswith("optimizer.state.fp32_param.") for k in bf16["keys"])
        assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in bf16["keys"])
        assert bf16["max_abs_diff"] == 0.0


def test_crafted_common_state_is_refused_without_running_it(results):
    for r in results:
        out = r["pp2"]["crafted"]
        assert not out["ok"] and not out["code_ran"]
        assert "common.pt" in out["error"] and "weights_only=True" in out["error"], out["error"]
