"""GKD (``set_loss("gkd")``, twinkle_megatron/training/losses.py ``GKDLoss``) with a teacher's top-k:
the loss and its grad norm against a float64 transformers computation of TRL's generalized JSD
over the teacher's top-k support, on the fused LM-head path (the student's head evaluated at the
k ids only) and the unfused one (a gather from the logits); the teacher's alignment (position t
is the distribution of token t, as ``logps``); the argument checks.

One process (in-process gloo rank), then two (tests/megatron_workers/gkd_worker.py: TP2 with the
vocabulary split, TP2+SP, CP2, PP2); the model is the tiny Qwen3 of the job (``tiny_qwen3_config``,
2 layers), fp32, its weights shared with a float64 transformers copy. Mixed-adapter batches: an
adapter trained with GKD in a mixed batch equals it trained alone.
"""
import math
import os

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

from conftest import megatron_one_rank  # noqa: E402
from tests.megatron_workers.protocol import ROOT, launch  # noqa: E402

B, S, K = 3, 12, 6
PROMPTS = [3, 5, 2]
PACKED = [(7, 5), (6, 6), (8, 4)]   # two samples per packed row
TOL = 1e-5


@pytest.fixture(scope="module")
def one_rank():
    with megatron_one_rank() as tm:
        yield tm


@pytest.fixture(scope="module")
def setup(one_rank, tmp_path_factory):
    from twinkle_megatron.job.configs import tiny_qwen3_config
    cfg = tiny_qwen3_config(num_layers=2)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**cfg)).float()
    root = tmp_path_factory.mktemp("gkd")
    path = str(root / "qwen3")
    hf.save_pretrained(path)
    hf = hf.double()
    vocab = cfg["vocab_size"]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 259, (B, S), generator=g)
    labels = ids.clone()
    for b, p in enumerate(PROMPTS):
        labels[b, :p] = -100
    labels[2, 10:] = -100                       # a short answer
    # a teacher: its own distribution per position, its top-k ids and log-probs (full normaliser)
    teacher = torch.log_softmax(2.0 * torch.randn(B, S, vocab, generator=g, dtype=torch.float64), -1)
    t_logps, t_ids = teacher.topk(K, -1)
    # the same teacher as full-vocabulary logits as a model returns them: position t predicts t + 1
    t_logits = torch.cat([teacher[:, 1:], 3.0 * torch.randn(B, 1, vocab, generator=g, dtype=torch.float64)], 1)
    # packed rows: position_ids restarting at 0, the second sample's first label -100
    p_ids, p_labels, p_pos = [], [], []
    for n1, n2 in PACKED:
        row = torch.randint(0, 259, (n1 + n2,), generator=g)
        lab = row.clone()
        lab[0] = lab[n1] = -100
        p_ids.append(row), p_labels.append(lab), p_pos.append(torch.cat([torch.arange(n1), torch.arange(n2)]))
    models = {}
    for fused in (False, True):
        m = one_rank.MegatronModel(path, mixed_precision="fp32", fused_linear_ce=fused)
        m.set_optimizer("AdamW", lr=1e-3)
        models[fused] = m
    torch.save({"ids": ids, "labels": labels, "t_logps": t_logps.float(), "t_ids": t_ids,
                "t_logits": t_logits.float()}, str(root / "data.pt"))
    return {"hf": hf, "vocab": vocab, "models": models, "ids": ids, "labels": labels, "root": root, "path": path,
            "t_logps": t_logps.float(), "t_ids": t_ids, "t_logits": t_logits.float(),
            "packed": (torch.stack(p_ids), torch.stack(p_labels), torch.stack(p_pos))}


def _segments(position_ids, s):
    """[(row, start, length)] of each sample (a whole row without position_ids)."""
    if position_ids is None:
        return None
    out = []
    for r, pos in enumerate(position_ids):
        starts = [i for i in range(s) if int(pos[i]) == 0] + [s]
        out += [(r, a, b - a) for a, b in zip(starts, starts[1:])]
    return out


def student_logits(hf, ids, position_ids=None):
    """[B, S, V] float64: position t holds the logits predicting token t (NaN at each sample's
    first position), from transformers run on each sample alone."""
    b, s = ids.shape
    out = torch.full((b, s, hf.config.vocab_size), float("nan"), dtype=torch.float64)
    for r, a, n in _segments(position_ids, s) or [(r, 0, s) for r in range(b)]:
        logits = hf(input_ids=ids[r:r + 1, a:a + n]).logits[0]
        out[r, a + 1:a + n] = logits[:-1]
    return out


