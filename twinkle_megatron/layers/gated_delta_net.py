"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) modules for megatron-core layer specs.

megatron-core 0.16.1 builds Qwen3-Next/3.5-style blocks only with TransformerEngine
(``get_transformer_block_with_experimental_attention_variant_spec``) and its ``GatedDeltaNet``
refuses to be constructed without flash-linear-attention (and always allocates on the current CUDA
device). Here:

- ``GatedDeltaNetBase`` (:func:`gated_delta_net_base`): megatron's ``GatedDeltaNet`` parameters
  (same names, shapes, TP sharding, initialisation) and its ``in_proj`` split
  ``[q, k, v, z, beta, alpha]`` per TP rank, constructed without fla on the configured device;
- ``LocalGatedDeltaNet`` (:func:`local_gated_delta_net_class`): megatron's own torch path for the
  core (``nn.Conv1d`` + activation, L2 norm, ``torch_chunk_gated_delta_rule``); the output norm is
  a plain-weight RMSNorm gated by ``silu(z)``, as Qwen3.5's ``RMSNormGated``;
- ``TwinkleGatedDeltaNet`` (:func:`gated_delta_net_class`): the same module with the conv, the
  delta rule and the gated norm on ``tk.causal_conv1d``, ``tk.chunk_gated_delta_rule`` and
  ``tk.gated_rms_norm``.

Both take packed sequences (``PackedSeqParams``, THD): the local one runs the delta rule and the
causal conv per sequence, the twinkle one hands ``cu_seqlens`` to the kernels, so no state or conv
window crosses a sample boundary. Inference caches are refused (as megatron-core refuses them).

Context parallelism (``context_parallel_size > 1``, plain rows): megatron's load-balanced split
gives CP rank r chunks r and ``2cp - 1 - r`` of each row's ``2cp`` chunks, so each rank holds two
non-adjacent pieces of every row. Both modules then run the conv and the delta rule on
:func:`twinkle_kernels.gdn.causal_conv1d_cp` and :func:`~twinkle_kernels.gdn.chunk_gated_delta_rule_cp`
over the rows laid end to end (``cu_seqlens = [0, S, 2S, ...]``, ``segments`` from
:func:`~twinkle_kernels.gdn.zigzag_segments`) with the CP process group: the conv exchanges its
``W - 1`` halo tokens and the delta rule passes states between ranks, so every rank gets exactly what
the unsplit layer computes for its tokens. The local module runs them on the ``reference`` backend
(pure torch), the twinkle one on the default backend. Packed rows under context parallelism are one
THD row split the same way (the facade's batching, ``packed_micro_batches``): ``cu_seqlens`` are the
global boundaries of its samples, which may cross the chunk boundaries; the CP ops restart the state
and the conv window at each of them. The hybrid layer specs are built by :mod:`twinkle_megatron.spec`'s
``gdn_layer_spec``, for the layers the Qwen3.5 family (:mod:`twinkle_megatron.models.qwen3_5`) says.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

import twinkle_kernels as tk
from twinkle_kernels.gdn import causal_conv1d_cp, chunk_gated_delta_rule_cp, l2norm, zigzag_segments

from ..packing import segments, thd_bounds
from .norm import TwinkleRMSNorm, gated_norm


def packed_bounds(packed_seq_params, batch: int, seq_len: int):
    """``cu_seqlens`` (int32 [N + 1]) of a THD ``packed_seq_params``, or None when unpacked.
    Checks that the packed batch is one row of ``seq_len`` tokens."""
    if packed_seq_params is None:
        return None
    if packed_seq_params.qkv_format != "thd":
        raise NotImplementedError(f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r} "
                                  "is not supported by the Gated DeltaNet (thd)")
    cu = thd_bounds(packed_seq_params)[0]
    if batch != 1 or int(cu[-1]) != seq_len:
        raise ValueError(f"packed sequences need one row of cu_seqlens[-1] tokens: got batch {batch}, "
                         f"{seq_len} tokens, cu_seqlens ending at {int(cu[-1])}")
    return cu


