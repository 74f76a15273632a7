// Chunked gated delta rule on the CPU (WY representation), forward and backward, fp32.
//
// Per value head h (key head h / G), chunk of L tokens with in-chunk cumulative decay gc,
// gam = exp(gc), gL = gam[L-1], E_ij = exp(gc_i - gc_j), and state S [K, V] at the chunk start:
//
//   A   = strict_lower(beta_i (k_i . k_j) E_ij)          T = (I + A)^-1
//   u   = T (beta * v)                                   w = T (beta * gam * k)
//   vn  = u - w S                                        (the delta-rule corrections)
//   o   = (gam * q) S + lower_incl((q k^T) * E) vn
//   S'  = gL S + ((gL / gam) * k)^T vn
//
// q arrives already L2-normalised and scaled (Python does that under autograd). Tensors are
// flat packed sequences: q, k [TT, H, K], v [TT, HV, V], g, beta [TT, HV], cu [N + 1] int64;
// B > 1 batches are passed as B sequences of T tokens. Tasks are (sequence, value head) pairs,
// run with at::parallel_for; the per-chunk products go through at::addmm_out on views.
// The backward recomputes the chunk quantities from the chunk-start states the forward saved.
#include "gdn/gdn_common.h"

namespace twinkle {
namespace gdn {
namespace {

struct Shape {
  int64_t H, HV, K, V, G, C;
};

// Per-task scratch, sized for a full chunk.
struct Chunk {
  const Shape& s;
  std::vector<float> gc, gam, KKE, A, T, P, Kb, Vb, U, W, VN, Qg, Kd;
  explicit Chunk(const Shape& sh)
      : s(sh), gc(sh.C), gam(sh.C), KKE(sh.C * sh.C), A(sh.C * sh.C), T(sh.C * sh.C), P(sh.C * sh.C),
        Kb(sh.C * sh.K), Vb(sh.C * sh.V), U(sh.C * sh.V), W(sh.C * sh.K), VN(sh.C * sh.V), Qg(sh.C * sh.K),
        Kd(sh.C * sh.K) {}

