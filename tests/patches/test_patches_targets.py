"""Every documented target of every registered family swaps on the installed transformers.

The registry (``twinkle_patches._specs.FAMILIES``) is what the docs promise. Each family's tiny
model is built from its config (SiLU, the families' published activation), patched with every op,
and each of its specs must be reported swapped: a skip fails with its reason. transformers 5.25
wraps ``apply_rotary_pos_emb`` and the Gated DeltaNet / conv1d functions in its hub-kernel function
objects (the ``kernels`` package's ``Func`` modules); those are transformers' own and must be
swapped, while a foreign patch of the same global (a Liger-style function, a user's wrapper
object) is still reported and left alone. The swapped functions must really run the twinkle ops
(counted) and match the unpatched model.
"""
from __future__ import annotations

import importlib
import sys

import pytest
import torch
import transformers

import twinkle_kernels as tk
import twinkle_patches as tp
from twinkle_kernels import testing
from twinkle_kernels.patching import aliases

from test_patches_models import FAMILY_NAMES, batch, build

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.timeout(300)]

VERSION = tuple(int(p) for p in transformers.__version__.split(".")[:2])
# From this release transformers' modeling code holds its hub-kernel wrappers in the module globals
# (it requires the kernels package); before it, the plain functions (kernels was optional).
HUB_WRAPPERS_FROM = (5, 25)

# (family, target) -> why that target may legitimately be skipped on the installed transformers.
# Empty: every target of the registry exists in both 5.17 (the oldest admitted) and 5.25 (checked
# against both sources) and fits its tiny model. A target added in a later release goes here with
# the versions that lack it, never as a blanket skip.
CONDITIONAL_SKIPS = {}

FUNCTION_SPECS = [s for s in tp.list_patches() if s.kind == "function"]


@pytest.fixture(autouse=True)
def _clean_patches():
    tp.revert()
    yield
    tp.revert()


def test_every_registered_family_has_a_tiny_model():
    assert set(FAMILY_NAMES) == set(tp.FAMILIES), "tests/patches/test_patches_models.py must build every registered family"


@pytest.mark.parametrize("family", sorted(tp.FAMILIES))
def test_every_documented_target_swaps(family):
    model = build(family)
    report = tp.apply(model, ops=tp.OPS, device="cpu")  # every op, the opt-in fused linear CE included
    want = {s.name for s in tp.list_patches() if s.family == family}
    assert want, family
    allowed = {name for (fam, name) in CONDITIONAL_SKIPS if fam == family}
    reasons = {}
    for s in report.skipped:
        if s.spec.family == family:
            reasons.setdefault(s.spec.name, []).append(s.reason)
    missing = sorted(want - set(report.swapped_names()) - allowed)
    partial = sorted(n for n in reasons if n not in allowed)  # module swapped, instances skipped
    bad = sorted(set(missing) | set(partial))
    assert not bad, f"transformers {transformers.__version__}, {family}: not swapped or partly skipped:\n" + \
        "\n".join(f"  {n}: {'; '.join(reasons.get(n, ['absent from the report']))}" for n in bad)


def _hub_wrappers_expected():
    return VERSION >= HUB_WRAPPERS_FROM


