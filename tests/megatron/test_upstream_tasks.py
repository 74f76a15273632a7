"""Upstream Twinkle's remaining metric objects: ``Accuracy`` (token accuracy, through
``add_metric``) and ``CompletionRewardMetric`` (the RL driver's record), each against a float64
plain-torch formula; the accuracy's argmax against the transformers model of the same weights,
on one rank (fused and unfused LM head) and under TP2 and DP2 (tests/megatron_workers/tasks_worker.py)."""
import math
import os
import statistics

import pytest
import torch

from twinkle_megatron.training import losses, metrics


def _reported(pairs, totals=()):
    return {k: float(s) if k in totals else float(s) / float(c) for k, (s, c) in pairs.items() if float(c)}


def test_accuracy_metric_formula():
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(3, 9, generator=g) > 0.3
    mask[:, 0] = False
    correct = torch.rand(3, 9, generator=g) > 0.5
    x = losses.LossInputs(logps=torch.zeros(3, 9), loss_mask=mask, segment_ids=torch.zeros(3, 9, dtype=torch.long),
                          num_segments=3, argmax_correct=correct)
    m = metrics.Accuracy()
    got = _reported(m(x), m.total_names)
    n, c = int(mask.sum()), int((correct & mask).sum())
    assert got == {"accuracy": c / n, "correct_tokens": c, "total_tokens": n} and 0 < c < n
    with pytest.raises(RuntimeError, match="argmax_correct was not computed"):
        m(losses.LossInputs(logps=x.logps, loss_mask=mask, segment_ids=x.segment_ids, num_segments=3))
    with pytest.raises(ValueError, match="Accuracy: ignore_index=-1"):
        metrics.Accuracy(ignore_index=-1)
    assert isinstance(metrics.resolve_metric("accuracy", {}), metrics.Accuracy)


def test_completion_reward_metric_matches_upstream_formulas():
    g = torch.Generator().manual_seed(4)
    m = metrics.CompletionRewardMetric(None, None)
    assert m.calculate() == {}
    acc = [[float(v) for v in torch.randint(0, 2, (5,), generator=g)] for _ in range(2)]
    fmt = torch.rand(5, generator=g, dtype=torch.float64)
    lengths = [[17, 40, 3, 22, 9], [31, 8]]
    m.accumulate(None, None, rewards={"accuracy": acc[0], "format": fmt}, completion_lengths=lengths[0],
                 generate_time=2.5)
    m.accumulate(rewards={"accuracy": acc[1]}, completion_lengths=lengths[1], generate_time=1.5,
                 weight_sync_time=0.25)
    a = acc[0] + acc[1]
    want = {"train/accuracy_reward": statistics.fmean(a), "train/accuracy_reward_std": statistics.stdev(a),
            "train/format_reward": float(fmt.mean()), "train/format_reward_std": float(fmt.std()),
            "train/completion_length": statistics.fmean(lengths[0] + lengths[1]),
            "profiling/Time taken: generate": 2.0, "profiling/Time taken: move_model_to_sampler": 0.25}
    got = m.calculate()
    assert set(got) == set(want)
    for k in want:
        assert abs(got[k] - want[k]) <= 1e-12 * max(1, abs(want[k])), (k, got[k], want[k])
    m.reset()
    m.accumulate(rewards={"r": [0.5]})
    assert m.calculate() == {"train/r_reward": 0.5, "train/r_reward_std": 0.0}
    with pytest.raises(TypeError, match="rewards must be a dict"):
        m.accumulate(rewards=[1.0])
    with pytest.raises(TypeError, match=r"rewards\['r'\] must be a sequence of numbers"):
        m.accumulate(rewards={"r": ["high"]})
    with pytest.raises(ValueError, match="completion_lengths has a non-finite value"):
        m.accumulate(rewards={"r": [1.0]}, completion_lengths=[float("nan")])
    assert m.calculate() == {"train/r_reward": 0.5, "train/r_reward_std": 0.0}   # bad calls recorded nothing


# ---- token accuracy through the facade -------------------------------------------------------

