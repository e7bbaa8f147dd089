// Test-only TensorFlow custom ops for `symgrad check`, declared in
// tests/custom_op/check_ops.toml. Plain CPU loops (correctness only); no
// gradient is registered in C++.
//
// Ops whose kernel computes exactly the formula of the spec:
//
//   CheckMatMul:      y[b,i,j] = sum_k a[b,i,k] * b[b,k,j]
//   CheckScaledTanh:  y[b,i] = alpha * tanh(x[b,i]) + z[b,i]   (alpha = 0.5)
//   CheckStridedConv: y[b,i,o] = sum_{k,c} x[b, s*i + d*k - p, c] * w[k,c,o]
//                     (zero outside x; i < (L - 1 + p - d*(K-1)) / s + 1)
//   CheckGatherRows:  y[b,t,d] = w[ids[b,t], d]   (zero for ids outside w)
//
// Ops whose kernel deliberately departs from the formula of the spec in one
// way, for `symgrad check` to catch:
//
//   CheckOffByOne:     spec y[b,i] = x[b,i] * w[i]; the loop over i stops at
//                      I-1, so y[:, I-1] stays 0.
//   CheckTransposed:   spec y[b,i,j] = A[b,i,k] * B[b,k,j]; the output is laid
//                      out (b, j, i): shape (B, J, I), y[b,j,i] = (a @ b)[b,i,j].
//   CheckMissingScale: spec y[b,i] = 0.5 * x[b,i] * x[b,i]; computes x * x.
//   CheckRenamed:      spec y[b,i,j] = A[b,i,k] * B[b,k,j] with inputs (A, B);
//                      the op's inputs are (rhs, lhs) and y = lhs @ rhs
//                      (batched): the same math under other names and order.

#include <cmath>

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

// Shape function of a batched matmul with inputs (a, b) at positions
// (ia, ib); transposed = true gives the (batch, j, i) layout.
Status BatchedMatMulShape(InferenceContext* c, int ia, int ib,
                          bool transposed) {
  ShapeHandle a, b;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(ia), 3, &a));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(ib), 3, &b));
  DimensionHandle batch, inner;
  TF_RETURN_IF_ERROR(c->Merge(c->Dim(a, 0), c->Dim(b, 0), &batch));
  TF_RETURN_IF_ERROR(c->Merge(c->Dim(a, 2), c->Dim(b, 1), &inner));
  if (transposed) {
    c->set_output(0, c->MakeShape({batch, c->Dim(b, 2), c->Dim(a, 1)}));
  } else {
    c->set_output(0, c->MakeShape({batch, c->Dim(a, 1), c->Dim(b, 2)}));
  }
  return Status();
}

// Checks a (B, I, K) and b (B, K, J) for a batched matmul; names are the
// op's input names for the error message. On failure, ctx's status is set.
void CheckMatMulInputs(OpKernelContext* ctx, const Tensor& a_t,
                       const Tensor& b_t, const char* a_name,
                       const char* b_name) {
  OP_REQUIRES(ctx, a_t.dims() == 3,
              InvalidArgument(a_name, " must be rank 3, got shape ",
                              a_t.shape().DebugString()));
  OP_REQUIRES(ctx, b_t.dims() == 3,
              InvalidArgument(b_name, " must be rank 3, got shape ",
                              b_t.shape().DebugString()));
  OP_REQUIRES(ctx,
              b_t.dim_size(0) == a_t.dim_size(0) &&
                  b_t.dim_size(1) == a_t.dim_size(2),
              InvalidArgument("incompatible shapes ", a_name, "=",
                              a_t.shape().DebugString(), " ", b_name, "=",
                              b_t.shape().DebugString()));
}

}  // namespace

// ------------------------------------------------------------------ op defs

REGISTER_OP("CheckMatMul")
    .Input("a: T")
    .Input("b: T")
    .Output("y: T")
    .Attr("T: {float, double}")
    .SetShapeFn([](InferenceContext* c) {
      return BatchedMatMulShape(c, 0, 1, false);
    });

