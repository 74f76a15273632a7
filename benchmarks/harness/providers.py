"""Who is benchmarked: twinkle's backends and the peers, each adapted to an op's canonical call.

A provider turns a :class:`~benchmarks.harness.ops.Case` into a :class:`Prepared`: its own
differentiable leaf tensors (converted to its layout outside any timed region) and a call
that runs the op on them. ``to_canonical`` / ``grads_to_canonical`` map its outputs and
gradients back to the canonical layout for the correctness gate (untimed).

A provider that cannot run here says why (``unavailable``); that row is reported as
missing with the reason. Peers are imported lazily, only when they are benchmarked.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from .ops import Case, OpSpec, twinkle_fn

_ident = lambda xs: xs  # noqa: E731


@dataclass
class Prepared:
    leaves: List[torch.Tensor]
    call: Callable[[], tuple]
    to_canonical: Callable[[tuple], tuple] = _ident
    grads_to_canonical: Callable[[list], list] = _ident


@dataclass
class Provider:
    name: str
    family: str                                   # twinkle / eager / compile / peer
    unavailable: Callable[[OpSpec, torch.device], Optional[str]]
    prepare: Callable[[OpSpec, Case], Prepared]
    ops: Optional[Sequence[str]] = None            # None: every op


def canonical_leaves(case: Case) -> List[torch.Tensor]:
    return [case.args[i].detach().clone().requires_grad_(True) for i in case.diff]


def with_leaves(case: Case, leaves: Sequence[torch.Tensor]) -> list:
    args = list(case.args)
    for i, t in zip(case.diff, leaves):
        args[i] = t
    return args


def _canonical(spec: OpSpec, case: Case, fn: Callable) -> Prepared:
    leaves = canonical_leaves(case)
    args = with_leaves(case, leaves)
    return Prepared(leaves, lambda: spec.select_outputs(fn(*args, **case.kwargs)))


def _import_reason(module: str) -> Optional[str]:
    try:
        importlib.import_module(module)
    except Exception as e:  # ImportError, or a package that fails on this machine (no CUDA)
        return f"{module} not importable ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    return None


def _needs(module: str, device_type: Optional[str] = None):
    def reason(spec, device):
        if device_type is not None and device.type != device_type:
            return f"needs a {device_type} device (running on {device.type})"
        return _import_reason(module)
    return reason


# --- twinkle ---------------------------------------------------------------------------------
def twinkle_provider(backend: str) -> Provider:
    def unavailable(spec, device):
        if twinkle_fn(spec) is None:
            return f"twinkle_kernels has no {spec.api} yet"
        from twinkle_kernels import backend_status
        why = backend_status(backend)
        if why:
            return why
        if backend == "triton" and device.type != "cuda":
            return "triton runs CPU tensors only in its interpreter; not a benchmark"
        if backend == "cpu" and device.type != "cpu":
            return f"the cpu backend needs CPU tensors (running on {device.type})"
        if backend == "npu" and device.type != "npu":
            return f"the npu backend needs an NPU (running on {device.type})"
        return None  # an op without this backend raises BackendUnavailableError: reported as missing

    def prepare(spec, case):
        fn = twinkle_fn(spec)
        return _canonical(spec, case, lambda *a, **k: fn(*a, backend=backend, **k))

    return Provider(f"twinkle-{backend}", "twinkle", unavailable, prepare)


def _eager_unavailable(spec, device):
    return None if twinkle_fn(spec) is not None else f"twinkle_kernels has no {spec.api} yet (no reference)"


def _eager_prepare(spec, case):
    fn = twinkle_fn(spec)
    return _canonical(spec, case, lambda *a, **k: fn(*a, backend="reference", **k))


EAGER = Provider("eager", "eager", _eager_unavailable, _eager_prepare)


def _compile_unavailable(spec, device):
    why = _eager_unavailable(spec, device) or spec.no_compile
    if why:
        return why
    try:
        import torch._dynamo  # noqa: F401
    except Exception as e:
        return f"torch.compile unavailable ({e})"
    return None


_COMPILED: Dict[str, Callable] = {}


def _compile_prepare(spec, case):
    import torch._dynamo.config as dynamo_config
    # Every shape x dtype is a recompilation of the same code object; past the recompile limit
    # (8 by default) dynamo silently runs eager, which would mislabel the rows. The harness
    # owns its process, so it raises the limit instead.
    for name in ("recompile_limit", "cache_size_limit"):
        if getattr(dynamo_config, name, 0) < 1024:
            setattr(dynamo_config, name, 1024)
    if getattr(dynamo_config, "accumulated_recompile_limit", 0) < 4096:
        dynamo_config.accumulated_recompile_limit = 4096
    if spec.name not in _COMPILED:  # one compiled function per op: modes reuse its graphs
        fn = twinkle_fn(spec)
        _COMPILED[spec.name] = torch.compile(lambda *a, **k: fn(*a, backend="reference", **k), dynamic=False)
    return _canonical(spec, case, _COMPILED[spec.name])


COMPILE = Provider("torch.compile", "compile", _compile_unavailable, _compile_prepare)


# --- peers: row-wise ops ---------------------------------------------------------------------
def _module_with_weight(module: torch.nn.Module, weight: torch.Tensor, name: str = "weight") -> torch.nn.Parameter:
    p = torch.nn.Parameter(weight.detach().clone())
    setattr(module, name, p)
    return p


def _torch_rms_prepare(spec, case):
    x, w, eps = case.args
    leaves = canonical_leaves(case)
    return Prepared(leaves, lambda: (F.rms_norm(leaves[0], (x.shape[-1],), leaves[1], eps),))


def _hf_rms_prepare(spec, case):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    x, w, eps = case.args
    m = Qwen3RMSNorm(x.shape[-1], eps=eps).to(x.device)
    xl = x.detach().clone().requires_grad_(True)
    wl = _module_with_weight(m, w)
    return Prepared([xl, wl], lambda: (m(xl),))


def _liger_rms_prepare(spec, case):
    from liger_kernel.transformers import LigerRMSNorm
    x, w, eps = case.args
    m = LigerRMSNorm(x.shape[-1], eps=eps).to(x.device)
    xl = x.detach().clone().requires_grad_(True)
    wl = _module_with_weight(m, w)
    return Prepared([xl, wl], lambda: (m(xl),))


def _fla_rms_prepare(spec, case):
    from fla.modules import RMSNorm
    x, w, eps = case.args
    m = RMSNorm(x.shape[-1], eps=eps).to(x.device)
    xl = x.detach().clone().requires_grad_(True)
    wl = _module_with_weight(m, w)
    return Prepared([xl, wl], lambda: (m(xl),))


def _te_rms_prepare(spec, case):
    import transformer_engine.pytorch as te
    x, w, eps = case.args
    m = te.RMSNorm(x.shape[-1], eps=eps, params_dtype=w.dtype)
    xl = x.detach().clone().requires_grad_(True)
    wl = _module_with_weight(m, w)
    return Prepared([xl, wl], lambda: (m(xl),))


def _npu_rms_prepare(spec, case):
    import torch_npu
    x, w, eps = case.args
    leaves = canonical_leaves(case)
    return Prepared(leaves, lambda: (torch_npu.npu_rms_norm(leaves[0], leaves[1], epsilon=eps)[0],))


def _hf_gated_prepare(spec, case):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated
    x, gate, w, eps = case.args
    m = Qwen3_5RMSNormGated(x.shape[-1], eps=eps).to(x.device)
    xl, gl = x.detach().clone().requires_grad_(True), gate.detach().clone().requires_grad_(True)
    wl = _module_with_weight(m, w)
    return Prepared([xl, gl, wl], lambda: (m(xl, gl),))


def _fla_gated_prepare(spec, case):
    from fla.modules import FusedRMSNormGated
    x, gate, w, eps = case.args
    m = FusedRMSNormGated(x.shape[-1], eps=eps, activation="swish").to(x.device)
    xl, gl = x.detach().clone().requires_grad_(True), gate.detach().clone().requires_grad_(True)
    wl = _module_with_weight(m, w)
    return Prepared([xl, gl, wl], lambda: (m(xl, gl),))


def _hf_rope_prepare(spec, case):
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb
    q, k, cos, sin, ud = case.args
    leaves = canonical_leaves(case)
    return Prepared(leaves, lambda: tuple(apply_rotary_pos_emb(leaves[0], leaves[1], cos, sin, ud)))


def _hf_rope_unavailable(spec, device):
    return _import_reason("transformers")


def _liger_rope_prepare(spec, case):
    from liger_kernel.transformers import liger_rotary_pos_emb
    q, k, cos, sin, ud = case.args
    leaves = canonical_leaves(case)
    return Prepared(leaves, lambda: tuple(liger_rotary_pos_emb(leaves[0], leaves[1], cos, sin)))


def _te_rope_prepare(spec, case):
    from transformer_engine.pytorch.attention import apply_rotary_pos_emb as te_rope
    q, k, cos, sin, ud = case.args
    # TE takes angles [S, 1, 1, R] and tensors in "bshd"; convert outside the timed call
    from .ops import rope_cos_sin
    _, _, emb = rope_cos_sin(1, q.shape[2], cos.shape[-1], q.device, torch.float32)
    freqs = emb[:, None, None, :]
    ql = q.detach().transpose(1, 2).contiguous().requires_grad_(True)
    kl = k.detach().transpose(1, 2).contiguous().requires_grad_(True)

    def call():
        return (te_rope(ql, freqs, tensor_format="bshd", fused=True),
                te_rope(kl, freqs, tensor_format="bshd", fused=True))
    back = lambda ts: tuple(t.transpose(1, 2) for t in ts)  # noqa: E731
    return Prepared([ql, kl], call, back, lambda gs: [g.transpose(1, 2) if g is not None else None for g in gs])


def _npu_rope_prepare(spec, case):
    import torch_npu
    q, k, cos, sin, ud = case.args
    leaves = canonical_leaves(case)
    c, s = cos.unsqueeze(ud), sin.unsqueeze(ud)
    return Prepared(leaves, lambda: (torch_npu.npu_rotary_mul(leaves[0], c, s),
                                     torch_npu.npu_rotary_mul(leaves[1], c, s)))


def _hf_swiglu_prepare(spec, case):
    from transformers.activations import ACT2FN
    act = ACT2FN["silu"]
    leaves = canonical_leaves(case)
    return Prepared(leaves, lambda: (act(leaves[0]) * leaves[1],))


def _liger_swiglu_prepare(spec, case):
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    leaves = canonical_leaves(case)
    return Prepared(leaves, lambda: (LigerSiLUMulFunction.apply(leaves[0], leaves[1]),))


def _packed(case: Case):
    """SwiGLU providers with Megatron's packed [gate | up] input: pack outside the timed call."""
    gate, up = case.args
    x = torch.cat([gate, up], dim=-1).detach().requires_grad_(True)
    n = gate.shape[-1]
    return x, lambda gs: [gs[0][..., :n], gs[0][..., n:]] if gs[0] is not None else [None, None]


