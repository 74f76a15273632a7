// Fused linear cross-entropy on the CPU: the LM head's GEMM and its softmax loss, block by block,
// never holding the [N, V] logits.
//
// Two loop orders:
//
// fp32, except as below: token-outer. Per chunk [r0, r1) of C tokens, with all V logits of those rows at hand:
//   x  = h[r0:r1] @ W^T (+ b)                  ATen's mm (torch's BLAS), fp32 [C, V]
//   z  = x / T, then cap * tanh(z / cap)       in place (row kernels below)
//   per row: lse, z[y], sum(z), entropy        fp32, a row that sits in cache
//   dz = d(loss, logp, entropy)/dx             in place
//   dh[r0:r1] = dz @ W,  dW += dz^T @ h,  db += sum(dz)     dW is the fp32 output itself
// Three GEMMs for the loss with its gradients, as eager. The automatic chunk (chunk 0) holds about
// 32M logits (128 MB). With chunks of C tokens, every chunk reads W twice and reads and writes the
// fp32 dW once more: at 512 tokens of a 151936 x 1024 head, three chunks cost about 10% more than one.
//
// bf16 / fp16, and fp32 in the loss-only mode when every logits block can be parked (below):
// vocabulary-outer. An fp32 [V, H] accumulator would be twice the bf16 weight
// gradient (the <= 25%-of-eager memory bar cannot be met with it), so the weight gradient is made
// one vocabulary block [v0, v1) at a time, complete after a pass over the tokens:
//   pass 1, per block: x = h_c @ W_b^T (input dtype, [C, Vb]); per row an online softmax
//           (running max, sum-exp, sum p*z, sum z, z[y]) merged over the blocks, fp32
//   pass 2, per block: x again; dz from lse and the entropy, written over x in the input dtype;
//           dh_c += dz @ W_b into an fp32 [N, H] accumulator (each block's product rounded once to
//           the input dtype, see gemm_acc); dW_b = dz^T @ h in one GEMM when the chunk holds all
//           tokens (the BLAS accumulates in fp32 inside and rounds once), else summed over the
//           token chunks in an fp32 [Vb, H] block accumulator; db_b += sum(dz) in fp32.
// Four GEMMs, each as large as the block allows; the scratch is a [C, Vb] block of logits (16 MB)
// and the fp32 [N, H] dh accumulator. When pass 1 and pass 2 run in one call (the loss-only mode)
// with all tokens in one chunk, pass 1 parks as many blocks of logits as fit in the weight
// gradient's storage, unwritten until pass 2 (see Parking): about min(1, H / N) of the blocks skip
// the recompute (45 of 75 at N=4096, H=2560, V=151936: 3.4 GEMMs instead of 4). When the rest, the
// last blocks, past which no weight gradient is left to park in, fit a spill of two blocks (about
// N <~ H), every block is parked and the loss with its gradients takes three GEMMs, as eager.
// fp32 takes this path only when the park is complete (a spill of up to 64 MB): its dW GEMMs then
// write their rows once instead of accumulating them chunk by chunk; fp32 dh is accumulated in place.
// That needs a weight gradient whose contents are free (dw_written: the caller's buffer is written,
// not added to), so about N <= H with a trainable weight; otherwise fp32 goes token-outer.
//
// Row statistics (with p = softmax(z), eps = label_smoothing):
//   loss  = lse - (1 - eps) z[y] - eps * mean(z)     (torch's label-smoothed cross entropy)
//   logp  = z[y] - lse
//   H     = lse - sum(p z)
// and with upstream per-row coefficients a (loss), b (logp), c (entropy):
//   dz_j  = p_j (a - b - c (log p_j + H)) + [j == y] (b - a (1 - eps)) - a eps / V
// Ignored rows (y == ignore_index) get zero statistics and a zero gradient row.
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <limits>
#include <vector>

#include "common/vec.h"

