"""One position of the tiled index against the budget, for the tiled real ops at real sizes.

    .venv/bin/python benchmarks/one_position.py

For each case, the TensorFlow module's call-time plan (`_tile_plan`) is run on inputs of
the case's shapes; the plan's estimate of the bytes a chunk of one position holds (its
largest temporaries times the number it assumes held at once, `_HELD`) is printed beside
the default budget (16 MiB), for one position of the first index the plan cuts and, for a
module tiled in two levels or more (`symgrad/tile_nest.py`), of every level. A chunk holds
at least one position of each: where that estimate exceeds the budget, a step exceeds its bound by
about that much (README, "One chunk holds at least one position"), unless the bound, 4 x (inputs +
outputs) + the budget, has room for it: the last column puts one position of every level against
the bound (modules in two levels or more, whose plan is handed the inputs' bytes and the outputs'
sizes).
"""

from __future__ import annotations

import importlib
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from symgrad.pipeline import compile_op, module_text
from symgrad.spec import load_spec

# (spec file, op, input shapes, int inputs, attrs): published layouts, real-world sizes
CASES = [
    (
        "symgrad.toml",
        "NattenAv2d",
        {"attn": (2, 4, 56, 56, 49), "value": (2, 4, 56, 56, 32)},
        {},
        {"K": 7},
    ),
    (
        "symgrad.toml",
        "NattenQk2d",
        {"query": (2, 4, 56, 56, 32), "key": (2, 4, 56, 56, 32)},
        {},
        {"K": 7},
    ),
    (
        "symgrad.toml",
        "NattenAv2d",
        {"attn": (1, 1, 24, 24, 49), "value": (1, 1, 24, 24, 64)},
        {},
        {"K": 7},
    ),
    (
        "symgrad.toml",
        "NattenQk1d",
        {"query": (2, 4, 4096, 64), "key": (2, 4, 4096, 64)},
        {},
        {"kernel_size": 31},
    ),
    (
        "symgrad.toml",
        "Correlation",
        {"f1": (8, 48, 64, 256), "f2": (8, 48, 64, 256)},
        {},
        {"r": 10},
    ),
    (
        "symgrad.toml",
        "MmcvCorrelation",
        {"input1": (4, 256, 48, 64), "input2": (4, 256, 48, 64)},
        {},
        {"r": 4},
    ),
    (
        "symgrad.toml",
        "LongformerQk",
        {"X": (1, 4096, 12, 64), "Y": (1, 4096, 12, 64), "D": (12,)},
        {"D": 1},
        {"w": 256},
    ),
    (
        "symgrad.toml",
        "LongformerAv",
        {"X": (1, 4096, 12, 513), "Y": (1, 4096, 12, 64), "D": (12,)},
        {"D": 1},
        {"w": 256},
    ),
    ("symgrad.toml", "CcAttentionScores", {"t": (2, 64, 97, 97), "f": (2, 64, 97, 97)}, {}, {}),
    ("symgrad.toml", "CcAttentionMap", {"a": (2, 193, 97, 97), "g": (2, 512, 97, 97)}, {}, {}),
    (
        "symgrad.toml",
        "Involution",
        {"x": (2, 256, 56, 56), "weight": (2, 16, 7, 7, 56, 56)},
        {},
        {},
    ),
    ("symgrad.toml", "DynamicConv", {"input": (8, 512, 256), "weight": (8, 8, 31, 256)}, {}, {}),
    (
        "symgrad.toml",
        "Carafe",
        {"features": (2, 256, 64, 64), "masks": (2, 25, 128, 128)},
        {},
        {"K": 5, "S": 2},
    ),
    (
        "benchmarks/memory.toml",
        "MemCorrelation",
        {"f1": (4, 48, 64, 64), "f2": (4, 48, 64, 64)},
        {},
        {"r": 4},
    ),
    (
        "benchmarks/memory.toml",
        "MemLocalAttention",
        {"q": (2, 1024, 4, 64), "k": (2, 1024, 4, 64)},
        {},
        {"w": 64},
    ),
    ("benchmarks/memory.toml", "MemLightConv", {"x": (8, 256, 512), "w": (256, 31)}, {}, {"p": 15}),
    ("benchmarks/memory.toml", "MemChamfer", {"x": (8, 2048, 3), "z": (8, 1536, 3)}, {}, {}),
    ("benchmarks/memory.toml", "MemRbfEnergy", {"x": (2, 3000, 3), "z": (2, 2000, 3)}, {}, {}),
]


