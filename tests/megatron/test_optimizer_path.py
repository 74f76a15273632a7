"""The facade's optimizer step on CPU (issue 48): megatron-core builds torch's Adam(W) when neither
TransformerEngine nor apex is installed, and the facade switches it to torch's fused kernel; with
twinkle kernels, ``clip_grad_and_step`` instead scales, clips, steps and copies to bf16 in one
``twinkle_kernels.adamw_step`` pass (``training/fused_adam.py``); the clipping scale runs in
place. Each must compute what the slower paths compute:

- torch's fused Adam and the one-pass step equal megatron's step with torch's per-tensor loop to
  fp32 rounding, dense and MoE (a chained optimizer: dense and expert parameters), with gradient
  accumulation over two calls, clipped and not;
- the in-place clip scale is bit-identical to megatron's ``local_multi_tensor_scale``.
"""
import pytest
import torch

pytest.importorskip("megatron.core")

from conftest import TINY_MOE_VOCAB, cpu_backend_available  # noqa: E402

VOCAB = TINY_MOE_VOCAB


def _inner(model):
    from twinkle_megatron.training.optim import torch_optimizers
    return list(torch_optimizers(model.optimizer))


def _model(tm, model_id, precision, lora):
    m = tm.MegatronModel(model_id=model_id, mixed_precision=precision, seed=3)
    if lora:   # LoRA on the routed experts too: megatron chains a dense and an expert optimizer
        from peft import LoraConfig
        m.add_adapter_to_model("a", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                               target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    return m


def _train(tm, model_id, impl, precision, steps, lora, max_grad_norm=0.5, calls=1):
    m = _model(tm, model_id, precision, lora)
    m.set_optimizer("AdamW", lr=1e-2, weight_decay=0.1)
    inner = _inner(m)
    state = m.train_state("a" if lora else None)
    assert inner and all(isinstance(o, (torch.optim.Adam, torch.optim.AdamW)) for o in inner)
    assert all(g["fused"] for o in inner for g in o.param_groups), "the facade left torch's per-tensor loop"
    assert state.fused_step, "the facade with twinkle kernels left the one-pass step off"
    state.fused_step = impl == "twinkle"
    if impl == "per-tensor":
        for o in inner:
            for g in o.param_groups:
                g.update(fused=False, foreach=False)
    norms = []
    for step in range(steps):
        for call in range(calls):   # gradient accumulation: the 1 / tokens factor covers both calls
            ids = torch.randint(0, VOCAB, (2, 16 + 4 * call), generator=torch.Generator().manual_seed(10 * step + call))
            m.forward_backward(inputs={"input_ids": ids, "labels": ids})
        # 0.5 clips: the norm of random init is above it
        norms.append(m.clip_grad_and_step(max_grad_norm=max_grad_norm))
    main = [p.detach().clone() for o in inner for g in o.param_groups for p in g["params"]]
    model = [p.detach().clone() for c in m.unwrapped_chunks() for p in c.parameters() if p.requires_grad]
    return m, main, len(inner), norms, model


# one step, from the same grads: a later step's forward runs on weights a few ulps apart (and in
# bf16 one ulp of fp32 can flip a rounding), which the parity suites cover at their tolerances
@pytest.mark.parametrize("precision,steps", [("bf16", 1), ("fp32", 1)])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen3_moe-lora"])
@pytest.mark.parametrize("impl", ["torch fused", "twinkle"])
@pytest.mark.parametrize("clip,calls", [(0.5, 1), (None, 2)])
def test_fused_adam_equals_the_per_tensor_loop(tm, family, precision, steps, tiny_moe_checkpoint, impl, clip, calls):
    from twinkle_megatron.job.configs import tiny_qwen3_config
    model_id = tiny_qwen3_config(num_layers=2) if family == "qwen3" else tiny_moe_checkpoint
    lora = family.endswith("lora")
    m_fused, fused, n, norms, model = _train(tm, model_id, impl, precision, steps, lora, clip, calls)
    m_loop, loop, _, loop_norms, loop_model = _train(tm, model_id, "per-tensor", precision, steps, lora, clip, calls)
    assert n == (2 if lora else 1)
    assert len(fused) == len(loop) and fused
    # the grad norm: megatron's, of the unscaled grads times 1 / tokens in the one-pass step
    assert norms == pytest.approx(loop_norms, rel=1e-6) and norms[0] > (clip or 0)
    for a, b in zip(fused, loop):
        assert a.dtype == torch.float32     # fp32 main parameters
        # the kernels order the same fp32 operations differently: a few ulps
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    for k, (a, b) in enumerate(zip(model, loop_model)):
        # the model's copy: its own main weight rounded; where the main weights differ by an ulp
        # across a bf16 rounding boundary, one bf16 ulp
        assert a.dtype == b.dtype == m_fused.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7 if precision == "bf16" else 1e-6, atol=1e-8)
    moved = max((a - p0).abs().max().item() for a, p0 in zip(fused, _initial(tm, model_id, precision, lora)))
    assert moved > 1e-3     # the steps did train