namespace twinkle {
namespace {

struct Params {
  int64_t ignore_index;
  float eps;      // label smoothing
  float cap;      // logit softcap, 0 = none
  float inv_t;    // 1 / temperature
};

// z = cap * tanh(x * inv_t / cap) (or x * inv_t) in place; returns max(z). Without a softcap and
// at temperature 1 the row is already z: only its max is read (no pass that writes the row back).
inline float transform_row(float* z, int64_t n, const Params& p) {
  const fVec vinv(p.inv_t);
  fVec vmax(-std::numeric_limits<float>::infinity());
  const bool capped = p.cap > 0.f;
  const bool identity = !capped && p.inv_t == 1.f;
  const fVec vcap(p.cap), vinvcap(capped ? 1.f / p.cap : 0.f);
  int64_t j = 0;
  if (identity) {
    for (; j + kF <= n; j += kF) vmax = at::vec::maximum(vmax, fVec::loadu(z + j));
  } else {
    for (; j + kF <= n; j += kF) {
      fVec v = fVec::loadu(z + j) * vinv;
      if (capped) v = vcap * (v * vinvcap).tanh();
      v.store(z + j);
      vmax = at::vec::maximum(vmax, v);
    }
  }
  alignas(64) float buf[kF];
  vmax.store(buf);
  float m = buf[0];
  for (int64_t i = 1; i < kF; ++i) m = std::max(m, buf[i]);
  for (; j < n; ++j) {
    float v = z[j] * p.inv_t;
    if (capped) v = p.cap * std::tanh(v / p.cap);
    z[j] = v;
    m = std::max(m, v);
  }
  return m;
}

// sum(exp(z - m)), sum(exp(z - m) * z), sum(z) of a transformed row.
inline void sums_row(const float* z, int64_t n, float m, float& s, float& t, float& sz) {
  const fVec vm(m);
  fVec vs(0.f), vt(0.f), vz(0.f);
  int64_t j = 0;
  for (; j + kF <= n; j += kF) {
    const fVec v = fVec::loadu(z + j);
    const fVec e = (v - vm).exp_u20();
    vs = vs + e;
    vt = at::vec::fmadd(e, v, vt);
    vz = vz + v;
  }
  s = hsum(vs), t = hsum(vt), sz = hsum(vz);
  for (; j < n; ++j) {
    const float e = std::exp(z[j] - m);
    s += e, t += e * z[j], sz += z[j];
  }
}

// Overwrites the transformed row z (n entries of the vocabulary of size V) with d(out)/dx, x the raw
// logits, given the row's lse and entropy H; yl is the target's index in this row, -1 if elsewhere.
inline void grad_row(float* z, int64_t n, int64_t V, int64_t yl, float lse, float H, float a, float b, float c,
                     const Params& p) {
  const float k0 = a - b - c * (H - lse);  // p_j * (k0 - c * z_j)
  const float konst = -a * p.eps / float(V);
  const fVec vk0(k0), vc(c), vlse(lse), vkonst(konst), vinv(p.inv_t);
  const bool capped = p.cap > 0.f;
  const fVec vinvcap(capped ? 1.f / p.cap : 0.f), one(1.f);
  const float zy = yl >= 0 ? z[yl] : 0.f;
  int64_t j = 0;
  for (; j + kF <= n; j += kF) {
    const fVec v = fVec::loadu(z + j);
    const fVec pj = (v - vlse).exp_u20();
    fVec d = at::vec::fmadd(pj, vk0 - vc * v, vkonst);
    if (capped) {
      const fVec r = v * vinvcap;
      d = d * (one - r * r);
    }
    (d * vinv).store(z + j);
  }
  for (; j < n; ++j) {
    const float v = z[j];
    float d = std::exp(v - lse) * (k0 - c * v) + konst;
    if (capped) d *= 1.f - (v / p.cap) * (v / p.cap);
    z[j] = d * p.inv_t;
  }
  if (yl < 0) return;
  // The one-hot term, with the chain rule at the target's z.
  float d1 = b - a * (1.f - p.eps);
  if (capped) d1 *= 1.f - (zy / p.cap) * (zy / p.cap);
  z[yl] += d1 * p.inv_t;
}

// fp32 copy of n logits of storage type T, plus the bias (fp32, may be null).
template <typename T>
inline void load_row(const T* x, const float* bias, int64_t n, float* z) {
  for (int64_t j = 0; j < n; j += kBlock) {
    fVec a, b;
    load2(x + j, n - j, a, b);
    if (bias) {
      fVec ba, bb;
      load2(bias + j, n - j, ba, bb);
      a = a + ba, b = b + bb;
    }
    store2(z + j, n - j, a, b);
  }
}

void check_row_out(const at::Tensor& t, const char* name, int64_t N) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == N && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              " must be a contiguous float32 [N] tensor");
}

const float* row_ptr(const c10::optional<at::Tensor>& t, const char* name, int64_t N) {
  if (!t.has_value() || !t->defined()) return nullptr;
  check_row_out(*t, name, N);
  return t->data_ptr<float>();
}

// What forward and backward share: checked inputs, the fp32 bias, the loop sizes.
struct Job {
  at::Tensor h, w, bias_f;
  const int64_t* y;
  int64_t N, V, H, chunk, vocab_block;
  Params p;
  bool reduced;  // bf16 / fp16: the vocabulary-outer loops
  bool auto_chunk;  // chunk 0 was passed: this file picks it

