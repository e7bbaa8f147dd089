// Test-only PyTorch C++ ops in namespace `checkcpp`, for `symgrad check --target pytorch`
// against tests/custom_op/check_py_ops.toml (no backward here: the check registers the
// generated one). py_mat_mul and py_scale compute their formula; py_off_by_one leaves
// y[:, I-1] at 0.
#include <torch/library.h>
#include <ATen/ATen.h>

at::Tensor py_mat_mul(const at::Tensor& A, const at::Tensor& B) { return at::bmm(A, B); }

at::Tensor py_scale(const at::Tensor& x, double alpha) { return x * alpha; }

at::Tensor py_off_by_one(const at::Tensor& x, const at::Tensor& w) {
  auto y = x * w;
  y.select(1, y.size(1) - 1).zero_();
  return y;
}

TORCH_LIBRARY(checkcpp, m) {
  m.def("py_mat_mul(Tensor A, Tensor B) -> Tensor");
  m.def("py_scale(Tensor x, float alpha=0.5) -> Tensor");
  m.def("py_off_by_one(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(checkcpp, CPU, m) {
  m.impl("py_mat_mul", &py_mat_mul);
  m.impl("py_scale", &py_scale);
  m.impl("py_off_by_one", &py_off_by_one);
}
