"""Hugging Face config <-> megatron-core config: what a model is, not how its layers are built.

:func:`load_hf_config` reads a ``config.json``; :func:`model_shape` turns it into a
:class:`ModelShape` (what the weight converter and the spec builder need to know) through the
config's family (:mod:`twinkle_megatron.models`, which lists the supported families);
:func:`transformer_config` makes megatron's ``TransformerConfig`` for a shape and a mesh, with the
family's own fields, and :func:`recompute_fields` checks the activation-recompute options and
translates them into megatron's. The layer specs are built in :mod:`twinkle_megatron.spec`.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from . import models, versions
from .models.shape import ModelShape  # noqa: F401 (re-exported)
from .options import RECOMPUTE_MODULES, RecomputeConfig  # noqa: F401 (re-exported)
from .validate import read_json

SUPPORTED_MODEL_TYPES = models.MODEL_TYPES


def load_hf_config(model_dir_or_config: Union[str, os.PathLike, dict]) -> dict:
    """Read ``config.json`` from a directory (or accept the dict itself / a transformers config)."""
    if hasattr(model_dir_or_config, "to_dict"):
        return model_dir_or_config.to_dict()
    if isinstance(model_dir_or_config, dict):
        return dict(model_dir_or_config)
    path = os.fspath(model_dir_or_config)
    cfg_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"model_dir_or_config: no config.json at {cfg_file!r}")
    return read_json(cfg_file, "model_dir_or_config")


def model_shape(cfg: dict) -> ModelShape:
    """The :class:`ModelShape` of an HF config dict, read by the family of its ``model_type``."""
    return models.family(cfg.get("model_type")).model_shape(cfg)


def transformer_config(shape: ModelShape, mesh, *, params_dtype: torch.dtype, on_cpu: bool,
                       recompute: Optional[dict] = None):
    """megatron's ``TransformerConfig`` for ``shape`` laid out on ``mesh`` (a
    :class:`twinkle_megatron.DeviceMesh`), with the fusions that need TransformerEngine or apex off
    and the per-token loss megatron's schedules sum over micro-batches. ``recompute``: the
    activation-recompute fields, as :func:`recompute_fields` returns them (default: none)."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig
    kwargs = dict(models.family(shape.model_type).transformer_fields(shape))
    # a family with multi-latent attention gets megatron's MLA config (its MLA fields)
    config_class = MLATransformerConfig if kwargs.get("multi_latent_attention") else TransformerConfig
    kwargs.update(recompute or {})
    if shape.zero_centered_norm:
        kwargs["layernorm_zero_centered_gamma"] = True
    if shape.attention_output_gate:
        kwargs["attention_output_gate"] = True
    qk_layernorm = kwargs.pop("qk_layernorm", shape.qk_norm)   # a family may set it (MLA's latent norms)
    # megatron's default CUDA-graph scope 'full' makes its own __post_init__ warn that 'full' is
    # deprecated; the empty list is what it turns 'full' into (the whole layer), so pass that
    for key, value in versions.cuda_graph_fields().items():
        kwargs.setdefault(key, value)
    # megatron's own Gated DeltaNet checks refuse context parallelism (0.16 / 0.17 assert cp == 1;
    # 0.18+ want the linear heads divisible by tp * cp, for their head-wise all-to-all). The facade's
    # GDN layers pass states with twinkle_kernels' CP ops instead (layers/gated_delta_net.py), so a
    # hybrid's config is checked at cp 1 and given the mesh's CP size afterwards.
    cp_after = mesh.cp_size > 1 and kwargs.get("experimental_attention_variant") == "gated_delta_net"
    cfg = config_class(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.intermediate_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        layernorm_epsilon=shape.rms_norm_eps,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=mesh.tp_size,
        pipeline_model_parallel_size=mesh.pp_size,
        virtual_pipeline_model_parallel_size=mesh.vpp_size if mesh.vpp_size > 1 else None,
        context_parallel_size=1 if cp_after else mesh.cp_size,
        expert_model_parallel_size=mesh.ep_size,
        expert_tensor_parallel_size=mesh.etp_size,
        sequence_parallel=mesh.sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=on_cpu,
        calculate_per_token_loss=True,
        # Over gloo, batched p2p swaps messages with interleaved PP (wrong loss, no error).
        batch_p2p_comm=False,
        batch_p2p_sync=False,
        **kwargs,
    )
    if cp_after:
        cfg.context_parallel_size = mesh.cp_size
    return cfg


# ---- activation recompute -------------------------------------------------------------------

def recompute_fields(shape: ModelShape, mesh, *, granularity: Optional[str] = None,
                     method: Optional[str] = None, num_layers: Optional[int] = None,
                     modules: Optional[Sequence[str]] = None) -> dict:
    """megatron's ``recompute_*`` ``TransformerConfig`` fields for ``MegatronModel``'s
    ``recompute_granularity`` / ``recompute_method`` / ``recompute_num_layers`` /
    ``recompute_modules``, checked (:class:`~twinkle_megatron.options.RecomputeConfig` says what each
    means) against ``shape`` on ``mesh``."""
    return RecomputeConfig(granularity, method, num_layers, modules).fields(shape, mesh)
