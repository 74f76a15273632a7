"""CPU plumbing checks on a SIMULATED NPU platform (tests/npu/_sim.py + the torch_npu EMULATION).

Covers: the registry's device dispatch choosing ``npu`` for every op on an npu device, the GDN
wiring to the Triton kernels (run here by the Triton interpreter), the patch plan and Ascend
toggles, patched tiny Hugging Face models through the emulated operators vs unpatched, and the
Megatron hook (hccl, MindSpeed adaptor before the process group). Nothing here ran on an NPU.
"""
import sys
import types

import pytest
import torch

import twinkle_kernels as tk
import twinkle_patches as tp
from twinkle_kernels import _dispatch, testing
from twinkle_kernels.gdn import _npu as npu_gdn
from twinkle_megatron.parallel import mindspeed as npu_ms

from ._sim import simulate_npu
from .emulation import EmulatedTorchNpu

pytestmark = pytest.mark.filterwarnings("ignore")
NPU = types.SimpleNamespace(type="npu")  # torch.device("npu") needs torch_npu


@pytest.fixture
def emulated(monkeypatch):
    return simulate_npu(monkeypatch, EmulatedTorchNpu())


@pytest.fixture(autouse=True)
def _clean_patches():
    tp.revert()
    yield
    tp.revert()


def _op_args():
    x, w = torch.randn(3, 16), torch.randn(16)
    q, k = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    cs = torch.randn(1, 5, 16)
    gq = torch.randn(1, 8, 2, 16)
    gv, gg = torch.randn(1, 8, 2, 16), -torch.rand(1, 8, 2)
    gdn = (gq, gq, gv, gg, torch.rand(1, 8, 2), 0.25, None, False, False, None, 64)
    return {
        "rms_norm": (x, w, 1e-6, 0.0), "gated_rms_norm": (x, x, w, 1e-6),
        "apply_rotary_pos_emb": (q, k, cs, cs, 1), "swiglu": (x, x), "swiglu_packed": (x,),
        "grouped_matmul": (x, torch.randn(2, 16, 4), torch.tensor([1, 3], dtype=torch.int32)),
        "moe_experts": (x, torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1), torch.randn(2, 8, 16),
                        torch.randn(2, 16, 4)),
        "chunk_gated_delta_rule": gdn, "fused_recurrent_gated_delta_rule": gdn,
    }


def test_emulated_dispatch_picks_npu_for_every_op_on_an_npu_device(emulated, monkeypatch):
    monkeypatch.setattr(npu_gdn, "triton_ascend_reason", lambda: None)
    for name, args in _op_args().items():
        assert _dispatch.op(name).select(NPU, None, *args) == "npu", name


def test_dispatch_on_simulated_npu_without_triton_ascend_falls_back_with_reason(emulated):
    args = _op_args()["chunk_gated_delta_rule"]
    assert "triton-ascend is not installed" in _dispatch.op("chunk_gated_delta_rule").reason("npu", *args)
    assert _dispatch.op("chunk_gated_delta_rule").select(NPU, None, *args) == "reference"


def test_gdn_sources_and_reasons_here():
    assert npu_gdn.triton_ascend_reason() == \
        "triton-ascend is not installed (the npu GDN kernels are Triton kernels compiled by it)"
    assert npu_gdn.fla_available() is False  # flash-linear-attention is not installed here


def test_emulated_gdn_npu_path_runs_twinkle_triton_kernels(emulated, monkeypatch):
    """On a simulated NPU with triton-ascend 'present', the npu GDN backend runs twinkle's Triton
    kernels (here in the Triton interpreter on CPU tensors): forward and gradients vs float64."""
    monkeypatch.setattr(npu_gdn, "triton_ascend_reason", lambda: None)
    monkeypatch.setattr(npu_gdn, "fla_available", lambda: False)
    torch.manual_seed(0)
    B, T, H, K, V = 1, 19, 2, 16, 16
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, H, V)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H) + 2)
    beta = torch.rand(B, T, H)
    ins = [q, k, v, g, beta]

    def run(backend, dtype):
        xs = [t.detach().to(dtype).clone().requires_grad_() for t in ins]
        o, ht = tk.chunk_gated_delta_rule(*xs, output_final_state=True, chunk_size=16, backend=backend)
        torch.manual_seed(3)
        ((o.double() * torch.randn(o.shape, dtype=torch.float64)).sum() + ht.double().sum()).backward()
        return [o.detach(), ht.detach()] + [x.grad for x in xs]

    got, ref = run("npu", torch.float32), run("reference", torch.float64)
    for name, a, b in zip(("o", "ht", "dq", "dk", "dv", "dg", "dbeta"), got, ref):
        testing.assert_close(a, b, torch.float32, name=name, scale=8.0)


@pytest.mark.parametrize("value,on", [("0", False), ("false", False), (" OFF ", False), ("no", False),
                                      ("1", True), ("", True), ("yes", True)])
