// Test-only TensorFlow custom ops for `symgrad check`, declared in
// tests/custom_op/check_attr_ops.toml: ops as users write them, where the
// check once misjudged them. Plain CPU loops; no gradient in C++.
//
//   CheckFloatScale:    y[b,i] = alpha * x[b,i]; alpha is a float attr, so
//                       the op holds float32(alpha) and computes in T. Correct.
//   CheckSwappedConv:   spec y[b,i,o] = sum_{k,c} x[b, s*i + d*k, c] * w[k,c,o]
//                       with s = d = 1 by default; the kernel reads
//                       x[b, d*i + s*k, c] (stride and dilation swapped),
//                       which the defaults cannot tell apart. Wrong.
//   CheckLocalAttention: y[b,i,e] = sum_{w,c} a[b,i,w] * k[b, i+w-r, c]
//                       * v[b, i+w-r, e] (zero outside k and v); like real
//                       local attention, it refuses k and v of different
//                       lengths. Correct.
//   CheckNoAttr:        spec y[b,i] = beta * x[b,i] with a float attr beta;
//                       the op has no attr and computes 2 * x.

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
using ::tensorflow::shape_inference::InferenceContext;

Status UnknownRank3(InferenceContext* c) {
  c->set_output(0, c->UnknownShapeOfRank(3));
  return Status();
}

Status SameAsInput0(InferenceContext* c) {
  c->set_output(0, c->input(0));
  return Status();
}

}  // namespace

REGISTER_OP("CheckFloatScale")
    .Input("x: T")
    .Output("y: T")
    .Attr("T: {float, double}")
    .Attr("alpha: float")
    .SetShapeFn(SameAsInput0);

REGISTER_OP("CheckSwappedConv")
    .Input("x: T")
    .Input("w: T")
    .Output("y: T")
    .Attr("T: {float, double}")
    .Attr("s: int = 1")
    .Attr("d: int = 1")
    .SetShapeFn(UnknownRank3);

REGISTER_OP("CheckLocalAttention")
    .Input("a: T")
    .Input("k: T")
    .Input("v: T")
    .Output("y: T")
    .Attr("T: {float, double}")
    .Attr("r: int")
    .SetShapeFn(UnknownRank3);

REGISTER_OP("CheckNoAttr")
    .Input("x: T")
    .Output("y: T")
    .Attr("T: {float, double}")
    .SetShapeFn(SameAsInput0);

template <typename T>
class CheckFloatScaleOp : public OpKernel {
 public:
  explicit CheckFloatScaleOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("alpha", &alpha_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x_t = ctx->input(0);
    Tensor* y_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x_t.shape(), &y_t));
    const auto x = x_t.flat<T>();
    auto y = y_t->flat<T>();
    for (int64_t n = 0; n < x.size(); ++n) y(n) = static_cast<T>(alpha_) * x(n);
  }

 private:
  float alpha_;
};

template <typename T>
class CheckSwappedConvOp : public OpKernel {
 public:
  explicit CheckSwappedConvOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("s", &s_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("d", &d_));
    OP_REQUIRES(ctx, s_ > 0 && d_ > 0,
                InvalidArgument("s and d must be positive"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x_t = ctx->input(0);
    const Tensor& w_t = ctx->input(1);
    OP_REQUIRES(ctx, x_t.dims() == 3 && w_t.dims() == 3,
                InvalidArgument("x and w must have rank 3"));
    const int64_t nb = x_t.dim_size(0), nl = x_t.dim_size(1),
                  nc = x_t.dim_size(2);
    const int64_t nk = w_t.dim_size(0), no = w_t.dim_size(2);
    OP_REQUIRES(ctx, w_t.dim_size(1) == nc, InvalidArgument("channels differ"));
    // The output length of the spec; only the read position is swapped.
    int64_t ni = (nl - 1 - d_ * (nk - 1)) / s_ + 1;
    if (nl - 1 - d_ * (nk - 1) < 0) ni = 0;
    Tensor* y_t = nullptr;
    OP_REQUIRES_OK(ctx,
                   ctx->allocate_output(0, TensorShape({nb, ni, no}), &y_t));
    const auto x = x_t.tensor<T, 3>();
    const auto w = w_t.tensor<T, 3>();
    auto y = y_t->tensor<T, 3>();
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t i = 0; i < ni; ++i)
        for (int64_t o = 0; o < no; ++o) {
          T total = T(0);
          for (int64_t k = 0; k < nk; ++k) {
            const int64_t at = d_ * i + s_ * k;  // the bug: s and d swapped
            if (at < 0 || at >= nl) continue;
            for (int64_t c = 0; c < nc; ++c) total += x(b, at, c) * w(k, c, o);
          }
          y(b, i, o) = total;
        }
  }