REGISTER_OP("CheckScaledTanh")
    .Input("x: T")
    .Input("z: T")
    .Output("y: T")
    .Attr("T: {float, double}")
    .Attr("alpha: float = 0.5")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x, z, out;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &z));
      TF_RETURN_IF_ERROR(c->Merge(x, z, &out));
      c->set_output(0, out);
      return Status();
    });

REGISTER_OP("CheckStridedConv")
    .Input("x: T")
    .Input("w: T")
    .Output("y: T")
    .Attr("T: {float, double}")
    .Attr("s: int")
    .Attr("d: int")
    .Attr("p: int")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x, w;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &x));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 3, &w));
      c->set_output(0, c->UnknownShapeOfRank(3));
      return Status();
    });

REGISTER_OP("CheckGatherRows")
    .Input("w: T")
    .Input("ids: Tidx")
    .Output("y: T")
    .Attr("T: {float, double}")
    .Attr("Tidx: {int32, int64}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle w, ids;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &w));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &ids));
      c->set_output(0,
                    c->MakeShape({c->Dim(ids, 0), c->Dim(ids, 1), c->Dim(w, 1)}));
      return Status();
    });

REGISTER_OP("CheckOffByOne")
    .Input("x: T")
    .Input("w: T")
    .Output("y: T")
    .Attr("T: {float, double}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x, w;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &w));
      DimensionHandle i;
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(x, 1), c->Dim(w, 0), &i));
      c->set_output(0, c->MakeShape({c->Dim(x, 0), i}));
      return Status();
    });

REGISTER_OP("CheckTransposed")
    .Input("a: T")
    .Input("b: T")
    .Output("y: T")
    .Attr("T: {float, double}")
    .SetShapeFn([](InferenceContext* c) {
      return BatchedMatMulShape(c, 0, 1, true);
    });

REGISTER_OP("CheckMissingScale")
    .Input("x: T")
    .Output("y: T")
    .Attr("T: {float, double}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
      c->set_output(0, x);
      return Status();
    });

REGISTER_OP("CheckRenamed")
    .Input("rhs: T")
    .Input("lhs: T")
    .Output("y: T")
    .Attr("T: {float, double}")
    .SetShapeFn([](InferenceContext* c) {
      // y = lhs @ rhs: lhs (input 1) is (B, I, K), rhs (input 0) is (B, K, J).
      return BatchedMatMulShape(c, 1, 0, false);
    });

// ------------------------------------------------------------------ kernels

// Batched matmul of a (B, I, K) and b (B, K, J). The output is (B, I, J), or
// (B, J, I) when Transposed is true (CheckTransposed's mistake).
template <typename T, bool Transposed>
void BatchedMatMul(OpKernelContext* ctx, const Tensor& a_t, const Tensor& b_t) {
  const int64_t nb = a_t.dim_size(0), ni = a_t.dim_size(1),
                nk = a_t.dim_size(2), nj = b_t.dim_size(2);
  Tensor* y_t = nullptr;
  const TensorShape shape =
      Transposed ? TensorShape({nb, nj, ni}) : TensorShape({nb, ni, nj});
  OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &y_t));
  const auto a = a_t.tensor<T, 3>();
  const auto b = b_t.tensor<T, 3>();
  auto y = y_t->tensor<T, 3>();
  for (int64_t p = 0; p < nb; ++p)
    for (int64_t i = 0; i < ni; ++i)
      for (int64_t j = 0; j < nj; ++j) {
        T acc = T(0);
        for (int64_t k = 0; k < nk; ++k) acc += a(p, i, k) * b(p, k, j);
        if (Transposed) {
          y(p, j, i) = acc;
        } else {
          y(p, i, j) = acc;
        }
      }
}

template <typename T>
class CheckMatMulOp : public OpKernel {
 public:
  explicit CheckMatMulOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& a_t = ctx->input(0);
    const Tensor& b_t = ctx->input(1);
    CheckMatMulInputs(ctx, a_t, b_t, "a", "b");
    if (!ctx->status().ok()) return;
    BatchedMatMul<T, false>(ctx, a_t, b_t);
  }
};

