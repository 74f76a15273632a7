// SiLU and its derivative on fp32 vectors, shared by the gated norm and SwiGLU kernels.
#pragma once

#include "common/vec.h"

#include <limits>

namespace twinkle {

// 1 / d for d >= 1 or +inf (-> 0, exactly: sigmoid(-inf) must be 0 so that silu(-inf) is nan, as
// torch's): the ISA's reciprocal estimate and one Newton step, r (2 - d r), which squares its
// relative error (AVX-512's 2^-14 to ~2^-28, AVX2's 1.5 * 2^-12 to ~2^-22). A vector division has a
// throughput of 10-16 cycles, about what the rest of a SwiGLU element costs. See exact_ends.
// The reciprocal's two ends exactly: 1 / inf = 0 (the Newton step would make inf * 0 = nan) and
// 1 / 1 = 1. The second matters for sigmoid(g) at large g, where 1 + exp(-g) rounds to 1: AVX2's
// estimate of 1 is 0.99976 and one step leaves 1 - 2^-24, so silu's gradient s (1 + g (1 - s))
// would be off by g * 6e-8 (6e-4 at g = 1e4; test_fuzz's causal_conv1d on the AVX2 build).
inline fVec exact_ends(const fVec& r, const fVec& d) {
  const fVec one(1.f);
  return fVec::blendv(fVec::blendv(r, fVec(0.f), d == fVec(std::numeric_limits<float>::infinity())), one, d == one);
}

inline fVec reciprocal_ge1(const fVec& d) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 x = d;
  const __m512 r = _mm512_rcp14_ps(x);
  const fVec nr(_mm512_mul_ps(r, _mm512_fnmadd_ps(x, r, _mm512_set1_ps(2.f))));
  return exact_ends(nr, d);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 x = d;
  const __m256 r = _mm256_rcp_ps(x);
  const fVec nr(_mm256_mul_ps(r, _mm256_fnmadd_ps(x, r, _mm256_set1_ps(2.f))));
  return exact_ends(nr, d);
#else
  return fVec(1.f) / d;
#endif
}

// sigmoid(g) = 1 / (1 + exp(-g)); exp(-g) overflowing to inf for very negative g gives 0, as it should.
// exp_u20 (error <= 20 ulp, ~2e-6 relative) is about twice as fast as exp and well inside fp32 tolerances.
inline fVec sigmoid(const fVec& g) {
  const fVec one(1.f);
  return reciprocal_ge1(one + g.neg().exp_u20());
}

// d silu(g) / dg = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
inline fVec silu_grad(const fVec& g, const fVec& sig) {
  const fVec one(1.f);
  return sig * at::vec::fmadd(g, one - sig, one);
}

}  // namespace twinkle
