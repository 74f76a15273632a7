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
        ids, labels, c0, m0, _ = batches[0]
        model.zero_grad()
        model.forward_only(inputs={"input_ids": ids, "labels": labels})    # evaluation reports it too
        ev = model.calculate_metric(is_training=False)
        assert (ev["correct_tokens"], ev["total_tokens"]) == (int(c0.sum()), int(m0.sum()))
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
    each rank has half of the rows, the counts are summed over the ranks; PP2: the last stage
    counts, both ranks report; CP2: each rank's share of the positions gathered, counted once."""
    pytest.importorskip("megatron.core")
    from tests.megatron_workers.protocol import ROOT, launch
    hf = hf_float64(tiny_dir)
    ids, labels, correct, mask, gap = greedy_batch(hf, 4, 10, 3)
    assert gap > 1e-4 and 0 < int(correct.sum()) < int(mask.sum())
    torch.save({"ids": ids, "labels": labels}, str(tmp_path / "data.pt"))
    runs = [{"name": f"acc_{n}", "kind": "accuracy", "mesh": mesh, "fused": fused}
            for n, mesh, fused in (("tp2", {"tp_size": 2}, False), ("tp2_fused", {"tp_size": 2}, True),
                                   ("dp2", {"dp_size": 2}, True), ("pp2", {"pp_size": 2}, True),
                                   ("cp2", {"cp_size": 2}, False))]
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


# ---- task='embedding' --------------------------------------------------------------------------

def infonce_reference(emb, labels, temperature, use_batch=True, mask_fake_negative=False, margin=0.1,
                      include_qq=False, include_dd=False, hard_negatives=None):
    """Upstream's InfonceLoss (twinkle/loss/infonce.py) on [n, H] unit embeddings, written out
    group by group in float64: the mean over groups of the cross entropy with the positive as
    target (groups: a 1 and the 0s after it)."""
    starts = [i for i, v in enumerate(labels) if v == 1]
    groups = [emb[a:b] for a, b in zip(starts, starts[1:] + [len(labels)])]
    if hard_negatives is not None:
        groups = [g[:hard_negatives + 2] for g in groups]
    total = 0.0
    if not use_batch:
        for g in groups:
            total = total + torch.nn.functional.cross_entropy((g[0] @ g[1:].T / temperature)[None],
                                                              torch.tensor([0]))
        return total / len(groups)
    bank = torch.cat([g[1:] for g in groups])
    queries = torch.stack([g[0] for g in groups])
    at = 0
    for i, g in enumerate(groups):
        qd = g[0] @ bank.T
        thr = qd[at] + margin
        parts = [torch.where(qd > thr, torch.tensor(float("-inf"), dtype=qd.dtype), qd) if mask_fake_negative else qd]
        if include_qq:
            qq = (g[0] @ queries.T).clone()
            qq[i] = float("-inf")
            if mask_fake_negative:
                qq = torch.where(qq > thr, torch.tensor(float("-inf"), dtype=qq.dtype), qq)
            parts.append(qq)
        if include_dd:
            dd = (g[1] @ bank.T).clone()
            dd[at] = float("-inf")
            parts.append(dd)
        row = torch.cat(parts) / temperature
        total = total + torch.nn.functional.cross_entropy(row[None], torch.tensor([at]))
        at += len(g) - 1
    return total / len(groups)


def sentences(sizes, seed, vocab=256, shortest=3, longest=9):
    """Samples in upstream's embedding form: token ids of different lengths, attention_mask,
    position_ids, and group labels, groups of ``sizes`` (anchor, positive, negatives)."""
    g = torch.Generator().manual_seed(seed)
    labels = []
    for k in sizes:
        labels += [1] + [0] * (k - 1)
    out = []
    for lab in labels:
        length = int(torch.randint(shortest, longest + 1, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "attention_mask": [1] * length, "labels": [lab],
                    "position_ids": list(range(length))})
    return out


