// One AdamW step over many tensors in a single pass each: fp32 master weights and moments, the
// gradient read once and scaled on the fly, and the model's low-precision copy written from the
// new weights in the same pass.
//
//   g  = grad * grad_factor                       (the 1 / tokens scaling and the clip, folded)
//   p  = p * (1 - lr * weight_decay)              (decoupled weight decay)
//   m  = m + (g - m) * (1 - beta1)
//   v  = v * beta2 + g * g * (1 - beta2)
//   p  = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//   out = p rounded to out's dtype                (when out_params is given)
//   grad = 0                                      (with zero_grads: the next step's accumulation
//                                                  buffer, without a pass of its own)
//
// t is each tensor's own step count: steps[k] (a 0-dim float32 tensor, torch's optimizer state)
// is incremented first. params, exp_avgs, exp_avg_sqs: contiguous float32; grads: contiguous
// float32 / bfloat16 / float16; out_params: empty, or one contiguous float32 / bfloat16 / float16
// tensor per param. The arithmetic is fp32 per element with the per-tensor constants in double,
// as torch's own AdamW. A megatron mixed-precision step otherwise makes six passes over these
// arrays (scale, clip, the optimizer's own, the copy back to bf16).
#include "../common/vec.h"

#include <vector>

namespace twinkle {
namespace {

constexpr int64_t kGrain = 1 << 15;   // elements per parallel range

struct AdamConsts {
  float decay;        // 1 - lr * weight_decay
  float one_m_b1;     // 1 - beta1
  float beta2, one_m_b2;
  float step_size;    // lr / (1 - beta1^t)
  float inv_bc2_sqrt; // 1 / sqrt(1 - beta2^t)
  float eps, factor;
};

template <typename G, typename O>
void adamw_range(float* p, G* g, float* m, float* v, O* out, int64_t begin, int64_t end,
                 const AdamConsts& c, bool zero_grads) {
  const fVec decay(c.decay), one_m_b1(c.one_m_b1), beta2(c.beta2), one_m_b2(c.one_m_b2);
  const fVec step_size(c.step_size), inv_bc2_sqrt(c.inv_bc2_sqrt), eps(c.eps), factor(c.factor);
  for (int64_t i = begin; i < end; i += kBlock) {
    const int64_t n = std::min<int64_t>(kBlock, end - i);
    fVec p0, p1, g0, g1, m0, m1, v0, v1;
    load2(p + i, n, p0, p1);
    load2(g + i, n, g0, g1);
    if (zero_grads) store2(g + i, n, fVec(0.f), fVec(0.f));
    load2(m + i, n, m0, m1);
    load2(v + i, n, v0, v1);
    auto one = [&](fVec& pp, fVec gg, fVec& mm, fVec& vv) {
      gg = gg * factor;
      pp = pp * decay;
      mm = mm + (gg - mm) * one_m_b1;
      vv = vv * beta2 + gg * gg * one_m_b2;
      const fVec denom = vv.sqrt() * inv_bc2_sqrt + eps;
      pp = pp - step_size * mm / denom;
    };
    one(p0, g0, m0, v0);
    one(p1, g1, m1, v1);
    store2(p + i, n, p0, p1);
    store2(m + i, n, m0, m1);
    store2(v + i, n, v0, v1);
    if constexpr (!std::is_same_v<O, void>) store2(out + i, n, p0, p1);
  }
}

template <typename G, typename O>
void adamw_tensor(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
                  const at::Tensor* out, const AdamConsts& c, bool zero_grads) {
  float* pp = p.data_ptr<float>();
  G* gp = g.data_ptr<G>();
  float* mp = m.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  O* op = nullptr;
  if constexpr (!std::is_same_v<O, void>) op = out->data_ptr<O>();
  // elementwise: any split gives the same result; each range ends with its own tail block
  at::parallel_for(0, p.numel(), kGrain, [&](int64_t b, int64_t e) {
    adamw_range<G, O>(pp, gp, mp, vp, op, b, e, c, zero_grads);
  });
}

template <typename G>
void adamw_dispatch_out(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
                        const at::Tensor* out, const AdamConsts& c, bool z) {
  if (out == nullptr) return adamw_tensor<G, void>(p, g, m, v, out, c, z);
  switch (out->scalar_type()) {
    case at::kFloat: return adamw_tensor<G, float>(p, g, m, v, out, c, z);
    case at::kBFloat16: return adamw_tensor<G, at::BFloat16>(p, g, m, v, out, c, z);
    case at::kHalf: return adamw_tensor<G, at::Half>(p, g, m, v, out, c, z);
    default: TORCH_CHECK(false, "adamw_step: out_params has dtype ", out->scalar_type());
  }
}

void check_f32(const at::Tensor& t, const char* what, size_t k, const at::Tensor& p) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              "adamw_step: ", what, "[", k, "] must be a contiguous float32 CPU tensor");
  TORCH_CHECK(t.numel() == p.numel(), "adamw_step: ", what, "[", k, "] has ", t.numel(),
              " elements, params[", k, "] ", p.numel());
}

