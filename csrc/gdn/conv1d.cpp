// Depthwise causal conv1d (transformers' causal_conv1d_fn layout) on the CPU, forward and
// backward, fp32.
//
//   pre[b, d, t] = bias[d] + sum_i w[d, i] x[b, d, t - (W - 1) + i]   (zero before the sequence start)
//   y = silu(pre) or pre
//
// x, y, dy, dx: [B, D, T]; w [D, W]; bias [D] or empty; starts [T] int64 (the first position
// of each token's sequence, for packed inputs) or empty. Rows (b, d) run in parallel; the
// weight and bias gradients are written per row ([B, D, W], [B, D]) and summed over B in Python.
//
// Each row is cut into its sequences; a sequence is copied behind W - 1 zeros, so that every
// tap is one branch-free vector axpy (forward, dx) or dot product (dw) over the whole sequence.
// (The per-element loop with a bounds test per tap that this replaces ran about 10 ns per output.)
#include "common/activation.h"
#include "gdn/gdn_common.h"

namespace twinkle {
namespace gdn {
namespace {

struct ConvArgs {
  int64_t D, T, W;
  const float *w, *bias;
  std::vector<int64_t> seg;  // sequence boundaries within a row: 0 = seg[0] < ... < seg.back() = T
};

ConvArgs conv_args(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, const at::Tensor& starts) {
  check_cpu_contig(x, "x");
  check_cpu_contig(w, "weight");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "causal_conv1d works in fp32");
  TORCH_CHECK(bias.numel() == 0 || (bias.is_contiguous() && bias.scalar_type() == at::kFloat), "bias: fp32 [D]");
  TORCH_CHECK(starts.numel() == 0 || (starts.is_contiguous() && starts.scalar_type() == at::kLong &&
                                      starts.numel() == x.size(2)), "starts: int64 [T]");
  const int64_t T = x.size(2);
  std::vector<int64_t> seg{0};
  if (starts.numel()) {
    const int64_t* st = starts.data_ptr<int64_t>();
    TORCH_CHECK(T == 0 || st[0] == 0, "starts: the first token starts a sequence (starts[0] == 0)");
    for (int64_t t = 1; t < T; ++t) {
      TORCH_CHECK(st[t] == st[t - 1] || st[t] == t, "starts: each token's entry must be its sequence's first "
                  "position (non-decreasing runs)");
      if (st[t] != st[t - 1]) seg.push_back(t);
    }
  }
  if (T > 0) seg.push_back(T);
  return ConvArgs{x.size(1), T, w.size(1), w.data_ptr<float>(), bias.numel() ? bias.data_ptr<float>() : nullptr,
                  std::move(seg)};
}

// xpad = [0] * (W - 1) ++ x[0:n]
inline void pad_front(const float* x, int64_t n, int64_t W, float* xpad) {
  std::fill(xpad, xpad + W - 1, 0.f);
  std::copy(x, x + n, xpad + W - 1);
}

// pre[0:n] = bias + sum_i w[i] * xpad[i : i + n]
inline void conv_seq(const float* xpad, int64_t n, const float* wd, int64_t W, float bias, float* pre) {
  std::fill(pre, pre + n, bias);
  for (int64_t i = 0; i < W; ++i) axpy(wd[i], xpad + i, pre, n);
}

inline void silu_inplace(float* y, int64_t n) {
  int64_t t = 0;
  for (; t + kF <= n; t += kF) {
    const fVec p = fVec::loadu(y + t);
    (p * sigmoid(p)).store(y + t);
  }
  if (t < n) {
    const fVec p = fVec::loadu(y + t, n - t);
    (p * sigmoid(p)).store(y + t, n - t);
  }
}

// dy[0:n] *= silu'(pre[0:n]), in place
inline void silu_backward_inplace(const float* pre, float* dy, int64_t n) {
  int64_t t = 0;
  for (; t + kF <= n; t += kF) {
    const fVec p = fVec::loadu(pre + t);
    (fVec::loadu(dy + t) * silu_grad(p, sigmoid(p))).store(dy + t);
  }
  if (t < n) {
    const fVec p = fVec::loadu(pre + t, n - t);
    (fVec::loadu(dy + t, n - t) * silu_grad(p, sigmoid(p))).store(dy + t, n - t);
  }
}

inline float sum(const float* a, int64_t n) {
  fVec acc(0.f);
  int64_t i = 0;
  for (; i + kF <= n; i += kF) acc = acc + fVec::loadu(a + i);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i];
  return s;
}

void causal_conv1d_fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, const at::Tensor& starts,
                       bool silu, at::Tensor& y) {
  const ConvArgs c = conv_args(x, w, bias, starts);
  check_cpu_contig(y, "out");
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t rows = x.size(0) * c.D;
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(c.T, 1)), [&](int64_t r0, int64_t r1) {
    std::vector<float> xpad(c.T + c.W);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t d = r % c.D;
      const float* wd = c.w + d * c.W;
      const float b = c.bias ? c.bias[d] : 0.f;
      for (size_t k = 0; k + 1 < c.seg.size(); ++k) {
        const int64_t s = c.seg[k], n = c.seg[k + 1] - s;
        pad_front(xp + r * c.T + s, n, c.W, xpad.data());
        float* yr = yp + r * c.T + s;
        conv_seq(xpad.data(), n, wd, c.W, b, yr);
        if (silu) silu_inplace(yr, n);
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
    std::vector<float> xpad(c.T + c.W), dpad(c.T + c.W), pre(c.T);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t d = r % c.D;
      const float* wd = c.w + d * c.W;
      const float b = c.bias ? c.bias[d] : 0.f;
      float* dwr = dwp + r * c.W;
      std::fill(dwr, dwr + c.W, 0.f);
      float db = 0.f;
      for (size_t k = 0; k + 1 < c.seg.size(); ++k) {
        const int64_t s = c.seg[k], n = c.seg[k + 1] - s;
        pad_front(xp + r * c.T + s, n, c.W, xpad.data());
        // dpre = dy * silu'(pre), followed by W - 1 zeros: dx reads past the sequence's end
        float* dpre = dpad.data();
        std::copy(dyp + r * c.T + s, dyp + r * c.T + s + n, dpre);
        std::fill(dpre + n, dpre + n + c.W - 1, 0.f);
        if (silu) {
          conv_seq(xpad.data(), n, wd, c.W, b, pre.data());
          silu_backward_inplace(pre.data(), dpre, n);
        }
        db += sum(dpre, n);
        for (int64_t i = 0; i < c.W; ++i) dwr[i] += dot(dpre, xpad.data() + i, n);
        // x[p] feeds pre[p + W - 1 - i] through tap i
        float* dxr = dxp + r * c.T + s;
        std::fill(dxr, dxr + n, 0.f);
        for (int64_t i = 0; i < c.W; ++i) axpy(wd[i], dpre + (c.W - 1 - i), dxr, n);
      }
      dbp[r] = db;
    }
  });
}

