// Sum of squares over many tensors, accumulated in float64: the squared L2 norm of a model's
// gradients (megatron's grad norm on the CPU).
//
//   out = sum_t sum_i double(x_t[i])^2
//
// x_t: any shape, float / bfloat16 / half / double (a non-contiguous one is read through a
// contiguous copy). out: a 0-dim float64 tensor the caller allocates. Each element is widened to
// double before it is squared, so neither the squares nor the sum round or overflow in fp32.
// The same result for any thread count (each tensor is split into fixed ranges whose partial
// sums are added in order).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <algorithm>
#include <vector>
#include <torch/library.h>

namespace twinkle {
namespace {

constexpr int kLanes = 16;             // independent accumulators: the compiler vectorises the lanes
constexpr int64_t kGrain = 1 << 16;    // elements per parallel range

// An element widened to double: through float for the 16-bit types (their own conversion), as is
// for double.
template <typename T>
inline double widen(T v) { return static_cast<double>(static_cast<float>(v)); }
inline double widen(double v) { return v; }

template <typename T>
double sum_squares_range(const T* x, int64_t begin, int64_t end) {
  double acc[kLanes] = {0.0};
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const double v = widen(x[i + j]);
      acc[j] += v * v;
    }
  }
  double s = 0.0;
  for (; i < end; ++i) {
    const double v = widen(x[i]);
    s += v * v;
  }
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

template <typename T>
double sum_squares_tensor(const at::Tensor& t) {
  const T* x = t.data_ptr<T>();
  const int64_t n = t.numel();
  if (n <= kGrain) return sum_squares_range<T>(x, 0, n);
  // fixed ranges, partial sums combined in range order: the result does not depend on scheduling
  const int64_t parts = (n + kGrain - 1) / kGrain;
  std::vector<double> partial(parts, 0.0);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      partial[p] = sum_squares_range<T>(x, p * kGrain, std::min(n, (p + 1) * kGrain));
  });
  double s = 0.0;
  for (double v : partial) s += v;
  return s;
}

void sum_squares(at::TensorList xs, at::Tensor& out) {
  TORCH_CHECK(out.scalar_type() == at::kDouble && out.numel() == 1 && out.device().is_cpu() && out.is_contiguous(),
              "sum_squares: out must be a one-element float64 CPU tensor");
  double total = 0.0;
  for (size_t k = 0; k < xs.size(); ++k) {
    const at::Tensor t = xs[k].contiguous();
    TORCH_CHECK(t.device().is_cpu(), "sum_squares: tensors[", k, "] is not on the CPU");
    switch (t.scalar_type()) {
      case at::kFloat: total += sum_squares_tensor<float>(t); break;
      case at::kBFloat16: total += sum_squares_tensor<c10::BFloat16>(t); break;
      case at::kHalf: total += sum_squares_tensor<c10::Half>(t); break;
      case at::kDouble: total += sum_squares_tensor<double>(t); break;
      default: TORCH_CHECK(false, "sum_squares: tensors[", k, "] has dtype ", t.scalar_type(),
                           "; expected float32, bfloat16, float16 or float64");
    }
  }
  *out.data_ptr<double>() = total;
}

}  // namespace
}  // namespace twinkle

TORCH_LIBRARY_FRAGMENT(TWINKLE_NS, m) {
  m.def("sum_squares(Tensor[] xs, Tensor(a!) out) -> ()", &twinkle::sum_squares);
}
