// Gated linear units (SwiGLU, GeGLU) forward and backward on the CPU.
//
//   y = act(g) * u
//   dg = dy * u * act'(g),   du = dy * act(g)
//
// act is SiLU (SwiGLU, the default), exact GELU (erf) or GELU's tanh approximation, chosen by
// the op's `act` argument (kSilu / kGelu / kGeluTanh below; the Python side maps the names).
// The activation is a template parameter, so each one compiles to its own loop with no branch
// per element.
//
// Every operand is a 2-D [M, n] tensor with unit stride in n and any row stride, so the
// packed Megatron layout (g = x[:, :n], u = x[:, n:], row stride 2n) and its gradient
// (views of one [M, 2n] buffer) need no copies. Work is split into (row, column-chunk)
// tiles so that one long row, or many short ones, both keep every thread busy.
#include "common/activation.h"
#include "common/autograd.h"

namespace twinkle {
namespace {

constexpr int64_t kCols = 8192;  // columns per tile; a multiple of every kBlock

// The `act` argument of the ops (twinkle_kernels/_activations.py holds the same numbers).
enum Act : int64_t { kSilu = 0, kGelu = 1, kGeluTanh = 2 };

// GELU's tanh approximation written with a sigmoid: 0.5 * (1 + tanh(z)) == sigmoid(2 z), so
//   gelu_tanh(g) = g * sigmoid(g * (c0 + c1 g^2)),  c0 = 2 sqrt(2 / pi),  c1 = c0 * 0.044715,
// and its derivative has SiLU's shape: s + g s (1 - s) (c0 + 3 c1 g^2). One exp, no tanh.
constexpr float kTanhC0 = 1.5957691216057308f;   // 2 * sqrt(2 / pi)
constexpr float kTanhC1 = 0.071354816272919f;    // 2 * sqrt(2 / pi) * 0.044715
// Exact GELU: g * Phi(g), Phi(g) = 0.5 * erfc(-g / sqrt(2)) (erfc keeps the left tail accurate, where
// 1 + erf(x) would cancel); Phi'(g) = exp(-g^2 / 2) / sqrt(2 pi).
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

// act(g), and with `grad` act'(g) as well.
template <int64_t A>
inline fVec act_value(const fVec& g) {
  if constexpr (A == kSilu) {
    return g * sigmoid(g);
  } else if constexpr (A == kGelu) {
    return g * (fVec(0.5f) * (g * fVec(-kInvSqrt2)).erfc());
  } else {
    return g * sigmoid(g * at::vec::fmadd(fVec(kTanhC1), g * g, fVec(kTanhC0)));
  }
}

template <int64_t A>
inline void act_value_grad(const fVec& g, fVec& value, fVec& grad) {
  if constexpr (A == kSilu) {
    const fVec s = sigmoid(g);
    value = g * s;
    grad = at::vec::fmadd(value, fVec(1.f) - s, s);  // s (1 + g (1 - s)), one product fewer
  } else if constexpr (A == kGelu) {
    const fVec cdf = fVec(0.5f) * (g * fVec(-kInvSqrt2)).erfc();
    const fVec pdf = fVec(kInvSqrt2Pi) * (g * g * fVec(-0.5f)).exp_u20();
    value = g * cdf;
    grad = at::vec::fmadd(g, pdf, cdf);
  } else {
    const fVec g2 = g * g;
    const fVec s = sigmoid(g * at::vec::fmadd(fVec(kTanhC1), g2, fVec(kTanhC0)));
    const fVec dz = at::vec::fmadd(fVec(3.f * kTanhC1), g2, fVec(kTanhC0));  // d(2 z)/dg
    value = g * s;
    grad = at::vec::fmadd(value * (fVec(1.f) - s), dz, s);                  // s + g s (1 - s) dz
  }
}

// Runs body.template operator()<A>() with A the activation named by `act`.
template <typename F>
inline void dispatch_act(int64_t act, const F& body) {
  switch (act) {
    case kSilu: body(std::integral_constant<int64_t, kSilu>{}); break;
    case kGelu: body(std::integral_constant<int64_t, kGelu>{}); break;
    case kGeluTanh: body(std::integral_constant<int64_t, kGeluTanh>{}); break;
    default: TORCH_CHECK(false, "act must be 0 (silu), 1 (gelu) or 2 (gelu_tanh), got ", act);
  }
}

struct Tiles {
  int64_t M, n, per_row, count, grain;
  Tiles(int64_t M_, int64_t n_) : M(M_), n(n_) {
    per_row = (n + kCols - 1) / kCols;
    count = M * per_row;
    grain = std::max<int64_t>(1, 32768 / std::min(n, kCols));
  }
};

void check_2d(const at::Tensor& t, const char* name, int64_t M, int64_t n, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.size(0) == M && t.size(1) == n, name, " must be [", M, ", ", n, "], got ",
              t.sizes());
  // An empty tensor is read nowhere, so its strides do not matter (and contiguous() keeps them).
  TORCH_CHECK(t.stride(1) == 1 || n <= 1 || M == 0, name, " must have unit stride in its last dim");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must have dtype ", dtype, ", got ", t.scalar_type());
}

void swiglu_fwd(const at::Tensor& g, const at::Tensor& u, at::Tensor& y, int64_t act) {
  TORCH_CHECK(g.dim() == 2, "gate must be 2-D [M, n]");
  const int64_t M = g.size(0), n = g.size(1);
  check_2d(g, "gate", M, n, g.scalar_type());
  check_2d(u, "up", M, n, g.scalar_type());
  check_2d(y, "out", M, n, g.scalar_type());
  dispatch_act(act, [&](auto a) {
    constexpr int64_t A = decltype(a)::value;
    if (M == 0 || n == 0) return;
    const Tiles tl(M, n);
    TWINKLE_DISPATCH_FLOATS(g.scalar_type(), "swiglu_fwd", [&] {
      const scalar_t* gp = g.data_ptr<scalar_t>();
      const scalar_t* up = u.data_ptr<scalar_t>();
      scalar_t* yp = y.data_ptr<scalar_t>();
      const int64_t gs = g.stride(0), us = u.stride(0), ys = y.stride(0);
      at::parallel_for(0, tl.count, tl.grain, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t m = t / tl.per_row, c0 = (t % tl.per_row) * kCols, c1 = std::min(n, c0 + kCols);
          const scalar_t* gr = gp + m * gs;
          const scalar_t* ur = up + m * us;
          scalar_t* yr = yp + m * ys;
          for (int64_t j = c0; j < c1; j += kBlock) {
            fVec ga, gb, ua, ub;
            const int64_t k = c1 - j;
            load2_ew(gr + j, k, ga, gb);
            load2_ew(ur + j, k, ua, ub);
            store2_ew(yr + j, k, act_value<A>(ga) * ua, act_value<A>(gb) * ub);
          }
        }
      });
    });
  });
}

