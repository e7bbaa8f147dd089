// Test-only TensorFlow custom ops used by tests/test_custom_op.py.
//
// Two CPU ops with plain-loop kernels (correctness only, no performance
// claims).  Neither op registers a gradient in C++; the Python test relies on
// symgrad-generated modules registering one via tf.RegisterGradient.
//
//   BatchedMatMul: y[b,i,j] = sum_k a[b,i,k] * b[b,k,j]
//   ScaledAdd:     y = alpha * a + b   (a, b, y all of shape (batch, i, j))

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::errors::InvalidArgument;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

}  // namespace

REGISTER_OP("BatchedMatMul")
    .Input("a: T")
    .Input("b: T")
    .Output("y: T")
    .Attr("T: {float, double}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle a, b;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &a));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 3, &b));
      DimensionHandle batch, inner;
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(a, 0), c->Dim(b, 0), &batch));
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(a, 2), c->Dim(b, 1), &inner));
      c->set_output(0, c->MakeShape({batch, c->Dim(a, 1), c->Dim(b, 2)}));
      return Status();
    });

REGISTER_OP("ScaledAdd")
    .Input("a: T")
    .Input("b: T")
    .Output("y: T")
    .Attr("T: {float, double}")
    .Attr("alpha: float")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle a, b, out;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &a));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 3, &b));
      TF_RETURN_IF_ERROR(c->Merge(a, b, &out));
      c->set_output(0, out);
      return Status();
    });

template <typename T>
class BatchedMatMulOp : public OpKernel {
 public:
  explicit BatchedMatMulOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& a_t = ctx->input(0);
    const Tensor& b_t = ctx->input(1);
    OP_REQUIRES(ctx, a_t.dims() == 3,
                InvalidArgument("a must be rank 3, got shape ",
                                a_t.shape().DebugString()));
    OP_REQUIRES(ctx, b_t.dims() == 3,
                InvalidArgument("b must be rank 3, got shape ",
                                b_t.shape().DebugString()));
    const int64_t nb = a_t.dim_size(0), ni = a_t.dim_size(1),
                  nk = a_t.dim_size(2), nj = b_t.dim_size(2);
    OP_REQUIRES(ctx, b_t.dim_size(0) == nb && b_t.dim_size(1) == nk,
                InvalidArgument("incompatible shapes a=",
                                a_t.shape().DebugString(), " b=",
                                b_t.shape().DebugString()));

    Tensor* y_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({nb, ni, nj}), &y_t));

    const auto a = a_t.tensor<T, 3>();
    const auto b = b_t.tensor<T, 3>();
    auto y = y_t->tensor<T, 3>();
    for (int64_t p = 0; p < nb; ++p)
      for (int64_t i = 0; i < ni; ++i)
        for (int64_t j = 0; j < nj; ++j) {
          T acc = T(0);
          for (int64_t k = 0; k < nk; ++k) acc += a(p, i, k) * b(p, k, j);
          y(p, i, j) = acc;
        }
  }
};

template <typename T>
class ScaledAddOp : public OpKernel {
 public:
  explicit ScaledAddOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("alpha", &alpha_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& a_t = ctx->input(0);
    const Tensor& b_t = ctx->input(1);
    OP_REQUIRES(ctx, a_t.dims() == 3,
                InvalidArgument("a must be rank 3, got shape ",
                                a_t.shape().DebugString()));
    OP_REQUIRES(ctx, a_t.shape() == b_t.shape(),
                InvalidArgument("a and b must have the same shape, got a=",
                                a_t.shape().DebugString(), " b=",
                                b_t.shape().DebugString()));

    Tensor* y_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, a_t.shape(), &y_t));

    const auto a = a_t.flat<T>();
    const auto b = b_t.flat<T>();
    auto y = y_t->flat<T>();
    const T alpha = static_cast<T>(alpha_);
    for (int64_t n = 0; n < a.size(); ++n) y(n) = alpha * a(n) + b(n);
  }

 private:
  float alpha_;
};

#define REGISTER_CPU(T)                                               \
  REGISTER_KERNEL_BUILDER(                                            \
      Name("BatchedMatMul").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
      BatchedMatMulOp<T>);                                            \
  REGISTER_KERNEL_BUILDER(                                            \
      Name("ScaledAdd").Device(DEVICE_CPU).TypeConstraint<T>("T"),     \
      ScaledAddOp<T>);

REGISTER_CPU(float);
REGISTER_CPU(double);

#undef REGISTER_CPU
