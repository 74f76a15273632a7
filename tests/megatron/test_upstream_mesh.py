"""DeviceMesh.from_sizes with upstream Twinkle's spellings and defaults (issue 47): the world size
as the product of the sizes, ``device_type``, ``fsdp_size``, expert tensor parallel 1 by default,
and sequence parallelism switched on for MoE + TP; then a TP2 x EP2 MoE run that gives neither
``etp_size`` nor ``sequence_parallel`` against the same run with both given, and transformers;
and TP2 + SP without EP with expert-TP 1 against expert-TP 2 and transformers."""
import logging
import math
import os

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

import twinkle_megatron as tm  # noqa: E402
from twinkle_megatron.parallel import mesh as mesh_mod  # noqa: E402
from tests.megatron_workers.protocol import ROOT, launch  # noqa: E402

WORKER = os.path.join(ROOT, "tests", "megatron_workers", "upstream_mesh_worker.py")


@pytest.fixture
def no_launcher(monkeypatch):
    """A process that no launcher started: no WORLD_SIZE, no RANK."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert not torch.distributed.is_initialized()


# ---- world size -----------------------------------------------------------------------------

@pytest.mark.parametrize("sizes, world, dp", [
    (dict(dp_size=2, tp_size=2, pp_size=2), 8, 2),
    (dict(tp_size=2, cp_size=2), 4, 1),          # dp_size left out: 1, as upstream
    (dict(dp_size=3), 3, 3),
    (dict(), 1, 1),
])
def test_world_size_is_the_product_of_the_sizes_without_a_launcher(no_launcher, sizes, world, dp):
    mesh = tm.DeviceMesh.from_sizes(**sizes)
    assert (mesh.world_size, mesh.dp_size) == (world, dp)
    assert mesh.dp_size * mesh.tp_size * mesh.pp_size * mesh.cp_size == mesh.world_size


def test_world_size_env_that_disagrees_names_both(no_launcher, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError) as err:
        tm.DeviceMesh.from_sizes(dp_size=1, tp_size=2)
    for words in ("dp_size*tp_size*pp_size*cp_size=1*2*1*1=2", "$WORLD_SIZE=4"):
        assert words in str(err.value)
    with pytest.raises(ValueError, match=r"\$WORLD_SIZE=4 is not divisible by tp_size\*pp_size\*cp_size=1\*3\*1=3"):
        tm.DeviceMesh.from_sizes(pp_size=3)
    assert tm.DeviceMesh.from_sizes(dp_size=2, tp_size=2).world_size == 4      # agrees
    assert tm.DeviceMesh.from_sizes(tp_size=2).dp_size == 2                      # dp: what is left
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ValueError, match=r"\$WORLD_SIZE must be a positive int, got 'four'"):
        tm.DeviceMesh.from_sizes(tp_size=2)


def test_initialize_refuses_a_multi_rank_mesh_without_a_launcher(no_launcher):
    """Without this, init_process_group would wait for ranks nobody started; nothing changes."""
    from twinkle_megatron.parallel import cpu_compat
    mesh = tm.DeviceMesh.from_sizes(tp_size=2)
    with pytest.raises(ValueError, match="mesh.world_size=2 needs 2 processes.*torchrun --nproc-per-node 2"):
        tm.initialize(mesh)
    assert not cpu_compat.is_applied() and tm.current_mesh() is None
    assert "WORLD_SIZE" not in os.environ and "RANK" not in os.environ


# ---- device_type and fsdp_size ----------------------------------------------------------------

def test_device_type_names_the_device_this_process_sees(no_launcher):
    here = mesh_mod.device_type()
    assert tm.DeviceMesh.from_sizes(device_type=here) == tm.DeviceMesh.from_sizes()
    for other in {"cuda", "npu", "cpu"} - {here}:
        with pytest.raises(ValueError, match=rf"device_type='{other}' but this process sees '{here}'"):
            tm.DeviceMesh.from_sizes(device_type=other)
    with pytest.raises(ValueError, match=r"device_type must be 'cuda', 'npu' or 'cpu', got 'gpu'"):
        tm.DeviceMesh.from_sizes(device_type="gpu")


def test_fsdp_size_one_is_accepted_larger_is_refused_with_the_reason(no_launcher):
    assert tm.DeviceMesh.from_sizes(dp_size=2, fsdp_size=1) == tm.DeviceMesh.from_sizes(dp_size=2)
    with pytest.raises(ValueError) as err:
        tm.DeviceMesh.from_sizes(fsdp_size=2, dp_size=2)
    assert "fsdp_size=2 is not supported under megatron" in str(err.value)
    assert "dp_size" in str(err.value)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=rf"fsdp_size must be a positive int, got {bad!r}"):
            tm.DeviceMesh.from_sizes(fsdp_size=bad)


# ---- expert tensor parallel and sequence parallel defaults --------------------------------------

def test_expert_tensor_parallel_defaults_to_one_and_explicit_values_stay(no_launcher):
    # TP2 x EP2 x PP2 on 4 ranks: dp 1, so the experts fit only with etp 1 (upstream's default)
    mesh = tm.DeviceMesh.from_sizes(tp_size=2, ep_size=2, pp_size=2)
    assert (mesh.world_size, mesh.dp_size, mesh.etp_size) == (4, 1, 1)
    with pytest.raises(ValueError, match=r"ep_size\*etp_size=2\*2 must divide dp_size\*cp_size\*tp_size=1\*1\*2"):
        tm.DeviceMesh.from_sizes(tp_size=2, ep_size=2, pp_size=2, etp_size=2)
    assert tm.DeviceMesh.from_sizes(tp_size=2, ep_size=2, dp_size=2, etp_size=2).etp_size == 2
    assert tm.DeviceMesh.from_sizes(tp_size=2, ep_size=2, dp_size=2).etp_size == 1


MODEL = dict(num_attention_heads=4, num_key_value_heads=2, num_layers=2)


def test_sequence_parallel_is_switched_on_for_moe_with_tp_and_logged_once(no_launcher, monkeypatch, caplog):
    monkeypatch.setitem(mesh_mod._logged, "sp_on", False)
    mesh = tm.DeviceMesh.from_sizes(tp_size=2, ep_size=2, dp_size=2)
    assert mesh.sequence_parallel is None                       # not given: the model decides
    mesh.check_model(**MODEL, num_experts=4)                    # no error: it will be switched on
    with caplog.at_level(logging.INFO, logger=mesh_mod.__name__):
        moe = mesh.for_model(num_experts=4)
        again = mesh.for_model(num_experts=4)
    assert moe.sequence_parallel is True and again == moe
    assert moe == tm.DeviceMesh.from_sizes(tp_size=2, ep_size=2, dp_size=2, sequence_parallel=True)
    said = [r.getMessage() for r in caplog.records if "sequence_parallel switched on" in r.getMessage()]
    assert len(said) == 1 and "tp_size=2" in said[0]
    dense = tm.DeviceMesh.from_sizes(tp_size=2, dp_size=2).for_model(num_experts=None)
    assert dense.sequence_parallel is False                     # dense: off, as before
    assert mesh.same_groups(moe) and not mesh.same_groups(None)
    assert dense.same_groups(tm.DeviceMesh.from_sizes(tp_size=2, dp_size=2, sequence_parallel=True))
    assert not mesh.same_groups(tm.DeviceMesh.from_sizes(tp_size=2, ep_size=2, dp_size=2, etp_size=2))
    # tp 1: nothing to decide
    assert tm.DeviceMesh.from_sizes(ep_size=2, dp_size=2).for_model(num_experts=4).sequence_parallel is False


def test_explicit_sequence_parallel_false_with_moe_and_tp_is_an_error(no_launcher):
    mesh = tm.DeviceMesh.from_sizes(tp_size=2, ep_size=2, dp_size=2, sequence_parallel=False)
    assert mesh.for_model(num_experts=4) is mesh                # given: never overridden
    with pytest.raises(ValueError, match=r"sequence_parallel=False: a mixture-of-experts model with tp_size=2 "
                                         r"needs sequence parallelism.*pass sequence_parallel=True"):
        mesh.check_model(**MODEL, num_experts=4)
    tm.DeviceMesh.from_sizes(tp_size=2, dp_size=2, sequence_parallel=False).check_model(**MODEL)   # dense: fine
    with pytest.raises(TypeError, match=r"sequence_parallel must be True, False or None, got 1"):
        tm.DeviceMesh.from_sizes(tp_size=2, sequence_parallel=1)


# ---- TP2 x EP2 with upstream's defaults trains as the explicit layout does ------------------------

VOCAB, B, S = 128, 4, 12
MOE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
           max_position_embeddings=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
           num_experts_per_tok=2, num_hidden_layers=2, head_dim=16, norm_topk_prob=True,
           tie_word_embeddings=False)


def _moe_and_reference(tmp_path):
    """The tiny fp32 Qwen3-MoE (routers far from uniform, so routing differences would show) and
    one batch (a padded row) written under ``tmp_path``; returns transformers' loss and grad norm."""
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**MOE)).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    hf.save_pretrained(str(tmp_path / "moe"))
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, 8:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    torch.save(batch, str(tmp_path / "batch.pt"))
    out = hf(**batch)
    out.loss.backward()
    ref_norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in hf.parameters() if p.grad is not None))
    return out.loss.item(), ref_norm