  // Everything that does not need the gradient: fills gc .. Kd for the chunk at row t0 of head h.
  void compute(const float* q, const float* k, const float* v, const float* g, const float* beta, const float* S,
               int64_t t0, int64_t L, int64_t h) {
    const int64_t K = s.K, V = s.V, hk = h / s.G, ldk = s.H * K, ldv = s.HV * V;
    const float* qc = q + (t0 * s.H + hk) * K;
    const float* kc = k + (t0 * s.H + hk) * K;
    const float* vc = v + (t0 * s.HV + h) * V;
    float acc = 0.f;
    for (int64_t i = 0; i < L; ++i) {
      acc += g[(t0 + i) * s.HV + h];
      gc[i] = acc;
      gam[i] = std::exp(acc);
    }
    auto Kc = mat(kc, L, K, ldk), Qc = mat(qc, L, K, ldk);
    gemm(mat(KKE.data(), L, L, L), Kc, Kc.t(), 0.f, 1.f);
    gemm(mat(P.data(), L, L, L), Qc, Kc.t(), 0.f, 1.f);
    for (int64_t i = 0; i < L; ++i) {
      const float bi = beta[(t0 + i) * s.HV + h];
      for (int64_t j = 0; j < L; ++j) {
        const float e = j <= i ? std::exp(gc[i] - gc[j]) : 0.f;
        KKE[i * L + j] = j < i ? KKE[i * L + j] * e : 0.f;
        A[i * L + j] = bi * KKE[i * L + j];
        P[i * L + j] *= e;
      }
      scale_to(bi, vc + i * ldv, Vb.data() + i * V, V);
      scale_to(bi * gam[i], kc + i * ldk, Kb.data() + i * K, K);
      scale_to(gam[i], qc + i * ldk, Qg.data() + i * K, K);
      // exp of the difference, not gL / gam[i]: both may underflow to 0 over a long chunk
      scale_to(std::exp(gc[L - 1] - gc[i]), kc + i * ldk, Kd.data() + i * K, K);
    }
    unit_lower_inverse(A.data(), T.data(), L);
    auto Tm = mat(T.data(), L, L, L);
    gemm(mat(U.data(), L, V, V), Tm, mat(Vb.data(), L, V, V), 0.f, 1.f);
    gemm(mat(W.data(), L, K, K), Tm, mat(Kb.data(), L, K, K), 0.f, 1.f);
    std::copy(U.begin(), U.begin() + L * V, VN.begin());
    gemm(mat(VN.data(), L, V, V), mat(W.data(), L, K, K), mat(S, K, V, V), 1.f, -1.f);
  }
};

void gdn_chunk_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                   const at::Tensor& beta, const at::Tensor& h0, const at::Tensor& cu, int64_t C, at::Tensor& o,
                   at::Tensor& hT, at::Tensor& states) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &g, &beta, &o, &hT}) {
    check_cpu_contig(*t, "gdn_chunk_fwd tensor");
    TORCH_CHECK(t->scalar_type() == at::kFloat, "gdn_chunk_fwd works in fp32");
  }
  const auto offs = offsets(cu);
  const int64_t N = offs.size() - 1;
  const Shape s{q.size(1), v.size(1), q.size(2), v.size(2), v.size(1) / q.size(1), C};
  const auto coff = chunk_offsets(offs, C);
  const bool save = states.numel() > 0;
  const bool has_h0 = h0.numel() > 0;
  TORCH_CHECK(!save || states.size(0) == coff[N], "states must hold one state per chunk");
  TORCH_CHECK(hT.size(0) == N, "hT must be [N, HV, K, V]");
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  const float* h0p = has_h0 ? h0.data_ptr<float>() : nullptr;
  float *op = o.data_ptr<float>(), *hp = hT.data_ptr<float>(), *sp = save ? states.data_ptr<float>() : nullptr;
  const int64_t KV = s.K * s.V;
  at::parallel_for(0, N * s.HV, 1, [&](int64_t a, int64_t b) {
    Chunk ch(s);
    std::vector<float> out(s.C * s.V);
    for (int64_t task = a; task < b; ++task) {
      const int64_t n = task / s.HV, h = task % s.HV;
      float* S = hp + task * KV;
      if (has_h0) std::copy(h0p + task * KV, h0p + (task + 1) * KV, S);
      else std::fill(S, S + KV, 0.f);
      auto Sm = mat(S, s.K, s.V, s.V);
      for (int64_t t0 = offs[n], c = coff[n]; t0 < offs[n + 1]; t0 += C, ++c) {
        const int64_t L = std::min(C, offs[n + 1] - t0);
        if (save) std::copy(S, S + KV, sp + (c * s.HV + h) * KV);
        ch.compute(qp, kp, vp, gp, bp, S, t0, L, h);
        auto O = mat(out.data(), L, s.V, s.V);
        gemm(O, mat(ch.Qg.data(), L, s.K, s.K), Sm, 0.f, 1.f);
        gemm(O, mat(ch.P.data(), L, L, L), mat(ch.VN.data(), L, s.V, s.V), 1.f, 1.f);
        copy_rows(out.data(), s.V, op + (t0 * s.HV + h) * s.V, s.HV * s.V, L, s.V);
        Sm.mul_(ch.gam[L - 1]);
        gemm(Sm, mat(ch.Kd.data(), L, s.K, s.K).t(), mat(ch.VN.data(), L, s.V, s.V), 1.f, 1.f);
      }
    }
  });
}

