// Fused linear cross-entropy on the CPU: the LM head's GEMM and its softmax loss, chunk by chunk
// over the tokens, never holding the [N, V] logits.
//
// Per token chunk [r0, r1) of C rows:
//   x  = h[r0:r1] @ W^T (+ b)                  ATen's mm (torch's BLAS), fp32 copy [C, V]
//   z  = x / T, then cap * tanh(z / cap)       in place, fp32 (row kernel below)
//   per row: lse, z[y], sum(z), entropy        fp32, two passes over a row that sits in cache
//   dz = d(loss, logp, entropy)/dz             in place; then the softcap and 1/T chain rule
//   dh[r0:r1] = dz @ W,  dW += dz^T @ h,  db += sum(dz)   dW and db accumulated in fp32
//
// Row statistics (with p = softmax(z), eps = label_smoothing):
//   loss  = lse - (1 - eps) z[y] - eps * mean(z)     (torch's label-smoothed cross entropy)
//   logp  = z[y] - lse
//   H     = lse - sum(p z)
// and with upstream per-row coefficients a (loss), b (logp), c (entropy):
//   dz_j  = p_j (a - b - c (log p_j + H)) + [j == y] (b - a (1 - eps)) - a eps / V
// Ignored rows (y == ignore_index) get zero statistics and a zero gradient row.
#include "common/vec.h"

namespace twinkle {
namespace {

struct Params {
  int64_t ignore_index;
  float eps;      // label smoothing
  float cap;      // logit softcap, 0 = none
  float inv_t;    // 1 / temperature
};

// z = cap * tanh(x * inv_t / cap) (or x * inv_t) in place; returns max(z).
inline float transform_row(float* z, int64_t V, const Params& p) {
  const fVec vinv(p.inv_t);
  fVec vmax(-std::numeric_limits<float>::infinity());
  const bool capped = p.cap > 0.f;
  const fVec vcap(p.cap), vinvcap(capped ? 1.f / p.cap : 0.f);
  int64_t j = 0;
  for (; j + kF <= V; j += kF) {
    fVec v = fVec::loadu(z + j) * vinv;
    if (capped) v = vcap * (v * vinvcap).tanh();
    v.store(z + j);
    vmax = at::vec::maximum(vmax, v);
  }
  alignas(64) float buf[kF];
  vmax.store(buf);
  float m = buf[0];
  for (int64_t i = 1; i < kF; ++i) m = std::max(m, buf[i]);
  for (; j < V; ++j) {
    float v = z[j] * p.inv_t;
    if (capped) v = p.cap * std::tanh(v / p.cap);
    z[j] = v;
    m = std::max(m, v);
  }
  return m;
}

// sum(exp(z - m)), sum(exp(z - m) * z), sum(z) of a transformed row.
inline void sums_row(const float* z, int64_t V, float m, float& s, float& t, float& sz) {
  const fVec vm(m);
  fVec vs(0.f), vt(0.f), vz(0.f);
  int64_t j = 0;
  for (; j + kF <= V; j += kF) {
    const fVec v = fVec::loadu(z + j);
    const fVec e = (v - vm).exp_u20();
    vs = vs + e;
    vt = at::vec::fmadd(e, v, vt);
    vz = vz + v;
  }
  s = hsum(vs), t = hsum(vt), sz = hsum(vz);
  for (; j < V; ++j) {
    const float e = std::exp(z[j] - m);
    s += e, t += e * z[j], sz += z[j];
  }
}

// Overwrites the transformed row z with d(out)/dx (x = the raw logits), given lse and H.
inline void grad_row(float* z, int64_t V, int64_t y, float lse, float H, float a, float b, float c, const Params& p) {
  const float k0 = a - b - c * (H - lse);  // p_j * (k0 - c * z_j)
  const float konst = -a * p.eps / float(V);
  const fVec vk0(k0), vc(c), vlse(lse), vkonst(konst), vinv(p.inv_t);
  const bool capped = p.cap > 0.f;
  const fVec vinvcap(capped ? 1.f / p.cap : 0.f), one(1.f);
  const float zy = z[y];
  int64_t j = 0;
  for (; j + kF <= V; j += kF) {
    const fVec v = fVec::loadu(z + j);
    const fVec pj = (v - vlse).exp_u20();
    fVec d = at::vec::fmadd(pj, vk0 - vc * v, vkonst);
    if (capped) {
      const fVec r = v * vinvcap;
      d = d * (one - r * r);
    }
    (d * vinv).store(z + j);
  }
  for (; j < V; ++j) {
    const float v = z[j];
    float d = std::exp(v - lse) * (k0 - c * v) + konst;
    if (capped) d *= 1.f - (v / p.cap) * (v / p.cap);
    z[j] = d * p.inv_t;
  }
  // The one-hot term, with the chain rule at the target's z.
  float d1 = b - a * (1.f - p.eps);
  if (capped) d1 *= 1.f - (zy / p.cap) * (zy / p.cap);
  z[y] += d1 * p.inv_t;
}

void check_inputs(const at::Tensor& h, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                  const at::Tensor& y) {
  TORCH_CHECK(h.device().is_cpu() && w.device().is_cpu() && y.device().is_cpu(), "linear_ce: CPU tensors only");
  TORCH_CHECK(h.dim() == 2 && w.dim() == 2 && h.size(1) == w.size(1), "linear_ce: hidden [N, H], weight [V, H]");
  TORCH_CHECK(h.scalar_type() == w.scalar_type(), "linear_ce: hidden and weight must share a dtype");
  TORCH_CHECK(h.is_contiguous() && w.is_contiguous(), "linear_ce: hidden and weight must be contiguous");
  TORCH_CHECK(y.dim() == 1 && y.size(0) == h.size(0) && y.scalar_type() == at::kLong, "linear_ce: labels int64 [N]");
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0), "linear_ce: bias must be [V]");
}

