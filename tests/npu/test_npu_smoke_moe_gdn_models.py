"""NPU smoke tests, part 2: grouped matmul, MoE experts, Gated DeltaNet, the named flash-attention,
and patched tiny Qwen3 / Qwen3.5 models against unpatched — on a real Ascend NPU.

They skip, saying why, wherever no NPU is present (every machine this project's CI has): none of
them has run yet.
"""
import pytest
import torch

import twinkle_kernels as tk
from twinkle_kernels import _dispatch, npu, testing

_why = npu.unavailable_reason()
pytestmark = [pytest.mark.skipif(_why is not None, reason=f"no Ascend NPU here: {_why}"),
              pytest.mark.filterwarnings("ignore")]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _grads(fn, inputs, n_grad, device, dtype):
    xs = [t.to(device, dtype if t.is_floating_point() else t.dtype).detach().requires_grad_(
        i < n_grad and t.is_floating_point()) for i, t in enumerate(inputs)]
    out = fn(*xs)
    outs = out if isinstance(out, tuple) else (out,)
    torch.manual_seed(5)
    loss = sum((o.double() * torch.randn(o.shape, dtype=torch.float64).to(o.device)).sum()
               for o in outs if o is not None)
    loss.backward()
    return [o.detach().cpu() for o in outs if o is not None], [x.grad.cpu() for x in xs[:n_grad]]


def _compare(fn_npu, fn_ref, inputs, n_grad, dtype, scale=4.0):
    outs, grads = _grads(fn_npu, inputs, n_grad, "npu", dtype)
    routs, rgrads = _grads(fn_ref, inputs, n_grad, "cpu", torch.float64)
    for o, r in zip(outs, routs):
        testing.assert_close(o, r, dtype, scale=scale)
    for g, r in zip(grads, rgrads):
        testing.assert_close(g, r, dtype, scale=scale, name="grad")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts", [[37, 0, 64, 3], [1], [128] * 8])
def test_npu_grouped_matmul(counts, dtype):
    off = torch.tensor(counts).cumsum(0).to(torch.int32)
    x, w = torch.randn(sum(counts), 96), torch.randn(len(counts), 80, 96) * 0.1  # HF [E, N, K]
    _compare(lambda x, w: tk.grouped_matmul(x, w.transpose(1, 2), off.to(x.device), backend="npu"),
             lambda x, w: tk.grouped_matmul(x, w.transpose(1, 2), off, backend="reference"), [x, w], 2, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_npu_moe_experts(dtype):
    T, H, I, E, k = 33, 64, 48, 8, 2
    torch.manual_seed(0)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    ins = [torch.randn(T, H), torch.rand(T, k), torch.randn(E, 2 * I, H) * 0.2, torch.randn(E, H, I) * 0.2]
    _compare(lambda x, w, gu, dn: tk.moe_experts(x, idx.to(x.device), w, gu, dn, backend="npu"),
             lambda x, w, gu, dn: tk.moe_experts(x, idx, w, gu, dn, backend="reference"), ins, 4, dtype)


def _gdn_inputs(B=1, T=70, H=2, K=32, V=32):
    torch.manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    return [q, k, torch.randn(B, T, H, V), torch.nn.functional.logsigmoid(torch.randn(B, T, H) + 2),
            torch.rand(B, T, H)]


def _gdn_skip(args):
    why = _dispatch.op("chunk_gated_delta_rule").reason("npu", *[a.to("npu") for a in args], 0.2, None, True,
                                                         False, None, 64)
    if why:
        pytest.skip(f"npu GDN unavailable: {why}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_npu_chunk_gated_delta_rule(dtype):
    ins = _gdn_inputs()
    _gdn_skip(ins)
    fn = lambda backend: (lambda q, k, v, g, b: tk.chunk_gated_delta_rule(q, k, v, g, b, output_final_state=True,
                                                                          backend=backend))
    _compare(fn("npu"), fn("reference"), ins, 5, dtype, scale=8.0)


def test_npu_fused_recurrent_gated_delta_rule_forward():
    ins = _gdn_inputs(T=9)
    _gdn_skip(ins)
    with torch.no_grad():
        o, ht = tk.fused_recurrent_gated_delta_rule(*[t.to("npu") for t in ins], output_final_state=True,
                                                    backend="npu")
        ro, rht = tk.fused_recurrent_gated_delta_rule(*[t.double() for t in ins], output_final_state=True,
                                                      backend="reference")
    testing.assert_close(o.cpu(), ro, torch.float32, scale=4.0)
    testing.assert_close(ht.cpu(), rht, torch.float32, scale=4.0, name="final_state")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("S,Skv", [(128, 128), (1, 77), (16, 77)])
def test_npu_fusion_attention_matches_sdpa(dtype, S, Skv):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from twinkle_patches import npu_attention as attention

    class Layer(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 4

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 8, S, 64), torch.randn(2, 2, Skv, 64), torch.randn(2, 2, Skv, 64)
    ref_mask = (torch.arange(Skv)[None, :] <= torch.arange(S)[:, None] + (Skv - S)).expand(2, 1, S, Skv)
    ins = [q, k, v]
    _compare(lambda q, k, v: attention.npu_fusion_attention_forward(Layer().eval(), q, k, v, None)[0],
             lambda q, k, v: sdpa_attention_forward(Layer().eval(), q, k, v, ref_mask)[0], ins, 3, dtype)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_npu_patched_tiny_model_matches_unpatched(family):
    import twinkle_patches as tp
    from tests.patches.test_patches_models import batch, build

    model = build(family).to("npu")
    ids = batch().to("npu")

    def run():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.logits.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}

    ref_logits, ref_grads = run()
    report = tp.apply(model, device="npu")
    try:
        assert any(s.backend == "auto:npu" for s in report.swapped), str(report)
        logits, grads = run()
    finally:
        tp.revert(report)
    testing.assert_close(logits.double(), ref_logits.double(), torch.float32, scale=16.0, name="logits")
    for n in ref_grads:
        testing.assert_close(grads[n].double(), ref_grads[n].double(), torch.float32, scale=16.0, name=n)
