"""The megatron-core releases the facade supports, and every API difference between them, in one place.

Supported: megatron-core 0.16.1 (the newest for Python 3.11) through 0.19.x (Python 3.12+). Each
difference the facade meets is a :class:`Change` in :data:`CHANGES`: what changed, the release that
brought it, and the dotted names it depends on (before and after). Code that must act differently
asks ``CHANGES[key].active`` (or one of the small helpers below), never ``try/except ImportError``;
``tests/megatron/test_versions.py`` checks, on whichever release is installed, that every name an active
change relies on exists and every name an inactive one relies on exists in its old form.

The layer-spec helpers exist because megatron-core moved from ``ModuleSpec`` to builders
(``functools.partial``) for the MLP and the experts: :func:`built_class`, :func:`with_class` and
:func:`submodules_of` read and rewrite either form, so the spec code says *what* it swaps, not how
each release spells it.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Optional, Tuple

OLDEST = "0.16.1"
NEWEST_MINOR = "0.19"     # the newest minor release tested (CI's second lane runs its newest patch)


def _parse(version: str) -> Tuple[int, ...]:
    parts = []
    for p in version.split("+")[0].split("."):
        n = len(p) - len(p.lstrip("0123456789"))
        if not n:
            break
        parts.append(int(p[:n]))
        if n != len(p):   # "0rc1" and the like: the release it previews
            break
    return tuple(parts)


@functools.lru_cache(maxsize=None)
def installed() -> str:
    """The installed megatron-core's version string (``megatron.core.__version__``)."""
    import megatron.core
    return megatron.core.__version__


def at_least(version: str, current: Optional[str] = None) -> bool:
    """Whether the installed (or the ``current``) megatron-core is ``version`` or newer."""
    return _parse(current or installed()) >= _parse(version)


@dataclasses.dataclass(frozen=True)
class Change:
    """One API difference: ``since`` is the first release with the new form; ``old`` / ``new``
    are dotted names (``module:attribute.path``) that exist before / from that release."""

    key: str
    since: str
    what: str
    old: Tuple[str, ...] = ()
    new: Tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        """Whether the installed megatron-core has the new form."""
        return at_least(self.since)

    def names(self) -> Tuple[str, ...]:
        """The dotted names the installed release must have for the facade's handling of it."""
        return self.new if self.active else self.old


CHANGES = {c.key: c for c in (
    Change("mlp_builder", "0.18",
           "TransformerLayer calls submodules.mlp(config=, pg_collection=, is_mtp_layer=, name=): the "
           "dense MLP spec is a functools.partial of MLP.as_mlp_submodule and only a ModuleSpec whose "
           "module is exactly MLP is rewrapped; the MoE spec is partial(MoELayer, submodules=...)",
           old=(),
           new=("megatron.core.transformer.mlp:MLP.as_mlp_submodule",)),
    Change("experts_builder", "0.17",
           "BackendSpecProvider.grouped_mlp_modules(moe_use_grouped_gemm) returns an experts builder "
           "(partial(SequentialMLP, submodules=...)), not (module, submodules); the legacy GroupedMLP "
           "and the moe_use_legacy_grouped_gemm argument are gone",
           old=("megatron.core.transformer.moe.experts:GroupedMLP",),
           new=("megatron.core.transformer.moe.moe_layer:ExpertsBuilder",)),
    Change("write_results_queue", "0.17",
           "dist_checkpointing's torch_dist writer takes its results queue from "
           "get_write_results_queue(mp_mode=) instead of _get_write_results_queue()",
           old=("megatron.core.dist_checkpointing.strategies.filesystem_async:_get_write_results_queue",),
           new=("megatron.core.dist_checkpointing.strategies.filesystem_async:get_write_results_queue",)),
    Change("gdn_context_parallel", "0.18",
           "megatron's GatedDeltaNet grew head-wise context parallelism and its methods "
           "(sharded_state_dict, the CP all-to-alls) read cp_size, tp_group, the per-TP-rank dims "
           "and the in_proj split tables that its constructor sets; a constructor of ours sets them too",
           old=(),
           new=("megatron.core.ssm.gated_delta_net:tensor_a2a_cp2hp",)),
    Change("attention_name_kwarg", "0.18",
           "TransformerLayer passes name= (and cp_comm_type=) to the self-attention module it builds, "
           "a Gated DeltaNet included",
           old=(), new=()),
    Change("cuda_graph_modules", "0.18",
           "TransformerConfig.cuda_graph_scope is renamed cuda_graph_modules (the old name warns as "
           "deprecated); both default to 'full', which megatron's own __post_init__ warns is deprecated "
           "in favour of the empty list, meaning the same (the whole layer): the facade passes [] under "
           "the release's name (cuda_graph_fields)",
           old=("megatron.core.transformer.transformer_config:TransformerConfig.cuda_graph_scope",),
           new=("megatron.core.transformer.transformer_config:TransformerConfig.cuda_graph_modules",)),
    Change("mla_latent_norms", "0.19",
           "multi-latent attention refuses q/kv latent norms in the spec when config.qk_layernorm is "
           "False (DeepSeek-V3 has them always: the facade sets qk_layernorm for MLA)",
           old=(), new=()),
    Change("gpt_model_deprecated", "0.19",
           "GPTModel's constructor logs 'GPTModel IS DEPRECATED' (HybridModel is megatron's successor) "
           "on every build; the facade's models are GPTModels, built for its users, so spec.build_chunks "
           "drops that one record (moving to HybridModel is the facade's to do, not its users')",
           old=(), new=()),
    Change("router_replay_static_buffer", "0.19",
           "moe/router_replay.py's RouterReplay gains static buffers for CUDA graphs (set_static_buffer, "
           "set_global_static_buffers: record_indices copies into one when set) and a layer_number that "
           "the router sets; the actions (RECORD / REPLAY_FORWARD / REPLAY_BACKWARD), get_replay_topk "
           "and the per-instance methods the facade drives (training/router_replay.py) are the same in "
           "0.16.1 and 0.19.2 (compared there; the release between that brought it is not pinned down)",
           old=("megatron.core.transformer.moe.router_replay:RouterReplay.get_replay_topk",),
           new=("megatron.core.transformer.moe.router_replay:RouterReplay.set_static_buffer",)),
    Change("topk_unsorted_without_grad", "0.19",
           "topk_routing_with_score_function's top-k is torch.topk(sorted=torch.is_grad_enabled()): "
           "without grad (forward_only) a token's k ids come in no particular order, so the ids the "
           "facade records are sorted by descending gate weight itself (layers.router.routed_ids)",
           old=(), new=()),
    Change("common_state_in_checkpoint", "0.19",
           "torch_dist no longer writes common.pt: the common state is inside the checkpoint and read "
           "with load_common_state_dict",
           old=(),
           new=("megatron.core.dist_checkpointing.serialization:load_common_state_dict",)),
)}


