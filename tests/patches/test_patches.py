"""twinkle_patches on tiny Hugging Face models: equivalence (logits and every gradient, patched vs
unpatched) for each family, and the registry mechanics (report, idempotence, exact revert, the
context manager, toggles, conflicts with other patchers, bad names)."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types

import pytest
import torch

import twinkle_kernels as tk
import twinkle_patches as tp
from twinkle_kernels import testing

from conftest import ROOT
from test_patches_models import FAMILY_NAMES, batch, build

pytestmark = pytest.mark.filterwarnings("ignore")

# What each family must swap on its tiny model (instances of these classes exist in it).
EXPECTED_CLASSES = {
    "llama": ("LlamaRMSNorm", "LlamaMLP"),
    "qwen2": ("Qwen2RMSNorm", "Qwen2MLP"),
    "qwen3": ("Qwen3RMSNorm", "Qwen3MLP"),
    "qwen3_moe": ("Qwen3MoeRMSNorm", "Qwen3MoeMLP"),
    "qwen3_next": ("Qwen3NextRMSNorm", "Qwen3NextRMSNormGated", "Qwen3NextMLP"),
    "qwen3_5": ("Qwen3_5RMSNorm", "Qwen3_5RMSNormGated", "Qwen3_5MLP"),
    "qwen3_5_moe": ("Qwen3_5MoeRMSNorm", "Qwen3_5MoeRMSNormGated", "Qwen3_5MoeMLP"),
    "mixtral": ("MixtralRMSNorm",),
    "glm4_moe": ("Glm4MoeRMSNorm", "Glm4MoeMLP"),
    "deepseek_v3": ("DeepseekV3RMSNorm", "DeepseekV3MLP"),
}
# The ops every family's forward must reach once patched (proves the patch runs, not just exists).
EXPECTED_OPS = {f: {"rms_norm", "apply_rotary_pos_emb"} for f in FAMILY_NAMES}
for _f in FAMILY_NAMES:
    if _f != "mixtral":
        EXPECTED_OPS[_f].add("swiglu")
for _f in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
    EXPECTED_OPS[_f].add("gated_rms_norm")


@pytest.fixture(autouse=True)
def _clean_patches():
    tp.revert()
    yield
    tp.revert()


@pytest.fixture
def spy(monkeypatch):
    """Counts calls of the twinkle ops the patches reach (they look the op up on every call)."""
    calls = {}
    for name in ("rms_norm", "gated_rms_norm", "apply_rotary_pos_emb", "swiglu"):
        fn = getattr(tk, name)

        def wrapper(*a, __fn=fn, __name=name, **k):
            calls[__name] = calls.get(__name, 0) + 1
            return __fn(*a, **k)

        monkeypatch.setattr(tk, name, wrapper)
    return calls


def _run(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().clone(), grads


def _assert_model_close(got, want, dtype, scale):
    logits, grads = got
    ref_logits, ref_grads = want
    atol, rtol = testing.tolerance(dtype)
    torch.testing.assert_close(logits.double(), ref_logits.double(), atol=atol * scale, rtol=rtol * scale)
    assert grads.keys() == ref_grads.keys()
    for n in ref_grads:
        g, r = grads[n], ref_grads[n]
        gs = scale * max(1.0, float(r.abs().max()))  # weight grads sum over every token
        torch.testing.assert_close(g.double(), r.double(), atol=atol * gs, rtol=rtol * scale, msg=lambda m: f"{n}: {m}")


def _max_diff(a, b):
    return float((a.double() - b.double()).abs().max())


# Logits pass through 2 layers of matmuls after the patched op; the differences are roundings of
# fp32 (or bf16) intermediates, amplified by the layers. Measured max logit differences are printed.
_FP32_SCALE = 10.0
_BF16_SCALE = 4.0


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_family_equivalence_fp32(family, spy):
    model = build(family)
    ids = batch()
    want = _run(model, ids)
    keys = list(model.state_dict().keys())
    ptrs = [t.data_ptr() for t in model.state_dict().values()]
    report = tp.apply(model, backend="reference")
    swapped = {s.spec.target for s in report.swapped if s.where == "instances"}
    for cls in EXPECTED_CLASSES[family]:
        assert cls in swapped, f"{cls} not swapped: {report}"
    assert {s.spec.target for s in report.swapped if s.where == "module"} >= {"apply_rotary_pos_emb"}
    assert all(s.backend == "reference" for s in report.swapped if not s.spec.kind.startswith("attention"))
    assert model.config._attn_implementation == "eager"  # the user's choice is kept
    assert list(model.state_dict().keys()) == keys
    assert [t.data_ptr() for t in model.state_dict().values()] == ptrs
    got = _run(model, ids)
    assert EXPECTED_OPS[family] <= set(spy), f"ops reached: {spy}"
    print(f"{family}: max logit diff {_max_diff(got[0], want[0]):.3g}")
    _assert_model_close(got, want, torch.float32, _FP32_SCALE)
    tp.revert(report)
    assert model.config._attn_implementation == "eager"
    for m in model.modules():
        assert not hasattr(type(m), "_twinkle_original")
    # reverted: the original code again, bit for bit
    again = _run(model, ids)
    assert torch.equal(again[0], want[0])


def test_bf16_equivalence_qwen3_5(spy):
    model = build("qwen3_5", dtype=torch.bfloat16)
    ids = batch()
    want = _run(model, ids)
    with tp.patched(model, backend="reference"):
        got = _run(model, ids)
    assert {"rms_norm", "gated_rms_norm", "apply_rotary_pos_emb", "swiglu"} <= set(spy)
    assert got[0].dtype == torch.bfloat16
    print(f"qwen3_5 bf16: max logit diff {_max_diff(got[0], want[0]):.3g}")
    _assert_model_close(got, want, torch.bfloat16, _BF16_SCALE)


def _fast_backend_ready(backend):
    from conftest import cpu_backend_available, triton_available
    if backend == "cpu" and not cpu_backend_available():
        return False
    if backend == "triton" and not triton_available():
        return False
    # the fast paths of every patched op must exist in this build (they land in separate issues)
    return all(importlib.util.find_spec(f"twinkle_kernels.{pkg}._{backend}") is not None
               for pkg in ("norm", "rope", "swiglu"))


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_fast_backend_equivalence_qwen3(backend):
    if not _fast_backend_ready(backend):
        pytest.skip(f"the {backend} fast paths of rms_norm / rope / swiglu are not in this build")
    model = build("qwen3")
    ids = batch(t=7)
    want = _run(model, ids)
    with tp.patched(model, backend=backend) as report:
        assert all(s.backend == backend for s in report.swapped if not s.spec.kind.startswith("attention"))
        got = _run(model, ids)
    _assert_model_close(got, want, torch.float32, _FP32_SCALE)


def test_model_built_after_apply_is_patched(spy):
    want = _run(build("qwen3"), batch())
    report = tp.apply(families=["qwen3"])
    assert {s.where for s in report.swapped} == {"module", "registry"}  # registry: the packed attention
    model = build("qwen3")  # same seed: same weights as the unpatched one
    assert any(hasattr(type(m), "_twinkle_original") for m in model.modules())
    got = _run(model, batch())
    assert {"rms_norm", "apply_rotary_pos_emb", "swiglu"} <= set(spy)
    _assert_model_close(got, want, torch.float32, _FP32_SCALE)
    # revert also moves the instances built while patched back to the original classes
    from transformers.models.qwen3 import modeling_qwen3 as mq
    tp.revert(report)
    assert all(type(m) is mq.Qwen3RMSNorm for m in model.modules() if "RMSNorm" in type(m).__name__)
    assert torch.equal(_run(model, batch())[0], want[0])


# -- registry mechanics -------------------------------------------------------------------------------

def _targets():
    out = {}
    for spec in tp.list_patches():
        if spec.kind == "attention_name":
            continue
        mod = importlib.import_module(spec.module)
        out[spec.qualname] = (mod, spec.target, vars(mod).get(spec.target))
    return out


def test_list_patches_covers_every_family():
    specs = tp.list_patches()
    assert {s.family for s in specs} == set(tp.FAMILIES) | {"all"}  # "all": the packed attention
    names = {s.name for s in specs}
    for expected in ("qwen3_next:Qwen3NextRMSNorm", "qwen3_5:Qwen3_5RMSNormGated", "qwen3_5_moe:causal_conv1d_fn",
                     "qwen3_moe:Qwen3MoeExperts", "mixtral:MixtralExperts", "deepseek_v3:DeepseekV3MLP",
                     "qwen3_next:torch_chunk_gated_delta_rule", "llama:apply_rotary_pos_emb"):
        assert expected in names
    assert all(s.devices and s.op in tp.OPS for s in specs)
    assert "Qwen3NextRMSNorm" in str(next(s for s in specs if s.target == "Qwen3NextRMSNorm"))


TESTED_TRANSFORMERS = (5, 25)  # the version the registry's names and signatures were checked against


def test_canary_every_registered_target_exists_in_installed_transformers():
    """Fails loudly when a transformers at least as new as the tested one renames or drops a patched
    target or changes its signature; on an older transformers, missing targets are skip reasons."""
    import transformers
    from twinkle_patches import _apply, _impls
    problems = []
    for spec in tp.list_patches():
        try:
            mod = importlib.import_module(spec.module)
        except ImportError as e:
            problems.append(f"{spec.module}: {e}")
            continue
        if spec.kind == "attention_name":
            if not callable(getattr(mod.AttentionInterface, "register", None)):
                problems.append("AttentionInterface.register is gone")
            continue
        if spec.kind == "attention":
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
            if vars(mod).get(spec.target) is not ALL_ATTENTION_FUNCTIONS:
                problems.append(f"{spec.qualname} is not transformers' global AttentionInterface")
            continue
        if spec.target not in vars(mod):
            problems.append(f"{spec.qualname} disappeared")
            continue
        obj = vars(mod)[spec.target]
        # 5.25 wraps the functions in its hub-kernel objects: the function inside is the target
        obj = _apply._hub_wrapped(spec, obj, mod.__name__) or obj
        why = _impls.IMPLS[spec.impl].target_reason(obj)
        if why is not None:
            problems.append(f"{spec.qualname}: {why}")
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    if problems and version < TESTED_TRANSFORMERS:
        pytest.skip(f"transformers {transformers.__version__} predates the tested {TESTED_TRANSFORMERS}: {problems}")
    assert not problems, f"transformers {transformers.__version__}: " + "; ".join(problems)


def test_report_contents_and_skip_reasons():
    report = tp.apply(families=["qwen3", "qwen3_5"], backend="reference")
    names = report.swapped_names()
    for n in ("qwen3:Qwen3RMSNorm", "qwen3:apply_rotary_pos_emb", "qwen3:Qwen3MLP", "qwen3_5:Qwen3_5RMSNorm",
              "qwen3_5:Qwen3_5RMSNormGated", "qwen3_5:Qwen3_5MLP"):
        assert n in names
    s = next(s for s in report.swapped if s.spec.name == "qwen3:Qwen3RMSNorm")
    assert s.impl == "twinkle_kernels.rms_norm" and s.backend == "reference" and s.where == "module"
    reasons = report.skipped_reasons()
    for gdn in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                "causal_conv1d_update"):
        key = f"qwen3_5:{gdn}"
        op = next(sp.op for sp in tp.list_patches() if sp.name == key)
        if callable(getattr(tk, op, None)):  # the GDN ops have landed
            assert key in names
        else:
            assert reasons[key] == f"op unavailable: twinkle_kernels.{op} does not exist in this build"
    assert "device=cpu" in str(report) and "swapped" in str(report)


def test_auto_backend_is_reported():
    report = tp.apply(families="llama", ops=["rms_norm"])
    assert [s.spec.name for s in report.swapped] == ["llama:LlamaRMSNorm"]
    assert report.swapped[0].backend.startswith("auto:")


def test_apply_twice_is_a_noop():
    first = tp.apply(families=["qwen3", "qwen3_next"])
    before = {k: v[2] for k, v in _targets().items()}
    second = tp.apply(families=["qwen3", "qwen3_next"])
    assert second.swapped == []
    assert {s.spec.name for s in first.swapped} <= {s.spec.name for s in second.skipped}
    assert all("already patched by twinkle_patches" in s.reason
               for s in second.skipped if s.spec.name in first.swapped_names())
    assert {k: v[2] for k, v in _targets().items()} == before
    assert all(before[k] is v[2] for k, v in _targets().items())


def test_apply_twice_on_a_model_is_a_noop():
    model = build("qwen3")
    first = tp.apply(model)
    types_after = [type(m) for m in model.modules()]
    second = tp.apply(model)
    assert first.swapped and second.swapped == []
    assert [type(m) for m in model.modules()] == types_after


def test_revert_restores_identical_objects():
    model = build("qwen3_5")
    originals = _targets()
    classes = [type(m) for m in model.modules()]
    forwards = {c: c.__dict__.get("forward") for c in classes}
    tp.apply(model)
    tp.apply()  # every family
    assert any(v[2] is not getattr(v[0], v[1]) for v in originals.values())
    tp.revert()
    for q, (mod, name, obj) in originals.items():
        assert getattr(mod, name) is obj, q
    assert [type(m) for m in model.modules()] == classes
    assert all(c.__dict__.get("forward") is forwards[c] for c in classes)
    assert not any("forward" in vars(m) for m in model.modules())


def test_revert_one_report_leaves_the_others():
    from transformers.models.llama import modeling_llama as ml
    from transformers.models.qwen3 import modeling_qwen3 as mq
    orig_l, orig_q = ml.LlamaRMSNorm, mq.Qwen3RMSNorm
    r1 = tp.apply(families=["llama"])
    r2 = tp.apply(families=["qwen3"])
    tp.revert(r1)
    assert ml.LlamaRMSNorm is orig_l and mq.Qwen3RMSNorm is not orig_q
    tp.revert(r2)
    assert mq.Qwen3RMSNorm is orig_q
    tp.revert(r2)  # reverting twice is harmless


def test_aliases_in_other_modules_are_patched_and_restored():
    from transformers.models.qwen3 import modeling_qwen3 as mq
    orig = mq.apply_rotary_pos_emb
    alias = types.ModuleType("user_code_alias")
    alias.apply_rotary_pos_emb = orig  # as `from ...modeling_qwen3 import apply_rotary_pos_emb` does
    sys.modules[alias.__name__] = alias
    try:
        report = tp.apply(families=["qwen3"], ops=["rope"])
        assert alias.apply_rotary_pos_emb is mq.apply_rotary_pos_emb is not orig
        assert "user_code_alias" in report.swapped[0].aliases
        # __wrapped__: the function modeling_qwen3 defines (on 5.25 the one inside its hub-kernel wrapper)
        inner = alias.apply_rotary_pos_emb.__wrapped__
        assert inner is orig or isinstance(orig, torch.nn.Module)
        assert inner.__code__.co_filename == mq.__file__ and inner.__name__ == "apply_rotary_pos_emb"
        tp.revert(report)
        assert alias.apply_rotary_pos_emb is orig and mq.apply_rotary_pos_emb is orig
    finally:
        del sys.modules[alias.__name__]


def test_patched_context_reverts_on_exception():
    from transformers.models.qwen3 import modeling_qwen3 as mq
    model = build("qwen3")
    orig = mq.Qwen3RMSNorm
    with pytest.raises(RuntimeError, match="boom"):
        with tp.patched(model, ops=("rms_norm",)) as report:
            assert mq.Qwen3RMSNorm is not orig
            assert report.swapped_names() == ["qwen3:Qwen3RMSNorm", "qwen3:Qwen3RMSNorm"]
            raise RuntimeError("boom")
    assert mq.Qwen3RMSNorm is orig
    assert all(type(m) is orig for m in model.modules() if "RMSNorm" in type(m).__name__)


def test_ops_filter():
    report = tp.apply(families=["qwen3"], ops=("rms_norm",))
    assert report.swapped_names() == ["qwen3:Qwen3RMSNorm"]
    from transformers.models.qwen3 import modeling_qwen3 as mq
    assert not hasattr(mq.apply_rotary_pos_emb, "_twinkle_spec")


def test_liger_style_instance_bound_forward_is_detected():
    model = build("qwen3")
    norm = model.model.norm
    sentinel = []

    def liger_forward(self, hidden_states):  # Liger binds its forward on each instance
        sentinel.append(1)
        return hidden_states

    norm.forward = types.MethodType(liger_forward, norm)
    ids = batch()
    report = tp.apply(model)
    reasons = [s.reason for s in report.skipped if s.spec.name == "qwen3:Qwen3RMSNorm"]
    assert len(reasons) == 1 and "already patched by another library" in reasons[0]
    assert "__dict__['forward']" in reasons[0] and "1 instance" in reasons[0]
    assert not hasattr(type(norm), "_twinkle_original")  # left alone
    model(input_ids=ids)
    assert sentinel == [1]  # the other library's forward still runs
    other = [m for m in model.modules() if "RMSNorm" in type(m).__name__ and m is not norm]
    assert other and all(hasattr(type(m), "_twinkle_original") for m in other)


def test_module_global_replaced_by_another_library_is_skipped(monkeypatch):
    from transformers.models.qwen3 import modeling_qwen3 as mq

    def foreign_rope(q, k, cos, sin, unsqueeze_dim=1):
        return q, k

    foreign_cls = type("Qwen3RMSNorm", (torch.nn.Module,), {"__module__": "liger_kernel.transformers.rms_norm"})
    monkeypatch.setattr(mq, "apply_rotary_pos_emb", foreign_rope)
    monkeypatch.setattr(mq, "Qwen3RMSNorm", foreign_cls)
    report = tp.apply(families=["qwen3"])
    reasons = report.skipped_reasons()
    assert "already patched by another library" in reasons["qwen3:apply_rotary_pos_emb"]
    assert "liger_kernel" in reasons["qwen3:Qwen3RMSNorm"]
    assert mq.apply_rotary_pos_emb is foreign_rope and mq.Qwen3RMSNorm is foreign_cls
    assert "qwen3:Qwen3MLP" in report.swapped_names()


def test_non_silu_mlp_is_skipped_with_reason():
    model = build("llama")
    mlp = model.model.layers[0].mlp
    mlp.act_fn = torch.nn.ReLU()   # GELU is served (activation="gelu"), ReLU is no GLU activation of the op
    report = tp.apply(model, ops=["swiglu"])
    assert any("act_fn is ReLU, which the fused GLU does not compute" in s.reason
               for s in report.skipped if s.spec.name == "llama:LlamaMLP")
    assert not hasattr(type(mlp), "_twinkle_original")
    assert hasattr(type(model.model.layers[1].mlp), "_twinkle_original")


def test_toggles_are_read_at_apply_time(monkeypatch):
    # set after twinkle_patches was imported: only apply() reads them
    monkeypatch.setenv("TWINKLE_NPU_FUSED_OPS", "0")
    r = tp.apply(families=["qwen3"], device="npu")
    assert r.swapped == []
    assert all(s.reason == "disabled by toggle TWINKLE_NPU_FUSED_OPS=0" for s in r.skipped)
    tp.revert(r)
    r = tp.apply(families=["qwen3"], device="cpu")  # Ascend toggles do not govern other devices
    assert "qwen3:Qwen3RMSNorm" in r.swapped_names()
    tp.revert(r)
    monkeypatch.setenv("TWINKLE_NPU_FUSED_OPS", "1")
    monkeypatch.setenv("TWINKLE_NPU_PATCH", "0")
    r = tp.apply(families=["qwen3"], device="npu")
    assert r.swapped == [] and all("TWINKLE_NPU_PATCH=0" in s.reason for s in r.skipped)
    monkeypatch.delenv("TWINKLE_NPU_PATCH")
    monkeypatch.setenv("TWINKLE_NPU_MOE_PATCH", "0")
    monkeypatch.setenv("TWINKLE_NPU_FLA", "0")
    r = tp.apply(families=["qwen3_5_moe"], device="npu")
    reasons = r.skipped_reasons()
    assert reasons["qwen3_5_moe:Qwen3_5MoeExperts"] == "disabled by toggle TWINKLE_NPU_MOE_PATCH=0"
    assert reasons["qwen3_5_moe:torch_chunk_gated_delta_rule"] == "disabled by toggle TWINKLE_NPU_FLA=0"
    assert "qwen3_5_moe:Qwen3_5MoeRMSNorm" in r.swapped_names()
    tp.revert(r)
    monkeypatch.setenv("TWINKLE_PATCH", "0")  # device-neutral master switch
    r = tp.apply(families=["qwen3"])
    assert r.swapped == [] and all(s.reason == "disabled by toggle TWINKLE_PATCH=0" for s in r.skipped)


def test_import_patches_nothing():
    code = ("import sys, importlib.util as u; s = u.spec_from_file_location('twinkle_patches', 'patches/__init__.py', "
            "submodule_search_locations=['patches']); m = u.module_from_spec(s); sys.modules['twinkle_patches'] = m; "
            "s.loader.exec_module(m); print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"  # not even transformers is imported, let alone patched


def test_bad_names_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown op 'rmsnorm'.*rms_norm"):
        tp.apply(ops=["rmsnorm"])
    with pytest.raises(ValueError, match="unknown model family 'gpt2'.*qwen3"):
        tp.apply(families=["gpt2"])
    with pytest.raises(ValueError, match="backend='cuda' is not a backend"):
        tp.apply(families=["qwen3"], backend="cuda")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        tp.apply(model="qwen3")
    # accepted spellings
    r = tp.apply(families=["Qwen3-MoE", "qwen3.5"], ops=["RMS_NORM"])
    assert {s.spec.family for s in r.swapped} == {"qwen3_moe", "qwen3_5"}


def test_explicit_backend_unavailable_is_reported():
    r = tp.apply(families=["qwen3"], ops=("norm", "rope", "swiglu"), backend="npu")
    assert r.swapped == []
    assert r.skipped and all(s.reason.startswith("op unavailable on this device") and "npu" in s.reason
                             for s in r.skipped), r


def test_readme_example_runs():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "hf_patch.py")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "swapped" in out.stdout and "max |logits diff|" in out.stdout


def test_readme_section_matches_example():
    page = open(os.path.join(ROOT, "docs", "patching.md")).read()
    section = page.split("## Apply, report, revert", 1)[1]
    block = section.split("```python", 1)[1].split("```", 1)[0]
    example = open(os.path.join(ROOT, "examples", "hf_patch.py")).read()
    assert block.strip() in example, "docs/patching.md's first python block must be the body of examples/hf_patch.py"


@pytest.mark.slow  # ~20 s (Qwen3) and ~60 s (Qwen3.5: transformers' torch GDN path) on 2 busy cores
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_convergence_30_steps_adamw(family):
    """Train the same tiny model 30 AdamW steps unpatched and patched: per-step losses agree."""
    def train(patch):
        model = build(family)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        data = torch.randint(0, 64, (4, 2, 12), generator=torch.Generator().manual_seed(7))
        losses = []
        with tp.patched(model) if patch else _nullcontext():
            for step in range(30):
                ids = data[step % 4]  # a few batches seen repeatedly: the loss must fall
                loss = model(input_ids=ids, labels=ids).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
        return torch.tensor(losses)

    want, got = train(False), train(True)
    assert want[-1] < want[0] - 0.1  # it does learn
    print(f"{family}: max per-step loss diff over 30 steps {float((got - want).abs().max()):.3g}")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _nullcontext():
    import contextlib
    return contextlib.nullcontext()


def test_class_forward_replaced_by_another_library_is_skipped(monkeypatch):
    from transformers.models.qwen3 import modeling_qwen3 as mq

    def foreign_forward(self, x):  # e.g. a library assigning Qwen3MLP.forward = its own
        return x

    monkeypatch.setattr(mq.Qwen3MLP, "forward", foreign_forward)
    report = tp.apply(families=["qwen3"], ops=["swiglu"])
    assert report.swapped == []
    reason = report.skipped_reasons()["qwen3:Qwen3MLP"]
    assert "already patched by another library" in reason and "test_patches" in reason


def test_model_without_a_known_family_patches_nothing():
    report = tp.apply(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert report.swapped == [] and report.skipped == []


def test_alias_made_while_patched_is_restored():
    from transformers.models.qwen3 import modeling_qwen3 as mq
    orig = mq.Qwen3RMSNorm
    report = tp.apply(families=["qwen3"], ops=["rms_norm"])
    late = types.ModuleType("user_code_late_import")
    late.Qwen3RMSNorm = mq.Qwen3RMSNorm  # imported after apply: holds the patched class
    sys.modules[late.__name__] = late
    try:
        tp.revert(report)
        assert late.Qwen3RMSNorm is orig
    finally:
        del sys.modules[late.__name__]


def test_missing_target_and_missing_family_are_skip_reasons(monkeypatch):
    from transformers.models.qwen3 import modeling_qwen3 as mq
    from twinkle_patches import _apply
    from twinkle_patches._specs import PatchSpec
    monkeypatch.delattr(mq, "Qwen3MLP")  # as if a newer transformers renamed it
    ghost = PatchSpec("qwen3", "transformers.models.qwen9.modeling_qwen9", "Qwen9RMSNorm", "class", "rms_norm",
                      "rms_norm")
    monkeypatch.setattr(_apply, "SPECS", _apply.SPECS + (ghost,))
    report = tp.apply(families=["qwen3"])
    reasons = report.skipped_reasons()
    assert reasons["qwen3:Qwen3MLP"].startswith("target missing: transformers.models.qwen3.modeling_qwen3.Qwen3MLP "
                                                "does not exist in transformers")
    assert reasons["qwen3:Qwen9RMSNorm"].startswith("family not installed: transformers.models.qwen9.modeling_qwen9")
    assert "qwen3:Qwen3RMSNorm" in report.swapped_names()


def test_target_that_is_an_alias_of_another_patched_target_is_not_patched_twice(monkeypatch):
    from transformers.models.llama import modeling_llama as ml
    from transformers.models.qwen2 import modeling_qwen2 as mq2
    # a modeling file importing another one's function: patched once, through the alias
    monkeypatch.setattr(mq2, "apply_rotary_pos_emb", ml.apply_rotary_pos_emb)
    report = tp.apply(families=["llama", "qwen2"], ops=["rope"])
    assert report.swapped_names() == ["llama:apply_rotary_pos_emb"]
    assert mq2.apply_rotary_pos_emb is ml.apply_rotary_pos_emb
    assert ml.apply_rotary_pos_emb.__wrapped__.__module__ == ml.__name__  # one layer of patching
    assert "alias of llama:apply_rotary_pos_emb" in report.skipped_reasons()["qwen2:apply_rotary_pos_emb"]
