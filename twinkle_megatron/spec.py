"""megatron-core layer specs for the facade's models, with the layer modules chosen when the model is
built.

The choice between megatron's local arithmetic and twinkle_kernels is made in one place, a backend
spec provider (megatron's ``BackendSpecProvider`` idea, ``megatron/core/models/backends.py``):
:class:`LocalSpecProvider` gives the local modules, :class:`TwinkleSpecProvider` the same slots on
twinkle_kernels, and :func:`spec_provider` picks one. The builders (:func:`attention_layer_spec`,
:func:`gdn_layer_spec`, :func:`block_spec`) only ask the provider; which layer gets which builder
is its family's choice (``layer_specs`` in :mod:`twinkle_megatron.models`). Nothing global is
modified.

The twinkle modules (see :mod:`twinkle_megatron.layers`):

- every RMSNorm (input, pre-MLP, q/k, Gated DeltaNet output, final) is ``TwinkleRMSNorm``
  (``tk.rms_norm``; plain or zero-centred from ``config.layernorm_zero_centered_gamma``;
  sequence-parallel aware);
- self-attention is ``TwinkleSelfAttention``, which hands the rotary frequencies to its core
  attention; the core attention (the local packed one, or the CP one) is subclassed to rotate q and
  k with ``tk.apply_rotary_pos_emb`` in megatron's ``[S, B, H, D]`` layout, full or partial rotary,
  and plain causal attention runs on torch's fused ``scaled_dot_product_attention``;
- the dense MLP is ``TwinkleMLP`` (``tk.swiglu_packed``); MoE experts are ``TwinkleGroupedMLP``
  (``tk.grouped_matmul``);
- the Gated DeltaNet is ``TwinkleGatedDeltaNet`` (``tk.causal_conv1d``,
  ``tk.chunk_gated_delta_rule``, ``tk.gated_rms_norm``).

Cases the fused paths do not cover (interleaved or MLA rotary, THD under context parallelism,
inference caches, biased/clamped GLUs) fall through to megatron's own
code, so the spec never changes what a model computes, only where.

For layer specs built by other code (e.g. megatron's ``get_gpt_layer_local_spec``),
:func:`twinkle_layer_spec` returns a copy with the twinkle modules substituted.
"""
from __future__ import annotations

import contextlib
import copy
import logging
from typing import List, Optional

import torch

from . import versions
from .layers import attention, gated_delta_net, lm_head, mlp
from .layers.norm import RMSNorm, TwinkleRMSNorm


