// Fused recurrent gated delta rule (decoding form) on the CPU, forward only, fp32.
//
// Token by token, per value head h (key head h / G), state S [K, V]:
//   S = exp(g_t) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
// q arrives already L2-normalised and scaled. Flat packed layout as in chunk.cpp:
// q, k [TT, H, K], v and o [TT, HV, V], g, beta [TT, HV], cu [N + 1]; hT [N, HV, K, V] is both
// the running state and the result. Tasks: (sequence, value head) pairs.
#include "gdn/gdn_common.h"

namespace twinkle {
namespace gdn {
namespace {

void gdn_recurrent_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                       const at::Tensor& beta, const at::Tensor& h0, const at::Tensor& cu, at::Tensor& o,
                       at::Tensor& hT) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &g, &beta, &o, &hT}) {
    check_cpu_contig(*t, "gdn_recurrent_fwd tensor");
    TORCH_CHECK(t->scalar_type() == at::kFloat, "gdn_recurrent_fwd works in fp32");
  }
  const auto offs = offsets(cu);
  const int64_t N = offs.size() - 1, H = q.size(1), HV = v.size(1), K = q.size(2), V = v.size(2), G = HV / H;
  const bool has_h0 = h0.numel() > 0;
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  const float* h0p = has_h0 ? h0.data_ptr<float>() : nullptr;
  float *op = o.data_ptr<float>(), *hp = hT.data_ptr<float>();
  const int64_t KV = K * V;
  at::parallel_for(0, N * HV, 1, [&](int64_t a, int64_t b) {
    std::vector<float> pred(V), delta(V);
    for (int64_t task = a; task < b; ++task) {
      const int64_t n = task / HV, h = task % HV;
      float* S = hp + task * KV;
      if (has_h0) std::copy(h0p + task * KV, h0p + (task + 1) * KV, S);
      else std::fill(S, S + KV, 0.f);
      for (int64_t t = offs[n]; t < offs[n + 1]; ++t) {
        const float* qt = qp + (t * H + h / G) * K;
        const float* kt = kp + (t * H + h / G) * K;
        const float* vt = vp + (t * HV + h) * V;
        float* ot = op + (t * HV + h) * V;
        const float decay = std::exp(gp[t * HV + h]), bt = bp[t * HV + h];
        std::fill(pred.begin(), pred.end(), 0.f);
        for (int64_t x = 0; x < K; ++x) {
          scale_to(decay, S + x * V, S + x * V, V);
          axpy(kt[x], S + x * V, pred.data(), V);
        }
        for (int64_t y = 0; y < V; ++y) delta[y] = bt * (vt[y] - pred[y]);
        std::fill(ot, ot + V, 0.f);
        for (int64_t x = 0; x < K; ++x) {
          axpy(kt[x], delta.data(), S + x * V, V);
          axpy(qt[x], S + x * V, ot, V);
        }
      }
    }
  });
}

}  // namespace
}  // namespace gdn
}  // namespace twinkle

TORCH_LIBRARY_FRAGMENT(TWINKLE_NS, m) {
  m.def("gdn_recurrent_fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor h0, Tensor cu, "
        "Tensor(a!) o, Tensor(b!) hT) -> ()",
        &twinkle::gdn::gdn_recurrent_fwd);
}
