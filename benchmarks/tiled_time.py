"""Time of a training step in chunks against the same module in one piece, per target.

    .venv/bin/python benchmarks/tiled_time.py [--targets tensorflow,pytorch,jax] [--ops A,B]

The rule (issue 16): where a module runs in chunks, a training step takes at most 1.5x
the time of the step without them at the same size. Each op below is generated now, and
one training step (forward, `sum(sin(y))`, the gradient of every float input) runs in a
fresh process per target, one compute thread, with `MAX_TEMP_BYTES` at 2**40 (one piece)
and at its default (16 MiB, the module's own plan): the median of 7 steps after a
warm-up each (TensorFlow and PyTorch eager, JAX under `jax.jit`), and the ratio.

Ops (published layouts, real-world sizes, each index its own size):

- GAT's segment softmax over 40,000 edges into 3,000 nodes, 4 heads, 16 features
  (`tests/test_memory_segment_softmax.py`'s formula): cut along the features.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

SPECS = {
    "GatSegmentSoftmax": (
        """
formula = "y[v,h,f] = sum(where(dst[n] == v, exp(s[n,h]) * x[src[n],h,f], 0), n) / sum(where(dst[n] == v, exp(s[n,h]), 0), n)"
inputs = ["s", "x", "src", "dst"]
ranges = { v = "x.shape[0]" }
""",
        # input -> (shape, high): float inputs have no high; int inputs draw in [0, high)
        {"s": ((40000, 4), None), "x": ((3000, 4, 16), None)}
        | {"src": ((40000,), 3000), "dst": ((40000,), 3000)},
    ),
}

STEP = r"""
import importlib.util, json, os, sys, time
import numpy as np
target, path, shapes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if target == "tensorflow":
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
elif target == "pytorch":
    import torch
    torch.set_num_threads(1)
else:
    import jax, jax.numpy as jnp
spec = importlib.util.spec_from_file_location("module", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
rng = np.random.default_rng(0)
arrays = [
    rng.standard_normal(shape).astype(np.float32) if high is None
    else rng.integers(0, high, shape).astype(np.int32)
    for shape, high in (shapes[n] for n in module.INPUTS)
]
floats = [k for k, (_, high) in enumerate(shapes[n] for n in module.INPUTS) if high is None]
if target == "tensorflow":
    def make():
        args = [tf.Variable(a) if k in floats else tf.constant(a) for k, a in enumerate(arrays)]
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.sin(module.forward(*args)))
            grads = tape.gradient(loss, [args[k] for k in floats])
            return [tf.convert_to_tensor(g).numpy() for g in grads]
        return step
elif target == "pytorch":
    def make():
        args = [torch.tensor(a, requires_grad=k in floats) for k, a in enumerate(arrays)]
        def step():
            torch.sin(module.forward(*args)).sum().backward()
        return step
else:
    def make():
        args = [jnp.asarray(a) for a in arrays]
        def loss(*xs):
            return jnp.sum(jnp.sin(module.forward(*xs)))
        grad = jax.jit(jax.grad(loss, argnums=tuple(floats)))
        return lambda: jax.block_until_ready(grad(*args))
times = {}
default = module.MAX_TEMP_BYTES
for name, budget in (("whole", 2**40), ("chunks", default)):
    module.MAX_TEMP_BYTES = budget
    step = make()
    step()
    runs = []
    for _ in range(7):
        start = time.perf_counter()
        step()
        runs.append(time.perf_counter() - start)
    times[name] = sorted(runs)[3]
print(json.dumps(times))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="tensorflow,pytorch,jax")
    parser.add_argument("--ops", default=",".join(SPECS))
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from symgrad.pipeline import module_text
    from symgrad.spec import parse_spec

    print(f"{'op':20s} {'target':11s} {'whole (ms)':>11s} {'chunks (ms)':>12s} {'ratio':>6s}")
    for name in args.ops.split(","):
        text, shapes = SPECS[name]
        (op,) = parse_spec(f"[ops.{name}]{text}", "tiled_time.py").ops
        for target in args.targets.split(","):
            with tempfile.TemporaryDirectory() as folder:
                path = Path(folder) / "module.py"
                path.write_text(module_text(op, "tiled_time.py", target))
                found = subprocess.run(
                    [sys.executable, "-c", STEP, target, str(path), json.dumps(shapes)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
            times = json.loads(found.stdout.strip().splitlines()[-1])
            whole, chunks = times["whole"] * 1e3, times["chunks"] * 1e3
            print(f"{name:20s} {target:11s} {whole:11.1f} {chunks:12.1f} {chunks / whole:6.2f}")


if __name__ == "__main__":
    main()
