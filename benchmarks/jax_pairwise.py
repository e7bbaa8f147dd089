"""JAX pairwise forms in chunks against the same module untiled: step time and bytes.

    .venv/bin/python benchmarks/jax_pairwise.py [--ops mmd,chamfer,rbf] [--repeats 15]

For each pairwise form (the Gaussian MMD with a bandwidth per batch, one direction of the
Chamfer distance, a Gaussian kernel sum) at a size and budgets that need chunks, the
module generated now runs one jitted training step (the gradient of the sum of sin of
the outputs with respect to every input) untiled (MAX_TEMP_BYTES = 2**40) and tiled (at
each budget). Prints, per budget: the plan, the step's bytes from XLA's
`memory_analysis()` (temporaries + arguments + outputs) against the bound (4 x inputs and
outputs + the budget), the median step time over `--repeats` calls after a warm-up, and
the ratio tiled / untiled (issue 16 asks at most 1.5x). Times are the process's CPU time
(one compute thread): on a shared machine wall time measures the other processes too.

Runs with one compute thread (XLA_FLAGS below), as `memory.py` does: on a shared machine a
second thread makes every small operation wait for it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)

import jax
import jax.numpy as jnp
import numpy as np

from symgrad.pipeline import module_text
from symgrad.spec import OpSpec

# name -> (formula, input shapes, budgets in bytes)
CASES = {
    "mmd": (
        (
            "y[b] = mean(exp(-sum((x[b,n,c] - x[b,k,c])**2, c) / s[b]), n, k)"
            " + mean(exp(-sum((z[b,m,c] - z[b,l,c])**2, c) / s[b]), m, l)"
            " - 2 * mean(exp(-sum((x[b,n,c] - z[b,m,c])**2, c) / s[b]), n, m)"
        ),
        {"x": (2, 1000, 3), "z": (2, 700, 3), "s": (2,)},
        (2**16, 2**18, 2**22),
    ),
    "chamfer": (
        "y[b,i] = min(sum((x[b,i,c] - z[b,j,c])**2, c), j)",
        {"x": (8, 2048, 3), "z": (8, 1536, 3)},
        (2**18, 2**22),
    ),
    "rbf": (
        "y[b,i] = sum(exp(-sum((x[b,i,c] - z[b,j,c])**2, c)), j)",
        {"x": (1, 5000, 3), "z": (1, 4000, 3)},
        (2**18, 2**22),
    ),
}


def load(name: str, formula: str, folder: Path):
    spec = OpSpec(f"Pair{name.title()}", (formula,), None, (), (), "bench [ops]")
    path = folder / f"jax_pairwise_{name}.py"
    path.write_text(module_text(spec, "bench.toml", "jax"), encoding="utf-8")
    loader = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(loader)
    sys.modules[path.stem] = module
    loader.loader.exec_module(module)
    return module


def step_function(module):
    def loss(*a):
        return jnp.sum(jnp.sin(module.forward(*a)))

    return jax.jit(jax.grad(loss, argnums=tuple(range(len(module.INPUTS)))))


def measure(module, xs, budget: int, repeats: int) -> dict:
    module.MAX_TEMP_BYTES = budget
    step = step_function(module)  # traced anew: under this budget
    analysis = step.lower(*xs).compile().memory_analysis()
    held = sum(
        (
            analysis.temp_size_in_bytes,
            analysis.argument_size_in_bytes,
            analysis.output_size_in_bytes,
        )
    )
    jax.block_until_ready(step(*xs))
    times = []
    for _ in range(repeats):
        start = time.process_time()
        jax.block_until_ready(step(*xs))
        times.append(time.process_time() - start)
    return {"plan": module._tile_plan(*xs), "bytes": held, "time": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(CASES))
    parser.add_argument("--repeats", type=int, default=15)
    options = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        for name in options.ops.split(","):
            formula, shapes, budgets = CASES[name]
            module = load(name, formula, Path(folder))
            xs = [jnp.asarray(rng.uniform(0.5, 1.5, shapes[n]), jnp.float32) for n in module.INPUTS]
            io = sum(x.nbytes for x in xs) + module.forward(*xs).nbytes
            whole = measure(module, xs, 2**40, options.repeats)
            print(
                f"{name} {shapes}: untiled {whole['time'] * 1e3:.1f} ms, "
                f"{whole['bytes'] / 2**20:.2f} MiB"
            )
            for budget in budgets:
                tiled = measure(module, xs, budget, options.repeats)
                bound = 4 * io + budget
                print(
                    f"  {budget // 1024:>5} KiB: plan {tiled['plan']}, "
                    f"{tiled['bytes'] / 1024:.0f} KiB = {tiled['bytes'] / bound:.2f}x bound, "
                    f"{tiled['time'] * 1e3:.1f} ms = {tiled['time'] / whole['time']:.2f}x untiled"
                )


if __name__ == "__main__":
    main()
