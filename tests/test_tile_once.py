"""A tiled module carries its program once (`symgrad/tile_once.py`): the chunk's, which the
whole op runs at tile_start=0 (and tile_length=None), where the two lowered programs agree.

Pinned here: the committed modules define no second program (`_chunk_compute`,
`_chunk_backward`) unless they say why; the one program at start 0 is, step for step, the
op's own lowered program, for every tiled op of the specs and of the tiling tests; and the
untiled call gives bit for bit the numbers of the module that kept both programs.
"""

from __future__ import annotations

import ast
import collections
import itertools
from pathlib import Path

import numpy as np
import pytest
from harness import load_module
from window_ops import dilated_lightconv

from symgrad import ir, pipeline, recurrence, tile_once
from symgrad.pipeline import compile_op, module_text
from symgrad.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
SPECS = [
    ROOT / "symgrad.toml",
    ROOT / "benchmarks" / "bench.toml",
    ROOT / "benchmarks" / "memory.toml",
]
FOLDERS = ["generated", "generated_torch", "generated_jax", "benchmarks/generated"]
# The ops whose chunk lowers otherwise than the op (a read the op lowers to a slice, a
# reshape or a kernel is a gather at shifted positions): they keep two programs.
SEPARATE = {"cc_attention_map", "cc_attention_scores", "max_pool2x2", "rwkv_wkv"}
# The correlations' third level sizes the displacement u by the chunk's length, which lowers
# otherwise than the chunk of i and j (`tile_nest`): two programs.
SEPARATE |= {"correlation", "mmcv_correlation", "bench_correlation"}
SEPARATE |= {"segment_csr_sum", "bench_max_pool", "natten_qk2d"}
# Tiled in two levels (`tile_nest`) where the chunk of both indices lowers otherwise than
# the chunk of one (a window read as a convolution along the inner index, then a gather).
SEPARATE |= {"involution", "dynamic_conv", "roi_pool"}
# Tiled in two levels because one position of the window offset is the size of `query`
# (`position_bound`): the chunk of both keeps other intermediates for its gradient.
SEPARATE |= {"natten_qk1d"}
_counter = itertools.count()


def _ops():
    for path in SPECS:
        for op in load_spec(path).ops:
            if not recurrence.is_recurrence(op):
                yield path.name, op


def _defined(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def _tiled_files():
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).glob("*.py")):
            if "def _tiled_compute(" in path.read_text(encoding="utf-8"):
                yield path


def test_a_committed_tiled_module_writes_its_program_once():
    files = list(_tiled_files())
    assert len(files) >= 50, len(files)
    once = 0
    for path in files:
        defined = _defined(path)
        assert {"_compute", "_backward", "_tiled_compute"} <= defined, path
        if path.stem in SEPARATE:
            assert {"_chunk_compute", "_chunk_backward"} <= defined, path
            assert "# Two programs: the chunk's lowering differs" in path.read_text(), path
            continue
        assert not defined & {"_chunk_compute", "_chunk_backward"}, f"{path}: two programs"
        assert "_chunk_saved" not in defined, f"{path}: two recomputes of the intermediates"
        once += 1
    assert once >= 40, once


def _at_zero(e: ir.Expr) -> ir.Expr:
    """The one program's expression for the whole op: no shift, the op's side of `Whole`."""

    def swap(x):
        if isinstance(x, ir.Call) and x.function == "shift":
            # a nested tiling's program shifts by the inner level's start too (tile_nest)
            assert x.args[1] in (ir.Var("_int_tile_start"), ir.Var("_int_tile_start2")), x
            return ir.rewrite(x.args[0], swap)
        if isinstance(x, ir.Whole):
            return ir.rewrite(x.whole, swap)
        return None

    return ir.rewrite(e, swap)


@pytest.mark.parametrize("spec, op", list(_ops()), ids=lambda v: getattr(v, "name", v))
def test_the_one_program_at_start_zero_is_the_ops_own(spec, op):
    module = compile_op(op)
    if module.tiling is None:
        return
    program = module.tiling.program
    if program is None:
        assert module.tiling.separate, f"{op.name}: two programs, and no reason"
        return
    for kind in ("forward", "backward"):
        ours, theirs = getattr(program, kind), getattr(module, kind)
        assert ours.returns == theirs.returns
        assert [s.target for s in ours.steps] == [s.target for s in theirs.steps]
        for a, b in zip(ours.steps, theirs.steps, strict=True):
            assert _at_zero(a.value) == b.value, f"{op.name} {kind} {a.target}"
    assert program.saved == module.saved and program.inputs == module.inputs


