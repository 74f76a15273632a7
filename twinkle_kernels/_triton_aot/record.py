"""Recording Triton launches: what a kernel was called with, as the compiler would see it.

Inside :func:`recording`, every launch of a ``@triton.jit`` kernel (``kernel[grid](...)``,
interpreted or compiled) is described as a :class:`Launch`: the kernel (module and name), each
argument's Triton type and specialization exactly as the installed Triton's launcher derives
them (pointer dtype and 16-byte alignment, ``i32``/``i64`` and divisibility by 16, ints equal
to 1 folded into constexprs, ``do_not_specialize`` honoured), the constexpr values, and the
launch options (``num_warps``, ``num_stages``, ...). Grid and argument values are not kept:
two calls that would hit the same compiled kernel are one launch.

``recording(execute=False)`` also skips running the kernels (the outputs stay as allocated).
That is valid for a driver whose later launches do not depend on values an earlier kernel
computed: in the ops here every launch decision (tiles, grids, chunk tables, group offsets)
is taken on the host from the inputs.

Launches are written as JSON lines (:func:`write_jsonl`) and compiled in another process
(:mod:`.compile`): with ``TRITON_INTERPRET=1`` active, the compiler's front end breaks.
"""
from __future__ import annotations

import contextlib
import inspect
import json
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Tuple

# Options a launch may pass that are compiler options, not kernel arguments.
_OPTION_KEYS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_cooperative_grid")


@dataclass
class Launch:
    """One distinct launch. ``signature``: ``[(arg, triton type)]`` in argument order, type
    ``"constexpr"`` for constexprs; ``constexprs``: ``{arg: value}`` of the kernel's declared
    constexprs (its tile configuration); ``folded``: arguments the launcher turned into constants
    (ints equal to 1, None); ``attrs``: ``{arg: spec}`` (``"D"``: divisible by 16); ``options``:
    launch options as given; ``tags``: where it was seen."""
    kernel: str
    signature: List[Tuple[str, str]]
    constexprs: Dict[str, object]
    attrs: Dict[str, str]
    options: Dict[str, object]
    folded: Dict[str, object] = field(default_factory=dict)
    tags: List[str] = field(default_factory=list)

    def key(self) -> str:
        return json.dumps([self.kernel, self.signature, sorted(self.constexprs.items()),
                           sorted(self.folded.items()), sorted(self.attrs.items()),
                           sorted(self.options.items())])

    @property
    def name(self) -> str:
        return self.kernel.rsplit(":", 1)[-1]

    def to_json(self) -> dict:
        return dict(kernel=self.kernel, signature=[list(s) for s in self.signature], constexprs=self.constexprs,
                    folded=self.folded, attrs=self.attrs, options=self.options, tags=self.tags)

    @classmethod
    def from_json(cls, d: dict) -> "Launch":
        return cls(d["kernel"], [tuple(s) for s in d["signature"]], dict(d["constexprs"]), dict(d["attrs"]),
                   dict(d["options"]), dict(d.get("folded", {})), list(d.get("tags", [])))


class Recorder:
    """The distinct launches seen while active, in first-seen order; ``tag`` labels sightings
    (the first ``MAX_TAGS`` different tags of each launch are kept)."""

    MAX_TAGS = 8

    def __init__(self, execute: bool = True, packages: Tuple[str, ...] = ()):
        self.execute = execute
        self.packages = packages
        self.tag = ""
        self._launches: Dict[str, Launch] = {}

    @property
    def launches(self) -> List[Launch]:
        return list(self._launches.values())

    def wants(self, kernel) -> bool:
        module = getattr(kernel.fn, "__module__", "") or ""
        return not self.packages or any(module == p or module.startswith(p + ".") for p in self.packages)

    def add(self, launch: Launch) -> None:
        known = self._launches.setdefault(launch.key(), launch)
        if self.tag and self.tag not in known.tags and len(known.tags) < self.MAX_TAGS:
            known.tags.append(self.tag)

    @contextlib.contextmanager
    def tagged(self, tag: str):
        prev, self.tag = self.tag, tag
        try:
            yield
        finally:
            self.tag = prev


_ACTIVE: List[Recorder] = []
_ORIGINAL_RUN: Dict[type, object] = {}


def _kernel_classes() -> List[type]:
    from triton.runtime.jit import JITFunction
    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:
        pass
    return classes


def _install() -> None:
    for cls in _kernel_classes():
        if cls in _ORIGINAL_RUN:
            continue
        original = cls.run

        def run(self, *args, grid, warmup, _original=original, **kwargs):
            if _ACTIVE and not warmup:
                rec = _ACTIVE[-1]
                if rec.wants(self):
                    rec.add(describe(self, args, kwargs))
                if not rec.execute:
                    return None
            return _original(self, *args, grid=grid, warmup=warmup, **kwargs)

        _ORIGINAL_RUN[cls] = original
        cls.run = run


def _uninstall() -> None:
    for cls, original in _ORIGINAL_RUN.items():
        cls.run = original
    _ORIGINAL_RUN.clear()