def hf_embeddings(hf_base, samples):
    """The float64 transformers base model's last hidden state (after its final norm) at each
    sample's last token, L2-normalised -> [n, H] (differentiable)."""
    out = []
    for s in samples:
        h = hf_base(input_ids=torch.tensor([s["input_ids"]])).last_hidden_state[0, -1]
        out.append(torch.nn.functional.normalize(h, dim=0))
    return torch.stack(out)


def hf_base_float64(path):
    from transformers import AutoModel
    return AutoModel.from_pretrained(path, torch_dtype=torch.float64)


def test_infonce_equals_upstream_reference():
    from twinkle_megatron.training import embedding
    g = torch.Generator().manual_seed(8)
    emb = torch.nn.functional.normalize(torch.randn(12, 16, generator=g, dtype=torch.float64), dim=1)
    cut = [0, 1, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0]     # every group with a negative: hard_negatives=1 cuts two
    for kw in [dict(use_batch=False), dict(), dict(include_qq=True), dict(include_dd=True),
               dict(mask_fake_negative=True, fake_neg_margin=0.05, include_qq=True, include_dd=True),
               dict(hard_negatives=1), dict(hard_negatives=1, use_batch=False)]:
        labels = cut if "hard_negatives" in kw else [0, 1, 0, 0, 1, 0, 1, 0, 0, 0, 1, 0]
        loss = embedding.InfonceLoss(temperature=0.07, **kw)
        groups = embedding.groups_of(labels, loss.hard_negatives)
        got = embedding.infonce(emb, groups, loss) / len(groups)
        want = infonce_reference(emb, labels, 0.07, use_batch=loss.use_batch,
                                 mask_fake_negative=loss.mask_fake_negative, margin=loss.fake_neg_margin,
                                 include_qq=loss.include_qq, include_dd=loss.include_dd,
                                 hard_negatives=loss.hard_negatives)
        assert abs(float(got) - float(want)) <= 1e-12 * max(1, abs(float(want))), (kw, float(got), float(want))
    # fake-negative masking changes the loss here (the test tells it apart)
    labels = [0, 1, 0, 0, 1, 0, 1, 0, 0, 0, 1, 0]
    plain = embedding.infonce(emb, embedding.groups_of(labels), embedding.InfonceLoss(temperature=0.07))
    masked = embedding.infonce(emb, embedding.groups_of(labels),
                               embedding.InfonceLoss(temperature=0.07, mask_fake_negative=True, fake_neg_margin=0.01))
    assert float(masked) < float(plain)
    with pytest.raises(ValueError, match="has no positive"):
        embedding.groups_of([1, 0, 1])
    with pytest.raises(ValueError, match="fewer than hard_negatives=2"):
        embedding.groups_of([1, 0, 0, 1, 0, 0, 0], 2)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        embedding.InfonceLoss(temperature=0)
    with pytest.raises(ValueError, match="fake_neg_margin must be > 0"):
        embedding.InfonceLoss(mask_fake_negative=True, fake_neg_margin=0.0)
    with pytest.raises(TypeError, match="process_group is not taken"):
        embedding.InfonceLoss(process_group=object())


def test_embedding_metric_formula():
    g = torch.Generator().manual_seed(5)
    labels = torch.tensor([1, 0, 0, 1, 0, 1, 0])
    emb = torch.nn.functional.normalize(torch.randn(7, 8, generator=g, dtype=torch.float64), dim=1)
    m = metrics.EmbeddingMetric()
    pairs = m(metrics.SentenceInputs(emb, labels))
    got = {k: float(s) if k in m.max_names else float(s) / float(c) for k, (s, c) in pairs.items()}
    got.update(m.derive(got))
    a, p = emb[[0, 3, 5]], emb[[1, 4, 6]]
    cos = (a * p).sum(1)
    sim = a @ p.T
    want = {"pos_sim": cos.mean(), "pos_sim_min": cos.min(), "pos_sim_max": cos.max(),
            "neg_sim": sim[~torch.eye(3, dtype=torch.bool)].mean()}
    for k, v in want.items():
        assert abs(got[k] - float(v)) <= 1e-12, k