// Decode step with a rolling state (transformers' causal_conv1d_update): per row, the window is
// state[0:L] ++ x[0:S]; y[s] = bias + sum_i w[i] window[L + s - (W - 1) + i], then state becomes
// the window's last L columns, in place. x, y: [B, D, S]; state: [B, D, L], L >= W - 1; fp32.
void causal_conv1d_update_fwd(const at::Tensor& x, at::Tensor& state, const at::Tensor& w, const at::Tensor& bias,
                              bool silu, at::Tensor& y) {
  check_cpu_contig(x, "x");
  check_cpu_contig(state, "conv_state");
  check_cpu_contig(w, "weight");
  check_cpu_contig(y, "out");
  TORCH_CHECK(x.scalar_type() == at::kFloat && state.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
                  y.scalar_type() == at::kFloat,
              "causal_conv1d_update works in fp32");
  TORCH_CHECK(bias.numel() == 0 || (bias.is_contiguous() && bias.scalar_type() == at::kFloat), "bias: fp32 [D]");
  TORCH_CHECK(x.dim() == 3 && state.dim() == 3 && w.dim() == 2 && y.sizes() == x.sizes(), "x/out [B, D, S], "
              "conv_state [B, D, L], weight [D, W]");
  const int64_t D = x.size(1), S = x.size(2), L = state.size(2), W = w.size(1);
  TORCH_CHECK(state.size(0) == x.size(0) && state.size(1) == D && w.size(0) == D && L >= W - 1,
              "conv_state must be [B, D, L] with L >= W - 1");
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float *sp = state.data_ptr<float>(), *yp = y.data_ptr<float>();
  const int64_t rows = x.size(0) * D;
  // A decode step has S = 1 or a few tokens: a short scalar loop per row, with the SiLU
  // vectorised over all of a task's rows afterwards (vector code per row of length 1 cost
  // more than it saved).
  at::parallel_for(0, rows, 2048, [&](int64_t r0, int64_t r1) {
    int64_t d = r0 % D;
    for (int64_t r = r0; r < r1; ++r, d = (d + 1 == D) ? 0 : d + 1) {
      const float* wd = wp + d * W;
      const float* xr = xp + r * S;
      float* st = sp + r * L;
      float* yr = yp + r * S;
      const float b = bp ? bp[d] : 0.f;
      if (S == 1) {  // one token: the taps read the state's last W - 1 entries and x
        float acc = b + wd[W - 1] * xr[0];
        const float* tail = st + L - (W - 1);
        for (int64_t i = 0; i + 1 < W; ++i) acc += wd[i] * tail[i];
        yr[0] = acc;
        if (L > 0) {  // an empty state (W == 1, L == 0) keeps nothing: st[L - 1] would be st[-1]
          for (int64_t j = 0; j + 1 < L; ++j) st[j] = st[j + 1];
          st[L - 1] = xr[0];
        }
        continue;
      }
      for (int64_t s = 0; s < S; ++s) {
        float acc = b;
        for (int64_t i = 0; i < W; ++i) {
          const int64_t k = L + s - (W - 1) + i;  // index into state ++ x
          acc += wd[i] * (k < L ? st[k] : xr[k - L]);
        }
        yr[s] = acc;
      }
      // roll: the state becomes the last L of state ++ x
      if (S >= L) {
        std::copy(xr + S - L, xr + S, st);
      } else {
        std::copy(st + S, st + L, st);
        std::copy(xr, xr + S, st + L - S);
      }
    }
    if (silu) silu_inplace(yp + r0 * S, (r1 - r0) * S);
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
  m.def("causal_conv1d_update_fwd(Tensor x, Tensor(a!) state, Tensor w, Tensor bias, bool silu, Tensor(b!) y) -> ()",
        &twinkle::gdn::causal_conv1d_update_fwd);
}
