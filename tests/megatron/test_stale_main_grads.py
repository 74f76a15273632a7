"""Stale ``main_grad`` buffers (``twinkle_megatron/parallel/main_grads.py``): the one-pass CPU
optimizer step leaves the grads it read in place, marked stale, and the next backward's first
write of each overwrites it instead of adding (no zeroing pass, no read of zeros).

Training must be what it is with the grads zeroed: the same grad norms and weights, step after
step, with accumulation over calls, dense (tied and untied embeddings), MoE (routed experts,
some of which get no tokens) and LoRA, bf16 and fp32. Under the tests' poisoning a stale buffer
is NaN, so a writer that added to one without claiming it would show up as NaN grads here and in
every other training test."""
import pytest
import torch

pytest.importorskip("megatron.core")

from conftest import TINY_MOE_VOCAB, cpu_backend_available  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_backend_available(), reason="the C++ extension is not built")

VOCAB = TINY_MOE_VOCAB


def test_mark_claim_settle():
    from twinkle_megatron.parallel import main_grads
    g = torch.randn(3, 4)
    main_grads.mark([g])
    assert main_grads.is_stale(g) and bool(torch.isnan(g).all())    # poisoned in the tests
    assert main_grads.claim(g) and not main_grads.is_stale(g) and not main_grads.claim(g)
    p, q = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    p.main_grad, q.main_grad = torch.ones(2), torch.ones(2)
    main_grads.mark([p.main_grad])
    assert main_grads.settle([p, q, torch.nn.Parameter(torch.zeros(1))]) == 1
    assert p.main_grad.tolist() == [0.0, 0.0] and q.main_grad.tolist() == [1.0, 1.0]
    assert main_grads.settle([p]) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_main_grad_writer_adds_or_overwrites(dtype):
    """cpu_compat's weight-gradient writer for a bf16 / fp16 ``main_grad`` (grads not accumulated
    in fp32): the product in the inputs' dtype added, or, over a stale buffer, written."""
    from twinkle_megatron.parallel import cpu_compat, main_grads
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(7, 5, generator=g).to(dtype), torch.randn(7, 3, generator=g).to(dtype)
    product = (dy.t() @ x).to(dtype)
    mg = torch.randn(3, 5, generator=g).to(dtype)
    expected = mg + product
    cpu_compat._WgradGemmAccum.wgrad_gemm_accum_fp16(x.view(7, 1, 5), dy.view(7, 1, 3), mg)
    assert torch.equal(mg, expected)
    main_grads.mark([mg])   # NaN under the tests' poisoning
    cpu_compat._WgradGemmAccum.wgrad_gemm_accum_fp16(x, dy, mg)
    assert torch.equal(mg, product) and not main_grads.is_stale(mg)


def _model_id(family, tiny_moe_checkpoint):
    from twinkle_megatron.job.configs import tiny_qwen3_config
    if family == "qwen3_moe":
        return tiny_moe_checkpoint
    return dict(tiny_qwen3_config(num_layers=2), vocab_size=VOCAB, tie_word_embeddings=family == "qwen3_tied")


def _train(tm, model_id, precision, stale, monkeypatch, lora=False, steps=3, calls=2, **kw):
    """Three steps of two accumulated calls (the second of each step a 1 x 2 batch: with the MoE,
    experts without tokens); returns the grad norms, the trained weights, and whether the grads
    were stale after each step."""
    from twinkle_megatron.parallel import cpu_compat, main_grads
    with monkeypatch.context() as mp:
        if not stale:
            mp.setattr(cpu_compat, "claims_stale_main_grads", lambda: False)
        m = tm.MegatronModel(model_id, mixed_precision=precision, seed=3, use_twinkle_kernels=True, **kw)
        name = None
        if lora:
            from peft import LoraConfig
            name = "a"
            m.add_adapter_to_model(name, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        m.set_optimizer("AdamW", lr=1e-2, adapter_name=name)
        state = m.train_state(name)
        norms, marked = [], []
        for step in range(steps):
            for call, (rows, seq) in enumerate(((2, 16), (1, 2))[:calls]):
                g = torch.Generator().manual_seed(10 * step + call)
                ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
                m.forward_backward(inputs={"input_ids": ids, "labels": ids}, adapter_name=name)
            norms.append(m.clip_grad_and_step(max_grad_norm=1.0, adapter_name=name))
            grads = [p.main_grad for c in state.model for p in c.parameters() if p.requires_grad]
            marked.append(all(main_grads.is_stale(g) for g in grads))
        weights = [p.detach().float().clone() for c in state.model for p in c.parameters() if p.requires_grad]
    return norms, weights, marked


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_tied", "qwen3_moe"])
def test_training_is_training_with_zeroed_grads(tm, family, precision, tiny_moe_checkpoint, monkeypatch):
    model_id = _model_id(family, tiny_moe_checkpoint)
    norms, weights, marked = _train(tm, model_id, precision, True, monkeypatch)
    ref_norms, ref_weights, ref_marked = _train(tm, model_id, precision, False, monkeypatch)
    assert all(marked) and not any(ref_marked)
    assert norms == ref_norms
    assert len(weights) == len(ref_weights)
    for a, b in zip(weights, ref_weights):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_lora_adapter_grads(tm, monkeypatch):
    model_id = _model_id("qwen3", None)
    norms, weights, marked = _train(tm, model_id, "bf16", True, monkeypatch, lora=True, steps=2)
    ref_norms, ref_weights, _ = _train(tm, model_id, "bf16", False, monkeypatch, lora=True, steps=2)
    assert all(marked) and norms == ref_norms
    for a, b in zip(weights, ref_weights):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_overlapped_grad_reduction_zeroes_instead(tm, monkeypatch):
    """With ``overlap_grad_reduce`` the buckets are reduced during the backward, before a stale
    buffer nobody wrote could be zeroed: the step zeroes the grads as before."""
    _, _, marked = _train(tm, _model_id("qwen3", None), "bf16", True, monkeypatch, steps=1, calls=1,
                          overlap_grad_reduce=True)
    assert not any(marked)


@pytest.mark.parametrize("stale", [True, False])
def test_a_step_without_a_backward_reads_zero_grads(tm, stale, monkeypatch):
    """A second ``clip_grad_and_step`` with no ``forward_backward`` in between reads the grads the
    first left stale: they are zeroed first (``main_grads.settle``), as they were zero before."""
    from twinkle_megatron.parallel import cpu_compat, main_grads
    with monkeypatch.context() as mp:
        if not stale:
            mp.setattr(cpu_compat, "claims_stale_main_grads", lambda: False)
        m = tm.MegatronModel(_model_id("qwen3", None), mixed_precision="bf16", seed=3, use_twinkle_kernels=True)
        m.set_optimizer("AdamW", lr=1e-2)
        ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
        m.forward_backward(inputs={"input_ids": ids, "labels": ids})
        assert m.clip_grad_and_step(max_grad_norm=1.0) > 0
        grads = [p.main_grad for c in m.train_state(None).model for p in c.parameters() if p.requires_grad]
        assert all(main_grads.is_stale(g) for g in grads) == stale
        assert m.clip_grad_and_step(max_grad_norm=1.0) == 0.0    # not NaN (the poisoned stale grads)
