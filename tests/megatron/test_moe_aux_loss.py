"""The MoE load-balancing (aux) loss of the facade against transformers.

- the pooled statistics of :mod:`twinkle_megatron.training.aux_loss` give transformers'
  ``load_balancing_loss_func`` (value and gradient with respect to the router logits) on the same
  routing, with and without an attention mask;
- one training step of ``MegatronModel`` (Qwen3-MoE, Qwen3.5-MoE) has transformers' loss
  (``output_router_logits=True``: cross entropy + coef * aux), aux loss and grad norm on the same
  weights; with ``output_router_logits`` off there is no aux loss, and the
  ``router_aux_loss_coef`` keyword overrides the config;
- TP2 + SP, EP2, CP2, DP2, PP2 (also with two micro-batches), PP2 x TP2 + SP and PP2 x DP2 (gloo
  ranks) equal transformers' step too, and an ``add_metric`` metric reduces over them exactly.
"""
import math
import os

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

from conftest import megatron_one_rank  # noqa: E402
from tests.megatron_workers.protocol import ROOT, launch  # noqa: E402

from twinkle_megatron.training import aux_loss  # noqa: E402

VOCAB, B, S, COEF = 128, 4, 12, 0.3
WORKER = os.path.join(ROOT, "tests", "megatron_workers", "aux_worker.py")
MOE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
           max_position_embeddings=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
           num_experts_per_tok=2, num_hidden_layers=2, head_dim=16, norm_topk_prob=True,
           tie_word_embeddings=False, output_router_logits=True, router_aux_loss_coef=COEF)


def _hf_lbl():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    return load_balancing_loss_func


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pooled_statistics_equal_load_balancing_loss_func(masked, dtype):
    g = torch.Generator().manual_seed(1)
    layers, b, s, e, k = 3, 3, 7, 6, 2
    logits = [(2 * torch.randn(b * s, e, generator=g)).to(dtype).requires_grad_() for _ in range(layers)]
    mask = torch.ones(b, s, dtype=torch.long)
    if masked:
        mask[0, 5:] = 0
        mask[2, 2:] = 0
    ref = _hf_lbl()(tuple(logits), e, k, mask if masked else None)
    ref_grads = torch.autograd.grad(ref, logits)

    stats = aux_loss.RoutingStats(e, "cpu")
    valid = mask.reshape(-1).bool() if masked else None
    sums = [stats.add(x, k, valid) for x in logits]
    w, value = stats.finish(1.0, coef=1.0)
    assert float(w) == 1.0
    assert abs(float(value) - float(ref)) <= 1e-6 * max(1.0, abs(float(ref)))
    # the gradient the routers get: through PooledAuxGrad on a dummy activation
    probe = torch.zeros(2, requires_grad=True)
    out = probe
    for p in sums:
        out = aux_loss.PooledAuxGrad.apply(out, p, stats)
    grads = torch.autograd.grad(out.sum(), logits)
    for got, want in zip(grads, ref_grads):
        assert (got.double() - want.double()).abs().max() <= 1e-6


def test_pooled_loss_is_not_the_mean_of_per_layer_losses():
    """Two layers with opposite imbalance: each layer alone is unbalanced, pooled they balance."""
    e, k = 2, 1
    a = torch.tensor([[4.0, 0.0]] * 4)
    b = torch.tensor([[0.0, 4.0]] * 4)
    lbl = _hf_lbl()
    pooled = float(lbl((a, b), e, k))
    per_layer = (float(lbl((a,), e, k)) + float(lbl((b,), e, k))) / 2
    stats = aux_loss.RoutingStats(e, "cpu")
    for x in (a, b):
        stats.add(x, k)
    assert abs(float(stats.finish(1.0, coef=1.0)[1]) - pooled) <= 1e-6
    assert abs(pooled - per_layer) > 0.1


def test_coefficient_follows_transformers():
    assert aux_loss.coefficient({"router_aux_loss_coef": 0.01}) == 0.0      # output_router_logits off
    assert aux_loss.coefficient({"router_aux_loss_coef": 0.01, "output_router_logits": True}) == 0.01
    assert aux_loss.coefficient({"text_config": {"router_aux_loss_coef": 0.02,
                                                 "output_router_logits": True}}) == 0.02
    assert aux_loss.coefficient({"output_router_logits": True}, override=0.0) == 0.0
    assert aux_loss.coefficient({}, override=0.5) == 0.5
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        aux_loss.coefficient({}, override=-1.0)


