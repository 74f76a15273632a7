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

#if defined(CPU_CAPABILITY_AVX512)
// exp(-g) in 10 instructions, about half of exp_u20's (sigmoid is most of a SwiGLU element's work):
// n = round(-g log2 e), r = -g - n ln2 in [-0.35, 0.35], exp(r) by exp_u20's degree-5 polynomial
// (1.6e-7 relative on that range in fp32), then vscalefps multiplies by 2^n, which overflows to inf
// and underflows through the subnormals to 0 by itself: no range masks. Computed as q = -r = g + n ln2
// with the odd coefficients negated, so -g is never formed. g is clamped to [-104, 104] first
// (exp(104) is inf in fp32 already, and an infinite n would make r nan); min(c, g) / max(c, g) return
// their second operand for a nan, so a nan g stays nan.
inline __m512 exp_neg_avx512(const __m512& g) {
  const __m512 x = _mm512_max_ps(_mm512_set1_ps(-104.f), _mm512_min_ps(_mm512_set1_ps(104.f), g));
  const __m512 magic = _mm512_set1_ps(12582912.f);  // 1.5 * 2^23: adding it rounds |t| < 2^22 to an integer
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(-1.44269504088896341f), magic), magic);
  const __m512 q = _mm512_fmadd_ps(n, _mm512_set1_ps(0.693147180559945309f), x);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(-0.00828929059f), q, _mm512_set1_ps(0.0418978221f));
  p = _mm512_fmadd_ps(p, q, _mm512_set1_ps(-0.166676521f));
  p = _mm512_fmadd_ps(p, q, _mm512_set1_ps(0.499991506f));
  p = _mm512_fmadd_ps(p, q, _mm512_set1_ps(-0.999999701f));
  p = _mm512_fmadd_ps(p, q, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif

// sigmoid(g) = 1 / (1 + exp(-g)); exp(-g) overflowing to inf for very negative g gives 0, as it should.
// exp_u20 (error <= 20 ulp, ~2e-6 relative) is about twice as fast as exp and well inside fp32 tolerances.
// AVX-512: exp_neg_avx512, and the reciprocal's ends need one mask: rcp14(1) is exactly 1 (so
// 1 / 1 stays 1 through the Newton step) and only d = inf (-> 0) is special.
inline fVec sigmoid(const fVec& g) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), exp_neg_avx512(g));
  const __m512 r = _mm512_rcp14_ps(d);
  const __mmask16 finite = _mm512_cmp_ps_mask(d, _mm512_set1_ps(std::numeric_limits<float>::infinity()), _CMP_NEQ_UQ);
  return fVec(_mm512_maskz_mul_ps(finite, r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f))));
#else
  const fVec one(1.f);
  return reciprocal_ge1(one + g.neg().exp_u20());
#endif
}

// d silu(g) / dg = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
inline fVec silu_grad(const fVec& g, const fVec& sig) {
  const fVec one(1.f);
  return sig * at::vec::fmadd(g, one - sig, one);
}

}  // namespace twinkle
