"""A facade call that raises leaves no trace (twinkle_megatron/training/transaction.py).

Each case: the error, then everything training keeps (parameters, grad buffers / main_grad and
.grad, optimizer state, LR scheduler, counters, meters, RNG) bit-identical to a snapshot taken
before the bad call, then one good step that equals the same step on a twin model that never saw
the failure. One process here; CP2 / TP2 under gloo in tests/megatron/test_facade_inputs.py
(tests/megatron_workers/transaction_worker.py).
"""
import copy
import math

import pytest
import torch

pytest.importorskip("megatron.core")

from conftest import megatron_one_rank  # noqa: E402

VOCAB, B, S = 256, 4, 10


@pytest.fixture(scope="module")
def one_rank():
    with megatron_one_rank() as tm:
        yield tm


def _config():
    from twinkle_megatron.job.configs import tiny_qwen3_config
    return tiny_qwen3_config(num_layers=1)


def make(tm, loss="cross_entropy", optimizer=True, overlap_grad_reduce=False, **loss_kwargs):
    m = tm.MegatronModel(model_id=_config(), mixed_precision="fp32", seed=7, overlap_grad_reduce=overlap_grad_reduce)
    if optimizer:
        m.set_optimizer("AdamW", lr=1e-2)
        m.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=10)
    m.set_loss(loss, **loss_kwargs)
    return m


