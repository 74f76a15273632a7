"""Applying and reverting patches; the report.

State lives in this module: ``_ACTIVE`` maps each patched target (``module.name``) to what is
needed to undo it, so applying twice is a no-op and revert restores the very objects that were
there. Nothing happens at import time; environment toggles are read inside :func:`apply`.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import os
import types
import weakref
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from twinkle_kernels.patching import Patcher

from . import _attention, _impls
from ._report import PatchReport, Skipped, Swapped
from ._specs import (COMPILE_DECOMPOSITIONS, DEFAULT_UNDER_COMPILE, FAMILIES, OP_TOGGLES, OPT_IN_OPS, SPECS, PatchSpec,
                     normalize_family, normalize_ops, normalize_under_compile)

_OFF = ("0", "false", "off", "no")


@dataclass
class _Active:
    spec: PatchSpec
    original: object
    patched: object
    swaps: Patcher
    report: PatchReport
    instances: "weakref.WeakSet" = field(default_factory=weakref.WeakSet)


_ACTIVE: Dict[str, _Active] = {}
_REPORTS: List[PatchReport] = []
# (original, spec name, backend, shown backend, decompose) -> the replacement made for it. Patching
# again after a revert swaps in the very same class / function, so torch.compile's guards (on the
# module's class and the globals' identity) still hold and nothing recompiles.
_MADE: Dict[tuple, object] = {}


# -- environment -------------------------------------------------------------------------------

def _flag(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in _OFF


def _toggle_reason(spec: PatchSpec, device: str) -> Optional[str]:
    if not _flag("TWINKLE_PATCH"):
        return "disabled by toggle TWINKLE_PATCH=0"
    if device != "npu":  # the Ascend toggles only govern the NPU device
        return None
    for name in ("TWINKLE_NPU_PATCH", OP_TOGGLES[spec.op]):
        if not _flag(name):
            return f"disabled by toggle {name}={os.environ.get(name)}"
    return None


def _detect_device(model, device) -> str:
    if isinstance(device, str):  # torch.device("npu") needs torch_npu: parse the string instead
        return device.split(":", 1)[0].strip().lower()
    if device is not None:
        return torch.device(device).type
    if model is not None:
        for p in model.parameters():
            return p.device.type
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    npu = getattr(torch, "npu", None)  # present only once torch_npu was imported by the user
    if npu is not None and npu.is_available():
        return "npu"
    return "cpu"


def _backend_reason(op: str, backend: Optional[str], device: str) -> Tuple[Optional[str], str]:
    """(why the op cannot run here, the backend name to report)."""
    from twinkle_kernels import registry

    impls = registry.registered_ops().get(op)
    if backend is None:
        chosen = "reference"
        if impls is not None:
            for name in registry.default_order(types.SimpleNamespace(type=device)):
                if name in impls.impls and registry.backend_status(name) is None:
                    chosen = name
                    break
        return None, f"auto:{chosen}"
    if impls is None or backend not in impls.impls:
        return f"op unavailable on this device: no {backend} implementation of {op}", backend
    why = registry.backend_status(backend)
    if why is None and backend == "triton" and device != "cuda" and not registry.triton_interpret():
        why = f"triton needs a CUDA device (device is {device}; CPU only with TRITON_INTERPRET=1)"
    if why is not None:
        return f"op unavailable on this device: {backend}: {why}", backend
    return None, backend


# -- patching primitives ---------------------------------------------------------------------------

# transformers' hub-kernel function wrappers. From 5.25 its modeling code decorates module-global
# functions (apply_rotary_pos_emb, the Gated DeltaNet and conv1d functions) with
# ``transformers.integrations.hub_kernels.use_kernel_forward_from_hub`` (the ``kernels`` package's
# decorator, a hard dependency there), which turns each function into an instance of an ``nn.Module``
# class made for it (``_create_func_module.<locals>.Func``) whose ``forward`` calls the function,
# unless the user selected a hub kernel (``kernelize`` / ``use_kernels=True``). The global is then
# that instance: not a foreign patch, transformers' own. The wrapper exposes no attribute holding the
# function (only ``kernel_layer_name``, ``can_torch_compile``, ``has_backward``); its ``forward`` keeps
# it in a closure cell. Which cell, and which ``forward`` code marks a wrapper, is learnt once by
# letting transformers' decorator wrap a probe function (no guess at names or files): a global whose
# class's ``forward`` is that same code object, and whose cell holds a function of this modeling
# module under the target's name, is transformers' wrapper. A user's own wrapper object, a Liger-style
# replacement function or a wrapper of another function all fail that test and stay foreign.
_HUB_LAYOUT: list = []  # [(forward code object, closure cell index) | None], filled on first use


def _hub_wrapper_layout():
    if not _HUB_LAYOUT:
        layout = None
        try:
            from transformers.integrations import hub_kernels
            decorate = hub_kernels.use_kernel_forward_from_hub
        except (ImportError, AttributeError):  # an older transformers: no such wrappers
            decorate = None
        if decorate is not None:
            def twinkle_probe(x):
                return x
            # only sets kernel_layer_name / kernel_condition on the class it makes; registers nothing
            made = decorate("twinkle_patches_probe")(twinkle_probe)
            fwd = getattr(type(made), "forward", None)
            cells = getattr(fwd, "__closure__", None) or ()
            where = [i for i, c in enumerate(cells) if c.cell_contents is twinkle_probe]
            if made is not twinkle_probe and isinstance(made, torch.nn.Module) and len(where) == 1:
                layout = (fwd.__code__, where[0])
        _HUB_LAYOUT.append(layout)
    return _HUB_LAYOUT[0]


def _hub_wrapped(spec: PatchSpec, cur, modname: str):
    """The transformers function inside ``cur`` when ``cur`` is transformers' own hub-kernel wrapper
    of ``modname.<spec.target>`` (see above), else None."""
    if spec.kind != "function" or not isinstance(cur, torch.nn.Module):
        return None
    layout = _hub_wrapper_layout()
    fwd = getattr(type(cur), "forward", None)
    if layout is None or getattr(fwd, "__code__", None) is not layout[0]:
        return None
    held = fwd.__closure__[layout[1]].cell_contents
    if not isinstance(held, types.FunctionType) or held.__module__ != modname or held.__name__ != spec.target:
        return None
    return held


def _hub_wrapper_reason(spec: PatchSpec, cur, modname: str) -> Optional[str]:
    """Why transformers' wrapper ``cur`` is left alone: the user put something on it."""
    if "forward" in vars(cur):
        return (f"a hub kernel is selected for {modname}.{spec.target} (its transformers hub-kernel wrapper has a "
                "forward of its own, as kernels.kernelize sets): left as is")
    hooks = [h for h in ("_forward_hooks", "_forward_pre_hooks") if getattr(cur, h, None)]
    if hooks:
        return f"hooks on transformers' hub-kernel wrapper of {modname}.{spec.target} ({', '.join(hooks)}): left as is"
    return None