@pytest.mark.multiprocess
@pytest.mark.parametrize("use_batch", [True, False])
def test_embedding_task_against_transformers(tiny_dir, use_batch):
    """forward_only / forward_backward(task='embedding') on one rank: the embeddings, the InfoNCE
    loss, EmbeddingMetric and the gradient norm against the float64 transformers base model of the
    same weights, with the same loss written from upstream's definition; two micro-batches."""
    pytest.importorskip("megatron.core")
    from conftest import megatron_one_rank
    hf = hf_base_float64(tiny_dir)
    samples = sentences([2, 3, 2, 3], 11)
    labels = [s["labels"][0] for s in samples]
    halves = [samples[:5], samples[5:]]
    ref_emb = hf_embeddings(hf, samples)
    losses_ref = [infonce_reference(hf_embeddings(hf, h), [s["labels"][0] for s in h], 0.05, use_batch=use_batch)
                  for h in halves]
    n_groups = [sum(s["labels"][0] for s in h) for h in halves]
    mean_loss = sum(l * n for l, n in zip(losses_ref, n_groups)) / sum(n_groups)
    hf.zero_grad()
    mean_loss.backward()
    ref_norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in hf.parameters() if p.grad is not None))
    with megatron_one_rank() as tm:
        model = tm.MegatronModel(model_id=tiny_dir, mixed_precision="fp32")
        model.set_optimizer("AdamW", lr=1e-3)
        out = model.forward_only(inputs=samples, task="embedding", return_logits=True)
        assert out["embeddings"].shape == ref_emb.shape
        assert (out["embeddings"].double() - ref_emb).abs().max() < 2e-5
        model.set_loss("InfonceLoss", temperature=0.05, use_batch=use_batch)
        model.add_metric("EmbeddingMetric", is_training=True)
        res = model.forward_backward(inputs=samples, task="embedding", micro_batch_size=5)
        norm = model.clip_grad_and_step(max_grad_norm=None)
        got = model.calculate_metric()
    assert res["count"] == sum(n_groups) == sum(labels)
    assert abs(res["loss"] - float(mean_loss)) < 2e-5 * max(1, float(mean_loss))
    assert abs(got["loss"] - float(mean_loss)) < 2e-5 * max(1, float(mean_loss))
    assert abs(norm - ref_norm) < 1e-4 * ref_norm, (norm, ref_norm)
    # EmbeddingMetric over each micro-batch's pairs
    cos, neg, negn = [], 0.0, 0
    for h, off in ((halves[0], 0), (halves[1], 5)):
        e = ref_emb[off:off + len(h)].detach()
        lab = torch.tensor([s["labels"][0] for s in h])
        idx = torch.nonzero(lab == 1).reshape(-1)
        idx = idx[idx + 1 < len(lab)]
        c = (e[idx] * e[idx + 1]).sum(1)
        cos.append(c)
        sim = e[idx] @ e[idx + 1].T
        neg += float(sim[~torch.eye(len(idx), dtype=torch.bool)].sum())
        negn += len(idx) * (len(idx) - 1)
    cos = torch.cat(cos)
    want = {"pos_sim": float(cos.mean()), "pos_sim_min": float(cos.min()), "pos_sim_max": float(cos.max()),
            "neg_sim": neg / negn}
    for k, v in want.items():
        assert abs(got[k] - v) < 2e-5, (k, got[k], v)
        assert abs(res[k] - v) < 2e-5, (k, res[k], v)


