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
#include "common/autograd.h"
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

// The [O, H, I, D] view of t around its head dim ud (the kernels' layout; see the top of this file):
// a view for the usual layouts, copied only when the head dim's stride is not 1.
at::Tensor as_4d(const at::Tensor& t, int64_t ud) {
  const auto s = t.sizes();
  int64_t o = 1, i = 1;
  for (int64_t d = 0; d < ud; ++d) o *= s[d];
  for (int64_t d = ud + 1; d + 1 < t.dim(); ++d) i *= s[d];
  at::Tensor t4 = t.reshape({o, s[ud], i, s.back()});
  if (t4.size(3) > 1 && t4.stride(3) != 1) t4 = t4.contiguous();
  return t4;
}

// cos / sin as fp32 [O, I, R] tables over t's frame, broadcast dims kept at stride 0 where a view
// allows, both with one set of strides (the kernel reads them with one).
std::vector<at::Tensor> rope_tables(const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& t, int64_t ud) {
  const auto s = t.sizes();
  std::vector<int64_t> frame;
  int64_t o = 1, i = 1;
  for (int64_t d = 0; d < ud; ++d) frame.push_back(s[d]), o *= s[d];
  for (int64_t d = ud + 1; d + 1 < t.dim(); ++d) frame.push_back(s[d]), i *= s[d];
  const int64_t r = cos.size(-1);
  frame.push_back(r);
  std::vector<at::Tensor> out;
  for (const at::Tensor* c : {&cos, &sin}) {
    at::Tensor c3 = c->to(at::kFloat).expand(frame).reshape({o, i, r});
    if (r > 1 && c3.stride(2) != 1) c3 = c3.contiguous();
    out.push_back(c3);
  }
  if (out[0].strides() != out[1].strides()) out = {out[0].contiguous(), out[1].contiguous()};
  return out;
}

// q4 with tables tq and k4 with tables tk into fresh outputs of q's and k's shapes: one kernel call
// when the tables are the same (q and k share their frame), else one each.
template <bool kBackward>
std::vector<at::Tensor> rope_run(const at::Tensor& q4, const at::Tensor& k4, const at::Tensor& cq, const at::Tensor& sq,
                                 const at::Tensor& ck, const at::Tensor& sk, bool same, at::IntArrayRef qshape,
                                 at::IntArrayRef kshape, bool poison) {
  at::Tensor qo = fresh(qshape, q4.options(), poison), ko = fresh(kshape, k4.options(), poison);
  at::Tensor qo4 = qo.view(q4.sizes()), ko4 = ko.view(k4.sizes());
  if (same) {
    rope_apply<kBackward>(q4, k4, cq, sq, qo4, ko4);
  } else {
    at::Tensor q0 = q4.slice(1, 0, 0), qo0 = qo4.slice(1, 0, 0), k0 = k4.slice(1, 0, 0), ko0 = ko4.slice(1, 0, 0);
    rope_apply<kBackward>(q4, q0, cq, sq, qo4, qo0);
    rope_apply<kBackward>(k4, k0, ck, sk, ko4, ko0);
  }
  return {qo, ko};
}

// Whether q and k have one frame (their shapes without the head dim agree): then they share tables.
bool same_frame(const at::Tensor& q, const at::Tensor& k, int64_t ud) {
  if (q.dim() != k.dim()) return false;
  for (int64_t d = 0; d < q.dim(); ++d)
    if (d != ud && q.size(d) != k.size(d)) return false;
  return true;
}

// The rotary embedding of q and k with its backward in C++: q, k with the head dim at ud and one dim
// more than cos / sin (the layouts twinkle_kernels.rope's fast paths take); no gradient for cos / sin.
struct RotaryFunction : public torch::autograd::Function<RotaryFunction> {
  static tensor_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                             const at::Tensor& sin, int64_t ud, bool poison) {
    TORCH_CHECK(ud >= 0 && ud + 1 < q.dim() && q.dim() == k.dim(), "unsqueeze_dim ", ud,
                " must name a dim of q and k before the head dim");
    const bool same = same_frame(q, k, ud);
    auto tq = rope_tables(cos, sin, q, ud);
    auto tk = same ? tq : rope_tables(cos, sin, k, ud);
    auto out = rope_run<false>(as_4d(q, ud), as_4d(k, ud), tq[0], tq[1], tk[0], tk[1], same, q.sizes(), k.sizes(),
                               poison);
    ctx->save_for_backward({tq[0], tq[1], tk[0], tk[1]});
    ctx->saved_data["ud"] = ud;
    ctx->saved_data["same"] = same;
    ctx->saved_data["poison"] = poison;
    ctx->saved_data["qshape"] = q.sizes().vec();
    ctx->saved_data["kshape"] = k.sizes().vec();
    ctx->saved_data["dtype"] = q.scalar_type();
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    refuse_create_graph("apply_rotary_pos_emb");
    const auto t = ctx->get_saved_variables();
    const int64_t ud = ctx->saved_data["ud"].toInt();
    const auto dt = ctx->saved_data["dtype"].toScalarType();
    const auto qshape = ctx->saved_data["qshape"].toIntVector(), kshape = ctx->saved_data["kshape"].toIntVector();
    auto out = rope_run<true>(as_4d(grads[0].to(dt), ud), as_4d(grads[1].to(dt), ud), t[0], t[1], t[2], t[3],
                              ctx->saved_data["same"].toBool(), qshape, kshape,
                              ctx->saved_data["poison"].toBool());
    return {out[0], out[1], at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::vector<at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                             int64_t unsqueeze_dim, bool poison) {
  return RotaryFunction::apply(q, k, cos, sin, unsqueeze_dim, poison);
}

}  // namespace
}  // namespace twinkle

TORCH_LIBRARY_FRAGMENT(TWINKLE_NS, m) {
  m.def("rope_fwd(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor(a!) q_out, Tensor(b!) k_out) -> ()",
        &twinkle::rope_fwd);
  m.def("rope_bwd(Tensor dq, Tensor dk, Tensor cos, Tensor sin, Tensor(a!) dq_out, Tensor(b!) dk_out) -> ()",
        &twinkle::rope_bwd);
  // differentiable in q and k: the autograd of the two above, in C++ (common/autograd.h)
  m.def("rope(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim, bool poison=False) -> Tensor[]",
        &twinkle::rope);
}