  Job(const at::Tensor& h_, const at::Tensor& w_, const c10::optional<at::Tensor>& bias, const at::Tensor& labels,
      int64_t ignore_index, double label_smoothing, double softcap, double temperature, int64_t chunk_,
      int64_t vocab_block_)
      : h(h_), w(w_), p{ignore_index, float(label_smoothing), float(softcap), float(1.0 / temperature)} {
    TORCH_CHECK(h.device().is_cpu() && w.device().is_cpu() && labels.device().is_cpu(), "linear_ce: CPU tensors only");
    TORCH_CHECK(h.dim() == 2 && w.dim() == 2 && h.size(1) == w.size(1), "linear_ce: hidden [N, H], weight [V, H]");
    TORCH_CHECK(h.scalar_type() == w.scalar_type(), "linear_ce: hidden and weight must share a dtype");
    TORCH_CHECK(h.is_contiguous() && w.is_contiguous(), "linear_ce: hidden and weight must be contiguous");
    TORCH_CHECK(labels.dim() == 1 && labels.size(0) == h.size(0) && labels.scalar_type() == at::kLong &&
                    labels.is_contiguous(), "linear_ce: labels int64 [N]");
    TORCH_CHECK(chunk_ >= 0, "linear_ce: chunk must be >= 0 (0 = automatic)");
    TORCH_CHECK(vocab_block_ >= 0, "linear_ce: vocab_block must be >= 0 (0 = automatic)");
    if (bias.has_value() && bias->defined()) {
      TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0), "linear_ce: bias must be [V]");
      bias_f = bias->to(at::kFloat).contiguous();
    }
    N = h.size(0), V = w.size(0), H = h.size(1);
    y = labels.data_ptr<int64_t>();
    reduced = h.scalar_type() != at::kFloat;
    auto_chunk = chunk_ == 0;
    // automatic: every token up to 16384 in bf16 / fp16; in fp32 all of them for the vocabulary-outer
    // path, which token_outer_chunk() narrows when that path is not taken
    chunk = std::max<int64_t>(1, auto_chunk ? (reduced ? std::min<int64_t>(N, 16384) : N) : std::min(chunk_, N));
    // A block of logits of about 8M entries (16 MB in bf16), at least 256 vocabulary rows wide.
    vocab_block = std::min(V, vocab_block_ > 0 ? vocab_block_ : std::max<int64_t>(256, (int64_t(1) << 23) / chunk));
  }
  bool ignored(int64_t i) const { return y[i] == p.ignore_index; }
  // The automatic fp32 token-outer chunk: a [C, V] chunk of about 32M fp32 logits (128 MB).
  void token_outer_chunk() {
    if (auto_chunk && !reduced) chunk = std::max<int64_t>(1, std::min(N, (int64_t(1) << 25) / std::max<int64_t>(V, 1)));
  }
};

// ---- fp32: token-outer ------------------------------------------------------------------------

// The raw logits of rows [r0, r1), fp32 [r1 - r0, V], written into the first rows of buf ([chunk, V]).
at::Tensor chunk_logits(const Job& J, const at::Tensor& buf, int64_t r0, int64_t r1) {
  at::Tensor x = buf.slice(0, 0, r1 - r0);
  at::mm_out(x, J.h.slice(0, r0, r1), J.w.t());
  if (J.bias_f.defined()) x.add_(J.bias_f);
  return x;
}

// dh[r0:r1] = dz @ W; dw += dz^T @ h[r0:r1] (dw undefined: a frozen weight, no GEMM);
// db += sum(dz, 0). dz is fp32 [C, V].
void chunk_grads(const Job& J, const at::Tensor& dz, int64_t r0, int64_t r1, const at::Tensor& dh,
                 const at::Tensor& dw, const c10::optional<at::Tensor>& db) {
  at::Tensor dh_c = dh.slice(0, r0, r1);
  at::mm_out(dh_c, dz, J.w);
  if (dw.defined()) dw.addmm_(dz.t(), J.h.slice(0, r0, r1));
  if (db.has_value() && db->defined()) db->add_(dz.sum(0));
}

// Per chunk of tokens: its fp32 logits [C, V], row(i, z) on each of its rows (z: row i's V logits,
// overwritten by their gradient when grads), then with grads the chunk's three gradient GEMMs.
// One [chunk, V] buffer serves every chunk: a fresh one per chunk (128 MB by default) would be
// new pages for the OS to fault in and zero each time, N * V * 4 bytes of them in all.
template <typename Row>
void token_outer(const Job& J, bool grads, const at::Tensor& dh, const at::Tensor& dw,
                 const c10::optional<at::Tensor>& db, const Row& row) {
  const at::Tensor buf = at::empty({J.chunk, J.V}, J.h.options().dtype(at::kFloat));
  for (int64_t r0 = 0; r0 < J.N; r0 += J.chunk) {
    const int64_t r1 = std::min(J.N, r0 + J.chunk);
    at::Tensor x = chunk_logits(J, buf, r0, r1);
    float* xp = x.data_ptr<float>();
    at::parallel_for(r0, r1, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) row(i, xp + (i - r0) * J.V);
    });
    if (grads) chunk_grads(J, x, r0, r1, dh, dw, db);
  }
}

