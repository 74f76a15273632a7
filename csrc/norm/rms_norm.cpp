// RMSNorm forward and backward on the CPU.
//
//   y    = x * rstd * (offset + w),     rstd = 1 / sqrt(mean(x^2) + eps)
//   dx   = rstd * (g - xhat * mean(g * xhat)),   g = dy * (offset + w),  xhat = x * rstd
//   dw   = sum_rows dy * xhat
//
// x, y, dy, dx: [M, N] in float / bfloat16 / half; w and dw: [N] fp32; rstd: [M] fp32.
// Outputs are written into tensors the caller allocates (so tests can poison them and
// benchmarks can keep allocation out of the timed region).
#include "common/autograd.h"
#include "common/vec.h"

#include <ATen/ops/zeros.h>

namespace twinkle {
namespace {

template <typename T>
void rms_fwd_rows(const T* x, const float* w, T* y, float* rstd, int64_t m0, int64_t m1, int64_t N,
                  float eps, float offset) {
  const fVec voff(offset);
  for (int64_t m = m0; m < m1; ++m) {
    const T* xr = x + m * N;
    T* yr = y + m * N;
    const float r = inv_rms(xr, N, eps);
    rstd[m] = r;
    const fVec vr(r);
    for (int64_t j = 0; j < N; j += kBlock) {
      fVec a, b, wa, wb;
      const int64_t n = N - j;
      load2(xr + j, n, a, b);
      load2(w + j, n, wa, wb);
      store2(yr + j, n, a * vr * (wa + voff), b * vr * (wb + voff));
    }
  }
}

template <typename T>
void rms_bwd_rows(const T* dy, const T* x, const float* w, const float* rstd, T* dx, float* dw_acc,
                  int64_t m0, int64_t m1, int64_t N, float offset) {
  const fVec voff(offset);
  const float invN = 1.f / float(N);
  for (int64_t m = m0; m < m1; ++m) {
    const T* xr = x + m * N;
    const T* dyr = dy + m * N;
    const fVec vr(rstd[m]);
    // c = mean(dy * (offset + w) * xhat)
    fVec c0(0.f), c1(0.f);
    for (int64_t j = 0; j < N; j += kBlock) {
      fVec a, b, ga, gb, wa, wb;
      const int64_t n = N - j;
      load2(xr + j, n, a, b);
      load2(dyr + j, n, ga, gb);
      load2(w + j, n, wa, wb);
      c0 = at::vec::fmadd(ga * (wa + voff), a, c0);
      c1 = at::vec::fmadd(gb * (wb + voff), b, c1);
      if (dw_acc) {
        fVec da, db;
        load2(dw_acc + j, n, da, db);
        store2(dw_acc + j, n, at::vec::fmadd(ga, a * vr, da), at::vec::fmadd(gb, b * vr, db));
      }
    }
    const fVec vc(hsum(c0 + c1) * rstd[m] * invN);
    for (int64_t j = 0; j < N; j += kBlock) {
      fVec a, b, ga, gb, wa, wb;
      const int64_t n = N - j;
      load2(xr + j, n, a, b);
      load2(dyr + j, n, ga, gb);
      load2(w + j, n, wa, wb);
      // dx = rstd * (g - xhat * c') with xhat = x * rstd, c' = c * rstd / N folded into vc
      store2(dx + m * N + j, n, vr * (ga * (wa + voff) - a * vr * vc), vr * (gb * (wb + voff) - b * vr * vc));
    }
  }
}

void rms_norm_fwd(const at::Tensor& x, const at::Tensor& w, double eps, double offset, at::Tensor& y,
                  at::Tensor& rstd) {
  check_cpu_contig(x, "x");
  check_cpu_contig(w, "weight");
  check_cpu_contig(y, "out");
  check_cpu_contig(rstd, "rstd");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1), "rms_norm_fwd: x [M, N], weight [N]");
  TORCH_CHECK(w.scalar_type() == at::kFloat && rstd.scalar_type() == at::kFloat, "weight and rstd must be fp32");
  TORCH_CHECK(y.sizes() == x.sizes() && y.scalar_type() == x.scalar_type(), "out must match x");
  const int64_t M = x.size(0), N = x.size(1);
  TORCH_CHECK(rstd.dim() == 1 && rstd.size(0) == M, "rstd must be [M]");
  if (M == 0 || N == 0) return;
  TWINKLE_DISPATCH_FLOATS(x.scalar_type(), "rms_norm_fwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const float* wp = w.data_ptr<float>();
    float* rp = rstd.data_ptr<float>();
    at::parallel_for(0, M, row_grain(N), [&](int64_t m0, int64_t m1) {
      rms_fwd_rows<scalar_t>(xp, wp, yp, rp, m0, m1, N, float(eps), float(offset));
    });
  });
}

