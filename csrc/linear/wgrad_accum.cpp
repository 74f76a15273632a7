// Weight gradient added into an fp32 accumulation buffer (megatron's "gradient accumulation
// fusion", which on GPUs is apex's wgrad_gemm_accum_fp32):
//
//   main_grad[N, K] += dy[M, N]^T @ x[M, K]        (accumulate = true)
//   main_grad[N, K]  = dy[M, N]^T @ x[M, K]        (accumulate = false: the first write of a step
//                                                   into a buffer whose contents are stale, which
//                                                   then need neither zeroing nor reading)
//
// fp32 x / dy: one GEMM with beta = 1 straight into main_grad. bf16 / fp16: the product is
// computed in row tiles of main_grad into a per-thread scratch of the input dtype (what the
// unfused path's weight gradient is: the GEMM accumulates in fp32 and rounds its output to the
// input dtype), and each tile is added into main_grad while it is still in cache. The unfused path
// writes the whole [N, K] product to fresh memory (its page faults included) and reads it back in
// the accumulation; here it never leaves the cache.
//
// Each task calls at::mm_out on its slice on the calling thread (inside at::parallel_for, oneDNN and
// MKL stay serial), so the parallelism is ours, over row tiles.
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <cstdint>
#include "common/vec.h"
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace twinkle {
namespace {

// Rows of main_grad per task. 256-row tiles measured fastest (bf16, 512 rows of x, N x K from
// 2048 x 768 to 4096 x 12288, 2 threads): 32-row tiles made the GEMMs too thin and ran slower than
// the unfused path; 256 rows ran 1.5-2.7x faster than it. Fewer rows when that leaves a thread idle.
constexpr int64_t kTileRows = 256;

template <typename T>
void add_into(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t k = std::min(kBlock, n - i);
    fVec a, b, ma, mb;
    load2(src + i, k, a, b);
    load2(dst + i, k, ma, mb);
    store2(dst + i, k, ma + a, mb + b);
  }
}

// The overwrite writes each line of main_grad whole and reads none of it: whole aligned blocks go
// out with streaming stores, which skip the read a plain store makes of a line it does not own
// (with plain stores the overwrite ran no faster than the add: 0.420 against 0.408 CPU s for 200
// expert-sized products, 32 x 1536 x 2048, into buffers out of cache, on a 2-core AMD EPYC).
template <typename T>
void copy_into(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  for (; i < n && (reinterpret_cast<uintptr_t>(dst + i) & 63) != 0; ++i) dst[i] = float(src[i]);
  for (; i + kBlock <= n; i += kBlock) {
    fVec a, b;
    load2(src + i, kBlock, a, b);
#if defined(CPU_CAPABILITY_AVX512)
    _mm512_stream_ps(dst + i, a);
    _mm512_stream_ps(dst + i + kF, b);
#else
    _mm256_stream_ps(dst + i, a);
    _mm256_stream_ps(dst + i + kF, b);
#endif
  }
  _mm_sfence();   // the streamed lines are visible before the task ends
#endif
  for (; i < n; i += kBlock) {
    const int64_t k = std::min(kBlock, n - i);
    fVec a, b;
    load2(src + i, k, a, b);
    store2(dst + i, k, a, b);
  }
}

template <typename T>
void tiles_into(const at::Tensor& x, const at::Tensor& dyt, at::Tensor& main_grad, int64_t tile, bool accumulate) {
  const int64_t N = main_grad.size(0), K = main_grad.size(1);
  const int64_t tasks = (N + tile - 1) / tile;
  float* mg = main_grad.data_ptr<float>();
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    at::AutoDispatchBelowADInplaceOrView guard;   // worker threads do not inherit the caller's
    at::Tensor scratch = at::empty({tile, K}, x.options());
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * tile, n = std::min(tile, N - n0);
      at::Tensor s = scratch.narrow(0, 0, n);
      at::mm_out(s, dyt.narrow(0, n0, n), x);
      if (accumulate) {
        add_into<T>(s.data_ptr<T>(), mg + n0 * K, n * K);
      } else {
        copy_into<T>(s.data_ptr<T>(), mg + n0 * K, n * K);
      }
    }
  });
}

void wgrad_accum(const at::Tensor& x, const at::Tensor& dy, at::Tensor& main_grad, bool accumulate) {
  TORCH_CHECK(x.device().is_cpu() && dy.device().is_cpu() && main_grad.device().is_cpu(),
              "wgrad_accum: CPU tensors expected");
  TORCH_CHECK(x.dim() == 2 && dy.dim() == 2 && main_grad.dim() == 2,
              "wgrad_accum: x [M, K], dy [M, N], main_grad [N, K] expected");
  const int64_t M = x.size(0), K = x.size(1), N = dy.size(1);
  TORCH_CHECK(dy.size(0) == M && main_grad.size(0) == N && main_grad.size(1) == K, "wgrad_accum: x ", x.sizes(),
              ", dy ", dy.sizes(), " and main_grad ", main_grad.sizes(), " do not fit [M, K], [M, N], [N, K]");
  TORCH_CHECK(main_grad.scalar_type() == at::kFloat && main_grad.is_contiguous(),
              "wgrad_accum: main_grad must be a contiguous fp32 tensor");
  TORCH_CHECK(x.scalar_type() == dy.scalar_type(), "wgrad_accum: x and dy must share a dtype");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  if (N == 0 || K == 0) return;
  if (M == 0) {   // an empty product: nothing to add, zeros to write
    if (!accumulate) main_grad.zero_();
    return;
  }
  if (x.scalar_type() == at::kFloat) {
    if (accumulate) {
      main_grad.addmm_(dy.t(), x);
    } else {
      at::mm_out(main_grad, dy.t(), x);
    }
    return;
  }
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t tile = std::max<int64_t>(1, std::min(kTileRows, (N + threads - 1) / threads));
  if (x.scalar_type() == at::kBFloat16) {
    tiles_into<at::BFloat16>(x, dy.t(), main_grad, tile, accumulate);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kHalf, "wgrad_accum: x must be float32, bfloat16 or float16");
    tiles_into<at::Half>(x, dy.t(), main_grad, tile, accumulate);
  }
}

}  // namespace
}  // namespace twinkle

TORCH_LIBRARY_FRAGMENT(TWINKLE_NS, m) {
  m.def("wgrad_accum(Tensor x, Tensor dy, Tensor(a!) main_grad, bool accumulate=True) -> ()", &twinkle::wgrad_accum);
}
