// Grouped matmul on the CPU: one op over all experts, parallel over (expert x tile) tasks.
//
//   forward / dx:  out[rows of e] = x[rows of e] @ w[e]          (dx: dy @ w[e]^T, pass w^T as w)
//   dw:            dw[e] = x[rows of e]^T @ dy[rows of e]         (zero for an empty expert)
//
// x, dy: [M, K] / [M, N]; w, dw: [E, K, N] with any strides (a transposed view of a
// Hugging Face [E, N, K] weight is read and written in place); offsets: int32 [E]
// cumulative end rows on the CPU. float / bfloat16 / half storage.
//
// Each task calls at::mm_out on one slice. Inside at::parallel_for the BLAS call runs on
// the calling thread (MKL and oneDNN see the OpenMP region and stay serial), so the
// parallelism is ours: no Python loop, no per-expert thread fork/join, and uneven groups
// are split into row tiles (forward) or K tiles (dw) so one big expert cannot serialise
// the op. MKL (fp32) and oneDNN (bf16/fp16, AMX where present) accumulate in fp32.
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include "common/vec.h"

#include <vector>

namespace twinkle {
namespace {

struct Task {
  int64_t e, begin, end;  // expert; rows (forward) or K range (dw)
};

std::vector<int64_t> read_offsets(const at::Tensor& offsets, int64_t E, int64_t M) {
  TORCH_CHECK(offsets.device().is_cpu() && offsets.scalar_type() == at::kInt && offsets.dim() == 1 &&
                  offsets.size(0) == E,
              "offsets must be a CPU int32 tensor of shape [E]");
  auto oc = offsets.contiguous();
  const int32_t* p = oc.data_ptr<int32_t>();
  std::vector<int64_t> ends(E);
  int64_t prev = 0;
  for (int64_t e = 0; e < E; ++e) {
    ends[e] = p[e];
    TORCH_CHECK(ends[e] >= prev, "offsets must be non-decreasing");
    prev = ends[e];
  }
  TORCH_CHECK(prev == M, "offsets must end at M");
  return ends;
}

// Enough tasks to keep every thread busy when the groups are uneven, but tiles big enough
// that the BLAS call stays efficient.
int64_t tile_size(int64_t total, int64_t min_tile) {
  const int64_t threads = at::get_num_threads();
  // One thread has nobody to balance with: a split group only adds calls (bf16 products of a
  // few hundred rows cost ~40 us each here, most of it per call).
  if (threads <= 1) return std::max<int64_t>(total, 1);
  const int64_t want_tasks = 4 * threads;
  const int64_t t = (total + want_tasks - 1) / want_tasks;
  return std::max<int64_t>(min_tile, t);
}

void grouped_mm_fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offsets, at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && out.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && out.dim() == 2, "x [M, K], w [E, K, N], out [M, N]");
  const int64_t M = x.size(0), K = x.size(1), E = w.size(0), N = w.size(2);
  TORCH_CHECK(w.size(1) == K && out.size(0) == M && out.size(1) == N, "shape mismatch");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && out.scalar_type() == x.scalar_type(), "dtype mismatch");
  const auto ends = read_offsets(offsets, E, M);
  const int64_t tile = tile_size(M, 64);
  std::vector<Task> tasks;
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t r = start; r < ends[e]; r += tile) tasks.push_back({e, r, std::min(ends[e], r + tile)});
    start = ends[e];
  }
  if (K == 0) {
    at::AutoDispatchBelowADInplaceOrView guard;
    out.zero_();
    return;
  }
  // fp32 weights stored transposed (w[e] a [K, N] view of an [N, K] matrix: the forward of Megatron's and
  // Hugging Face's expert layouts) and groups of few rows: compute out^T = w[e]^T x^T into a scratch
  // [N, rows] and transpose it into place. MKL then takes the weight as an untransposed operand of a
  // product whose small side is the rows; at 16-32 rows per expert (Qwen3-30B-A3B's 128 experts, top-8,
  // 512 tokens) that measured 10-22 % faster than x @ w[e] despite the copy, and 0-10 % slower from
  // 64 rows up (MKL sgemm, 1 thread, weights [2048, 1536] / [768, 2048]). Row-major weights (dx's
  // w^T views) stay x @ w[e]: swapped, those were 35-75 % slower.
  const bool swap = x.scalar_type() == at::kFloat && w.stride(1) == 1 && w.stride(2) != 1;
  constexpr int64_t kSwapRows = 48;
  at::parallel_for(0, (int64_t)tasks.size(), 1, [&](int64_t t0, int64_t t1) {
    // Worker threads do not inherit the caller's thread-local dispatch state: keep autograd out.
    at::AutoDispatchBelowADInplaceOrView guard;
    at::Tensor scratch;
    for (int64_t t = t0; t < t1; ++t) {
      const Task& tk = tasks[t];
      const int64_t rows = tk.end - tk.begin;
      auto o = out.narrow(0, tk.begin, rows);
      auto xs = x.narrow(0, tk.begin, rows);
      if (swap && rows < kSwapRows) {
        if (scratch.numel() < N * rows) scratch = at::empty({N * kSwapRows}, out.options());
        auto st = scratch.narrow(0, 0, N * rows).view({N, rows});
        at::mm_out(st, w.select(0, tk.e).t(), xs.t());
        o.copy_(st.t());
      } else {
        at::mm_out(o, xs, w.select(0, tk.e));
      }
    }
  });
}