def jsd_per_position(s, t, beta):
    """TRL's generalized JSD per position from the student's and teacher's log-probs ``s``, ``t``
    [..., k]: KL(t || s) at beta 0, KL(s || t) at beta 1, else the beta-mixture's."""
    def kl(lp, lq):      # KL(P || Q)
        return (lp.exp() * (lp - lq)).sum(-1)
    if beta == 0:
        return kl(t, s)
    if beta == 1:
        return kl(s, t)
    m = torch.logsumexp(torch.stack([s + math.log(1 - beta), t + math.log(beta)]), 0)
    return beta * kl(t, m) + (1 - beta) * kl(s, m)


def generalized_jsd(z, t_logps, t_ids, labels, beta, temperature):
    """TRL's generalized JSD over the teacher's top-k, token mean over labels != -100 (float64)."""
    mask = labels != -100
    mask[:, 0] = False
    zs = z[mask].gather(-1, t_ids[mask].long())
    s = torch.log_softmax(zs / temperature, -1)
    t = torch.log_softmax(t_logps[mask].double() / temperature, -1)
    return jsd_per_position(s, t, beta).sum() / mask.sum()


def full_vocab_jsd(z, t_logits, labels, beta, temperature):
    """TRL's generalized JSD over the whole vocabulary (float64): the student's logits ``z``
    aligned as logps (position t predicts token t), the teacher's ``t_logits`` as a model returns
    them (position t - 1 predicts token t); token mean over labels != -100."""
    mask = labels != -100
    mask[:, 0] = False
    teacher = torch.cat([torch.zeros_like(t_logits[:, :1]), t_logits[:, :-1]], 1)
    s = torch.log_softmax(z[mask] / temperature, -1)
    t = torch.log_softmax(teacher[mask].double() / temperature, -1)
    return jsd_per_position(s, t, beta).sum() / mask.sum()


def reference(setup, beta, temperature, *, inputs=None, t_logps=None, t_ids=None, t_logits=None):
    """(loss, grad norm) of transformers (float64) on the same batch; with ``t_logits`` against
    that full-vocabulary teacher."""
    hf = setup["hf"]
    inputs = inputs or {"input_ids": setup["ids"], "labels": setup["labels"]}
    hf.zero_grad()
    z = student_logits(hf, inputs["input_ids"], inputs.get("position_ids"))
    if t_logits is not None:
        loss = full_vocab_jsd(z, t_logits, inputs["labels"], beta, temperature)
    else:
        loss = generalized_jsd(z, setup["t_logps"] if t_logps is None else t_logps,
                               setup["t_ids"] if t_ids is None else t_ids, inputs["labels"], beta, temperature)
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in hf.parameters() if p.grad is not None))
    hf.zero_grad()
    return float(loss.detach()), norm