def one_position(folder: Path, spec_file: str, op_name: str, shapes, ints, attrs):
    spec = load_spec(REPO / spec_file)
    (op,) = [o for o in spec.ops if o.name == op_name]
    name = "".join("_" + ch.lower() if ch.isupper() else ch for ch in op_name).lstrip("_")
    (folder / f"{name}.py").write_text(module_text(op, spec_file))
    module = importlib.import_module(name)
    rng = np.random.default_rng(0)
    arrays = [
        np.full(shapes[n], ints[n], np.int32)
        if n in ints
        else rng.standard_normal(shapes[n]).astype(np.float32)
        for n in module.INPUTS
    ]
    seen = {}

    def plan(n, volumes, itemsize):
        seen.update(n=n, volumes=volumes, itemsize=itemsize)

    def plan2(n, n2, volumes, itemsize, *bound):
        seen.update(n=n, n2=n2, volumes=volumes, itemsize=itemsize, bound=bound)
        return n, 1, n2, 1  # a plan, so that a module with deeper levels asks for theirs

    def plan_deeper(counts, volumes, itemsize):
        seen.update(deeper=counts[2:])
        return tuple((n, 1) for n in counts[2:])

    import tensorflow as tf

    if not hasattr(module, "_tile_plan"):  # every window read in place (a band kernel)
        return None
    module._plan = plan
    module._plan2 = plan2
    module._plan_deeper = plan_deeper
    module._tile_plan(*[tf.constant(a) for a in arrays], **attrs)
    held = module._HELD * sum((v[0] or seen["itemsize"]) * _product(v[1:]) for v in seen["volumes"])
    tiling = compile_op(op).tiling
    n, n2 = int(seen["n"]), int(seen.get("n2", 1))
    inner = tiling.inner.index if tiling.inner else "-"
    inner = ", ".join([inner, *(d.index for d in tiling.deeper)])
    every = held / (n * n2)
    for count in seen.get("deeper", ()):
        every /= int(count)
    bound = None
    if seen.get("bound"):
        inputs, outputs = seen["bound"]
        io = int(inputs) + seen["itemsize"] * sum(_product(v) for v in outputs)
        bound = 4 * io + module.MAX_TEMP_BYTES
    return tiling.index, inner, held / n, every, bound


def _product(sizes) -> int:
    result = 1
    for s in sizes:
        result *= int(s)
    return result


def main() -> None:
    budget = 16 * 2**20
    with tempfile.TemporaryDirectory() as tmp:
        sys.path.insert(0, tmp)
        print(
            "| op | sizes | tiled along | one position of the first (MB, x budget) "
            "| of every level | of every level, x the bound |"
        )
        print("|---|---|---|---|---|---|")
        for spec_file, op, shapes, ints, attrs in CASES:
            found = one_position(Path(tmp), spec_file, op, shapes, ints, attrs)
            sizes = ", ".join("x".join(map(str, s)) for s in shapes.values())
            extra = ", ".join(f"{k}={v}" for k, v in attrs.items())
            if found is None:
                print(
                    f"| {op} | {sizes}{', ' + extra if extra else ''} | no plan: read in place | - | - | - |"
                )
                continue
            index, inner, one, both, bound = found
            second = f"{both / 1e6:.2f} ({both / budget:.2f}x)" if inner != "-" else "-"
            against = f"{both / bound:.2f}x of {bound / 1e6:.0f} MB" if bound else "-"
            print(
                f"| {op} | {sizes}{', ' + extra if extra else ''} | {index}, {inner} | "
                f"{one / 1e6:.2f} ({one / budget:.2f}x) | {second} | {against} |"
            )


if __name__ == "__main__":
    main()