def _spec_op(name: str):
    if name == "DilatedLightconv":  # a test op: LightconvSame is a depthwise kernel
        return dilated_lightconv()
    return next(op for path, op in _ops() if op.name == name)


def _both(op, target, folder, monkeypatch):
    """The module with one program, and the module that keeps the op's and the chunk's."""
    one = load_module(module_text(op, "t.toml", target), folder, f"once_{next(_counter)}")
    with monkeypatch.context() as m:
        m.setattr(pipeline.tile_once, "merge", lambda module: (module, "kept apart"))
        text = module_text(op, "t.toml", target)
    two = load_module(text, folder, f"twice_{next(_counter)}")
    assert not hasattr(one, "_chunk_compute") and hasattr(two, "_chunk_compute")
    return one, two


# Each kind of shift: an int position (NattenAv2d's window), a length as well (a dilated
# lightconv, `window_ops`), a
# float position (RoiAlign, DeformConv2d), a position cast to int64 (LongformerQk).
CASES = {
    "NattenAv2d": ({"attn": (2, 3, 7, 6, 9), "value": (2, 3, 7, 6, 5)}, {"K": 3}),
    "DilatedLightconv": ({"w": (3, 5), "x": (2, 3, 11)}, {}),
    "LongformerQk": ({"X": (2, 9, 3, 4), "Y": (2, 9, 3, 4), "D": (3,)}, {"w": 2}),
    "RoiAlign": (
        {"x": (2, 3, 7, 6), "bi": (4,), "y0": (4,), "x0": (4,), "bh": (4,), "bw": (4,)},
        {"S": 2, "PH": 3, "PW": 2},
    ),
}


def _inputs(module, shapes, rng):
    arrays = []
    for name in module.INPUTS:
        if name == "bi":
            arrays.append(rng.integers(0, shapes["x"][0], shapes[name]))
        elif name == "D":
            arrays.append(rng.integers(1, 3, shapes[name]))
        elif name in ("bh", "bw"):
            arrays.append(rng.uniform(0.5, 2.0, shapes[name]))
        else:
            arrays.append(rng.standard_normal(shapes[name]))
    return arrays


@pytest.mark.parametrize("name", sorted(CASES))
def test_tensorflow_untiled_call_is_bit_identical_to_the_two_program_module(
    name, tmp_path, monkeypatch
):
    tf = pytest.importorskip("tensorflow")
    one, two = _both(_spec_op(name), "tensorflow", tmp_path, monkeypatch)
    shapes, attrs = CASES[name]
    rng = np.random.default_rng(3)
    xs = [tf.constant(a) for a in _inputs(one, shapes, rng)]
    assert one._tile_plan(*xs, **attrs) is None
    y1, y2 = one.forward(*xs, **attrs), two.forward(*xs, **attrs)
    np.testing.assert_array_equal(y1.numpy(), y2.numpy())
    grad = tf.constant(rng.standard_normal(y1.shape))
    for g1, g2 in zip(one.vjp(*xs, grad, **attrs), two.vjp(*xs, grad, **attrs), strict=True):
        assert (g1 is None) == (g2 is None)
        if g1 is not None:
            np.testing.assert_array_equal(np.asarray(g1), np.asarray(g2))