def test_transformers_hub_wrappers_are_swapped_and_restored_exactly():
    before = {}
    for s in FUNCTION_SPECS:
        mod = importlib.import_module(s.module)
        obj = vars(mod)[s.target]
        before[s.qualname] = (mod, obj, aliases(obj, name=s.target))
    wrapped = [q for q, (_, obj, _) in before.items() if isinstance(obj, torch.nn.Module)]
    if _hub_wrappers_expected():
        # what this file is about: the test must not pass vacuously on the transformers CI runs
        expected = {f"{tp.FAMILIES[f].module}.apply_rotary_pos_emb"
                    for f in ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3")}
        expected |= {s.qualname for s in FUNCTION_SPECS if s.op != "apply_rotary_pos_emb"}  # GDN and conv1d
        assert expected <= set(wrapped), f"transformers {transformers.__version__} wraps only {wrapped}"
    # (older transformers, or no kernels package: the plain functions, swapped and restored the same way)
    report = tp.apply(ops=("rope", "gdn"))
    swapped = {s.spec.qualname: s for s in report.swapped}
    for q, (mod, obj, where) in before.items():
        assert q in swapped, f"{q}: {report.skipped_reasons()}"
        new = getattr(mod, q.rsplit(".", 1)[1])
        assert new is not obj and getattr(new, "_twinkle_spec", None) == swapped[q].spec.name
        # the replacement is made from the function inside the wrapper: its name, signature, module
        assert new.__wrapped__.__module__ == mod.__name__ and not isinstance(new.__wrapped__, torch.nn.Module)
        assert ("hub-kernel wrapper" in swapped[q].replaced) == (q in wrapped), swapped[q]
        assert all(getattr(m, k) is new for m, k in where), q  # every alias
    tp.revert(report)
    for q, (mod, obj, where) in before.items():
        assert getattr(mod, q.rsplit(".", 1)[1]) is obj, q  # the very wrapper object again
        assert all(getattr(m, k) is obj for m, k in where), q


# -- the swapped functions run the twinkle ops and keep the model's results -----------------------

def _counting(monkeypatch, names):
    calls = {n: 0 for n in names}
    for name in names:
        fn = getattr(tk, name)

        def wrapper(*a, __fn=fn, __name=name, **k):
            calls[__name] += 1
            return __fn(*a, **k)
        monkeypatch.setattr(tk, name, wrapper)  # the patched functions look the op up on every call
    return calls


def _layers(model, kind):
    types_ = getattr(model.config, "layer_types", None)
    if types_ is None:
        return model.config.num_hidden_layers if kind == "full_attention" else 0
    return sum(t == kind for t in types_)


def _forward_backward(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close(got, want, what):
    atol, rtol = testing.tolerance(torch.float32)
    scale = 10.0  # two layers of fp32 matmuls after the op amplify its roundings (as tests/patches/test_patches.py)
    torch.testing.assert_close(got[0], want[0], atol=atol * scale, rtol=rtol * scale, msg=lambda m: f"{what}: {m}")
    assert got[1].keys() == want[1].keys()
    for n, r in want[1].items():
        gs = scale * max(1.0, float(r.abs().max()))
        torch.testing.assert_close(got[1][n], r, atol=atol * gs, rtol=rtol * scale, msg=lambda m: f"{what} {n}: {m}")


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "qwen3_next", "qwen3_5",
                                    "qwen3_5_moe"])
def test_swapped_functions_run_twinkle_ops_and_match_unpatched(family, monkeypatch):
    model = build(family)
    ids = batch()
    want = _forward_backward(model, ids)
    gdn = tp.FAMILIES[family].gdn
    names = ["apply_rotary_pos_emb"] + (["chunk_gated_delta_rule", "causal_conv1d"] if gdn else [])
    calls = _counting(monkeypatch, names)
    # only the module-global functions: what runs differently is theirs alone
    report = tp.apply(model, ops=("rope", "gdn"), device="cpu")
    assert {f"{family}:apply_rotary_pos_emb"} <= set(report.swapped_names()), report
    got = _forward_backward(model, ids)
    expect = {"apply_rotary_pos_emb": _layers(model, "full_attention")}
    if gdn:
        expect.update(chunk_gated_delta_rule=_layers(model, "linear_attention"),
                      causal_conv1d=_layers(model, "linear_attention"))
    assert calls == expect, f"twinkle ops called {calls}, one per layer expected {expect}"
    _assert_close(got, want, family)
    tp.revert(report)
    again = _forward_backward(model, ids)
    assert torch.equal(again[0], want[0])  # transformers' own code again


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_decode_step_runs_recurrent_and_conv_update_ops(family, monkeypatch):
    """A cached one-token step goes through torch_recurrent_gated_delta_rule and causal_conv1d_update."""
    model = build(family).eval()
    ids = batch(t=9)
    prompt, nxt = ids[:, :8], ids[:, 8:]

    def step():
        with torch.no_grad():
            out = model(input_ids=prompt, use_cache=True)
            return model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True).logits

    want = step()
    calls = _counting(monkeypatch, ["fused_recurrent_gated_delta_rule", "causal_conv1d_update"])
    with tp.patched(model, ops=("rope", "gdn"), device="cpu"):
        got = step()
    n = _layers(model, "linear_attention")
    assert calls == {"fused_recurrent_gated_delta_rule": n, "causal_conv1d_update": n}, calls
    atol, rtol = testing.tolerance(torch.float32)
    torch.testing.assert_close(got, want, atol=atol * 10, rtol=rtol * 10)


