// SwiGLU forward and backward on the CPU.
//
//   y = silu(g) * u
//   dg = dy * u * silu'(g),   du = dy * silu(g)
//
// Every operand is a 2-D [M, n] tensor with unit stride in n and any row stride, so the
// packed Megatron layout (g = x[:, :n], u = x[:, n:], row stride 2n) and its gradient
// (views of one [M, 2n] buffer) need no copies. Work is split into (row, column-chunk)
// tiles so that one long row, or many short ones, both keep every thread busy.
#include "common/activation.h"

namespace twinkle {
namespace {

constexpr int64_t kCols = 8192;  // columns per tile; a multiple of every kBlock

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

void swiglu_fwd(const at::Tensor& g, const at::Tensor& u, at::Tensor& y) {
  TORCH_CHECK(g.dim() == 2, "gate must be 2-D [M, n]");
  const int64_t M = g.size(0), n = g.size(1);
  check_2d(g, "gate", M, n, g.scalar_type());
  check_2d(u, "up", M, n, g.scalar_type());
  check_2d(y, "out", M, n, g.scalar_type());
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
          load2(gr + j, k, ga, gb);
          load2(ur + j, k, ua, ub);
          store2(yr + j, k, ga * sigmoid(ga) * ua, gb * sigmoid(gb) * ub);
        }
      }
    });
  });
}

void swiglu_bwd(const at::Tensor& dy, const at::Tensor& g, const at::Tensor& u, at::Tensor& dg, at::Tensor& du) {
  TORCH_CHECK(g.dim() == 2, "gate must be 2-D [M, n]");
  const int64_t M = g.size(0), n = g.size(1);
  const auto dt = g.scalar_type();
  check_2d(dy, "grad_output", M, n, dt);
  check_2d(g, "gate", M, n, dt);
  check_2d(u, "up", M, n, dt);
  check_2d(dg, "grad_gate", M, n, dt);
  check_2d(du, "grad_up", M, n, dt);
  if (M == 0 || n == 0) return;
  const Tiles tl(M, n);
  TWINKLE_DISPATCH_FLOATS(dt, "swiglu_bwd", [&] {
    const scalar_t* dyp = dy.data_ptr<scalar_t>();
    const scalar_t* gp = g.data_ptr<scalar_t>();
    const scalar_t* up = u.data_ptr<scalar_t>();
    scalar_t* dgp = dg.data_ptr<scalar_t>();
    scalar_t* dup = du.data_ptr<scalar_t>();
    const int64_t s_dy = dy.stride(0), s_g = g.stride(0), s_u = u.stride(0), s_dg = dg.stride(0), s_du = du.stride(0);
    at::parallel_for(0, tl.count, tl.grain, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t m = t / tl.per_row, c0 = (t % tl.per_row) * kCols, c1 = std::min(n, c0 + kCols);
        for (int64_t j = c0; j < c1; j += kBlock) {
          fVec da, db, ga, gb, ua, ub;
          const int64_t k = c1 - j;
          load2(dyp + m * s_dy + j, k, da, db);
          load2(gp + m * s_g + j, k, ga, gb);
          load2(up + m * s_u + j, k, ua, ub);
          const fVec sa = sigmoid(ga), sb = sigmoid(gb);
          store2(dgp + m * s_dg + j, k, da * ua * silu_grad(ga, sa), db * ub * silu_grad(gb, sb));
          store2(dup + m * s_du + j, k, da * (ga * sa), db * (gb * sb));
        }
      }
    });
  });
}

}  // namespace
}  // namespace twinkle

TORCH_LIBRARY_FRAGMENT(TWINKLE_NS, m) {
  m.def("swiglu_fwd(Tensor gate, Tensor up, Tensor(a!) out) -> ()", &twinkle::swiglu_fwd);
  m.def("swiglu_bwd(Tensor dy, Tensor gate, Tensor up, Tensor(a!) dgate, Tensor(b!) dup) -> ()",
        &twinkle::swiglu_bwd);
}