@pytest.mark.parametrize("name", ["NattenAv2d", "DilatedLightconv"])
def test_pytorch_and_jax_untiled_calls_are_bit_identical_too(name, tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    shapes, attrs = CASES[name]
    for target, to in (("pytorch", torch.tensor), ("jax", jnp.asarray)):
        one, two = _both(_spec_op(name), target, tmp_path, monkeypatch)
        arrays = _inputs(one, shapes, np.random.default_rng(4))
        xs = [to(a) for a in arrays]
        y1, y2 = one.forward(*xs, **attrs), two.forward(*xs, **attrs)
        np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
        grad = to(np.random.default_rng(5).standard_normal(tuple(y1.shape)))
        got = one.vjp(*xs, grad, **attrs)
        for g1, g2 in zip(got, two.vjp(*xs, grad, **attrs), strict=True):
            np.testing.assert_array_equal(np.asarray(g1), np.asarray(g2))


@pytest.mark.parametrize("name", sorted(CASES))
def test_pytorch_recomputes_the_intermediates_with_the_one_program(name, tmp_path, monkeypatch):
    """The one program serves PyTorch's `_recompute` too (`tile_once.program_recomputes`):
    the untiled backward calls it at the defaults, each chunk with its start, and no
    `_chunk_saved` stands beside it; at the defaults it gives bit for bit the intermediates
    of the module that kept both programs, and those `_compute` saves."""
    torch = pytest.importorskip("torch")
    one, two = _both(_spec_op(name), "pytorch", tmp_path, monkeypatch)
    assert not hasattr(one, "_chunk_saved") and hasattr(two, "_chunk_saved")
    shapes, attrs = CASES[name]
    xs = [torch.tensor(a) for a in _inputs(one, shapes, np.random.default_rng(7))]
    outputs, saved = one._compute(*xs, **attrs)
    got = one._recompute(*xs, *outputs, **attrs)
    want = two._recompute(*xs, *outputs, **attrs)
    assert len(got) == len(want) == len(saved) > 0
    for g, w, s in zip(got, want, saved, strict=True):
        np.testing.assert_array_equal(g.numpy(), w.numpy())
        np.testing.assert_array_equal(g.numpy(), s.numpy())


def test_the_untiled_call_runs_the_ops_of_the_two_program_module(tmp_path, monkeypatch):
    """What the untiled path costs: the same TF graph ops and the same PyTorch dispatches,
    op for op, as the module that kept both programs (a start of 0 adds nothing). The TF
    graph's ops are compared as a multiset: the one program computes what a nested loop's
    chunks share (`_compute_outer_once`) before its other steps, the same ops made in
    another order."""
    tf = pytest.importorskip("tensorflow")
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    arrays = _inputs_of(("w", "x"), CASES["DilatedLightconv"][0])
    graphs = []
    for module in _both(_spec_op("DilatedLightconv"), "tensorflow", tmp_path, monkeypatch):

        def step(w, x, module=module):
            with tf.GradientTape() as tape:
                tape.watch([w, x])
                y = module.forward(w, x)
            return tape.gradient(y, [w, x], output_gradients=tf.ones_like(y))

        xs = [tf.constant(a) for a in arrays]
        graph = tf.function(step).get_concrete_function(*xs).graph
        graphs.append([op.type for op in graph.get_operations()])
    assert collections.Counter(graphs[0]) == collections.Counter(graphs[1])
    dispatched = []
    for module in _both(_spec_op("DilatedLightconv"), "pytorch", tmp_path, monkeypatch):
        xs = [torch.tensor(a, requires_grad=True) for a in arrays]
        with Record() as record:
            y = module.forward(*xs)
            torch.autograd.grad(y, xs, torch.ones_like(y))
        dispatched.append(record.ops)
    assert dispatched[0] == dispatched[1] and len(dispatched[0]) > 10


def _inputs_of(names, shapes):
    rng = np.random.default_rng(6)
    return [rng.standard_normal(shapes[n]) for n in names]


def test_the_whole_op_adds_no_start():
    """`_shift` with the Python int 0 hands its positions back: no op runs."""
    import generated.natten_av2d as tf_module
    import generated_jax.natten_av2d as jax_module
    import generated_torch.natten_av2d as torch_module

    for module in (tf_module, torch_module, jax_module):
        positions = np.arange(3)
        assert module._shift(positions, 0) is positions
        assert list(module._shift(positions, 2)) == [2, 3, 4]


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("RwkvWkv", "other intermediates"),
        # two levels (`tile_nest`): the chunk of both indices against the chunk of one
        ("MaxPool2x2", "the chunk of i and j, against the chunk of i"),
    ],
)
def test_an_op_that_keeps_two_programs_says_why(name, reason):
    op = _spec_op(name)
    module = compile_op(op)
    assert module.tiling.program is None
    assert reason in module.tiling.separate
    if module.tiling.inner is None:  # two levels say why the chunk of both differs
        _, why = tile_once.merge(module)
        assert why == module.tiling.separate
