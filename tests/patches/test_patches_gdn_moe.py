"""The Gated DeltaNet and MoE-experts patches.

Each test runs twice: with ``impl="contract"``, the twinkle ops are stand-ins written here from the
contract in the public functions' docstrings (``twinkle_kernels.chunk_gated_delta_rule``,
``causal_conv1d``, ``moe_experts``: argument order, layouts, varlen ``cu_seqlens``), built on
transformers' own torch functions, so the plumbing of the patches is tested before the kernels
land; with ``impl="twinkle"``, the real ops run, and the test skips until they are in the build.
"""
from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

import twinkle_kernels as tk
import twinkle_patches as tp
from twinkle_kernels import testing

from test_patches_models import assert_unpatched_mishandles_packing, batch, build

pytestmark = pytest.mark.filterwarnings("ignore")

GDN_OPS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d", "causal_conv1d_update")
GDN_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
MOE_FAMILIES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe", "mixtral", "deepseek_v3")


@pytest.fixture(autouse=True)
def _clean_patches():
    tp.revert()
    yield
    tp.revert()


def _real_gdn_missing():
    return [op for op in GDN_OPS if not callable(getattr(tk, op, None))]


def _real_moe_missing():
    try:
        hf = importlib.import_module("twinkle_patches.hf_experts")
    except ImportError:
        return "twinkle_patches.hf_experts"
    if not callable(getattr(hf, "register_hf_experts", None)) or not callable(getattr(tk, "moe_experts", None)):
        return "register_hf_experts / moe_experts"
    return None


# -- contract stand-ins ------------------------------------------------------------------------

def _segments(T, cu):
    if cu is None:
        return [(0, T)]
    c = [int(v) for v in cu.tolist()]
    return list(zip(c[:-1], c[1:]))


def _install_gdn_contract(monkeypatch, calls):
    """The GDN signatures of twinkle_kernels' docstrings, computed per sequence with the transformers torch path."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    chunk, recur = hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule
    conv, conv_update = hf.causal_conv1d_fn, hf.causal_conv1d_update

    def gdr(torch_fn, name):
        def op(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, chunk_size=64, backend=None):
            calls[name] = calls.get(name, 0) + 1
            assert q.dim() == 4 and v.shape[:2] == q.shape[:2] and g.shape == v.shape[:3] == beta.shape
            assert scale is None and isinstance(output_final_state, bool)
            extra = {"chunk_size": chunk_size} if torch_fn is chunk else {}
            outs, states = [], []
            for i, (a, b) in enumerate(_segments(q.shape[1], cu_seqlens)):
                init = None if initial_state is None else initial_state[i:i + 1] if cu_seqlens is not None \
                    else initial_state
                o, s = torch_fn(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b], initial_state=init,
                                output_final_state=output_final_state,
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **extra)
                outs.append(o)
                states.append(s)
            state = torch.cat(states) if output_final_state else None
            return torch.cat(outs, dim=1), state
        return op

    def causal_conv1d(x, weight, bias=None, activation="silu", cu_seqlens=None, *, backend=None):
        calls["causal_conv1d"] = calls.get("causal_conv1d", 0) + 1
        assert x.dim() == 3 and weight.dim() == 2 and x.shape[1] == weight.shape[0]  # [B, D, T], [D, W]
        return torch.cat([conv(x[:, :, a:b], weight, bias, activation) for a, b in _segments(x.shape[2], cu_seqlens)],
                         dim=2)

    def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, *, backend=None):
        calls["causal_conv1d_update"] = calls.get("causal_conv1d_update", 0) + 1
        return conv_update(x, conv_state, weight, bias, activation)

    monkeypatch.setattr(tk, "chunk_gated_delta_rule", gdr(chunk, "chunk_gated_delta_rule"), raising=False)
    monkeypatch.setattr(tk, "fused_recurrent_gated_delta_rule", gdr(recur, "fused_recurrent_gated_delta_rule"),
                        raising=False)
    monkeypatch.setattr(tk, "causal_conv1d", causal_conv1d, raising=False)
    monkeypatch.setattr(tk, "causal_conv1d_update", causal_conv1d_update, raising=False)


def _install_moe_contract(monkeypatch, calls):
    """twinkle_kernels.moe_experts' documented semantics, written as a plain loop, and a register_hf_experts."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    acts = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
            "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh")}

    def moe_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *, activation="silu",
                    backend=None):
        calls["moe_experts"] = calls.get("moe_experts", 0) + 1
        out = torch.zeros_like(hidden_states)
        inter = down_proj.shape[-1]
        for t in range(hidden_states.shape[0]):
            for j in range(top_k_index.shape[1]):
                e = int(top_k_index[t, j])
                if e >= gate_up_proj.shape[0]:
                    continue
                gu = gate_up_proj[e] @ hidden_states[t]
                h = acts[activation](gu[:inter]) * gu[inter:]
                out[t] = out[t] + top_k_weights[t, j] * (down_proj[e] @ h)
        return out

    def experts_forward(self, hidden_states, top_k_index, top_k_weights):
        return moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)

    hf = types.ModuleType("twinkle_patches.hf_experts")
    hf.register_hf_experts = lambda name="twinkle": ALL_EXPERTS_FUNCTIONS.register(name, experts_forward)
    hf.unregister_hf_experts = lambda name: ALL_EXPERTS_FUNCTIONS._global_mapping.pop(name, None)
    monkeypatch.setitem(sys.modules, "twinkle_patches.hf_experts", hf)
    monkeypatch.setattr(tk, "moe_experts", moe_experts, raising=False)