def _model_hub_kernel_reason(spec: PatchSpec, cur, model) -> Optional[str]:
    """A model whose layers selected a hub kernel for the function (``kernels.kernelize``, transformers'
    ``use_kernels=True``): each such layer holds a private copy of the wrapper (same class as the
    global) in ``_kernel_funcs``, with the kernel bound as its ``forward``. The global wrapper routes
    the layer's calls there; swapping the global would silently drop the user's kernel."""
    if model is None:
        return None
    for m in model.modules():
        for w in (vars(m).get("_kernel_funcs") or {}).values():
            if type(w) is type(cur) and "forward" in vars(w):
                return (f"{type(m).__name__} of the model runs a hub kernel for {spec.target} (selected with "
                        "kernels.kernelize / use_kernels=True): left as is")
    return None


def _foreign_reason(spec: PatchSpec, cur, modname: str) -> Optional[str]:
    """The target was replaced by some other library (Liger-Kernel swaps module globals and classes)."""
    owner = getattr(cur, "__module__", "") or ""
    if getattr(cur, "__name__", None) != spec.target or not owner.startswith("transformers."):
        return f"already patched by another library: {modname}.{spec.target} is {owner}.{getattr(cur, '__qualname__', cur)}"
    if spec.kind != "function":
        fwd = getattr(cur, "forward", None)
        fowner = getattr(fwd, "__module__", "") or ""
        if not fowner.startswith("transformers."):
            return f"already patched by another library: {spec.target}.forward comes from {fowner}"
    return None


