// Rotary position embedding (Hugging Face rotate_half convention) on the CPU, forward and backward.
//
// With R = cos.shape[-1] (the rotary dim) and h = R / 2, for every row x of length D:
//   forward   y[:h]  = x[:h] * c[:h] - x[h:R] * s[:h]     y[h:R] = x[h:R] * c[h:] + x[:h] * s[h:]
//   backward  dx[:h] = dy[:h] * c[:h] + dy[h:R] * s[h:]   dx[h:R] = dy[h:R] * c[h:] - dy[:h] * s[:h]
//   y[R:] = x[R:] (partial rotary: the tail passes through, and so does its gradient).
//
// q: [O, Hq, I, D], k: [O, Hk, I, D] (any strides, unit stride in D), where the head dim sits
// between an "outer" block O and an "inner" block I of the original layout; cos, sin: [O, I, R]
// fp32 (any strides, stride 0 for broadcast dims; unit stride in R); outputs contiguous.
// Tasks take runs of up to 16 consecutive (o, i) pairs and rotate them head by head, so each head
// reads one contiguous stretch and the run's cos/sin rows are reused from L1 for every head.
#include "common/vec.h"

#include <cstring>

namespace twinkle {
namespace {

constexpr int64_t kChunk = 16;  // (o, i) rows per head visited together

template <typename T, bool kBackward>
inline void rope_row(const T* x, T* y, const float* c, const float* s, int64_t half, int64_t D) {
  for (int64_t j = 0; j < half; j += kBlock) {
    const int64_t n = half - j;
    fVec x1a, x1b, x2a, x2b, c1a, c1b, c2a, c2b, s1a, s1b, s2a, s2b;
    load2(x + j, n, x1a, x1b);
    load2(x + half + j, n, x2a, x2b);
    load2(c + j, n, c1a, c1b);
    load2(c + half + j, n, c2a, c2b);
    load2(s + j, n, s1a, s1b);
    load2(s + half + j, n, s2a, s2b);
    if constexpr (!kBackward) {
      store2(y + j, n, x1a * c1a - x2a * s1a, x1b * c1b - x2b * s1b);
      store2(y + half + j, n, at::vec::fmadd(x1a, s2a, x2a * c2a), at::vec::fmadd(x1b, s2b, x2b * c2b));
    } else {
      store2(y + j, n, at::vec::fmadd(x2a, s2a, x1a * c1a), at::vec::fmadd(x2b, s2b, x1b * c1b));
      store2(y + half + j, n, x2a * c2a - x1a * s1a, x2b * c2b - x1b * s1b);
    }
  }
  if (D > 2 * half) std::memcpy(y + 2 * half, x + 2 * half, sizeof(T) * (D - 2 * half));
}

void check_layout(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 4, name, " must be 4-D [outer, heads, inner, head_dim], got ", t.dim(), " dims");
  // An empty tensor is read nowhere, so its strides do not matter (and contiguous() keeps them).
  TORCH_CHECK(t.stride(3) == 1 || t.size(3) <= 1 || t.numel() == 0, name, " must have unit stride in the head dim");
}

template <bool kBackward>
void rope_apply(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                at::Tensor& q_out, at::Tensor& k_out) {
  check_layout(q, "q");
  check_layout(k, "k");
  check_cpu_contig(q_out, "q_out");
  check_cpu_contig(k_out, "k_out");
  TORCH_CHECK(q_out.sizes() == q.sizes() && q_out.scalar_type() == q.scalar_type(), "q_out must match q");
  TORCH_CHECK(k_out.sizes() == k.sizes() && k_out.scalar_type() == k.scalar_type(), "k_out must match k");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "q and k must share a dtype");
  const int64_t O = q.size(0), Hq = q.size(1), I = q.size(2), D = q.size(3), Hk = k.size(1);
  TORCH_CHECK(k.size(0) == O && k.size(2) == I && k.size(3) == D, "k must be [", O, ", Hk, ", I, ", ", D,
              "] like q, got ", k.sizes());
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat, "cos and sin must be fp32 CPU tensors");
    TORCH_CHECK(t->dim() == 3 && t->size(0) == O && t->size(1) == I, "cos and sin must be [", O, ", ", I,
                ", R], got ", t->sizes());
    TORCH_CHECK(t->stride(2) == 1 || t->size(2) <= 1 || t->numel() == 0,
                "cos and sin must have unit stride in the rotary dim");
  }
  TORCH_CHECK(sin.sizes() == cos.sizes() && (sin.strides() == cos.strides() || cos.numel() == 0),
              "cos and sin must share shape and strides");
  const int64_t R = cos.size(2);
  TORCH_CHECK(R % 2 == 0 && R <= D, "rotary dim ", R, " must be even and at most the head dim ", D);
  const int64_t half = R / 2;
  if (O * I == 0 || D == 0 || Hq + Hk == 0) return;
  const int64_t cs0 = cos.stride(0), cs1 = cos.stride(1);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, (Hq + Hk) * D));
  TWINKLE_DISPATCH_FLOATS(q.scalar_type(), "rope", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k.data_ptr<scalar_t>();
    scalar_t* qo = q_out.data_ptr<scalar_t>();
    scalar_t* ko = k_out.data_ptr<scalar_t>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    const int64_t q0 = q.stride(0), q1 = q.stride(1), q2 = q.stride(2);
    const int64_t k0 = k.stride(0), k1 = k.stride(1), k2 = k.stride(2);
    at::parallel_for(0, O * I, grain, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1;) {
        const int64_t o = p / I;
        const int64_t p_end = std::min(p1, std::min(p + kChunk, (o + 1) * I));
        // Rows p..p_end share o: per head they are consecutive in memory (one stream, prefetch
        // friendly), and the chunk's cos/sin rows stay in L1 across the heads.
        for (int64_t h = 0; h < Hq; ++h)
          for (int64_t pp = p; pp < p_end; ++pp) {
            const int64_t ii = pp - o * I;
            rope_row<scalar_t, kBackward>(qp + o * q0 + h * q1 + ii * q2, qo + ((o * Hq + h) * I + ii) * D,
                                          cp + o * cs0 + ii * cs1, sp + o * cs0 + ii * cs1, half, D);
          }
        for (int64_t h = 0; h < Hk; ++h)
          for (int64_t pp = p; pp < p_end; ++pp) {
            const int64_t ii = pp - o * I;
            rope_row<scalar_t, kBackward>(kp + o * k0 + h * k1 + ii * k2, ko + ((o * Hk + h) * I + ii) * D,
                                          cp + o * cs0 + ii * cs1, sp + o * cs0 + ii * cs1, half, D);
          }
        p = p_end;
      }
    });
  });
}

void rope_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
              at::Tensor& q_out, at::Tensor& k_out) {
  rope_apply<false>(q, k, cos, sin, q_out, k_out);
}

void rope_bwd(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& cos, const at::Tensor& sin,
              at::Tensor& dq_out, at::Tensor& dk_out) {
  rope_apply<true>(dq, dk, cos, sin, dq_out, dk_out);
}

}  // namespace
}  // namespace twinkle

TORCH_LIBRARY_FRAGMENT(TWINKLE_NS, m) {
  m.def("rope_fwd(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor(a!) q_out, Tensor(b!) k_out) -> ()",
        &twinkle::rope_fwd);
  m.def("rope_bwd(Tensor dq, Tensor dk, Tensor cos, Tensor sin, Tensor(a!) dq_out, Tensor(b!) dk_out) -> ()",
        &twinkle::rope_bwd);
}
