// Shared helpers for the CPU kernels: fp32 vector loads/stores of float, bfloat16 and half.
//
// Every kernel works on blocks of kBlock = 2 * Vectorized<float>::size() elements, held as
// two fp32 vectors, so the same code serves all three storage types and always
// accumulates in fp32. The ISA (AVX-512, AVX2, scalar) is whatever CPU_CAPABILITY this
// translation unit was compiled for; setup.py builds one extension per ISA.
#pragma once

// ATen/core/Tensor.h and the per-operator headers a file uses, not ATen/ATen.h (every operator:
// most of a kernel file's compile time)
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#ifndef TWINKLE_NS
#error "TWINKLE_NS must name the torch.ops namespace of this build (set by setup.py)"
#endif

namespace twinkle {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kF = fVec::size();
constexpr int64_t kBlock = 2 * kF;

template <typename T>
inline void load2(const T* p, int64_t n, fVec& a, fVec& b) {
  if constexpr (std::is_same_v<T, float>) {
    if (n >= kBlock) {
      a = fVec::loadu(p);
      b = fVec::loadu(p + kF);
    } else {
      a = fVec::loadu(p, std::min<int64_t>(n, kF));
      b = n > kF ? fVec::loadu(p + kF, n - kF) : fVec(0.f);
    }
  } else {
    using V = at::vec::Vectorized<T>;
    static_assert(V::size() == kBlock, "reduced-precision vector must hold two float vectors");
    V v = n >= kBlock ? V::loadu(p) : V::loadu(p, n);
    std::tie(a, b) = at::vec::convert_to_float<T>(v);
  }
}

template <typename T>
inline void store2(T* p, int64_t n, const fVec& a, const fVec& b) {
  if constexpr (std::is_same_v<T, float>) {
    if (n >= kBlock) {
      a.store(p);
      b.store(p + kF);
    } else {
      a.store(p, std::min<int64_t>(n, kF));
      if (n > kF) b.store(p + kF, n - kF);
    }
  } else {
    auto v = at::vec::convert_from_float<T>(a, b);
    if (n >= kBlock) v.store(p); else v.store(p, n);
  }
}

// load2_ew / store2_ew: load2 / store2 for purely elementwise kernels, whose lanes may hold the
// block's elements in any order as long as every operand of the block uses the same one; store2_ew
// puts each element back in its place. On AVX-512, bfloat16 takes a cheaper order: the 32 values as
// 16 32-bit words, the even elements in the words' low halves and the odd ones in their high halves,
// so that bf16 -> fp32 is one shift (even) or one mask (odd) per vector, against torch's converters'
// two cross-lane widenings, and fp32 -> bf16 needs no pack and permute. The rounding is torch's:
// to nearest, ties to even, subnormals kept, inf kept (and a finite value rounding past the largest
// bf16 becomes inf); a NaN becomes the default NaN (torch's vector path gives 0xffff, also a NaN).
// float and half use load2 / store2.
#if defined(CPU_CAPABILITY_AVX512)
inline __mmask32 tail_mask32(int64_t n) { return n >= 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1; }

// fp32 -> bf16 bits, rounded to nearest even, in the high half of each 32-bit lane (the low half is
// garbage). A NaN is first replaced by the default NaN 0xffc00000 (vfixupimmps, table 0x33: quiet and
// signalling NaN -> QNaN indefinite, any other class -> itself): adding the rounding bias to a NaN
// with a large payload would carry into the sign bit, and one whose payload is all in the low half
// would truncate to inf.
inline __m512i bf16_rne_high(const __m512& x) {
  const __m512i v = _mm512_castps_si512(_mm512_fixupimm_ps(x, x, _mm512_set1_epi32(0x33), 0));
  // + 0x7fff, or + 0x8000 where the kept part's last bit (bit 16) is odd: ties go to even
  const __mmask16 odd = _mm512_test_epi32_mask(v, _mm512_set1_epi32(0x10000));
  return _mm512_mask_add_epi32(_mm512_add_epi32(v, _mm512_set1_epi32(0x7fff)), odd, v, _mm512_set1_epi32(0x8000));
}
#endif

template <typename T>
inline void load2_ew(const T* p, int64_t n, fVec& a, fVec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m512i v = n >= kBlock ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(tail_mask32(n), p);
    a = fVec(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));                              // even elements
    b = fVec(_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int32_t(0xffff0000u)))));  // odd
    return;
  }
#endif
  load2(p, n, a, b);
}

template <typename T>
inline void store2_ew(T* p, int64_t n, const fVec& a, const fVec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m512i even = _mm512_srli_epi32(bf16_rne_high(a), 16);
    // high halves from the odd elements, low halves from the even ones (0xE4: c ? a : b, bitwise)
    const __m512i v = _mm512_ternarylogic_epi32(bf16_rne_high(b), even, _mm512_set1_epi32(int32_t(0xffff0000u)), 0xE4);
    if (n >= kBlock) _mm512_storeu_si512(p, v); else _mm512_mask_storeu_epi16(p, tail_mask32(n), v);
    return;
  }
#endif
  store2(p, n, a, b);
}

// Horizontal sum (Vectorized<float>::reduce_add does not compile for the DEFAULT build).
inline float hsum(const fVec& v) {
  alignas(64) float buf[kF];
  v.store(buf);
  float s = 0.f;
  for (int64_t i = 0; i < kF; ++i) s += buf[i];
  return s;
}

// 1 / sqrt(mean(x^2) + eps) of one row of N values, accumulated in fp32 (two vector lanes).
template <typename T>
inline float inv_rms(const T* xr, int64_t N, float eps) {
  fVec acc0(0.f), acc1(0.f);
  for (int64_t j = 0; j < N; j += kBlock) {
    fVec a, b;
    load2(xr + j, N - j, a, b);
    acc0 = at::vec::fmadd(a, a, acc0);
    acc1 = at::vec::fmadd(b, b, acc1);
  }
  return 1.f / std::sqrt(hsum(acc0 + acc1) / float(N) + eps);
}

// Rows per parallel_for task: enough work per task to amortise the scheduling.
inline int64_t row_grain(int64_t cols) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)); }

// Tasks for a backward over M rows of N that gives each task one of `slots` fp32 weight-gradient rows:
// `slots`, but no more than one per row_grain(N) rows (about 32K elements). A small input (a q/k
// norm of a short batch) then runs as one task on the calling thread: waking the pool costs more
// than the work, and on a loaded machine a task can wait for a descheduled thread.
inline int64_t bwd_tasks(int64_t slots, int64_t M, int64_t N) {
  const int64_t g = row_grain(N);
  return std::max<int64_t>(1, std::min<int64_t>(slots, (M + g - 1) / g));
}

inline void check_cpu_contig(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace twinkle

// float, bfloat16 and half only: float64 is served by the Python reference.
#define TWINKLE_DISPATCH_FLOATS(dtype, name, ...)                 \
  AT_DISPATCH_SWITCH(dtype, name,                                 \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)    \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))
