"""twinkle_megatron.layers.gated_delta_net: megatron-core's GatedDeltaNet with its core on
twinkle_kernels equals megatron's own forward code (its torch path, deterministic_mode) on the same
module: output and every gradient, with and without q/k L2 normalisation and with grouped value
heads.

megatron's own constructor cannot run here (it refuses to without flash-linear-attention and
allocates on the current CUDA device), so the reference is megatron's ``GatedDeltaNet.forward``
called on our module, whose parameters are megatron's (names, shapes, initialisation)."""

import pytest
from conftest import megatron_one_rank
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def single_rank():
    with megatron_one_rank():
        yield


def _torch_l2norm(x, dim=-1, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(dim, keepdim=True) + eps)


def _build(cls_spec, l2, **config):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module
    cfg = TransformerConfig(**config,
        num_layers=1, hidden_size=32, num_attention_heads=4, normalization="RMSNorm",
        activation_func=F.silu, layernorm_epsilon=1e-6, params_dtype=torch.float32,
        use_cpu_initialization=True, deterministic_mode=True, add_bias_linear=False,
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, gradient_accumulation_fusion=False)
    return build_module(cls_spec, config=cfg, layer_number=1, use_qk_l2norm=l2)


def _spec():
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    b = LocalSpecProvider()
    return ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=b.column_parallel_linear(), out_norm=b.layer_norm(rms_norm=True),
        out_proj=b.row_parallel_linear()))


@pytest.mark.parametrize("l2", [True, False])
def test_twinkle_gdn_equals_megatron_gdn(single_rank, monkeypatch, l2):
    import importlib
    import megatron.core.ssm.gated_delta_net as gdn_mod
    from twinkle_megatron import spec as specs_gdn, versions
    # megatron imports fla's l2norm (absent here, CUDA-only); its torch path needs one. From 0.19 the
    # module is a package whose forward reads it from its common module.
    monkeypatch.setattr(gdn_mod, "l2norm", _torch_l2norm, raising=False)
    if hasattr(gdn_mod, "__path__"):
        monkeypatch.setattr(importlib.import_module("megatron.core.ssm.gated_delta_net.common"), "l2norm",
                            _torch_l2norm, raising=False)
    torch.manual_seed(0)
    ours = _build(specs_gdn.gated_delta_net_spec(_spec()), l2)
    assert type(ours).__name__ == "TwinkleGatedDeltaNet"
    assert type(ours.out_norm).__name__ == "TwinkleRMSNorm"
    assert sorted(n for n, _ in ours.named_parameters()) == sorted([
        "in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "out_norm.weight", "out_proj.weight"])
    assert ours.conv1d.weight.tensor_model_parallel and ours.A_log.tensor_model_parallel
    lo, hi = ours.A_init_range
    assert bool(((ours.A_log.exp() >= lo - 1e-5) & (ours.A_log.exp() <= hi + 1e-5)).all())
    with torch.no_grad():
        ours.out_norm.weight.uniform_(0.5, 1.5)
        ours.dt_bias.normal_()
    ref = _build(specs_gdn.gated_delta_net_spec(_spec()), l2)
    ref.load_state_dict(ours.state_dict())
    if versions.CHANGES["gdn_context_parallel"].active:
        # 0.18+: the forward calls the kernel its constructor picked (deterministic_mode: the torch one)
        ref.gated_delta_rule = gdn_mod.torch_chunk_gated_delta_rule
    x = torch.randn(37, 2, 32)                       # [S, B, H]: S not a multiple of the chunk
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, _ = gdn_mod.GatedDeltaNet.forward(ref, xa, None)   # megatron's own forward code
    yb, _ = ours(xb, None)
    torch.testing.assert_close(yb, ya, rtol=1e-4, atol=1e-5)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-4, atol=1e-5)
    for (n, p), (_, q) in zip(ref.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("local", [False, True], ids=["twinkle", "local"])
def test_packed_sequences_equal_separate_sequences(single_rank, local):
    """THD packed_seq_params: each sequence's output and input grads equal running it alone (the
    conv window and the delta-rule state restart at every boundary); the local module too."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from twinkle_megatron import spec as specs_gdn
    from twinkle_megatron.layers import gated_delta_net as hybrid
    spec = _spec()
    if local:
        spec.module = hybrid.local_gated_delta_net_class()
    else:
        spec = specs_gdn.gated_delta_net_spec(spec)
    torch.manual_seed(1)
    mod = _build(spec, True)
    lengths = [3, 70, 1, 20]
    cu = torch.tensor([0, 3, 73, 74, 94], dtype=torch.int32)
    x = torch.randn(sum(lengths), 1, 32, requires_grad=True)
    y, _ = mod(x, None, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                         max_seqlen_q=70, max_seqlen_kv=70))
    g = torch.randn_like(y)
    (y * g).sum().backward()
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        xs = x.detach()[a:b].clone().requires_grad_()
        ys, _ = mod(xs, None)
        (ys * g[a:b]).sum().backward()
        torch.testing.assert_close(y[a:b], ys, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x.grad[a:b], xs.grad, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="cu_seqlens"):
        mod(torch.randn(8, 1, 32), None, packed_seq_params=PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32)))
    with pytest.raises(NotImplementedError, match="thd"):
        mod(torch.randn(8, 1, 32), None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))


def test_layer_spec_swaps_gated_delta_net():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from twinkle_megatron import spec as specs
    layer = get_gpt_layer_local_spec(normalization="RMSNorm")
    layer.submodules.self_attention = _spec()
    out = specs.twinkle_layer_spec(layer)
    assert out.submodules.self_attention.module.__name__ == "TwinkleGatedDeltaNet"
    assert out.submodules.self_attention.submodules.out_norm is specs.TwinkleRMSNorm
    assert layer.submodules.self_attention.module.__name__ == "GatedDeltaNet"  # input untouched


def test_context_parallelism_builds_and_checks_its_group(single_rank):
    """Under context parallelism the layer builds (it runs on twinkle_kernels' CP ops; the 2-rank
    equality, plain and packed rows, is tests/megatron/test_gdn_context_parallel.py), and a CP group whose
    size is not the config's is an error, with packed rows too."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from twinkle_megatron import spec as specs_gdn
    from twinkle_megatron.layers import gated_delta_net as hybrid
    spec = _spec()
    spec.module = hybrid.local_gated_delta_net_class()
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 4, 8], dtype=torch.int32),
                             cu_seqlens_kv=torch.tensor([0, 4, 8], dtype=torch.int32))
    for s in (spec, specs_gdn.gated_delta_net_spec(_spec())):
        mod = _build(s, True, context_parallel_size=2)
        with pytest.raises(ValueError, match="context-parallel group has 1 ranks"):
            mod(torch.randn(8, 1, 32), None, packed_seq_params=packed)
        with pytest.raises(ValueError, match="context-parallel group has 1 ranks"):
            mod(torch.randn(8, 1, 32), None)
