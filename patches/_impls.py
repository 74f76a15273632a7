"""The replacements: forwards and functions that call twinkle_kernels, with the checks that decide
whether a target fits them.

Every replacement keeps the Hugging Face semantics of what it replaces (argument names, layouts,
output dtypes) so a patched model gives the same results within the dtype tolerance. Each impl
provides:

- ``op_reason()``: why the twinkle op cannot be used at all (not built / not merged yet), or None;
- ``target_reason(orig)``: why this transformers object does not fit (a changed signature), or None;
- ``instance_reason(module)``: (class kinds) why one built instance does not fit, or None;
- ``make(orig, backend)``: the forward (class kinds) or the function (function kinds); the impls of
  the ops in ``_specs.COMPILE_DECOMPOSITIONS`` take ``decompose=True`` too: while torch.compile
  traces (``torch.compiler.is_compiling()``, a constant at trace time, nothing guarded per call)
  the forward then runs that decomposition instead of the twinkle custom op, so inductor can fuse
  it. The row-wise ones trace the op's pure-torch reference (fp32 statistics, output dtype as the
  kernels'), so results stay within the tolerance table of the kernels; eager calls are unchanged.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import logging
import weakref
from typing import Callable, Dict, Optional

import torch

from . import _linear_ce
from ._glu import glu_activation

logger = logging.getLogger("twinkle_patches")

EXPERTS_NAME = "twinkle"


def _tk():
    import twinkle_kernels
    return twinkle_kernels


def _ref():
    """The pure-torch references (the decompositions traced under torch.compile)."""
    from twinkle_kernels.norm import reference as norm
    from twinkle_kernels.rope import reference as rope
    from twinkle_kernels.swiglu import reference as swiglu
    return norm, rope, swiglu


def _tracing(decompose: bool) -> bool:
    return decompose and torch.compiler.is_compiling()


def _has_op(name: str) -> Optional[str]:
    if callable(getattr(_tk(), name, None)):
        return None
    return f"op unavailable: twinkle_kernels.{name} does not exist in this build"


_WARNED = set()


def _fallback_once(what: str, why: str) -> None:
    if (what, why) not in _WARNED:
        _WARNED.add((what, why))
        logger.warning("twinkle_patches: %s runs its original forward: %s", what, why)


def _params(fn) -> list:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def _needs_params(fn, names) -> Optional[str]:
    got = _params(fn)
    missing = [n for n in names if n not in got]
    if missing:
        return f"signature changed: {getattr(fn, '__qualname__', fn)} has parameters {got}, missing {missing}"
    return None


def _init_sets(cls, attr: str) -> Optional[str]:
    try:
        src = inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        return None  # no source (frozen install): the instance checks still run
    if f"self.{attr}" not in src:
        return f"{cls.__name__}.__init__ no longer sets self.{attr}"
    return None


# -- RMSNorm ----------------------------------------------------------------------------------

class _RMSNorm:
    """Llama-style ``weight * normed.to(dtype)``; output dtype = promote(x, weight) as in HF."""
    op = "rms_norm"

    @staticmethod
    def op_reason():
        return _has_op("rms_norm")

    @staticmethod
    def target_reason(cls):
        return _needs_params(cls.forward, ["hidden_states"]) or _init_sets(cls, "variance_epsilon")

    @staticmethod
    def instance_reason(m):
        w = getattr(m, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 1:
            return "no 1-D weight"
        if not isinstance(getattr(m, "variance_epsilon", None), (int, float)):
            return "no float variance_epsilon"
        return None

    @staticmethod
    def make(orig, backend, decompose=False):
        def forward(self, hidden_states):
            if _tracing(decompose):
                y = _ref()[0].rms_norm_reference(hidden_states, self.weight, float(self.variance_epsilon))
            else:
                y = _tk().rms_norm(hidden_states, self.weight, float(self.variance_epsilon), backend=backend)
            out_dtype = torch.promote_types(hidden_states.dtype, self.weight.dtype)
            return y if y.dtype == out_dtype else y.to(out_dtype)
        return forward


class _ZeroCentredRMSNorm(_RMSNorm):
    """Qwen3-Next / Qwen3.5: ``norm(x.float()) * (1 + weight)``, eps in ``self.eps``, output x.dtype."""

    @staticmethod
    def target_reason(cls):
        return _needs_params(cls.forward, ["x"]) or _init_sets(cls, "eps")

    @staticmethod
    def instance_reason(m):
        w = getattr(m, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 1:
            return "no 1-D weight"
        if not isinstance(getattr(m, "eps", None), (int, float)):
            return "no float eps"
        return None

    @staticmethod
    def make(orig, backend, decompose=False):
        def forward(self, x):
            if _tracing(decompose):
                return _ref()[0].rms_norm_reference(x, self.weight, float(self.eps), 1.0)
            return _tk().rms_norm(x, self.weight, float(self.eps), offset=1.0, backend=backend)
        return forward


class _GatedRMSNorm:
    """``RMSNormGated.forward(hidden_states, gate)``: norm(x) * weight * silu(gate), output x.dtype."""
    op = "gated_rms_norm"

    @staticmethod
    def op_reason():
        return _has_op("gated_rms_norm")

    @staticmethod
    def target_reason(cls):
        return _needs_params(cls.forward, ["hidden_states", "gate"]) or _init_sets(cls, "variance_epsilon")

    @staticmethod
    def instance_reason(m):
        why = _RMSNorm.instance_reason(m)
        if why:
            return why
        act = getattr(m, "activation", "silu")
        if act not in ("silu", "swish"):
            return f"gate activation is {act!r}, not silu"
        return None

    @staticmethod
    def make(orig, backend, decompose=False):
        orig_forward = orig.forward

        def forward(self, hidden_states, gate=None):
            if gate is None or getattr(self, "activation", "silu") not in ("silu", "swish"):
                return orig_forward(self, hidden_states, gate)
            if _tracing(decompose):
                return _ref()[0].gated_rms_norm_reference(hidden_states, gate.to(hidden_states.dtype), self.weight,
                                                          float(self.variance_epsilon))
            return _tk().gated_rms_norm(hidden_states, gate.to(hidden_states.dtype), self.weight,
                                        float(self.variance_epsilon), backend=backend)
        return forward


# -- SwiGLU MLP ------------------------------------------------------------------------------------

class _SwiGLUMLP:
    """``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` -> ``down(swiglu(gate, up, activation=...))``,
    act_fn SiLU or GELU (exact or tanh; :func:`glu_activation`)."""
    op = "swiglu"

    @staticmethod
    def op_reason():
        return _has_op("swiglu")

    @staticmethod
    def target_reason(cls):
        return _needs_params(cls.forward, ["x"]) or _init_sets(cls, "gate_proj")

    @staticmethod
    def instance_reason(m):
        for p in ("gate_proj", "up_proj", "down_proj"):
            if not callable(getattr(m, p, None)):
                return f"no {p}"
        return glu_activation(getattr(m, "act_fn", None))[1]

    @staticmethod
    def make(orig, backend, decompose=False):
        orig_forward = orig.forward

        def forward(self, x):
            act, why = glu_activation(getattr(self, "act_fn", None))  # act_fn may be swapped after apply
            if act is None:
                _fallback_once(type(self).__name__, why)
                return orig_forward(self, x)
            if _tracing(decompose):
                return self.down_proj(_ref()[2].swiglu_reference(self.gate_proj(x), self.up_proj(x), act))
            return self.down_proj(_tk().swiglu(self.gate_proj(x), self.up_proj(x), activation=act, backend=backend))
        return forward


# -- MoE experts -----------------------------------------------------------------------------------

def _experts_hf():
    try:
        return importlib.import_module("twinkle_patches.hf_experts")
    except ImportError:
        return None


class _Experts:
    """``@use_experts_implementation`` classes: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""
    op = "moe_experts"

    @staticmethod
    def op_reason():
        hf = _experts_hf()
        if hf is None or not callable(getattr(hf, "register_hf_experts", None)):
            return "op unavailable: twinkle_patches.hf_experts.register_hf_experts does not exist in this build"
        return _has_op("moe_experts")

    @staticmethod
    def target_reason(cls):
        return _needs_params(cls.forward, ["hidden_states", "top_k_index", "top_k_weights"]) or \
            _init_sets(cls, "gate_up_proj")

    @staticmethod
    def instance_reason(m):
        gu, dp = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
        if not (isinstance(gu, torch.Tensor) and isinstance(dp, torch.Tensor) and gu.dim() == 3 and dp.dim() == 3):
            return "no 3-D gate_up_proj / down_proj parameters"
        for flag, want in (("has_bias", False), ("is_transposed", False), ("is_concatenated", True),
                           ("has_gate", True), ("has_post_expert_norm", False), ("_is_expert_parallel", False)):
            if getattr(m, flag, want) != want:
                return f"{flag}={getattr(m, flag)!r} is not supported by twinkle_kernels.moe_experts"
        return glu_activation(getattr(m, "act_fn", None))[1]

    @staticmethod
    def make(orig, backend, decompose=False):
        # ``orig.forward`` is transformers' dispatching forward (``use_experts_implementation``): it
        # looks ``config._experts_implementation`` up in ALL_EXPERTS_FUNCTIONS, "eager" being the
        # class's own loop. Every selection but "twinkle" goes there untouched, so
        # ``set_experts_implementation("eager" | "batched_mm" | "grouped_mm")`` keeps its meaning.
        orig_forward = orig.forward

        def forward(self, hidden_states, top_k_index, top_k_weights):
            if getattr(getattr(self, "config", None), "_experts_implementation", None) != EXPERTS_NAME:
                return orig_forward(self, hidden_states, top_k_index, top_k_weights)
            why = _Experts.instance_reason(self)
            if why is not None or _tracing(decompose):
                # what transformers would have run by default (unpatched), not a silent approximation;
                # under compile also when apply(under_compile=...) asked for the decomposition
                if why is not None:
                    _fallback_once(type(self).__name__, f"{why}; running transformers' grouped_mm")
                from transformers.integrations.moe import grouped_mm_experts_forward
                return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
            w = self.gate_up_proj
            out = _tk().moe_experts(hidden_states.to(w.dtype), top_k_index, top_k_weights, w, self.down_proj,
                                    activation=glu_activation(self.act_fn)[0], backend=backend)
            return out.to(hidden_states.dtype)
        return forward


# Selections transformers makes by itself (nothing requested): a patched model uses "twinkle" then.
# Anything else was chosen by the user and is kept.
DEFAULT_EXPERTS = (None, "grouped_mm")
# config -> the implementation it had (or transformers would have chosen) before "twinkle": revert
# restores it, since "twinkle" leaves ALL_EXPERTS_FUNCTIONS with the last revert.
# (configs are unhashable: keyed by id, holding a weak reference)
SELECTED: Dict[int, tuple] = {}


def select(cfg, prev) -> None:
    """Record ``cfg``'s implementation before "twinkle" (once: the first one is the user's)."""
    if id(cfg) not in SELECTED or SELECTED[id(cfg)][0]() is not cfg:
        SELECTED[id(cfg)] = (weakref.ref(cfg), prev)


def restore_selected(cfg=None) -> None:
    """Give ``cfg`` (None: every recorded config) its implementation before "twinkle" back."""
    keys = list(SELECTED) if cfg is None else [id(cfg)]
    for key in keys:
        ref, prev = SELECTED.pop(key, (None, None))
        c = ref() if ref is not None else None
        if c is not None and getattr(c, "_experts_implementation", None) == EXPERTS_NAME:
            c._experts_implementation_internal = prev


def default_to_twinkle(base: type) -> Callable:
    """The ``get_correct_experts_implementation`` for a family's ``*PreTrainedModel`` while patched:
    a model built without ``experts_implementation=`` gets "twinkle"; an explicit request
    (``"eager"``, ``"batched_mm"``, ``"grouped_mm"``, ...) is honoured as transformers would."""
    orig = base.get_correct_experts_implementation

    @functools.wraps(orig)
    def get_correct_experts_implementation(self, requested_experts=None, *args, **kwargs):
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        if requested_experts is None and EXPERTS_NAME in ALL_EXPERTS_FUNCTIONS:
            cfg = getattr(self, "config", None)
            if cfg is not None:
                select(cfg, orig(self, None, *args, **kwargs))
            requested_experts = EXPERTS_NAME
        return orig(self, requested_experts, *args, **kwargs)
    return get_correct_experts_implementation


# -- module-global functions -----------------------------------------------------------------------

def _wrap(orig, fn):
    functools.update_wrapper(fn, orig)  # name, doc, __wrapped__ (the original, as Liger keeps it)
    return fn


class _Rope:
    op = "apply_rotary_pos_emb"

    @staticmethod
    def op_reason():
        return _has_op("apply_rotary_pos_emb")

    @staticmethod
    def target_reason(fn):
        got = _params(fn)
        if got != ["q", "k", "cos", "sin", "unsqueeze_dim"]:
            return f"signature changed: apply_rotary_pos_emb has parameters {got}, expected (q, k, cos, sin, unsqueeze_dim)"
        return None

    @staticmethod
    def make(orig, backend, decompose=False):
        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            if _tracing(decompose):
                return _ref()[1].apply_rotary_pos_emb_reference(q, k, cos, sin, unsqueeze_dim)
            return _tk().apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim, backend=backend)
        return _wrap(orig, apply_rotary_pos_emb)


_GDN_PARAMS = ["query", "key", "value", "g", "beta", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel"]


class _GDNChunk:
    """HF ``torch_chunk_gated_delta_rule``: q, k [B,T,H,K], v [B,T,HV,V], g, beta [B,T,HV] (the fla layout,
    no transpose); called with ``cu_seqlens`` (from ``cu_seq_lens_q``) and other attention kwargs."""
    op = "chunk_gated_delta_rule"

    @staticmethod
    def op_reason():
        return _has_op("chunk_gated_delta_rule")

    @staticmethod
    def target_reason(fn):
        return _needs_params(fn, _GDN_PARAMS + ["chunk_size"])

    @staticmethod
    def make(orig, backend, decompose=False):
        def torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                         output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                                         **kwargs):
            if cu_seqlens is None and _tracing(decompose) and (decompose is True or query.shape[1] < decompose):
                # unpacked: transformers' own torch code, as a compiled unpatched model runs it (packed
                # calls keep the op: that code would mix the samples' states); with decompose = n, only
                # sequences shorter than n (a trace-time shape), where it is the faster one
                return orig(query, key, value, g, beta, chunk_size=chunk_size, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            **kwargs)
            o, state = _tk().chunk_gated_delta_rule(
                query, key, value, g, beta, None, initial_state, bool(output_final_state),
                bool(use_qk_l2norm_in_kernel), cu_seqlens, chunk_size=chunk_size, backend=backend)
            return o.to(query.dtype), (state if output_final_state else None)
        return _wrap(orig, torch_chunk_gated_delta_rule)


class _GDNRecurrent:
    op = "fused_recurrent_gated_delta_rule"

    @staticmethod
    def op_reason():
        return _has_op("fused_recurrent_gated_delta_rule")

    @staticmethod
    def target_reason(fn):
        return _needs_params(fn, _GDN_PARAMS)

    @staticmethod
    def make(orig, backend):
        def torch_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                                             use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
            o, state = _tk().fused_recurrent_gated_delta_rule(
                query, key, value, g, beta, None, initial_state, bool(output_final_state),
                bool(use_qk_l2norm_in_kernel), cu_seqlens, backend=backend)
            return o.to(query.dtype), (state if output_final_state else None)
        return _wrap(orig, torch_recurrent_gated_delta_rule)


def _packed_offsets(kwargs) -> Optional[torch.Tensor]:
    # The GDN layers forward the flash-style packing kwargs to causal_conv1d_fn untouched; the
    # offsets keep the convolution from reading across samples.
    cu = kwargs.get("cu_seqlens")
    return kwargs.get("cu_seq_lens_q") if cu is None else cu


class _Conv1d:
    """HF ``causal_conv1d_fn(hidden_states [B, D, T], weight [D, W], bias, activation, **kwargs)``;
    math in weight's dtype, output in hidden_states' dtype, as the torch fallback does."""
    op = "causal_conv1d"

    @staticmethod
    def op_reason():
        return _has_op("causal_conv1d")

    @staticmethod
    def target_reason(fn):
        return _needs_params(fn, ["hidden_states", "weight", "bias", "activation"])

    @staticmethod
    def make(orig, backend, decompose=False):
        def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
            cu = _packed_offsets(kwargs)
            if cu is None and _tracing(decompose):  # unpacked: transformers' torch conv (see _GDNChunk)
                return orig(hidden_states, weight, bias, activation, **kwargs)
            x = hidden_states.to(weight.dtype)
            if cu is not None:
                # a cache may have prepended left context (zero padding or the previous conv state): it
                # precedes the first sample, so it joins the first segment. Shifting by T - cu[-1] (0
                # without a cache) needs no branch on a value, which torch.compile could not trace.
                cu = torch.cat([cu[:1], cu[1:] + (x.shape[-1] - cu[-1:])])
            y = _tk().causal_conv1d(x, weight, bias, activation, cu, backend=backend)
            return y.to(hidden_states.dtype)
        return _wrap(orig, causal_conv1d_fn)


class _Conv1dUpdate:
    """HF ``causal_conv1d_update(hidden_states [B, D, S], conv_state [B, D, L], weight [D, W], bias, activation)``;
    updates conv_state in place."""
    op = "causal_conv1d_update"

    @staticmethod
    def op_reason():
        return _has_op("causal_conv1d_update")

    @staticmethod
    def target_reason(fn):
        return _needs_params(fn, ["hidden_states", "conv_state", "weight", "bias", "activation"])

    @staticmethod
    def make(orig, backend):
        def causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None):
            x = hidden_states.to(weight.dtype)
            y = _tk().causal_conv1d_update(x, conv_state, weight, bias, activation, backend=backend)
            return y.to(hidden_states.dtype)
        return _wrap(orig, causal_conv1d_update)


IMPLS: Dict[str, type] = {
    "rms_norm": _RMSNorm,
    "rms_norm_zero_centred": _ZeroCentredRMSNorm,
    "gated_rms_norm": _GatedRMSNorm,
    "swiglu_mlp": _SwiGLUMLP,
    "experts": _Experts,
    "rope": _Rope,
    "gdn_chunk": _GDNChunk,
    "gdn_recurrent": _GDNRecurrent,
    "conv1d": _Conv1d,
    "conv1d_update": _Conv1dUpdate,
    "fused_linear_cross_entropy": _linear_ce.FusedLinearCrossEntropy,
}


def register_experts() -> Callable[[], None]:
    """Registers the twinkle experts implementation with transformers; returns its undo."""
    hf = _experts_hf()
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    if EXPERTS_NAME in ALL_EXPERTS_FUNCTIONS:
        return lambda: None
    hf.register_hf_experts(name=EXPERTS_NAME)
    return lambda: hf.unregister_hf_experts(EXPERTS_NAME)