def test_toggle_parsing_on_simulated_npu(emulated, monkeypatch, value, on):
    monkeypatch.setenv("TWINKLE_NPU_FUSED_OPS", value)
    r = tp.apply(families=["qwen3"], ops=("rms_norm",), device="npu")
    if on:
        assert r.swapped and all(s.backend == "auto:npu" for s in r.swapped), str(r)
    else:
        assert not r.swapped and all("TWINKLE_NPU_FUSED_OPS" in s.reason for s in r.skipped), str(r)


def test_patch_plan_on_simulated_npu(emulated, monkeypatch):
    """Default: every group on, each op served by the npu backend; then each toggle turns its group off."""
    r = tp.apply(families=["qwen3_5_moe"], device="npu")
    ops = {s.spec.op: s.backend for s in r.swapped}
    for op in ("rms_norm", "gated_rms_norm", "apply_rotary_pos_emb", "moe_experts", "chunk_gated_delta_rule"):
        assert ops.get(op) == "auto:npu", str(r)
    tp.revert(r)
    monkeypatch.setenv("TWINKLE_NPU_FLA", "0")
    monkeypatch.setenv("TWINKLE_NPU_MOE_PATCH", "0")
    r = tp.apply(families=["qwen3_5_moe"], device="npu")
    swapped_ops = {s.spec.op for s in r.swapped}
    assert "moe_experts" not in swapped_ops and "chunk_gated_delta_rule" not in swapped_ops
    assert "rms_norm" in swapped_ops
    reasons = set(r.skipped_reasons().values())
    assert "disabled by toggle TWINKLE_NPU_FLA=0" in reasons and "disabled by toggle TWINKLE_NPU_MOE_PATCH=0" in reasons
    tp.revert(r)
    # the Ascend toggles govern the npu device only
    r = tp.apply(families=["qwen3_5_moe"], device="cpu")
    assert "moe_experts" in {s.spec.op for s in r.swapped}


def _fwd_bwd(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                 if p.grad is not None}


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_emulated_patched_tiny_model_matches_unpatched(emulated, family):
    from tests.patches.test_patches_models import batch, build
    model = build(family)
    ids = batch()
    ref_logits, ref_grads = _fwd_bwd(model, ids)
    emulated.calls.clear()
    r = tp.apply(model, backend="npu")
    assert r.swapped, str(r)
    logits, grads = _fwd_bwd(model, ids)
    names = {c[0] for c in emulated.calls}
    assert {"npu_rms_norm", "npu_rotary_mul"} <= names
    assert ("npu_grouped_matmul" in names) == (family == "qwen3_moe")
    testing.assert_close(logits.double(), ref_logits.double(), torch.float32, scale=16.0, name="logits")
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        testing.assert_close(grads[n].double(), ref_grads[n].double(), torch.float32, scale=16.0, name=n)


# -- Megatron on NPU ----------------------------------------------------------------------------

def test_mindspeed_skipped_with_reason_when_not_installed(caplog):
    with caplog.at_level("INFO", logger="twinkle_kernels"):
        assert npu_ms.apply_mindspeed_adaptor() == "MindSpeed is not installed"
    assert "MindSpeed adaptor skipped: MindSpeed is not installed" in caplog.text


@pytest.fixture
def fake_mindspeed(tmp_path, monkeypatch):
    """A stand-in ``mindspeed`` package whose ``megatron_adaptor`` records that it was imported."""
    events = types.ModuleType("twinkle_npu_test_events")
    events.log = []
    monkeypatch.setitem(sys.modules, "twinkle_npu_test_events", events)
    pkg = tmp_path / "mindspeed"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "megatron_adaptor.py").write_text(
        "import sys\nsys.modules['twinkle_npu_test_events'].log.append('mindspeed.megatron_adaptor')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield events.log
    for name in ("mindspeed", "mindspeed.megatron_adaptor"):
        sys.modules.pop(name, None)


def test_initialize_on_simulated_npu_applies_mindspeed_then_uses_hccl(fake_mindspeed, monkeypatch):
    pytest.importorskip("megatron.core")
    import twinkle_megatron.parallel.mesh as mesh_mod

    class _Stop(Exception):
        pass

    def fake_init(backend, timeout):
        fake_mindspeed.append(f"init_process_group:{backend}")
        raise _Stop

    monkeypatch.setattr(mesh_mod, "device_type", lambda: "npu")
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(set_device=lambda i: fake_mindspeed.append(f"set_device:{i}")),
                        raising=False)
    monkeypatch.setattr(mesh_mod.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(mesh_mod.dist, "init_process_group", fake_init)
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(_Stop):
        mesh_mod.initialize(mesh_mod.DeviceMesh.from_sizes(world_size=1))
    assert fake_mindspeed == ["mindspeed.megatron_adaptor", "set_device:0", "init_process_group:hccl"]


def test_importing_the_package_imports_no_npu_stack_and_registers_no_attention():
    import subprocess
    code = ("import sys, twinkle_kernels, twinkle_patches.npu_attention, twinkle_kernels.moe._npu, "
            "twinkle_kernels.gdn._npu, twinkle_megatron.parallel.mindspeed\n"
            "bad = [m for m in ('torch_npu', 'mindspeed', 'triton', 'fla', 'transformers') if m in sys.modules]\n"
            "assert not bad, bad\n")
    root = __file__.rsplit("/tests/", 1)[0]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