void swiglu_bwd(const at::Tensor& dy, const at::Tensor& g, const at::Tensor& u, at::Tensor& dg, at::Tensor& du,
                int64_t act) {
  TORCH_CHECK(g.dim() == 2, "gate must be 2-D [M, n]");
  const int64_t M = g.size(0), n = g.size(1);
  const auto dt = g.scalar_type();
  check_2d(dy, "grad_output", M, n, dt);
  check_2d(g, "gate", M, n, dt);
  check_2d(u, "up", M, n, dt);
  check_2d(dg, "grad_gate", M, n, dt);
  check_2d(du, "grad_up", M, n, dt);
  dispatch_act(act, [&](auto a) {
    constexpr int64_t A = decltype(a)::value;
    if (M == 0 || n == 0) return;
    const Tiles tl(M, n);
    TWINKLE_DISPATCH_FLOATS(dt, "swiglu_bwd", [&] {
      const scalar_t* dyp = dy.data_ptr<scalar_t>();
      const scalar_t* gp = g.data_ptr<scalar_t>();
      const scalar_t* up = u.data_ptr<scalar_t>();
      scalar_t* dgp = dg.data_ptr<scalar_t>();
      scalar_t* dup = du.data_ptr<scalar_t>();
      const int64_t s_dy = dy.stride(0), s_g = g.stride(0), s_u = u.stride(0), s_dg = dg.stride(0),
                    s_du = du.stride(0);
      at::parallel_for(0, tl.count, tl.grain, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t m = t / tl.per_row, c0 = (t % tl.per_row) * kCols, c1 = std::min(n, c0 + kCols);
          // Row pointers in locals: read through the lambda's captures, the compiler reloaded and
          // re-multiplied all five per block (it cannot tell that the stores leave them alone).
          const scalar_t* dyr = dyp + m * s_dy;
          const scalar_t* gr = gp + m * s_g;
          const scalar_t* ur = up + m * s_u;
          scalar_t* dgr = dgp + m * s_dg;
          scalar_t* dur = dup + m * s_du;
          for (int64_t j = c0; j < c1; j += kBlock) {
            fVec da, db, ga, gb, ua, ub, va, vb, ra, rb;
            const int64_t k = c1 - j;
            load2_ew(dyr + j, k, da, db);
            load2_ew(gr + j, k, ga, gb);
            load2_ew(ur + j, k, ua, ub);
            act_value_grad<A>(ga, va, ra);
            act_value_grad<A>(gb, vb, rb);
            store2_ew(dgr + j, k, da * ua * ra, db * ub * rb);
            store2_ew(dur + j, k, da * va, db * vb);
          }
        }
      });
    });
  });
}