// Statistics of every row; with grads, also the gradients of sum(a * loss + pb[i] * logp over valid
// rows) (pb null: 0).
void fwd_token_outer(const Job& J, float* lp, float* Lp, float* gp, float* ep, float a, const float* pb, bool grads,
                     const at::Tensor& dh, const at::Tensor& dw, const c10::optional<at::Tensor>& db) {
  const Params& p = J.p;
  const int64_t V = J.V;
  token_outer(J, grads, dh, dw, db, [&](int64_t i, float* z) {
    const int64_t yi = J.y[i];
    if (J.ignored(i)) {
      lp[i] = Lp[i] = gp[i] = ep[i] = 0.f;
      if (grads) std::fill(z, z + V, 0.f);
      return;
    }
    const float m = transform_row(z, V, p);
    float s, t, sz;
    sums_row(z, V, m, s, t, sz);
    const float l = m + std::log(s), zy = z[yi], H = l - t / s;
    lp[i] = l;
    Lp[i] = l - (1.f - p.eps) * zy - p.eps * sz / float(V);
    gp[i] = zy - l;
    ep[i] = H;
    if (grads) grad_row(z, V, V, yi, l, H, a, pb ? pb[i] : 0.f, 0.f, p);
  });
}

void bwd_token_outer(const Job& J, const float* lp, const float* ep, const float* pa, const float* pb,
                     const float* pc, const at::Tensor& dh, const at::Tensor& dw,
                     const c10::optional<at::Tensor>& db) {
  const int64_t V = J.V;
  token_outer(J, true, dh, dw, db, [&](int64_t i, float* z) {
    const float a = pa ? pa[i] : 0.f, b = pb ? pb[i] : 0.f, c = pc ? pc[i] : 0.f;
    if (J.ignored(i) || (a == 0.f && b == 0.f && c == 0.f)) {
      std::fill(z, z + V, 0.f);
      return;
    }
    transform_row(z, V, J.p);
    grad_row(z, V, V, J.y[i], lp[i], ep[i], a, b, c, J.p);
  });
}

// ---- bf16 / fp16: vocabulary-outer ------------------------------------------------------------

// acc[i] += t[i] over n entries, fp32 acc, t of the input dtype; parallel over the entries.
template <typename T>
void add_into(float* acc, const T* t, int64_t n) {
  at::parallel_for(0, n, 1 << 16, [&](int64_t i0, int64_t i1) {
    int64_t i = i0;
    for (; i + kBlock <= i1; i += kBlock) {
      fVec a, b, c, d;
      load2(t + i, kBlock, a, b);
      load2(acc + i, kBlock, c, d);
      store2(acc + i, kBlock, c + a, d + b);
    }
    for (; i < i1; ++i) acc[i] += float(t[i]);
  });
}

// acc (fp32 [M, N], contiguous) += A [M, K] @ B [K, N] (input dtype). The product comes from ATen's mm
// in the input dtype (oneDNN: fp32 inside, one rounding at the end) into tmp (a contiguous [M, N]
// tensor of the input dtype whose contents are free: the caller passes an output not yet written)
// and is added in fp32. torch's bf16 x bf16 -> fp32 GEMMs are not oneDNN's on the CPU (cpublas::brgemm's
// non-VNNI path, MKL's, ran 3-4x slower here: 50-65 against 230 GFLOPS), hence the rounding.
template <typename T>
void gemm_acc(const at::Tensor& A, const at::Tensor& B, const at::Tensor& acc, const at::Tensor& tmp) {
  at::Tensor t = tmp.view({A.size(0), B.size(1)});
  at::mm_out(t, A, B);
  add_into(acc.data_ptr<float>(), t.const_data_ptr<T>(), acc.numel());
}