# -- foreign patches of the same globals are still reported and left alone -------------------------

def _rope_module():
    from transformers.models.qwen3 import modeling_qwen3 as mq
    return mq


def _transformers_wrapper_or_skip(mq):
    cur = mq.apply_rotary_pos_emb
    if not isinstance(cur, torch.nn.Module):
        assert not _hub_wrappers_expected(), f"transformers {transformers.__version__} should wrap apply_rotary_pos_emb"
        pytest.skip(f"transformers {transformers.__version__} has no hub-kernel wrapper here")
    return cur


def _assert_left_alone(mq, obj, report, *words):
    reason = report.skipped_reasons().get("qwen3:apply_rotary_pos_emb", "")
    assert "qwen3:apply_rotary_pos_emb" not in report.swapped_names()
    assert all(w in reason for w in words), reason
    assert mq.apply_rotary_pos_emb is obj


def test_user_wrapper_object_is_foreign(monkeypatch):
    mq = _rope_module()
    inner = getattr(mq.apply_rotary_pos_emb, "__wrapped__", None) or mq.apply_rotary_pos_emb

    class UserRope(torch.nn.Module):  # a user's own wrapper object around transformers' function
        def forward(self, *args, **kwargs):
            return inner(*args, **kwargs)

    obj = UserRope()
    monkeypatch.setattr(mq, "apply_rotary_pos_emb", obj)
    report = tp.apply(families=["qwen3"], ops=["rope"])
    _assert_left_alone(mq, obj, report, "already patched by another library")


def test_liger_style_function_is_foreign(monkeypatch):
    mq = _rope_module()

    def liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return q, k

    liger_rotary_pos_emb.__module__ = "liger_kernel.transformers.rope"
    monkeypatch.setattr(mq, "apply_rotary_pos_emb", liger_rotary_pos_emb)
    report = tp.apply(families=["qwen3"], ops=["rope"])
    _assert_left_alone(mq, liger_rotary_pos_emb, report, "already patched by another library", "liger_kernel")


def test_kernels_wrapper_of_another_function_is_foreign(monkeypatch):
    """Built with transformers' own decorator, but around a function that is not this module's."""
    mq = _rope_module()
    _transformers_wrapper_or_skip(mq)
    from transformers.integrations.hub_kernels import use_kernel_forward_from_hub

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # the user's, same name and signature
        return q, k

    obj = use_kernel_forward_from_hub("rotary_pos_emb")(apply_rotary_pos_emb)
    assert type(obj).forward.__code__ is type(mq.apply_rotary_pos_emb).forward.__code__
    monkeypatch.setattr(mq, "apply_rotary_pos_emb", obj)
    report = tp.apply(families=["qwen3"], ops=["rope"])
    _assert_left_alone(mq, obj, report, "already patched by another library")
    # another family's transformers wrapper in this module's global is not this module's either
    from transformers.models.llama import modeling_llama as ml
    monkeypatch.setattr(mq, "apply_rotary_pos_emb", ml.apply_rotary_pos_emb)
    report = tp.apply(families=["qwen3"], ops=["rope"])
    _assert_left_alone(mq, ml.apply_rotary_pos_emb, report, "already patched by another library", "modeling_llama")


def test_transformers_wrapper_with_a_selected_hub_kernel_or_hooks_is_left_alone(monkeypatch):
    mq = _rope_module()
    cur = _transformers_wrapper_or_skip(mq)
    monkeypatch.setattr(cur, "forward", lambda *a, **k: a[:2])  # what kernels.kernelize binds on a wrapper
    report = tp.apply(families=["qwen3"], ops=["rope"])
    _assert_left_alone(mq, cur, report, "hub kernel is selected")
    tp.revert(report)
    monkeypatch.delattr(cur, "forward")
    handle = cur.register_forward_hook(lambda m, a, o: o)
    try:
        report = tp.apply(families=["qwen3"], ops=["rope"])
        _assert_left_alone(mq, cur, report, "hooks")
    finally:
        handle.remove()
    tp.revert(report)
    report = tp.apply(families=["qwen3"], ops=["rope"])  # nothing on it: transformers' own, swapped
    assert report.swapped_names() == ["qwen3:apply_rotary_pos_emb"]
    tp.revert(report)
    assert mq.apply_rotary_pos_emb is cur and "forward" not in vars(cur)


