// Python module entry of one ISA build. The ops themselves are registered per file with
// TORCH_LIBRARY_FRAGMENT(TWINKLE_NS, m) and reached as torch.ops.<TWINKLE_NS>.<op>.
// pybind11 alone (torch/extension.h took 22 CPU s to compile this file, for one module attribute)
#include <pybind11/pybind11.h>

#define TWINKLE_STR2(x) #x
#define TWINKLE_STR(x) TWINKLE_STR2(x)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("ops_namespace") = TWINKLE_STR(TWINKLE_NS);
#if defined(CPU_CAPABILITY_AVX512)
  m.attr("isa") = "avx512";
#elif defined(CPU_CAPABILITY_AVX2)
  m.attr("isa") = "avx2";
#else
  m.attr("isa") = "default";
#endif
}
