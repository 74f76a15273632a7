"""Launch helpers shared by the Triton backends (imported only when a Triton op runs).

The kernels must run on real Triton 3.6 (CUDA) and in the Triton 3.9 interpreter
(``TRITON_INTERPRET=1``, CPU tensors), so they stay with plain pointer arithmetic,
masks, one launch configuration per call (no multi-config autotune) and no libdevice.
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch
import triton

# One program keeps at most this many elements of a tile in registers; bigger rows
# still work (the block grows), just with register spills.
TILE_ELEMS = 4096


_GPU_CONFIGS = False   # see gpu_configs


def tuned_for_gpu(t: torch.Tensor) -> bool:
    """Whether launch configurations are picked for a GPU: for CUDA tensors, and for CPU tensors
    inside :func:`gpu_configs`."""
    return t.device.type == "cuda" or _GPU_CONFIGS


@contextlib.contextmanager
def gpu_configs():
    """Pick GPU launch configurations for CPU tensors too: the compile lane
    (:mod:`twinkle_kernels._triton_aot`) records, under the interpreter and without running them,
    the launches a GPU would get."""
    global _GPU_CONFIGS
    prev, _GPU_CONFIGS = _GPU_CONFIGS, True
    try:
        yield
    finally:
        _GPU_CONFIGS = prev


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def num_warps(block_elems: int) -> int:
    if block_elems >= 16384:
        return 16
    if block_elems >= 4096:
        return 8
    if block_elems >= 1024:
        return 4
    return 2


def rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as ``[M, N]`` (N = last dim) with a unit column stride; copies only when needed."""
    # the row count spelled out: reshape(-1, 0) of an empty last dim is ambiguous and raises
    t2 = t.reshape(math.prod(t.shape[:-1]), t.shape[-1]) if t.dim() != 2 else t
    if t2.shape[1] > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


def program_budget(device: torch.device) -> int:
    """How many persistent programs a reduction launch uses.

    On a GPU a few waves of the SMs; in the interpreter every program costs ~0.1 ms
    of Python, so few programs are faster.
    """
    if device.type == "cuda":
        return 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def on_device(t: torch.Tensor):
    """Launch on ``t``'s GPU: Triton launches on the *current* CUDA device, which need not be t's."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()
