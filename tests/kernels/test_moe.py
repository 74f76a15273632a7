"""MoE: grouped matmul, routing and moe_experts against float64 loop references; HF integration."""
import copy
import math

import pytest
import torch

import twinkle_kernels as tk
from twinkle_kernels.moe import (grouped_matmul_reference, make_routing_plan, moe_experts_reference,
                                 permute_tokens, unpermute_tokens)
from twinkle_kernels.testing import assert_close, poison_outputs, reduction_scale

from conftest import available_backends

# On a CUDA machine the kernels run on the GPU (triton, reference); else on the CPU (cpu,
# reference, and triton in its interpreter).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = [b for b in available_backends() if not (b == "cpu" and DEVICE.type != "cpu")]
DTYPES = (torch.float32, torch.bfloat16)


def _skip_unsupported(backend, dtype, big=False):
    # The Triton interpreter gets bf16 dot products wrong and costs ~0.1 ms per program.
    if backend == "triton" and DEVICE.type == "cpu" and (dtype != torch.float32 or big):
        pytest.skip("triton interpreter: fp32 at small shapes only")


def _offsets(counts):
    return torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0).to(torch.int32).to(DEVICE)


def _leaf(t, dtype):
    return t.to(device=DEVICE, dtype=dtype).detach().requires_grad_()


def _check_gmm(backend, dtype, counts, k, n, *, transposed_w=False, x_noncontig=False):
    m, e = sum(counts), len(counts)
    offsets = _offsets(counts)
    x64 = torch.randn(m, k, dtype=torch.float64)
    if transposed_w:  # the Hugging Face [E, N, K] parameter seen as [E, K, N]
        w_param64 = torch.randn(e, n, k, dtype=torch.float64) / math.sqrt(k)
    else:
        w_param64 = torch.randn(e, k, n, dtype=torch.float64) / math.sqrt(k)
    x, wp = _leaf(x64, dtype), _leaf(w_param64, dtype)
    xr, wr = _leaf(x, torch.float64), _leaf(wp, torch.float64)  # exactly the rounded inputs
    view = (lambda p: p.transpose(1, 2)) if transposed_w else (lambda p: p)
    x_in = x
    if x_noncontig:
        x_in = x.t().contiguous().t()  # column-major view, same values
        assert not x_in.is_contiguous()
    y = tk.grouped_matmul(x_in, view(wp), offsets, backend=backend)
    yr = grouped_matmul_reference(xr, view(wr), offsets)
    assert_close(y, yr, dtype, name="y", scale=1.0)
    g = torch.randn(m, n, dtype=torch.float64).to(DEVICE)
    y.backward(g.to(dtype))
    yr.backward(g)
    assert_close(x.grad, xr.grad, dtype, name="dx")
    assert_close(wp.grad, wr.grad, dtype, name="dw", scale=reduction_scale(max(counts + [1])))
    for i, c in enumerate(counts):
        if c == 0:
            assert torch.count_nonzero(view(wp.grad)[i]) == 0, f"expert {i} has no rows but a nonzero dw"
    if transposed_w:
        assert wp.grad.is_contiguous()
    # the public backward (for callers with an autograd Function of their own) gives the same
    # gradients as autograd's, in w's [E, K, N] view
    with poison_outputs():
        dx, dw = tk.grouped_matmul_backward(g.to(dtype), x_in.detach(), view(wp).detach(), offsets, backend=backend)
    assert_close(dx, xr.grad, dtype, name="grouped_matmul_backward dx")
    assert_close(dw, view(wr.grad), dtype, name="grouped_matmul_backward dw", scale=reduction_scale(max(counts + [1])))