def _launch_moe(tmp_path, ranks, runs):
    """``runs`` of the MoE model written by :func:`_moe_and_reference` on ``ranks`` gloo ranks;
    each rank's results."""
    spec = {"model_dir": str(tmp_path / "moe"), "data": str(tmp_path / "batch.pt"), "runs": runs}
    res, rcs, logs, _ = launch(ranks, spec, str(tmp_path / "run"), timeout=300, script=WORKER)
    assert rcs == [0] * ranks and all(r is not None for r in res), "\n".join(l[-3000:] for l in logs)
    return res


@pytest.mark.multiprocess
def test_tp2_ep2_moe_without_etp_or_sp_equals_the_explicit_layout_and_transformers(tmp_path):
    ref_loss, ref_norm = _moe_and_reference(tmp_path)
    runs = [{"name": "upstream_defaults", "mesh": {"tp_size": 2, "ep_size": 2}},
            {"name": "explicit", "mesh": {"tp_size": 2, "ep_size": 2, "etp_size": 1, "sequence_parallel": True}}]
    res = _launch_moe(tmp_path, 4, runs)
    for rank, r in enumerate(res):
        d, e = r["upstream_defaults"], r["explicit"]
        assert d["ok"] and e["ok"], (d.get("traceback"), e.get("traceback"))
        assert d["given_sp"] is None and e["given_sp"] is True
        assert (d["sp"], d["config_sp"], d["etp"], d["config_etp"], d["dp"]) == (True, True, 1, 1, 2)
        for key in ("loss", "norm", "loss_after", "param_sq"):
            assert d[key] == e[key], (rank, key, d[key], e[key])        # the same run, bit for bit
        assert math.isclose(d["loss"], ref_loss, rel_tol=1e-5), (d["loss"], ref_loss)
        assert math.isclose(d["norm"], ref_norm, rel_tol=1e-4), (d["norm"], ref_norm)
        assert d["loss_after"] < d["loss"]                               # the step trained