def _megatron_swiglu_prepare(spec, case):
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
    x, split = _packed(case)
    return Prepared([x], lambda: (bias_swiglu_impl(x, None),), grads_to_canonical=split)


def _npu_swiglu_prepare(spec, case):
    import torch_npu
    x, split = _packed(case)
    return Prepared([x], lambda: (torch_npu.npu_swiglu(x, dim=-1),), grads_to_canonical=split)


# --- peers: GDN ------------------------------------------------------------------------------
def _hf_gdr_prepare(spec, case):
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    leaves = canonical_leaves(case)
    l2 = case.kwargs.get("use_qk_l2norm_in_kernel", False)
    # repeat_interleave of q/k for HV > H happens inside (as in transformers' GDN module)
    return Prepared(leaves, lambda: (torch_chunk_gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=l2)[0],))


def _fla_gdr_prepare(spec, case):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    leaves = canonical_leaves(case)
    l2 = case.kwargs.get("use_qk_l2norm_in_kernel", False)

    def call():
        q, k, v, g, beta = leaves
        rep = v.shape[2] // q.shape[2]
        if rep > 1:  # transformers' Qwen3.5 module repeats the key heads before calling fla
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        return (chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=l2)[0],)
    return Prepared(leaves, call)


def _hf_conv_prepare(spec, case):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    x, w, b, act = case.args
    leaves = canonical_leaves(case)
    # the module global may be a hub kernel; the torch fallback is what runs without one
    fn = getattr(m.causal_conv1d_fn, "__wrapped__", m.causal_conv1d_fn)
    return Prepared(leaves, lambda: (fn(leaves[0], leaves[1], leaves[2], activation=act),))


