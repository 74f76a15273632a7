// Depthwise causal conv1d (transformers' causal_conv1d_fn layout) on the CPU, forward and
// backward, fp32.
//
//   pre[b, d, t] = bias[d] + sum_i w[d, i] x[b, d, t - (W - 1) + i]   (zero before the sequence start)
//   y = silu(pre) or pre
//
// x, y, dy, dx: [B, D, T]; w [D, W]; bias [D] or empty; starts [T] int64 (the first position
// of each token's sequence, for packed inputs) or empty. Rows (b, d) run in parallel; the
// weight and bias gradients are written per row ([B, D, W], [B, D]) and summed over B in Python.
#include "gdn/gdn_common.h"

namespace twinkle {
namespace gdn {
namespace {

struct ConvArgs {
  int64_t D, T, W;
  const float *w, *bias;
  const int64_t* starts;
};

inline float pre_act(const ConvArgs& c, const float* xr, int64_t d, int64_t t) {
  const int64_t s0 = c.starts ? c.starts[t] : 0;
  const float* wd = c.w + d * c.W;
  float acc = c.bias ? c.bias[d] : 0.f;
  for (int64_t i = 0; i < c.W; ++i) {
    const int64_t p = t - (c.W - 1 - i);
    if (p >= s0) acc += wd[i] * xr[p];
  }
  return acc;
}

ConvArgs conv_args(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, const at::Tensor& starts) {
  check_cpu_contig(x, "x");
  check_cpu_contig(w, "weight");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "causal_conv1d works in fp32");
  TORCH_CHECK(bias.numel() == 0 || (bias.is_contiguous() && bias.scalar_type() == at::kFloat), "bias: fp32 [D]");
  TORCH_CHECK(starts.numel() == 0 || (starts.is_contiguous() && starts.scalar_type() == at::kLong &&
                                      starts.numel() == x.size(2)), "starts: int64 [T]");
  return ConvArgs{x.size(1), x.size(2), w.size(1), w.data_ptr<float>(),
                  bias.numel() ? bias.data_ptr<float>() : nullptr,
                  starts.numel() ? starts.data_ptr<int64_t>() : nullptr};
}

void causal_conv1d_fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, const at::Tensor& starts,
                       bool silu, at::Tensor& y) {
  const ConvArgs c = conv_args(x, w, bias, starts);
  check_cpu_contig(y, "out");
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t rows = x.size(0) * c.D;
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(c.T, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t d = r % c.D;
      const float* xr = xp + r * c.T;
      float* yr = yp + r * c.T;
      for (int64_t t = 0; t < c.T; ++t) {
        const float p = pre_act(c, xr, d, t);
        yr[t] = silu ? p / (1.f + std::exp(-p)) : p;
      }
    }
  });
}

void causal_conv1d_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                       const at::Tensor& starts, bool silu, at::Tensor& dx, at::Tensor& dw_rows,
                       at::Tensor& db_rows) {
  const ConvArgs c = conv_args(x, w, bias, starts);
  check_cpu_contig(dy, "grad_output");
  check_cpu_contig(dx, "grad_x");
  check_cpu_contig(dw_rows, "grad_weight rows");
  check_cpu_contig(db_rows, "grad_bias rows");
  const float *xp = x.data_ptr<float>(), *dyp = dy.data_ptr<float>();
  float *dxp = dx.data_ptr<float>(), *dwp = dw_rows.data_ptr<float>(), *dbp = db_rows.data_ptr<float>();
  const int64_t rows = x.size(0) * c.D;
  at::parallel_for(0, rows, std::max<int64_t>(1, 2048 / std::max<int64_t>(c.T, 1)), [&](int64_t r0, int64_t r1) {
    std::vector<float> dpre(c.T);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t d = r % c.D;
      const float* xr = xp + r * c.T;
      const float* dyr = dyp + r * c.T;
      const float* wd = c.w + d * c.W;
      float* dwr = dwp + r * c.W;
      float db = 0.f;
      std::fill(dwr, dwr + c.W, 0.f);
      for (int64_t t = 0; t < c.T; ++t) {
        float gd = dyr[t];
        if (silu) {
          const float p = pre_act(c, xr, d, t);
          const float sg = 1.f / (1.f + std::exp(-p));
          gd *= sg * (1.f + p * (1.f - sg));
        }
        dpre[t] = gd;
        db += gd;
        const int64_t s0 = c.starts ? c.starts[t] : 0;
        for (int64_t i = 0; i < c.W; ++i) {
          const int64_t p = t - (c.W - 1 - i);
          if (p >= s0) dwr[i] += gd * xr[p];
        }
      }
      dbp[r] = db;
      float* dxr = dxp + r * c.T;
      for (int64_t p = 0; p < c.T; ++p) {
        float acc = 0.f;
        for (int64_t i = 0; i < c.W; ++i) {
          const int64_t t = p + (c.W - 1 - i);
          // token t reads x[p] only when p lies in t's sequence
          if (t < c.T && (!c.starts || c.starts[t] <= p)) acc += wd[i] * dpre[t];
        }
        dxr[p] = acc;
      }
    }
  });
}

}  // namespace
}  // namespace gdn
}  // namespace twinkle

TORCH_LIBRARY_FRAGMENT(TWINKLE_NS, m) {
  m.def("causal_conv1d_fwd(Tensor x, Tensor w, Tensor bias, Tensor starts, bool silu, Tensor(a!) y) -> ()",
        &twinkle::gdn::causal_conv1d_fwd);
  m.def("causal_conv1d_bwd(Tensor dy, Tensor x, Tensor w, Tensor bias, Tensor starts, bool silu, "
        "Tensor(a!) dx, Tensor(b!) dw_rows, Tensor(c!) db_rows) -> ()",
        &twinkle::gdn::causal_conv1d_bwd);
}