def facade(setup, fused, beta, temperature, *, inputs=None, mbs=None, **teacher):
    model = setup["models"][fused]
    model.set_loss("gkd", beta=beta, temperature=temperature)
    inputs = inputs or {"input_ids": setup["ids"], "labels": setup["labels"]}
    teacher = teacher or {"teacher_topk_logps": setup["t_logps"], "teacher_topk_indices": setup["t_ids"]}
    out = model.forward_backward(inputs=inputs, micro_batch_size=mbs, **teacher)
    norm = model.clip_grad_norm(0)
    model.zero_grad()
    return out, norm


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("beta, temperature", [(0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (0.0, 2.0), (0.5, 2.0),
                                               (1.0, 2.0)])
def test_loss_and_grad_norm_equal_transformers(setup, fused, beta, temperature):
    ref_loss, ref_norm = reference(setup, beta, temperature)
    out, norm = facade(setup, fused, beta, temperature)
    print(f"[gkd {'fused' if fused else 'unfused'} beta={beta} T={temperature}: loss {ref_loss:.6f} "
          f"rel err {_rel(out['loss'], ref_loss):.1e}, norm {ref_norm:.6f} rel err {_rel(norm, ref_norm):.1e}]")
    assert ref_loss > 1e-2 and ref_norm > 1e-3
    mask = setup["labels"] != -100
    mask[:, 0] = False
    assert out["num_tokens"] == out["count"] == int(mask.sum())
    assert _rel(out["loss"], ref_loss) <= TOL, (out["loss"], ref_loss)
    assert _rel(norm, ref_norm) <= TOL, (norm, ref_norm)
    mass = float((setup["t_logps"].double().exp().sum(-1) * mask).sum() / mask.sum())
    assert abs(out["teacher_mass"] - mass) <= 1e-6


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_micro_batches_response_only_and_packed_rows(setup, fused):
    """Micro-batches of one row with the teacher given per sample over its loss tokens only, and
    packed rows (two samples each, one THD row per micro-batch) equal transformers."""
    mask = setup["labels"] != -100
    mask[:, 0] = False
    per_sample = {"teacher_topk_logps": [setup["t_logps"][b][mask[b]] for b in range(B)],
                  "teacher_topk_indices": [setup["t_ids"][b][mask[b]] for b in range(B)]}
    ref = reference(setup, 0.5, 2.0)
    out, norm = facade(setup, fused, 0.5, 2.0, mbs=1, **per_sample)
    assert _rel(out["loss"], ref[0]) <= TOL and _rel(norm, ref[1]) <= TOL, (out["loss"], norm, ref)
    ids, labels, pos = setup["packed"]
    packed = {"input_ids": ids, "labels": labels, "position_ids": pos}
    ref = reference(setup, 0.5, 2.0, inputs=packed)
    out, norm = facade(setup, fused, 0.5, 2.0, inputs=packed, mbs=1)
    print(f"[packed {'fused' if fused else 'unfused'}: loss rel err {_rel(out['loss'], ref[0]):.1e}, "
          f"norm rel err {_rel(norm, ref[1]):.1e}]")
    assert _rel(out["loss"], ref[0]) <= TOL and _rel(norm, ref[1]) <= TOL, (out["loss"], norm, ref)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_upstream_teacher_topk_logprobs_alignment(setup, fused):
    """Upstream Twinkle's spelling: ``teacher_topk_logprobs`` / ``teacher_topk_indices`` rolled by -1
    (its GKD cookbook rolls vLLM's prompt_logprobs so position t holds token t + 1's distribution).
    The student as its own teacher in that convention gives a zero loss, and equals the same
    teacher given in this package's alignment; the rolled values under this package's key (only
    the key renamed) do not, which is why the alias takes the convention with the name."""
    with torch.no_grad():
        z = student_logits(setup["hf"], setup["ids"])
    own_logps, own_ids = torch.log_softmax(torch.nan_to_num(z), -1).topk(K, -1)
    theirs = {"teacher_topk_logprobs": torch.roll(own_logps.float(), -1, dims=1),
              "teacher_topk_indices": torch.roll(own_ids, -1, dims=1)}
    out, norm = facade(setup, fused, 0.5, 0.05, **theirs)
    ours, ours_norm = facade(setup, fused, 0.5, 0.05, teacher_topk_logps=own_logps.float(), teacher_topk_indices=own_ids)
    assert abs(out["loss"]) <= 1e-6 and out["loss"] == ours["loss"] and norm == ours_norm, (out, ours)
    renamed = {"teacher_topk_logps": theirs["teacher_topk_logprobs"], "teacher_topk_indices": theirs["teacher_topk_indices"]}
    assert facade(setup, fused, 0.5, 0.05, **renamed)[0]["loss"] > 0.05
    with pytest.raises(TypeError, match="teacher_topk_logprobs .* or teacher_topk_logps"):
        setup["models"][fused].forward_backward(inputs={"input_ids": setup["ids"], "labels": setup["labels"]},
                                                teacher_topk_logps=own_logps.float(), **theirs)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_teacher_alignment(setup, fused):
    """A teacher that is the student itself (its top-k of transformers' log-softmax, position t =
    the distribution of token t) gives a zero loss; the same teacher one position off does not,
    and neither does the reference formula moved one position from the facade's alignment."""
    with torch.no_grad():
        z = student_logits(setup["hf"], setup["ids"])
    lsm = torch.log_softmax(torch.nan_to_num(z), -1)
    own_logps, own_ids = lsm.topk(K, -1)
    own = {"teacher_topk_logps": own_logps.float(), "teacher_topk_indices": own_ids}
    # the random tiny model is near uniform: a low temperature sharpens both sides alike
    out, _ = facade(setup, fused, 0.5, 0.05, **own)
    late = {k: torch.roll(v, 1, dims=1) for k, v in own.items()}       # position t gets t - 1's
    early = {k: torch.roll(v, -1, dims=1) for k, v in own.items()}     # ... and t + 1's
    offs = [facade(setup, fused, 0.5, 0.05, **shifted)[0]["loss"] for shifted in (late, early)]
    print(f"[teacher = student: loss {out['loss']:.1e}; one position late / early {offs[0]:.3f} / {offs[1]:.3f}]")
    assert abs(out["loss"]) <= 1e-6, out["loss"]
    assert min(offs) > 0.05, offs
    # the random teacher: the facade equals the formula at its alignment, not one position off
    out, _ = facade(setup, fused, 0.0, 1.0)
    right = reference(setup, 0.0, 1.0)[0]
    wrong = reference(setup, 0.0, 1.0, t_logps=torch.roll(setup["t_logps"], 1, dims=1),
                      t_ids=torch.roll(setup["t_ids"], 1, dims=1))[0]
    print(f"[alignment: facade {out['loss']:.5f}, formula {right:.5f}, formula one position off {wrong:.5f}]")
    assert _rel(out["loss"], right) <= TOL
    assert _rel(out["loss"], wrong) > 0.05


def test_bad_arguments_are_refused(setup, one_rank):
    model = setup["models"][False]
    for kw, match in (({"beta": -0.1}, "beta"), ({"beta": 1.01}, "beta"), ({"beta": "0.5"}, "beta"),
                      ({"temperature": 0.0}, "temperature"), ({"temperature": -2.0}, "temperature"),
                      ({"temperature": float("nan")}, "temperature")):
        with pytest.raises(ValueError, match=match):
            model.set_loss("gkd", **kw)
    assert model.set_loss("GKDLoss", beta=1, temperature=0.5).name == "gkd"
    model.set_loss("gkd", beta=0.5, temperature=1.0)
    inputs = {"input_ids": setup["ids"], "labels": setup["labels"]}
    lp, ix = setup["t_logps"], setup["t_ids"]
    vocab = setup["vocab"]
    bad_ix = ix.clone()
    bad_ix[1, 7, 2] = vocab                      # a loss position (prompt of row 1 is 5 tokens)
    neg_ix = ix.clone()
    neg_ix[0, 4, 0] = -1
    masked_ix = ix.clone()
    masked_ix[0, 1] = 10 ** 6                    # a prompt position: not read
    cases = [
        ({"teacher_topk_logps": lp[..., 0], "teacher_topk_indices": ix}, "teacher_topk_logps"),
        ({"teacher_topk_logps": lp[:, :-1], "teacher_topk_indices": ix}, "teacher_topk_logps"),
        ({"teacher_topk_logps": lp[:2], "teacher_topk_indices": ix}, "teacher_topk_logps"),
        ({"teacher_topk_logps": lp, "teacher_topk_indices": ix[..., :3]}, "must share k"),
        ({"teacher_topk_logps": lp, "teacher_topk_indices": bad_ix}, rf"teacher_topk_indices.*\[0, {vocab}\)"),
        ({"teacher_topk_logps": lp, "teacher_topk_indices": neg_ix}, "teacher_topk_indices"),
        ({"teacher_topk_logps": lp, "teacher_topk_indices": ix + 0.5}, "teacher_topk_indices"),
        ({"teacher_topk_logps": torch.full_like(lp, float("nan")), "teacher_topk_indices": ix}, "teacher_topk_logps"),
        ({"teacher_topk_logps": lp}, "teacher_topk_indices"),
    ]
    for teacher, match in cases:
        with pytest.raises(ValueError, match=match):
            model.forward_backward(inputs=inputs, **teacher)
    tl = setup["t_logits"]
    nan_tl = tl.clone()
    nan_tl[1, 6, 3] = float("nan")               # predicts position 7, a loss token of row 1
    full_cases = [
        ({"teacher_logits": tl, "teacher_topk_logps": lp, "teacher_topk_indices": ix}, "not both"),
        ({"teacher_logits": tl, "teacher_topk_logps": lp}, "not both"),
        ({"teacher_logits": tl[..., :-1]}, rf"teacher_logits must be \[B, S, V\] = \({B}, {S}, {vocab}\)"),
        ({"teacher_logits": tl[:, :-1]}, "teacher_logits must be"),
        ({"teacher_logits": tl[0]}, "teacher_logits must be"),
        ({"teacher_logits": tl.long()}, "teacher_logits must be a float"),
        ({"teacher_logits": nan_tl}, "teacher_logits must not be NaN"),
    ]
    for teacher, match in full_cases:
        with pytest.raises(ValueError, match=match):
            model.forward_backward(inputs=inputs, **teacher)
    masked_tl = tl.clone()
    masked_tl[0, 0] = float("nan")               # predicts position 1, a prompt token: not read
    assert math.isfinite(model.forward_backward(inputs=inputs, teacher_logits=masked_tl)["loss"])
    model.zero_grad()
    out = model.forward_backward(inputs=inputs, teacher_topk_logps=lp, teacher_topk_indices=masked_ix)
    assert math.isfinite(out["loss"])
    model.zero_grad()


LAYOUTS = [{"name": "tp2", "mesh": {"tp_size": 2}, "fused": False},
           {"name": "tp2_fused", "mesh": {"tp_size": 2}, "fused": True},
           {"name": "tp2_sp", "mesh": {"tp_size": 2, "sequence_parallel": True}, "fused": False},
           {"name": "tp2_sp_fused", "mesh": {"tp_size": 2, "sequence_parallel": True}, "fused": True},
           {"name": "cp2_fused", "mesh": {"cp_size": 2}, "fused": True},
           {"name": "pp2_fused", "mesh": {"pp_size": 2}, "fused": True, "mbs": 1},
           # megatron's output_layer (vocab-parallel logits, then the loss) on the unfused spec
           {"name": "cp2_unfused", "mesh": {"cp_size": 2}, "fused": False, "kernels": False},
           {"name": "pp2_unfused", "mesh": {"pp_size": 2}, "fused": False, "kernels": False, "mbs": 1}]
LAYOUT_CASES = [(0.0, 2.0), (0.5, 2.0), (1.0, 2.0)]


@pytest.mark.multiprocess
def test_two_rank_layouts_equal_transformers(setup):
    """Vocab-parallel top-k logits (each TP rank its shard's ids, summed over the group), and the
    full-vocabulary teacher (each TP rank its vocabulary shard of the student's head and of the
    teacher's logits, the log-sum-exps and sums all-reduced), under SP (the fused path gathers the
    sequence), CP (rows reassembled) and PP, with the fused head and with megatron's output_layer
    (``use_twinkle_kernels=False``) under CP and PP: loss and grad norm equal transformers' within
    1e-5 relative on both ranks."""
    root = setup["root"]
    spec = {"data": str(root / "data.pt"), "model_dir": setup["path"], "runs": LAYOUTS, "cases": LAYOUT_CASES,
            "full_vocab": True}
    res, rcs, logs, elapsed = launch(2, spec, str(root / "two"), timeout=600,
                                     script=os.path.join(ROOT, "tests", "megatron_workers", "gkd_worker.py"))
    assert rcs == [0, 0] and all(r is not None for r in res), "\n".join(l[-3000:] for l in logs)
    print(f"[2 ranks: {elapsed:.1f}s]")
    worst = {}
    for full in (False, True):
        for beta, temperature in LAYOUT_CASES:
            ref_loss, ref_norm = reference(setup, beta, temperature, t_logits=setup["t_logits"] if full else None)
            for run in LAYOUTS:
                for rank in (0, 1):
                    rec = res[rank][run["name"]]
                    assert rec["ok"], rec.get("traceback")
                    got = rec[f"{'full/' if full else ''}{beta}/{temperature}"]
                    errs = (_rel(got["loss"], ref_loss), _rel(got["norm"], ref_norm))
                    key = ("full vocab " if full else "top-k ") + run["name"]
                    worst[key] = max(worst.get(key, 0.0), *errs)
                    assert max(errs) <= TOL, (key, rank, beta, temperature, got, ref_loss, ref_norm)
    print("[two-rank layouts, max rel err of loss / grad norm: " +
          ", ".join(f"{k} {v:.1e}" for k, v in worst.items()) + "]")


# the teacher keywords of forward_backward -> the setup entries that hold them
TEACHERS = {"topk": {"teacher_topk_logps": "t_logps", "teacher_topk_indices": "t_ids"},
            "full_vocab": {"teacher_logits": "t_logits"}}


@pytest.mark.parametrize("teacher", list(TEACHERS))
def test_mixed_adapter_batch_equals_the_adapter_alone(setup, one_rank, teacher):
    """Adapter b trained with GKD (top-k or full-vocabulary teacher) on its rows of a mixed batch
    (a: cross entropy on the others) equals b trained alone on its rows: count exactly, grad norm
    within 1e-6, loss within 1e-5 (the JSD is a small difference of O(1) terms, so its fp32
    rounding is large relative to itself: 1.1e-6 apart on an AMD EPYC, whose GEMMs block the 3-
    and the 2-row batch differently, against under 1e-6 on a Xeon)."""
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0,
            "init_lora_weights": False}
    names = ["b", "a", "b"]
    rows = [i for i, n in enumerate(names) if n == "b"]
    got = {}
    for mixed in (True, False):
        torch.manual_seed(0)
        model = one_rank.MegatronModel(setup["path"], mixed_precision="fp32", fused_linear_ce=True)
        for n in ("a", "b"):
            model.add_adapter_to_model(n, lora)
            model.set_optimizer("AdamW", lr=1e-3, adapter_name=n)
        model.set_loss("gkd", beta=0.5, temperature=2.0, adapter_name="b")
        if mixed:
            out = model.forward_backward(inputs={"input_ids": setup["ids"], "labels": setup["labels"]},
                                         adapter_names=names,
                                         **{k: setup[v] for k, v in TEACHERS[teacher].items()})["b"]
        else:
            out = model.forward_backward(inputs={"input_ids": setup["ids"][rows], "labels": setup["labels"][rows]},
                                         adapter_name="b",
                                         **{k: setup[v][rows] for k, v in TEACHERS[teacher].items()})
        norms = model.clip_grad_and_step(1.0)
        got[mixed] = (out["loss"], out["count"], norms["b"])
        del model
    print(f"[{teacher} mixed vs alone (gkd adapter): {got[True]} vs {got[False]}]")
    assert got[True][1] == got[False][1]
    assert _rel(got[True][0], got[False][0]) <= 1e-5 and _rel(got[True][2], got[False][2]) <= 1e-6
    assert got[False][0] > 1e-3 and got[False][2] > 1e-3