# ---- the facade's training step against transformers --------------------------------------

def _batch():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, 9:] = 0
    mask[3, 6:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :2] = -100   # prompts
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _hf_model(cls, cfg, seed):
    torch.manual_seed(seed)
    model = cls(cfg).float()
    with torch.no_grad():   # routers far from uniform, so the aux loss and its gradient matter
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model


def _reference(hf, batch, output_router_logits=True):
    hf.zero_grad()
    out = hf(**batch, output_router_logits=output_router_logits)
    out.loss.backward()
    norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in hf.parameters() if p.grad is not None))
    aux = None if out.aux_loss is None else float(out.aux_loss)
    return float(out.loss), aux, norm


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("aux") / "qwen3_moe")
    hf = _hf_model(transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(**MOE), seed=0)
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def one_rank():
    with megatron_one_rank() as tm:
        yield tm


def _step(model, batch, **kw):
    model.set_optimizer("AdamW", lr=1e-3)
    out = model.forward_backward(inputs=batch, **kw)
    norm = model.clip_grad_norm(0)
    model.router_grads = [p.main_grad.clone() for n, p in model.unwrapped_chunks()[0].named_parameters()
                          if n.endswith("mlp.router.weight")]
    model.zero_grad()
    return out, norm


def _router_grads_match(model, hf):
    want = [p.grad for n, p in hf.named_parameters() if n.endswith("mlp.gate.weight")]
    assert len(want) == len(model.router_grads) > 0
    return max(float((g - w).abs().max()) for g, w in zip(model.router_grads, want))


def _close(a, b, rel):
    return abs(a - b) <= rel * max(1.0, abs(b))


def test_step_equals_transformers_with_router_logits(one_rank, moe_dir):
    path, hf = moe_dir
    batch = _batch()
    ref_loss, ref_aux, ref_norm = _reference(hf, batch)
    model = one_rank.MegatronModel(path, mixed_precision="fp32")
    out, norm = _step(model, batch)
    print(f"[aux {out['aux_loss'] - ref_aux:.2e}, loss {out['loss'] - ref_loss:.2e}, "
          f"norm {norm - ref_norm:.2e} (ref {ref_aux:.4f}, {ref_loss:.4f}, {ref_norm:.4f})]")
    assert _close(out["aux_loss"], ref_aux, 1e-6), (out["aux_loss"], ref_aux)
    assert _close(out["loss"], ref_loss, 1e-6), (out["loss"], ref_loss)
    assert _close(norm, ref_norm, 1e-5), (norm, ref_norm)
    assert _router_grads_match(model, hf) <= 1e-6   # the aux loss's own gradient is ~2x theirs
    # micro-batches: each pools its own rows; with the count weighting the loss is the
    # count-weighted mean of the micro-batches' transformers losses
    parts = [slice(0, 2), slice(2, 4)]
    refs = [_reference(hf, {k: v[p] for k, v in batch.items()}) for p in parts]
    counts = [int((batch["labels"][p][:, 1:] != -100).sum()) for p in parts]
    assert _close(model.calculate_metric()["aux_loss"], ref_aux, 1e-6)   # the first call's
    out2, _ = _step(model, batch, micro_batch_size=2)
    want = sum(c * r[0] for c, r in zip(counts, refs)) / sum(counts)
    assert _close(out2["loss"], want, 1e-6), (out2["loss"], want)
    metric = model.calculate_metric()
    assert _close(metric["aux_loss"], sum(c * r[1] for c, r in zip(counts, refs)) / sum(counts), 1e-6)