def _make_class(orig: type, forward, spec: PatchSpec, backend: str) -> type:
    orig_init = orig.__init__
    made: list = []

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        active = _ACTIVE.get(spec.qualname)
        if active is not None and active.patched is made[0]:
            active.instances.add(self)  # built while patched: revert moves it back

    # Same name and module as the original: transformers' heuristics and reprs look at class names.
    ns = {"forward": forward, "__init__": __init__, "__module__": orig.__module__, "__qualname__": orig.__qualname__,
          "__doc__": orig.__doc__, "_twinkle_original": orig, "_twinkle_spec": spec.name, "_twinkle_backend": backend}
    made.append(type(orig.__name__, (orig,), ns))
    return made[0]


def _replacement(spec: PatchSpec, cur, backend: Optional[str], shown: str, impl, decompose, inner=None):
    """The patched class or function for ``cur``: made once per original and options (see _MADE).
    ``decompose``: False, True or n (decompose calls of fewer than n tokens per sequence);
    ``inner``: the function inside transformers' hub-kernel wrapper ``cur`` (the replacement's
    original: its signature, name and fallback), None when ``cur`` is the function itself."""
    key = (cur, spec.name, backend, shown, decompose)
    new = _MADE.get(key)
    if new is None:
        orig = cur if inner is None else inner
        fn = impl.make(orig, backend, decompose=decompose) if decompose else impl.make(orig, backend)
        if spec.kind == "function":
            new = fn
            new._twinkle_spec = spec.name
            new._twinkle_backend = shown
        else:
            new = _make_class(cur, fn, spec, shown)
        new._twinkle_under_compile = _compiled_label(spec, decompose)
        _MADE[key] = new
    return new


def _compiled_label(spec: PatchSpec, decompose) -> str:
    if decompose is not True and decompose:
        return (f"decomposed below {decompose} tokens per sequence: {COMPILE_DECOMPOSITIONS[spec.op]}; "
                f"custom op twinkle::{spec.op} from {decompose}")
    if decompose:
        return f"decomposed: {COMPILE_DECOMPOSITIONS[spec.op]}"
    return f"custom op twinkle::{spec.op}"


def _patch_module(spec: PatchSpec, mod, cur, backend: Optional[str], shown: str, impl,
                  report: PatchReport, decompose=False, inner=None) -> _Active:
    new = _replacement(spec, cur, backend, shown, impl, decompose, inner)
    swaps = Patcher()
    # the defining module and every module that imported the object by name (as MindSpeed's
    # patcher handles them)
    aliases = swaps.replace_everywhere(cur, new, name=spec.target, home=mod)
    active = _Active(spec, cur, new, swaps, report)
    _ACTIVE[spec.qualname] = active

    def undo():
        # also modules imported while patched; a global replaced on top of ours stays
        active.swaps.undo(only_if_unchanged=True)
        for inst in list(active.instances):
            if type(inst) is active.patched:
                inst.__class__ = active.original
        _ACTIVE.pop(spec.qualname, None)

    report._undo.append(undo)
    report.swapped.append(Swapped(spec, _impl_name(spec), shown, "module",
                                  aliases=tuple(getattr(m, "__name__", "?") for m, _ in aliases[1:]),
                                  under_compile=new._twinkle_under_compile,
                                  replaced=_HUB_REPLACED if inner is not None else ""))
    return active


_HUB_REPLACED = "transformers' hub-kernel wrapper (kernels Func; revert puts it back)"


def _impl_name(spec: PatchSpec) -> str:
    return f"twinkle_kernels.{spec.op}"


def _patch_instances(spec: PatchSpec, model, active: _Active, impl, report: PatchReport) -> None:
    orig, new = active.original, active.patched
    done: List["weakref.ref"] = []
    foreign = 0
    unfit: Dict[str, int] = {}
    for m in model.modules():
        t = type(m)
        if t is not orig:
            continue
        if "forward" in vars(m):
            foreign += 1
            continue
        why = impl.instance_reason(m)
        if why is not None:
            unfit[why] = unfit.get(why, 0) + 1
            continue
        m.__class__ = new
        active.instances.add(m)
        done.append(weakref.ref(m))
    if foreign:
        report.skipped.append(Skipped(spec, f"{foreign} instance(s) already patched by another library: "
                                            "forward bound on the instance (module.__dict__['forward'], as "
                                            "Liger-Kernel does)"))
    for why, n in unfit.items():
        report.skipped.append(Skipped(spec, f"{n} instance(s) do not fit: {why}"))
    if done:
        def undo():
            for r in done:
                m = r()
                if m is not None and type(m) is new:
                    m.__class__ = orig
        report._undo.append(undo)
        report.swapped.append(Swapped(spec, _impl_name(spec), getattr(new, "_twinkle_backend", report.backend),
                                      "instances", instances=len(done),
                                      under_compile=getattr(new, "_twinkle_under_compile", "")))


