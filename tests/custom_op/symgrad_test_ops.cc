// Test-only TensorFlow custom ops used by tests/test_custom_op.py.
//
// Two CPU ops with plain-loop kernels (correctness only, no performance
// claims).  Neither op registers a gradient in C++; the Python test relies on
// symgrad-generated modules registering one via tf.RegisterGradient.
//
//   BatchedMatMul: y[b,i,j] = sum_k a[b,i,k] * b[b,k,j]
//   ScaledAdd:     y = alpha * a + b   (a, b, y all of shape (batch, i, j))
//
// and, to test how a generated gradient matches an op's inputs and outputs by
// name, ops that declare them in another order than the formula's:
//
//   WeightedSqErr: y[b] = sum_i w[b,i] * (p[b,i] - t[b,i])^2, inputs (p, t, w)
//   SumAndProduct: z = a * b, y = a + b (elementwise), outputs (z, y)
//   PlainAdd:      out = x + z (elementwise), no attrs

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

REGISTER_OP("WeightedSqErr")
    .Input("p: T")
    .Input("t: T")
    .Input("w: T")
    .Output("y: T")
    .Attr("T: {float, double}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle p;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &p));
      c->set_output(0, c->MakeShape({c->Dim(p, 0)}));
      return Status();
    });

REGISTER_OP("SumAndProduct")
    .Input("a: T")
    .Input("b: T")
    .Output("z: T")
    .Output("y: T")
    .Attr("T: {float, double}")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      c->set_output(1, c->input(0));
      return Status();
    });

REGISTER_OP("PlainAdd")
    .Input("x: T")
    .Input("z: T")
    .Output("out: T")
    .Attr("T: {float, double}")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
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

template <typename T>
class WeightedSqErrOp : public OpKernel {
 public:
  explicit WeightedSqErrOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& p_t = ctx->input(0);
    const Tensor& t_t = ctx->input(1);
    const Tensor& w_t = ctx->input(2);
    OP_REQUIRES(ctx, p_t.dims() == 2 && p_t.shape() == t_t.shape() &&
                         p_t.shape() == w_t.shape(),
                InvalidArgument("p, t and w must share one rank-2 shape"));
    const int64_t nb = p_t.dim_size(0), ni = p_t.dim_size(1);
    Tensor* y_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({nb}), &y_t));
    const auto p = p_t.matrix<T>();
    const auto t = t_t.matrix<T>();
    const auto w = w_t.matrix<T>();
    auto y = y_t->vec<T>();
    for (int64_t b = 0; b < nb; ++b) {
      T acc = T(0);
      for (int64_t i = 0; i < ni; ++i) {
        const T d = p(b, i) - t(b, i);
        acc += w(b, i) * d * d;
      }
      y(b) = acc;
    }
  }
};

template <typename T>
class SumAndProductOp : public OpKernel {
 public:
  explicit SumAndProductOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& a_t = ctx->input(0);
    const Tensor& b_t = ctx->input(1);
    OP_REQUIRES(ctx, a_t.shape() == b_t.shape(),
                InvalidArgument("a and b must have the same shape"));
    Tensor* z_t = nullptr;
    Tensor* y_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, a_t.shape(), &z_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, a_t.shape(), &y_t));
    const auto a = a_t.flat<T>();
    const auto b = b_t.flat<T>();
    auto z = z_t->flat<T>();
    auto y = y_t->flat<T>();
    for (int64_t n = 0; n < a.size(); ++n) {
      z(n) = a(n) * b(n);
      y(n) = a(n) + b(n);
    }
  }
};

template <typename T>
class PlainAddOp : public OpKernel {
 public:
  explicit PlainAddOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x_t = ctx->input(0);
    const Tensor& z_t = ctx->input(1);
    OP_REQUIRES(ctx, x_t.shape() == z_t.shape(),
                InvalidArgument("x and z must have the same shape"));
    Tensor* out_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x_t.shape(), &out_t));
    const auto x = x_t.flat<T>();
    const auto z = z_t.flat<T>();
    auto out = out_t->flat<T>();
    for (int64_t n = 0; n < x.size(); ++n) out(n) = x(n) + z(n);
  }
};

#define REGISTER_CPU(T)                                               \
  REGISTER_KERNEL_BUILDER(                                            \
      Name("BatchedMatMul").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
      BatchedMatMulOp<T>);                                            \
  REGISTER_KERNEL_BUILDER(                                            \
      Name("ScaledAdd").Device(DEVICE_CPU).TypeConstraint<T>("T"),     \
      ScaledAddOp<T>);                                                \
  REGISTER_KERNEL_BUILDER(                                            \
      Name("WeightedSqErr").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
      WeightedSqErrOp<T>);                                            \
  REGISTER_KERNEL_BUILDER(                                            \
      Name("SumAndProduct").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
      SumAndProductOp<T>);                                            \
  REGISTER_KERNEL_BUILDER(                                            \
      Name("PlainAdd").Device(DEVICE_CPU).TypeConstraint<T>("T"),      \
      PlainAddOp<T>);

REGISTER_CPU(float);
REGISTER_CPU(double);

#undef REGISTER_CPU
