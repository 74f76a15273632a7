"""The report every ``apply`` of twinkle_patches returns (Hugging Face and megatron-core targets).

A *spec* here is anything with a ``name``: a :class:`~twinkle_patches.PatchSpec` for transformers,
a :class:`~twinkle_patches.megatron.Target` for megatron-core.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple


@dataclass
class Swapped:
    """One target now served by twinkle: ``where`` is "module" (the module's global, and every
    alias of it in ``sys.modules``), "registry" (a named implementation) or "instances"
    (``instances`` modules already built)."""
    spec: Any
    impl: str
    backend: str
    where: str
    instances: int = 0
    aliases: Tuple[str, ...] = ()
    # what the target runs while torch.compile traces it ("custom op twinkle::<op>" or
    # "decomposed: <the traced torch code>"); empty for registry entries
    under_compile: str = ""
    # what the module global was when it was not the plain transformers object, e.g. transformers'
    # own hub-kernel wrapper of the function (5.25); empty otherwise
    replaced: str = ""

    def __str__(self) -> str:
        extra = f" ({self.instances} instances)" if self.where == "instances" else ""
        if self.replaced:
            extra += f" (replaces {self.replaced})"
        if self.aliases:
            extra += f" (+aliases {', '.join(self.aliases)})"
        if self.under_compile:
            extra += f"; under torch.compile {self.under_compile}"
        return f"swapped  {self.spec.name:<48} -> {self.impl} [backend {self.backend}] in {self.where}{extra}"


@dataclass
class Skipped:
    spec: Any
    reason: str

    def __str__(self) -> str:
        return f"skipped  {self.spec.name:<48} {self.reason}"


@dataclass
class PatchReport:
    """What one ``apply`` call did. ``swapped`` and ``skipped`` hold one entry per target
    (a target can appear in both: module patched, some instances skipped). ``target`` names a
    patch target other than transformers (``"megatron"``), shown in place of the device."""
    device: str
    backend: str
    swapped: List[Swapped] = field(default_factory=list)
    skipped: List[Skipped] = field(default_factory=list)
    reverted: bool = False
    _undo: List[Callable[[], None]] = field(default_factory=list, repr=False)
    target: Optional[str] = None

    def swapped_names(self) -> List[str]:
        return [s.spec.name for s in self.swapped]

    def under_compile(self) -> Dict[str, str]:
        """Target name -> what it runs while torch.compile traces it (see :class:`Swapped`)."""
        return {s.spec.name: s.under_compile for s in self.swapped if s.under_compile}

    def skipped_reasons(self) -> Dict[str, str]:
        return {s.spec.name: s.reason for s in self.skipped}

    def _revert(self) -> bool:
        """Run this report's undos, newest first (once). Returns False when already reverted."""
        if self.reverted:
            return False
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self.reverted = True
        return True

    def __str__(self) -> str:
        where = f"target={self.target}" if self.target else f"device={self.device}"
        head = f"twinkle_patches report: {where} backend={self.backend} " \
               f"swapped={len(self.swapped)} skipped={len(self.skipped)}" + (" (reverted)" if self.reverted else "")
        return "\n".join([head] + [str(s) for s in self.swapped] + [str(s) for s in self.skipped])
