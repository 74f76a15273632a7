"""Upstream Twinkle's ``return_logits=True``: ``forward_only`` / ``forward_backward`` return the
model's full-vocabulary logits [B, S, V] fp32 as a model returns them (position t predicts token
t + 1), against transformers (float64, same weights) on plain and packed rows, fused LM head and
not; TP2, TP2+SP, CP2 and PP2 on two gloo ranks (tests/megatron_workers/logits_worker.py).
Upstream's ``task=``: 'causal_lm' runs, 'embedding' takes sentence rows (tests/megatron/test_upstream_tasks.py)."""
import os

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

from conftest import megatron_one_rank  # noqa: E402
from tests.megatron_workers.protocol import ROOT, launch  # noqa: E402
from tests.megatron.test_gkd import LAYOUTS  # noqa: E402

B, S = 3, 12
TOL = 1e-5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from twinkle_megatron.job.configs import tiny_qwen3_config
    cfg = tiny_qwen3_config(num_layers=2)
    root = tmp_path_factory.mktemp("logits")
    path = str(root / "model")
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**cfg)).float()
    hf.save_pretrained(path)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 259, (B, S), generator=g)
    labels = ids.clone()
    labels[:, :2] = -100
    p_ids, p_labels, p_pos = [], [], []
    for n1, n2 in [(7, 5), (6, 6), (8, 4)]:
        row = torch.randint(0, 259, (n1 + n2,), generator=g)
        lab = row.clone()
        lab[0] = lab[n1] = -100
        p_ids.append(row), p_labels.append(lab), p_pos.append(torch.cat([torch.arange(n1), torch.arange(n2)]))
    data = {"ids": ids, "labels": labels, "p_ids": torch.stack(p_ids), "p_labels": torch.stack(p_labels),
            "p_pos": torch.stack(p_pos)}
    torch.save(data, str(root / "data.pt"))
    with megatron_one_rank() as tm:
        models = {f: tm.MegatronModel(path, mixed_precision="fp32", fused_linear_ce=f) for f in (False, True)}
        yield {"hf": hf.double(), "path": path, "root": root, "data": data, "models": models}


def reference_logits(hf, ids, position_ids=None):
    """transformers' [B, S, V] float64 logits, each packed sample run alone (position t: after the
    tokens up to t)."""
    out = torch.zeros(*ids.shape, hf.config.vocab_size, dtype=torch.float64)
    with torch.no_grad():
        for r in range(ids.shape[0]):
            starts = [0] if position_ids is None else (position_ids[r] == 0).nonzero().reshape(-1).tolist()
            for a, b in zip(starts, starts[1:] + [ids.shape[1]]):
                out[r, a:b] = hf(input_ids=ids[r:r + 1, a:b]).logits[0]
    return out


def _err(got, want):
    return float((got.double() - want).abs().max())


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_return_logits_equal_transformers(setup, fused):
    model, d, hf = setup["models"][fused], setup["data"], setup["hf"]
    out = model.forward_only(inputs={"input_ids": d["ids"], "labels": d["labels"]}, return_logits=True,
                             temperature=2.0)
    want = reference_logits(hf, d["ids"])
    assert out["logits"].dtype == torch.float32 and tuple(out["logits"].shape) == (B, S, hf.config.vocab_size)
    assert _err(out["logits"], want) <= TOL
    # the logps of the same call are read from them (at the call's temperature), one position on
    lsm = torch.log_softmax(out["logits"][:, :-1].double() / 2.0, -1)
    lp = lsm.gather(-1, d["labels"][:, 1:].clamp(min=0)[..., None])[..., 0] * (d["labels"][:, 1:] != -100)
    assert float((lp - out["logps"][:, 1:].double()).abs().max()) <= TOL
    packed = {"input_ids": d["p_ids"], "labels": d["p_labels"], "position_ids": d["p_pos"]}
    out = model.forward_only(inputs=packed, return_logits=True, micro_batch_size=1)
    assert _err(out["logits"], reference_logits(hf, d["p_ids"], d["p_pos"])) <= TOL
    assert "logits" not in model.forward_only(inputs=packed)


def test_forward_backward_return_logits(setup):
    model, d, hf = setup["models"][True], setup["data"], setup["hf"]
    model.set_optimizer("AdamW", lr=1e-3)
    out = model.forward_backward(inputs={"input_ids": d["ids"], "labels": d["labels"]}, return_logits=True,
                                 micro_batch_size=1)
    model.zero_grad()
    assert _err(out["logits"], reference_logits(hf, d["ids"])) <= TOL
    assert "logits" not in model.forward_backward(inputs={"input_ids": d["ids"], "labels": d["labels"]})
    model.zero_grad()


def test_task_keyword(setup):
    model, d = setup["models"][False], setup["data"]
    inputs = {"input_ids": d["ids"], "labels": d["labels"]}
    base = model.forward_only(inputs=inputs)["logps"]
    assert torch.equal(model.forward_only(inputs=inputs, task="causal_lm")["logps"], base)
    for call in (model.forward_only, model.forward_backward):
        with pytest.raises(ValueError, match="task='embedding'"):
            # token labels (and the cross entropy loss): task='embedding' takes sentence rows and InfonceLoss
            call(inputs=inputs, task="embedding")
        with pytest.raises(ValueError, match="task must be 'causal_lm'"):
            call(inputs=inputs, task="seq_cls")


@pytest.mark.multiprocess
def test_two_rank_layouts_equal_transformers(setup):
    """TP2 (vocabulary shards gathered), TP2+SP, CP2 (positions gathered as logps are) and PP2
    (broadcast from the last stage), fused head and not: both ranks return transformers' logits."""
    root = setup["root"]
    spec = {"data": str(root / "data.pt"), "model_dir": setup["path"], "runs": LAYOUTS}
    res, rcs, logs, elapsed = launch(2, spec, str(root / "two"), timeout=400,
                                     script=os.path.join(ROOT, "tests", "megatron_workers", "logits_worker.py"))
    assert rcs == [0, 0] and all(r is not None for r in res), "\n".join(l[-3000:] for l in logs)
    d, hf = setup["data"], setup["hf"]
    want = {"plain": reference_logits(hf, d["ids"]), "packed": reference_logits(hf, d["p_ids"], d["p_pos"])}
    worst = 0.0
    for run in LAYOUTS:
        for rank in (0, 1):
            rec = res[rank][run["name"]]
            assert rec["ok"], rec.get("traceback")
            for kind in ("plain", "packed"):
                assert rec[kind]["dtype"] == "torch.float32"
                err = _err(torch.tensor(rec[kind]["logits"]), want[kind])
                assert err <= TOL, (run["name"], rank, kind, err)
                worst = max(worst, err)
    print(f"[return_logits on two ranks ({elapsed:.0f} s): max abs err {worst:.1e}]")
