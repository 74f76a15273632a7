// Gated RMSNorm (Qwen3.5 / Qwen3-Next RMSNormGated) forward and backward on the CPU.
//
//   y  = xhat * w * silu(g),            xhat = x * rstd,  rstd = 1 / sqrt(mean(x^2) + eps)
//   dg = dy * xhat * w * silu'(g)
//   dw = sum_rows dy * silu(g) * xhat
//   dx = rstd * (h - xhat * mean(h * xhat)),   h = dy * silu(g) * w
//
// x, g, y, dy, dx, dg: [M, N] in float / bfloat16 / half; w: [N] fp32; rstd: [M] fp32;
// dw_partial: [T, N] fp32, zero-filled by the caller, one row per task (summed in Python).
#include "common/activation.h"

#include <vector>

namespace twinkle {
namespace {

template <typename T>
void gated_fwd_rows(const T* x, const T* g, const float* w, T* y, float* rstd, int64_t m0, int64_t m1,
                    int64_t N, float eps) {
  for (int64_t m = m0; m < m1; ++m) {
    const T* xr = x + m * N;
    const T* gr = g + m * N;
    T* yr = y + m * N;
    const float r = inv_rms(xr, N, eps);
    rstd[m] = r;
    const fVec vr(r);
    for (int64_t j = 0; j < N; j += kBlock) {
      fVec a, b, ga, gb, wa, wb;
      const int64_t n = N - j;
      load2(xr + j, n, a, b);
      load2(gr + j, n, ga, gb);
      load2(w + j, n, wa, wb);
      store2(yr + j, n, a * vr * wa * (ga * sigmoid(ga)), b * vr * wb * (gb * sigmoid(gb)));
    }
  }
}

// One row of h = dy * silu(g) * w is kept in `h` (fp32, L1/L2 resident) between the two passes,
// so the sigmoid is evaluated once per element and pass 2 reads only x and h.
template <typename T>
void gated_bwd_rows(const T* dy, const T* x, const T* g, const float* w, const float* rstd, T* dx, T* dg,
                    float* dw_acc, float* h, int64_t m0, int64_t m1, int64_t N) {
  const float invN = 1.f / float(N);
  for (int64_t m = m0; m < m1; ++m) {
    const int64_t off = m * N;
    const fVec vr(rstd[m]);
    fVec c0(0.f), c1(0.f);
    for (int64_t j = 0; j < N; j += kBlock) {
      fVec a, b, da, db, ga, gb, wa, wb;
      const int64_t n = N - j;
      load2(x + off + j, n, a, b);
      load2(dy + off + j, n, da, db);
      load2(g + off + j, n, ga, gb);
      load2(w + j, n, wa, wb);
      const fVec sa = sigmoid(ga), sb = sigmoid(gb);
      const fVec xa = a * vr, xb = b * vr;  // xhat
      store2(dg + off + j, n, da * xa * wa * silu_grad(ga, sa), db * xb * wb * silu_grad(gb, sb));
      const fVec ua = da * (ga * sa), ub = db * (gb * sb);  // dy * silu(g)
      const fVec ha = ua * wa, hb = ub * wb;
      store2(h + j, n, ha, hb);
      c0 = at::vec::fmadd(ha, xa, c0);
      c1 = at::vec::fmadd(hb, xb, c1);
      if (dw_acc) {
        fVec pa, pb;
        load2(dw_acc + j, n, pa, pb);
        store2(dw_acc + j, n, at::vec::fmadd(ua, xa, pa), at::vec::fmadd(ub, xb, pb));
      }
    }
    const fVec vc(hsum(c0 + c1) * invN);
    for (int64_t j = 0; j < N; j += kBlock) {
      fVec a, b, ha, hb;
      const int64_t n = N - j;
      load2(x + off + j, n, a, b);
      load2(h + j, n, ha, hb);
      store2(dx + off + j, n, vr * (ha - a * vr * vc), vr * (hb - b * vr * vc));
    }
  }
}

void check_rows(const at::Tensor& t, const at::Tensor& like, const char* name) {
  check_cpu_contig(t, name);
  TORCH_CHECK(t.sizes() == like.sizes(), name, " must have the shape of x, got ", t.sizes(), " vs ", like.sizes());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have the dtype of x");
}

void gated_rms_norm_fwd(const at::Tensor& x, const at::Tensor& g, const at::Tensor& w, double eps, at::Tensor& y,
                        at::Tensor& rstd) {
  check_cpu_contig(x, "x");
  TORCH_CHECK(x.dim() == 2, "gated_rms_norm_fwd: x must be [M, N]");
  check_rows(g, x, "gate");
  check_rows(y, x, "out");
  check_cpu_contig(w, "weight");
  check_cpu_contig(rstd, "rstd");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == at::kFloat, "weight must be fp32 [N]");
  TORCH_CHECK(rstd.dim() == 1 && rstd.size(0) == x.size(0) && rstd.scalar_type() == at::kFloat,
              "rstd must be fp32 [M]");
  const int64_t M = x.size(0), N = x.size(1);
  if (M == 0 || N == 0) return;
  TWINKLE_DISPATCH_FLOATS(x.scalar_type(), "gated_rms_norm_fwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* gp = g.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const float* wp = w.data_ptr<float>();
    float* rp = rstd.data_ptr<float>();
    at::parallel_for(0, M, row_grain(N), [&](int64_t m0, int64_t m1) {
      gated_fwd_rows<scalar_t>(xp, gp, wp, yp, rp, m0, m1, N, float(eps));
    });
  });
}