def test_topk_rows_in_chunks_equal_the_dense_head():
    """The fused head's k logits per token, a few tokens at a time, with a bias and the vocabulary
    split in two shards (summed as the TP group would): values and gradients equal the dense
    ``hidden @ weight.T + bias`` gathered at the ids (float64, gradcheck)."""
    from twinkle_megatron.layers.lm_head import TopkRows
    from twinkle_megatron.layers.vocab_parallel import vocab_parallel_topk_logits
    g = torch.Generator().manual_seed(2)
    n, h, v, k = 11, 7, 13, 4
    hid = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, v, (n, k), generator=g)

    def sharded(hid, w, b):   # two vocabulary shards of 6 and 7 rows, 3 tokens per chunk
        return (TopkRows.apply(hid, w[:6], b[:6], ids, 0, 3, None, True)
                + TopkRows.apply(hid, w[6:], b[6:], ids, 6, 3, None, True))
    dense = (hid @ w.T + b).gather(1, ids)
    assert torch.allclose(sharded(hid, w, b), dense, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(sharded, (hid, w, b))
    logits = hid @ w.T + b
    pieces = vocab_parallel_topk_logits(logits[:, :6], ids, vocab_start=0) + \
        vocab_parallel_topk_logits(logits[:, 6:], ids, vocab_start=6)
    assert torch.allclose(pieces, dense, rtol=0, atol=1e-12)


def test_fused_head_in_small_chunks_equals_transformers(setup, monkeypatch):
    """The fused path with 5 tokens per chunk (36 tokens: 8 chunks) gives the same loss and grad
    norm as transformers."""
    from twinkle_megatron.layers import lm_head
    calls = []
    monkeypatch.setattr(lm_head, "topk_chunk", lambda k, hidden: calls.append((k, hidden)) or 5)
    ref_loss, ref_norm = reference(setup, 0.5, 2.0)
    out, norm = facade(setup, True, 0.5, 2.0)
    assert calls == [(K, 128)]
    assert _rel(out["loss"], ref_loss) <= TOL and _rel(norm, ref_norm) <= TOL, (out["loss"], norm, ref_loss, ref_norm)


def test_memory_benchmark_small_shape_checks_and_reports(monkeypatch):
    """benchmarks/scripts/gkd_memory.py at a small shape: the fused and unfused paths agree (the
    script asserts it) and the student's fused peak is below the unfused one (no [N, V] logits or
    their gradient), with the teacher's top-k and with its full-vocabulary logits (in small
    blocks). The teacher's fused path reads the vocabulary in chunks of 2^24 / N rows, one chunk
    at this shape, so its peak is only compared at the published shape
    (benchmarks/results/gkd_memory_cpu_2026-12-04.md)."""
    from benchmarks.scripts.gkd_memory import main
    from twinkle_kernels.linear_ce import jsd
    # blocks of 16 tokens x 256 columns: the default (about 4M elements) is one block at this shape
    monkeypatch.setattr(jsd, "default_chunks", lambda n, vs: (16, 256))
    rows = main(["--tokens", "64", "--hidden", "32", "--vocab", "2048", "--k", "4"])
    assert [r[0].split()[0] for r in rows] == ["student", "teacher", "student,"]
    for side, k, unfused, fused, *_ in (rows[0], rows[2]):    # top-k, then full-vocabulary teacher_logits
        assert 0 < fused < unfused, (side, fused, unfused)


# --- full-vocabulary teacher logits ------------------------------------------------------------

@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("beta, temperature", [(0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (0.0, 2.0), (0.5, 2.0),
                                               (1.0, 2.0)])
def test_full_vocab_loss_and_grad_norm_equal_transformers(setup, fused, beta, temperature):
    """``teacher_logits`` [B, S, V] (position t predicts token t + 1): the JSD over the whole
    vocabulary, fused (chunked over tokens and vocabulary from the hidden states) and unfused
    (from the logits), equals the float64 transformers formula: loss and grad norm within 1e-5."""
    ref_loss, ref_norm = reference(setup, beta, temperature, t_logits=setup["t_logits"])
    out, norm = facade(setup, fused, beta, temperature, teacher_logits=setup["t_logits"])
    print(f"[gkd full vocab {'fused' if fused else 'unfused'} beta={beta} T={temperature}: loss {ref_loss:.6f} "
          f"rel err {_rel(out['loss'], ref_loss):.1e}, norm {ref_norm:.6f} rel err {_rel(norm, ref_norm):.1e}]")
    assert ref_loss > 1e-2 and ref_norm > 1e-3
    mask = setup["labels"] != -100
    mask[:, 0] = False
    assert out["num_tokens"] == out["count"] == int(mask.sum())
    assert _rel(out["loss"], ref_loss) <= TOL, (out["loss"], ref_loss)
    assert _rel(norm, ref_norm) <= TOL, (norm, ref_norm)
    assert out["teacher_mass"] == 1.0


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_full_vocab_micro_batches_packed_rows_and_alignment(setup, fused):
    """Full-vocabulary teacher: micro-batches of one row and packed rows (the teacher's logits of
    the packed row as a model returns them) equal transformers; a teacher that is the student's own
    logits gives 0, one position late or early does not, and the formula read one position off
    differs from the facade."""
    ref = reference(setup, 0.5, 2.0, t_logits=setup["t_logits"])
    out, norm = facade(setup, fused, 0.5, 2.0, mbs=1, teacher_logits=setup["t_logits"])
    assert _rel(out["loss"], ref[0]) <= TOL and _rel(norm, ref[1]) <= TOL, (out["loss"], norm, ref)
    ids, labels, pos = setup["packed"]
    packed = {"input_ids": ids, "labels": labels, "position_ids": pos}
    g = torch.Generator().manual_seed(5)
    p_logits = 2.0 * torch.randn(B, S, setup["vocab"], generator=g)
    ref = reference(setup, 0.5, 2.0, inputs=packed, t_logits=p_logits)
    out, norm = facade(setup, fused, 0.5, 2.0, inputs=packed, mbs=1, teacher_logits=p_logits)
    print(f"[packed full vocab {'fused' if fused else 'unfused'}: loss rel err {_rel(out['loss'], ref[0]):.1e}, "
          f"norm rel err {_rel(norm, ref[1]):.1e}]")
    assert _rel(out["loss"], ref[0]) <= TOL and _rel(norm, ref[1]) <= TOL, (out["loss"], norm, ref)
    # the student as its own teacher: transformers' logits as returned (position t predicts t + 1)
    with torch.no_grad():
        own = setup["hf"](input_ids=setup["ids"]).logits.float()
    out, _ = facade(setup, fused, 0.5, 1.0, teacher_logits=own)
    offs = [facade(setup, fused, 0.5, 1.0, teacher_logits=torch.roll(own, r, dims=1))[0]["loss"] for r in (1, -1)]
    print(f"[full vocab, teacher = student: loss {out['loss']:.1e}; one position late / early "
          f"{offs[0]:.2e} / {offs[1]:.2e}]")
    assert abs(out["loss"]) <= 1e-7, out["loss"]
    assert min(offs) > 1e3 * max(abs(out["loss"]), 1e-9), offs
    out, _ = facade(setup, fused, 0.0, 1.0, teacher_logits=setup["t_logits"])
    right = reference(setup, 0.0, 1.0, t_logits=setup["t_logits"])[0]
    wrong = reference(setup, 0.0, 1.0, t_logits=torch.roll(setup["t_logits"], 1, dims=1))[0]
    print(f"[full vocab alignment: facade {out['loss']:.5f}, formula {right:.5f}, one position off {wrong:.5f}]")
    assert _rel(out["loss"], right) <= TOL and _rel(out["loss"], wrong) > 100 * TOL


def test_full_vocab_fused_in_small_chunks_equals_transformers(setup, monkeypatch):
    """The fused full-vocabulary path with blocks of 5 tokens x 7 vocabulary columns (36 tokens x
    259 columns: 8 x 37 blocks) equals transformers; the chunk sizes asked are the kernel's."""
    from twinkle_kernels.linear_ce import jsd
    calls = []
    monkeypatch.setattr(jsd, "default_chunks", lambda n, vs: calls.append((n, vs)) or (5, 7))
    ref_loss, ref_norm = reference(setup, 0.5, 2.0, t_logits=setup["t_logits"])
    out, norm = facade(setup, True, 0.5, 2.0, teacher_logits=setup["t_logits"])
    mask = setup["labels"] != -100
    mask[:, 0] = False
    assert calls == [(B * S, setup["vocab"])], calls
    assert _rel(out["loss"], ref_loss) <= TOL and _rel(norm, ref_norm) <= TOL, (out["loss"], norm, ref_loss, ref_norm)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.3])
