"""The elementwise functions of the formula language, as SymPy functions.

One place per rule: SymPy's own functions where their derivative matches TensorFlow's
convention, small `Function` subclasses (with `fdiff`) where TF's hand-written gradient
fixes a value SymPy leaves open -- `max`/`min` at ties (`Heaviside(0)` in SymPy) -- or
where SymPy has no function (sigmoid, softplus).

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


class step_ge(sp.Function):
    """1 where x >= y, else 0 (the gradient mask of max); its derivative is 0."""

    is_real = True

    def fdiff(self, argindex=1):
        return sp.Integer(0)

    @classmethod
    def eval(cls, x, y):
        if x.is_number and y.is_number:
            return sp.Integer(1 if bool(x >= y) else 0)
        return None


class step_le(sp.Function):
    """1 where x <= y, else 0 (the gradient mask of min); its derivative is 0."""

    is_real = True

    def fdiff(self, argindex=1):
        return sp.Integer(0)

    @classmethod
    def eval(cls, x, y):
        if x.is_number and y.is_number:
            return sp.Integer(1 if bool(x <= y) else 0)
        return None


class maximum(sp.Function):
    """max(x, y) with TensorFlow's tie rule (see module docstring)."""

    is_real = True

    def fdiff(self, argindex=1):
        x, y = self.args
        return step_ge(x, y) if argindex == 1 else 1 - step_ge(x, y)

    @classmethod
    def eval(cls, x, y):
        if x.is_number and y.is_number:
            return sp.Max(x, y)
        return None


class minimum(sp.Function):
    """min(x, y) with TensorFlow's tie rule (see module docstring)."""

    is_real = True

    def fdiff(self, argindex=1):
        x, y = self.args
        return step_le(x, y) if argindex == 1 else 1 - step_le(x, y)

    @classmethod
    def eval(cls, x, y):
        if x.is_number and y.is_number:
            return sp.Min(x, y)
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
}
_BINARY = {"max": maximum, "min": minimum}


def apply(name: str, args: list[sp.Expr]) -> sp.Expr:
    """The SymPy expression for the language's function `name` applied to `args`."""
    if name in _UNARY:
        return _UNARY[name](args[0])
    return _BINARY[name](*args)
