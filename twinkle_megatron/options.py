"""The settings objects of ``MegatronModel``: :class:`PrecisionConfig`, :class:`RecomputeConfig`,
:class:`OverlapOptions`.

Each is a frozen dataclass that checks itself when it is made (``__post_init__``), with a
``TypeError`` / ``ValueError`` naming the flat ``MegatronModel`` keyword it stands for
(``mixed_precision``, ``recompute_granularity`` ..., ``overlap_grad_reduce`` ...). The flat
keywords build the same object, so both spellings are refused with the same message. What depends
on the model (a recompute module that needs experts, layers per pipeline stage) is checked when the
model is built, by :meth:`RecomputeConfig.fields`.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "no": torch.float32}
RECOMPUTE_GRANULARITIES = ("selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
# megatron's selective-recompute modules -> what a model needs for it (None: every model)
RECOMPUTE_MODULES = {
    "core_attn": None, "layernorm": None, "mlp": None,
    "moe": "an MoE model", "shared_experts": "an MoE model with a shared expert",
    "moe_act": "grouped-GEMM experts (the facade's experts are not)",
    "mla_up_proj": "multi-latent attention (no supported family has it)",
    # megatron-core 0.19's: only with its own Gated DeltaNet (experimental_attention_variant, built
    # with TransformerEngine); the facade's Gated DeltaNet modules are its own
    "gdn_norm_out": "megatron's own Gated DeltaNet (experimental_attention_variant='gated_delta_net', "
                    "TransformerEngine); the facade builds its own Gated DeltaNet modules",
}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """``MegatronModel(precision=...)`` or ``mixed_precision=``: "bf16" (bf16 params, fp32 main
    params and grads), "fp16" (the same with megatron's dynamic loss scaling), "fp32" or "no" (= fp32)."""
    mixed_precision: str = "bf16"

    def __post_init__(self):
        if not isinstance(self.mixed_precision, str) or self.mixed_precision not in PRECISIONS:
            raise ValueError(f"mixed_precision must be one of {sorted(PRECISIONS)}, got {self.mixed_precision!r}")

    @property
    def dtype(self) -> torch.dtype:
        return PRECISIONS[self.mixed_precision]


@dataclasses.dataclass(frozen=True)
class RecomputeConfig:
    """``MegatronModel(recompute=...)`` or the flat ``recompute_granularity`` / ``recompute_method`` /
    ``recompute_num_layers`` / ``recompute_modules``: megatron's activation recompute.

    - ``granularity=None``: no recompute; the other three must then be unset.
    - ``"full"``: whole transformer layers are recomputed in the backward (their inputs are kept):
      ``method="uniform"`` checkpoints every group of ``num_layers`` consecutive layers of a
      pipeline stage (``num_layers`` must divide the stage's layer count), ``"block"`` only the
      first ``num_layers`` layers of each stage. ``modules`` must be unset.
    - ``"selective"``: only the ``modules`` (default ``("core_attn",)``) are recomputed:
      ``core_attn`` (softmax attention), ``layernorm`` (input and pre-MLP norms), ``mlp`` (dense
      MLPs), ``moe`` / ``shared_experts`` (MoE models). ``method`` and ``num_layers`` must be unset.

    ``modules`` is kept as a tuple of distinct names, in the order given.
    """
    granularity: Optional[str] = None
    method: Optional[str] = None
    num_layers: Optional[int] = None
    modules: Optional[Tuple[str, ...]] = None

    def __post_init__(self):
        g, method, n, modules = self.granularity, self.method, self.num_layers, self.modules
        if g is None:
            for name, value in (("recompute_method", method), ("recompute_num_layers", n),
                                ("recompute_modules", modules)):
                if value is not None:
                    raise ValueError(f"{name}={value!r} needs recompute_granularity='full' or 'selective'")
            return
        if g not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"recompute_granularity must be None, 'selective' or 'full', got {g!r}")
        if g == "selective":
            for name, value in (("recompute_method", method), ("recompute_num_layers", n)):
                if value is not None:
                    raise ValueError(f"{name}={value!r} applies to recompute_granularity='full' only "
                                     "(selective recompute picks modules: recompute_modules)")
            modules = ("core_attn",) if modules is None else modules
            if isinstance(modules, str) or not all(isinstance(m, str) for m in modules):
                raise TypeError(f"recompute_modules must be a list of names, got {modules!r}")
            modules = tuple(dict.fromkeys(modules))
            if not modules:
                raise ValueError("recompute_modules is empty: name at least one module, or use "
                                 "recompute_granularity=None")
            for m in modules:
                if m not in RECOMPUTE_MODULES:
                    raise ValueError(f"recompute_modules: unknown module {m!r}; megatron's are "
                                     f"{sorted(RECOMPUTE_MODULES)}")
            object.__setattr__(self, "modules", modules)
            return
        if modules is not None:
            raise ValueError(f"recompute_modules={modules!r} applies to recompute_granularity='selective' "
                             "only (full recompute reruns whole layers)")
        if method not in RECOMPUTE_METHODS:
            raise ValueError(f"recompute_granularity='full' needs recompute_method='uniform' or 'block', "
                             f"got {method!r}")
        if n is not None and not _is_int(n):  # its range needs the model: fields()
            raise ValueError(f"recompute_granularity='full' needs recompute_num_layers between 1 and the layers "
                             f"of a pipeline stage, got {n!r}")

    def fields(self, shape, mesh) -> dict:
        """megatron's ``recompute_*`` ``TransformerConfig`` fields for a model of ``shape``
        (:class:`~twinkle_megatron.models.shape.ModelShape`) on ``mesh``, after the checks that need
        them (ValueError naming the argument; megatron's own are asserts or index errors deep in
        the forward)."""
        if self.granularity is None:
            return {}
        if self.granularity == "selective":
            for m in self.modules:
                need = RECOMPUTE_MODULES[m]
                ok = need is None or (m == "moe" and shape.num_experts > 0) or (
                    m == "shared_experts" and shape.num_experts > 0 and shape.shared_expert_intermediate_size > 0)
                if not ok:
                    raise ValueError(f"recompute_modules: {m!r} needs {need}; this is {shape.model_type} "
                                     f"with {shape.num_experts or 'no'} experts")
            if "layernorm" in self.modules and not _layernorm_recompute_available():
                raise ValueError("recompute_modules: 'layernorm' needs TransformerEngine (megatron-core's "
                                 "CheckpointWithoutOutput reads TransformerEngine's FP8 state even without FP8)")
            return {"recompute_granularity": "selective", "recompute_modules": list(self.modules)}
        per_stage = shape.num_layers // (mesh.pp_size * mesh.vpp_size)
        if self.num_layers is None or not 1 <= self.num_layers <= per_stage:
            raise ValueError(f"recompute_granularity='full' needs recompute_num_layers between 1 and the "
                             f"{per_stage} layers of a pipeline stage, got {self.num_layers!r}")
        if self.method == "uniform" and per_stage % self.num_layers:
            raise ValueError(f"recompute_method='uniform': recompute_num_layers={self.num_layers} must divide the "
                             f"{per_stage} layers of a pipeline stage")
        return {"recompute_granularity": "full", "recompute_method": self.method,
                "recompute_num_layers": self.num_layers,
                # megatron's default list is read only by selective recompute; keep it out of full's way
                "recompute_modules": []}