void grouped_mm_dw(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& offsets, at::Tensor& dw) {
  TORCH_CHECK(x.device().is_cpu() && dy.device().is_cpu() && dw.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(x.dim() == 2 && dy.dim() == 2 && dw.dim() == 3, "x [M, K], dy [M, N], dw [E, K, N]");
  const int64_t M = x.size(0), K = x.size(1), N = dy.size(1), E = dw.size(0);
  TORCH_CHECK(dy.size(0) == M && dw.size(1) == K && dw.size(2) == N, "shape mismatch");
  TORCH_CHECK(x.scalar_type() == dy.scalar_type() && dw.scalar_type() == x.scalar_type(), "dtype mismatch");
  const auto ends = read_offsets(offsets, E, M);
  // Split K only when there are too few experts to go round the threads.
  const int64_t per_expert = std::max<int64_t>(1, (4 * at::get_num_threads() + E - 1) / E);
  const int64_t ktile = std::max<int64_t>(64, (K + per_expert - 1) / per_expert);
  std::vector<Task> tasks;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t k = 0; k < K; k += ktile) tasks.push_back({e, k, std::min(K, k + ktile)});
  const at::Tensor xt = x.t();
  at::parallel_for(0, (int64_t)tasks.size(), 1, [&](int64_t t0, int64_t t1) {
    at::AutoDispatchBelowADInplaceOrView guard;
    for (int64_t t = t0; t < t1; ++t) {
      const Task& tk = tasks[t];
      const int64_t r0 = tk.e ? ends[tk.e - 1] : 0, rows = ends[tk.e] - r0;
      auto o = dw.select(0, tk.e).narrow(0, tk.begin, tk.end - tk.begin);
      if (rows == 0) {
        o.zero_();
        continue;
      }
      at::mm_out(o, xt.narrow(0, tk.begin, tk.end - tk.begin).narrow(1, r0, rows), dy.narrow(0, r0, rows));
    }
  });
}

}  // namespace
}  // namespace twinkle

TORCH_LIBRARY_FRAGMENT(TWINKLE_NS, m) {
  m.def("grouped_mm_fwd(Tensor x, Tensor w, Tensor offsets, Tensor(a!) out) -> ()", &twinkle::grouped_mm_fwd);
  m.def("grouped_mm_dw(Tensor x, Tensor dy, Tensor offsets, Tensor(a!) dw) -> ()", &twinkle::grouped_mm_dw);
}