void check_row_out(const at::Tensor& t, const char* name, int64_t N) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == N && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              " must be a contiguous float32 [N] tensor");
}

// The raw logits of rows [r0, r1) as a fresh fp32 [C, V] tensor.
at::Tensor chunk_logits(const at::Tensor& h, const at::Tensor& w, const at::Tensor& bias_f, int64_t r0, int64_t r1) {
  at::Tensor x = at::mm(h.slice(0, r0, r1), w.t());
  if (x.scalar_type() != at::kFloat) x = x.to(at::kFloat);
  if (bias_f.defined()) x.add_(bias_f);
  return x;
}

// dh[r0:r1] = dz @ W; dW_acc += dz^T @ h[r0:r1]; db_acc += sum(dz, 0). dz is fp32 [C, V].
void chunk_grads(const at::Tensor& dz, const at::Tensor& h, const at::Tensor& w, int64_t r0, int64_t r1,
                 const at::Tensor& dh, const at::Tensor& dw_acc, const c10::optional<at::Tensor>& db_acc,
                 at::Tensor& tmp) {
  const auto dt = w.scalar_type();
  const at::Tensor dzt = dt == at::kFloat ? dz : dz.to(dt);
  const at::Tensor hc = h.slice(0, r0, r1);
  at::Tensor dh_c = dh.slice(0, r0, r1);
  at::mm_out(dh_c, dzt, w);
  if (dt == at::kFloat) {
    dw_acc.addmm_(dzt.t(), hc);
  } else {
    // Reduced precision: the chunk's product comes back in dt (the BLAS accumulates in fp32 inside)
    // and is added to the fp32 accumulator a vocabulary block at a time, through one reused buffer.
    const int64_t V = w.size(0), Vb = tmp.size(0);
    for (int64_t v0 = 0; v0 < V; v0 += Vb) {
      const int64_t v1 = std::min(V, v0 + Vb);
      at::Tensor t = tmp.slice(0, 0, v1 - v0);
      at::mm_out(t, dzt.slice(1, v0, v1).t(), hc);
      dw_acc.slice(0, v0, v1).add_(t);
    }
  }
  if (db_acc.has_value() && db_acc->defined()) db_acc->add_(dz.sum(0));
}

at::Tensor make_tmp(const at::Tensor& w) {
  if (w.scalar_type() == at::kFloat) return at::Tensor();
  return at::empty({std::min<int64_t>(w.size(0), 4096), w.size(1)}, w.options());
}

// Forward over all chunks. Writes lse, loss, logp, entropy per row ([N] fp32; zero on ignored rows,
// lse included). With dh defined, also the gradients of sum(grad_scale * loss over valid rows)
// (the loss-only fast path: the caller multiplies them by the incoming gradient later).
void linear_ce_fwd(const at::Tensor& h, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                   const at::Tensor& y, int64_t ignore_index, double label_smoothing, double softcap,
                   double temperature, int64_t chunk, at::Tensor& lse, at::Tensor& loss, at::Tensor& logp,
                   at::Tensor& ent, double grad_scale, const c10::optional<at::Tensor>& dh,
                   const c10::optional<at::Tensor>& dw_acc, const c10::optional<at::Tensor>& db_acc) {
  check_inputs(h, w, bias, y);
  const int64_t N = h.size(0), V = w.size(0);
  check_row_out(lse, "lse", N), check_row_out(loss, "loss", N), check_row_out(logp, "logp", N);
  check_row_out(ent, "entropy", N);
  TORCH_CHECK(chunk > 0, "linear_ce: chunk must be positive");
  const bool grads = dh.has_value() && dh->defined();
  if (grads) TORCH_CHECK(dw_acc.has_value() && dw_acc->scalar_type() == at::kFloat, "linear_ce: dw_acc fp32 [V, H]");
  const Params p{ignore_index, float(label_smoothing), float(softcap), float(1.0 / temperature)};
  const at::Tensor bias_f = bias.has_value() && bias->defined() ? bias->to(at::kFloat) : at::Tensor();
  at::Tensor tmp = grads ? make_tmp(w) : at::Tensor();
  const int64_t* yp = y.data_ptr<int64_t>();
  float *lp = lse.data_ptr<float>(), *Lp = loss.data_ptr<float>(), *gp = logp.data_ptr<float>(),
        *ep = ent.data_ptr<float>();
  const float a = float(grad_scale);
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t r1 = std::min(N, r0 + chunk);
    at::Tensor x = chunk_logits(h, w, bias_f, r0, r1);
    float* xp = x.data_ptr<float>();
    at::parallel_for(r0, r1, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        float* z = xp + (i - r0) * V;
        const int64_t yi = yp[i];
        if (yi == p.ignore_index) {
          lp[i] = Lp[i] = gp[i] = ep[i] = 0.f;
          if (grads) std::fill(z, z + V, 0.f);
          continue;
        }
        const float m = transform_row(z, V, p);
        float s, t, sz;
        sums_row(z, V, m, s, t, sz);
        const float l = m + std::log(s), zy = z[yi], H = l - t / s;
        lp[i] = l;
        Lp[i] = l - (1.f - p.eps) * zy - p.eps * sz / float(V);
        gp[i] = zy - l;
        ep[i] = H;
        if (grads) grad_row(z, V, yi, l, H, a, 0.f, 0.f, p);
      }
    });
    if (grads) chunk_grads(x, h, w, r0, r1, *dh, *dw_acc, db_acc, tmp);
  }
}

