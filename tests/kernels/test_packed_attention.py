"""Packed (THD) causal attention: which implementation serves a call and why (on any machine), the
per-sequence path against a float64 masked reference, the adapters to torch's varlen_attn
signatures, and on CUDA the varlen kernel against the per-sequence SDPA loop."""
import math

import pytest
import torch

from twinkle_kernels.packed_attention import (_torch_varlen_call, available_varlen, packed_attention,
                                              sdpa_loop, select_packed_attention)
from twinkle_kernels.testing import assert_close

CUDA = torch.cuda.is_available()
H100 = (9, 0)


def _reference(q, k, v, cu, scale, window=None):
    """float64 attention with the block-diagonal causal (windowed) mask, q heads over kv groups."""
    q, k, v = (t.double() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    T = q.shape[0]
    seq = torch.searchsorted(cu[1:].cpu().long(), torch.arange(T), right=True).to(q.device)
    i = torch.arange(T, device=q.device)
    allowed = (seq[:, None] == seq[None, :]) & (i[:, None] >= i[None, :])
    if window is not None:
        allowed &= (i[:, None] - i[None, :]) < window
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
    return torch.einsum("hqk,khd->qhd", p, v)


def _pack(lens, hq, hk, d, dtype, device="cpu"):
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(lens), 0).tolist()), dtype=torch.int32)
    T = int(cu[-1])
    q, k, v = (torch.randn(T, h, d, dtype=torch.float64).to(device=device, dtype=dtype).requires_grad_()
               for h in (hq, hk, hk))
    return q, k, v, cu.to(device)


# -- selection ---------------------------------------------------------------------------------
def test_cpu_runs_the_per_sequence_loop():
    c = select_packed_attention("cpu", torch.bfloat16, 128, 32, 8)
    assert c.impl == "sdpa_loop" and "CUDA-only" in c.reason


def test_this_torch_has_varlen_attn_and_cuda_bf16_picks_it():
    # torch >= 2.10 ships torch.nn.attention.varlen.varlen_attn; flash-attn is not installed in CI
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    found = available_varlen()
    if (major, minor) >= (2, 10):
        assert "torch_varlen_attn" in found
    expected = ("flash_attn_varlen" if "flash_attn_varlen" in found else
                "torch_varlen_attn" if "torch_varlen_attn" in found else "sdpa_loop")
    for dtype in (torch.bfloat16, torch.float16):
        assert select_packed_attention("cuda", dtype, 128, 32, 8, capability=H100).impl == expected


@pytest.mark.parametrize("kwargs,reason", [
    (dict(dtype=torch.float32), "fp16 / bf16"),
    (dict(head_dim=512), "at most 256"),
    (dict(head_dim=100), "multiple of 8"),
    (dict(head_dim_v=64), "equal q/k and v"),
    (dict(capability=(7, 5)), "sm_80"),
    (dict(q_heads=12, kv_heads=8), "key/value heads"),
])
def test_cuda_calls_the_varlen_kernels_cannot_serve(kwargs, reason):
    args = dict(dtype=torch.bfloat16, head_dim=128, q_heads=32, kv_heads=8, capability=H100)
    args.update(kwargs)
    dtype, d, hq, hk = args.pop("dtype"), args.pop("head_dim"), args.pop("q_heads"), args.pop("kv_heads")
    c = select_packed_attention("cuda", dtype, d, hq, hk, available={"torch_varlen_attn": _varlen_new}, **args)
    assert c.impl == "sdpa_loop" and reason in c.reason, c


def _varlen_new(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False):
    """torch >= 2.11's varlen_attn signature, computed by the float64 reference (CPU)."""
    assert cu_seq_q.dtype == torch.int32 and max_q == int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
    assert window_size[1] == 0, "causal"
    if key.shape[1] != query.shape[1]:
        assert enable_gqa
    window = None if window_size[0] < 0 else window_size[0] + 1
    return _reference(query, key, value, cu_seq_q, scale, window).to(query.dtype)