@pytest.mark.multiprocess
def test_tp2_moe_with_expert_tp_1_equals_expert_tp_2_and_transformers(tmp_path):
    """TP2 + SP without EP: upstream's default expert-TP 1 (every TP rank holds whole experts and
    runs them on its own sequence share, so their grads are summed over the TP ranks too) trains
    as expert-TP 2 does (the experts split like the dense MLPs): loss, grad norm and the loss after
    one AdamW step within 1e-6, the loss and norm as transformers'. megatron-core 0.16.1 marks expert
    params for the expert-data-parallel reduction only with EP > 1: unmarked, each TP rank stepped
    its experts with its own tokens' grads (measured without twinkle_megatron.parallel.ddp's
    mark_expert_params: the grad norm 4.3e-6 relative off, the loss after the step 2.1e-3)."""
    ref_loss, ref_norm = _moe_and_reference(tmp_path)
    runs = [{"name": "etp1", "mesh": {"tp_size": 2, "etp_size": 1, "sequence_parallel": True}},
            {"name": "etp2", "mesh": {"tp_size": 2, "etp_size": 2, "sequence_parallel": True}}]
    res = _launch_moe(tmp_path, 2, runs)
    for rank, r in enumerate(res):
        one, two = r["etp1"], r["etp2"]
        assert one["ok"] and two["ok"], (one.get("traceback"), two.get("traceback"))
        assert (one["config_etp"], two["config_etp"], one["dp"]) == (1, 2, 1)
        rel = {k: abs(one[k] - two[k]) / abs(two[k]) for k in ("loss", "norm", "loss_after")}
        print(f"[TP2 + SP rank {rank}, expert-TP 1 against 2: {rel}; norm {one['norm']:.7f}, "
              f"transformers {ref_norm:.7f}]")
        assert max(rel.values()) <= 1e-6, (rank, rel, one, two)
        assert math.isclose(one["loss"], ref_loss, rel_tol=1e-5), (one["loss"], ref_loss)
        assert math.isclose(one["norm"], ref_norm, rel_tol=1e-5), (one["norm"], ref_norm)
        assert one["loss_after"] < one["loss"]                               # the step trained
