// Shared pieces of the ops whose autograd runs in C++ (torch::autograd::Function).
//
// Called from Python once per forward, these replace a Python autograd.Function: at the hidden
// sizes of small models an op's Python side (Function.apply, views, allocations, the backward's
// Python frame) cost more than its kernels, and more than the few eager ops it replaces. The
// kernels they run are the same ones the Python path runs.
//
// `poison` is twinkle_kernels' NaN-filling of fresh outputs (tests turn it on, _alloc.py): an
// element a kernel forgets to write then fails the comparison with the reference.
#pragma once

#include "common/vec.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/custom_function.h>

#include <limits>
#include <vector>

namespace twinkle {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// Product of t's sizes before the last dim: the row count of its [M, n] view.
inline int64_t leading_rows(const at::Tensor& t) {
  int64_t m = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) m *= t.size(d);
  return m;
}

// t as [M, n] rows with unit stride in n (copied only when a view cannot have it).
inline at::Tensor as_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() >= 1, name, " must have at least one dim");
  const int64_t n = t.size(-1);
  at::Tensor r = t.reshape({leading_rows(t), n});
  if (n > 1 && r.stride(1) != 1) r = r.contiguous();
  return r;
}

// A fresh contiguous tensor, NaN-filled when poisoning is on.
inline at::Tensor fresh(at::IntArrayRef sizes, const at::TensorOptions& opts, bool poison) {
  at::Tensor t = at::empty(sizes, opts);
  if (poison && t.numel() > 0) t.fill_(std::numeric_limits<float>::quiet_NaN());
  return t;
}

// Each backward starts with this: its kernels write plain tensors, so a graph of the backward
// (backward(create_graph=True), for a double backward) would silently miss this op's part.
inline void refuse_create_graph(const char* op) {
  TORCH_CHECK(!at::GradMode::is_enabled(), "twinkle_kernels.", op,
              ": the cpu backend's backward is not differentiable (backward with create_graph=True); "
              "use backend=\"reference\" for higher-order gradients");
}

}  // namespace twinkle