def _dao_conv_prepare(spec, case):
    from causal_conv1d import causal_conv1d_fn
    x, w, b, act = case.args
    leaves = canonical_leaves(case)
    return Prepared(leaves, lambda: (causal_conv1d_fn(leaves[0], leaves[1], leaves[2], activation=act),))


# --- peers: MoE ------------------------------------------------------------------------------
def _grouped_mm_unavailable(spec, device):
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    return None


def _grouped_mm_prepare(spec, case):
    x, w, offs = case.args
    leaves = canonical_leaves(case)
    return Prepared(leaves, lambda: (torch._grouped_mm(leaves[0], leaves[1], offs=offs),))


def _gg_prepare(spec, case):
    from grouped_gemm import ops as gg
    x, w, offs = case.args
    counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long()).cpu()
    leaves = canonical_leaves(case)
    return Prepared(leaves, lambda: (gg.gmm(leaves[0], leaves[1], counts, trans_b=False),))


def _hf_experts_prepare(impl: str):
    def prepare(spec, case):
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
        hs, idx, wts, gate_up, down = case.args
        e, two_i, h = gate_up.shape
        cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=two_i // 2, num_experts=e,
                             num_experts_per_tok=idx.shape[-1], hidden_act="silu")
        cfg._experts_implementation = impl
        with torch.device("meta"):
            m = Qwen3MoeExperts(cfg)
        gl = _module_with_weight(m, gate_up, "gate_up_proj")
        dl = _module_with_weight(m, down, "down_proj")
        hl = hs.detach().clone().requires_grad_(True)
        wl = wts.detach().clone().requires_grad_(True)
        return Prepared([hl, wl, gl, dl], lambda: (m(hl, idx, wl),))
    return prepare