def embedding_reference(hf, samples, parts, loss_kw):
    """(embeddings [n, H], mean loss over the groups, pre-clip grad norm, EmbeddingMetric values)
    of the float64 transformers base model for the contrastive batches ``parts`` (lists of row
    indices of ``samples``: each one micro-batch over every data-parallel rank)."""
    emb = hf_embeddings(hf, samples)
    total, groups, cos, neg, negn = 0.0, 0, [], 0.0, 0
    for rows in parts:
        lab = [samples[i]["labels"][0] for i in rows]
        n = sum(lab)
        total = total + infonce_reference(emb[rows], lab, **loss_kw) * n
        groups += n
        e, t = emb[rows].detach(), torch.tensor(lab)
        idx = torch.nonzero(t == 1).reshape(-1)
        idx = idx[idx + 1 < len(t)]
        cos.append((e[idx] * e[idx + 1]).sum(1))
        sim = e[idx] @ e[idx + 1].T
        neg += float(sim[~torch.eye(len(idx), dtype=torch.bool)].sum())
        negn += len(idx) * (len(idx) - 1)
    mean = total / groups
    hf.zero_grad()
    mean.backward()
    norm = math.sqrt(sum(float((p.grad ** 2).sum()) for p in hf.parameters() if p.grad is not None))
    cos = torch.cat(cos)
    metric = {"pos_sim": float(cos.mean()), "pos_sim_min": float(cos.min()), "pos_sim_max": float(cos.max()),
              "neg_sim": neg / negn}
    return emb.detach(), float(mean), norm, metric


@pytest.mark.multiprocess
def test_embedding_task_under_parallel_layouts(tiny_dir, tmp_path):
    """task='embedding' on two ranks: TP2 (and with sequence parallelism: the sequence gathered
    before pooling), PP2 (the last stage pools and broadcasts), CP2 (each rank's share of the
    positions gathered), DP2 (the in-batch negatives gathered over the data-parallel ranks): the
    embeddings, the loss, the gradient norm and EmbeddingMetric against the float64 transformers
    model, as one process sees them."""
    pytest.importorskip("megatron.core")
    from tests.megatron_workers.protocol import ROOT, launch
    hf = hf_base_float64(tiny_dir)
    samples = sentences([3, 3, 3, 3], 21)
    loss_kw = {"temperature": 0.05, "use_batch": True, "include_qq": True}
    torch.save({"sentences": samples}, str(tmp_path / "data.pt"))
    one = embedding_reference(hf, samples, [list(range(6)), list(range(6, 12))], dict(loss_kw))
    # DP2: rank r holds rows 6r .. 6r + 5 in micro-batches of 3; micro-batch k over both ranks
    dp_parts = [[0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 10, 11]]
    dp = embedding_reference(hf, samples, dp_parts, dict(loss_kw))
    # use_batch=False: each group's own documents only, the mean over every rank's groups
    local_kw = dict(loss_kw, use_batch=False)
    dp_local = embedding_reference(hf, samples, dp_parts, dict(local_kw))
    runs = [{"name": n, "kind": "embedding", "mesh": mesh, "loss": loss_kw, "micro_batch_size": mbs}
            for n, mesh, mbs in (("tp2", {"tp_size": 2}, 6), ("tp2_sp", {"tp_size": 2, "sequence_parallel": True}, 6),
                                 ("pp2", {"pp_size": 2}, 6), ("cp2", {"cp_size": 2}, 6), ("dp2", {"dp_size": 2}, 3))]
    runs.append({"name": "dp2_local", "kind": "embedding", "mesh": {"dp_size": 2}, "loss": local_kw,
                 "micro_batch_size": 3})
    spec = {"data": str(tmp_path / "data.pt"), "model_dir": tiny_dir, "runs": runs}
    res, rcs, logs, _ = launch(2, spec, str(tmp_path / "run"), timeout=500,
                               script=os.path.join(ROOT, "tests", "megatron_workers", "tasks_worker.py"))
    assert rcs == [0, 0] and all(r is not None for r in res), "\n".join(l[-3000:] for l in logs)
    for run in runs:
        emb, loss, norm, metric = {"dp2": dp, "dp2_local": dp_local}.get(run["name"], one)
        for r in res:
            rec = r[run["name"]]
            assert rec["ok"], rec.get("traceback")
            a, b = rec["rows"]
            got = torch.tensor(rec["embeddings"], dtype=torch.float64)
            assert (got - emb[a:b]).abs().max() < 2e-5, run["name"]
            assert abs(rec["call"]["loss"] - loss) < 2e-5 * max(1, loss), (run["name"], rec["call"]["loss"], loss)
            assert abs(rec["metric"]["loss"] - loss) < 2e-5 * max(1, loss), run["name"]
            assert abs(rec["grad_norm"] - norm) < 1e-4 * norm, (run["name"], rec["grad_norm"], norm)
            for k, v in metric.items():
                assert abs(rec["metric"][k] - v) < 2e-5, (run["name"], k, rec["metric"][k], v)