// Where pass 1 parks its blocks of logits for pass 2. The weight gradient dw [V, H] is written only
// in pass 2, block by block in vocabulary order, so until then its storage is free: block k's raw
// logits ([N, n_k], input dtype) are kept there at an offset off[k] >= v1_k * H (past the rows its
// own dW GEMM writes) and past the blocks parked before it, and pass 2 reads them instead of
// recomputing the GEMM. About min(1, H / N) of the blocks fit; the last block never does (no rows
// are left past it). A frozen weight has no dw: the caller passes a scratch (in_dw false) that no
// GEMM writes, of min(N, H) * V entries, where the blocks are packed from its start: all of them
// when N <= H, as many as fit otherwise. The blocks that do not fit go to a spill tensor when it
// is at most two blocks ([N, Vb] each) and so parks every block: at most one block more than the
// [N, Vb] buffer a recompute needs, for a GEMM less per spilled block. Otherwise they are
// recomputed into that buffer. Only with all tokens in one chunk (each block's logits read once in
// pass 2).
struct Parking {
  std::vector<at::Tensor> blocks;  // block k's logits storage (flat), undefined: recomputed

  Parking(int64_t N, int64_t V, int64_t H, int64_t Vb, const at::Tensor& dw, bool in_dw = true) {
    if (!dw.defined()) return;
    const at::Tensor store = dw.view({-1});
    const int64_t S = store.numel();
    std::vector<int64_t> off;  // dw offsets (-1: not there)
    int64_t end = 0, spilled = 0;  // spilled: the entries of the blocks left out of dw
    for (int64_t v0 = 0; v0 < V; v0 += Vb) {
      const int64_t v1 = std::min(V, v0 + Vb), o = in_dw ? std::max(end, v1 * H) : end, size = N * (v1 - v0);
      if (o + size <= S) {
        off.push_back(o);
        end = o + size;
      } else {
        off.push_back(-1);
        spilled += size;
      }
    }
    at::Tensor spill;
    if (spilled > 0 && spilled <= 2 * N * Vb) spill = at::empty({spilled}, dw.options());
    blocks.resize(off.size());
    int64_t at_spill = 0;
    for (int64_t k = 0, v0 = 0; k < int64_t(off.size()); ++k, v0 += Vb) {
      const int64_t size = N * (std::min(V, v0 + Vb) - v0);
      if (off[k] >= 0) {
        blocks[k] = store.slice(0, off[k], off[k] + size);
      } else if (spill.defined()) {
        blocks[k] = spill.slice(0, at_spill, at_spill + size);
        at_spill += size;
      }
    }
  }
  bool complete() const {
    if (blocks.empty()) return false;
    for (const auto& b : blocks)
      if (!b.defined()) return false;
    return true;
  }
  // Block k's logits [rows, n], or an undefined tensor when the block is not parked.
  at::Tensor block(int64_t k, int64_t rows, int64_t n) const {
    if (k >= int64_t(blocks.size()) || !blocks[k].defined()) return at::Tensor();
    return blocks[k].view({rows, n});
  }
};

// The logits block x = h[r0:r1] @ W[v0:v1]^T, [r1 - r0, v1 - v0] in the input dtype, in buf.
at::Tensor block_logits(const Job& J, const at::Tensor& buf, int64_t r0, int64_t r1, int64_t v0, int64_t v1) {
  at::Tensor x = buf.slice(0, 0, (r1 - r0) * (v1 - v0)).view({r1 - r0, v1 - v0});
  at::mm_out(x, J.h.slice(0, r0, r1), J.w.slice(0, v0, v1).t());
  return x;
}

// Pass 1: per-row statistics by an online softmax over the vocabulary blocks; blocks that fit are
// computed straight into their parking place (see Parking).
template <typename T>
void stats_vocab_outer(const Job& J, float* lp, float* Lp, float* gp, float* ep, const Parking& park) {
  const Params& p = J.p;
  const int64_t N = J.N, Vb = J.vocab_block;
  std::vector<float> m(N, -std::numeric_limits<float>::infinity()), s(N, 0.f), t(N, 0.f), sz(N, 0.f), zy(N, 0.f);
  at::Tensor buf;
  const float* bias = J.bias_f.defined() ? J.bias_f.data_ptr<float>() : nullptr;
  for (int64_t v0 = 0, k = 0; v0 < J.V; v0 += Vb, ++k) {
    const int64_t v1 = std::min(J.V, v0 + Vb), n = v1 - v0;
    for (int64_t r0 = 0; r0 < N; r0 += J.chunk) {
      const int64_t r1 = std::min(N, r0 + J.chunk);
      at::Tensor x = park.block(k, r1 - r0, n);
      if (x.defined()) {
        at::mm_out(x, J.h.slice(0, r0, r1), J.w.slice(0, v0, v1).t());
      } else {
        if (!buf.defined()) buf = at::empty({J.chunk * Vb}, J.h.options());
        x = block_logits(J, buf, r0, r1, v0, v1);
      }
      const T* xp = x.const_data_ptr<T>();
      at::parallel_for(r0, r1, 1, [&](int64_t i0, int64_t i1) {
        std::vector<float> z(n);
        for (int64_t i = i0; i < i1; ++i) {
          if (J.ignored(i)) continue;
          load_row(xp + (i - r0) * n, bias ? bias + v0 : nullptr, n, z.data());
          const float mb = transform_row(z.data(), n, p);
          float sb, tb, szb;
          sums_row(z.data(), n, mb, sb, tb, szb);
          const float mn = std::max(m[i], mb), fo = std::exp(m[i] - mn), fb = std::exp(mb - mn);
          s[i] = s[i] * fo + sb * fb, t[i] = t[i] * fo + tb * fb, m[i] = mn, sz[i] += szb;
          const int64_t yi = J.y[i];
          if (yi >= v0 && yi < v1) zy[i] = z[yi - v0];
        }
      });
    }
  }
  for (int64_t i = 0; i < N; ++i) {
    if (J.ignored(i)) {
      lp[i] = Lp[i] = gp[i] = ep[i] = 0.f;
      continue;
    }
    const float l = m[i] + std::log(s[i]);
    lp[i] = l;
    Lp[i] = l - (1.f - p.eps) * zy[i] - p.eps * sz[i] / float(J.V);
    gp[i] = zy[i] - l;
    ep[i] = l - t[i] / s[i];
  }
}

