"""Causal attention's training step with and without the check on finite values.

    .venv/bin/python benchmarks/causal_check.py [--targets tensorflow,pytorch,jax]
        [--sizes 2x384x384x32,4x1024x1024x64] [--rounds 15] [--budget 4194304]

A causal mask over an input's values (`einsum(P, v)`, P = softmax(where(j <= i, s, -inf)))
branches on whether the values' sum is finite (`symgrad/masked_values.py`): the exact sum
runs only for inf or nan values. This prints what the branch costs on the finite path: the
training step (forward and gradients of q, k and v, float32, CPU, one thread) of the
module as generated against the same module generated without the check, timed in
interleaved rounds (CPU time of this process, medians), untiled (MAX_TEMP_BYTES 2**40) and
tiled (`--budget`, small so the op runs in chunks). Sizes are b x i x j x d (d = e: the
values' width). Each target runs in its own process (one thread each).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

FORMULA = (
    "y[b,i,e] = sum(where(j <= i, exp(sum(q[b,i,d] * k[b,j,d], d)) * v[b,j,e], 0), j)"
    " / sum(where(j <= i, exp(sum(q[b,i,d] * k[b,j,d], d)), 0), j)"
)
UNTILED = 2**40


def _write_modules(folder: Path, target: str) -> dict[str, Path]:
    """The module as generated ("check") and without the masked-values pass ("plain")."""
    from symgrad.lower import lowerer
    from symgrad.pipeline import module_text
    from symgrad.spec import load_spec

    spec_file = folder / "causal.toml"
    spec_file.write_text(f'[ops.BenchCausalAttention]\nformula = "{FORMULA}"\n')
    (op,) = load_spec(spec_file).ops
    paths = {"check": folder / f"check_{target}.py"}
    paths["check"].write_text(module_text(op, "causal.toml", target))
    with mock.patch.object(lowerer.masked_values, "exact", lambda f, b, _: (f, b)):
        paths["plain"] = folder / f"plain_{target}.py"
        paths["plain"].write_text(module_text(op, "causal.toml", target))
    return paths


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _step(target: str, module):
    """A training step of `module`: (arrays -> gradients of q, k and v, run to the end)."""
    if target == "tensorflow":
        import tensorflow as tf

        @tf.function
        def step(q, k, v, g):
            with tf.GradientTape() as tape:
                tape.watch([q, k, v])
                y = module.forward(q, k, v)
            return tape.gradient(y, [q, k, v], output_gradients=g)

        return tf.constant, lambda *a: [t.numpy() for t in step(*a)]
    if target == "pytorch":
        import torch

        def step(q, k, v, g):
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            return torch.autograd.grad(module.forward(*leaves), leaves, g)

        return torch.tensor, step
    import jax

    def loss(q, k, v, g):
        return (module.forward(q, k, v) * g).sum()

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return jax.numpy.asarray, lambda *a: jax.block_until_ready(step(*a))


def _one_thread(target: str) -> None:
    if target == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    elif target == "pytorch":
        import torch

        torch.set_num_threads(1)


def measure(target: str, sizes: list[tuple[int, ...]], rounds: int, budget: int) -> list:
    """Per size and budget: (median ms with the check, without), in interleaved rounds."""
    import numpy as np

    _one_thread(target)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = _write_modules(Path(tmp), target)
        modules = {w: _load(p, f"causal_{w}_{target}") for w, p in paths.items()}
        for b, n, m, d in sizes:
            rng = np.random.default_rng(0)
            arrays = [
                rng.standard_normal(shape).astype(np.float32) * scale
                for shape, scale in (
                    ((b, n, d), 0.3),
                    ((b, m, d), 0.3),
                    ((b, m, d), 1.0),
                    ((b, n, d), 1.0),
                )
            ]
            for limit in (UNTILED, budget):
                steps = {}
                for which, module in modules.items():
                    module.MAX_TEMP_BYTES = limit
                    convert, step = _step(target, module)
                    steps[which] = step, [convert(a) for a in arrays]
                times = {which: [] for which in steps}
                for which, (step, args) in steps.items():
                    for _ in range(2):  # compile, warm up
                        step(*args)
                for _ in range(rounds):
                    for which, (step, args) in steps.items():
                        modules[which].MAX_TEMP_BYTES = limit
                        start = time.process_time()
                        step(*args)
                        times[which].append(time.process_time() - start)
                check, plain = (1e3 * float(np.median(times[w])) for w in ("check", "plain"))
                rows.append(
                    (f"{b}x{n}x{m}x{d}", "untiled" if limit == UNTILED else "tiled", check, plain)
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="tensorflow,pytorch,jax")
    parser.add_argument("--sizes", default="2x384x384x32,4x1024x1024x64")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--budget", type=int, default=2**22)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a target, in this process
    args = parser.parse_args()
    sizes = [tuple(int(s) for s in size.split("x")) for size in args.sizes.split(",")]
    if args.one:
        print(json.dumps(measure(args.one, sizes, args.rounds, args.budget)))
        return
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
        TF_CPP_MIN_LOG_LEVEL="3",
    )
    print(f"{'target':<11} {'size':<15} {'mode':<8} {'check ms':>9} {'plain ms':>9} {'cost':>7}")
    for target in args.targets.split(","):
        command = [sys.executable, __file__, "--one", target, "--sizes", args.sizes]
        command += ["--rounds", str(args.rounds), "--budget", str(args.budget)]
        result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        for size, mode, check, plain in json.loads(result.stdout.strip().splitlines()[-1]):
            cost = f"{100 * (check / plain - 1):+.1f}%"
            print(f"{target:<11} {size:<15} {mode:<8} {check:>9.2f} {plain:>9.2f} {cost:>7}")


if __name__ == "__main__":
    main()
