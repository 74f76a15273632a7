"""CPU plumbing checks of the NPU MoE and attention paths against an EMULATION of torch_npu.

``npu_grouped_matmul``, ``npu_moe_token_permute`` / ``unpermute`` and ``npu_fusion_attention`` are
emulated in pure torch from their documented semantics (tests/npu/emulation.py). These tests
check twinkle's argument marshalling and its own backward; nothing here ran on an Ascend NPU.
"""
import pytest
import torch

import twinkle_kernels as tk
from twinkle_kernels import testing
from twinkle_patches import npu_attention as npu_attn
from twinkle_kernels.moe import _npu as npu_moe

from ._sim import simulate_npu
from .emulation import EmulatedTorchNpu


class EmulatedOldTorchNpu(EmulatedTorchNpu):
    """An older torch_npu without the fused token permute / unpermute."""
    npu_moe_token_permute = None
    npu_moe_token_unpermute = None

    def __getattribute__(self, name):
        if name in ("npu_moe_token_permute", "npu_moe_token_unpermute"):
            raise AttributeError(name)
        return super().__getattribute__(name)


@pytest.fixture
def emulated(monkeypatch):
    return simulate_npu(monkeypatch, EmulatedTorchNpu())


def _grads(fn, inputs, n_grad):
    xs = [t.detach().clone().requires_grad_(i < n_grad) for i, t in enumerate(inputs)]
    out = fn(*xs)
    torch.manual_seed(7)
    (out.double() * torch.randn(out.shape, dtype=torch.float64)).sum().backward()
    return out.detach(), [x.grad for x in xs[:n_grad]]


