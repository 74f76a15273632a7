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

Packed sequences and inference caches are refused like megatron refuses them.
"""
from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F

import twinkle_kernels as tk


@functools.lru_cache(maxsize=None)
def gated_delta_net_class() -> type:
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    class TwinkleGatedDeltaNet(GatedDeltaNet):
        """GatedDeltaNet whose conv, delta rule and gated norm run on twinkle_kernels.

        Same constructor arguments, parameters (names, shapes, TP attributes) and initialisation
        as megatron's; built without flash-linear-attention (megatron's constructor refuses to run
        without it) and on the configured device rather than always the current CUDA device."""

        def __init__(self, config, submodules, layer_number=None, bias=False, conv_bias=False,
                     conv_init=None, use_qk_l2norm=True, A_init_range=(1, 16), pg_collection=None):
            from megatron.core.transformer.module import MegatronModule
            from megatron.core.transformer.spec_utils import build_module
            MegatronModule.__init__(self, config)
            if not (0 <= A_init_range[0] <= A_init_range[1]):
                raise ValueError(f"A_init_range must satisfy 0 <= low <= high, got {A_init_range}")
            if pg_collection is None:
                from megatron.core.process_groups_config import ProcessGroupCollection
                pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
            self.layer_number, self.bias, self.conv_bias, self.conv_init = layer_number, bias, conv_bias, conv_init
            self.A_init_range, self.use_qk_l2norm, self.pg_collection = A_init_range, use_qk_l2norm, pg_collection
            self.tp_size = pg_collection.tp.size()
            self.sp_size = self.tp_size if config.sequence_parallel else 1
            self.config = config
            self.hidden_size = config.hidden_size
            self.act_fn = config.activation_func
            self.activation = self.act_fn.__name__
            self.conv_kernel_dim = config.linear_conv_kernel_dim
            self.key_head_dim = config.linear_key_head_dim
            self.value_head_dim = config.linear_value_head_dim
            self.num_key_heads = config.linear_num_key_heads
            self.num_value_heads = config.linear_num_value_heads
            self.qk_dim = self.key_head_dim * self.num_key_heads
            self.v_dim = self.value_head_dim * self.num_value_heads
            for name, n in (("linear_num_key_heads", self.num_key_heads),
                            ("linear_num_value_heads", self.num_value_heads)):
                if n % self.tp_size:
                    raise ValueError(f"{name}={n} is not divisible by the tensor-parallel size {self.tp_size}")
            self.in_proj_dim = self.qk_dim * 2 + self.v_dim * 2 + self.num_value_heads * 2
            tp_group = pg_collection.tp
            self.in_proj = build_module(
                submodules.in_proj, self.hidden_size, self.in_proj_dim, config=config,
                init_method=config.init_method, gather_output=False, bias=bias, skip_bias_add=False,
                is_expert=False, tp_comm_buffer_name="fc1", tp_group=tp_group)
            self.conv_dim = self.qk_dim * 2 + self.v_dim
            self.conv_dim_local_tp = self.conv_dim // self.tp_size
            device = torch.device("cpu") if config.use_cpu_initialization or not torch.cuda.is_available() \
                else torch.device("cuda", torch.cuda.current_device())
            self.conv1d = torch.nn.Conv1d(
                self.conv_dim_local_tp, self.conv_dim_local_tp, kernel_size=self.conv_kernel_dim,
                groups=self.conv_dim_local_tp, padding=self.conv_kernel_dim - 1, bias=conv_bias,
                device=device, dtype=config.params_dtype)
            self.num_v_heads_local_tp = self.num_value_heads // self.tp_size
            self.dt_bias = torch.nn.Parameter(torch.empty(self.num_v_heads_local_tp, dtype=config.params_dtype,
                                                          device=device))
            self.A_log = torch.nn.Parameter(torch.empty(self.num_v_heads_local_tp, dtype=config.params_dtype,
                                                        device=device))
            for p in [self.conv1d.weight, self.dt_bias, self.A_log] + ([self.conv1d.bias] if conv_bias else []):
                setattr(p, "tensor_model_parallel", True)
            self.out_norm = build_module(submodules.out_norm, config=config, hidden_size=self.value_head_dim,
                                         eps=config.layernorm_epsilon)
            self.out_proj = build_module(
                submodules.out_proj, self.v_dim, self.hidden_size, config=config,
                init_method=config.output_layer_init_method, bias=bias, input_is_parallel=True,
                skip_bias_add=True, is_expert=False, tp_comm_buffer_name="fc2", tp_group=tp_group)
            self.reset_parameters()

        def reset_parameters(self):
            from megatron.core.tensor_parallel import get_cuda_rng_tracker
            if not self.config.perform_initialization:
                return
            with torch.no_grad(), get_cuda_rng_tracker().fork():
                if self.conv_init is not None:
                    torch.nn.init.uniform_(self.conv1d.weight, -self.conv_init, self.conv_init)
                self.dt_bias.fill_(1.0)
                self.A_log.copy_(torch.empty_like(self.A_log).uniform_(*self.A_init_range).log())

        def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                    attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *,
                    inference_params=None, **kwargs):
            if inference_context is not None or inference_params is not None:
                raise NotImplementedError("GDN does not support inference for now (as megatron-core)")
            if packed_seq_params is not None:
                raise NotImplementedError("GDN does not support packed sequences yet (as megatron-core)")
            if self.activation not in ("silu", "swish"):
                return super().forward(hidden_states, attention_mask, key_value_states=key_value_states,
                                       attention_bias=attention_bias, sequence_len_offset=sequence_len_offset)
            seq_len, batch, _ = hidden_states.shape
            seq_len = seq_len * self.sp_size      # in_proj gathers the SP-split sequence
            qkvzba, _ = self.in_proj(hidden_states)
            qkvzba = qkvzba.transpose(0, 1)       # [S, B, *] -> [B, S, *]
            tp = self.tp_size
            qkv, gate, beta, alpha = torch.split(
                qkvzba, [(self.qk_dim * 2 + self.v_dim) // tp, self.v_dim // tp,
                         self.num_value_heads // tp, self.num_value_heads // tp], dim=-1)
            gate = gate.reshape(batch, seq_len, -1, self.value_head_dim)
            qkv = tk.causal_conv1d(qkv.transpose(1, 2), self.conv1d.weight.squeeze(1),
                                   self.conv1d.bias, activation="silu").transpose(1, 2)
            q, k, v = torch.split(qkv, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], dim=-1)
            q = q.reshape(batch, seq_len, -1, self.key_head_dim)
            k = k.reshape(batch, seq_len, -1, self.key_head_dim)
            v = v.reshape(batch, seq_len, -1, self.value_head_dim)
            rep = self.num_value_heads // self.num_key_heads
            if rep > 1:  # value head j reads key head j // rep, as megatron's repeat_interleave
                q = q.repeat_interleave(rep, dim=2)
                k = k.repeat_interleave(rep, dim=2)
            g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias.float())
            out, _ = tk.chunk_gated_delta_rule(
                q.contiguous(), k.contiguous(), v.contiguous(), g, beta.sigmoid(),
                use_qk_l2norm_in_kernel=self.use_qk_l2norm)
            norm = self.out_norm
            if type(norm).__name__ == "TwinkleRMSNorm" and not norm.zero_centered:
                y = tk.gated_rms_norm(out, gate.to(out.dtype), norm.weight.to(out.dtype), norm.eps)
            else:
                y = self._apply_gated_norm(out, gate)
            y = y.reshape(batch, seq_len, -1).transpose(0, 1).contiguous()
            return self.out_proj(y)

    return TwinkleGatedDeltaNet


def gated_delta_net_spec(spec):
    """A copy of a megatron GatedDeltaNet ``ModuleSpec`` running on twinkle_kernels (the module,
    and its output norm as :class:`twinkle_megatron.specs.TwinkleRMSNorm` when it is an RMSNorm)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from .specs import TwinkleRMSNorm
    spec = copy.deepcopy(spec)
    if spec.module is GatedDeltaNet:
        spec.module = gated_delta_net_class()
        norm = spec.submodules.out_norm
        if norm is not None and "Norm" in getattr(norm, "__name__", "") and "Layer" not in norm.__name__:
            spec.submodules.out_norm = TwinkleRMSNorm
    return spec