@pytest.mark.multiprocess
def test_embedding_task_refusals_and_lora(tiny_dir):
    """Bad embedding calls are clear errors that leave nothing behind; the InfoNCE loss does not
    run on token rows; a LoRA adapter trains on sentence rows (its B = 0 start: the base model's
    embeddings; after one step they move)."""
    pytest.importorskip("megatron.core")
    from conftest import megatron_one_rank
    from peft import LoraConfig
    samples = sentences([2, 3], 31)
    hf = hf_base_float64(tiny_dir)
    ref = hf_embeddings(hf, samples).detach()
    tokens = {"input_ids": torch.randint(0, 256, (2, 6)), "labels": torch.randint(0, 256, (2, 6))}
    with megatron_one_rank() as tm:
        model = tm.MegatronModel(model_id=tiny_dir, mixed_precision="fp32")
        model.add_adapter_to_model("emb", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        model.set_optimizer("AdamW", lr=1e-2)
        with pytest.raises(ValueError, match=r"trains with set_loss\('InfonceLoss'"):
            model.forward_backward(inputs=samples, task="embedding")
        model.set_loss("InfonceLoss", temperature=0.1)
        with pytest.raises(ValueError, match="the loss 'infonce' is task='embedding''s"):
            model.forward_backward(inputs=tokens)
        assert "loss" in model.forward_only(inputs=tokens)        # cross entropy reported
        with pytest.raises(TypeError, match=r"\['return_logps', 'temperature'\] do not apply"):
            model.forward_backward(inputs=samples, task="embedding", return_logps=True, temperature=0.5)
        with pytest.raises(TypeError, match=r"\['advantages'\] do not apply"):
            model.forward_backward(inputs=samples, task="embedding", advantages=torch.ones(5))
        bad = [dict(s, labels=[2]) for s in samples]
        with pytest.raises(ValueError, match=r"labels must be 1 \(starts a group"):
            model.forward_backward(inputs=bad, task="embedding")
        lonely = [dict(s, labels=[1]) for s in samples]
        with pytest.raises(ValueError, match="has no positive"):
            model.forward_backward(inputs=lonely, task="embedding")
        with pytest.raises(ValueError, match="needs each sentence's group label"):
            model.forward_backward(inputs=[{"input_ids": s["input_ids"]} for s in samples], task="embedding")
        with pytest.raises(ValueError, match="attention_mask must be right padding"):
            model.forward_backward(inputs={"input_ids": torch.ones(2, 3, dtype=torch.long),
                                           "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
                                           "labels": torch.tensor([1, 0])}, task="embedding")
        assert model.calculate_metric()["num_tokens"] == 0      # the refused calls left no trace
        before = model.forward_only(inputs=samples, task="embedding")["embeddings"]
        assert (before.double() - ref).abs().max() < 2e-5
        res = model.forward_backward(inputs=samples, task="embedding")
        assert res["count"] == 2 and res["loss"] > 0
        norm = model.clip_grad_and_step(max_grad_norm=1.0)
        assert math.isfinite(norm) and norm > 0
        after = model.forward_only(inputs=samples, task="embedding")["embeddings"]
        assert (after - before).abs().max() > 1e-4
        got = model.calculate_metric()
        assert got["num_tokens"] == sum(len(s["input_ids"]) for s in samples)