def test_fused_linear_jsd_kernel_equals_the_formula(beta):
    """twinkle_kernels.linear_ce.jsd.fused_linear_jsd (blocks of 4 tokens x 5 columns, a bias,
    some tokens not valid, a teacher with -inf logits) equals the unfused float64 formula in value
    and in the gradients of hidden, weight and bias (and of the logits, without a weight), and
    passes gradcheck; two vocabulary shards combined as a TP group would (the log-sum-exps and the
    sums added over shards) are checked by the two-rank test."""
    from twinkle_kernels.linear_ce.jsd import fused_linear_jsd, linear_jsd_reference
    g = torch.Generator().manual_seed(3)
    n, h, v = 13, 7, 37
    hid = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True)
    t = 2.0 * torch.randn(n, v, generator=g, dtype=torch.float64)
    if beta != 1.0:
        t[2, 5] = float("-inf")          # a zero teacher probability (KL(S || T) would be infinite)
    valid = torch.rand(n, generator=g) > 0.3
    up = torch.randn(n, generator=g, dtype=torch.float64)
    for temperature in (1.0, 2.0):
        out = fused_linear_jsd(hid, w, t, valid=valid, beta=beta, temperature=temperature, bias=b,
                               chunk_tokens=4, chunk_vocab=5)
        ref = linear_jsd_reference(hid, w, t, valid=valid, beta=beta, temperature=temperature, bias=b)
        assert torch.allclose(out, ref, rtol=1e-12, atol=1e-13), (out - ref).abs().max()
        assert bool((out[~valid] == 0).all()) and bool((out[valid] > 0).all())
        got = torch.autograd.grad((out * up).sum(), (hid, w, b))
        want = torch.autograd.grad((ref * up).sum(), (hid, w, b))
        for a, c in zip(got, want):
            assert torch.allclose(a, c, rtol=1e-10, atol=1e-12), (a - c).abs().max()
        z = (hid @ w.T + b).detach().requires_grad_()
        out = fused_linear_jsd(z, None, t, valid=valid, beta=beta, temperature=temperature, chunk_tokens=3,
                               chunk_vocab=8)
        ref = linear_jsd_reference(z, None, t, valid=valid, beta=beta, temperature=temperature)
        assert torch.allclose(out, ref, rtol=1e-12, atol=1e-13)
        assert torch.allclose(torch.autograd.grad((out * up).sum(), z)[0],
                              torch.autograd.grad((ref * up).sum(), z)[0], rtol=1e-10, atol=1e-12)
    fn = lambda hid, w, b: fused_linear_jsd(hid, w, t, valid=valid, beta=beta, temperature=2.0, bias=b,  # noqa: E731
                                            chunk_tokens=4, chunk_vocab=5)
    # fast mode (random projections of the Jacobian): the full one perturbs each of the 387 inputs
    # through the Python block loop, 18 s in CI; the exact gradients are compared above
    assert torch.autograd.gradcheck(fn, (hid, w, b), fast_mode=True)
    with pytest.raises(ValueError, match="teacher_logits"):
        fused_linear_jsd(hid, w, t[:, :-1], beta=beta)
    with pytest.raises(ValueError, match="beta"):
        fused_linear_jsd(hid, w, t, beta=1.5)
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_jsd(hid, w, t, beta=beta, temperature=0.0)


