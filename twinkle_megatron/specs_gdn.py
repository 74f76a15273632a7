"""megatron-core's Gated DeltaNet (``ssm/gated_delta_net.py``, Qwen3-Next / Qwen3.5 linear attention)
with its core on twinkle_kernels, chosen in the layer spec.

megatron-core 0.16.1 runs that core through flash-linear-attention (``chunk_gated_delta_rule``,
``l2norm``) and the ``causal_conv1d`` package, both CUDA-only, or, in ``deterministic_mode``,
through a slow torch loop. :class:`TwinkleGatedDeltaNet` keeps megatron's parameters and
projections (same state dict, same TP sharding of ``in_proj`` / ``out_proj``) and runs

- the depthwise causal conv + SiLU on ``tk.causal_conv1d``,
- q/k L2 normalisation and the chunked gated delta rule on ``tk.chunk_gated_delta_rule``,
- the output ``RMSNormGated`` on ``tk.gated_rms_norm`` (when ``out_norm`` is a plain-weight
  RMSNorm; otherwise megatron's own gated norm).

Packed sequences (``PackedSeqParams``, THD) reach the kernels as ``cu_seqlens``; inference
caches are refused like megatron refuses them.
"""
from __future__ import annotations

import copy
import functools

import twinkle_kernels as tk


@functools.lru_cache(maxsize=None)
def gated_delta_net_class() -> type:
    from .hybrid import local_gated_delta_net_class, packed_bounds

    class TwinkleGatedDeltaNet(local_gated_delta_net_class()):
        """GatedDeltaNet whose conv, delta rule and gated norm run on twinkle_kernels.

        Same constructor arguments, parameters (names, shapes, TP attributes) and initialisation
        as megatron's (:class:`twinkle_megatron.hybrid.GatedDeltaNetBase`). Packed sequences
        (THD ``packed_seq_params``) go to the kernels as ``cu_seqlens``; activations other than
        SiLU take the local torch path."""

        def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                    attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *,
                    inference_params=None, **kwargs):
            self._check_call(inference_context, inference_params)
            if self.activation not in ("silu", "swish"):
                return super().forward(hidden_states, attention_mask, packed_seq_params=packed_seq_params)
            qkv, gate, beta, alpha = self._project(hidden_states)
            batch, seq_len = qkv.shape[:2]
            cu = packed_bounds(packed_seq_params, batch, seq_len)
            qkv = tk.causal_conv1d(qkv.transpose(1, 2), self.conv1d.weight.squeeze(1),
                                   self.conv1d.bias, activation="silu", cu_seqlens=cu).transpose(1, 2)
            q, k, v = self._split_heads(qkv)
            rep = self.num_value_heads // self.num_key_heads
            if rep > 1:  # value head j reads key head j // rep, as megatron's repeat_interleave
                q = q.repeat_interleave(rep, dim=2)
                k = k.repeat_interleave(rep, dim=2)
            out, _ = tk.chunk_gated_delta_rule(
                q.contiguous(), k.contiguous(), v.contiguous(), self._decay(alpha), beta.sigmoid(),
                use_qk_l2norm_in_kernel=self.use_qk_l2norm, cu_seqlens=cu)
            norm = self.out_norm
            if type(norm).__name__ == "TwinkleRMSNorm" and not norm.zero_centered:
                y = tk.gated_rms_norm(out, gate.to(out.dtype), norm.weight.to(out.dtype), norm.eps)
            else:
                y = self._gated_norm(out, gate)
            return self._output(y, batch, seq_len)

    return TwinkleGatedDeltaNet


def is_gated_delta_net(module) -> bool:
    """Whether ``module`` (a class) is megatron's GatedDeltaNet or one of ours."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    return isinstance(module, type) and issubclass(module, GatedDeltaNet)


def gated_delta_net_spec(spec):
    """A copy of a GatedDeltaNet ``ModuleSpec`` (megatron's or
    :class:`twinkle_megatron.hybrid.LocalGatedDeltaNet`) running on twinkle_kernels: the module,
    and its output norm as :class:`twinkle_megatron.specs.TwinkleRMSNorm` when it is an RMSNorm
    (given as a class or as a ``ModuleSpec`` with params)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from .specs import TwinkleRMSNorm
    spec = copy.deepcopy(spec)
    if is_gated_delta_net(spec.module):
        spec.module = gated_delta_net_class()
        norm = spec.submodules.out_norm
        cls = norm.module if isinstance(norm, ModuleSpec) else norm
        if cls is not None and "Norm" in getattr(cls, "__name__", "") and "Layer" not in cls.__name__:
            if isinstance(norm, ModuleSpec):
                norm.module = TwinkleRMSNorm
            else:
                spec.submodules.out_norm = TwinkleRMSNorm
    return spec
