"""mmcv's roi_align_rotated, untiled against tiled: a training step's time and peak, per target.

    .venv/bin/python benchmarks/roi_align_rotated.py [--targets tensorflow,pytorch,jax]
        [--rois 16] [--channels 8] [--budget 262144] [--rounds 7] [--threads 1]

The op is tests/test_tiling_adversarial_4.py's REAL["roi_align_rotated"] (rotated sample
positions as internal tensors, bilinear reads at them), generated now from this checkout
into a temporary folder, at the size of test_pytorch_roi_align_rotated_step_stays_within_
the_bound: `--rois` rois of a `--channels`-channel 32 x 32 map (batch 2), 7 x 7 bins of
2 x 2 samples, float32. Each target runs in a fresh process with `--threads` compute
threads (one by default: see benchmarks/memory.py) and reports:

- plan: `_tile_plan` at `--budget` (MAX_TEMP_BYTES), where the step must tile.
- untiled / tiled: the median over `--rounds` interleaved rounds (one untiled step, one
  tiled step) of the process's CPU time per step (less sensitive than wall time to other
  processes on a busy machine), and their ratio: the issue asks for at most 1.5x.
- peaks: untiled and tiled, as fractions of the bound 4 x (inputs + outputs) + budget
  (PyTorch: torch.profiler's memory events; TensorFlow: the BFC allocator's peak; JAX:
  the compiled step's memory_analysis).
- first: the CPU time of the first tiled call (TensorFlow: eager `vjp`, which traces its
  chunk's graph; JAX: compiling the tiled step).

The step is the gradient of the sum of sin of the output with respect to the map.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

# The spec of REAL["roi_align_rotated"] (tests/test_tiling_adversarial_4.py).
SPEC = {
    "formula": [
        (
            "Y[r,i,a,j,q] = (-rois[r,4] * scale / 2 + (i + (a + 0.5) / S) * rois[r,4]"
            " * scale / PH) * cos(rois[r,5]) - (-rois[r,3] * scale / 2 + (j + (q + 0.5)"
            " / S) * rois[r,3] * scale / PW) * sin(rois[r,5]) + rois[r,2] * scale - 0.5"
        ),
        (
            "X[r,i,a,j,q] = (-rois[r,4] * scale / 2 + (i + (a + 0.5) / S) * rois[r,4]"
            " * scale / PH) * sin(rois[r,5]) + (-rois[r,3] * scale / 2 + (j + (q + 0.5)"
            " / S) * rois[r,3] * scale / PW) * cos(rois[r,5]) + rois[r,1] * scale - 0.5"
        ),
        "y[r,c,i,j] = mean(input[1.0 * rois[r,0], c, Y[r,i,a,j,q], X[r,i,a,j,q]], a, q)",
    ],
    "inputs": ["rois", "input"],
    "outputs": ["y"],
    "attrs": {"scale": "float", "PH": "int", "PW": "int", "S": "int"},
    "ranges": {"i": "PH", "j": "PW", "a": "S", "q": "S"},
}
ATTRS = {"scale": 0.5, "PH": 7, "PW": 7, "S": 2}

STEP = r"""
import json, os, statistics, sys, time
import numpy as np
sys.path.insert(0, {folder!r})
target, rois_count, channels, budget, rounds, attrs = {args!r}
threads = int(os.environ["SYMGRAD_BENCH_THREADS"])
module = __import__("roi_align_rotated_" + target)
rng = np.random.default_rng(15)
k = rois_count
rois = np.stack([rng.integers(0, 2, k), *rng.uniform(20, 40, (2, k)),
                 *rng.uniform(8, 20, (2, k)), rng.uniform(-1, 1, k)], 1).astype(np.float32)
image = rng.standard_normal((2, channels, 32, 32)).astype(np.float32)
out_bytes = k * channels * attrs["PH"] * attrs["PW"] * 4
io = rois.nbytes + image.nbytes + out_bytes
result = {{"bound": 4 * io + budget}}

def cpu(step):
    start = time.process_time()
    step()
    return time.process_time() - start

if target == "pytorch":
    import torch
    torch.set_num_threads(threads)
    from peaks import torch_peak
    xs = [torch.from_numpy(rois), torch.from_numpy(image).requires_grad_()]
    def step():
        out = module.forward(*xs, **attrs)
        torch.autograd.grad(torch.sin(out).sum(), [xs[1]])
    def peak():
        return torch_peak(step)
