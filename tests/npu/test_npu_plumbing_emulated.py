"""CPU-runnable plumbing checks of the NPU backend against an EMULATION of torch_npu.

These check argument marshalling only (layouts, eps, dtype handling, partial rotary),
using tests/npu/emulation.py — a pure-torch emulation of the documented torch_npu
semantics, not the real operators. Nothing here ran on an Ascend NPU.
"""
import pytest
import torch

import twinkle_kernels as tk
from twinkle_kernels import _dispatch, testing
from twinkle_kernels.npu import ops as npu_ops

from .emulation import EmulatedTorchNpu


@pytest.fixture
def emulated(monkeypatch):
    emu = EmulatedTorchNpu()
    emu.calls = []
    monkeypatch.setattr(npu_ops, "torch_npu_module", lambda: emu)
    return emu


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_emulated_rms_norm_marshalling(emulated, offset, dtype):
    x = torch.randn(3, 5, 64, dtype=dtype)
    w = torch.randn(64, dtype=dtype) * 0.1
    y = npu_ops.rms_norm(x, w, 1e-5, offset)
    ref = tk.rms_norm(x.double(), w.double(), 1e-5, offset=offset, backend="reference")
    testing.assert_close(y, ref, dtype)
    assert emulated.calls[-1][-1] == 1e-5  # eps forwarded
    if offset:
        assert emulated.calls[-1][4] == torch.float32  # gamma kept in fp32 so (1 + w) stays exact


def test_emulated_gated_rms_norm_marshalling(emulated):
    x, g, w = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32)
    y = npu_ops.gated_rms_norm(x, g, w, 1e-6)
    ref = tk.gated_rms_norm(x.double(), g.double(), w.double(), backend="reference")
    testing.assert_close(y, ref, torch.float32)


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("rot", [64, 32])
def test_emulated_rope_marshalling(emulated, unsqueeze_dim, rot):
    B, S, Hq, Hk, D = 2, 7, 4, 2, 64
    shape = (lambda h: (B, h, S, D)) if unsqueeze_dim == 1 else (lambda h: (B, S, h, D))
    q, k = torch.randn(shape(Hq)), torch.randn(shape(Hk))
    cos, sin = torch.randn(B, S, rot), torch.randn(B, S, rot)
    qo, ko = npu_ops.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    qr, kr = tk.apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double(), unsqueeze_dim,
                                     backend="reference")
    testing.assert_close(qo, qr, torch.float32, name="q")
    testing.assert_close(ko, kr, torch.float32, name="k")
    assert all(c[1][-1] == rot for c in emulated.calls)  # only the rotary channels reach the kernel


def test_emulated_swiglu_marshalling(emulated):
    g, u = torch.randn(5, 48), torch.randn(5, 48)
    testing.assert_close(npu_ops.swiglu(g, u), tk.swiglu(g.double(), u.double(), backend="reference"), torch.float32)
    x = torch.randn(5, 96)[:, :]  # packed
    testing.assert_close(npu_ops.swiglu_packed(x.t().contiguous().t()),
                         tk.swiglu_packed(x.double(), backend="reference"), torch.float32)


def test_npu_backend_is_registered_for_every_row_wise_op_and_rejects_cpu_tensors():
    for name in ("rms_norm", "gated_rms_norm", "apply_rotary_pos_emb", "swiglu", "swiglu_packed"):
        assert "npu" in _dispatch.op(name).impls
    why = npu_ops.tensor_reason(torch.empty(3))
    assert "NPU tensors" in why


def test_npu_unavailable_here_is_explained_and_explicit_request_raises():
    from twinkle_kernels import npu
    assert npu.unavailable_reason()  # no NPU on CI machines
    with pytest.raises(tk.BackendUnavailableError, match="npu"):
        tk.rms_norm(torch.randn(2, 8), torch.ones(8), backend="npu")


def test_emulation_is_not_importable_from_the_package():
    import importlib
    for name in ("twinkle_kernels.npu.emulation", "twinkle_kernels.emulation", "twinkle_kernels.testing_npu"):
        with pytest.raises(ImportError):
            importlib.import_module(name)