// y = act(gate) * up with its backward in C++: gate, up [..., n] (same shape and dtype, any strides);
// y and the gradients are fresh contiguous tensors of gate's shape.
struct SwiGLUFunction : public torch::autograd::Function<SwiGLUFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up, int64_t act,
                            bool poison) {
    TORCH_CHECK(gate.sizes() == up.sizes(), "gate and up must have one shape, got ", gate.sizes(), " and ",
                up.sizes());
    at::Tensor g2 = as_rows(gate, "gate"), u2 = as_rows(up, "up");
    at::Tensor y = fresh(gate.sizes(), gate.options(), poison);
    at::Tensor y2 = y.view(g2.sizes());
    swiglu_fwd(g2, u2, y2, act);
    ctx->save_for_backward({g2, u2});
    ctx->saved_data["act"] = act;
    ctx->saved_data["poison"] = poison;
    ctx->saved_data["shape"] = gate.sizes().vec();
    return y;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    refuse_create_graph("swiglu");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &g2 = saved[0], &u2 = saved[1];
    const auto shape = ctx->saved_data["shape"].toIntVector();
    const bool poison = ctx->saved_data["poison"].toBool();
    at::Tensor dy2 = as_rows(grads[0].to(g2.scalar_type()), "grad_output");
    at::Tensor dg = fresh(shape, g2.options(), poison), du = fresh(shape, g2.options(), poison);
    at::Tensor dg2 = dg.view(g2.sizes()), du2 = du.view(g2.sizes());
    swiglu_bwd(dy2, g2, u2, dg2, du2, ctx->saved_data["act"].toInt());
    return {dg, du, at::Tensor(), at::Tensor()};
  }
};

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up, int64_t act, bool poison) {
  return SwiGLUFunction::apply(gate, up, act, poison);
}

}  // namespace
}  // namespace twinkle

TORCH_LIBRARY_FRAGMENT(TWINKLE_NS, m) {
  m.def("swiglu_fwd(Tensor gate, Tensor up, Tensor(a!) out, int act=0) -> ()", &twinkle::swiglu_fwd);
  m.def("swiglu_bwd(Tensor dy, Tensor gate, Tensor up, Tensor(a!) dgate, Tensor(b!) dup, int act=0) -> ()",
        &twinkle::swiglu_bwd);
  // differentiable: the autograd of the two above, in C++ (common/autograd.h)
  m.def("swiglu(Tensor gate, Tensor up, int act=0, bool poison=False) -> Tensor", &twinkle::swiglu);
}