class LocalSpecProvider:
    """The facade's local modules: megatron's local ones, except our :class:`RMSNorm` (megatron's
    ``WrappedTorchNorm`` refuses sequence parallelism), our core attention (the local one extended to
    packed THD sequences, or, with ``context_parallel``, the K/V-gathering one: the local one refuses
    CP) and the local Gated DeltaNet (megatron's needs flash-linear-attention).

    The methods of megatron's ``BackendSpecProvider`` protocol answer as megatron's
    ``LocalSpecProvider`` does; :meth:`self_attention`, :meth:`mlp` and :meth:`gated_delta_net` are
    the slots megatron's builders fill with fixed classes. :meth:`output_head` is the LM-head
    loss path of a built chunk (``fused_linear_ce``)."""

    def __init__(self, context_parallel: bool = False, fused_linear_ce: bool = False):
        self.context_parallel = bool(context_parallel)
        self.fused_linear_ce = bool(fused_linear_ce)

    def output_head(self, chunk) -> Optional[lm_head.OutputHead]:
        """What the loss of a built GPTModel ``chunk`` reads: with ``fused_linear_ce`` on its last
        pipeline stage, the output layer's weight shard (the chunk then returns its final hidden
        states, and the loss is twinkle_kernels' fused linear cross-entropy, never holding the
        ``[tokens, V / tp]`` logits); None where the chunk returns logits (or no output)."""
        if self.fused_linear_ce and chunk.post_process:
            return lm_head.output_head(chunk)
        return None

    # megatron's BackendSpecProvider
    def column_parallel_linear(self) -> type:
        from megatron.core.tensor_parallel import ColumnParallelLinear
        return ColumnParallelLinear

    def row_parallel_linear(self) -> type:
        from megatron.core.tensor_parallel import RowParallelLinear
        return RowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        return False

    def column_parallel_layer_norm_linear(self) -> Optional[type]:
        return None

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        if rms_norm:
            return RMSNorm
        from megatron.core.models import backends
        return backends.LNImpl

    def core_attention(self) -> type:
        if self.context_parallel:
            return attention.ContextParallelAttention
        return attention.PackedDotProductAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool = False):
        """The experts entry: ``(module, submodules)`` on megatron-core 0.16, a builder from 0.17
        (:data:`~twinkle_megatron.versions.CHANGES` ``experts_builder``), as megatron's own."""
        return versions.grouped_mlp_modules(self, moe_use_grouped_gemm)

    def activation_func(self) -> Optional[type]:
        return None

    # slots megatron's builders hard-code
    def self_attention(self) -> type:
        from megatron.core.transformer.attention import SelfAttention
        if self.context_parallel:   # packed rows: RoPE at each token's place in its sample
            return attention.context_parallel_self_attention_class(SelfAttention)
        return SelfAttention

    def mlp(self) -> type:
        from megatron.core.transformer.mlp import MLP
        return MLP

    def gated_delta_net(self) -> type:
        return gated_delta_net.local_gated_delta_net_class()

    def final_norm(self) -> type:
        """The block's final norm."""
        return self.layer_norm(rms_norm=True)