def two_adapters(tm):
    """A model with LoRA adapters "a" and "b", each with its own AdamW."""
    m = tm.MegatronModel(model_id=_config(), mixed_precision="fp32", seed=7)
    for n in ("a", "b"):
        m.add_adapter_to_model(n, {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
        m.set_optimizer("AdamW", lr=1e-2, adapter_name=n)
    return m


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    return {"input_ids": ids, "labels": labels}


def loss_mask(b):
    m = b["labels"] != -100
    m[:, 0] = False
    return m


# ---- the state a call may change -------------------------------------------------------------

def snapshot(model):
    """Everything training keeps, copied: params, grad buffers, .grad, optimizer and scheduler
    state, the train state's counters and meters, the RNG."""
    state = model.train_state()
    wrapped = state.model or []
    out = {"params": [p.detach().clone() for c in model.unwrapped_chunks() for p in c.parameters()],
           "grad_buffers": [b.grad_data.clone() for m in wrapped for b in m.buffers + m.expert_parallel_buffers],
           "main_grad": [None if getattr(p, "main_grad", None) is None else p.main_grad.clone()
                         for m in wrapped for p in m.module.parameters()],
           "grad": [None if p.grad is None else p.grad.clone() for c in model.unwrapped_chunks()
                    for p in c.parameters()],
           "counters": {k: getattr(state, k) for k in ("cur_step", "consumed_train_samples", "accumulated_calls",
                                                      "grads_ready", "skip_step", "has_grads")},
           "pending_tokens": None if state.pending_tokens is None else state.pending_tokens.clone(),
           "metric": copy.deepcopy(vars(state.metric)), "eval_metric": copy.deepcopy(vars(state.eval_metric)),
           "rng": torch.get_rng_state()}
    if state.optimizer is not None:
        out["optimizer"] = copy.deepcopy(state.optimizer.state_dict())
        out["lr"] = [g["lr"] for g in state.optimizer.param_groups]
    if state.lr_scheduler is not None:
        out["scheduler"] = copy.deepcopy(state.lr_scheduler.state_dict())
    return out


def assert_identical(a, b, path="state"):
    """Bit-identical (tensors: torch.equal incl. NaN positions; floats: NaN == NaN)."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and
                                     torch.equal(a.nan_to_num(), b.nan_to_num())), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), (path, sorted(a), sorted(b))
        for k in a:
            assert_identical(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    else:
        assert a == b, (path, a, b)


def comparable(snap):
    """A snapshot without what two models in one process cannot share: wall-clock seconds in the
    meters, and the RNG (one generator for both)."""
    snap = dict(snap)
    snap.pop("rng")
    for k in ("metric", "eval_metric"):
        snap[k] = {f: v for f, v in snap[k].items() if f != "seconds"}
    return snap


def good_step(model, b, **kw):
    out = model.forward_backward(inputs=b, micro_batch_size=2, **kw)
    norm = model.clip_grad_and_step()
    return out, norm


def assert_twins(model, twin, b, **kw):
    """One good step on both: same result, same weights, bit for bit."""
    out_m, norm_m = good_step(model, b, **kw)
    out_t, norm_t = good_step(twin, b, **kw)
    assert out_m["loss"] == out_t["loss"] and norm_m == norm_t, (out_m, out_t, norm_m, norm_t)
    assert_identical(comparable(snapshot(model)), comparable(snapshot(twin)))
    met_m, met_t = model.calculate_metric(), twin.calculate_metric()
    met_m.pop("tokens_per_s"), met_t.pop("tokens_per_s")
    assert_identical(met_m, met_t)


# ---- a call that fails inside the schedule ------------------------------------------------------

def _raising_metric(on_call):
    """A user metric that draws from the RNG, then raises on its ``on_call``-th micro-batch."""
    calls = []

    def metric(x):
        calls.append(torch.rand(1))
        if len(calls) == on_call:
            raise RuntimeError(f"metric failed on micro-batch {on_call}")
        return x.logps.detach().sum(), x.loss_mask.sum()

    return metric


@pytest.mark.parametrize("accumulated", [False, True], ids=["first_call", "after_a_call"])
def test_failed_forward_backward_keeps_nothing(one_rank, accumulated):
    """A metric raising on micro-batch 2 of 2: micro-batch 1's grads are not kept (they were
    summed into main_grad 1.0e4 before), whether the buffers were zero (the first call of a step)
    or held an earlier call's grads (accumulation: restored to them, not zeroed)."""
    model, twin = make(one_rank), make(one_rank)
    assert_identical(snapshot(model)["params"], snapshot(twin)["params"])
    if accumulated:
        for m in (model, twin):
            m.forward_backward(inputs=batch(1), micro_batch_size=2)
    before = snapshot(model)
    if accumulated:
        assert any(bool(g.any()) for g in before["grad_buffers"])
    # the snapshot finds megatron's grad buffers (no main_grad outside them), and copies them
    # only when they hold grads
    from twinkle_megatron.training import transaction
    snap = transaction.Snapshot(model.engine, [model.train_state()])
    assert snap.wraps and all(w.buffers and not w.loose for w in snap.wraps)
    assert all((saved is not None) == accumulated for w in snap.wraps for _, saved in w.buffers)
    model.add_metric("boom", _raising_metric(2))
    with pytest.raises(RuntimeError, match="metric failed on micro-batch 2"):
        model.forward_backward(inputs=batch(), micro_batch_size=2)
    del model.train_state().user_metrics["boom"]
    assert_identical(snapshot(model), before)
    assert_twins(model, twin, batch())


def test_failed_call_under_overlap_grad_reduce_keeps_nothing(one_rank):
    """overlap_grad_reduce (one forward_backward per step): after a failed call the loss count is
    None again, so the next call is allowed, and it equals the twin's, two steps on."""
    model, twin = make(one_rank, overlap_grad_reduce=True), make(one_rank, overlap_grad_reduce=True)
    before = snapshot(model)
    model.add_metric("boom", _raising_metric(2))
    with pytest.raises(RuntimeError, match="metric failed on micro-batch 2"):
        model.forward_backward(inputs=batch(), micro_batch_size=2)
    del model.train_state().user_metrics["boom"]
    assert_identical(snapshot(model), before)
    assert_twins(model, twin, batch())
    assert_twins(model, twin, batch(2))


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap_grad_reduce"])
def test_call_failing_inside_a_backward_keeps_nothing(one_rank, overlap):
    """An error raised inside micro-batch 2's backward (a backward hook on the first decoder
    layer: the layers after it and the output layer already added their grads of micro-batch 2,
    and under overlap_grad_reduce registered them with their bucket groups)."""
    model, twin = make(one_rank, overlap_grad_reduce=overlap), make(one_rank, overlap_grad_reduce=overlap)
    if not overlap:
        for m in (model, twin):
            m.forward_backward(inputs=batch(1), micro_batch_size=2)
    before = snapshot(model)
    wraps = model.train_state().model
    groups = [(g.is_first_batch, dict(g.per_param_grad_ready_counts)) for w in wraps for g in w.bucket_groups]
    calls = []

    def hook(module, grad_input, grad_output):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("backward failed in micro-batch 2")

    handle = model.unwrapped_chunks()[0].decoder.layers[0].register_full_backward_hook(hook)
    try:
        with pytest.raises(RuntimeError, match="backward failed in micro-batch 2"):
            model.forward_backward(inputs=batch(), micro_batch_size=2)
    finally:
        handle.remove()
    assert len(calls) == 2
    assert_identical(snapshot(model), before)
    assert groups == [(g.is_first_batch, dict(g.per_param_grad_ready_counts)) for w in wraps for g in w.bucket_groups]
    assert_twins(model, twin, batch())
    assert_twins(model, twin, batch(2))


def test_failed_mixed_adapter_call_keeps_nothing(one_rank):
    """The same for a mixed-adapter batch: every adapter's grads and counters as before."""
    model, twin = two_adapters(one_rank), two_adapters(one_rank)
    names = ["a", "b", "a", "b"]
    for m in (model, twin):
        m.forward_backward(inputs=batch(1), adapter_names=names)
    states = [model.train_state(n) for n in ("a", "b")]
    before = [[b.grad_data.clone() for w in s.model for b in w.buffers] for s in states]
    counters = [(s.pending_tokens.clone(), s.has_grads, s.consumed_train_samples, vars(copy.deepcopy(s.metric)))
                for s in states]
    model.add_metric("boom", _raising_metric(2), adapter_name="b")
    with pytest.raises(RuntimeError, match="metric failed on micro-batch 2"):
        model.forward_backward(inputs=batch(), adapter_names=names, micro_batch_size=2)
    del model.train_state("b").user_metrics["boom"]
    assert_identical([[b.grad_data for w in s.model for b in w.buffers] for s in states], before)
    assert_identical([(s.pending_tokens, s.has_grads, s.consumed_train_samples, vars(s.metric)) for s in states],
                     counters)
    for m in (model, twin):
        m.forward_backward(inputs=batch(), adapter_names=names, micro_batch_size=2)
        m.clip_grad_and_step()
    for n in ("a", "b"):
        got = [b.grad_data for w in model.train_state(n).model for b in w.buffers]
        want = [b.grad_data for w in twin.train_state(n).model for b in w.buffers]
        assert_identical(got, want)
    assert_identical([p.detach() for p in model.unwrapped_chunks()[0].parameters()],
                     [p.detach() for p in twin.unwrapped_chunks()[0].parameters()])


def test_failed_forward_only_keeps_no_meter_or_rng_draw(one_rank):
    model, twin = make(one_rank), make(one_rank)
    for m in (model, twin):
        m.forward_only(inputs=batch(1))       # something in the eval meter
    before = snapshot(model)
    model.add_metric("boom", _raising_metric(2))
    with pytest.raises(RuntimeError, match="metric failed"):
        model.forward_only(inputs=batch(), micro_batch_size=2)
    del model.train_state().user_metrics["boom"]
    assert_identical(snapshot(model), before)
    a, b = model.forward_only(inputs=batch()), twin.forward_only(inputs=batch())
    assert_identical(a["logps"], b["logps"])
    assert_identical(model.calculate_metric(is_training=False)["loss"],
                     twin.calculate_metric(is_training=False)["loss"])
    assert_twins(model, twin, batch())


def test_refused_clip_grad_and_step_counts_nothing(one_rank):
    """Refused before anything is counted: a bad gradient_accumulation_steps, and no optimizer
    (has_grads and accumulated_calls were changed first before)."""
    model, twin = make(one_rank), make(one_rank)
    for m in (model, twin):
        m.forward_backward(inputs=batch(1))
    before = snapshot(model)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        model.clip_grad_and_step(gradient_accumulation_steps=0)
    assert_identical(snapshot(model), before)
    assert_twins(model, twin, batch())
    bare = make(one_rank, optimizer=False)
    bare.forward_backward(inputs=batch())
    before = snapshot(bare)
    with pytest.raises(RuntimeError, match="set_optimizer"):
        bare.clip_grad_and_step()
    assert_identical(snapshot(bare), before)
    assert bare.train_state().has_grads


def test_clip_grad_and_step_failing_before_the_reduction_restores_counters(one_rank, monkeypatch):
    """An error inside the step before the grads are reduced: counters, scheduler and grads as
    before; the next step equals the twin's."""
    model, twin = make(one_rank), make(one_rank)
    for m in (model, twin):
        m.forward_backward(inputs=batch(1))
    before = snapshot(model)

    def broken(chunks, num_tokens=None):
        raise RuntimeError("reduction failed")

    # megatron's finalize_model_grads, which both optimizer paths run (the one-pass step too)
    monkeypatch.setattr(model.engine, "finalize_model_grads", broken)
    with pytest.raises(RuntimeError, match="reduction failed"):
        model.clip_grad_and_step()
    monkeypatch.undo()
    assert_identical(snapshot(model), before)
    assert_twins(model, twin, batch())


@pytest.mark.parametrize("bad", [-1.0, 0, float("nan"), float("inf"), True, "1.0"])
def test_bad_max_grad_norm_is_refused_before_anything_changes(one_rank, bad):
    """max_grad_norm must be a finite number > 0 or None: a negative, zero or NaN bar was accepted."""
    model, twin = make(one_rank), make(one_rank)
    for m in (model, twin):
        m.forward_backward(inputs=batch(1))
    before = snapshot(model)
    with pytest.raises(ValueError, match="max_grad_norm"):
        model.clip_grad_and_step(max_grad_norm=bad)
    assert_identical(snapshot(model), before)
    assert_twins(model, twin, batch())


@pytest.mark.parametrize("kwargs, error", [
    (dict(num_warmup_steps=-1, num_training_steps=10), ValueError),
    (dict(lr_warmup_steps=-3, lr_decay_steps=10), ValueError),
    (dict(num_warmup_steps=1, num_training_steps=-5), ValueError),
    (dict(num_warmup_steps=1.5, num_training_steps=10), TypeError),
    (dict(num_warmup_steps=True, num_training_steps=10), TypeError),
    (dict(num_warmup_steps=1, num_training_steps=10, max_lr=float("nan")), ValueError),
    (dict(num_warmup_steps=1, num_training_steps=10, min_lr=-1e-3), ValueError),
])
def test_bad_scheduler_steps_are_refused_before_anything_changes(one_rank, kwargs, error):
    model = make(one_rank)
    model.forward_backward(inputs=batch(1))
    before = snapshot(model)
    name = next(k for k, v in kwargs.items() if (k.endswith("steps") and (isinstance(v, (bool, float)) or v < 0))
                or (k.endswith("lr") and not (v >= 0)))
    with pytest.raises(error, match=name):
        model.set_lr_scheduler("CosineWarmupScheduler", **kwargs)
    assert_identical(snapshot(model), before)
    model.clip_grad_and_step(max_grad_norm=1.0)


def test_set_optimizer_after_every_adapter_was_removed(one_rank):
    """The base weights stay frozen after the last adapter goes: set_optimizer is a ValueError that says
    so (was megatron's AttributeError 'no attribute ddp_config'), with nothing changed; adding an
    adapter again then trains."""
    model = one_rank.MegatronModel(model_id=_config(), mixed_precision="fp32", seed=7)
    model.add_adapter_to_model("a", dict(r=4, lora_alpha=8, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=1e-2)
    model.remove_adapter("a")
    before = {n: p.detach().clone() for n, p in model.engine.chunks[0].named_parameters()}
    with pytest.raises(ValueError, match="no trainable parameters.*add_adapter_to_model"):
        model.set_optimizer("AdamW", lr=1e-2)
    assert model.engine.states[None].optimizer is None and model.engine.states[None].model is None
    for n, p in model.engine.chunks[0].named_parameters():
        assert torch.equal(p, before[n]), n
    model.add_adapter_to_model("b", dict(r=4, lora_alpha=8, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=1e-2)
    model.forward_backward(inputs=batch())
    assert model.clip_grad_and_step(max_grad_norm=1.0) > 0


def test_one_adapters_non_finite_step_does_not_hold_back_the_others(one_rank):
    """clip_grad_and_step over several adapters: each adapter's step is its own transaction. One
    tenant with non-finite grads is skipped (grads zeroed, its parameters, optimizer and step
    count unchanged) while the other steps exactly as a twin where only it trained; the error
    names the skipped adapter and carries the others' results."""
    model, twin = two_adapters(one_rank), two_adapters(one_rank)
    model.forward_backward(inputs=batch(1), adapter_name="a")
    twin.forward_backward(inputs=batch(1), adapter_name="a")
    b_params = model.adapters["b"].parameters
    model.forward_backward(inputs=batch(2), adapter_name="b")
    for w in model.train_state("b").model:   # b's gradients become non-finite
        for buf in w.buffers:
            buf.grad_data.fill_(math.nan)
    b_before = [p.detach().clone() for p in b_params]
    with pytest.raises(one_rank.NonFiniteGradientError, match=r"adapter\(s\) \['b'\].*\['a'\] stepped") as err:
        model.clip_grad_and_step()
    assert err.value.failed == ("b",) and set(err.value.results) == {"a"}
    assert err.value.results["a"] == twin.clip_grad_and_step(adapter_name="a")
    assert_identical([p.detach() for p in model.adapters["a"].parameters],
                     [p.detach() for p in twin.adapters["a"].parameters])
    assert_identical([p.detach() for p in b_params], b_before)
    assert model.train_state("b").cur_step == 0 and model.train_state("a").cur_step == 1
    assert all(float(buf.grad_data.abs().sum()) == 0 for w in model.train_state("b").model for buf in w.buffers)
    model.forward_backward(inputs=batch(3), adapter_name="b")     # b trains on
    assert math.isfinite(model.clip_grad_and_step()["b"])