def _family_base(mod) -> Optional[type]:
    """The family's ``*PreTrainedModel`` class (every model class of the family derives from it)."""
    from transformers import PreTrainedModel
    for name, obj in vars(mod).items():
        if (name.endswith("PreTrainedModel") and isinstance(obj, type) and issubclass(obj, PreTrainedModel)
                and obj.__module__ == mod.__name__):
            return obj
    return None


def _default_experts(spec: PatchSpec, mod, active: _Active, report: PatchReport) -> None:
    """Models of the family built while patched, without ``experts_implementation=``, select "twinkle"
    (transformers would pick "grouped_mm"); any explicit choice stays transformers' own."""
    base = _family_base(mod)
    if base is None or not hasattr(base, "get_correct_experts_implementation"):
        report.skipped.append(Skipped(spec, "models built later keep transformers' default experts "
                                            "implementation: no *PreTrainedModel.get_correct_experts_implementation "
                                            "to extend (select experts_implementation='twinkle' by hand)"))
        return
    active.swaps.setattr(base, "get_correct_experts_implementation", _impls.default_to_twinkle(base))
    report._undo.append(lambda: _impls.restore_selected())  # before "twinkle" leaves the registry


def _select_experts(spec: PatchSpec, model, report: PatchReport) -> None:
    """A model given to ``apply`` on transformers' default experts implementation switches to
    "twinkle"; ``eager``/``batched_mm``/... chosen by the user are kept (and reported)."""
    configs = []
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if type(m).__name__ == spec.target and cfg is not None and all(c is not cfg for c in configs):
            configs.append(cfg)
    switched = 0
    for cfg in configs:
        cur = getattr(cfg, "_experts_implementation", None)
        if cur == _impls.EXPERTS_NAME:
            continue
        if cur not in _impls.DEFAULT_EXPERTS:
            report.skipped.append(Skipped(spec, f"model's experts_implementation is {cur!r} (chosen by the user), "
                                                f"left as is; set_experts_implementation({_impls.EXPERTS_NAME!r}) "
                                                "selects the twinkle kernel"))
            continue
        _impls.select(cfg, cur)
        cfg._experts_implementation_internal = _impls.EXPERTS_NAME
        ref = weakref.ref(cfg)

        def undo(ref=ref):
            c = ref()
            if c is not None:
                _impls.restore_selected(c)
        report._undo.append(undo)
        switched += 1
    if switched:
        report.swapped.append(Swapped(spec, f"experts_implementation -> {_impls.EXPERTS_NAME!r}",
                                      report.backend, "config", instances=switched))


_ATTN_KEY = "attention:" + _attention.NAME
_ATTN_COMPILED = "traced: torch sdpa with the packing mask (no custom op)"
_ATTN_IMPL = "packing-aware sdpa and eager (twinkle_patches._attention)"


def _apply_attention_name(spec: PatchSpec, report: PatchReport) -> None:
    """Registers :data:`_attention.NAME` for models that ask for it by name."""
    if _ACTIVE.get(_ATTN_KEY) is not None:
        report.skipped.append(Skipped(spec, "already patched by twinkle_patches (no-op)"))
        return
    unregister = _attention.register()
    if unregister is None:
        report.skipped.append(Skipped(spec, f"attn_implementation {_attention.NAME!r} is registered already, "
                                            "not by twinkle_patches.apply: left as is"))
        return
    _ACTIVE[_ATTN_KEY] = _Active(spec, None, _attention.packed_sdpa_attention_forward, Patcher(), report)

    def undo():
        unregister()
        _ACTIVE.pop(_ATTN_KEY, None)
    report._undo.append(undo)
    report.swapped.append(Swapped(spec, f"AttentionInterface[{_attention.NAME!r}]", "torch sdpa", "registry",
                                  under_compile=_ATTN_COMPILED))