void gated_rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& g, const at::Tensor& w,
                        const at::Tensor& rstd, at::Tensor& dx, at::Tensor& dg, at::Tensor& dw_partial) {
  check_cpu_contig(x, "x");
  TORCH_CHECK(x.dim() == 2, "gated_rms_norm_bwd: x must be [M, N]");
  check_rows(dy, x, "grad_output");
  check_rows(g, x, "gate");
  check_rows(dx, x, "grad_x");
  check_rows(dg, x, "grad_gate");
  check_cpu_contig(w, "weight");
  check_cpu_contig(rstd, "rstd");
  const int64_t M = x.size(0), N = x.size(1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == N && w.scalar_type() == at::kFloat, "weight must be fp32 [N]");
  TORCH_CHECK(rstd.dim() == 1 && rstd.size(0) == M && rstd.scalar_type() == at::kFloat, "rstd must be fp32 [M]");
  const bool want_dw = dw_partial.numel() > 0;
  if (want_dw) {
    check_cpu_contig(dw_partial, "dw_partial");
    TORCH_CHECK(dw_partial.dim() == 2 && dw_partial.size(1) == N && dw_partial.scalar_type() == at::kFloat,
                "dw_partial must be fp32 [T, N]");
  }
  if (M == 0 || N == 0) return;
  const int64_t tasks = bwd_tasks(want_dw ? dw_partial.size(0) : std::max<int64_t>(1, at::get_num_threads()), M, N);
  TWINKLE_DISPATCH_FLOATS(x.scalar_type(), "gated_rms_norm_bwd", [&] {
    const scalar_t* dyp = dy.data_ptr<scalar_t>();
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* gp = g.data_ptr<scalar_t>();
    scalar_t* dxp = dx.data_ptr<scalar_t>();
    scalar_t* dgp = dg.data_ptr<scalar_t>();
    const float* wp = w.data_ptr<float>();
    const float* rp = rstd.data_ptr<float>();
    float* dwp = want_dw ? dw_partial.data_ptr<float>() : nullptr;
    // Task t owns row t of dw_partial, whichever thread runs it: correct for any thread count.
    at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> h(N);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t m0 = M * t / tasks, m1 = M * (t + 1) / tasks;
        gated_bwd_rows<scalar_t>(dyp, xp, gp, wp, rp, dxp, dgp, dwp ? dwp + t * N : nullptr, h.data(), m0, m1, N);
      }
    });
  });
}

}  // namespace
}  // namespace twinkle

TORCH_LIBRARY_FRAGMENT(TWINKLE_NS, m) {
  m.def("gated_rms_norm_fwd(Tensor x, Tensor gate, Tensor w, float eps, Tensor(a!) out, Tensor(b!) rstd) -> ()",
        &twinkle::gated_rms_norm_fwd);
  m.def("gated_rms_norm_bwd(Tensor dy, Tensor x, Tensor gate, Tensor w, Tensor rstd, Tensor(a!) dx, "
        "Tensor(b!) dgate, Tensor(c!) dw_partial) -> ()",
        &twinkle::gated_rms_norm_bwd);
}