template <typename T>
class CheckScaledTanhOp : public OpKernel {
 public:
  explicit CheckScaledTanhOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("alpha", &alpha_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x_t = ctx->input(0);
    const Tensor& z_t = ctx->input(1);
    OP_REQUIRES(ctx, x_t.dims() == 2,
                InvalidArgument("x must be rank 2, got shape ",
                                x_t.shape().DebugString()));
    OP_REQUIRES(ctx, x_t.shape() == z_t.shape(),
                InvalidArgument("x and z must have the same shape, got x=",
                                x_t.shape().DebugString(), " z=",
                                z_t.shape().DebugString()));
    Tensor* y_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x_t.shape(), &y_t));
    const auto x = x_t.flat<T>();
    const auto z = z_t.flat<T>();
    auto y = y_t->flat<T>();
    const T alpha = static_cast<T>(alpha_);
    for (int64_t n = 0; n < x.size(); ++n) y(n) = alpha * std::tanh(x(n)) + z(n);
  }

 private:
  float alpha_;
};

template <typename T>
class CheckStridedConvOp : public OpKernel {
 public:
  explicit CheckStridedConvOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("s", &s_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("d", &d_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("p", &p_));
    OP_REQUIRES(ctx, s_ > 0 && d_ > 0,
                InvalidArgument("s and d must be positive"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x_t = ctx->input(0);
    const Tensor& w_t = ctx->input(1);
    OP_REQUIRES(ctx, x_t.dims() == 3 && w_t.dims() == 3,
                InvalidArgument("x and w must have rank 3, got x=",
                                x_t.shape().DebugString(), " w=",
                                w_t.shape().DebugString()));
    const int64_t nb = x_t.dim_size(0), nl = x_t.dim_size(1),
                  nc = x_t.dim_size(2);
    const int64_t nk = w_t.dim_size(0), no = w_t.dim_size(2);
    OP_REQUIRES(ctx, w_t.dim_size(1) == nc,
                InvalidArgument("channels differ: x=", x_t.shape().DebugString(),
                                " w=", w_t.shape().DebugString()));
    int64_t ni = (nl - 1 + p_ - d_ * (nk - 1)) / s_ + 1;
    if (nl - 1 + p_ - d_ * (nk - 1) < 0) ni = 0;
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
class CheckGatherRowsOp : public OpKernel {
 public:
  explicit CheckGatherRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& w_t = ctx->input(0);
    const Tensor& ids_t = ctx->input(1);
    OP_REQUIRES(ctx, w_t.dims() == 2 && ids_t.dims() == 2,
                InvalidArgument("w and ids must have rank 2, got w=",
                                w_t.shape().DebugString(), " ids=",
                                ids_t.shape().DebugString()));
    const int64_t nv = w_t.dim_size(0), ne = w_t.dim_size(1);
    const int64_t nb = ids_t.dim_size(0), nt = ids_t.dim_size(1);
    Tensor* y_t = nullptr;
    OP_REQUIRES_OK(ctx,
                   ctx->allocate_output(0, TensorShape({nb, nt, ne}), &y_t));
    const auto w = w_t.matrix<T>();
    const auto ids = ids_t.matrix<Index>();
    auto y = y_t->tensor<T, 3>();
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t t = 0; t < nt; ++t) {
        const int64_t row = static_cast<int64_t>(ids(b, t));
        for (int64_t e = 0; e < ne; ++e)
          y(b, t, e) = (row >= 0 && row < nv) ? w(row, e) : T(0);
      }
  }
};

template <typename T>
class CheckOffByOneOp : public OpKernel {
 public:
  explicit CheckOffByOneOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x_t = ctx->input(0);
    const Tensor& w_t = ctx->input(1);
    OP_REQUIRES(ctx, x_t.dims() == 2,
                InvalidArgument("x must be rank 2, got shape ",
                                x_t.shape().DebugString()));
    OP_REQUIRES(ctx, w_t.dims() == 1 && w_t.dim_size(0) == x_t.dim_size(1),
                InvalidArgument("w must be rank 1 of x.shape[1], got x=",
                                x_t.shape().DebugString(), " w=",
                                w_t.shape().DebugString()));
    const int64_t nb = x_t.dim_size(0), ni = x_t.dim_size(1);
    Tensor* y_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x_t.shape(), &y_t));
    const auto x = x_t.matrix<T>();
    const auto w = w_t.vec<T>();
    auto y = y_t->matrix<T>();
    y.setZero();
    // The deliberate mistake: i stops at I-1, so y[:, I-1] stays 0.
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t i = 0; i < ni - 1; ++i) y(b, i) = x(b, i) * w(i);
  }
};

