"""The elementwise functions of the formula language, as SymPy functions.

One place per rule: SymPy's own functions where their derivative matches TensorFlow's
convention, small `Function` subclasses (with `fdiff`) where TF's hand-written gradient
fixes a value SymPy leaves open -- `max`/`min` at ties (`Heaviside(0)` in SymPy) -- or
where SymPy has no function (sigmoid, softplus, and the activations relu, silu, gelu,
gelu_tanh, elu: each one call of its framework's own function forward, its derivative
written from SymPy's functions).

Conventions at non-smooth points (the same as TensorFlow's):
- `abs(x)`: derivative `sign(x)`, so 0 at x = 0.
- `max(x, y)`: the whole gradient goes to `x` where `x >= y` (ties included), else to `y`.
- `min(x, y)`: the whole gradient goes to `x` where `x <= y` (ties included), else to `y`.
- `x ** y` with a tensor exponent: `∂/∂y = x**y * log(x)`, which is nan for x <= 0.
"""

from __future__ import annotations

import sympy as sp


class sigmoid(sp.Function):
    """1 / (1 + exp(-x))."""

    is_real = True

    def fdiff(self, argindex=1):
        return sigmoid(self.args[0]) * (1 - sigmoid(self.args[0]))

    @classmethod
    def eval(cls, x):
        if x.is_number:
            return 1 / (1 + sp.exp(-x))
        return None


class softplus(sp.Function):
    """log(1 + exp(x))."""

    is_real = True

    def fdiff(self, argindex=1):
        return sigmoid(self.args[0])

    @classmethod
    def eval(cls, x):
        if x.is_number:
            return sp.log(1 + sp.exp(x))
        return None


class silu(sp.Function):
    """x * sigmoid(x) (SiLU, swish)."""

    is_real = True

    def fdiff(self, argindex=1):
        x = self.args[0]
        return sigmoid(x) * (1 + x * (1 - sigmoid(x)))

    @classmethod
    def eval(cls, x):
        if x.is_number:
            return x / (1 + sp.exp(-x))
        return None


class gelu(sp.Function):
    """x * Φ(x) = x / 2 * (1 + erf(x / sqrt(2))): GELU in its exact form (the default of
    `tf.nn.gelu` and `torch.nn.functional.gelu`)."""

    is_real = True

    def fdiff(self, argindex=1):
        x = self.args[0]
        return (1 + sp.erf(x / sp.sqrt(2))) / 2 + x * sp.exp(-(x**2) / 2) / sp.sqrt(2 * sp.pi)

    @classmethod
    def eval(cls, x):
        if x.is_number:
            return x * (1 + sp.erf(x / sp.sqrt(2))) / 2
        return None


def _gelu_tanh(x: sp.Expr) -> sp.Expr:
    """GELU's tanh approximation, written out (as TensorFlow's `approximate=True`)."""
    return x * (1 + sp.tanh(sp.sqrt(2 / sp.pi) * (x + sp.Rational(44715, 10**6) * x**3))) / 2


class gelu_tanh(sp.Function):
    """x / 2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))): GELU's tanh approximation
    (GPT-2's; `approximate=True` in TensorFlow and JAX, `"tanh"` in PyTorch)."""

    is_real = True

    def fdiff(self, argindex=1):
        s = sp.Dummy("s", real=True)
        return sp.diff(_gelu_tanh(s), s).subs(s, self.args[0])

    @classmethod
    def eval(cls, x):
        if x.is_number:
            return _gelu_tanh(x)
        return None


class _Step(sp.Function):
    """1 where `holds(x, y)`, else 0 (the gradient mask of max/min); its
    derivative is 0."""

    is_real = True

    @staticmethod
    def holds(x, y) -> bool:
        raise NotImplementedError

    def fdiff(self, argindex=1):
        return sp.Integer(0)

    @classmethod
    def eval(cls, x, y):
        if x.is_number and y.is_number:
            return sp.Integer(1 if cls.holds(x, y) else 0)
        return None


class step_ge(_Step):
    """1 where x >= y, else 0."""

    @staticmethod
    def holds(x, y) -> bool:
        return bool(x >= y)


class step_le(_Step):
    """1 where x <= y, else 0."""

    @staticmethod
    def holds(x, y) -> bool:
        return bool(x <= y)


class step_eq(_Step):
    """1 where x == y, else 0: which entries attain a max/min over indices (its ties)."""

    @staticmethod
    def holds(x, y) -> bool:
        return bool(x == y)


# -inf, for masked logits: `where(c, exp(u), 0)` is `exp(where(c, u, -inf))`, so a masked
# sum of exponentials stays a logsumexp (finite at logits in the hundreds). A plain symbol,
# not SymPy's -oo, so that algebra treats it as an opaque number.
NEG_INF = sp.Symbol("_neg_inf", real=True)