def _initial(tm, model_id, precision, lora):
    m = _model(tm, model_id, precision, lora)
    m.set_optimizer("AdamW", lr=1e-2, weight_decay=0.1)
    return [p.detach().clone() for o in _inner(m) for g in o.param_groups for p in g["params"]]


def test_in_place_clip_scale_is_megatrons_bit_for_bit(tm):
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_scale
    from twinkle_megatron.parallel import cpu_compat
    assert clip_grads.multi_tensor_scale_impl is cpu_compat._scale   # applied by initialize on CPU
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=g) for s in ((7, 5), (1,), (0,), (33,))]
    grads.append(torch.randn(6, 4, generator=g).t())                 # not contiguous
    expect = [t.clone() for t in grads]
    local_multi_tensor_scale(0, None, [expect, expect], 0.3127)
    views = list(grads)
    cpu_compat._scale(0, None, [grads, grads], 0.3127)
    assert all(a is b for a, b in zip(views, grads))                 # in place
    assert all(torch.equal(a, b) for a, b in zip(grads, expect))
    # distinct source and destination: the destination gets the products, the source is kept
    src = [torch.randn(5, generator=g) for _ in range(3)]
    dst, ref = [torch.empty(5) for _ in src], [torch.empty(5) for _ in src]
    kept = [t.clone() for t in src]
    cpu_compat._scale(0, None, [src, dst], 1.5)
    local_multi_tensor_scale(0, None, [src, ref], 1.5)
    assert all(torch.equal(a, b) for a, b in zip(dst, ref))
    assert all(torch.equal(a, b) for a, b in zip(src, kept))


@pytest.mark.skipif(not cpu_backend_available(), reason="the C++ extension (adamw_step) is not built")
def test_one_pass_step_leaves_megatrons_memset_out_and_the_next_step_is_the_same(tm, monkeypatch):
    """The one-pass step leaves each main grad it read stale (``parallel/main_grads.py``: the next
    backward's first write overwrites it), so zero_grad leaves out megatron's memset of the buffers
    it covered (every one here); the next step's grads are then the same as after megatron's own
    step: equal grad norms over three steps, with accumulation over two calls."""
    from twinkle_megatron.parallel import main_grads
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer
    from twinkle_megatron.job.configs import tiny_qwen3_config
    memsets = []
    real_reset = _ParamAndGradBuffer.reset
    monkeypatch.setattr(_ParamAndGradBuffer, "reset", lambda self: (memsets.append(self), real_reset(self))[1])
    norms = {}
    for fused in (True, False):
        m = tm.MegatronModel(tiny_qwen3_config(num_layers=2), mixed_precision="fp32", seed=3)
        m.set_optimizer("AdamW", lr=1e-3, weight_decay=0.1)
        m.train_state().fused_step = fused
        memsets.clear()
        norms[fused] = []
        for step in range(3):
            for call in range(2):
                ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(10 * step + call))
                m.forward_backward(inputs={"input_ids": ids, "labels": ids})
            norms[fused].append(m.clip_grad_and_step(max_grad_norm=1.0))
        wrap = m.engine.wrapped(m.train_state())
        n_buffers = sum(len(w.buffers) + len(w.expert_parallel_buffers) for w in wrap)
        assert len(memsets) == (0 if fused else 3 * n_buffers), (fused, len(memsets), n_buffers)
        grads = [p.main_grad for w in wrap for p in w.module.parameters() if p.requires_grad]
        if fused:   # NaN under the tests' poisoning: their value is zero only by the mark
            assert grads and all(main_grads.is_stale(g) for g in grads)
        else:
            assert all(bool((b.grad_data == 0).all()) for w in wrap for b in w.buffers)
    assert norms[True] == pytest.approx(norms[False], rel=1e-5)


