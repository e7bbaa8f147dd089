"""Random windowed formulas: affine positions `s*i + d*k + o` (coefficients 1-3, offsets
-2..2), output ranges from the spec, from a plain use or by default (the largest range that
keeps every access in bounds at its upper end), reductions (sum, mean, max, min) over a
window index, and `where` masks on index comparisons or values. Each one is either refused
with a clear one-line error, or its generated gradient matches TF autodiff over the
reference evaluator. A window index with no range at all must be refused.
"""

from __future__ import annotations

import pytest

tf = pytest.importorskip("tensorflow")

import random
from dataclasses import dataclass, field

from harness import Case, check, generate, op_spec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from symgrad.errors import SymgradError
from symgrad.model import build

BATCH = 2


@dataclass(frozen=True)
class Drawn:
    formula: str
    shapes: dict
    ranges: dict
    sizes: dict
    k_has_range: bool
    attrs: dict = field(default_factory=dict)


def _affine(s: int, d: int, o: int) -> str:
    terms = ["i" if s == 1 else f"{s}*i"]
    if d:
        terms.append("k" if d == 1 else f"{d}*k")
    text = " + ".join(terms)
    return f"{text} + {o}" if o > 0 else f"{text} - {-o}" if o < 0 else text


def draw_window(rng: random.Random) -> Drawn:
    """One random windowed formula; redrawn until every index has a different size."""
    while True:
        drawn = _attempt(rng)
        if drawn is not None:
            return drawn