class index_value(sp.Function):
    """The value of an index (`_iota[i]`: 0, 1, ...) as a number of the inputs' float
    dtype, as in RWKV's decay `(t - 1 - i) * w[c]`. A constant: no gradient."""

    is_real = True

    def fdiff(self, argindex=1):
        return sp.Integer(0)


class floor(sp.Function):
    """The largest integer <= x, in the inputs' float dtype. Piecewise constant: its
    derivative is 0 (so `x - floor(x)`, a sampled read's fraction, has derivative 1)."""

    is_real = True

    def fdiff(self, argindex=1):
        return sp.Integer(0)

    @classmethod
    def eval(cls, x):
        if x.is_Number:
            return sp.floor(x)
        if isinstance(x, floor):  # already an integer
            return x
        return None


class floor_index(sp.Function):
    """floor(x) as an integer position (int64): where a sampled read gathers its lower
    neighbour. Only inside gather positions, never differentiated; printed `floor(x)`."""

    def _symgrad_str(self, printer) -> str:  # notation.IndexPrinter: `floor(x)`
        return f"floor({printer._print(self.args[0])})"

    @classmethod
    def eval(cls, x):
        if x.is_Number:  # a constant position: the plain integer read it is
            return sp.floor(x)
        return None

    def _latex(self, printer) -> str:
        return rf"\left\lfloor{{{printer._print(self.args[0])}}}\right\rfloor"

    def fdiff(self, argindex=1):
        return sp.Integer(0)


class select(sp.Function):
    """`where(cond, a, b)`: a where the condition holds, else b.

    The condition gets no gradient, and the derivative is the select of the derivatives,
    so a nan or inf in the branch not taken never reaches the gradient (unlike
    `cond*a + (1-cond)*b`)."""

    is_real = True

    @classmethod
    def eval(cls, cond, a, b):
        if cond is sp.true:
            return a
        if cond is sp.false:
            return b
        if a == b:
            return a
        return None

    def _eval_derivative(self, s):
        cond, a, b = self.args
        return select(cond, sp.diff(a, s), sp.diff(b, s))


class _Extremum(sp.Function):
    """max or min with TensorFlow's tie rule: the gradient goes to x where `mask` is 1."""

    is_real = True
    mask: type[_Step] = step_ge
    fold = sp.Max  # the value for numbers

    def fdiff(self, argindex=1):
        x, y = self.args
        return self.mask(x, y) if argindex == 1 else 1 - self.mask(x, y)

    @classmethod
    def eval(cls, x, y):
        if x.is_number and y.is_number:
            return cls.fold(x, y)
        return None


class maximum(_Extremum):
    """max(x, y): ties send the gradient to x (see module docstring)."""

    mask = step_ge
    fold = sp.Max


class minimum(_Extremum):
    """min(x, y): ties send the gradient to x (see module docstring)."""

    mask = step_le
    fold = sp.Min


class elu(sp.Function):
    """x where x > 0, else exp(x) - 1 (ELU with alpha 1). Its derivative is
    exp(min(x, 0)): 1 for x >= 0 (as TensorFlow's EluGrad at 0), exp(x) below."""

    is_real = True

    def fdiff(self, argindex=1):
        return sp.exp(minimum(self.args[0], 0))

    @classmethod
    def eval(cls, x):
        if x.is_number:
            return x if x > 0 else sp.exp(x) - 1
        return None


class relu(sp.Function):
    """max(x, 0) with the frameworks' gradient at 0: 1 only where x > 0 (`max(x, 0)`
    gives its tie at 0 to x, as TensorFlow's maximum does)."""

    is_real = True

    def fdiff(self, argindex=1):
        return 1 - step_le(self.args[0], 0)

    @classmethod
    def eval(cls, x):
        if x.is_number:
            return sp.Max(x, 0)
        return None


_UNARY = {
    "exp": sp.exp,
    "log": sp.log,
    "sin": sp.sin,
    "cos": sp.cos,
    "tan": sp.tan,
    "tanh": sp.tanh,
    "sinh": sp.sinh,
    "cosh": sp.cosh,
    "sqrt": sp.sqrt,
    "abs": sp.Abs,
    "sigmoid": sigmoid,
    "softplus": softplus,
    "erf": sp.erf,
    "floor": floor,
    "silu": silu,
    "gelu": gelu,
    "gelu_tanh": gelu_tanh,
    "elu": elu,
    "relu": relu,
}
_BINARY = {"max": maximum, "min": minimum}


def apply(name: str, args: list[sp.Expr]) -> sp.Expr:
    """The SymPy expression for the language's function `name` applied to `args`."""
    if name in _UNARY:
        return _UNARY[name](args[0])
    return _BINARY[name](*args)