GROUPS = {
    "uniform": [5, 5, 5, 5],
    "skewed": [1, 37, 0, 2],
    "empty_ends": [0, 6, 9, 0],
    "single_expert": [19],
    "all_in_one_of_many": [0, 0, 23, 0, 0],
    "e64_sparse": [0] * 30 + [3] + [0] * 20 + [2, 1] + [0] * 11,
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups", list(GROUPS))
def test_grouped_matmul_matches_float64_loop(backend, dtype, groups):
    _skip_unsupported(backend, dtype)
    _check_gmm(backend, dtype, GROUPS[groups], k=24, n=40)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_matmul_hf_layout_and_odd_sizes(backend, dtype):
    _skip_unsupported(backend, dtype)
    _check_gmm(backend, dtype, [3, 0, 70, 1], k=33, n=17, transposed_w=True, x_noncontig=True)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
def test_grouped_matmul_fp16(backend):
    _check_gmm(backend, torch.float16, [4, 0, 9, 2], k=20, n=12, transposed_w=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_matmul_zero_rows(backend):
    x = torch.randn(0, 8, device=DEVICE, requires_grad=True)
    w = torch.randn(3, 8, 5, device=DEVICE, requires_grad=True)
    y = tk.grouped_matmul(x, w, torch.zeros(3, dtype=torch.int32, device=DEVICE), backend=backend)
    assert y.shape == (0, 5)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_grouped_matmul_big_group_splits_into_tiles(backend):
    # One expert with many rows next to empty ones: the C++ op splits it into row / K tiles.
    _skip_unsupported(backend, torch.float32, big=True)
    _check_gmm(backend, torch.float32, [0, 700, 0], k=96, n=48)


# -- the bf16 tiles, emulated in fp32 (the interpreter computes bf16 tl.dot wrongly) ----------
def _emulated_triton():
    if "triton" not in BACKENDS:
        pytest.skip("triton backend unavailable")
    from twinkle_kernels.moe import _triton
    return _triton


def _bf16_values(t):
    return t.to(torch.bfloat16).to(torch.float64)


def test_emulated_bf16_rounds_to_nearest_even():
    # w[e] = identity: y = x rounded to bf16, exactly (products by 1 and sums with 0 are exact)
    gmm = _emulated_triton()
    one = 1.0 + 2.0 ** -8  # halfway between 1 and the next bf16: ties go to the even mantissa (1.0)
    ties = torch.tensor([one, 1.0 + 3 * 2.0 ** -8, -one, 3.0 * (1 + 2.0 ** -9), 1e-30, -7.5e4])
    x = torch.randn(70, 64)
    x.view(-1)[:ties.numel()] = ties
    w = torch.eye(64).expand(3, 64, 64).contiguous()
    offsets = _offsets([5, 0, 65])
    y = gmm.grouped_matmul(x.to(DEVICE), w.to(DEVICE), offsets, emulate_bf16=True)
    assert torch.equal(y.cpu(), x.to(torch.bfloat16).float())
    assert y.view(-1)[0].item() == 1.0 and y.view(-1)[1].item() == 1.0 + 2.0 ** -6


@pytest.mark.parametrize("counts,k,n", [
    ([1, 0, 130, 64, 0, 65], 72, 136),   # a single row, empty groups, groups of 1-3 row tiles
    ([200, 180], 64, 160),               # 128-row tiles (big groups), a partial column tile
    ([0, 0, 3], 200, 40),                # one non-empty group last; K over several steps
])
def test_grouped_matmul_emulated_bf16_tiles(counts, k, n):
    """The bf16 path's tiles and arithmetic (bf16 operands, fp32 accumulation, bf16 output) in fp32
    under the interpreter, against float64 of the bf16-rounded inputs at bf16 tolerance."""
    gmm = _emulated_triton()
    m, e = sum(counts), len(counts)
    offsets = _offsets(counts)
    x = torch.randn(m, k, device=DEVICE, requires_grad=True)
    w_param = (torch.randn(e, n, k) / math.sqrt(k)).to(DEVICE).requires_grad_()  # HF [E, N, K] layout
    y = gmm.grouped_matmul(x, w_param.transpose(1, 2), offsets, emulate_bf16=True)
    xr = _bf16_values(x.detach()).requires_grad_()
    wr = _bf16_values(w_param.detach()).requires_grad_()
    yr = grouped_matmul_reference(xr, wr.transpose(1, 2), offsets)
    assert torch.equal(y.detach(), y.detach().to(torch.bfloat16).float()), "outputs are not bf16 values"
    assert_close(y, yr, torch.bfloat16, name="y", atol_scale=2.0)
    g = torch.randn(m, n, device=DEVICE)
    y.backward(g)
    yr.backward(_bf16_values(g))
    assert_close(x.grad, xr.grad, torch.bfloat16, name="dx", atol_scale=2.0)
    assert_close(w_param.grad, wr.grad, torch.bfloat16, name="dw", scale=reduction_scale(max(counts)))
    for i, c in enumerate(counts):
        if c == 0:
            assert torch.count_nonzero(w_param.grad[i]) == 0, f"expert {i} has no rows but a nonzero dw"


def test_tile_table_uses_tensor_core_tiles():
    from twinkle_kernels.moe._triton import dw_tiles, gemm_tiles
    # Qwen3-30B-A3B experts (E=128, H=2048, I=768, top-8) at 4096 tokens: 256 rows per expert
    for dtype in (torch.bfloat16, torch.float16):
        for rows, n in ((256, 2 * 768), (256, 2048), (8, 1024), (1, 64)):
            t = gemm_tiles(dtype, rows, n)
            assert t.block_m >= 64 and t.block_n >= 64 and t.block_k >= 32, (dtype, rows, n, t)
        for k, n in ((2048, 1536), (768, 2048), (64, 64)):
            t = dw_tiles(dtype, k, n)
            assert t.block_k >= 64 and t.block_n >= 64 and t.block_m >= 32, (dtype, k, n, t)
    assert gemm_tiles(torch.float32, 256, 1536).precision == "ieee"


def test_emulated_bf16_needs_float32():
    gmm = _emulated_triton()
    with pytest.raises(TypeError, match="emulate_bf16"):
        gmm.grouped_matmul(torch.randn(4, 8, dtype=torch.float16, device=DEVICE),
                           torch.randn(1, 8, 8, dtype=torch.float16, device=DEVICE), _offsets([4]),
                           emulate_bf16=True)


# -- routing ---------------------------------------------------------------------------------
def test_routing_plan_is_stable_and_round_trips():
    idx = torch.tensor([[2, 0], [0, 2], [1, 0], [2, 1]])
    plan = make_routing_plan(idx, 4)
    assert plan.perm.tolist() == [1, 2, 5, 4, 7, 0, 3, 6]  # expert 0: pairs 1, 2, 5 in token order
    assert plan.row_map.tolist() == [0, 1, 2, 2, 3, 0, 1, 3]
    assert plan.tokens_per_expert.tolist() == [3, 2, 3, 0]
    assert plan.offsets.tolist() == [3, 5, 8, 8] and plan.offsets.dtype == torch.int32
    assert torch.equal(plan.perm[plan.inverse], torch.arange(8))


def test_permute_unpermute_values_and_grads():
    t, k, h, e = 9, 3, 5, 4
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    plan = make_routing_plan(idx, e)
    x = torch.randn(t, h, dtype=torch.float64, requires_grad=True)
    wts = torch.rand(t, k, dtype=torch.float64, requires_grad=True)
    xp = permute_tokens(x, plan)
    assert torch.equal(xp, x[idx.reshape(-1).argsort(stable=True) // k])
    scale = torch.randn(xp.shape[0], 1, dtype=torch.float64)  # a per-row "expert" so rows differ
    out = unpermute_tokens(xp * scale, wts, plan)
    s_pair = scale[plan.inverse].view(t, k)
    expected = x * (wts * s_pair).sum(1, keepdim=True)
    torch.testing.assert_close(out, expected)
    assert torch.autograd.gradcheck(lambda a, b: unpermute_tokens(permute_tokens(a, plan) * scale, b, plan),
                                    (x, wts))


def test_unpermute_rejects_weight_shape():
    plan = make_routing_plan(torch.zeros(4, 2, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="top_k_weights"):
        unpermute_tokens(torch.randn(8, 3), torch.rand(4, 3), plan)


# -- moe_experts -----------------------------------------------------------------------------
def _routing(kind, t, e, k):
    if kind == "uniform":
        return torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    if kind == "skewed":  # most tokens on experts 0..k-1, a few elsewhere
        idx = torch.arange(k).repeat(t, 1)
        idx[::5] = torch.stack([torch.randperm(e)[:k] for _ in range(len(idx[::5]))])
        return idx
    if kind == "same_experts":  # every token picks the same k experts: the rest get zero tokens
        return torch.randperm(e)[:k].repeat(t, 1)
    raise ValueError(kind)


def _check_moe(backend, dtype, t, h, i, e, k, kind):
    idx = _routing(kind, t, e, k).to(DEVICE)
    x = _leaf(torch.randn(t, h), dtype)
    wts = _leaf(torch.softmax(torch.randn(t, k), -1), torch.float32)
    gu = _leaf(torch.randn(e, 2 * i, h) / math.sqrt(h), dtype)
    dp = _leaf(torch.randn(e, h, i) / math.sqrt(i), dtype)
    ref = [_leaf(a, torch.float64) for a in (x, wts, gu, dp)]
    out = tk.moe_experts(x, idx, wts, gu, dp, backend=backend)
    expected = moe_experts_reference(ref[0], idx, ref[1], ref[2], ref[3])
    assert out.dtype == dtype
    assert_close(out, expected, dtype, name="out")
    g = torch.randn(t, h, dtype=torch.float64).to(DEVICE)
    out.backward(g.to(dtype))
    expected.backward(g)
    rows = max(1, int(torch.bincount(idx.reshape(-1), minlength=e).max()))
    assert_close(x.grad, ref[0].grad, dtype, name="d hidden_states")
    # routing-weight grads sum H products: compare at the tolerance of the activations' dtype
    assert_close(wts.grad, ref[1].grad, dtype, name="d top_k_weights", scale=reduction_scale(h))
    assert_close(gu.grad, ref[2].grad, dtype, name="d gate_up_proj", scale=reduction_scale(rows))
    assert_close(dp.grad, ref[3].grad, dtype, name="d down_proj", scale=reduction_scale(rows))
    used = set(idx.reshape(-1).tolist())
    for j in range(e):
        if j not in used:
            assert torch.count_nonzero(gu.grad[j]) == 0 and torch.count_nonzero(dp.grad[j]) == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,e,k", [("uniform", 8, 2), ("skewed", 8, 2), ("same_experts", 8, 2),
                                      ("uniform", 1, 1), ("uniform", 64, 8), ("skewed", 16, 1),
                                      ("same_experts", 64, 8)])
def test_moe_experts_matches_float64_loop(backend, dtype, kind, e, k):
    _skip_unsupported(backend, dtype)
    if backend == "reference" and (kind, e) not in (("uniform", 8), ("uniform", 64)):
        pytest.skip("the reference against itself in float64: two routings are enough (time)")
    _check_moe(backend, dtype, t=13, h=24, i=16, e=e, k=k, kind=kind)


@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_experts_no_tokens(backend):
    gu, dp = torch.randn(4, 8, 6, device=DEVICE), torch.randn(4, 6, 4, device=DEVICE)
    out = tk.moe_experts(torch.randn(0, 6, device=DEVICE), torch.zeros(0, 2, dtype=torch.long, device=DEVICE),
                         torch.zeros(0, 2, device=DEVICE), gu, dp, backend=backend)
    assert out.shape == (0, 6)


def test_moe_experts_deterministic():
    args = (torch.randn(31, 16), _routing("skewed", 31, 8, 2), torch.rand(31, 2), torch.randn(8, 20, 16),
            torch.randn(8, 16, 10))
    a, b = tk.moe_experts(*args), tk.moe_experts(*args)
    assert torch.equal(a, b)


# -- bad inputs ------------------------------------------------------------------------------
def test_grouped_matmul_bad_inputs():
    x, w, off = torch.randn(6, 4), torch.randn(3, 4, 5), torch.tensor([2, 4, 6], dtype=torch.int32)
    cases = [
        ((x, w, torch.tensor([2, 1, 6], dtype=torch.int32)), ValueError, "offsets.*non-decreasing"),
        ((x, w, torch.tensor([-1, 4, 6], dtype=torch.int32)), ValueError, "offsets"),
        ((x, w, torch.tensor([2, 4, 5], dtype=torch.int32)), ValueError, "offsets must end at M"),
        ((x, w, off.long()), TypeError, "offsets must be int32"),
        ((x, w, off[:2]), ValueError, r"offsets must have shape \[3\]"),
        ((x, torch.randn(3, 5, 5), off), ValueError, "w has K"),
        ((x[None], w, off), ValueError, "x must be"),
        ((x, w[0], off), ValueError, "w must be"),
        ((x, w.double(), off), TypeError, "w has dtype"),
        ((x.long(), w, off), TypeError, "x must be a floating"),
    ]
    for args, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            tk.grouped_matmul(*args)
        with pytest.raises(exc, match=pattern):   # the backward checks the same arguments
            tk.grouped_matmul_backward(torch.randn(6, 5), *args)
    with pytest.raises(ValueError, match=r"dy must be \[M, N\] = \(6, 5\)"):
        tk.grouped_matmul_backward(torch.randn(6, 4), x, w, off)


def test_moe_experts_bad_inputs():
    t, h, i, e, k = 5, 6, 4, 3, 2
    x, idx, wts = torch.randn(t, h), torch.randint(0, e, (t, k)), torch.rand(t, k)
    gu, dp = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    bad_idx = idx.clone()
    bad_idx[1, 1] = e
    neg_idx = idx.clone()
    neg_idx[0, 0] = -1
    cases = [
        ((x, bad_idx, wts, gu, dp), ValueError, r"top_k_index values must be expert ids in \[0, 3\)"),
        ((x, neg_idx, wts, gu, dp), ValueError, "top_k_index values"),
        ((x, idx.float(), wts, gu, dp), TypeError, "top_k_index must be an integer"),
        ((x, idx[:4], wts, gu, dp), ValueError, "top_k_index must be"),
        ((x, idx, wts[:, :1], gu, dp), ValueError, "top_k_weights must have the shape"),
        ((x, idx, wts, gu[:, :, :5], dp), ValueError, "gate_up_proj must be"),
        ((x, idx, wts, gu[:, :7], dp), ValueError, "gate_up_proj must be"),
        ((x, idx, wts, gu, dp[:, :, :3]), ValueError, "down_proj must be"),
        ((x, idx, wts, gu, dp.double()), TypeError, "down_proj has dtype"),
        ((x[None], idx, wts, gu, dp), ValueError, "hidden_states must be"),
    ]
    for args, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            tk.moe_experts(*args)


# -- Hugging Face integration ----------------------------------------------------------------
def _qwen3_moe_config(**kw):
    from transformers import Qwen3MoeConfig
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
                num_experts_per_tok=2, decoder_sparse_step=1, max_position_embeddings=64)
    base.update(kw)
    return Qwen3MoeConfig(**base)


def _mixtral_config():
    from transformers import MixtralConfig
    return MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=64)


def _qwen3_5_moe_config():
    from transformers import Qwen3_5MoeTextConfig
    return Qwen3_5MoeTextConfig(vocab_size=64, hidden_size=32, moe_intermediate_size=24,
                                shared_expert_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                                linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                                linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"],
                                max_position_embeddings=64)


def _logits_and_grads(cls, cfg, impl, state):
    cfg = copy.deepcopy(cfg)
    cfg.dtype = torch.float32
    model = cls._from_config(cfg, experts_implementation=impl, attn_implementation="eager")
    model.load_state_dict(state)
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def twinkle_experts():
    pytest.importorskip("transformers")
    from twinkle_patches.hf_experts import register_hf_experts, unregister_hf_experts
    register_hf_experts("twinkle")
    yield "twinkle"
    unregister_hf_experts("twinkle")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen3_5_moe", "qwen3_moe_gelu", "qwen3_moe_relu"])
def test_hf_model_twinkle_experts_equal_eager(twinkle_experts, family):
    import transformers
    if family == "mixtral":
        cls, cfg = transformers.MixtralForCausalLM, _mixtral_config()
    elif family == "qwen3_5_moe":
        if not hasattr(transformers, "Qwen3_5MoeForCausalLM"):
            pytest.skip("this transformers has no Qwen3.5-MoE")
        cls, cfg = transformers.Qwen3_5MoeForCausalLM, _qwen3_5_moe_config()
    else:
        # gelu runs the twinkle experts (activation="gelu"); relu is not a GLU activation the op
        # computes: the twinkle function hands it to transformers' grouped_mm path
        act = {"qwen3_moe": "silu", "qwen3_moe_gelu": "gelu", "qwen3_moe_relu": "relu"}[family]
        cls, cfg = transformers.Qwen3MoeForCausalLM, _qwen3_moe_config(hidden_act=act)
    torch.manual_seed(0)
    model = cls._from_config(copy.deepcopy(cfg), attn_implementation="eager")
    with torch.no_grad():  # weights large enough for the experts to matter in the logits
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    state = model.state_dict()
    calls = []
    import twinkle_kernels.moe as moe_mod
    # spy on whichever backend the dispatcher picks: the twinkle path must really run
    spied = {name: moe_mod._MOE.impls[name].fn for name in moe_mod._MOE.impls}
    try:
        for name, fn in spied.items():
            moe_mod._MOE.impls[name].fn = (lambda f: lambda *a: (calls.append(1), f(*a))[1])(fn)
        l_tw, g_tw = _logits_and_grads(cls, cfg, twinkle_experts, state)
    finally:
        for name, fn in spied.items():
            moe_mod._MOE.impls[name].fn = fn
    l_ref, g_ref = _logits_and_grads(cls, cfg, "eager", state)
    assert (len(calls) == cfg.num_hidden_layers) == (family != "qwen3_moe_relu")
    torch.testing.assert_close(l_tw, l_ref, atol=1e-5, rtol=1e-5)
    assert g_tw.keys() == g_ref.keys()
    for n in g_ref:
        torch.testing.assert_close(g_tw[n], g_ref[n], atol=1e-5, rtol=1e-5, msg=lambda m: f"{n}: {m}")


def test_hf_registry_register_unregister_restores_exactly():
    pytest.importorskip("transformers")
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface
    from twinkle_patches.hf_experts import register_hf_experts, twinkle_experts_forward, unregister_hf_experts
    before = dict(ExpertsInterface._global_mapping)
    assert "twinkle" not in ALL_EXPERTS_FUNCTIONS  # nothing registered at import
    register_hf_experts()
    register_hf_experts()  # idempotent
    assert ALL_EXPERTS_FUNCTIONS["twinkle"] is twinkle_experts_forward
    assert unregister_hf_experts() is True
    assert dict(ExpertsInterface._global_mapping) == before
    assert unregister_hf_experts() is False
    # overriding an existing name puts the original back
    original = ExpertsInterface._global_mapping["batched_mm"]
    register_hf_experts("batched_mm")
    assert ALL_EXPERTS_FUNCTIONS["batched_mm"] is twinkle_experts_forward
    unregister_hf_experts("batched_mm")
    assert ExpertsInterface._global_mapping["batched_mm"] is original
    assert dict(ExpertsInterface._global_mapping) == before
    with pytest.raises(ValueError, match="eager"):
        register_hf_experts("eager")