def _hf_experts_unavailable(impl: str):
    def unavailable(spec, device):
        why = _import_reason("transformers.models.qwen3_moe.modeling_qwen3_moe")
        if why or impl == "eager":
            return why
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        if impl not in ALL_EXPERTS_FUNCTIONS:
            return f"transformers has no experts implementation {impl!r}"
        return None
    return unavailable


def _torch_lce_prepare(spec, case):
    # what a model does without the fused op: the logits in the input dtype, then torch's loss
    leaves = canonical_leaves(case)
    labels = case.args[2]
    return Prepared(leaves, lambda: (F.cross_entropy(F.linear(leaves[0], leaves[1]), labels),))


def _liger_lce_prepare(spec, case):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    leaves = canonical_leaves(case)
    labels = case.args[2]
    loss = LigerFusedLinearCrossEntropyLoss()

    def call():
        out = loss(leaves[1], leaves[0], labels)
        return (out[0] if isinstance(out, tuple) else out,)
    return Prepared(leaves, call)


# --- the table -------------------------------------------------------------------------------
def _peer(name, ops, unavailable, prepare):
    return Provider(name, "peer", unavailable, prepare, ops=ops)


PEERS: List[Provider] = [
    _peer("torch.rms_norm", ("rms_norm",), lambda s, d: None if hasattr(F, "rms_norm") else "no F.rms_norm",
          _torch_rms_prepare),
    _peer("transformers", ("rms_norm",), _needs("transformers"), _hf_rms_prepare),
    _peer("liger", ("rms_norm",), _needs("liger_kernel.transformers", "cuda"), _liger_rms_prepare),
    _peer("fla", ("rms_norm",), _needs("fla.modules", "cuda"), _fla_rms_prepare),
    _peer("transformer_engine", ("rms_norm",), _needs("transformer_engine.pytorch", "cuda"), _te_rms_prepare),
    _peer("torch_npu", ("rms_norm",), _needs("torch_npu", "npu"), _npu_rms_prepare),
    _peer("transformers", ("gated_rms_norm",), _needs("transformers.models.qwen3_5.modeling_qwen3_5"),
          _hf_gated_prepare),
    _peer("fla", ("gated_rms_norm",), _needs("fla.modules", "cuda"), _fla_gated_prepare),
    _peer("transformers", ("rope",), _hf_rope_unavailable, _hf_rope_prepare),
    _peer("liger", ("rope",), _needs("liger_kernel.transformers", "cuda"), _liger_rope_prepare),
    _peer("transformer_engine", ("rope",), _needs("transformer_engine.pytorch.attention", "cuda"),
          _te_rope_prepare),
    _peer("torch_npu", ("rope",), _needs("torch_npu", "npu"), _npu_rope_prepare),
    _peer("transformers", ("swiglu",), _needs("transformers.activations"), _hf_swiglu_prepare),
    _peer("liger", ("swiglu",), _needs("liger_kernel.ops.swiglu", "cuda"), _liger_swiglu_prepare),
    _peer("megatron-core", ("swiglu",), _needs("megatron.core.fusions.fused_bias_swiglu"),
          _megatron_swiglu_prepare),
    _peer("torch_npu", ("swiglu",), _needs("torch_npu", "npu"), _npu_swiglu_prepare),
    _peer("transformers", ("chunk_gated_delta_rule",), _needs("transformers.models.qwen3_5.modeling_qwen3_5"),
          _hf_gdr_prepare),
    _peer("fla", ("chunk_gated_delta_rule",), _needs("fla.ops.gated_delta_rule", "cuda"), _fla_gdr_prepare),
    _peer("transformers", ("causal_conv1d",), _needs("transformers.models.qwen3_5.modeling_qwen3_5"),
          _hf_conv_prepare),
    _peer("causal-conv1d", ("causal_conv1d",), _needs("causal_conv1d", "cuda"), _dao_conv_prepare),
    _peer("torch._grouped_mm", ("grouped_matmul",), _grouped_mm_unavailable, _grouped_mm_prepare),
    _peer("grouped_gemm", ("grouped_matmul",), _needs("grouped_gemm", "cuda"), _gg_prepare),
    _peer("transformers-eager", ("moe_experts",), _hf_experts_unavailable("eager"), _hf_experts_prepare("eager")),
    _peer("transformers-grouped_mm", ("moe_experts",), _hf_experts_unavailable("grouped_mm"),
          _hf_experts_prepare("grouped_mm")),
    _peer("transformers-batched_mm", ("moe_experts",), _hf_experts_unavailable("batched_mm"),
          _hf_experts_prepare("batched_mm")),
    _peer("torch linear+cross_entropy", ("fused_linear_cross_entropy",), lambda s, d: None, _torch_lce_prepare),
    _peer("liger", ("fused_linear_cross_entropy",), _needs("liger_kernel.transformers", "cuda"), _liger_lce_prepare),
]


def providers_for(spec: OpSpec, backends: Sequence[str]) -> List[Provider]:
    """eager first (the ratio baseline), then twinkle per backend, torch.compile, then the peers."""
    out = [EAGER] + [twinkle_provider(b) for b in backends] + [COMPILE]
    out += [p for p in PEERS if p.ops is None or spec.name in p.ops]
    return out