@contextlib.contextmanager
def recording(execute: bool = True, packages: Tuple[str, ...] = ()) -> Iterator[Recorder]:
    """Record every Triton launch made inside the block. Recorders nest: a launch goes to the
    innermost one only (a test that records its own, possibly deliberately broken, launches keeps
    them out of the session's recording), which also decides whether the kernel runs.
    ``packages``: record only kernels defined in these packages (default: all)."""
    rec = Recorder(execute, packages)
    if not _ACTIVE:
        _install()
    _ACTIVE.append(rec)
    try:
        yield rec
    finally:
        _ACTIVE.remove(rec)
        if not _ACTIVE:
            _uninstall()


# --- describing one launch ---------------------------------------------------------------------

_PARAMS: Dict[int, list] = {}


def _params(kernel) -> list:
    """[(name, is_constexpr, specialize, align, default)] of a jit kernel, from its Python function."""
    hit = _PARAMS.get(id(kernel))
    if hit is not None:
        return hit
    fn = kernel.fn
    opts = getattr(kernel, "kwargs", None) or {}   # InterpretedFunction keeps the jit() arguments
    names = [p.name for p in inspect.signature(fn).parameters.values()]

    def as_names(items):
        return {names[i] if isinstance(i, int) else i for i in (items or ())}
    if hasattr(kernel, "params"):                    # JITFunction
        out = [(p.name, p.is_constexpr, not p.do_not_specialize, not p.do_not_specialize_on_alignment,
                p.default) for p in kernel.params]
    else:
        no_spec = as_names(opts.get("do_not_specialize"))
        no_align = as_names(opts.get("do_not_specialize_on_alignment"))
        out = []
        for p in inspect.signature(fn).parameters.values():
            ann = p.annotation
            is_c = "constexpr" in (ann if isinstance(ann, str) else getattr(ann, "__name__", repr(ann)))
            out.append((p.name, is_c, p.name not in no_spec, p.name not in no_align, p.default))
    _PARAMS[id(kernel)] = out
    return out


def _json_value(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if hasattr(v, "value"):            # tl.constexpr wrapper
        return _json_value(v.value)
    raise TypeError(f"constexpr value {v!r} ({type(v).__name__}) cannot be recorded")


def describe(kernel, args: tuple, kwargs: dict) -> Launch:
    """The :class:`Launch` of ``kernel[grid](*args, **kwargs)`` under the installed Triton."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import native_specialize_impl

    params = _params(kernel)
    bound = dict(zip((p[0] for p in params), args))
    for name, _, _, _, default in params:
        if name not in bound:
            if name in kwargs:
                bound[name] = kwargs[name]
            elif default is not inspect.Parameter.empty:
                bound[name] = default
            else:
                raise TypeError(f"launch of {kernel.fn.__name__} is missing argument {name!r}")
    signature, constexprs, folded, attrs = [], {}, {}, {}
    for name, is_constexpr, specialize, align, _ in params:
        value = bound[name]
        if is_constexpr:
            ty, spec = "constexpr", value
            constexprs[name] = _json_value(value)
        else:
            ty, spec = native_specialize_impl(CUDABackend, value, False, specialize, align)
            if ty == "constexpr":
                folded[name] = _json_value(spec)
            elif isinstance(spec, str) and spec:
                attrs[name] = spec
        signature.append((name, ty))
    options = {k: _json_value(kwargs[k]) for k in _OPTION_KEYS if kwargs.get(k) is not None}
    fn = kernel.fn
    return Launch(f"{fn.__module__}:{fn.__qualname__}", signature, constexprs, attrs, options, folded)


# --- files -------------------------------------------------------------------------------------

def write_jsonl(path: str, launches: Iterable[Launch]) -> int:
    n = 0
    with open(path, "w") as f:
        for launch in launches:
            f.write(json.dumps(launch.to_json()) + "\n")
            n += 1
    return n


def read_jsonl(path: str) -> List[Launch]:
    with open(path) as f:
        return [Launch.from_json(json.loads(line)) for line in f if line.strip()]


def merge(*groups: Iterable[Launch]) -> List[Launch]:
    """Distinct launches of all groups (first-seen order), their tags united."""
    out: Dict[str, Launch] = {}
    for group in groups:
        for launch in group:
            known = out.setdefault(launch.key(), Launch.from_json(launch.to_json()))
            if known is not launch:
                known.tags.extend(t for t in launch.tags if t not in known.tags)
    return list(out.values())


def pointer_dtypes(launch: Launch) -> str:
    """The element types of a launch's pointer arguments, e.g. ``"bf16,fp32"`` (for reports)."""
    seen: List[str] = []
    for _, ty in launch.signature:
        if ty.startswith("*") and ty[1:] not in seen:
            seen.append(ty[1:])
    return ",".join(seen)


def tile(launch: Launch) -> str:
    """The declared constexprs, e.g. ``HAS_GATE=0 BLOCK_M=8 BLOCK_N=256`` (warps and stages are
    reported from the compiled kernel)."""
    return " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in launch.constexprs.items())