def _attempt(rng: random.Random) -> Drawn | None:
    length = rng.randint(9, 14)  # x's window axis: read only through affine positions
    window = rng.randint(3, 5)
    kind = rng.choice(["sum", "mean", "max", "min", "none"])
    uses_k = kind != "none"
    channels = rng.choice([None, rng.randint(3, 7)])  # a plain axis c next to the window
    c = ", c" if channels else ""

    # One or two accesses of x; each uses i, and k when there is a window.
    accesses = []
    for _ in range(rng.randint(1, 2)):
        s, o = rng.randint(1, 3), rng.randint(-2, 2)
        d = rng.randint(1, 3) if uses_k else 0
        accesses.append((s, d, o, f"x[b, {_affine(s, d, o)}{c}]"))
    texts = [a[3] for a in accesses]
    body = texts[0] if len(texts) == 1 else f"{texts[0]} {rng.choice('+*')} {texts[1]}"

    shapes = {"x": (BATCH, length, channels) if channels else (BATCH, length)}
    k_source = rng.choice(["ranges", "plain", "ranges", "plain", "none"]) if uses_k else "unused"
    if k_source == "plain":  # a weight over the window gives k its range
        body = f"({body}) * w[k]"
        shapes["w"] = (window,)

    # A mask: comparisons on indices (with k only inside a window), or on a value.
    o = rng.randint(-2, 2)
    conditions = [f"i >= {rng.randint(0, 2)}", f"{texts[0]} > 0"]
    if uses_k:
        conditions += [
            f"k <= i + {o}" if o >= 0 else f"k <= i - {-o}",
            f"{o} <= i - k <= {o + 2}",
            "i != k",
            "not (2*k > i)",
            f"k < i or k == {abs(o)}",
            f"k >= 1 and {texts[0]} < 0.5",
        ]
    if rng.random() < 0.6:
        otherwise = rng.choice(["0", texts[-1], "-2"])
        body = f"where({rng.choice(conditions)}, {body}, {otherwise})"
    rhs = f"{kind}({body}, k)" if uses_k else body

    # Where i's range comes from.
    ranges: dict[str, str] = {}
    plain = any((s, d, o) == (1, 0, 0) for s, d, o, _ in accesses)  # `x[b, i]`
    i_source = "x" if plain else rng.choice(["default", "shape", "literal", "plain"])
    if i_source == "x":  # a plain use: i runs over x's axis, and the shifted reads pad
        size_i = length
    elif i_source == "shape":
        cut = rng.randint(0, 3)
        ranges["i"] = "x.shape[1]" + (f" - {cut}" if cut else "")
        size_i = length - cut
    elif i_source == "literal":
        size_i = rng.randint(3, 8)
        ranges["i"] = str(size_i)
    elif i_source == "plain":
        size_i = rng.randint(4, 8)
        shapes["v"] = (BATCH, size_i, channels) if channels else (BATCH, size_i)
        rhs = f"{rhs} + v[b, i{c}]"
    else:  # every access in bounds at the upper ends of i and k
        upper = window - 1 if uses_k else 0
        size_i = min((length - 1 - o - d * upper) // s + 1 for s, d, o, _ in accesses)
    if k_source == "ranges":
        ranges["k"] = str(window)

    sizes = [BATCH, size_i, *([window] if uses_k else []), *([channels] if channels else [])]
    if size_i < 2 or len(set(sizes)) != len(sizes):  # a different size for every index
        return None
    return Drawn(
        f"y[b,i{c.replace(' ', '')}] = {rhs}",
        shapes,
        ranges,
        {"i": size_i, **({"k": window} if uses_k else {})},
        k_source != "none",
    )


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(drawn=st.integers(0, 2**32 - 1).map(lambda seed: draw_window(random.Random(seed))))
def test_random_window_is_refused_or_correct(drawn, tmp_path_factory):
    case = Case(
        drawn.formula,
        drawn.shapes,
        ranges=drawn.ranges,
        sizes=drawn.sizes,
        rtol=1e-8,
        finite_differences=False,
    )
    try:
        build(op_spec(case, "Probe"))
    except SymgradError as error:
        message = error.render().splitlines()[0]
        assert message.startswith("error: ") and len(message) < 300, message
        if not drawn.k_has_range:
            assert "'k'" in message, message
        return
    assert drawn.k_has_range, f"accepted a window index without a range: {drawn.formula}"
    module = generate(case, tmp_path_factory.mktemp("window"), prefix="Window")
    check(case, module)


# ----------------------------------------------------------------------------- convolutions


def draw_convolution(rng: random.Random) -> Drawn:
    """A random 1-d or 2-d convolution `sum(x[b, s*i + k + o, .., c] * w[k, .., c, q], ..)`
    with literal or int-attr strides and offsets (padding or cropping), any output range,
    and the output axes in either channel order: the recognised pattern and its edges."""
    while True:
        drawn = _convolution(rng)
        if drawn is not None:
            return drawn


def _convolution(rng: random.Random) -> Drawn | None:
    rank = rng.choice([1, 1, 2])
    outs, wins = ["i", "j"][:rank], ["u", "v"][:rank]
    channels, filters = rng.randint(1, 4), rng.randint(1, 5)
    positions, ranges, sizes, attrs, shape, kernel = [], {}, {}, {}, [], []
    for axis, (i, u) in enumerate(zip(outs, wins, strict=True), start=1):
        length, width = rng.randint(5, 11), rng.randint(1, 4)
        stride, offset = rng.randint(1, 3), rng.randint(-3, 3)
        s = str(stride)
        if rng.random() < 0.3:
            s = f"s{axis}"
            attrs[s] = stride
        o = f" + {offset}" if offset > 0 else f" - {-offset}" if offset < 0 else ""
        if offset and rng.random() < 0.3:
            o = f" - p{axis}"
            attrs[f"p{axis}"] = -offset
        positions.append(f"{s}*{i} + {u}{o}")
        choice = rng.choice(["default", "shape", "same", "literal"])
        if choice == "default":
            size = max((length - 1 - offset - (width - 1)) // stride + 1, 0)
        elif choice == "shape":
            cut = rng.randint(-2, 2)
            ranges[i] = f"x.shape[{axis}]" + (
                f" - {cut}" if cut > 0 else f" + {-cut}" if cut else ""
            )
            size = length - cut
        elif choice == "same":
            ranges[i] = f"(x.shape[{axis}] + {stride - 1}) // {stride}"
            size = (length + stride - 1) // stride
        else:
            size = rng.randint(1, 6)
            ranges[i] = str(size)
        sizes[i] = size
        shape.append(length)
        kernel.append(width)
    all_sizes = [BATCH, channels, filters, *sizes.values(), *kernel]
    if min(sizes.values()) < 1 or len(set(all_sizes)) != len(all_sizes):
        return None
    read = f"x[b, {', '.join(positions)}, c] * w[{', '.join(wins)}, c, q]"
    body = f"sum({read}, {', '.join(wins)}, c)"
    out = ["b", *outs, "q"] if rng.random() < 0.7 else ["b", "q", *outs]
    if rng.random() < 0.2:
        body = f"tanh({body} + beta[q])"
    shapes = {"x": (BATCH, *shape, channels), "w": (*kernel, channels, filters)}
    if "beta" in body:
        shapes["beta"] = (filters,)
    formula = f"y[{','.join(out)}] = {body}"
    return Drawn(formula, shapes, ranges, sizes, True, attrs)


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(drawn=st.integers(0, 2**32 - 1).map(lambda seed: draw_convolution(random.Random(seed))))
def test_random_convolution_matches_the_reference(drawn, tmp_path_factory):
    """Every drawn convolution is in the language, so none may be refused."""
    case = Case(
        drawn.formula,
        drawn.shapes,
        attrs=drawn.attrs,
        ranges=drawn.ranges,
        sizes=drawn.sizes,
        rtol=1e-8,
        finite_differences=False,
    )
    module = generate(case, tmp_path_factory.mktemp("conv"), prefix="Conv")
    check(case, module)