// Pass 2: dh (input dtype), dw (input dtype, written) and db (fp32, accumulated) of
// sum(a * loss + b * logp + c * entropy), a = pa[i] (or a0 when pa is null), b = pb[i], c = pc[i].
// Parked blocks (pass 1 in the same call) are read from dw's storage instead of recomputed. The
// GEMM products rounded before their fp32 accumulation go through outputs not yet written: dh's
// rows for dh, the dw block for a multi-chunk dw.
template <typename T>
void grads_vocab_outer(const Job& J, const float* lp, const float* ep, const float* pa, float a0, const float* pb,
                       const float* pc, const at::Tensor& dh, const at::Tensor& dw,
                       const c10::optional<at::Tensor>& db, const Parking& park) {
  const Params& p = J.p;
  const int64_t N = J.N, V = J.V, H = J.H, Vb = J.vocab_block, C = J.chunk;
  const bool one_chunk = C >= N;
  const auto opts = J.h.options();
  constexpr bool f32 = std::is_same_v<T, float>;
  at::Tensor buf;
  // fp32: dh is its own accumulator (each block's product added by the BLAS)
  at::Tensor dh_acc = f32 ? dh.zero_() : at::zeros({N, H}, opts.dtype(at::kFloat));
  at::Tensor dw_acc = one_chunk || !dw.defined() ? at::Tensor() : at::empty({Vb, H}, opts.dtype(at::kFloat));
  const float* bias = J.bias_f.defined() ? J.bias_f.data_ptr<float>() : nullptr;
  for (int64_t v0 = 0, k = 0; v0 < V; v0 += Vb, ++k) {
    const int64_t v1 = std::min(V, v0 + Vb), n = v1 - v0;
    const at::Tensor wb = J.w.slice(0, v0, v1);
    at::Tensor dwb = dw.defined() ? dw.slice(0, v0, v1) : at::Tensor();
    at::Tensor acc = one_chunk || !dw.defined() ? at::Tensor() : dw_acc.slice(0, 0, n);
    if (acc.defined()) acc.zero_();
    for (int64_t r0 = 0; r0 < N; r0 += C) {
      const int64_t r1 = std::min(N, r0 + C);
      at::Tensor x = one_chunk ? park.block(k, r1 - r0, n) : at::Tensor();
      if (!x.defined()) {
        if (!buf.defined()) buf = at::empty({C * Vb}, opts);
        x = block_logits(J, buf, r0, r1, v0, v1);
      }
      T* xp = x.data_ptr<T>();
      at::parallel_for(r0, r1, 1, [&](int64_t i0, int64_t i1) {
        std::vector<float> z(n);
        for (int64_t i = i0; i < i1; ++i) {
          T* xr = xp + (i - r0) * n;
          const float a = pa ? pa[i] : a0, b = pb ? pb[i] : 0.f, c = pc ? pc[i] : 0.f;
          if (J.ignored(i) || (a == 0.f && b == 0.f && c == 0.f)) {
            std::fill(xr, xr + n, T(0));
            continue;
          }
          load_row(xr, bias ? bias + v0 : nullptr, n, z.data());
          transform_row(z.data(), n, p);
          const int64_t yi = J.y[i];
          grad_row(z.data(), n, V, yi >= v0 && yi < v1 ? yi - v0 : -1, lp[i], ep[i], a, b, c, p);
          for (int64_t j = 0; j < n; j += kBlock) {
            fVec u, w2;
            load2(z.data() + j, n - j, u, w2);
            store2(xr + j, n - j, u, w2);
          }
        }
      });
      // x now holds dz [r1 - r0, n] in the input dtype.
      if constexpr (f32) {
        dh_acc.slice(0, r0, r1).addmm_(x, wb);
      } else {
        gemm_acc<T>(x, wb, dh_acc.slice(0, r0, r1), dh.slice(0, r0, r1));
      }
      if (!dwb.defined()) {
        // a frozen weight (LoRA's head, a tied embedding): no dW GEMM, a third of the backward
      } else if (one_chunk) {
        at::mm_out(dwb, x.t(), J.h);
      } else {
        gemm_acc<T>(x.t(), J.h.slice(0, r0, r1), acc, dwb);
      }
      if (db.has_value() && db->defined()) db->slice(0, v0, v1).add_(x.sum(at::IntArrayRef{0}, false, at::kFloat));
    }
    if (acc.defined()) dwb.copy_(acc);
  }
  if constexpr (!f32) dh.copy_(dh_acc);
}