// dw_partial: [num_threads, N] fp32 zero-filled scratch, or empty when dw is not needed.
void rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w, const at::Tensor& rstd,
                  double offset, at::Tensor& dx, at::Tensor& dw_partial) {
  check_cpu_contig(dy, "grad_output");
  check_cpu_contig(x, "x");
  check_cpu_contig(w, "weight");
  check_cpu_contig(rstd, "rstd");
  check_cpu_contig(dx, "grad_x");
  TORCH_CHECK(x.dim() == 2, "rms_norm_bwd: x must be [M, N]");
  const int64_t M = x.size(0), N = x.size(1);
  TORCH_CHECK(dy.sizes() == x.sizes() && dx.sizes() == x.sizes(), "rms_norm_bwd: shapes must match x");
  TORCH_CHECK(dy.scalar_type() == x.scalar_type() && dx.scalar_type() == x.scalar_type(),
              "rms_norm_bwd: grad_output and grad_x must have the dtype of x");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == N && w.scalar_type() == at::kFloat, "weight must be fp32 [N]");
  TORCH_CHECK(rstd.dim() == 1 && rstd.size(0) == M && rstd.scalar_type() == at::kFloat, "rstd must be fp32 [M]");
  const bool want_dw = dw_partial.numel() > 0;
  if (want_dw) {
    check_cpu_contig(dw_partial, "dw_partial");
    TORCH_CHECK(dw_partial.dim() == 2 && dw_partial.size(1) == N && dw_partial.scalar_type() == at::kFloat,
                "dw_partial must be fp32 [T, N]");
  }
  if (M == 0 || N == 0) return;
  const int64_t T = want_dw ? dw_partial.size(0) : 0;
  TWINKLE_DISPATCH_FLOATS(x.scalar_type(), "rms_norm_bwd", [&] {
    const scalar_t* dyp = dy.data_ptr<scalar_t>();
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* dxp = dx.data_ptr<scalar_t>();
    const float* wp = w.data_ptr<float>();
    const float* rp = rstd.data_ptr<float>();
    float* dwp = want_dw ? dw_partial.data_ptr<float>() : nullptr;
    // One task per thread slot so each owns a row of dw_partial.
    const int64_t tasks = bwd_tasks(want_dw ? T : std::max<int64_t>(1, at::get_num_threads()), M, N);
    at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t m0 = M * t / tasks, m1 = M * (t + 1) / tasks;
        rms_bwd_rows<scalar_t>(dyp, xp, wp, rp, dxp, dwp ? dwp + t * N : nullptr, m0, m1, N, float(offset));
      }
    });
  });
}

// y = x * rstd * (offset + w) with its backward in C++: x [..., N] (any strides), weight [N] of any
// float dtype (the kernels read it as fp32); y and dx are fresh contiguous tensors of x's shape and
// dtype, dweight has weight's dtype (computed only when weight needs a gradient).
struct RMSNormFunction : public torch::autograd::Function<RMSNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps,
                            double offset, bool poison) {
    at::Tensor x2 = as_rows(x, "x").contiguous();
    at::Tensor w32 = weight.to(at::kFloat).contiguous();
    at::Tensor y = fresh(x.sizes(), x.options(), poison);
    at::Tensor y2 = y.view(x2.sizes());
    at::Tensor rstd = fresh({x2.size(0)}, x.options().dtype(at::kFloat), poison);
    rms_norm_fwd(x2, w32, eps, offset, y2, rstd);
    ctx->save_for_backward({x2, w32, rstd});
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["poison"] = poison;
    ctx->saved_data["shape"] = x.sizes().vec();
    ctx->saved_data["wdtype"] = weight.scalar_type();
    return y;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    refuse_create_graph("rms_norm");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x2 = saved[0], &w32 = saved[1], &rstd = saved[2];
    const bool poison = ctx->saved_data["poison"].toBool();
    at::Tensor dy2 = as_rows(grads[0].to(x2.scalar_type()), "grad_output").contiguous();
    at::Tensor dx = fresh(ctx->saved_data["shape"].toIntVector(), x2.options(), poison);
    at::Tensor dx2 = dx.view(x2.sizes());
    const bool need_dw = ctx->needs_input_grad(1);
    // one fp32 row per task (thread slot), summed here in a fixed order: the result does not
    // depend on the threads' scheduling
    at::Tensor scratch = need_dw ? at::zeros({std::max<int64_t>(1, at::get_num_threads()), x2.size(1)},
                                             x2.options().dtype(at::kFloat))
                                 : at::empty({0}, x2.options().dtype(at::kFloat));
    rms_norm_bwd(dy2, x2, w32, rstd, ctx->saved_data["offset"].toDouble(), dx2, scratch);
    at::Tensor dw;
    if (need_dw) {
      dw = scratch.size(0) == 1 ? scratch[0] : scratch.sum(0);
      dw = dw.to(ctx->saved_data["wdtype"].toScalarType());
    }
    return {dx, dw, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset, bool poison) {
  return RMSNormFunction::apply(x, weight, eps, offset, poison);
}

}  // namespace
}  // namespace twinkle

TORCH_LIBRARY_FRAGMENT(TWINKLE_NS, m) {
  m.def("rms_norm_fwd(Tensor x, Tensor w, float eps, float offset, Tensor(a!) out, Tensor(b!) rstd) -> ()",
        &twinkle::rms_norm_fwd);
  m.def("rms_norm_bwd(Tensor dy, Tensor x, Tensor w, Tensor rstd, float offset, Tensor(a!) dx, "
        "Tensor(b!) dw_partial) -> ()",
        &twinkle::rms_norm_bwd);
  // differentiable: the autograd of the two above, in C++ (common/autograd.h)
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float offset=0., bool poison=False) -> Tensor",
        &twinkle::rms_norm);
}