@functools.lru_cache(maxsize=None)
def gated_delta_net_base() -> type:
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    class GatedDeltaNetBase(GatedDeltaNet):
        """megatron's ``GatedDeltaNet`` parameters and projections, constructed without
        flash-linear-attention and on the configured device (megatron's constructor requires fla
        and always allocates on the current CUDA device). ``forward`` is left to subclasses."""

        def __init__(self, config, submodules, layer_number=None, bias=False, conv_bias=False,
                     conv_init=None, use_qk_l2norm=True, A_init_range=(1, 16), pg_collection=None, *,
                     name=None, cp_comm_type=None):
            # name / cp_comm_type: what TransformerLayer passes from megatron-core 0.18
            # (versions.CHANGES["attention_name_kwarg"]); neither changes this module.
            from megatron.core.transformer.module import MegatronModule
            from megatron.core.transformer.spec_utils import build_module
            MegatronModule.__init__(self, config)
            if not (0 <= A_init_range[0] <= A_init_range[1]):
                raise ValueError(f"A_init_range must satisfy 0 <= low <= high, got {A_init_range}")
            if pg_collection is None:
                from megatron.core.process_groups_config import ProcessGroupCollection
                pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
            self.layer_number, self.bias, self.conv_bias, self.conv_init = layer_number, bias, conv_bias, conv_init
            self.A_init_range, self.use_qk_l2norm, self.pg_collection = A_init_range, use_qk_l2norm, pg_collection
            self.tp_group = pg_collection.tp
            self.tp_size = pg_collection.tp.size()
            self.sp_size = self.tp_size if config.sequence_parallel else 1
            # megatron-core 0.18+ methods this class inherits (sharded_state_dict, the CP
            # all-to-alls) read the CP size (versions.CHANGES["gdn_context_parallel"]). Our forward
            # never runs megatron's head-wise all-to-alls: under context parallelism it passes
            # states with twinkle_kernels' CP ops instead (``_cp_layout``), so megatron's view stays 1.
            self.cp_size = 1
            self.context_parallel_size = config.context_parallel_size
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
            if self.num_value_heads % self.num_key_heads:
                raise ValueError(f"linear_num_value_heads={self.num_value_heads} is not a multiple of "
                                 f"linear_num_key_heads={self.num_key_heads}")
            self.in_proj_dim = self.qk_dim * 2 + self.v_dim * 2 + self.num_value_heads * 2
            # The per-TP-rank sizes and the in_proj split table megatron-core 0.18+ reads (its
            # sharded_state_dict splits in_proj.weight by them); harmless on 0.16 / 0.17.
            tp = self.tp_size
            self.qk_dim_local_tp, self.v_dim_local_tp = self.qk_dim // tp, self.v_dim // tp
            self.num_k_heads_local_tp = self.num_key_heads // tp
            self.in_proj_qkvg_dim = self.qk_dim * 2 + self.v_dim * 2
            self.in_proj_extra_dim = self.num_value_heads * 2
            self.in_proj_split_names = ["query", "key", "value", "z", "beta", "alpha"]
            self.in_proj_split_sections = (self.qk_dim_local_tp, self.qk_dim_local_tp, self.v_dim_local_tp,
                                           self.v_dim_local_tp, self.num_value_heads // tp,
                                           self.num_value_heads // tp)
            # ... and what megatron's own forward reads (tests run it on this module as the reference):
            # the split of the projection, the delta rule of its torch path, no gdn_norm_out recompute
            self.feat_dim_split = (self.qk_dim_local_tp * 2 + self.v_dim_local_tp, self.v_dim_local_tp,
                                   self.num_value_heads // tp, self.num_value_heads // tp)
            self.recompute_norm_out = False
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
                # Split along dim 0 over TP, like megatron's column-parallel weights.
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
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

        def _check_call(self, inference_context, inference_params):
            if inference_context is not None or inference_params is not None:
                raise NotImplementedError("GatedDeltaNet: inference caches are not supported (as megatron-core)")

        def _cp_layout(self, packed_seq_params, batch: int, local_len: int, device):
            """``(cu_seqlens, segments, group)`` for the CP ops, or None without context parallelism.

            Megatron's CP split (``get_batch_on_this_cp_rank``, the facade's ``cp_positions``) cuts
            each row of ``S = local_len * cp`` tokens into ``2 * cp`` chunks; rank r holds chunks r
            and ``2cp - 1 - r``, in that order, and its ``[B, local_len]`` tokens are them row by row.
            Laid end to end, the B rows are one packed stream of B sequences of S tokens. Packed
            rows (THD ``packed_seq_params``) are one row split the same way, its ``cu_seqlens`` the
            global boundaries of its samples."""
            cp = self.context_parallel_size
            if cp == 1:
                return None
            group = getattr(self.pg_collection, "cp", None)
            if group is None:
                from megatron.core import parallel_state
                group = parallel_state.get_context_parallel_group()
            if dist.get_world_size(group) != cp:
                raise ValueError(f"the context-parallel group has {dist.get_world_size(group)} ranks, "
                                 f"but config.context_parallel_size={cp}")
            if local_len % 2:
                raise ValueError(f"context parallelism needs an even number of tokens per CP rank "
                                 f"(two chunks of each row), got {local_len}")
            row = local_len * cp
            if packed_seq_params is not None:
                # Packed rows: one row whose chunks r and 2cp - 1 - r this rank holds, as plain
                # rows; its samples, with their global boundaries, may cross the chunk boundaries.
                if packed_seq_params.qkv_format != "thd":
                    raise NotImplementedError(f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r} "
                                              "is not supported by the Gated DeltaNet (thd)")
                cu = thd_bounds(packed_seq_params)[0]
                if batch != 1 or int(cu[-1]) != row:
                    raise ValueError(
                        f"packed sequences under context parallelism need one row whose cu_seqlens (global, "
                        f"not divided by cp) end at {local_len} tokens x cp {cp} = {row}: got batch {batch}, "
                        f"cu_seqlens ending at {int(cu[-1])}")
                return cu.to(device=device, dtype=torch.long), zigzag_segments(row, cp, rows=1), group
            cu = torch.arange(batch + 1, dtype=torch.long, device=device) * row
            return cu, zigzag_segments(row, cp, rows=batch), group

        def _conv_cp(self, qkv, layout, activation, backend):
            """The causal conv of ``qkv [B, S_r, D]`` (this rank's tokens) over the whole rows."""
            batch, local_len, dim = qkv.shape
            cu, segs, group = layout
            x = qkv.reshape(1, batch * local_len, dim).transpose(1, 2)
            y = causal_conv1d_cp(x, self.conv1d.weight.squeeze(1), self.conv1d.bias, activation,
                                 cu_seqlens=cu, segments=segs, group=group, backend=backend)
            return y.transpose(1, 2).reshape(batch, local_len, dim)

        def _delta_rule_cp(self, q, k, v, g, beta, layout, l2_in_kernel, backend):
            """The delta rule on this rank's ``[B, S_r, ...]`` tokens over the whole rows; ``[B, S_r, HV, V]``."""
            batch, local_len = q.shape[:2]
            cu, segs, group = layout

            def flat(t):
                return t.reshape(1, batch * local_len, *t.shape[2:]).contiguous()
            out, _ = chunk_gated_delta_rule_cp(flat(q), flat(k), flat(v), flat(g), flat(beta),
                                               use_qk_l2norm_in_kernel=l2_in_kernel, cu_seqlens=cu,
                                               segments=segs, group=group, backend=backend)
            return out.reshape(batch, local_len, *out.shape[2:])

        def _project(self, hidden_states):
            """in_proj and the split into ``qkv`` [B, S, conv_dim/tp], ``gate`` [B, S, HV/tp, V],
            ``beta`` and ``alpha`` [B, S, HV/tp] (S: the full sequence, gathered under SP)."""
            seq_len, batch, _ = hidden_states.shape
            seq_len = seq_len * self.sp_size
            qkvzba, _ = self.in_proj(hidden_states)
            qkvzba = qkvzba.transpose(0, 1)       # [S, B, *] -> [B, S, *]
            tp = self.tp_size
            qkv, gate, beta, alpha = torch.split(
                qkvzba, [(self.qk_dim * 2 + self.v_dim) // tp, self.v_dim // tp,
                         self.num_value_heads // tp, self.num_value_heads // tp], dim=-1)
            return qkv, gate.reshape(batch, seq_len, -1, self.value_head_dim), beta, alpha

        def _split_heads(self, qkv):
            batch, seq_len = qkv.shape[:2]
            tp = self.tp_size
            q, k, v = torch.split(qkv, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], dim=-1)
            return (q.reshape(batch, seq_len, -1, self.key_head_dim),
                    k.reshape(batch, seq_len, -1, self.key_head_dim),
                    v.reshape(batch, seq_len, -1, self.value_head_dim))

        def _decay(self, alpha):
            return -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias.float())

        def _gated_norm(self, out, gate):
            """``out_norm(out) * act(gate)`` over [.., V] rows, in ``out``'s dtype."""
            return gated_norm(self.out_norm, out, gate, self.act_fn)

        def _output(self, y, batch, seq_len):
            y = y.reshape(batch, seq_len, -1).transpose(0, 1).contiguous()
            return self.out_proj(y)

    return GatedDeltaNetBase


@functools.lru_cache(maxsize=None)
def local_gated_delta_net_class() -> type:
    from megatron.core.ssm import gated_delta_net as mgdn

    class LocalGatedDeltaNet(gated_delta_net_base()):
        """megatron's GatedDeltaNet on its torch path (``nn.Conv1d`` + activation, L2 norm,
        ``torch_chunk_gated_delta_rule``, the gated output norm): the reference the twinkle spec
        is measured against. Packed sequences run one sequence at a time."""

        def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                    attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *,
                    inference_params=None, **kwargs):
            self._check_call(inference_context, inference_params)
            qkv, gate, beta, alpha = self._project(hidden_states)
            batch, seq_len = qkv.shape[:2]
            layout = self._cp_layout(packed_seq_params, batch, seq_len, qkv.device)
            if layout is not None:
                # the conv without activation, then this module's activation, as below
                qkv = self.act_fn(self._conv_cp(qkv, layout, None, "reference"))
            else:
                cu = packed_bounds(packed_seq_params, batch, seq_len)
                spans = [(0, seq_len)] if cu is None else segments(cu)
                x = qkv.transpose(1, 2)                                    # [B, D, S]
                qkv = torch.cat([self.act_fn(self.conv1d(x[..., a:b])[..., :b - a]) for a, b in spans], -1)
                qkv = qkv.transpose(1, 2)
            q, k, v = self._split_heads(qkv)
            if self.use_qk_l2norm:
                q, k = l2norm(q), l2norm(k)
            rep = self.num_value_heads // self.num_key_heads
            if rep > 1:
                q = q.repeat_interleave(rep, dim=2)
                k = k.repeat_interleave(rep, dim=2)
            g, beta = self._decay(alpha), beta.sigmoid()
            if layout is not None:
                out = self._delta_rule_cp(q, k, v, g, beta, layout, False, "reference")
                return self._output(self._gated_norm(out, gate), batch, seq_len)
            out = torch.cat([mgdn.torch_chunk_gated_delta_rule(
                q[:, a:b].contiguous(), k[:, a:b].contiguous(), v[:, a:b].contiguous(),
                g=g[:, a:b].contiguous(), beta=beta[:, a:b].contiguous())[0] for a, b in spans], 1)
            return self._output(self._gated_norm(out, gate), batch, seq_len)

    return LocalGatedDeltaNet