// dw undefined: the weight's gradient is not wanted (none is computed).
void check_grads(const Job& J, const at::Tensor& dh, const at::Tensor& dw, const c10::optional<at::Tensor>& db) {
  TORCH_CHECK(dh.sizes() == J.h.sizes() && dh.scalar_type() == J.h.scalar_type() && dh.is_contiguous(),
              "linear_ce: dh must be a contiguous [N, H] tensor of hidden's dtype");
  const auto dwt = J.reduced ? J.w.scalar_type() : at::kFloat;
  TORCH_CHECK(!dw.defined() || (dw.sizes() == J.w.sizes() && dw.scalar_type() == dwt && dw.is_contiguous()),
              "linear_ce: dw must be a contiguous [V, H] tensor, fp32 for fp32 inputs (accumulated into, "
              "or written with dw_written), weight's dtype (written) for bf16 / fp16 inputs");
  if (db.has_value() && db->defined())
    TORCH_CHECK(db->dim() == 1 && db->size(0) == J.V && db->scalar_type() == at::kFloat && db->is_contiguous(),
                "linear_ce: db_acc must be a contiguous fp32 [V] tensor");
}

// Forward: lse, loss, logp, entropy per row ([N] fp32; zero on ignored rows, lse included). With dh
// defined, also the gradients of sum(grad_scale * loss + b_i * logp_i over valid rows), b = grad_logp
// (fp32 [N], or undefined for 0): the loss-only mode, or the caller's expected logp gradient.
// dw_written: an fp32 dw's contents are free and it is written (bf16 / fp16 dw always is); without
// it an fp32 dw is accumulated into, and the fp32 vocabulary-outer path is not taken.
void linear_ce_fwd(const at::Tensor& h, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                   const at::Tensor& y, int64_t ignore_index, double label_smoothing, double softcap,
                   double temperature, int64_t chunk, int64_t vocab_block, at::Tensor& lse, at::Tensor& loss,
                   at::Tensor& logp, at::Tensor& ent, double grad_scale, const c10::optional<at::Tensor>& dh,
                   const c10::optional<at::Tensor>& dw, const c10::optional<at::Tensor>& db,
                   const c10::optional<at::Tensor>& grad_logp, bool dw_written) {
  Job J(h, w, bias, y, ignore_index, label_smoothing, softcap, temperature, chunk, vocab_block);
  check_row_out(lse, "lse", J.N), check_row_out(loss, "loss", J.N), check_row_out(logp, "logp", J.N);
  check_row_out(ent, "entropy", J.N);
  const float* pb = row_ptr(grad_logp, "grad_logp", J.N);
  const bool grads = dh.has_value() && dh->defined();
  // dw absent with dh: the weight is frozen (no dW GEMM)
  const at::Tensor dwt = dw.has_value() ? *dw : at::Tensor();
  if (grads) check_grads(J, *dh, dwt, db);
  float *lp = lse.data_ptr<float>(), *Lp = loss.data_ptr<float>(), *gp = logp.data_ptr<float>(),
        *ep = ent.data_ptr<float>();
  const bool written = J.reduced || dw_written;
  if (J.N == 0) {
    if (grads && written && dwt.defined()) dwt.zero_();
    return;
  }
  if (!J.reduced) {
    const bool fresh_dw = grads && dw_written && dwt.defined();
    // Token-outer accumulates into dw. Vocabulary-outer does not need the zeros, but a fresh dw's
    // pages are faulted in here, in one sequential pass; left to the GEMMs' first writes they cost
    // far more (a Qwen3-0.6B head in the facade's fp32 step: 7.2-9.5 CPU s for this call unzeroed,
    // 6.1-6.2 with this pass, which took 0.3 of them).
    if (fresh_dw) dwt.zero_();
    if (fresh_dw && J.chunk >= J.N) {
      const Parking park(J.N, J.V, J.H, J.vocab_block, dwt);
      if (park.complete()) {
        stats_vocab_outer<float>(J, lp, Lp, gp, ep, park);
        grads_vocab_outer<float>(J, lp, ep, nullptr, float(grad_scale), pb, nullptr, *dh, dwt, db, park);
        return;
      }
    }
    J.token_outer_chunk();
    fwd_token_outer(J, lp, Lp, gp, ep, float(grad_scale), pb, grads, grads ? *dh : at::Tensor(), dwt, db);
    return;
  }
  // pass 1 parks its logits blocks in dw's storage for pass 2; for a frozen weight, in a scratch of
  // min(N, H) * V entries (all the logits when N <= H; never more than a weight gradient would be)
  const at::Tensor park_store = !(grads && J.chunk >= J.N) ? at::Tensor()
                              : dwt.defined() ? dwt : at::empty({std::min(J.N, J.H) * J.V}, J.w.options());
  AT_DISPATCH_REDUCED_FLOATING_TYPES(h.scalar_type(), "linear_ce_fwd", [&] {   // bf16, fp16
    const Parking park(J.N, J.V, J.H, J.vocab_block, park_store, dwt.defined());
    stats_vocab_outer<scalar_t>(J, lp, Lp, gp, ep, park);
    if (grads) grads_vocab_outer<scalar_t>(J, lp, ep, nullptr, float(grad_scale), pb, nullptr, *dh, dwt, db, park);
  });
}