 private:
  int64_t s_, d_;
};

template <typename T>
class CheckLocalAttentionOp : public OpKernel {
 public:
  explicit CheckLocalAttentionOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("r", &r_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& a_t = ctx->input(0);
    const Tensor& k_t = ctx->input(1);
    const Tensor& v_t = ctx->input(2);
    OP_REQUIRES(ctx, a_t.dims() == 3 && k_t.dims() == 3 && v_t.dims() == 3,
                InvalidArgument("a, k and v must have rank 3"));
    const int64_t nb = a_t.dim_size(0), ni = a_t.dim_size(1),
                  nw = a_t.dim_size(2);
    const int64_t nl = k_t.dim_size(1), nc = k_t.dim_size(2),
                  ne = v_t.dim_size(2);
    OP_REQUIRES(ctx, k_t.dim_size(0) == nb && v_t.dim_size(0) == nb,
                InvalidArgument("batch sizes differ"));
    OP_REQUIRES(ctx, v_t.dim_size(1) == nl,
                InvalidArgument("k and v must have the same length, got k=",
                                k_t.shape().DebugString(), " v=",
                                v_t.shape().DebugString()));
    Tensor* y_t = nullptr;
    OP_REQUIRES_OK(ctx,
                   ctx->allocate_output(0, TensorShape({nb, ni, ne}), &y_t));
    const auto a = a_t.tensor<T, 3>();
    const auto k = k_t.tensor<T, 3>();
    const auto v = v_t.tensor<T, 3>();
    auto y = y_t->tensor<T, 3>();
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t i = 0; i < ni; ++i)
        for (int64_t e = 0; e < ne; ++e) {
          T total = T(0);
          for (int64_t w = 0; w < nw; ++w) {
            const int64_t at = i + w - r_;
            if (at < 0 || at >= nl) continue;
            for (int64_t c = 0; c < nc; ++c)
              total += a(b, i, w) * k(b, at, c) * v(b, at, e);
          }
          y(b, i, e) = total;
        }
  }

 private:
  int64_t r_;
};

template <typename T>
class CheckNoAttrOp : public OpKernel {
 public:
  explicit CheckNoAttrOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x_t = ctx->input(0);
    Tensor* y_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x_t.shape(), &y_t));
    const auto x = x_t.flat<T>();
    auto y = y_t->flat<T>();
    for (int64_t n = 0; n < x.size(); ++n) y(n) = T(2) * x(n);
  }
};

#define REGISTER_CPU(NAME, T)                                        \
  REGISTER_KERNEL_BUILDER(                                           \
      Name(#NAME).Device(DEVICE_CPU).TypeConstraint<T>("T"), NAME##Op<T>);

#define REGISTER_ALL(T)                  \
  REGISTER_CPU(CheckFloatScale, T)       \
  REGISTER_CPU(CheckSwappedConv, T)      \
  REGISTER_CPU(CheckLocalAttention, T)   \
  REGISTER_CPU(CheckNoAttr, T)

REGISTER_ALL(float);
REGISTER_ALL(double);

#undef REGISTER_ALL
#undef REGISTER_CPU