elif target == "tensorflow":
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    from peaks import peak as tf_peak
    xs = [tf.constant(rois), tf.constant(image)]
    def step():
        with tf.GradientTape() as tape:
            tape.watch(xs[1])
            loss = tf.reduce_sum(tf.sin(module.forward(*xs, **attrs)))
        tape.gradient(loss, xs[1]).numpy()
    def peak():
        return tf_peak(step)
else:
    import jax, jax.numpy as jnp
    from peaks import jax_step_bytes
    xs = [jnp.asarray(rois), jnp.asarray(image)]
    steps = {{}}
    def step():
        key = module.MAX_TEMP_BYTES
        if key not in steps:
            loss = lambda *a: jnp.sum(jnp.sin(module.forward(*a, **attrs)))
            steps[key] = jax.jit(jax.grad(loss, argnums=1))
        steps[key](*xs).block_until_ready()
    def peak():
        return jax_step_bytes(module, xs, attrs, wrt=(1,))

result["plan"] = None
module.MAX_TEMP_BYTES = budget
plan = module._tile_plan(*xs, **attrs)
result["plan"] = None if plan is None else [int(v) for v in plan]
if target == "tensorflow":  # eager vjp traces its chunk's graph at the first call
    result["first"] = cpu(lambda: module.vjp(*xs, tf.ones((k, channels, 7, 7)), **attrs))
else:
    result["first"] = cpu(step)
module.MAX_TEMP_BYTES = 2**40
step()
untiled, tiled = [], []
for _ in range(rounds):
    module.MAX_TEMP_BYTES = 2**40
    untiled.append(cpu(step))
    module.MAX_TEMP_BYTES = budget
    tiled.append(cpu(step))
result["untiled"] = statistics.median(untiled)
result["tiled"] = statistics.median(tiled)
module.MAX_TEMP_BYTES = 2**40
result["untiled_peak"] = peak()
module.MAX_TEMP_BYTES = budget
result["tiled_peak"] = peak()
print(json.dumps(result))
"""


def write_modules(folder: Path, targets) -> None:
    """The op's module for each target, generated from this checkout."""
    from symgrad.pipeline import module_text
    from symgrad.spec import parse_op

    op = parse_op("RoiAlignRotated", SPEC, "roi_align_rotated.toml")
    for target in targets:
        text = module_text(op, "roi_align_rotated.toml", target)
        (folder / f"roi_align_rotated_{target}.py").write_text(text, encoding="utf-8")


def measure(folder: Path, target: str, options) -> dict:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(options.threads),
        "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false "
        f"intra_op_parallelism_threads={options.threads}",
        "SYMGRAD_BENCH_THREADS": str(options.threads),
        "TF_CPU_ALLOCATOR_USE_BFC": "true",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONPATH": str(REPO / "tests"),
    }
    args = (target, options.rois, options.channels, options.budget, options.rounds, ATTRS)
    code = STEP.format(folder=str(folder), args=args)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    if done.returncode:
        raise SystemExit(f"{target}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="tensorflow,pytorch,jax")
    parser.add_argument("--rois", type=int, default=16)
    parser.add_argument("--channels", type=int, default=8)
    parser.add_argument("--budget", type=int, default=2**18)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    options = parser.parse_args()
    targets = options.targets.split(",")
    print(
        f"roi_align_rotated: {options.rois} rois, {options.channels} x 32 x 32 map (batch 2), "
        f"7 x 7 bins of 2 x 2 samples, float32, budget {options.budget} bytes"
    )
    print(
        f"{'target':<11} {'plan':<16} {'untiled ms':>10} {'tiled ms':>9} {'ratio':>6}"
        f" {'first s':>8} {'untiled peak':>12} {'tiled peak':>10}"
    )
    with tempfile.TemporaryDirectory() as folder:
        write_modules(Path(folder), targets)
        for target in targets:
            r = measure(Path(folder), target, options)
            plan = "-" if r["plan"] is None else "x".join(str(v) for v in r["plan"])
            print(
                f"{target:<11} {plan:<16} {r['untiled'] * 1e3:>10.1f} {r['tiled'] * 1e3:>9.1f}"
                f" {r['tiled'] / r['untiled']:>6.2f} {r['first']:>8.2f}"
                f" {r['untiled_peak'] / r['bound']:>11.2f}x {r['tiled_peak'] / r['bound']:>9.2f}x"
            )


if __name__ == "__main__":
    main()
