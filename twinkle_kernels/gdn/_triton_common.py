"""Helpers shared by the chunked gated delta rule's Triton kernels.

``OPD`` (a constexpr string) is the operand precision of every ``tl.dot`` in a kernel, with
fp32 accumulation in all modes:

- ``"bf16"`` / ``"fp16"``: operands cast to the input dtype, the tensor-core path (as fla);
- ``"ieee"``: fp32 operands, exact fp32 products (FMA; fp32 inputs). It holds every operand row
  and column a thread touches in registers, which spills at [64, 64] x [64, 64] tiles (so fp32
  inputs run 32-token chunks);
- ``"tf32x3"``: fp32 operands split in two tf32 halves, three tensor-core products per dot
  (about 2^-21 relative per product); ``"tf32"``: one tf32 product;
- ``"bf16emu"``: fp32 operands rounded to bf16's 8-bit mantissa (round to nearest even, in
  integer bit arithmetic) and multiplied exactly. The Triton interpreter computes bf16
  ``tl.dot`` wrongly, so this is how the bf16 path's numerics are tested without a GPU: the
  same kernel code, with every operand rounded exactly where the GPU path would round it.

Intermediates that are only ever dot operands (``Ai``, ``w``, the chunk states ``h``, ``vn``,
``dh``, ``dvn``) are stored rounded the same way (in bf16/fp16 for those inputs), which halves
their memory traffic and loses nothing the dots would not lose anyway.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_bf16(x):
    """fp32 ``x`` rounded to the nearest bf16 value (ties to even), still fp32. No libdevice:
    it runs in the interpreter."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (0x7FFF + ((bits >> 16) & 1))
    bits = (bits >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def opnd(x, OPD: tl.constexpr):
    """``x`` as a ``tl.dot`` operand of precision ``OPD`` (see the module docstring)."""
    if OPD == "bf16":
        y = x.to(tl.bfloat16)
    elif OPD == "fp16":
        y = x.to(tl.float16)
    elif OPD == "bf16emu":
        y = round_bf16(x.to(tl.float32))
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def mm(a, b, OPD: tl.constexpr):
    """``a @ b`` with fp32 accumulation, operands in precision ``OPD``."""
    if OPD == "tf32" or OPD == "tf32x3":
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=OPD)
    elif OPD == "ieee" or OPD == "bf16emu":
        c = tl.dot(opnd(a, OPD), opnd(b, OPD), input_precision="ieee")
    else:
        c = tl.dot(opnd(a, OPD), opnd(b, OPD))
    return c


@triton.jit
def mm_acc(a, b, acc, OPD: tl.constexpr):
    """``acc + a @ b`` accumulated in place (fp32 ``acc``), operands in precision ``OPD``."""
    if OPD == "tf32" or OPD == "tf32x3":
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=OPD)
    elif OPD == "ieee" or OPD == "bf16emu":
        c = tl.dot(opnd(a, OPD), opnd(b, OPD), acc, input_precision="ieee")
    else:
        c = tl.dot(opnd(a, OPD), opnd(b, OPD), acc)
    return c


@triton.jit
def chunk_span(cu_ptr, cidx_ptr, i_c, BT: tl.constexpr):
    """(first token, number of valid tokens) of global chunk ``i_c``."""
    i_n = tl.load(cidx_ptr + i_c * 2)
    i_t = tl.load(cidx_ptr + i_c * 2 + 1)
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    eos = tl.load(cu_ptr + i_n + 1).to(tl.int64)
    start = bos + i_t.to(tl.int64) * BT
    return start, tl.minimum(eos - start, BT)


@triton.jit
def decay_diff(gc_row, gc_col, mask):
    """``exp(gc_i - gc_j)`` where ``mask``, else 0: the difference is taken in fp64 (``gc`` is
    fp64) before the exponent, never as a ratio of exponentials, which overflow/underflow."""
    d = tl.where(mask, (gc_row[:, None] - gc_col[None, :]).to(tl.float32), 0.0)
    return tl.where(mask, tl.exp(d), 0.0)


@triton.jit
def state_block_load(ptr, base, i_k: tl.constexpr, cv, K, V, BK: tl.constexpr, HAS: tl.constexpr, BV: tl.constexpr):
    """Rows [i_k * BK, (i_k + 1) * BK) of a ``[K, V]`` fp32 state (zeros when not ``HAS``)."""
    if HAS:
        ck = i_k * BK + tl.arange(0, BK)
        t = tl.load(ptr + base + ck[:, None] * V + cv[None, :], mask=(ck[:, None] < K) & (cv[None, :] < V),
                    other=0.0).to(tl.float32)
    else:
        t = tl.zeros([BK, BV], dtype=tl.float32)
    return t


@triton.jit
def state_block_store(ptr, base, i_k: tl.constexpr, cv, K, V, t, BK: tl.constexpr):
    ck = i_k * BK + tl.arange(0, BK)
    tl.store(ptr + base + ck[:, None] * V + cv[None, :], t.to(ptr.dtype.element_ty),
             mask=(ck[:, None] < K) & (cv[None, :] < V))


@triton.jit
def rows_block(ptr, base, i_k: tl.constexpr, rows, rm, K, stride, BK: tl.constexpr):
    """Columns [i_k * BK, (i_k + 1) * BK) of ``BT`` rows of a ``[T, ..., K]`` tensor."""
    ck = i_k * BK + tl.arange(0, BK)
    return tl.load(ptr + base + rows[:, None] * stride + ck[None, :], mask=rm[:, None] & (ck[None, :] < K),
                   other=0.0)
