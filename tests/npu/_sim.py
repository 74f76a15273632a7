"""Test helper: a SIMULATED NPU platform on CPU tensors.

``simulate_npu(monkeypatch, emu)`` makes the ``npu`` backend report itself available, treats CPU
tensors as NPU tensors, and routes every torch_npu call to ``emu`` (tests/npu/emulation.py, a
pure-torch emulation of the documented semantics). It exercises twinkle's plumbing only; it says
nothing about real NPU numerics. Never importable from the package (lives under tests/).
"""
from twinkle_kernels import _dispatch
from twinkle_kernels.npu import ops as npu_ops


def simulate_npu(monkeypatch, emu):
    emu.calls = []
    monkeypatch.setitem(_dispatch.STATUS_CACHE, "npu", None)
    monkeypatch.setattr(npu_ops, "on_npu", lambda t: True)
    monkeypatch.setattr(npu_ops, "torch_npu_module", lambda: emu)
    return emu