@pytest.mark.skipif(not cpu_backend_available(), reason="the C++ extension (adamw_step) is not built")
def test_one_pass_step_runs_and_makes_torchs_state(tm, monkeypatch):
    """With twinkle kernels, clip_grad_and_step's update is one adamw_step call per param group
    and kind (with / without a bf16 copy), from the first step on: the AdamW state it makes is
    torch's (float32 step counts, moments shaped as the params), so megatron's state_dict and a
    later step through torch read it. A separate clip_grad_norm + step keeps megatron's path."""
    import twinkle_kernels
    from twinkle_megatron.job.configs import tiny_qwen3_config
    calls = []
    real = twinkle_kernels.adamw_step
    monkeypatch.setattr(twinkle_kernels, "adamw_step", lambda *a, **k: (calls.append(k), real(*a, **k))[1])
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    runs = {}
    for fused in (True, False):
        m = tm.MegatronModel(tiny_qwen3_config(num_layers=1), mixed_precision="bf16", seed=3)
        m.set_optimizer("AdamW", lr=1e-2, weight_decay=0.1)
        m.train_state().fused_step = fused
        m.forward_backward(inputs={"input_ids": ids, "labels": ids})
        m.clip_grad_and_step(max_grad_norm=0.5)
        runs[fused] = m
    calls[:] = [k for k in calls if "grad_factor" in k]   # not the one-element probe of the C++ build
    assert calls and all(k["backend"] == "cpu" and 0 < k["grad_factor"] < 1 for k in calls)
    assert any(k["out_params"] is not None for k in calls)
    for a, b in zip(_inner(runs[True]), _inner(runs[False])):
        for p, q in zip([p for g in a.param_groups for p in g["params"]], [q for g in b.param_groups for q in g["params"]]):
            sa, sb = a.state[p], b.state[q]
            assert sorted(sa) == sorted(sb) == ["exp_avg", "exp_avg_sq", "step"]
            assert sa["step"].dtype == sb["step"].dtype == torch.float32 and float(sa["step"]) == float(sb["step"]) == 1
            assert sa["exp_avg"].shape == p.shape
    runs[True].optimizer.state_dict()   # megatron reads it
    from twinkle_megatron.parallel import main_grads
    for fused, m in runs.items():   # stale after the one-pass step (zero by the mark), else zeroed
        wrap = m.engine.wrapped(m.train_state())
        buffers = [b for w in wrap for b in list(w.buffers) + list(w.expert_parallel_buffers)]
        assert buffers
        if fused:
            assert all(main_grads.is_stale(p.main_grad) for w in wrap for p in w.module.parameters())
        else:
            assert all(bool((b.grad_data == 0).all()) for b in buffers)
        assert not any(getattr(p, "grad_added_to_main_grad", False) for w in wrap for p in w.module.parameters())
    calls.clear()
    m = runs[True]
    m.forward_backward(inputs={"input_ids": ids, "labels": ids})
    m.clip_grad_norm(0.5)
    m.step()
    m.zero_grad()
    assert not [k for k in calls if "grad_factor" in k]


@pytest.mark.parametrize("kernels", [False, True])
def test_train_configs_name_the_paths_that_run(tm, kernels):
    """``get_train_configs`` (what ``python -m twinkle_megatron.job`` prints) names the layers'
    implementation, the LM head's loss path and the optimizer's kernel."""
    from twinkle_megatron.job.configs import tiny_qwen3_config
    m = tm.MegatronModel(tiny_qwen3_config(num_layers=1), use_twinkle_kernels=kernels)
    m.set_optimizer("AdamW", lr=1e-3)
    text = m.get_train_configs()
    if kernels:
        assert "paths: layers=twinkle_kernels (cpu backend) lm_head_loss=fused linear cross-entropy" in text
    else:
        assert "paths: layers=megatron local modules lm_head_loss=logits + cross-entropy" in text
    if kernels:
        assert "implementation=twinkle adamw_step (cpu: scale, clip, AdamW and the bf16 copy in one pass)" in text
        fp32 = tm.MegatronModel(tiny_qwen3_config(num_layers=1), mixed_precision="fp32", use_twinkle_kernels=True)
        fp32.set_optimizer("AdamW", lr=1e-3)
        assert "implementation=twinkle adamw_step (cpu: scale, clip and AdamW in one pass)" in fp32.get_train_configs()
        m.train_state().fused_step = False
        text = m.get_train_configs()
    assert "implementation=torch fused" in text
    for o in _inner(m):
        for g in o.param_groups:
            g["fused"] = False
    assert "implementation=torch per-tensor" in m.get_train_configs()