void adamw_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                at::TensorList exp_avg_sqs, at::TensorList steps, at::TensorList out_params, double lr,
                double beta1, double beta2, double eps, double weight_decay, double grad_factor, bool zero_grads) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n,
              "adamw_step: params, grads, exp_avgs, exp_avg_sqs and steps must have one entry each per param");
  TORCH_CHECK(out_params.empty() || out_params.size() == n, "adamw_step: out_params must be empty or one per param");
  for (size_t k = 0; k < n; ++k) {
    check_f32(params[k], "params", k, params[k]);
    check_f32(exp_avgs[k], "exp_avgs", k, params[k]);
    check_f32(exp_avg_sqs[k], "exp_avg_sqs", k, params[k]);
    TORCH_CHECK(grads[k].device().is_cpu() && grads[k].is_contiguous() && grads[k].numel() == params[k].numel(),
                "adamw_step: grads[", k, "] must be a contiguous CPU tensor the size of params[", k, "]");
    TORCH_CHECK(steps[k].device().is_cpu() && steps[k].scalar_type() == at::kFloat && steps[k].numel() == 1,
                "adamw_step: steps[", k, "] must be a one-element float32 CPU tensor");
    if (!out_params.empty())
      TORCH_CHECK(out_params[k].device().is_cpu() && out_params[k].is_contiguous() &&
                      out_params[k].numel() == params[k].numel(),
                  "adamw_step: out_params[", k, "] must be a contiguous CPU tensor the size of params[", k, "]");
  }
  for (size_t k = 0; k < n; ++k) {
    float* step_ptr = steps[k].data_ptr<float>();
    *step_ptr += 1.0f;
    const double t = static_cast<double>(*step_ptr);
    AdamConsts c;
    c.decay = static_cast<float>(1.0 - lr * weight_decay);
    c.one_m_b1 = static_cast<float>(1.0 - beta1);
    c.beta2 = static_cast<float>(beta2);
    c.one_m_b2 = static_cast<float>(1.0 - beta2);
    c.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, t)));
    c.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(beta2, t)));
    c.eps = static_cast<float>(eps);
    c.factor = static_cast<float>(grad_factor);
    const at::Tensor* out = out_params.empty() ? nullptr : &out_params[k];
    switch (grads[k].scalar_type()) {
      case at::kFloat: adamw_dispatch_out<float>(params[k], grads[k], exp_avgs[k], exp_avg_sqs[k], out, c, zero_grads); break;
      case at::kBFloat16: adamw_dispatch_out<at::BFloat16>(params[k], grads[k], exp_avgs[k], exp_avg_sqs[k], out, c, zero_grads); break;
      case at::kHalf: adamw_dispatch_out<at::Half>(params[k], grads[k], exp_avgs[k], exp_avg_sqs[k], out, c, zero_grads); break;
      default: TORCH_CHECK(false, "adamw_step: grads[", k, "] has dtype ", grads[k].scalar_type(),
                           "; expected float32, bfloat16 or float16");
    }
  }
}

}  // namespace
}  // namespace twinkle

TORCH_LIBRARY_FRAGMENT(TWINKLE_NS, m) {
  m.def("adamw_step(Tensor(a!)[] params, Tensor(f!)[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] steps, Tensor(e!)[] out_params, float lr, float beta1, float beta2, float eps, "
        "float weight_decay, float grad_factor, bool zero_grads) -> ()",
        &twinkle::adamw_step);
}