def _varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, is_causal=False):
    """torch 2.10's varlen_attn: is_causal, no scale argument (always D ** -0.5), no GQA."""
    assert is_causal and key.shape[1] == query.shape[1]
    return _reference(query, key, value, cu_seq_q, query.shape[-1] ** -0.5).to(query.dtype)


def test_selection_prefers_flash_attn_and_respects_the_signature():
    both = {"flash_attn_varlen": _varlen_new, "torch_varlen_attn": _varlen_new}
    pick = lambda avail, **kw: select_packed_attention("cuda", torch.bfloat16, 128, 16, 4, capability=H100,  # noqa: E731
                                                       available=avail, **kw)
    assert pick(both).impl == "flash_attn_varlen"
    assert pick(both, dropout=0.1).impl == "flash_attn_varlen"
    assert pick({"torch_varlen_attn": _varlen_new}).impl == "torch_varlen_attn"
    assert pick({"torch_varlen_attn": _varlen_new}, window=128).impl == "torch_varlen_attn"
    assert pick({"torch_varlen_attn": _varlen_new}, dropout=0.1).impl == "sdpa_loop"
    old = pick({"torch_varlen_attn": _varlen_2_10}, window=128)
    assert old.impl == "sdpa_loop" and "window_size" in old.reason
    assert pick({"torch_varlen_attn": _varlen_2_10}).impl == "torch_varlen_attn"
    assert "flash-attn is missing" in pick({}).reason


# -- the torch varlen_attn adapters (signatures of 2.10 and 2.11+) ------------------------------
@pytest.mark.parametrize("fn,window", [(_varlen_new, None), (_varlen_new, 3), (_varlen_2_10, None)])
def test_torch_varlen_adapter(fn, window):
    q, k, v, cu = _pack([5, 0, 9, 1], 4, 2, 16, torch.float64)
    out = _torch_varlen_call(fn, q, k, v, cu, 9, 0.3, window)
    torch.testing.assert_close(out, _reference(q, k, v, cu, 0.3, window))


# -- the per-sequence path (CPU, and CUDA fp32) ---------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 4])
def test_sdpa_loop_matches_float64(dtype, window):
    q, k, v, cu = _pack([7, 0, 13, 1, 6], 6, 2, 32, dtype)
    out = packed_attention(q, k, v, cu, scale=0.2, window=window)
    ref = _reference(q.detach(), k.detach(), v.detach(), cu, 0.2, window)
    assert out.dtype == dtype
    assert_close(out, ref, dtype, name="out")
    g = torch.randn_like(ref)
    out.backward(g.to(dtype))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    _reference(q64, k64, v64, cu, 0.2, window).backward(g)
    for name, a, b in (("dq", q, q64), ("dk", k, k64), ("dv", v, v64)):
        assert_close(a.grad, b.grad, dtype, name=name, atol_scale=2.0)


def test_packed_attention_bad_inputs():
    q, k, v, cu = _pack([3, 4], 4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        packed_attention(q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1), cu)
    with pytest.raises(ValueError, match=r"\[T, heads, dim\]"):
        packed_attention(q[None], k, v, cu)
    with pytest.raises(ValueError, match="not available"):
        packed_attention(q, k, v, cu, impl="no_such_kernel")