@pytest.mark.parametrize("counts", [[3, 0, 5], [1], [0, 4, 0, 2, 7], [0, 0]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_emulated_grouped_matmul_forward_and_own_backward(emulated, counts, dtype):
    M, K, N, E = sum(counts), 13, 19, len(counts)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(M, K).to(dtype)
    w_hf = torch.randn(E, N, K).to(dtype)  # HF layout: the op gets a transposed view, no copy
    if M == 0:  # torch_npu kernels reject empty tensors: the verifier routes the call elsewhere
        assert "empty" in npu_moe.gmm_reason(x, w_hf.transpose(1, 2), offsets)
        y = tk.grouped_matmul(x, w_hf.transpose(1, 2), offsets)
        assert y.shape == (0, N) and not emulated.calls
        return
    fn = lambda x, w: tk.grouped_matmul(x, w.transpose(1, 2), offsets, backend="npu")
    out, (dx, dw) = _grads(fn, [x, w_hf], 2)
    ref_fn = lambda x, w: tk.grouped_matmul(x, w.transpose(1, 2), offsets, backend="reference")
    rout, (rdx, rdw) = _grads(ref_fn, [x.double(), w_hf.double()], 2)
    testing.assert_close(out, rout, dtype, name="y")
    testing.assert_close(dx, rdx, dtype, name="dx")
    testing.assert_close(dw, rdw, dtype, name="dw")
    assert dw.stride() == w_hf.stride()
    gmm = [c for c in emulated.calls if c[0] == "npu_grouped_matmul"]
    # forward + dx: x list of 1, E weights [K, N] / [N, K], int64 cumulative group_list, split M, one y
    assert gmm[0][1:8] == (1, E, (K, N), torch.int64, 2, 0, 0)
    assert gmm[1][1:8] == (1, E, (N, K), torch.int64, 2, 0, 0)


def test_npu_grouped_matmul_verifier_reasons():
    x, w, off = torch.randn(4, 8), torch.randn(3, 8, 5), torch.tensor([1, 2, 4], dtype=torch.int32)
    assert "NPU tensors" in npu_moe.gmm_reason(x, w, off)
    with pytest.raises(tk.BackendUnavailableError, match="npu"):
        tk.grouped_matmul(x, w, off, backend="npu")


def test_emulated_grouped_matmul_rejects_more_than_128_groups(emulated):
    x, w = torch.randn(4, 8), torch.randn(129, 8, 5)
    off = torch.full((129,), 4, dtype=torch.int32)
    assert "at most 128 groups" in npu_moe.gmm_reason(x, w, off)
    y = tk.grouped_matmul(x, w, off)  # auto: the registry routes elsewhere, still correct
    testing.assert_close(y, tk.grouped_matmul(x.double(), w.double(), off, backend="reference"), torch.float32)


@pytest.mark.parametrize("emu_cls", [EmulatedTorchNpu, EmulatedOldTorchNpu], ids=["fused_permute", "generic_routing"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_emulated_moe_experts_matches_reference(monkeypatch, emu_cls, dtype):
    emu = simulate_npu(monkeypatch, emu_cls())
    T, H, I, E, k = 9, 16, 12, 5, 2
    torch.manual_seed(0)
    x = torch.randn(T, H).to(dtype)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    idx[:, 0] = 0  # expert 4 may get nothing; expert 0 gets every token once
    wts = torch.rand(T, k).to(dtype)
    gu, dn = (torch.randn(E, 2 * I, H) * 0.3).to(dtype), (torch.randn(E, H, I) * 0.3).to(dtype)
    fn = lambda x, wts, gu, dn: tk.moe_experts(x, idx, wts, gu, dn, backend="npu")
    out, grads = _grads(fn, [x, wts, gu, dn], 4)
    ref = lambda x, wts, gu, dn: tk.moe_experts(x, idx, wts, gu, dn, backend="reference")
    rout, rgrads = _grads(ref, [x.double(), wts.double(), gu.double(), dn.double()], 4)
    testing.assert_close(out, rout, dtype, name="out", scale=4.0)
    for name, g, r in zip(("dx", "dweights", "dgate_up", "ddown"), grads, rgrads):
        testing.assert_close(g, r, dtype, name=name, scale=4.0)
    names = [c[0] for c in emu.calls]
    fused = emu_cls is EmulatedTorchNpu
    assert ("npu_moe_token_permute" in names) == fused and ("npu_moe_token_unpermute" in names) == fused
    assert names.count("npu_grouped_matmul") == 4  # two forward, two dx (dw is the per-expert loop)
    assert npu_moe.has_fused_permute(emu) == fused


# -- attention ------------------------------------------------------------------------------------

class _Layer(torch.nn.Module):
    is_causal = True

    def __init__(self, groups=1):
        super().__init__()
        self.num_key_value_groups = groups  # what transformers' sdpa path repeats k/v by


def _qkv(B, H, Hkv, S, Skv, D, dtype=torch.float32):
    torch.manual_seed(1)
    return (torch.randn(B, H, S, D, dtype=dtype), torch.randn(B, Hkv, Skv, D, dtype=dtype),
            torch.randn(B, Hkv, Skv, D, dtype=dtype))


@pytest.mark.parametrize("case", ["causal", "padding_mask", "decode", "cache_prefill"])
def test_emulated_fusion_attention_matches_transformers_sdpa(emulated, case):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    B, H, Hkv, D = 2, 4, 2, 16
    S, Skv = {"causal": (7, 7), "padding_mask": (7, 7), "decode": (1, 9), "cache_prefill": (3, 9)}[case]
    q, k, v = _qkv(B, H, Hkv, S, Skv, D)
    mask = None
    if case == "padding_mask":  # transformers' bool mask, True = attend; sample 1 has 2 pad tokens on the left
        i, j = torch.arange(S)[:, None], torch.arange(Skv)[None, :]
        mask = (j <= i).expand(B, 1, S, Skv).clone()
        mask[1, :, :, :2] = False
        mask[1, :, :2, :] = torch.eye(S, dtype=torch.bool)[:2]  # padded rows see themselves (no NaN)
    layer = _Layer(H // Hkv).eval()
    out, w = npu_attn.npu_fusion_attention_forward(layer, q, k, v, mask, scaling=0.3)
    ref_mask = mask
    if case == "cache_prefill":  # queries are the last S positions: causal aligned bottom-right
        ref_mask = (torch.arange(Skv)[None, :] <= torch.arange(S)[:, None] + (Skv - S)).expand(B, 1, S, Skv)
    ref, _ = sdpa_attention_forward(layer, q.double(), k.double(), v.double(), ref_mask, scaling=0.3)
    assert w is None and out.shape == (B, S, H, D)
    testing.assert_close(out, ref, torch.float32)
    call = emulated.calls[-1]
    assert call[3:6] == (H, "BNSD", 0.3) and call[6] == 1.0
    want_mode = {"causal": 2, "padding_mask": 0, "decode": 0, "cache_prefill": 3}[case]
    assert call[7] == want_mode


def test_fusion_attention_falls_back_to_sdpa_off_npu_and_with_sliding_window():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    q, k, v = _qkv(1, 2, 2, 5, 5, 8)
    layer = _Layer().eval()
    out, _ = npu_attn.npu_fusion_attention_forward(layer, q, k, v, None)
    ref, _ = sdpa_attention_forward(layer, q, k, v, None)
    assert torch.equal(out, ref)
    assert npu_attn._fallback_reason(q, None, {}) == "query is on cpu, not an NPU"


def test_sliding_window_falls_back_even_on_simulated_npu(emulated):
    q, k, v = _qkv(1, 2, 2, 5, 5, 8)
    npu_attn.npu_fusion_attention_forward(_Layer().eval(), q, k, v, None, sliding_window=3)
    assert not emulated.calls


def test_register_attention_is_named_explicit_idempotent_and_leaves_sdpa_alone():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import AttentionInterface
    sdpa_before = AttentionInterface._global_mapping["sdpa"]
    assert npu_attn.NAME == "twinkle_npu_fa"
    assert npu_attn.NAME not in AttentionInterface._global_mapping  # importing registered nothing
    undo = npu_attn.register_attention()
    try:
        assert AttentionInterface._global_mapping[npu_attn.NAME] is npu_attn.npu_fusion_attention_forward
        assert npu_attn.NAME in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
        assert AttentionInterface._global_mapping["sdpa"] is sdpa_before
        assert npu_attn.register_attention() is None
    finally:
        undo()
    assert npu_attn.NAME not in AttentionInterface._global_mapping


def test_emulated_named_attention_in_a_tiny_qwen3_matches_sdpa(emulated):
    from tests.patches.test_patches_models import batch, build
    undo = npu_attn.register_attention()
    try:
        model = build("qwen3").eval()
        ids = batch()
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            ref = model(input_ids=ids).logits
        model.set_attn_implementation(npu_attn.NAME)
        with torch.no_grad():
            out = model(input_ids=ids).logits
    finally:
        undo()
    assert any(c[0] == "npu_fusion_attention" for c in emulated.calls)
    testing.assert_close(out.double(), ref.double(), torch.float32, scale=4.0)
