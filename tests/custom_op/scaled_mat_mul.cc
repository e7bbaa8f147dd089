// A test-only PyTorch C++ op, symgrad_cpp_test::scaled_mat_mul, opaque to autograd: the
// generated backward is registered for it by name (tests/test_target_pytorch.py). Built
// into one library with check_torch_ops.cc (conftest.py's `torch_op_library`).
#include <torch/library.h>
#include <ATen/ATen.h>

// y[b,i,j] = alpha * sum_k A[b,i,k] * B[b,k,j], in plain loops: opaque to autograd.
at::Tensor scaled_mat_mul(const at::Tensor& A, const at::Tensor& B, double alpha) {
  TORCH_CHECK(A.dim() == 3 && B.dim() == 3, "scaled_mat_mul: inputs of rank 3");
  auto a = A.contiguous().to(at::kDouble);
  auto b = B.contiguous().to(at::kDouble);
  int64_t n = a.size(0), rows = a.size(1), inner = a.size(2), cols = b.size(2);
  auto y = at::zeros({n, rows, cols}, a.options());
  auto pa = a.data_ptr<double>();
  auto pb = b.data_ptr<double>();
  auto py = y.data_ptr<double>();
  for (int64_t s = 0; s < n; ++s)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        double total = 0;
        for (int64_t k = 0; k < inner; ++k)
          total += pa[(s * rows + i) * inner + k] * pb[(s * inner + k) * cols + j];
        py[(s * rows + i) * cols + j] = alpha * total;
      }
  return y.to(A.scalar_type());
}

TORCH_LIBRARY(symgrad_cpp_test, m) {
  m.def("scaled_mat_mul(Tensor A, Tensor B, float alpha) -> Tensor");
}
TORCH_LIBRARY_IMPL(symgrad_cpp_test, CPU, m) {
  m.impl("scaled_mat_mul", &scaled_mat_mul);
}