def test_forward_only_adds_the_aux_loss_like_transformers_eval_forward(one_rank, moe_dir):
    """transformers' forward in eval mode with ``output_router_logits`` returns ``CE + coef * aux``
    and the aux loss; forward_only does the same, and leaves no gradient behind."""
    path, hf = moe_dir
    batch = _batch()
    hf.eval()
    try:
        with torch.no_grad():
            ref = hf(**batch, output_router_logits=True)
    finally:
        hf.train()
    ref_loss, ref_aux = float(ref.loss), float(ref.aux_loss)
    model = one_rank.MegatronModel(path, mixed_precision="fp32")
    out = model.forward_only(inputs=batch)
    print(f"[eval aux {out['aux_loss'] - ref_aux:.2e}, loss {out['loss'] - ref_loss:.2e}]")
    assert _close(out["aux_loss"], ref_aux, 1e-6), (out["aux_loss"], ref_aux)
    assert _close(out["loss"], ref_loss, 1e-6), (out["loss"], ref_loss)
    assert abs(ref_loss - float(ref.loss - COEF * ref.aux_loss)) > 1e-3   # the aux term matters
    assert _close(model.calculate_metric(is_training=False)["aux_loss"], ref_aux, 1e-6)
    assert all(p.main_grad.abs().max() == 0 for p in model.unwrapped_chunks()[0].parameters()
               if getattr(p, "main_grad", None) is not None)
    # a training step after it is unchanged (the eval forward left no statistics behind)
    ref_loss, ref_aux, ref_norm = _reference(hf, batch)
    out, norm = _step(model, batch)
    assert _close(out["aux_loss"], ref_aux, 1e-6) and _close(norm, ref_norm, 1e-5)


def test_off_without_router_logits_and_the_keyword_overrides(one_rank, moe_dir, tmp_path):
    path, hf = moe_dir
    batch = _batch()
    cfg = transformers.Qwen3MoeConfig(**dict(MOE, output_router_logits=False))
    hf.config.output_router_logits = False
    off_dir = str(tmp_path / "off")
    hf.save_pretrained(off_dir)
    hf.config.output_router_logits = True
    assert not cfg.output_router_logits
    ref_loss, ref_aux, ref_norm = _reference(hf, batch, output_router_logits=False)
    assert ref_aux is None
    model = one_rank.MegatronModel(off_dir, mixed_precision="fp32")
    out, norm = _step(model, batch)
    assert "aux_loss" not in out and "aux_loss" not in model.calculate_metric()
    assert _close(out["loss"], ref_loss, 1e-6) and _close(norm, ref_norm, 1e-5)
    # the keyword turns it on (the config's coefficient is still transformers' reference)
    on = one_rank.MegatronModel(off_dir, mixed_precision="fp32", router_aux_loss_coef=COEF)
    ref_loss, ref_aux, ref_norm = _reference(hf, batch)
    out, norm = _step(on, batch)
    assert _close(out["loss"], ref_loss, 1e-6) and _close(norm, ref_norm, 1e-5)
    # and 0 turns it off on a config that has it on
    off = one_rank.MegatronModel(path, mixed_precision="fp32", router_aux_loss_coef=0.0)
    assert "aux_loss" not in _step(off, batch)[0]


def test_qwen3_5_moe_hybrid_equals_transformers(one_rank, tmp_path):
    if not hasattr(transformers, "Qwen3_5MoeForCausalLM"):
        pytest.skip("this transformers has no Qwen3.5-MoE")
    from tests.megatron.test_megatron_hybrid import HYBRID_MOE
    cfg = transformers.Qwen3_5MoeTextConfig(**{k: v for k, v in HYBRID_MOE.items() if k != "model_type"},
                                            output_router_logits=True, router_aux_loss_coef=COEF)
    hf = _hf_model(transformers.Qwen3_5MoeForCausalLM, cfg, seed=2)
    hf.save_pretrained(str(tmp_path / "hf"))
    batch = _batch()
    batch = {k: v % HYBRID_MOE["vocab_size"] if k == "input_ids" else v for k, v in batch.items()}
    batch["labels"] = torch.where(batch["labels"] >= 0, batch["input_ids"], batch["labels"])
    ref_loss, ref_aux, ref_norm = _reference(hf, batch)
    model = one_rank.MegatronModel(str(tmp_path / "hf"), mixed_precision="fp32")
    out, norm = _step(model, batch)
    assert _close(out["aux_loss"], ref_aux, 1e-6), (out["aux_loss"], ref_aux)
    assert _close(out["loss"], ref_loss, 1e-6), (out["loss"], ref_loss)
    assert _close(norm, ref_norm, 1e-5), (norm, ref_norm)
    assert _router_grads_match(model, hf) <= 1e-6
    assert _close(model.calculate_metric()["aux_loss"], ref_aux, 1e-6)