// Backward: recomputes the logits and applies per-row upstream coefficients a = dL/dloss_i,
// b = dL/dlogp_i, c = dL/dentropy_i (each an fp32 [N] tensor, or undefined for 0).
void linear_ce_bwd(const at::Tensor& h, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                   const at::Tensor& y, int64_t ignore_index, double label_smoothing, double softcap,
                   double temperature, int64_t chunk, int64_t vocab_block, const at::Tensor& lse,
                   const at::Tensor& ent, const c10::optional<at::Tensor>& ga, const c10::optional<at::Tensor>& gb,
                   const c10::optional<at::Tensor>& gc, at::Tensor& dh, const c10::optional<at::Tensor>& dw_opt,
                   const c10::optional<at::Tensor>& db) {
  const at::Tensor dw = dw_opt.has_value() ? *dw_opt : at::Tensor();   // absent: a frozen weight
  Job J(h, w, bias, y, ignore_index, label_smoothing, softcap, temperature, chunk, vocab_block);
  check_row_out(lse, "lse", J.N), check_row_out(ent, "entropy", J.N);
  check_grads(J, dh, dw, db);
  const float *pa = row_ptr(ga, "grad_loss", J.N), *pb = row_ptr(gb, "grad_logp", J.N),
              *pc = row_ptr(gc, "grad_entropy", J.N);
  const float *lp = lse.data_ptr<float>(), *ep = ent.data_ptr<float>();
  if (J.N == 0) {
    if (J.reduced && dw.defined()) dw.zero_();
    return;
  }
  if (!J.reduced) {
    J.token_outer_chunk();
    bwd_token_outer(J, lp, ep, pa, pb, pc, dh, dw, db);
    return;
  }
  AT_DISPATCH_REDUCED_FLOATING_TYPES(h.scalar_type(), "linear_ce_bwd", [&] {   // bf16, fp16
    grads_vocab_outer<scalar_t>(J, lp, ep, pa, 0.f, pb, pc, dh, dw, db, Parking(0, 0, 0, 1, at::Tensor()));
  });
}

}  // namespace
}  // namespace twinkle

TORCH_LIBRARY_FRAGMENT(TWINKLE_NS, m) {
  m.def("linear_ce_fwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, int ignore_index, "
        "float label_smoothing, float softcap, float temperature, int chunk, int vocab_block, Tensor(a!) lse, "
        "Tensor(b!) loss, Tensor(c!) logp, Tensor(d!) entropy, float grad_scale, Tensor(e!)? dh, Tensor(f!)? dw, "
        "Tensor(g!)? db_acc, Tensor? grad_logp=None, bool dw_written=False) -> ()",
        &twinkle::linear_ce_fwd);
  m.def("linear_ce_bwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, int ignore_index, "
        "float label_smoothing, float softcap, float temperature, int chunk, int vocab_block, Tensor lse, "
        "Tensor entropy, Tensor? grad_loss, Tensor? grad_logp, Tensor? grad_entropy, Tensor(a!) dh, Tensor(b!)? dw, "
        "Tensor(c!)? db_acc) -> ()",
        &twinkle::linear_ce_bwd);
}