def greedy_batch(hf, rows: int, length: int, seed: int):
    """[rows, length] ids where about half the positions are the float64 transformers model's
    argmax after their prefix (the rest random), labels = ids with a prompt of 2 masked; and the
    reference: whether each label is the argmax of the logits before it, with the smallest gap
    between the top two logits over the loss positions (the facade's fp32 argmax must agree)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, hf.config.vocab_size, (rows, length), generator=g)
    with torch.no_grad():
        for t in range(1, length):
            pick = torch.rand(rows, generator=g) < 0.5
            nxt = hf(input_ids=ids[:, :t]).logits[:, -1].argmax(-1)
            ids[:, t] = torch.where(pick, nxt, ids[:, t])
        logits = hf(input_ids=ids).logits.double()
    labels = ids.clone()
    labels[:, :2] = -100
    labels[rows - 1, length - 3:] = -100
    mask = labels != -100
    mask[:, 0] = False
    top2 = logits[:, :-1].topk(2, dim=-1).values
    gap = (top2[..., 0] - top2[..., 1])[mask[:, 1:]].min()
    correct = torch.zeros_like(mask)
    correct[:, 1:] = logits[:, :-1].argmax(-1) == labels[:, 1:]
    return ids, labels, correct & mask, mask, float(gap)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen3Config
    from twinkle_megatron.job.configs import tiny_qwen3_config
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("tasks") / "model")
    AutoModelForCausalLM.from_config(Qwen3Config(**tiny_qwen3_config(num_layers=2))).save_pretrained(path)
    return path


def hf_float64(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float64).eval()


@pytest.mark.multiprocess
@pytest.mark.parametrize("fused", [False, True])
def test_accuracy_through_calls_and_calculate_metric(tiny_dir, fused):
    pytest.importorskip("megatron.core")
    from conftest import megatron_one_rank
    hf = hf_float64(tiny_dir)
    batches = [greedy_batch(hf, 4, 10, seed) for seed in (1, 2)]
    for *_, gap in batches:
        assert gap > 1e-4, "a near tie between the top two logits: pick another seed"
    with megatron_one_rank() as tm:
        model = tm.MegatronModel(model_id=tiny_dir, mixed_precision="fp32", fused_linear_ce=fused)
        model.set_optimizer("AdamW", lr=1e-3)
        model.add_metric(metrics.Accuracy)      # upstream's class form
        outs = [model.forward_backward(inputs={"input_ids": ids, "labels": labels}, micro_batch_size=2)
                for ids, labels, *_ in batches]
        got = model.calculate_metric()
    correct = sum(int(c.sum()) for _, _, c, _, _ in batches)
    total = sum(int(m.sum()) for _, _, _, m, _ in batches)
    assert 0 < correct < total
    assert got["accuracy"] == correct / total
    assert (got["correct_tokens"], got["total_tokens"]) == (correct, total)
    for out, (_, _, c, m, _) in zip(outs, batches):      # each call's own result
        assert (out["correct_tokens"], out["total_tokens"], out["accuracy"]) == (
            int(c.sum()), int(m.sum()), int(c.sum()) / int(m.sum()))


@pytest.mark.multiprocess
def test_accuracy_under_tensor_and_data_parallel(tiny_dir, tmp_path):
    """TP2: each rank holds half of the vocabulary, the argmax is merged over the TP group; DP2:
    each rank has half of the rows, the counts are summed over the ranks."""
    pytest.importorskip("megatron.core")
    from tests.megatron_workers.protocol import ROOT, launch
    hf = hf_float64(tiny_dir)
    ids, labels, correct, mask, gap = greedy_batch(hf, 4, 10, 3)
    assert gap > 1e-4 and 0 < int(correct.sum()) < int(mask.sum())
    torch.save({"ids": ids, "labels": labels}, str(tmp_path / "data.pt"))
    runs = [{"name": f"acc_{n}", "kind": "accuracy", "mesh": mesh, "fused": fused}
            for n, mesh, fused in (("tp2", {"tp_size": 2}, False), ("tp2_fused", {"tp_size": 2}, True),
                                   ("dp2", {"dp_size": 2}, True))]
    spec = {"data": str(tmp_path / "data.pt"), "model_dir": tiny_dir, "runs": runs}
    res, rcs, logs, _ = launch(2, spec, str(tmp_path / "run"), timeout=400,
                               script=os.path.join(ROOT, "tests", "megatron_workers", "tasks_worker.py"))
    assert rcs == [0, 0] and all(r is not None for r in res), "\n".join(l[-3000:] for l in logs)
    want = {"accuracy": int(correct.sum()) / int(mask.sum()), "correct_tokens": int(correct.sum()),
            "total_tokens": int(mask.sum())}
    for run in runs:
        for r in res:
            rec = r[run["name"]]
            assert rec["ok"], rec.get("traceback")
            assert {k: rec["metric"][k] for k in want} == want, run["name"]
            assert {k: rec["call"][k] for k in want} == want, run["name"]