template <typename T>
class CheckTransposedOp : public OpKernel {
 public:
  explicit CheckTransposedOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& a_t = ctx->input(0);
    const Tensor& b_t = ctx->input(1);
    CheckMatMulInputs(ctx, a_t, b_t, "a", "b");
    if (!ctx->status().ok()) return;
    // The deliberate mistake: the output is laid out (b, j, i).
    BatchedMatMul<T, true>(ctx, a_t, b_t);
  }
};

template <typename T>
class CheckMissingScaleOp : public OpKernel {
 public:
  explicit CheckMissingScaleOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x_t = ctx->input(0);
    OP_REQUIRES(ctx, x_t.dims() == 2,
                InvalidArgument("x must be rank 2, got shape ",
                                x_t.shape().DebugString()));
    Tensor* y_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x_t.shape(), &y_t));
    const auto x = x_t.flat<T>();
    auto y = y_t->flat<T>();
    // The deliberate mistake: the factor 0.5 of the spec is missing.
    for (int64_t n = 0; n < x.size(); ++n) y(n) = x(n) * x(n);
  }
};

template <typename T>
class CheckRenamedOp : public OpKernel {
 public:
  explicit CheckRenamedOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& rhs_t = ctx->input(0);
    const Tensor& lhs_t = ctx->input(1);
    CheckMatMulInputs(ctx, lhs_t, rhs_t, "lhs", "rhs");
    if (!ctx->status().ok()) return;
    // y = lhs @ rhs: the spec's math, with inputs (rhs, lhs) instead of (A, B).
    BatchedMatMul<T, false>(ctx, lhs_t, rhs_t);
  }
};

// ------------------------------------------------------------ registrations

#define REGISTER_CPU(NAME, T)                                        \
  REGISTER_KERNEL_BUILDER(                                           \
      Name(#NAME).Device(DEVICE_CPU).TypeConstraint<T>("T"), NAME##Op<T>);

#define REGISTER_ALL(T)                  \
  REGISTER_CPU(CheckMatMul, T)           \
  REGISTER_CPU(CheckScaledTanh, T)       \
  REGISTER_CPU(CheckStridedConv, T)      \
  REGISTER_CPU(CheckOffByOne, T)         \
  REGISTER_CPU(CheckTransposed, T)       \
  REGISTER_CPU(CheckMissingScale, T)     \
  REGISTER_CPU(CheckRenamed, T)

REGISTER_ALL(float);
REGISTER_ALL(double);

#define REGISTER_GATHER(T, Index)                                    \
  REGISTER_KERNEL_BUILDER(Name("CheckGatherRows")                    \
                              .Device(DEVICE_CPU)                    \
                              .TypeConstraint<T>("T")                \
                              .TypeConstraint<Index>("Tidx"),        \
                          CheckGatherRowsOp<T, Index>);
REGISTER_GATHER(float, int32_t);
REGISTER_GATHER(float, int64_t);
REGISTER_GATHER(double, int32_t);
REGISTER_GATHER(double, int64_t);

#undef REGISTER_GATHER
#undef REGISTER_ALL
#undef REGISTER_CPU