def test_model_with_a_hub_kernel_selected_keeps_it():
    """kernels.kernelize binds the kernel as the forward of the layer's private copy of the wrapper
    (kernels' ``_replace_forward``); swapping the global would bypass it, so the target is skipped."""
    import types
    mq = _rope_module()
    cur = _transformers_wrapper_or_skip(mq)
    model = build("qwen3")
    ids = batch()
    attn = model.model.layers[0].self_attn
    private = [w for w in attn._kernel_funcs.values() if type(w) is type(cur)]
    assert len(private) == 1
    calls = []

    def hub_kernel(self, q, k, cos, sin, unsqueeze_dim=1):  # stands in for a kernel from the hub
        calls.append(1)
        return type(cur).forward(self, q, k, cos, sin, unsqueeze_dim)
    private[0].forward = types.MethodType(hub_kernel, private[0])
    model(input_ids=ids)
    assert calls, "the bound kernel is what transformers runs for this layer"
    report = tp.apply(model, ops=["rope"])
    reason = report.skipped_reasons()["qwen3:apply_rotary_pos_emb"]
    assert "runs a hub kernel" in reason and "Qwen3Attention" in reason, reason
    assert mq.apply_rotary_pos_emb is cur
    calls.clear()
    model(input_ids=ids)
    assert calls  # still the user's kernel
    tp.revert(report)
    report = tp.apply(build("qwen3"), ops=["rope"])  # another model without one: swapped
    assert report.swapped_names() == ["qwen3:apply_rotary_pos_emb"]


def test_report_names_the_replaced_wrapper():
    mq = _rope_module()
    _transformers_wrapper_or_skip(mq)
    report = tp.apply(families=["qwen3"], ops=["rope"])
    assert "replaces transformers' hub-kernel wrapper" in str(report), str(report)
    assert sys.modules[mq.__name__].apply_rotary_pos_emb._twinkle_spec == "qwen3:apply_rotary_pos_emb"


# -- the per-family table of python -m twinkle_kernels -----------------------------------------------

def test_family_swaps_table_matches_a_real_apply_and_leaves_nothing_applied(capsys):
    from twinkle_kernels.__main__ import _patch_table
    from twinkle_patches._apply import _ACTIVE, family_swaps
    globals_before = {s.qualname: vars(importlib.import_module(s.module))[s.target]
                      for s in tp.list_patches() if s.kind != "attention_name"}
    rows = family_swaps("cpu")
    assert not _ACTIVE  # applied and reverted family by family
    assert {q: vars(importlib.import_module(q.rsplit(".", 1)[0]))[q.rsplit(".", 1)[1]] for q in globals_before} == \
        globals_before
    assert list(rows) == list(tp.FAMILIES)
    for fam, r in rows.items():
        targets = [s.target for s in tp.list_patches() if s.family == fam]
        assert list(r.swapped) == [t for t in targets if t in r.swapped]  # registry order
        assert sorted(r.swapped + tuple(r.skipped)) == sorted(targets), fam
        assert not set(r.hub_wrappers) - set(r.swapped)
        # the same answer as an apply of that family alone (module globals only, every op)
        report = tp.apply(families=[fam], ops=tp.OPS, device="cpu")
        assert set(r.swapped) == {s.spec.target for s in report.swapped if s.spec.family == fam}, fam
        assert set(r.hub_wrappers) == {s.spec.target for s in report.swapped if s.replaced}, fam
        tp.revert(report)
    if _hub_wrappers_expected():
        assert "torch_chunk_gated_delta_rule" in rows["qwen3_next"].hub_wrappers
        assert "apply_rotary_pos_emb" in rows["llama"].hub_wrappers
    _patch_table(torch.device("cpu"))
    out = capsys.readouterr().out
    total = sum(len(r.swapped) + len(r.skipped) for r in rows.values())
    swapped = sum(len(r.swapped) for r in rows.values())
    assert f"transformers {transformers.__version__}, device cpu): {swapped}/{total} targets swap" in out, out
    for fam, r in rows.items():
        line = next(ln for ln in out.splitlines() if ln.startswith(f"  {fam} "))
        assert f"{len(r.swapped)}/{len(r.swapped) + len(r.skipped)}" in line, line
        assert all(t in line for t in r.swapped), line
        assert all(f"skipped {t}: {why}" in out for t, why in r.skipped.items())