// Gradients: dq_h, dk_h [TT, HV, K] per value head (Python sums each GVA group), dv [TT, HV, V],
// dg, dbeta [TT, HV], dh0 [N, HV, K, V] (seeded from dhT, or zero when dhT is empty).
void gdn_chunk_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                   const at::Tensor& beta, const at::Tensor& states, const at::Tensor& cu, int64_t C,
                   const at::Tensor& dout, const at::Tensor& dhT, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                   at::Tensor& dg, at::Tensor& dbeta, at::Tensor& dh0) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &g, &beta, &states, &dout, &dq, &dk, &dv, &dg, &dbeta, &dh0}) {
    check_cpu_contig(*t, "gdn_chunk_bwd tensor");
    TORCH_CHECK(t->scalar_type() == at::kFloat, "gdn_chunk_bwd works in fp32");
  }
  const auto offs = offsets(cu);
  const int64_t N = offs.size() - 1;
  const Shape s{q.size(1), v.size(1), q.size(2), v.size(2), v.size(1) / q.size(1), C};
  const auto coff = chunk_offsets(offs, C);
  TORCH_CHECK(states.size(0) == coff[N], "states must hold one state per chunk");
  const bool has_dhT = dhT.numel() > 0;
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>(), *sp = states.data_ptr<float>();
  const float *dop = dout.data_ptr<float>(), *dhTp = has_dhT ? dhT.data_ptr<float>() : nullptr;
  float *dqp = dq.data_ptr<float>(), *dkp = dk.data_ptr<float>(), *dvp = dv.data_ptr<float>();
  float *dgp = dg.data_ptr<float>(), *dbp = dbeta.data_ptr<float>(), *dhp = dh0.data_ptr<float>();
  const int64_t K = s.K, V = s.V, KV = K * V, CC = C * C;
  at::parallel_for(0, N * s.HV, 1, [&](int64_t a, int64_t b) {
    Chunk ch(s);
    std::vector<float> dO(C * V), dvn(C * V), dQ(C * K), dK(C * K), dKd(C * K), dW(C * K), dVb(C * V),
        dKb(C * K), dP(CC), dA(CC), dgc(C), db(C);
    for (int64_t task = a; task < b; ++task) {
      const int64_t n = task / s.HV, h = task % s.HV, hk = h / s.G;
      float* dS = dhp + task * KV;
      if (has_dhT) std::copy(dhTp + task * KV, dhTp + (task + 1) * KV, dS);
      else std::fill(dS, dS + KV, 0.f);
      auto dSm = mat(dS, K, V, V);
      const int64_t nch = coff[n + 1] - coff[n];
      for (int64_t ci = nch - 1; ci >= 0; --ci) {
        const int64_t t0 = offs[n] + ci * C, L = std::min(C, offs[n + 1] - t0);
        const float* S = sp + ((coff[n] + ci) * s.HV + h) * KV;
        auto Sm = mat(S, K, V, V);
        ch.compute(qp, kp, vp, gp, bp, S, t0, L, h);
        const float* qc = qp + (t0 * s.H + hk) * K;
        const float* kc = kp + (t0 * s.H + hk) * K;
        const float* vc = vp + (t0 * s.HV + h) * V;
        const int64_t ldk = s.H * K, ldv = s.HV * V;
        auto Qc = mat(qc, L, K, ldk), Kc = mat(kc, L, K, ldk);
        copy_rows(dop + (t0 * s.HV + h) * V, ldv, dO.data(), V, L, V);
        auto dOm = mat(dO.data(), L, V, V), VNm = mat(ch.VN.data(), L, V, V);
        auto dvnm = mat(dvn.data(), L, V, V), dQm = mat(dQ.data(), L, K, K), dKm = mat(dK.data(), L, K, K);
        const float gL = ch.gam[L - 1];
        // dvn = P^T dO + Kd dS'
        gemm(dvnm, mat(ch.P.data(), L, L, L).t(), dOm, 0.f, 1.f);
        gemm(dvnm, mat(ch.Kd.data(), L, K, K), dSm, 1.f, 1.f);
        // q through (gam * q) S: dQ = gam * (dO S^T)
        gemm(dQm, dOm, Sm.t(), 0.f, 1.f);
        for (int64_t i = 0; i < L; ++i) {
          dgc[i] = ch.gam[i] * dot(qc + i * ldk, dQ.data() + i * K, K);
          for (int64_t x = 0; x < K; ++x) dQ[i * K + x] *= ch.gam[i];
        }
        // P = lower_incl(q k^T * E): Z = dP * P feeds the decays, dP * E feeds q and k
        gemm(mat(dP.data(), L, L, L), dOm, VNm.t(), 0.f, 1.f);
        for (int64_t i = 0; i < L; ++i) {
          for (int64_t j = 0; j < L; ++j) {
            float& d = dP[i * L + j];
            if (j > i) { d = 0.f; continue; }
            const float z = d * ch.P[i * L + j];
            dgc[i] += z;
            dgc[j] -= z;
            d *= std::exp(ch.gc[i] - ch.gc[j]);
          }
        }
        auto dPm = mat(dP.data(), L, L, L);
        gemm(dQm, dPm, Kc, 1.f, 1.f);
        gemm(dKm, dPm.t(), Qc, 0.f, 1.f);
        // S' = gL S + Kd^T vn, Kd = (gL / gam) * k
        gemm(mat(dKd.data(), L, K, K), VNm, dSm.t(), 0.f, 1.f);
        float rsum = 0.f;
        for (int64_t i = 0; i < L; ++i) {
          const float r = dot(ch.Kd.data() + i * K, dKd.data() + i * K, K);
          dgc[i] -= r;
          rsum += r;
          axpy(std::exp(ch.gc[L - 1] - ch.gc[i]), dKd.data() + i * K, dK.data() + i * K, K);
        }
        dgc[L - 1] += rsum + gL * dot(S, dS, KV);
        // vn = u - w S ; u = T Vb ; w = T Kb
        gemm(mat(dW.data(), L, K, K), dvnm, Sm.t(), 0.f, -1.f);
        auto Tt = mat(ch.T.data(), L, L, L).t();
        gemm(mat(dVb.data(), L, V, V), Tt, dvnm, 0.f, 1.f);
        gemm(mat(dKb.data(), L, K, K), Tt, mat(dW.data(), L, K, K), 0.f, 1.f);
        auto dAm = mat(dA.data(), L, L, L);
        gemm(dAm, mat(dVb.data(), L, V, V), mat(ch.U.data(), L, V, V).t(), 0.f, -1.f);
        gemm(dAm, mat(dKb.data(), L, K, K), mat(ch.W.data(), L, K, K).t(), 1.f, -1.f);
        for (int64_t i = 0; i < L; ++i) {
          const float bi = bp[(t0 + i) * s.HV + h];
          const float kdkb = dot(kc + i * ldk, dKb.data() + i * K, K);
          db[i] = dot(vc + i * ldv, dVb.data() + i * V, V) + ch.gam[i] * kdkb;
          dgc[i] += bi * ch.gam[i] * kdkb;
          axpy(bi * ch.gam[i], dKb.data() + i * K, dK.data() + i * K, K);
          scale_to(bi, dVb.data() + i * V, dvp + ((t0 + i) * s.HV + h) * V, V);
        }
        // A = strict_lower(beta_i KKE_ij), KKE = (k k^T) * E
        for (int64_t i = 0; i < L; ++i) {
          const float bi = bp[(t0 + i) * s.HV + h];
          for (int64_t j = 0; j < L; ++j) {
            float& d = dA[i * L + j];
            if (j >= i) { d = 0.f; continue; }
            const float y = d * ch.A[i * L + j];
            dgc[i] += y;
            dgc[j] -= y;
            db[i] += d * ch.KKE[i * L + j];
            d *= bi * std::exp(ch.gc[i] - ch.gc[j]);
          }
        }
        gemm(dKm, dAm, Kc, 1.f, 1.f);
        gemm(dKm, dAm.t(), Kc, 1.f, 1.f);
        // state gradient for the previous chunk: gL dS' + (gam q)^T dO - w^T dvn
        dSm.mul_(gL);
        gemm(dSm, mat(ch.Qg.data(), L, K, K).t(), dOm, 1.f, 1.f);
        gemm(dSm, mat(ch.W.data(), L, K, K).t(), dvnm, 1.f, -1.f);
        float acc = 0.f;
        for (int64_t i = L - 1; i >= 0; --i) {
          acc += dgc[i];
          const int64_t r = (t0 + i) * s.HV + h;
          dgp[r] = acc;
          dbp[r] = db[i];
          std::copy(dQ.data() + i * K, dQ.data() + (i + 1) * K, dqp + r * K);
          std::copy(dK.data() + i * K, dK.data() + (i + 1) * K, dkp + r * K);
        }
      }
    }
  });
}

}  // namespace
}  // namespace gdn
}  // namespace twinkle

TORCH_LIBRARY_FRAGMENT(TWINKLE_NS, m) {
  m.def("gdn_chunk_fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor h0, Tensor cu, int C, "
        "Tensor(a!) o, Tensor(b!) hT, Tensor(c!) states) -> ()",
        &twinkle::gdn::gdn_chunk_fwd);
  m.def("gdn_chunk_bwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor states, Tensor cu, int C, "
        "Tensor dout, Tensor dhT, Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, Tensor(d!) dg, Tensor(e!) dbeta, "
        "Tensor(f!) dh0) -> ()",
        &twinkle::gdn::gdn_chunk_bwd);
}
