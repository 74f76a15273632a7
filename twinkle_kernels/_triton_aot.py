"""Compile the Triton kernels for a CUDA target without a GPU.

The interpreter (``TRITON_INTERPRET=1``) never lowers a kernel, so mistakes only the
compiler rejects (loop-carried types, constexpr misuse, pointer arithmetic) would first
show on a GPU. ``triton.compile`` runs the whole pipeline down to a cubin with the ptxas
that ships in the Triton wheel, on any machine. Each kernel module lists what to compile in
``aot_specs()``: ``(name, kernel, {arg: type}, {constexpr: value})``; unlisted arguments
are ``i32``.

    python -m twinkle_kernels._triton_aot [--arch 90]     # exit status 1 if any kernel fails

Run it in a process without ``TRITON_INTERPRET`` (``main`` clears it before importing
triton): with the interpreter active in the same process the compiler's front end breaks.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

MODULES = (
    "twinkle_kernels.norm._triton",
    "twinkle_kernels.rope._triton",
    "twinkle_kernels.swiglu._triton",
)


def compile_spec(kernel, types, consts, arch: int = 90, num_warps: int = 8):
    """Compile one kernel for ``sm_<arch>``; returns the compiled kernel (its ``asm`` has the cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="compile the Triton kernels for a CUDA arch, no GPU needed")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--modules", default=",".join(MODULES))
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    import triton

    failed = 0
    for mod in args.modules.split(","):
        for name, kernel, types, consts in importlib.import_module(mod).aot_specs():
            try:
                k = compile_spec(kernel, types, consts, args.arch)
                print(f"ok   {name}: {len(k.asm['cubin'])} bytes of sm_{args.arch} cubin", flush=True)
            except Exception as e:  # report every kernel, not only the first failure
                failed += 1
                msg = str(e).strip().splitlines()
                print(f"FAIL {name}: {type(e).__name__}: {msg[-1] if msg else ''}", flush=True)
    print(f"triton {triton.__version__}: {failed} kernel(s) failed to compile", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
