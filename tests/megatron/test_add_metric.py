"""``MegatronModel.add_metric``: a user metric from the per-token outputs, (sum, count) reduced
exactly over micro-batches and calls (DP2 / EP2 / TP2+SP / CP2: tests/megatron/test_moe_aux_loss.py)."""
import pytest
import torch

pytest.importorskip("megatron.core")

from conftest import megatron_one_rank  # noqa: E402


@pytest.fixture(scope="module")
def model():
    from twinkle_megatron.job.configs import tiny_qwen3_config
    with megatron_one_rank() as tm:
        m = tm.MegatronModel(model_id=tiny_qwen3_config(num_layers=1), mixed_precision="fp32")
        m.set_optimizer("AdamW", lr=1e-3)
        yield m


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (4, 10), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    labels[2, 7:] = -100
    return {"input_ids": ids, "labels": labels}


def _token_mean(key):
    return lambda x: ((getattr(x, key) * x.loss_mask).sum(), x.loss_mask.sum())


def test_metric_is_total_sum_over_total_count(model):
    batch = _batch()
    model.add_metric("mean_logp", _token_mean("logps"))
    model.add_metric("mean_ent", _token_mean("entropy"), needs_entropy=True)
    # the advantage of each loss token, weighted per token (GRPO's advantages are per sample)
    model.add_metric("adv_per_token", _token_mean("advantages"))
    model.set_loss("grpo")
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0])
    mask = batch["labels"] != -100
    mask[:, 0] = False
    out = model.forward_backward(inputs=batch, advantages=adv, micro_batch_size=1, return_entropy=True)
    model.zero_grad()
    lp, ent = out["logps"].double(), out["entropy"].double()
    assert abs(out["mean_logp"] - float((lp * mask).sum() / mask.sum())) <= 1e-6
    assert abs(out["mean_ent"] - float((ent * mask).sum() / mask.sum())) <= 1e-6
    want_adv = float((adv[:, None] * mask).sum() / mask.sum())
    assert abs(out["adv_per_token"] - want_adv) <= 1e-6
    assert out["mean_ent"] > 0 and out["mean_logp"] < 0
    model.calculate_metric()
    # two calls of unequal token counts: the metric is their pooled token mean, not the mean of means
    model.set_loss("cross_entropy")
    del model.train_state().user_metrics["adv_per_token"]
    outs = [model.forward_backward(inputs={k: v[rows] for k, v in batch.items()})
            for rows in (slice(0, 1), slice(1, 4))]
    model.zero_grad()
    metric = model.calculate_metric()
    assert abs(metric["mean_logp"] - out["mean_logp"]) <= 1e-6
    assert abs(outs[0]["mean_logp"] + outs[0]["loss"]) <= 1e-6     # CE = -mean logp
    # forward_only reports it too
    fo = model.forward_only(inputs=batch)
    assert abs(fo["mean_logp"] - out["mean_logp"]) <= 1e-6
    assert abs(model.calculate_metric(is_training=False)["mean_logp"] - out["mean_logp"]) <= 1e-6


def test_bad_metrics_are_clear_errors(model):
    with pytest.raises(ValueError, match="loss"):
        model.add_metric("loss", _token_mean("logps"))
    with pytest.raises(TypeError, match="callable"):
        model.add_metric("m", 3)
    with pytest.raises(TypeError, match="name"):
        model.add_metric("", _token_mean("logps"))
    model.add_metric("clip_frac", _token_mean("logps"))   # clashes with GRPO's own metric
    model.set_loss("grpo")
    with pytest.raises(ValueError, match="clip_frac"):
        model.forward_only(inputs=_batch(), advantages=torch.zeros(4))
    del model.train_state().user_metrics["clip_frac"]
    model.set_loss("cross_entropy")
    model.add_metric("bad", lambda x: x.logps.sum())
    with pytest.raises(TypeError, match="bad"):
        model.forward_backward(inputs=_batch())
    del model.train_state().user_metrics["bad"]
    model.zero_grad()
    model.forward_backward(inputs=_batch())   # nothing left behind
    model.zero_grad()
