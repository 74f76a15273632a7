// Helpers shared by the Gated DeltaNet CPU kernels: fp32 matrix views over raw pointers
// (so per-chunk products go to BLAS through ATen without copies) and the sequence layout.
#pragma once

#include "common/vec.h"

#include <ATen/ops/addmm.h>
#include <ATen/ops/from_blob.h>

#include <cmath>
#include <vector>

namespace twinkle {
namespace gdn {

// A [rows, cols] fp32 view with row stride ld over memory owned elsewhere.
inline at::Tensor mat(const float* p, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(const_cast<float*>(p), {rows, cols}, {ld, 1}, at::TensorOptions().dtype(at::kFloat));
}

// out = alpha * a @ b + beta * out   (beta == 0 ignores out's old contents, NaN included)
inline void gemm(at::Tensor out, const at::Tensor& a, const at::Tensor& b, float beta, float alpha) {
  at::addmm_out(out, out, a, b, beta, alpha);
}

inline std::vector<int64_t> offsets(const at::Tensor& cu) {
  // N == 0 (one offset) is an empty batch: no tasks, empty outputs.
  TORCH_CHECK(cu.device().is_cpu() && cu.scalar_type() == at::kLong && cu.dim() == 1 && cu.numel() >= 1,
              "cu_seqlens must be a CPU int64 vector of N + 1 offsets");
  auto c = cu.contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + c.numel());
}

// Chunk index of the first chunk of every sequence (N + 1 entries; the last is the total).
inline std::vector<int64_t> chunk_offsets(const std::vector<int64_t>& cu, int64_t C) {
  std::vector<int64_t> out(cu.size(), 0);
  for (size_t n = 0; n + 1 < cu.size(); ++n) out[n + 1] = out[n] + (cu[n + 1] - cu[n] + C - 1) / C;
  return out;
}

inline float dot(const float* a, const float* b, int64_t n) {
  fVec acc(0.f);
  int64_t i = 0;
  for (; i + kF <= n; i += kF) acc = at::vec::fmadd(fVec::loadu(a + i), fVec::loadu(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y = a * x + y
inline void axpy(float a, const float* x, float* y, int64_t n) {
  const fVec va(a);
  int64_t i = 0;
  for (; i + kF <= n; i += kF) at::vec::fmadd(va, fVec::loadu(x + i), fVec::loadu(y + i)).store(y + i);
  for (; i < n; ++i) y[i] += a * x[i];
}

// y = a * x
inline void scale_to(float a, const float* x, float* y, int64_t n) {
  const fVec va(a);
  int64_t i = 0;
  for (; i + kF <= n; i += kF) (va * fVec::loadu(x + i)).store(y + i);
  for (; i < n; ++i) y[i] = a * x[i];
}

// Copies `rows` rows of `n` floats between strided layouts.
inline void copy_rows(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) std::copy(src + r * lds, src + r * lds + n, dst + r * ldd);
}

// T = (I + A)^-1 for strictly lower A [L, L] (row-major, ld L): forward substitution, T unit lower.
inline void unit_lower_inverse(const float* A, float* T, int64_t L) {
  std::fill(T, T + L * L, 0.f);
  for (int64_t i = 0; i < L; ++i) {
    float* ti = T + i * L;
    ti[i] = 1.f;
    for (int64_t j = 0; j < i; ++j) {
      const float a = A[i * L + j];
      if (a != 0.f) axpy(-a, T + j * L, ti, j + 1);
    }
  }
}

}  // namespace gdn
}  // namespace twinkle
