"""The Megatron target of twinkle_patches: swap twinkle_kernels into megatron-core models built by
other code (for models built by twinkle_megatron, prefer the build-time specs of
``twinkle_megatron.spec``, which change no global).

    from twinkle_patches import megatron as tpm
    report = tpm.apply()          # swaps module-level functions megatron-core calls at run time
    print(report)                 # swapped / skipped, with the impl, backend and every alias
    tpm.revert(report)            # the original objects back, everywhere they were

Targets (each swapped in its defining module and in every ``megatron.core`` module that imported
the same object, since megatron modules bind these with ``from ... import``):

- ``apply_rotary_pos_emb`` (``models.common.embeddings.rope_utils``; called by attention for
  ``[S, B, H, D]`` q and k): unpacked, non-interleaved, non-MLA calls run on
  ``tk.apply_rotary_pos_emb``; anything else calls the original.
- ``bias_swiglu_impl`` (``fusions.fused_bias_swiglu``; the MLP's fused gated SiLU when
  ``bias_activation_fusion`` is on): ``tk.swiglu_packed`` (bias added first).

Importing this module patches nothing and reads no environment variable.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from twinkle_kernels.patching import Patcher

from ._report import PatchReport, Skipped, Swapped


@dataclass(frozen=True)
class Target:
    name: str          # e.g. "megatron.core.models.common.embeddings.rope_utils.apply_rotary_pos_emb"
    op: str            # the twinkle_kernels op that serves it
    make: Callable     # original -> replacement


# The report types are twinkle_patches' own; this name is kept for callers that annotate with it.
MegatronPatchReport = PatchReport


# ---- replacements ------------------------------------------------------------------------------

def _rope(original, backend):
    import torch
    import twinkle_kernels as tk

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        if (cu_seqlens is not None or t.dim() != 4 or config.rotary_interleaved
                or config.multi_latent_attention or config.apply_rope_fusion
                or getattr(config, "mrope_section", None) or freqs.dim() != 4
                or freqs.shape[1] != 1 or freqs.shape[2] != 1):
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
        f = freqs[: t.shape[0]].reshape(t.shape[0], 1, freqs.shape[-1])   # [S, 1, R]
        cos = (torch.cos(f) * mscale).to(t.dtype)
        sin = (torch.sin(f) * mscale).to(t.dtype)
        # The op rotates q and k together; megatron calls once per tensor, so k has no heads.
        out, _ = tk.apply_rotary_pos_emb(t, t[:, :, :0], cos, sin, unsqueeze_dim=2, backend=backend)
        return out

    apply_rotary_pos_emb.__wrapped__ = original
    return apply_rotary_pos_emb


def _bias_swiglu(original, backend):
    import twinkle_kernels as tk

    def bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
        x = input if bias is None else input + bias
        return tk.swiglu_packed(x, backend=backend)

    bias_swiglu_impl.__wrapped__ = original
    return bias_swiglu_impl


TARGETS = (
    Target("megatron.core.models.common.embeddings.rope_utils.apply_rotary_pos_emb",
           "apply_rotary_pos_emb", _rope),
    Target("megatron.core.fusions.fused_bias_swiglu.bias_swiglu_impl", "swiglu_packed", _bias_swiglu),
)

# Modules known to bind the targets by name; imported so the swap reaches them (others that are
# already imported are found by scanning sys.modules).
_USERS = ("megatron.core.transformer.attention", "megatron.core.transformer.mlp")

_ACTIVE: Dict[str, PatchReport] = {}


def _backend_reason(op: str, backend: Optional[str]) -> Optional[str]:
    from twinkle_kernels import registry
    if backend is None:
        return None
    impls = registry.registered_ops().get(op)
    if impls is None or backend not in impls.impls:
        return f"op unavailable: no {backend} implementation of {op}"
    why = registry.backend_status(backend)
    return f"backend {backend} unavailable: {why}" if why else None


def apply(ops: Optional[Tuple[str, ...]] = None, *, backend: Optional[str] = None) -> PatchReport:
    """Swap the targets (all, or those whose op is in ``ops``) in megatron-core. ``backend``: force a
    twinkle_kernels backend (default: per call, by device). Applying an already-swapped target
    skips it (reported). Returns the report; :func:`revert` undoes exactly this call."""
    report = PatchReport(device="any", backend=backend or "auto", target="megatron")
    known = {t.op for t in TARGETS}
    if ops is not None:
        bad = sorted(set(ops) - known)
        if bad:
            raise ValueError(f"ops: unknown {bad}; the Megatron target has {sorted(known)}")
    for t in TARGETS:
        if ops is not None and t.op not in ops:
            report.skipped.append(Skipped(t, f"not selected (ops={tuple(ops)})"))
            continue
        if t.name in _ACTIVE:
            report.skipped.append(Skipped(t, "already swapped by an earlier apply()"))
            continue
        mod_name, attr = t.name.rsplit(".", 1)
        try:
            module = importlib.import_module(mod_name)
            original = getattr(module, attr)
            for user in _USERS:
                importlib.import_module(user)
        except (ImportError, AttributeError) as e:
            report.skipped.append(Skipped(t, f"megatron-core has no {t.name} ({type(e).__name__}: {e})"))
            continue
        why = _backend_reason(t.op, backend)
        if why:
            report.skipped.append(Skipped(t, why))
            continue
        replacement = t.make(original, backend)
        swaps = Patcher()
        # megatron modules bind these with ``from ... import`` (sometimes under another name)
        found = swaps.replace_everywhere(original, replacement, package="megatron")
        aliases = sorted(f"{m.__name__}.{key}" for m, key in found if not (m is module and key == attr))
        report._undo.append(_undo_target(t.name, swaps, report))
        report.swapped.append(Swapped(t, f"twinkle_kernels.{t.op}", backend or "auto", "module", aliases=tuple(aliases)))
        _ACTIVE[t.name] = report
    return report


def _undo_target(name: str, swaps: Patcher, report: PatchReport) -> Callable[[], None]:
    def undo():
        swaps.undo()
        if _ACTIVE.get(name) is report:
            del _ACTIVE[name]
    return undo


def revert(report: PatchReport) -> None:
    """Put back every object ``report``'s apply() replaced (idempotent)."""
    report._revert()


def active() -> List[str]:
    """Names of the targets swapped now."""
    return sorted(_ACTIVE)