class TwinkleSpecProvider(LocalSpecProvider):
    """:class:`LocalSpecProvider` with every slot that has a twinkle_kernels module filled by it
    (see the module docstring); linear layers stay megatron's."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return TwinkleRMSNorm if rms_norm else super().layer_norm(rms_norm=rms_norm, for_qk=for_qk)

    def core_attention(self) -> type:
        return attention.rope_core_attention(super().core_attention())

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool = False):
        from megatron.core.transformer.moe.experts import SequentialMLP
        experts = super().grouped_mlp_modules(moe_use_grouped_gemm, moe_use_legacy_grouped_gemm)
        if isinstance(experts, tuple):   # megatron-core 0.16: (module, submodules)
            module, submodules = experts
            return (mlp.grouped_mlp_class() if module is SequentialMLP else module), submodules
        if versions.built_class(experts) is SequentialMLP:
            return versions.with_class(experts, mlp.grouped_mlp_class())
        return experts

    def self_attention(self) -> type:
        if self.context_parallel:
            return attention.context_parallel_self_attention_class(attention.self_attention_class())
        return attention.self_attention_class()

    def mlp(self) -> type:
        return mlp.mlp_class()

    def gated_delta_net(self) -> type:
        return gated_delta_net.gated_delta_net_class()


def spec_provider(use_twinkle_kernels: bool, *, context_parallel: bool = False,
                  fused_linear_ce: bool = False) -> LocalSpecProvider:
    """The provider of a facade model's layer modules (twinkle_kernels or megatron's local ones)
    and of its LM-head loss path (``fused_linear_ce``)."""
    cls = TwinkleSpecProvider if use_twinkle_kernels else LocalSpecProvider
    return cls(context_parallel=context_parallel, fused_linear_ce=fused_linear_ce)


def attention_layer_spec(backend: LocalSpecProvider, *, qk_norm: bool, num_experts: int = 0,
                         router: Optional[type] = None):
    """A full-attention layer: the structure of megatron's ``get_gpt_layer_local_spec`` (RMSNorm,
    q/k norms when ``qk_norm``, a dense MLP, or with ``num_experts`` an MoE with the alltoall
    dispatcher and ``router`` as its router class when given) with the modules of ``backend``.
    The families choose the arguments (:mod:`twinkle_megatron.models`)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
    norm = backend.layer_norm(rms_norm=True)
    qk = backend.layer_norm(rms_norm=True, for_qk=True) if qk_norm else IdentityOp
    mlp_spec = get_mlp_module_spec_for_backend(backend=backend, num_experts=num_experts or None,
                                               moe_grouped_gemm=False)
    if versions.built_class(mlp_spec) is MLP:   # megatron's builder names the dense MLP class itself
        mlp_spec = versions.with_class(mlp_spec, backend.mlp())
    elif router is not None:
        versions.submodules_of(mlp_spec).router = router
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=backend.self_attention(),
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=backend.column_parallel_linear(),
                    core_attention=backend.core_attention(),
                    linear_proj=backend.row_parallel_linear(),
                    q_layernorm=qk,
                    k_layernorm=qk,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=mlp_spec,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def gdn_layer_spec(full_attention_spec, backend: LocalSpecProvider):
    """A linear-attention layer spec: ``full_attention_spec`` with its self-attention replaced by
    ``backend``'s Gated DeltaNet (column-parallel ``in_proj``, row-parallel ``out_proj``,
    plain-weight RMSNorm as the gated output norm)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    spec = copy.deepcopy(full_attention_spec)
    spec.submodules.self_attention = ModuleSpec(
        module=backend.gated_delta_net(),
        submodules=GatedDeltaNetSubmodules(
            in_proj=backend.column_parallel_linear(),
            # Qwen3.5's RMSNormGated scales by weight (ones at init), not 1 + weight.
            out_norm=ModuleSpec(module=backend.layer_norm(rms_norm=True), params={"zero_centered": False}),
            out_proj=backend.row_parallel_linear()))
    return spec


def block_spec(layer_specs: List, config, vp_stage: Optional[int], backend: LocalSpecProvider):
    """The ``TransformerBlockSubmodules`` of the layers this pipeline stage (and virtual stage
    ``vp_stage``) builds, for megatron's ``GPTModel(transformer_layer_spec=...)``;
    ``layer_specs``: one spec per global layer (a family's ``layer_specs``)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=layer_specs[offset:offset + n], layer_norm=backend.final_norm())


# ---- twinkle modules in a layer spec built by other code -----------------------------------------

def _norm_classes() -> tuple:
    """The norm classes a layer spec may name in a norm slot (megatron's, torch's, ours)."""
    from megatron.core.extensions.transformer_engine import TENorm
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    return (RMSNorm, WrappedTorchNorm, TENorm, FusedLayerNorm, torch.nn.RMSNorm, torch.nn.LayerNorm)


def _is_norm(x) -> bool:
    return isinstance(x, type) and issubclass(x, _norm_classes())


def is_gated_delta_net(module) -> bool:
    """Whether ``module`` (a class) is megatron's GatedDeltaNet or one of ours."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    return isinstance(module, type) and issubclass(module, GatedDeltaNet)


def gated_delta_net_spec(spec, backend: Optional[LocalSpecProvider] = None):
    """A copy of a GatedDeltaNet ``ModuleSpec`` (megatron's or the local one) running on
    twinkle_kernels: the module, and its output norm as ``TwinkleRMSNorm`` when it is a norm class
    (given as a class or as a ``ModuleSpec`` with params)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    backend = backend or TwinkleSpecProvider()
    spec = copy.deepcopy(spec)
    if is_gated_delta_net(spec.module):
        spec.module = backend.gated_delta_net()
        norm = spec.submodules.out_norm
        if isinstance(norm, ModuleSpec):
            if _is_norm(norm.module):
                norm.module = backend.layer_norm(rms_norm=True)
        elif _is_norm(norm):
            spec.submodules.out_norm = backend.layer_norm(rms_norm=True)
    return spec


def expert_spec(experts, backend: Optional[LocalSpecProvider] = None):
    """The experts entry of a megatron MoE spec with ``SequentialMLP`` swapped for the grouped
    twinkle experts (a copy; anything else is returned unchanged)."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    backend = backend or TwinkleSpecProvider()
    if versions.built_class(experts) is SequentialMLP:
        return versions.with_class(experts, mlp.grouped_mlp_class())
    return experts


def twinkle_layer_spec(spec, *, experts: bool = True):
    """A copy of the megatron layer spec ``spec`` with the twinkle_kernels modules of
    :class:`TwinkleSpecProvider` substituted: norms, self-attention, the core attention (rotary
    and SDPA around whatever core attention ``spec`` names), MLP, Gated DeltaNet, and, unless
    ``experts=False``, the MoE experts."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP
    backend = TwinkleSpecProvider()
    spec = copy.deepcopy(spec)
    sub = spec.submodules

    def norm(x):
        return backend.layer_norm(rms_norm=True) if _is_norm(x) else x

    sub.input_layernorm = norm(sub.input_layernorm)
    sub.pre_mlp_layernorm = norm(sub.pre_mlp_layernorm)
    attn = sub.self_attention
    if getattr(attn, "module", None) is SelfAttention:
        attn.module = backend.self_attention()
        a = attn.submodules
        a.q_layernorm = norm(a.q_layernorm)
        a.k_layernorm = norm(a.k_layernorm)
        if isinstance(a.core_attention, type):
            a.core_attention = attention.rope_core_attention(a.core_attention)
    elif is_gated_delta_net(getattr(attn, "module", None)):
        sub.self_attention = gated_delta_net_spec(attn, backend)
    mlp_spec = sub.mlp
    mlp_sub = versions.submodules_of(mlp_spec) if mlp_spec is not None else None
    if versions.built_class(mlp_spec) is MLP:
        sub.mlp = versions.with_class(mlp_spec, backend.mlp())
    elif experts and mlp_sub is not None and getattr(mlp_sub, "experts", None) is not None:
        mlp_sub.experts = expert_spec(mlp_sub.experts, backend)
    return spec


def describe(module: torch.nn.Module) -> Optional[str]:
    """Which twinkle modules a built model contains, e.g. for logs: ``'TwinkleRMSNorm x9, ...'``."""
    counts = {}
    for m in module.modules():
        name = type(m).__name__
        if name.startswith("Twinkle"):
            counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or None


@contextlib.contextmanager
def _no_cpu_affine_init():
    """megatron's CPU init of the embedding and linear weights (``_initialize_affine_weight_cpu``:
    each TP rank draws the full unsharded matrix and copies its shard out) reduced to what else
    it does, setting the weight's tensor-parallel attributes; the weight keeps its uninitialised
    memory. megatron's own switch, ``perform_initialization=False``, skips those attributes too."""
    from megatron.core.tensor_parallel import layers
    real = layers._initialize_affine_weight_cpu

    def attributes_only(weight, output_size, input_size, per_partition_size, partition_dim, init_method,
                        stride=1, return_master_weight=False, *, params_dtype=torch.float32, rank=None,
                        world_size=None, skip_set_tensor_parallel_attributes=False):
        if return_master_weight:   # megatron's tests' keep_master_weight_for_test: the real init
            return real(weight, output_size, input_size, per_partition_size, partition_dim, init_method,
                        stride, return_master_weight, params_dtype=params_dtype, rank=rank,
                        world_size=world_size,
                        skip_set_tensor_parallel_attributes=skip_set_tensor_parallel_attributes)
        if not skip_set_tensor_parallel_attributes:
            layers.set_tensor_model_parallel_attributes(tensor=weight, is_parallel=True, dim=partition_dim,
                                                        stride=stride)
        return None

    layers._initialize_affine_weight_cpu = attributes_only
    try:
        yield
    finally:
        layers._initialize_affine_weight_cpu = real


def build_chunks(shape, config, layer_specs, provider, vpp_size: int, device, *,
                 initialize_weights: bool = True) -> List[torch.nn.Module]:
    """This rank's GPTModel chunks (one per virtual pipeline stage) on ``device``: ``layer_specs``
    (one per global layer, as the model's family lays them out) cut into this rank's blocks with
    :func:`block_spec`; ``shape`` (:class:`~twinkle_megatron.models.ModelShape`) gives the
    vocabulary, positions, rotary and tied embeddings. ``initialize_weights=False`` (a checkpoint
    overwrites every weight next): with CPU initialisation, the embedding and linear weights are
    left uninitialised instead of drawn (the small router, norm and Gated DeltaNet parameters still
    are)."""
    from megatron.core import parallel_state as ps
    from .layers.lm_head import gpt_model_class
    GPTModel = gpt_model_class()   # megatron's, plus forward(..., return_hidden_states=)
    skip = _no_cpu_affine_init() if not initialize_weights and config.use_cpu_initialization \
        else contextlib.nullcontext()
    with skip, _quiet_build(layer_specs):
        return _build_chunks(GPTModel, shape, config, layer_specs, provider, vpp_size, device, ps)


class _DropMessage(logging.Filter):
    """A logger filter that drops the records whose message starts with ``prefix``."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


@contextlib.contextmanager
def _quiet_build(layer_specs):
    """While the chunks are built, drop two of megatron's warnings (log records on rank 0, printed
    before anything of the user's), each only where it says nothing the user can act on:

    - ``Unknown MLP type: <class 'ModuleSpec'>. Using default kwargs.``, once per dense layer
      (megatron-core before 0.18, :data:`~twinkle_megatron.versions.CHANGES` ``mlp_builder``).
      TransformerLayer passes ``tp_group=pg_collection.tp`` only to an MLP spec whose module *is*
      megatron's ``MLP``; for ``TwinkleMLP`` (a subclass) it warns and passes no extra keyword.
      ``MLP.__init__`` then takes parallel_state's tensor-parallel group, the same group: the
      facade builds GPTModel without a ``pg_collection``, so megatron's is
      ``ProcessGroupCollection.use_mpu_process_groups()``, parallel_state's groups. Nothing else
      differs (``config`` and ``submodules`` reach the MLP as for megatron's own). Dropped only
      when every layer's MLP that megatron could call unknown is an MLP subclass (an MoE layer is
      known to it). From 0.18 the MLP spec is a builder taking ``pg_collection`` and megatron
      has no such warning.
    - ``GPTModel IS DEPRECATED. ...`` (0.19, ``gpt_model_deprecated``): addressed to whoever
      chose GPTModel, which is the facade, not its user.

    Only those loggers, only those messages, only during the build."""
    drops = []
    if not versions.CHANGES["mlp_builder"].active and _only_mlp_subclasses(layer_specs):
        drops.append(("megatron.core.transformer.transformer_layer", "Unknown MLP type: "))
    if versions.CHANGES["gpt_model_deprecated"].active:
        drops.append(("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED."))
    filters = [(logging.getLogger(name), _DropMessage(prefix)) for name, prefix in drops]
    for logger, f in filters:
        logger.addFilter(f)
    try:
        yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)


def _only_mlp_subclasses(layer_specs) -> bool:
    """Whether each layer's MLP entry that is a ``ModuleSpec`` (the only kind megatron checks)
    builds megatron's ``MLP`` (or a subclass) or an MoE layer."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    for layer in layer_specs:
        entry = getattr(getattr(layer, "submodules", None), "mlp", None)
        if isinstance(entry, ModuleSpec) and not (isinstance(entry.module, type)
                                                  and issubclass(entry.module, (MLP, MoELayer))):
            return False
    return True


def _build_chunks(GPTModel, shape, config, layer_specs, provider, vpp_size, device, ps):
    chunks = []
    for i in range(vpp_size):
        vp = i if vpp_size > 1 else None
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=block_spec(layer_specs, config, vp, provider),
            vocab_size=shape.vocab_size,
            max_sequence_length=shape.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=shape.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=shape.partial_rotary_factor,
            rotary_base=shape.rope_theta,
            rope_scaling=shape.rope_scaling_factor > 0,       # llama3 scaling (megatron's fixed variant)
            rope_scaling_factor=shape.rope_scaling_factor or 8.0,
            vp_stage=vp,
        )
        chunks.append(chunk.to(device))
    return chunks