@pytest.fixture(params=["contract", "twinkle"])
def gdn_ops(request, monkeypatch):
    calls = {}
    if request.param == "contract":
        _install_gdn_contract(monkeypatch, calls)
    else:
        missing = _real_gdn_missing()
        if missing:
            pytest.skip(f"twinkle GDN ops not in this build yet: {missing}")
        for op in GDN_OPS:
            fn = getattr(tk, op)

            def spy(*a, __fn=fn, __op=op, **k):
                calls[__op] = calls.get(__op, 0) + 1
                return __fn(*a, **k)
            monkeypatch.setattr(tk, op, spy)
    return request.param, calls


@pytest.fixture(params=["contract", "twinkle"])
def moe_ops(request, monkeypatch):
    calls = {}
    if request.param == "contract":
        _install_moe_contract(monkeypatch, calls)
    else:
        missing = _real_moe_missing()
        if missing:
            pytest.skip(f"twinkle MoE ops not in this build yet: {missing}")
        fn = tk.moe_experts

        def spy(*a, **k):
            calls["moe_experts"] = calls.get("moe_experts", 0) + 1
            return fn(*a, **k)
        monkeypatch.setattr(tk, "moe_experts", spy)
    return request.param, calls


def _run(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.logits.float().square().mean().backward()
    return out.logits.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(got, want, scale):
    atol, rtol = testing.tolerance(torch.float32, "chunk_gated_delta_rule")
    torch.testing.assert_close(got[0], want[0], atol=atol * scale, rtol=rtol * scale)
    assert got[1].keys() == want[1].keys()
    for n in want[1]:
        s = scale * max(1.0, float(want[1][n].abs().max()))
        torch.testing.assert_close(got[1][n], want[1][n], atol=atol * s, rtol=rtol * scale, msg=lambda m: f"{n}: {m}")


# -- Gated DeltaNet --------------------------------------------------------------------------------

@pytest.mark.parametrize("family", GDN_FAMILIES)
def test_gdn_patch_equivalence(family, gdn_ops):
    kind, calls = gdn_ops
    model = build(family)
    ids = batch(t=13)
    want = _run(model, input_ids=ids)
    report = tp.apply(model, ops=("gdn",), backend=None)
    swapped = set(report.swapped_names())
    for fn in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
               "causal_conv1d_update"):
        assert f"{family}:{fn}" in swapped, report
    got = _run(model, input_ids=ids)
    assert calls.get("chunk_gated_delta_rule") and calls.get("causal_conv1d"), calls
    _close(got, want, 10.0 if kind == "twinkle" else 1.0)
    tp.revert(report)
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    assert not hasattr(mod.torch_chunk_gated_delta_rule, "_twinkle_spec")