def _layernorm_recompute_available() -> bool:
    from megatron.core.tensor_parallel import random as mrandom
    return hasattr(mrandom, "FP8GlobalStateManager")


@dataclasses.dataclass(frozen=True)
class OverlapOptions:
    """``MegatronModel(overlap=...)`` or the flat ``overlap_grad_reduce`` / ``overlap_param_gather`` /
    ``bucket_size``: the switches of the facade's DDP config (:func:`twinkle_megatron.parallel.ddp.ddp_config`).

    ``overlap_grad_reduce``: the grad all-reduce (reduce-scatter with the distributed optimizer)
    of each bucket starts in the backward, as soon as the bucket's grads are complete.
    ``overlap_param_gather``: with the distributed optimizer, the updated params are all-gathered
    bucket by bucket ahead of the next forward's use instead of inside the optimizer step.
    ``bucket_size``: parameters per bucket with ``overlap_grad_reduce`` (None: megatron's default,
    ``max(40M, 1M * dp)``); without it megatron reduces one bucket."""
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    bucket_size: Optional[int] = None

    def __post_init__(self):
        for name in ("overlap_grad_reduce", "overlap_param_gather"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        b = self.bucket_size
        if b is not None and (not _is_int(b) or b < 1):
            raise ValueError(f"bucket_size must be a positive int (parameters per bucket) or None, got {b!r}")

    def describe(self, use_distributed_optimizer: Optional[bool] = None) -> str:
        """The ``ddp:`` line of ``get_train_configs`` (and the train job's header);
        ``use_distributed_optimizer``: None before the model is wrapped (not known yet)."""
        gather = self.overlap_param_gather and use_distributed_optimizer is not False
        line = (f"ddp: overlap_grad_reduce={self.overlap_grad_reduce} overlap_param_gather={gather} "
                f"bucket_size={self.bucket_size or 'default'}")
        notes = []
        if self.bucket_size is not None and not self.overlap_grad_reduce:
            notes.append("bucket_size applies with overlap_grad_reduce only (else megatron uses one bucket)")
        if self.overlap_param_gather and use_distributed_optimizer is False:
            notes.append("overlap_param_gather applies to the distributed optimizer only")
        return line + "".join(f"; {n}" for n in notes)


CONFIGS = (PrecisionConfig, RecomputeConfig, OverlapOptions)