# -- CUDA: the varlen kernel against the per-sequence SDPA loop -----------------------------------
@pytest.mark.skipif(not CUDA, reason="the varlen kernels run on CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hk,d", [(16, 4, 128), (8, 8, 256), (4, 2, 64)])
def test_varlen_kernel_equals_the_loop_on_cuda(dtype, hq, hk, d):
    choice = select_packed_attention("cuda", dtype, d, hq, hk)
    if choice.impl == "sdpa_loop":
        pytest.skip(choice.reason)
    lens = [1, 200, 0, 64, 511, 33] + [17] * 20
    q, k, v, cu = _pack(lens, hq, hk, d, dtype, "cuda")
    scale = 1 / math.sqrt(d)
    out = packed_attention(q, k, v, cu, scale=scale)
    ref = _reference(q.detach(), k.detach(), v.detach(), cu, scale)
    assert_close(out, ref, dtype, name=f"{choice.impl} out")
    loop = sdpa_loop(q, k, v, cu, scale)
    assert_close(out, loop.double(), dtype, name=f"{choice.impl} vs loop")
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    grads_loop = torch.autograd.grad(loop, (q, k, v), g)
    for name, a, b in zip(("dq", "dk", "dv"), grads, grads_loop):
        assert_close(a, b.double(), dtype, name=name, atol_scale=4.0)


# -- the callers: transformers' twinkle_packed attention and the Megatron THD attention ------------
def test_hf_packed_boundaries_and_cpu_choice():
    from twinkle_patches._attention import _segment_bounds, _varlen_choice
    seg = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    assert _segment_bounds(seg).tolist() == [0, 2, 5, 6, 7, 12]
    q = torch.randn(1, 4, 6, 64, dtype=torch.bfloat16)
    module = torch.nn.Module()
    assert _varlen_choice(module, q, q, q, None, 0.0, None, False, {}) is None  # CPU: the mask path


def test_megatron_thd_attention_choice_on_cpu():
    from twinkle_megatron.layers.attention import packed_attention_impl
    q = torch.randn(10, 8, 64, dtype=torch.bfloat16)
    assert packed_attention_impl(q, q[:, :2], q[:, :2]) == "sdpa_loop"


class _Attn(torch.nn.Module):
    is_causal = True
    training = False


@pytest.mark.skipif(not CUDA, reason="the varlen kernels run on CUDA")
def test_hf_twinkle_packed_varlen_equals_the_mask_path_on_cuda():
    from twinkle_patches._attention import _varlen_choice, packed_sdpa_attention_forward
    S, H, Hkv, D = 300, 8, 2, 128
    lens = [1, 120, 40, 139]
    pos = torch.cat([torch.arange(n) for n in lens])[None].cuda()
    q = torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, Hkv, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    module = _Attn()
    if _varlen_choice(module, q, k, v, None, 0.0, None, False, {}) is None:
        pytest.skip("no varlen kernel here")
    out, _ = packed_sdpa_attention_forward(module, q, k, v, None, scaling=D ** -0.5, position_ids=pos)
    everything = torch.ones(1, 1, S, S, dtype=torch.bool, device="cuda")   # a mask tensor: the mask path
    masked, _ = packed_sdpa_attention_forward(module, q, k, v, everything, scaling=D ** -0.5, position_ids=pos)
    assert out.shape == masked.shape == (1, S, H, D)
    assert_close(out, masked.double(), torch.bfloat16, name="varlen vs mask path")


@pytest.mark.parametrize("cu, error, match", [
    (torch.tensor([0, 4, 8]), ValueError, "end at the sequence length"),
    (torch.tensor([0.0, 4.0, 10.0]), TypeError, "integer tensor"),
    (torch.tensor([1, 4, 10]), ValueError, "start at 0"),
    (torch.tensor([0, 6, 4, 10]), ValueError, "non-decreasing"),
    (torch.tensor([[0, 4, 10]]), ValueError, "1-D"),
    ([0, 4, 10], TypeError, "torch.Tensor"),
])
def test_bad_cu_seqlens_is_refused_naming_it(cu, error, match):
    """cu_seqlens is checked as the Gated DeltaNet ops check it: a float tensor, or offsets that do not
    end at T, gave rows of zeros or overlapping samples without an error."""
    from twinkle_kernels.packed_attention import packed_attention
    q = torch.randn(10, 2, 8)
    with pytest.raises(error, match=match) as e:
        packed_attention(q, q, q, cu)
    assert "cu_seqlens" in str(e.value)