@functools.lru_cache(maxsize=None)
def gated_delta_net_class() -> type:
    class TwinkleGatedDeltaNet(local_gated_delta_net_class()):
        """GatedDeltaNet whose conv, delta rule and gated norm run on twinkle_kernels.

        Same constructor arguments, parameters (names, shapes, TP attributes) and initialisation
        as megatron's (``GatedDeltaNetBase``). Packed sequences
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
            layout = self._cp_layout(packed_seq_params, batch, seq_len, qkv.device)
            if layout is not None:
                qkv = self._conv_cp(qkv, layout, "silu", None)
            else:
                cu = packed_bounds(packed_seq_params, batch, seq_len)
                qkv = tk.causal_conv1d(qkv.transpose(1, 2), self.conv1d.weight.squeeze(1),
                                       self.conv1d.bias, activation="silu", cu_seqlens=cu).transpose(1, 2)
            q, k, v = self._split_heads(qkv)
            rep = self.num_value_heads // self.num_key_heads
            if rep > 1:  # value head j reads key head j // rep, as megatron's repeat_interleave
                q = q.repeat_interleave(rep, dim=2)
                k = k.repeat_interleave(rep, dim=2)
            if layout is not None:
                out = self._delta_rule_cp(q, k, v, self._decay(alpha), beta.sigmoid(), layout,
                                          self.use_qk_l2norm, None)
            else:
                out, _ = tk.chunk_gated_delta_rule(
                    q.contiguous(), k.contiguous(), v.contiguous(), self._decay(alpha), beta.sigmoid(),
                    use_qk_l2norm_in_kernel=self.use_qk_l2norm, cu_seqlens=cu)
            norm = self.out_norm
            if isinstance(norm, TwinkleRMSNorm) and not norm.zero_centered:
                y = norm.gated(out, gate)
            else:
                y = self._gated_norm(out, gate)
            return self._output(y, batch, seq_len)

    return TwinkleGatedDeltaNet