def test_interleaved_pipeline_and_dense_models_are_clear_errors():
    from twinkle_megatron import config
    shape = config.model_shape(dict(MOE, model_type="qwen3_moe"))
    mesh = type("M", (), {"pp_size": 2, "vpp_size": 2})()
    with pytest.raises(NotImplementedError, match="interleaved.*router_aux_loss_coef=0"):
        aux_loss.build(dict(MOE), shape, mesh, [], None)
    assert aux_loss.build(dict(MOE), shape, mesh, [], 0.0) == (None, None)   # off: no error
    dense = type("S", (), {"num_experts": 0, "model_type": "qwen3"})()
    with pytest.raises(ValueError, match="no MoE layers"):
        aux_loss.build({}, dense, mesh, [], 0.1)


LAYOUTS = {"tp2_sp": {"tp_size": 2, "etp_size": 2, "sequence_parallel": True}, "ep2": {"ep_size": 2},
           "cp2": {"cp_size": 2}, "dp2": {"dp_size": 2}, "pp2": {"pp_size": 2}}


def _reference_micro_batches(hf, batch, parts):
    """transformers' loss per micro-batch, weighted by its loss tokens (the facade's definition)."""
    counts = [int((batch["labels"][p][:, 1:] != -100).sum()) for p in parts]
    hf.zero_grad()
    loss = aux = 0.0
    for p, c in zip(parts, counts):
        out = hf(**{k: v[p] for k, v in batch.items()}, output_router_logits=True)
        (out.loss * c / sum(counts)).backward()
        loss += float(out.loss) * c / sum(counts)
        aux += float(out.aux_loss) * c / sum(counts)
    norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in hf.parameters() if p.grad is not None))
    return loss, aux, norm