// Backward: recomputes each chunk's logits and applies per-row upstream coefficients
// a = dL/dloss_i, b = dL/dlogp_i, c = dL/dentropy_i (each an fp32 [N] tensor, or undefined for 0).
void linear_ce_bwd(const at::Tensor& h, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                   const at::Tensor& y, int64_t ignore_index, double label_smoothing, double softcap,
                   double temperature, int64_t chunk, const at::Tensor& lse, const at::Tensor& ent,
                   const c10::optional<at::Tensor>& ga, const c10::optional<at::Tensor>& gb,
                   const c10::optional<at::Tensor>& gc, at::Tensor& dh, at::Tensor& dw_acc,
                   const c10::optional<at::Tensor>& db_acc) {
  check_inputs(h, w, bias, y);
  const int64_t N = h.size(0), V = w.size(0);
  check_row_out(lse, "lse", N), check_row_out(ent, "entropy", N);
  TORCH_CHECK(chunk > 0, "linear_ce: chunk must be positive");
  TORCH_CHECK(dw_acc.scalar_type() == at::kFloat, "linear_ce: dw_acc must be fp32");
  auto row_ptr = [&](const c10::optional<at::Tensor>& t, const char* name) -> const float* {
    if (!t.has_value() || !t->defined()) return nullptr;
    check_row_out(*t, name, N);
    return t->data_ptr<float>();
  };
  const float *pa = row_ptr(ga, "grad_loss"), *pb = row_ptr(gb, "grad_logp"), *pc = row_ptr(gc, "grad_entropy");
  const Params p{ignore_index, float(label_smoothing), float(softcap), float(1.0 / temperature)};
  const at::Tensor bias_f = bias.has_value() && bias->defined() ? bias->to(at::kFloat) : at::Tensor();
  at::Tensor tmp = make_tmp(w);
  const int64_t* yp = y.data_ptr<int64_t>();
  const float *lp = lse.data_ptr<float>(), *ep = ent.data_ptr<float>();
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t r1 = std::min(N, r0 + chunk);
    at::Tensor x = chunk_logits(h, w, bias_f, r0, r1);
    float* xp = x.data_ptr<float>();
    at::parallel_for(r0, r1, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        float* z = xp + (i - r0) * V;
        const int64_t yi = yp[i];
        const float a = pa ? pa[i] : 0.f, b = pb ? pb[i] : 0.f, c = pc ? pc[i] : 0.f;
        if (yi == p.ignore_index || (a == 0.f && b == 0.f && c == 0.f)) {
          std::fill(z, z + V, 0.f);
          continue;
        }
        transform_row(z, V, p);
        grad_row(z, V, yi, lp[i], ep[i], a, b, c, p);
      }
    });
    chunk_grads(x, h, w, r0, r1, dh, dw_acc, db_acc, tmp);
  }
}

}  // namespace
}  // namespace twinkle

TORCH_LIBRARY_FRAGMENT(TWINKLE_NS, m) {
  m.def("linear_ce_fwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, int ignore_index, "
        "float label_smoothing, float softcap, float temperature, int chunk, Tensor(a!) lse, Tensor(b!) loss, "
        "Tensor(c!) logp, Tensor(d!) entropy, float grad_scale, Tensor(e!)? dh, Tensor(f!)? dw_acc, "
        "Tensor(g!)? db_acc) -> ()",
        &twinkle::linear_ce_fwd);
  m.def("linear_ce_bwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, int ignore_index, "
        "float label_smoothing, float softcap, float temperature, int chunk, Tensor lse, Tensor entropy, "
        "Tensor? grad_loss, Tensor? grad_logp, Tensor? grad_entropy, Tensor(a!) dh, Tensor(b!) dw_acc, "
        "Tensor(c!)? db_acc) -> ()",
        &twinkle::linear_ce_bwd);
}