def _row_major(t):
    """Strides torch's matmul folds into one GEMM: row-major, size-1 dimensions included."""
    return tuple(t.stride()) == tuple(torch.empty(t.shape).stride())


@pytest.mark.parametrize("tied,rows", [(False, 3), (True, 3), (True, 1)])
def test_frozen_output_layer_gets_a_contiguous_gradient(tm, tied, rows):
    """LoRA on the local spec: the output layer's weight is frozen, and megatron's frozen-weight
    backward runs ``grad_output.matmul(weight)`` on the gradient as it arrives. The facade hands it
    over row-major (a transposed one, or with one row a [s, 1, V] one whose size-1 stride is not
    s * V, made torch's CPU matmul expand the weight per token and fall back to a
    single-threaded batched GEMM: minutes per Qwen3-0.6B step). The step still equals
    the same step without the hook's copy."""
    from megatron.core.tensor_parallel import layers
    from peft import LoraConfig
    from twinkle_megatron.job.configs import tiny_qwen3_config
    from twinkle_megatron.layers import lm_head
    cfg = dict(tiny_qwen3_config(num_layers=1), tie_word_embeddings=tied)
    seen, results = [], []
    for hooked in (True, False):
        if not hooked:   # the reference: the same model without the hook (its matmul folds the copy itself)
            real = lm_head.contiguous_logit_grads
            lm_head.contiguous_logit_grads = lambda chunks: None
        try:
            m = tm.MegatronModel(cfg, mixed_precision="fp32", seed=3, use_twinkle_kernels=False)
        finally:
            if not hooked:
                lm_head.contiguous_logit_grads = real
        m.add_adapter_to_model("a", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        m.set_optimizer("AdamW", lr=1e-2)
        ids = torch.randint(0, VOCAB, (rows, 16), generator=torch.Generator().manual_seed(0))
        frozen = layers.LinearWithFrozenWeight
        real_backward = frozen.backward

        def backward(ctx, grad_output):   # what megatron's frozen-weight backward receives
            seen.append((hooked, _row_major(grad_output)))
            return real_backward(ctx, grad_output)
        frozen.backward = staticmethod(backward)
        try:
            out = m.forward_backward(inputs={"input_ids": ids, "labels": ids})
        finally:
            frozen.backward = staticmethod(real_backward)
        results.append((out["loss"], m.clip_grad_and_step(max_grad_norm=None)))
    # the output layer's is the frozen-weight backward fed from the logits (the attention and MLP
    # base weights' get 2-D, contiguous gradients either way)
    assert (True, False) not in seen and (False, False) in seen, seen
    # the same loss; the grad norm to fp32 rounding (one GEMM against the batched fallback)
    assert results[0][0] == results[1][0]
    assert results[0][1] == pytest.approx(results[1][1], rel=1e-6)


def test_the_fast_path_is_the_default(tm, monkeypatch):
    """MegatronModel() builds the twinkle spec with the fused LM-head loss wherever
    twinkle_kernels has a fast backend for its device (here the C++ extension), and megatron's
    local spec where only the reference is left; an explicit False is the local spec."""
    import twinkle_kernels
    from twinkle_megatron.job.configs import tiny_qwen3_config
    cfg = tiny_qwen3_config(num_layers=1)

    def kinds(m):
        return {type(mod).__name__ for c in m.unwrapped_chunks() for mod in c.modules()
                if type(mod).__module__.startswith("twinkle_megatron.layers")}
    fast = twinkle_kernels.default_backend("cpu") != "reference"
    m = tm.MegatronModel(cfg, mixed_precision="fp32")
    assert m.use_twinkle_kernels is fast and m.fused_linear_ce is fast
    if fast:
        assert {"TwinkleMLP", "TwinkleRMSNorm"} <= kinds(m)
    local = tm.MegatronModel(cfg, mixed_precision="fp32", use_twinkle_kernels=False)
    assert not local.use_twinkle_kernels and not local.fused_linear_ce and "TwinkleMLP" not in kinds(local)
    monkeypatch.setattr(twinkle_kernels, "default_backend", lambda device: "reference")
    slow = tm.MegatronModel(cfg, mixed_precision="fp32")
    assert not slow.use_twinkle_kernels and not slow.fused_linear_ce