def test_gdn_decode_uses_recurrent_and_conv_update(gdn_ops):
    """Cached generation: one token at a time goes through the recurrent and conv-update functions."""
    kind, calls = gdn_ops
    model = build("qwen3_5").eval()
    ids = batch(t=6)[:1]
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=3, do_sample=False, min_new_tokens=3)
        with tp.patched(model, ops=("gdn",)):
            got = model.generate(ids, max_new_tokens=3, do_sample=False, min_new_tokens=3)
    assert calls.get("fused_recurrent_gated_delta_rule") and calls.get("causal_conv1d_update"), calls
    assert torch.equal(got, want)


def _packing_kwargs(lengths):
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return dict(position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths),
                max_length_k=max(lengths))


def test_gdn_packed_sequences_stay_independent(gdn_ops):
    """A packed batch (flash-style kwargs, as DataCollatorWithFlattening makes them) through Gated
    DeltaNet layers gives each sample's logits as if run alone. All layers are linear attention
    here: the full-attention layers' packing is the attention implementation's business."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
    from test_patches_models import _cfg
    kind, calls = gdn_ops
    cfg = _cfg("qwen3_5")
    cfg.layer_types = ["linear_attention", "linear_attention"]
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = hf.Qwen3_5ForCausalLM(cfg)
    lengths = [5, 9]
    ids = batch(t=sum(lengths))[:1]
    packed_kwargs = dict(_packing_kwargs(lengths), use_cache=False)
    with torch.no_grad():
        alone = [model(input_ids=ids[:, a:b], use_cache=False).logits for a, b in _segments(ids.shape[1], packed_kwargs["cu_seq_lens_q"])]
        assert_unpatched_mishandles_packing(lambda: model(input_ids=ids, **packed_kwargs).logits,
                                            torch.cat(alone, dim=1))
    with tp.patched(model, ops=("gdn",)), torch.no_grad():
        packed = model(input_ids=ids, **packed_kwargs).logits
    atol, rtol = testing.tolerance(torch.float32, "chunk_gated_delta_rule")
    scale = 10.0 if kind == "twinkle" else 1.0
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), atol=atol * scale, rtol=rtol * scale)


# -- MoE experts ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_experts_patch_equivalence(family, moe_ops):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    kind, calls = moe_ops
    model = build(family)
    ids = batch(t=5)
    want = _run(model, input_ids=ids)
    registered_before = "twinkle" in ALL_EXPERTS_FUNCTIONS
    report = tp.apply(model, ops=("experts",))
    target = next(s.spec.target for s in report.swapped)
    # the class, its built instances, and the model's selection (transformers' default -> "twinkle")
    assert [s.where for s in report.swapped] == ["module", "instances", "config"], report
    assert target.endswith("Experts") and report.swapped[1].instances >= 1
    assert "twinkle" in ALL_EXPERTS_FUNCTIONS  # selectable with experts_implementation="twinkle" too
    got = _run(model, input_ids=ids)
    assert calls.get("moe_experts"), calls
    _close(got, want, 10.0)
    tp.revert(report)
    assert ("twinkle" in ALL_EXPERTS_FUNCTIONS) == registered_before
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    assert all(type(m) is getattr(mod, target) for m in model.modules() if type(m).__name__ == target)


def test_experts_unavailable_is_reported_until_moe_lands():
    if not _real_moe_missing():
        pytest.skip("the MoE ops are in this build")
    report = tp.apply(families=["qwen3_moe"], ops=("experts",))
    assert report.swapped == []
    assert report.skipped_reasons()["qwen3_moe:Qwen3MoeExperts"].startswith("op unavailable")


def test_gdn_unavailable_is_reported_until_gdn_lands():
    missing = _real_gdn_missing()
    if not missing:
        pytest.skip("the GDN ops are in this build")
    report = tp.apply(families=["qwen3_next"], ops=("gdn",))
    reasons = report.skipped_reasons()
    assert reasons["qwen3_next:torch_chunk_gated_delta_rule"].startswith("op unavailable")