def test_full_vocab_forward_only_reports_the_loss(setup):
    """forward_only with gkd and teacher_logits reports the loss forward_backward reports (no
    gradient accumulated), and a bfloat16 head in the kernel stays within bf16 rounding of the
    float64 formula."""
    from twinkle_kernels.linear_ce.jsd import fused_linear_jsd, linear_jsd_reference
    model = setup["models"][True]
    model.set_loss("gkd", beta=0.5, temperature=2.0)
    inputs = {"input_ids": setup["ids"], "labels": setup["labels"]}
    seen = model.forward_only(inputs=inputs, teacher_logits=setup["t_logits"])
    assert model.clip_grad_norm(0) == 0.0
    trained, _ = facade(setup, True, 0.5, 2.0, teacher_logits=setup["t_logits"])
    assert _rel(seen["loss"], trained["loss"]) <= 1e-6, (seen["loss"], trained["loss"])
    g = torch.Generator().manual_seed(4)
    hid, w = torch.randn(9, 16, generator=g), torch.randn(50, 16, generator=g)
    t = 2.0 * torch.randn(9, 50, generator=g)
    out = fused_linear_jsd(hid.bfloat16(), w.bfloat16(), t, beta=0.5, temperature=2.0, chunk_tokens=4, chunk_vocab=7)
    ref = linear_jsd_reference(hid.bfloat16().double(), w.bfloat16().double(), t.double(), beta=0.5, temperature=2.0)
    assert out.dtype == torch.float32 and torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6), (out, ref)
