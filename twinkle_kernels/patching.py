"""The one patching mechanism: swap attributes (and registry entries) and undo the swaps exactly.

Every place that changes other people's objects — ``twinkle_patches`` (Hugging Face and
megatron-core targets, the attention and experts registries) and ``twinkle_megatron.parallel.cpu_compat`` —
records its changes in a :class:`Patcher` and keeps only its own table of what to change::

    p = Patcher()
    p.replace_everywhere(original, replacement, name="apply_rotary_pos_emb", home=module)
    p.setattr(owner, "attr", value)          # recorded, also when ``attr`` did not exist
    p.setitem(registry, "name", fn)          # dict entries: registries of named implementations
    p.undo()                                 # the very objects back, in reverse order

Aliases: ``from x import f`` copies ``f`` into the importing module, so a swap of ``x.f`` alone
misses callers that captured it (MindSpeed's patch manager handles the same). :func:`aliases`
finds every module in ``sys.modules`` that holds the object; :meth:`Patcher.replace_everywhere`
swaps all of them, and :meth:`Patcher.undo` also restores modules that captured the replacement
after the swap (imported while patched).

This module imports nothing but the standard library, so every layer can use it; it is public
because the other top-level packages (``twinkle_patches``, ``twinkle_megatron``) record in it.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, List, MutableMapping, Optional, Tuple

MISSING = object()
"""The value recorded for an attribute or key that did not exist before a change."""


def _in_package(modname: str, package: Optional[str]) -> bool:
    return package is None or modname == package or modname.startswith(package + ".")


def aliases(value: Any, *, name: Optional[str] = None, package: Optional[str] = None,
            home: Optional[ModuleType] = None) -> List[Tuple[ModuleType, str]]:
    """Every ``(module, key)`` in ``sys.modules`` whose global ``key`` is ``value`` (identity).

    Args:
        name: only that global name (``from x import f as g`` is then not an alias); None: any name.
        package: only modules named ``package`` or ``package.*`` (e.g. ``"megatron.core"``).
        home: the defining module, listed first (under ``name``) whether or not it matched.
    """
    out: List[Tuple[ModuleType, str]] = []
    if home is not None:
        out.append((home, name))
    for modname, module in list(sys.modules.items()):
        if module is None or module is home or not _in_package(modname, package):
            continue
        try:
            namespace = vars(module)
        except TypeError:  # objects without a __dict__ placed in sys.modules
            continue
        if name is not None:
            if namespace.get(name, MISSING) is value:
                out.append((module, name))
            continue
        for key, held in list(namespace.items()):
            if held is value:
                out.append((module, key))
    return out


@dataclass
class _Change:
    owner: Any          # an object (setattr) or a mapping (setitem)
    key: str
    before: Any         # MISSING when it did not exist
    after: Any
    item: bool          # True: owner[key]; False: getattr(owner, key)

    def current(self) -> Any:
        if self.item:
            return self.owner.get(self.key, MISSING)
        return vars(self.owner).get(self.key, MISSING)

    def restore(self) -> None:
        if self.item:
            if self.before is MISSING:
                self.owner.pop(self.key, None)
            else:
                self.owner[self.key] = self.before
        elif self.before is MISSING:
            if self.key in vars(self.owner):
                delattr(self.owner, self.key)
        else:
            setattr(self.owner, self.key, self.before)


@dataclass
class _Sweep:
    """Undo-time search for modules that captured ``after`` once it was in place."""
    before: Any
    after: Any
    name: Optional[str]
    package: Optional[str]


class Patcher:
    """A record of changes to attributes and mapping entries, undone exactly by :meth:`undo`.

    ``bool(patcher)`` is True while it holds changes not yet undone.
    """

    def __init__(self) -> None:
        self._log: List[object] = []   # _Change and _Sweep entries, in the order made

    def __bool__(self) -> bool:
        return any(isinstance(e, _Change) for e in self._log)

    def __len__(self) -> int:
        return sum(isinstance(e, _Change) for e in self._log)

    def setattr(self, owner: Any, name: str, value: Any) -> None:
        """``setattr(owner, name, value)``, remembering what ``owner`` itself held (its ``__dict__``;
        an attribute it only inherited is deleted again on undo)."""
        self._log.append(_Change(owner, name, vars(owner).get(name, MISSING), value, item=False))
        setattr(owner, name, value)

    def setitem(self, mapping: MutableMapping, key: str, value: Any) -> None:
        """``mapping[key] = value``, remembering the previous entry (or its absence)."""
        self._log.append(_Change(mapping, key, mapping.get(key, MISSING), value, item=True))
        mapping[key] = value

    def replace_everywhere(self, original: Any, value: Any, *, name: Optional[str] = None,
                           package: Optional[str] = None,
                           home: Optional[ModuleType] = None) -> List[Tuple[ModuleType, str]]:
        """Set ``value`` in every module global that holds ``original`` (see :func:`aliases` for
        ``name``, ``package`` and ``home``). Returns the ``(module, key)`` pairs changed, ``home`` first."""
        found = aliases(original, name=name, package=package, home=home)
        for module, key in found:
            self.setattr(module, key, value)
        self._log.append(_Sweep(original, value, name, package))
        return found

    def undo(self, *, only_if_unchanged: bool = False) -> None:
        """Restore every change, newest first, then idempotently forget them.

        ``only_if_unchanged``: leave an attribute alone when something else replaced our value
        since (another library patched on top). Modules that captured a replacement after
        :meth:`replace_everywhere` get the original too.
        """
        while self._log:
            entry = self._log.pop()
            if isinstance(entry, _Sweep):
                for module, key in aliases(entry.after, name=entry.name, package=entry.package):
                    setattr(module, key, entry.before)
            elif not only_if_unchanged or entry.current() is entry.after:
                entry.restore()