def cuda_graph_fields() -> dict:
    """The ``TransformerConfig`` keyword that leaves CUDA graphs capturing the whole layer, as
    megatron's default ``'full'`` does, without megatron's warning that ``'full'`` is deprecated
    (``cuda_graph_modules`` from 0.18, ``cuda_graph_scope`` before)."""
    return {"cuda_graph_modules" if CHANGES["cuda_graph_modules"].active else "cuda_graph_scope": []}


def resolve(name: str):
    """The object a dotted ``module:attribute.path`` names (AttributeError / ImportError if none)."""
    module, _, attrs = name.partition(":")
    obj = importlib.import_module(module)
    for a in attrs.split(".") if attrs else ():
        obj = getattr(obj, a)
    return obj


def missing() -> list:
    """``[(change key, dotted name)]`` of the names the installed release lacks (empty when every
    change is handled as this release needs)."""
    out = []
    for change in CHANGES.values():
        for name in change.names():
            try:
                resolve(name)
            except (AttributeError, ImportError):
                out.append((change.key, name))
    return out


# ---- layer specs: ModuleSpec or builder ------------------------------------------------------------

def built_class(spec) -> Optional[type]:
    """The class a layer-spec entry builds: a ``ModuleSpec``'s module, a ``functools.partial`` of a
    class, or the class of a partial of one of its classmethods (``MLP.as_mlp_submodule``); a bare
    class is itself. None for anything else."""
    if isinstance(spec, functools.partial):
        fn = spec.func
        if isinstance(fn, type):
            return fn
        owner = getattr(fn, "__self__", None)
        return owner if isinstance(owner, type) else None
    if isinstance(spec, type):
        return spec
    module = getattr(spec, "module", None)
    return module if isinstance(module, type) else None


def with_class(spec, cls: type):
    """A copy of the layer-spec entry ``spec`` that builds ``cls`` (a subclass of what it built)
    the same way: same submodules, params and keywords."""
    import copy
    if isinstance(spec, functools.partial):
        fn = spec.func
        fn = cls if isinstance(fn, type) else getattr(cls, fn.__name__)
        return functools.partial(fn, *spec.args, **spec.keywords)
    if isinstance(spec, type):
        return cls
    spec = copy.copy(spec)
    spec.module = cls
    return spec


def submodules_of(spec):
    """The submodules a layer-spec entry passes (a ``ModuleSpec``'s, or a partial's ``submodules=``)."""
    if isinstance(spec, functools.partial):
        return spec.keywords.get("submodules")
    return getattr(spec, "submodules", None)


def grouped_mlp_modules(provider, moe_use_grouped_gemm: bool):
    """megatron's local provider's experts entry in the installed release's form: ``(module,
    submodules)`` before 0.17, a builder from it."""
    from megatron.core.models import backends
    if CHANGES["experts_builder"].active:
        return backends.LocalSpecProvider.grouped_mlp_modules(provider, moe_use_grouped_gemm)
    return backends.LocalSpecProvider.grouped_mlp_modules(provider, moe_use_grouped_gemm, False)


def dense_mlp_spec(backend, cls: type):
    """The dense-MLP entry of a layer spec building ``cls`` (an ``MLP`` subclass) with ``backend``'s
    linears, as the installed TransformerLayer takes it."""
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
    return with_class(get_mlp_module_spec_for_backend(backend=backend, num_experts=None,
                                                      moe_grouped_gemm=False), cls)