def _apply_attention(spec: PatchSpec, mod, model, report: PatchReport) -> None:
    """Gives the family's modeling module its own attention interface whose ``sdpa`` and ``eager`` are
    packing-aware (:func:`_attention.family_interface`). Models keep ``config._attn_implementation``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    cur = vars(mod).get(spec.target)
    active = _ACTIVE.get(spec.qualname)
    if active is not None:
        why = ("already patched by twinkle_patches (no-op)" if active.patched is cur else
               f"already patched by another library on top of twinkle: {spec.qualname} was replaced after "
               "twinkle_patches.apply")
        report.skipped.append(Skipped(spec, why))
    elif cur is None:
        import transformers
        report.skipped.append(Skipped(spec, f"target missing: {spec.qualname} does not exist in transformers "
                                            f"{transformers.__version__}"))
    elif cur is not ALL_ATTENTION_FUNCTIONS:
        report.skipped.append(Skipped(spec, f"already patched by another library: {spec.qualname} is not "
                                            "transformers' global AttentionInterface"))
    else:
        eager = vars(mod).get("eager_attention_forward")
        if eager is None:
            from transformers.models.llama.modeling_llama import eager_attention_forward as eager
        new = _attention.family_interface(cur, eager)
        swaps = Patcher()
        swaps.setattr(mod, spec.target, new)
        _ACTIVE[spec.qualname] = _Active(spec, cur, new, swaps, report)

        def undo():
            swaps.undo(only_if_unchanged=True)
            _ACTIVE.pop(spec.qualname, None)
        report._undo.append(undo)
        report.swapped.append(Swapped(spec, _ATTN_IMPL, "torch sdpa", "module", under_compile=_ATTN_COMPILED))
    if model is None or spec.family not in _families_in(model):
        return
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl is not None and impl not in ("sdpa", "eager", _attention.NAME):
        report.skipped.append(Skipped(spec, f"model's attn_implementation is {impl!r}: it runs as is (the packing-"
                                            "aware implementations are sdpa, eager and twinkle_packed)"))


def _families_in(model) -> List[str]:
    mods = {type(m).__module__ for m in model.modules()}
    return [fam for fam, f in FAMILIES.items() if f.module in mods]


# -- public ------------------------------------------------------------------------------------

def apply(model: Optional[torch.nn.Module] = None, *, ops: Optional[Iterable[str]] = None,
          families: Optional[Iterable[str]] = None, backend: Optional[str] = None,
          device: Optional[str] = None, under_compile=DEFAULT_UNDER_COMPILE) -> PatchReport:
    """Swap twinkle ops into transformers modeling modules and, when given, into ``model``.

    Args:
        model: a model already built; its matching submodules move to the patched classes
            (parameters, buffers and ``state_dict`` keys unchanged). Without ``families``, only the
            families found in the model are patched.
        ops: op names to patch (``rms_norm``, ``gated_rms_norm``, ``apply_rotary_pos_emb``, ``swiglu``,
            ``moe_experts``, ``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule``,
            ``causal_conv1d``, ``causal_conv1d_update``, ``packed_attention``, ``fused_linear_cross_entropy``;
            aliases ``rope``, ``norm``, ``experts``, ``gdn``, ``attention``, ``linear_ce``); None: all but
            ``fused_linear_cross_entropy``, which is opt-in because a fused training step returns
            ``logits=None`` (see :mod:`twinkle_patches._linear_ce`). ``packed_attention`` makes each
            family's ``sdpa`` and ``eager`` packing-aware (its modeling module's own attention
            interface; a model keeps ``config._attn_implementation``) and registers
            ``attn_implementation="twinkle_packed"`` for models that ask for it by name (see
            :mod:`twinkle_patches._attention`).
        families: family names (``llama``, ``qwen2``, ``qwen3``, ``qwen3_moe``, ``qwen3_next``, ``qwen3_5``,
            ``qwen3_5_moe``, ``mixtral``, ``glm4_moe``, ``deepseek_v3``; "Qwen3-MoE" / "qwen3.5" spellings work); None: all.
        backend: twinkle backend every patched call uses (None: each call picks by device).
        device: the device the model will run on (default: the model's, else cuda / npu / cpu);
            the Ascend toggles apply only to "npu".
        under_compile: what the patched layers run while ``torch.compile`` traces them (eager calls
            always run the twinkle ops). ``"auto"`` (default, from measurements on a CPU): the
            RMSNorm variants, RoPE and the SwiGLU MLPs trace their op's pure-torch reference, which
            inductor fuses with the matmuls and elementwise ops around it (as custom ops they made a
            compiled model about half as fast), and the experts run transformers' ``grouped_mm``
            (faster compiled than the custom op; where transformers' cannot compile, 5.17, the
            experts keep the custom op); unpacked Gated DeltaNet chunk calls of fewer than
            ``GDN_CHUNK_KERNEL_MIN_TOKENS`` (1536) tokens per sequence run transformers' torch
            chunked rule (faster there; the custom op wins on longer ones, 1.54x at 4096); conv1d,
            the packed and longer GDN calls and the fused linear CE keep their twinkle custom ops. ``"decompose_rowwise"``: the row-wise ops only (the
            experts keep their custom op). ``"kernels"``: every patched layer calls its custom op.
            ``"decompose_all"``: the unpacked Gated DeltaNet chunk and conv1d calls decompose too
            (transformers' torch code; packed calls keep the custom ops). Or the op names (aliases as in ``ops``) that decompose. The report says, per
            target, what runs under compile. A target already patched keeps the choice it was
            patched with (revert first to change it).

    Returns a :class:`PatchReport`. Applying what is already applied is a no-op (reported as skipped).
    Toggles, read now: ``TWINKLE_PATCH=0`` disables everything; on npu ``TWINKLE_NPU_PATCH``,
    ``TWINKLE_NPU_FUSED_OPS`` (norms, RoPE, SwiGLU), ``TWINKLE_NPU_MOE_PATCH`` (experts) and
    ``TWINKLE_NPU_FLA`` (Gated DeltaNet) switch groups off with 0.
    """
    from twinkle_kernels import registry

    op_sel = normalize_ops(ops) if ops is not None else None
    decomposed = normalize_under_compile(under_compile)
    if isinstance(families, str):
        families = (families,)
    fam_sel = [normalize_family(f) for f in families] if families is not None else None
    if backend is not None:
        if backend == "auto":
            backend = None
        elif backend not in registry.BACKENDS:
            raise ValueError(f"backend={backend!r} is not a backend; expected one of {registry.BACKENDS} or None")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    dev = _detect_device(model, device)
    if model is not None and fam_sel is None:
        fam_sel = _families_in(model)

    report = PatchReport(device=dev, backend=backend or "auto")
    experts_registered = False
    for spec in SPECS:
        if fam_sel is not None and spec.family not in fam_sel and not (spec.family == "all" and fam_sel):
            continue
        if op_sel is not None and spec.op not in op_sel:
            continue
        if op_sel is None and spec.op in OPT_IN_OPS:
            continue
        why = _toggle_reason(spec, dev)
        if why is None and dev not in spec.devices:
            why = f"op unavailable on this device: {spec.op} is not registered for device {dev}"
        if why is not None:
            report.skipped.append(Skipped(spec, why))
            continue
        if spec.kind == "attention_name":
            _apply_attention_name(spec, report)
            continue
        try:
            mod = importlib.import_module(spec.module)
        except ImportError as e:
            report.skipped.append(Skipped(spec, f"family not installed: {spec.module} does not import ({e})"))
            continue
        if spec.kind == "attention":
            _apply_attention(spec, mod, model, report)
            continue
        impl = _impls.IMPLS[spec.impl]
        why = impl.op_reason()
        shown_backend = backend or "auto"
        if why is None:
            why, shown_backend = _backend_reason(spec.op, backend, dev)
        if why is not None:
            report.skipped.append(Skipped(spec, why))
            continue
        cur = vars(mod).get(spec.target)
        if cur is None:
            import transformers
            report.skipped.append(Skipped(spec, f"target missing: {spec.qualname} does not exist in transformers "
                                                f"{transformers.__version__}"))
            continue
        active = _ACTIVE.get(spec.qualname)
        if active is not None and active.patched is not cur:
            report.skipped.append(Skipped(spec, f"already patched by another library on top of twinkle: "
                                                f"{spec.qualname} was replaced after twinkle_patches.apply"))
            continue
        if active is None and (hasattr(cur, "_twinkle_original") or hasattr(cur, "_twinkle_spec")):
            report.skipped.append(Skipped(spec, f"already patched by twinkle_patches as an alias of "
                                                f"{getattr(cur, '_twinkle_spec', '?')} (no-op)"))
            continue
        if active is None:
            inner = _hub_wrapped(spec, cur, mod.__name__)
            if inner is not None:  # transformers' own wrapper: its function is the target
                why = _hub_wrapper_reason(spec, cur, mod.__name__) or _model_hub_kernel_reason(spec, cur, model) \
                    or impl.target_reason(inner)
            else:
                why = _foreign_reason(spec, cur, mod.__name__) or impl.target_reason(cur)
            if why is not None:
                report.skipped.append(Skipped(spec, why))
                continue
            if spec.kind == "experts" and not experts_registered:
                try:
                    report._undo.append(_impls.register_experts())
                except Exception as e:  # the experts module's own error, reported rather than raised
                    report.skipped.append(Skipped(spec, f"op unavailable: register_hf_experts failed ({e})"))
                    continue
                experts_registered = True
            active = _patch_module(spec, mod, cur, backend, shown_backend, impl, report,
                                   decompose=decomposed.get(spec.op, False), inner=inner)
            if spec.kind == "experts":
                _default_experts(spec, mod, active, report)
            if model is not None and spec.kind != "function":
                _patch_instances(spec, model, active, impl, report)
                if spec.kind == "experts":
                    _select_experts(spec, model, report)
            continue
        # Already patched by twinkle: the module part is a no-op; instances may still need moving.
        had = getattr(active.patched, "_twinkle_under_compile", None)
        if had is not None and had != _compiled_label(spec, decomposed.get(spec.op, False)):
            report.skipped.append(Skipped(spec, f"under_compile not changed: patched earlier with {had!r} under "
                                                "torch.compile (revert first to change it)"))
        n_before = len(report.swapped)
        if model is not None and spec.kind != "function":
            _patch_instances(spec, model, active, impl, report)
            if spec.kind == "experts":
                _select_experts(spec, model, report)
        if len(report.swapped) == n_before:
            report.skipped.append(Skipped(spec, "already patched by twinkle_patches (no-op)"))
    _REPORTS.append(report)
    return report


def revert(report: Optional[PatchReport] = None) -> None:
    """Undo one report (or, with None, every report still applied, newest first).

    Module globals (and their aliases) become the original objects again; instances moved to a
    patched class, or built while it was patched, go back to the original class.
    """
    todo = list(reversed(_REPORTS)) if report is None else [report]
    for rep in todo:
        if not rep._revert():
            continue
        if rep in _REPORTS:
            _REPORTS.remove(rep)


@contextlib.contextmanager
def patched(model: Optional[torch.nn.Module] = None, **kwargs):
    """``with patched(model, ops=("rms_norm",)) as report: ...`` — apply, and revert in a finally."""
    report = apply(model, **kwargs)
    try:
        yield report
    finally:
        revert(report)


def list_patches() -> List[PatchSpec]:
    """Every registered spec (family, module, target, kind, op, devices), in registry order."""
    return list(SPECS)



@dataclass
class FamilySwaps:
    """One family's row of :func:`family_swaps`: target names, in registry order."""
    swapped: Tuple[str, ...]
    skipped: Dict[str, str]           # target -> the reason
    hub_wrappers: Tuple[str, ...]     # swapped targets that were transformers' hub-kernel wrappers


def family_swaps(device: Optional[str] = "cpu") -> Dict[str, FamilySwaps]:
    """Which targets of each registered family ``apply`` swaps on the installed transformers,
    every op included (the opt-in fused linear CE too), module globals only (no model, so the
    per-instance checks are not made).

    Each family is applied and reverted in turn, so call it with nothing applied (a target applied
    already reads "already patched by twinkle_patches"). ``python -m twinkle_kernels`` prints it.
    """
    out: Dict[str, FamilySwaps] = {}
    for fam in FAMILIES:
        report = apply(families=[fam], ops=OP_TOGGLES, device=device)
        try:
            order = [sp.target for sp in SPECS if sp.family == fam]
            done = {s.spec.target for s in report.swapped if s.spec.family == fam}
            why = {s.spec.target: s.reason for s in reversed(report.skipped)
                   if s.spec.family == fam and s.spec.target not in done}
            hub = {s.spec.target for s in report.swapped if s.spec.family == fam and s.replaced}
            out[fam] = FamilySwaps(tuple(t for t in order if t in done), {t: why[t] for t in order if t in why},
                                   tuple(t for t in order if t in hub))
        finally:
            revert(report)
    return out
