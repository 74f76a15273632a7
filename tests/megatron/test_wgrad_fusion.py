"""Gradient accumulation fusion on the CPU (``cpu_compat`` item 14, ``ddp.fuse_wgrad_accumulation``):
with twinkle kernels, megatron's linear layers add their weight gradient straight into DDP's fp32
``main_grad`` through ``twinkle_kernels.wgrad_accum`` instead of writing a gradient of the weight's
dtype for DDP's hook to add. The main grads must be what the unfused path accumulates (one rounding
of the bf16 product apart at most; exactly in fp32 up to the GEMM's order), over two accumulated
calls, with megatron's own ``grad_added_to_main_grad`` bookkeeping; LoRA's frozen base weights are
left alone; a model built without twinkle kernels keeps megatron's unfused path."""
import pytest
import torch

pytest.importorskip("megatron.core")

from conftest import TINY_MOE_VOCAB, cpu_backend_available  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_backend_available(), reason="the C++ extension is not built")

VOCAB = TINY_MOE_VOCAB


def _linears(m):
    from megatron.core.tensor_parallel import layers
    return [mod for c in m.unwrapped_chunks() for mod in c.modules()
            if isinstance(mod, (layers.ColumnParallelLinear, layers.RowParallelLinear))]


def _grads(tm, fuse, precision, monkeypatch, lora=False, kernels=True, model_id=None):
    from twinkle_megatron.job.configs import tiny_qwen3_config
    import twinkle_kernels
    calls = []
    real = twinkle_kernels.wgrad_accum
    monkeypatch.setattr(twinkle_kernels, "wgrad_accum", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    m = tm.MegatronModel(model_id or tiny_qwen3_config(num_layers=2), mixed_precision=precision, seed=3,
                         use_twinkle_kernels=kernels)
    if lora:
        from peft import LoraConfig
        m.add_adapter_to_model("a", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    m.engine.fuse_wgrad = fuse and m.engine.fuse_wgrad
    m.set_optimizer("AdamW", lr=1e-2)
    state = m.train_state("a" if lora else None)
    for call in range(2):   # accumulated: the second call adds onto the first's main grads
        ids = torch.randint(0, VOCAB, (2, 16 + 4 * call), generator=torch.Generator().manual_seed(call))
        m.forward_backward(inputs={"input_ids": ids, "labels": ids}, adapter_name="a" if lora else None)
    params = [p for c in state.model for p in c.parameters() if p.requires_grad]
    fused_layers = sum(bool(getattr(mod, "gradient_accumulation_fusion", False)) for mod in _linears(m))
    return m, [p.main_grad.clone() for p in params], len(calls), fused_layers


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_fused_main_grads_are_the_unfused_ones(tm, family, precision, tiny_moe_checkpoint, monkeypatch):
    """Dense: every megatron linear. MoE: the routed experts' per-expert products too
    (``layers/mlp.py``), whose DDP buffer is the expert-parallel one."""
    model_id = tiny_moe_checkpoint if family == "qwen3_moe" else None
    m, fused, calls, layers = _grads(tm, True, precision, monkeypatch, model_id=model_id)
    _, unfused, unfused_calls, unfused_layers = _grads(tm, False, precision, monkeypatch, model_id=model_id)
    assert layers == len(_linears(m)) > 0 and unfused_layers == 0
    if family == "qwen3_moe":   # the routed experts took the fused products
        experts = [mod.weight for mod in _linears(m) if getattr(mod, "is_expert", False)]
        assert experts and all(w.grad_added_to_main_grad for w in experts)
    assert calls > 0 and unfused_calls == 0     # the fused backward ran, and only there
    assert len(fused) == len(unfused)
    tol = 2 ** -7 if precision == "bf16" else 1e-6   # one rounding of the bf16 product
    for a, b in zip(fused, unfused):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1e-3, float(b.abs().max())))
    assert any(float(g.abs().max()) > 0 for g in fused)


def test_megatron_bookkeeping_is_its_own(tm, monkeypatch):
    """megatron's layer sets ``grad_added_to_main_grad`` and hands DDP's hook its dummy, which the
    hook does not add; zero_grad resets the mark. The one-pass step leaves the main grads stale
    (``parallel/main_grads.py``, NaN under the tests' poisoning), and the next call's fused
    products overwrite them."""
    m, _, _, _ = _grads(tm, True, "bf16", monkeypatch)
    # the decoder's linears (the fused LM-head loss computes the output layer's gradient itself)
    weights = [mod.weight for mod in _linears(m) if mod is not m.unwrapped_chunks()[-1].output_layer]
    assert weights
    assert all(w.grad_added_to_main_grad for w in weights)
    assert all(w.grad is None for w in weights)     # the dummy never stays
    m.clip_grad_and_step(max_grad_norm=1.0)
    from twinkle_megatron.parallel import main_grads
    assert not any(w.grad_added_to_main_grad for w in weights)
    assert all(main_grads.is_stale(w.main_grad) for w in weights)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    m.forward_backward(inputs={"input_ids": ids, "labels": ids})
    assert all(w.grad_added_to_main_grad and not main_grads.is_stale(w.main_grad) for w in weights)
    assert all(bool(torch.isfinite(w.main_grad).all()) and float(w.main_grad.abs().max()) > 0 for w in weights)


def test_lora_base_weights_are_not_fused(tm, monkeypatch):
    """Frozen base weights have no main_grad (megatron's frozen-weight path); the adapters' grads
    are what they are without the fusion."""
    m, fused, calls, layers = _grads(tm, True, "bf16", monkeypatch, lora=True)
    _, unfused, _, _ = _grads(tm, False, "bf16", monkeypatch, lora=True)
    assert layers == 0 and calls == 0
    for a, b in zip(fused, unfused):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_local_spec_keeps_megatrons_unfused_path(tm, monkeypatch):
    m, _, calls, layers = _grads(tm, True, "bf16", monkeypatch, kernels=False)
    assert not m.engine.fuse_wgrad and layers == 0 and calls == 0