@pytest.mark.multiprocess
def test_tp2_sp_ep2_cp2_dp2_equal_transformers(moe_dir, tmp_path):
    """Each layout pools the routing of the same whole batch (one micro-batch per DP rank): the
    loss, aux loss and grad norm are transformers' on the whole batch. PP2 also with two
    micro-batches (1F1B: the first stage runs both forwards before its backwards), against
    transformers' per-micro-batch losses weighted by their loss tokens."""
    path, hf = moe_dir
    batch = _batch()
    ref_loss, ref_aux, ref_norm = _reference(hf, batch)
    torch.save(batch, str(tmp_path / "batch.pt"))
    runs = [{"name": n, "mesh": m} for n, m in LAYOUTS.items()]
    runs.append({"name": "ep2_twinkle", "mesh": LAYOUTS["ep2"], "twinkle": True})
    runs.append({"name": "pp2_mbs2", "mesh": {"pp_size": 2, "tp_size": 1}, "mbs": 2})
    refs = {r["name"]: (ref_loss, ref_aux, ref_norm) for r in runs}
    refs["pp2_mbs2"] = _reference_micro_batches(hf, batch, [slice(0, 2), slice(2, 4)])
    spec = {"model_dir": path, "data": str(tmp_path / "batch.pt"), "runs": runs}
    res, rcs, logs, elapsed = launch(2, spec, str(tmp_path / "run"), timeout=300, script=WORKER)
    assert rcs == [0, 0] and all(r is not None for r in res), "\n".join(l[-3000:] for l in logs)
    worst = {k: max(abs(res[r][run["name"]][k] - refs[run["name"]][i]) / max(1.0, abs(refs[run["name"]][i]))
                    for r in range(2) for run in runs)
             for i, k in enumerate(("loss", "aux_loss", "norm"))}
    print(f"[2 ranks: {elapsed:.1f}s; largest relative differences {worst}]")
    for run in runs:
        ref_loss, ref_aux, ref_norm = refs[run["name"]]
        for rank in range(2):
            rec = res[rank][run["name"]]
            assert rec["ok"], rec.get("traceback")
            assert _close(rec["aux_loss"], ref_aux, 1e-6), (run, rank, rec, ref_aux)
            assert _close(rec["metric"], ref_aux, 1e-6), (run, rank, rec, ref_aux)
            assert _close(rec["loss"], ref_loss, 1e-6), (run, rank, rec, ref_loss)
            assert _close(rec["norm"], ref_norm, 1e-5), (run, rank, rec, ref_norm)
            # forward_only (no gradient exchange under PP) reports the same loss and aux loss
            assert _close(rec["eval_loss"], ref_loss, 1e-6), (run, rank, rec, ref_loss)
            assert _close(rec["eval_aux_loss"], ref_aux, 1e-6), (run, rank, rec, ref_aux)
            assert _close(rec["eval_metric"], ref_aux, 1e-6), (run, rank, rec, ref_aux)
            # add_metric's (sum, count) reduce over the layouts like the loss: -mean logp = CE
            assert _close(-rec["mean_logp"], ref_loss - COEF * ref_aux, 1e-6), (run, rank, rec)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_scales_the_aux_gradient_like_the_loss(one_rank, moe_dir, precision):
    """fp16 multiplies the loss by megatron's loss scale before the backward; the aux gradient
    must be scaled the same (MoEAuxLossAutoScaler's scale), or the grad norm moves away from
    transformers' towards the norm without the aux loss (3.06 vs 3.22 here)."""
    path, hf = moe_dir
    batch = _batch()
    ref_loss, ref_aux, ref_norm = _reference(hf, batch)
    no_aux_norm = _reference(hf, batch, output_router_logits=False)[2]
    assert abs(ref_norm - no_aux_norm) > 0.03 * ref_norm
    model = one_rank.MegatronModel(path, mixed_precision=precision)
    if precision == "fp16":
        # the facade's first scale (2**16) overflows this step's loss sum and would be backed off
        # over a few skipped steps; start at a scale that fits, still far from 1
        model.set_optimizer("AdamW", lr=1e-3)
        for opt in getattr(model.optimizer, "chained_optimizers", [model.optimizer]):
            opt.grad_scaler._scale.fill_(64.0)
        assert float(model.optimizer.get_loss_scale()) == 64.0
        model.set_optimizer = lambda *a, **k: None   # _step must keep that optimizer
    out, norm = _step(model, batch)
    assert _close(out["aux_loss"], ref_aux, 2e-2) and _close(out["loss"], ref_loss, 2e-2)
    assert abs(norm - ref_norm) <= 0.01 * ref_norm, (norm, ref_norm, no_aux_norm)


@pytest.mark.multiprocess
def test_pp2_with_tp2_sp_and_with_dp2_equal_transformers(moe_dir, tmp_path):
    """Four ranks: the later stage's routers see a sequence-parallel share of the padding mask
    (megatron cuts it only on the first stage), and the pipeline exchange runs per DP replica."""
    path, hf = moe_dir
    batch = _batch()
    ref = _reference(hf, batch)
    torch.save(batch, str(tmp_path / "batch.pt"))
    runs = [{"name": "pp2_tp2_sp", "mesh": {"pp_size": 2, "tp_size": 2, "etp_size": 2, "sequence_parallel": True}},
            {"name": "pp2_dp2", "mesh": {"pp_size": 2, "dp_size": 2}}]
    spec = {"model_dir": path, "data": str(tmp_path / "batch.pt"), "runs": runs}
    res, rcs, logs, elapsed = launch(4, spec, str(tmp_path / "run"), timeout=300, script=WORKER)
    assert rcs == [0] * 4 and all(r is not None for r in res), "\n".join(l[-3000:] for l in logs)
    print(f"[4 ranks: {elapsed:.1f}s]")
    for run in runs:
        for rank in range(4):
            rec = res[rank][run["name"]]
            assert rec["ok"], rec.get("traceback")
            for key, want, rel in (("loss", ref[0], 1e-6), ("aux_loss", ref[1], 1e-6), ("norm", ref[2], 1e-5),
                                   ("eval_loss", ref[0], 1e-6), ("eval_aux_loss", ref[1], 1e-6)):
                assert _close(rec[key], want, rel), (run, rank, key, rec[key], want)
