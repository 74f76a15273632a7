"""Builds the C++ CPU extension of twinkle_kernels, three times, one per instruction set (a wheel, or
``TWINKLE_ISA_VARIANTS=all``); an editable install builds only the best one this CPU runs, unless
``TWINKLE_ISA_VARIANTS`` names the variants (``all``, ``runnable``: those this CPU executes, ``host``: the
best of them, or ``avx512`` / ``avx2`` / ``default``).

Install with the torch you already have (never let pip fetch a second torch into an
isolated build environment):

    pip install torch==2.13.0
    pip install --no-build-isolation -e .

If torch is not importable at build time (an isolated build) or no C++ compiler is
present, the package installs without the extension; the ``cpu`` backend then reports
itself unavailable with the reason and ops fall back to ``reference``.
"""
import glob
import os
import sys

from setuptools import find_packages, setup

VARIANTS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "default": ["-DCPU_CAPABILITY=DEFAULT"],
}


def _extensions():
    if os.environ.get("TWINKLE_NO_EXTENSION", "0") not in ("", "0"):
        print("twinkle: TWINKLE_NO_EXTENSION set; skipping the C++ extension", file=sys.stderr)
        return [], {}
    try:
        import torch  # noqa: F401
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except Exception as e:
        print(f"twinkle: torch is not importable at build time ({e}); building without the C++ "
              "extension. Use `pip install --no-build-isolation -e .` with torch installed.",
              file=sys.stderr)
        return [], {}

    here = os.path.dirname(os.path.abspath(__file__))
    sources = sorted(os.path.relpath(p, here) for p in glob.glob(os.path.join(here, "csrc", "**", "*.cpp"),
                                                                  recursive=True))
    is_x86 = os.uname().machine in ("x86_64", "AMD64") if hasattr(os, "uname") else True
    # TWINKLE_ISA_VARIANTS=avx512 builds one variant only (faster edit-compile loops); "host" is the
    # best one this CPU runs (the loader's own choice, twinkle_kernels/_cpu_ext.py).
    only = [v for v in os.environ.get("TWINKLE_ISA_VARIANTS", "").replace(",", " ").split() if v]
    if "all" in only:
        only = []
    elif "runnable" in only:   # every variant this CPU executes (what the test suite can check)
        only = list(_runnable_variants(here))
    elif "host" in only:
        only = [v for v in only if v != "host"] + [_host_variant(here)]
    # TWINKLE_SANITIZE=1 (the sanitizer lane, .ci/sanitize): AddressSanitizer + UndefinedBehaviorSanitizer,
    # every UB report fatal. -fno-wrapv undoes Python's -fwrapv, under which signed overflow is defined
    # and goes unreported; -O1 keeps reports readable (and compiles faster).
    sanitize = os.environ.get("TWINKLE_SANITIZE", "0") not in ("", "0")
    san_flags = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer",
                 "-fno-wrapv", "-g", "-O1"] if sanitize else []
    # Python's own CFLAGS carry -g: debug info for torch's templates was 40 % of the compile time
    # (swiglu.cpp 10.3 vs 6.1 CPU s); the sanitized build keeps it for readable reports
    no_debug_info = ["-g0"]
    exts = []
    for name, flags in VARIANTS.items():
        if (name != "default" and not is_x86) or (only and name not in only):
            continue
        exts.append(CppExtension(
            name=f"twinkle_kernels._C_{name}",
            sources=sources,
            include_dirs=[os.path.join(here, "csrc")],
            extra_compile_args=["-O3", "-std=c++17", "-Wno-unknown-pragmas", "-Wno-maybe-uninitialized",
                                "-Wno-c++20-extensions", "-fopenmp", f"-DTWINKLE_NS=twinkle_{name}"] + flags
                               + (san_flags or no_debug_info),
            extra_link_args=["-fopenmp"] + san_flags[:1],
        ))

    class SafeBuildExt(BuildExtension):
        """A failed compile (no compiler, unsupported flags) leaves that variant out, not the install."""

        failed = set()

        def build_extensions(self):
            # An editable install (a clone being worked in) builds the variant this CPU loads, not
            # all three: a third of the compile time. A wheel may run on another CPU: all three.
            if getattr(self, "editable_mode", False) and not os.environ.get("TWINKLE_ISA_VARIANTS"):
                host = f"twinkle_kernels._C_{_host_variant(here)}"
                self.extensions = [e for e in self.extensions if e.name == host] or self.extensions
                print(f"twinkle: editable install: building {host} only (TWINKLE_ISA_VARIANTS=all builds "
                      "every variant)", file=sys.stderr)
            super().build_extensions()

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as e:
                self.failed.add(ext.name)
                print(f"twinkle: could not build {ext.name}: {e}; the cpu backend will skip it",
                      file=sys.stderr)

        def copy_extensions_to_source(self):
            built = [e for e in self.extensions if e.name not in self.failed]
            self.extensions, everything = built, self.extensions
            try:
                super().copy_extensions_to_source()
            finally:
                self.extensions = everything

    return exts, {"build_ext": SafeBuildExt.with_options(use_ninja=True)}


def _runnable_variants(here):
    """The ISA variants this CPU executes, best first, as the extension's loader sees them (its
    module is loaded by path: importing the package would need the package built)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("_twinkle_cpu_ext", os.path.join(here, "twinkle_kernels",
                                                                                   "_cpu_ext.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.cpu_supports()


def _host_variant(here):
    """The best ISA variant this CPU executes (the one the loader picks)."""
    return _runnable_variants(here)[0]


def _packages():
    # benchmarks/ is not installed: a top-level package of that name collides with other
    # projects' in site-packages. It runs from a checkout (`python -m benchmarks` at the root).
    pkgs = find_packages(include=["twinkle_kernels", "twinkle_kernels.*", "twinkle_megatron", "twinkle_megatron.*"])
    # The folder patches/ is imported as twinkle_patches.
    pkgs += ["twinkle_patches" + p[len("patches"):] for p in find_packages(include=["patches", "patches.*"])]
    return pkgs


ext_modules, cmdclass = _extensions()
setup(
    packages=_packages(),
    package_dir={"twinkle_patches": "patches"},
    include_package_data=True,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
