"""The op registry and the backends, read-only, for tools outside the package.

``twinkle_patches`` (which backend a patched call would take, and why one cannot serve) and the
benchmarks (the C++ build they time) ask here instead of reaching into the private core
(``_dispatch``, ``_backends``, ``_cpu_ext``), which stays free to change. Importing this module
imports the package, so every op is registered by then.

- :data:`BACKENDS`, :func:`backend_status`: the backend names, and why one cannot run in this
  process (None when it can);
- :func:`registered_ops`: op name -> its registry entry (an ``Op``, whose ``impls`` maps each
  backend it has to its implementation); :func:`default_order`: the backends the automatic choice
  tries on a device, in order;
- :func:`triton_interpret`: whether Triton runs CPU tensors (its interpreter, ``TRITON_INTERPRET=1``);
- :func:`cpu_isa`: the instruction set of the C++ build the cpu backend runs; :func:`cpu_kernels`:
  that build's ``torch.ops`` namespace, the raw kernels (benchmarks time them without the op's
  dispatch and checks; raises when no build loads).
"""
from ._backends import BACKENDS, backend_status, triton_interpret
from ._cpu_ext import isa as cpu_isa
from ._cpu_ext import ops as cpu_kernels
from ._dispatch import default_order, registered_ops

__all__ = ["BACKENDS", "backend_status", "cpu_isa", "cpu_kernels", "default_order", "registered_ops",
           "triton_interpret"]
