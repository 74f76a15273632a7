"""Loads the C++ CPU extension built for the best instruction set this CPU has.

``setup.py`` builds the same sources from ``csrc/`` three times: ``_C_avx512``
(``-mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma``), ``_C_avx2`` (``-mavx2 -mfma``)
and ``_C_default`` (no ISA flags). Each is a separate shared object, so inline code
compiled for AVX-512 can never be picked up by the scalar build; only the variant
chosen here is ever loaded (unless a test loads others on purpose). The choice
follows ``torch.backends.cpu.get_cpu_capability()`` (which honours
``ATEN_CPU_CAPABILITY``) and can be narrowed with ``TWINKLE_CPU_ISA``
(``avx512`` / ``avx2`` / ``default``), both read when the extension is first loaded.

``TWINKLE_CPU_EXT_DIR`` (also read at load time) loads the builds from another directory
instead of the package: the sanitizer lane (``.ci/sanitize``) builds an ASan/UBSan
instrumented extension into a directory of its own and points this at it, so the normal
in-place build is never touched. A variant missing there is reported missing (no fallback
to the package's build, which would silently test the uninstrumented code).

Ops live in ``torch.ops.twinkle_<isa>``; :func:`ops` returns that namespace.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from typing import Optional

import torch

VARIANTS = ("avx512", "avx2", "default")

_loaded = {}
_origins = {}
_errors = {}
EXT_DIR_VAR = "TWINKLE_CPU_EXT_DIR"
_chosen: Optional[str] = None


def cpu_supports() -> tuple:
    """Variants this CPU can execute, best first."""
    cap = torch.backends.cpu.get_cpu_capability().lower()  # "avx512", "avx2", "default", ...
    flags = _cpuinfo_flags()
    out = []
    if cap == "avx512" and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        out.append("avx512")
    if cap in ("avx512", "avx2") and {"avx2", "fma"} <= flags:
        out.append("avx2")
    out.append("default")
    return tuple(out)


def _cpuinfo_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    # No /proc (macOS, Windows): trust torch's own detection for x86 variants.
    cap = torch.backends.cpu.get_cpu_capability().lower()
    return {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"} if cap == "avx512" else (
        {"avx2", "fma"} if cap == "avx2" else set())


def load(variant: str):
    """Import the extension built for ``variant``; returns the torch.ops namespace or raises."""
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}; expected one of {VARIANTS}")
    if variant not in _loaded:
        if variant not in cpu_supports():
            raise RuntimeError(f"this CPU cannot run the {variant} build (supports {cpu_supports()})")
        _origins[variant] = _import(variant).__file__
        _loaded[variant] = getattr(torch.ops, f"twinkle_{variant}")
    return _loaded[variant]


def _import(variant: str):
    name = f"twinkle_kernels._C_{variant}"
    ext_dir = os.environ.get(EXT_DIR_VAR, "").strip()
    if not ext_dir:
        return importlib.import_module(name)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(ext_dir, f"_C_{variant}{suffix}")
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules[name] = module
            return module
    raise ImportError(f"{EXT_DIR_VAR}={ext_dir}: no _C_{variant} build in that directory")


def loaded_from(variant: Optional[str] = None) -> Optional[str]:
    """The file the ``variant`` build (default: the chosen one) was loaded from, or None."""
    v = variant or chosen_variant()
    return _origins.get(v) if v else None


def chosen_variant() -> Optional[str]:
    """The variant the cpu backend uses, or None when no build can be loaded."""
    global _chosen
    if _chosen is None and not _errors:
        forced = os.environ.get("TWINKLE_CPU_ISA", "").strip().lower()
        order = cpu_supports()
        if forced:
            if forced not in VARIANTS:
                raise ValueError(f"TWINKLE_CPU_ISA={forced!r}; expected one of {VARIANTS}")
            order = tuple(v for v in order if VARIANTS.index(v) >= VARIANTS.index(forced))
        for v in order:
            try:
                load(v)
            except Exception as e:  # not built, or built for another torch
                _errors[v] = f"{type(e).__name__}: {e}"
                continue
            _chosen = v
            break
    return _chosen


def ops():
    """The ``torch.ops`` namespace of the chosen build (raises if there is none)."""
    v = chosen_variant()
    if v is None:
        raise RuntimeError(unavailable_reason())
    return _loaded[v]


_OP_CACHE = {}


def op(name: str):
    """The default overload of ``ops().<name>``, cached; a build that predates the op raises
    naming it (rebuild the extension: ``pip install --no-build-isolation -e .``)."""
    fn = _OP_CACHE.get(name)
    if fn is None:
        namespace = ops()
        if not hasattr(namespace, name):
            raise RuntimeError(f"the C++ extension ({loaded_from()}) has no op {name!r}: it predates this "
                               "twinkle_kernels; rebuild it (pip install --no-build-isolation -e .)")
        fn = _OP_CACHE[name] = getattr(namespace, name).default
    return fn


def unavailable_reason() -> Optional[str]:
    if chosen_variant() is not None:
        return None
    detail = "; ".join(f"_C_{k}: {v}" for k, v in _errors.items())
    return ("the C++ extension is not built (install with `pip install --no-build-isolation -e .`, "
            f"which needs a C++ compiler) [{detail}]")


def isa() -> str:
    """The instruction set the cpu backend runs with, for reports."""
    return chosen_variant() or "none (extension not built)"
