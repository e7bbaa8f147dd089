// Test-only TensorFlow custom ops with windows and gathers, used by
// tests/test_custom_window_op.py. Plain loops (correctness only); no gradient is
// registered in C++: the generated modules of this repo's symgrad.toml register one.
//
//   StridedConv1d:   y[b,i,o] = sum_{k,c} x[b, s*i + d*k - p, c] * w[k,c,o]
//                    (zero outside x; i < (L - 1 + p - d*(K-1)) / s + 1)
//   EmbeddingLookup: y[b,t,e] = w[ids[b,t], e]   (zero for ids outside w)

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::errors::InvalidArgument;
using ::tensorflow::shape_inference::InferenceContext;

}  // namespace

REGISTER_OP("StridedConv1d")
    .Input("x: T")
    .Input("w: T")
    .Output("y: T")
    .Attr("T: {float, double}")
    .Attr("s: int")
    .Attr("d: int")
    .Attr("p: int")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->UnknownShapeOfRank(3));
      return Status();
    });

REGISTER_OP("EmbeddingLookup")
    .Input("w: T")
    .Input("ids: Tidx")
    .Output("y: T")
    .Attr("T: {float, double}")
    .Attr("Tidx: {int32, int64}")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->UnknownShapeOfRank(3));
      return Status();
    });

template <typename T>
class StridedConv1dOp : public OpKernel {
 public:
  explicit StridedConv1dOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("s", &s_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("d", &d_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("p", &p_));
    OP_REQUIRES(ctx, s_ > 0 && d_ > 0, InvalidArgument("s and d must be positive"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x_t = ctx->input(0);
    const Tensor& w_t = ctx->input(1);
    OP_REQUIRES(ctx, x_t.dims() == 3 && w_t.dims() == 3,
                InvalidArgument("x and w must have rank 3"));
    const int64_t nb = x_t.dim_size(0), nl = x_t.dim_size(1), nc = x_t.dim_size(2);
    const int64_t nk = w_t.dim_size(0), no = w_t.dim_size(2);
    OP_REQUIRES(ctx, w_t.dim_size(1) == nc, InvalidArgument("channels differ"));
    int64_t ni = (nl - 1 + p_ - d_ * (nk - 1)) / s_ + 1;
    if (nl - 1 + p_ - d_ * (nk - 1) < 0) ni = 0;
    Tensor* y_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({nb, ni, no}), &y_t));
    auto x = x_t.tensor<T, 3>();
    auto w = w_t.tensor<T, 3>();
    auto y = y_t->tensor<T, 3>();
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t i = 0; i < ni; ++i)
        for (int64_t o = 0; o < no; ++o) {
          T total = T(0);
          for (int64_t k = 0; k < nk; ++k) {
            const int64_t at = s_ * i + d_ * k - p_;
            if (at < 0 || at >= nl) continue;
            for (int64_t c = 0; c < nc; ++c) total += x(b, at, c) * w(k, c, o);
          }
          y(b, i, o) = total;
        }
  }

 private:
  int64_t s_, d_, p_;
};

template <typename T, typename Index>
class EmbeddingLookupOp : public OpKernel {
 public:
  explicit EmbeddingLookupOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& w_t = ctx->input(0);
    const Tensor& ids_t = ctx->input(1);
    OP_REQUIRES(ctx, w_t.dims() == 2 && ids_t.dims() == 2,
                InvalidArgument("w and ids must have rank 2"));
    const int64_t nv = w_t.dim_size(0), ne = w_t.dim_size(1);
    const int64_t nb = ids_t.dim_size(0), nt = ids_t.dim_size(1);
    Tensor* y_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({nb, nt, ne}), &y_t));
    auto w = w_t.matrix<T>();
    auto ids = ids_t.matrix<Index>();
    auto y = y_t->tensor<T, 3>();
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t t = 0; t < nt; ++t) {
        const int64_t row = static_cast<int64_t>(ids(b, t));
        for (int64_t e = 0; e < ne; ++e)
          y(b, t, e) = (row >= 0 && row < nv) ? w(row, e) : T(0);
      }
  }
};

#define REGISTER_CONV(T)                                                     \
  REGISTER_KERNEL_BUILDER(                                                   \
      Name("StridedConv1d").Device(DEVICE_CPU).TypeConstraint<T>("T"),       \
      StridedConv1dOp<T>);
REGISTER_CONV(float);
REGISTER_CONV(double);

#define REGISTER_LOOKUP(T, Index)                                            \
  REGISTER_KERNEL_BUILDER(Name("EmbeddingLookup")                            \
                              .Device(DEVICE_CPU)                            \
                              .TypeConstraint<T>("T")                        \
                              .TypeConstraint<Index>("Tidx"),                \
                          EmbeddingLookupOp<T, Index>);
REGISTER_LOOKUP(float, int32_t);
REGISTER_LOOKUP(float, int64_t);
REGISTER_LOOKUP(double, int32_t);
REGISTER_LOOKUP(double, int64_t);
