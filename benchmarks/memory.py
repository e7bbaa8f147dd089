"""Peak memory and time of a training step, tiled modules against today's, per target.

    .venv/bin/python benchmarks/memory.py [--targets tensorflow,pytorch,jax] [--ops A,B]

For each op of `memory.toml` (real-world windowed and pairwise ops in their own layouts, at
real-world sizes) and each target, one training step (forward, a scalar loss, the
gradient of every float input) runs in a fresh subprocess with the module generated now
(default MAX_TEMP_BYTES, 16 MiB) and with `baseline/<target>/`, the same op generated
before tiling. Each subprocess reports:

- peak: TensorFlow: the BFC allocator's peak (`get_memory_info("CPU:0")["peak"]` after
  `reset_memory_stats`, minus the bytes in use before). JAX: the compiled step's
  `memory_analysis()` (temporaries + outputs + arguments, the bytes XLA allocates for one
  call). PyTorch: the CPU allocator keeps no statistics, so the peak of the running sum of
  the allocations and frees `torch.profiler` records (`profile_memory=True`, its
  "[memory]" events, in order) over one step after a warm-up step.
  A TensorFlow peak of 0, or below the outputs and gradients the step itself holds at
  once, is refused (the row reads "failed"): it was not measured on the step.
- io: the bytes of the op's inputs and outputs; the bound is 4 x io + MAX_TEMP_BYTES.
- time: the median of 5 steps after one warm-up (TensorFlow eager; PyTorch eager; JAX
  under `jax.jit`), and the ratio new / baseline.

Every framework runs with `--threads` compute threads (default 1; `THREADS` below). On a
busy machine, a pool of 2 threads makes every small operation wait for the second
thread to be scheduled (a PyTorch Chamfer chunk of [8, 85, 1536] took 190 ms with 2
threads and 11 ms with 1, under a load of 4.4 on 2 cores), which a loop of chunks pays
once per operation and an untiled step only a few times.

Updates `memory.json` beside this file (per op and target) and prints a table.
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

# upfirdn2d's attrs for StyleGAN2's Upsample(factor 2) with a 4x4 filter: pads (2, 1)
UPSAMPLE_2X = {"up_x": 2, "up_y": 2, "down_x": 1, "down_y": 1}
UPSAMPLE_2X.update({"pad_x0": 2, "pad_x1": 1, "pad_y0": 2, "pad_y1": 1})

# op -> (module name, input shapes, attrs): real-world sizes, each index its own size.
CASES = {
    "MemCorrelation": ("mem_correlation", {"f1": (4, 48, 64, 64), "f2": (4, 48, 64, 64)}, {"r": 4}),
    "MemChamfer": ("mem_chamfer", {"x": (8, 2048, 3), "z": (8, 1536, 3)}, {}),
    "MemRbfSum": ("mem_rbf_sum", {"x": (1, 5000, 3), "z": (1, 4000, 3)}, {}),
    "MemLightConv": ("mem_light_conv", {"x": (8, 256, 512), "w": (256, 31)}, {"p": 15}),
    "MemDilatedConv1d": (
        "mem_dilated_conv1d",
        {"x": (8, 2048, 64), "w": (9, 64, 48)},
        {"p": 8},
    ),
    "MemLocalAttention": (
        "mem_local_attention",
        {"q": (2, 1024, 4, 64), "k": (2, 1024, 4, 64)},
        {"w": 64},
    ),
    "MemRbfEnergy": ("mem_rbf_energy", {"x": (2, 3000, 3), "z": (2, 2000, 3)}, {}),
    "MemKernelLoss": (
        "mem_kernel_loss",
        {"w": (2, 3000), "x": (2, 3000, 3), "z": (2, 2000, 3)},
        {},
    ),
    "MemChamferBoth": ("mem_chamfer_both", {"x": (8, 2048, 3), "z": (8, 1536, 3)}, {}),
    "MemHausdorff": ("mem_hausdorff", {"x": (8, 2048, 3), "z": (8, 1536, 3)}, {}),
    # StyleGAN2's 2x upsampling with a 4x4 filter (pads as its Upsample layer): 32 -> 64
    "MemUpfirdn2d": ("mem_upfirdn2d", {"x": (4, 64, 32, 32), "f": (4, 4)}, UPSAMPLE_2X),
    # GAT's first layer on Cora: 2708 nodes, 10556 edges and a self-loop per node, 8 heads
    # of 8 features; src and dst are node ids (`INDEX_INPUTS`)
    "MemGatAggregate": (
        "mem_gat_aggregate",
        {"s": (13264, 8), "x": (2708, 8, 8), "src": (13264,), "dst": (13264,)},
        {},
    ),
}

# integer inputs: name -> the number of ids; the first `high` entries are 0 .. high - 1
# (every node has an edge: GAT adds a self-loop per node), the rest uniform in [0, high)
INDEX_INPUTS = {"MemGatAggregate": {"src": 2708, "dst": 2708}}


# Environment of every measured process: its frameworks' thread counts (see the docstring).
def thread_env(threads: int) -> dict:
    return {
        "OMP_NUM_THREADS": str(threads),
        "XLA_FLAGS": f"--xla_cpu_multi_thread_eigen={'true' if threads > 1 else 'false'} "
        f"intra_op_parallelism_threads={threads}",
        "SYMGRAD_BENCH_THREADS": str(threads),
    }


THREADS = {"threads": 1}  # set by --threads

STEP = r"""
import json, os, resource, statistics, sys, time
import numpy as np
sys.path.insert(0, {folder!r})
target, name, shapes, attrs = {target!r}, {name!r}, {shapes!r}, {attrs!r}
index = {index!r}
module = __import__(name)
rng = np.random.default_rng(0)

def ids(shape, high):
    a = rng.integers(0, high, shape)
    a[: min(high, shape[0])] = np.arange(min(high, shape[0]))
    return a.astype(np.int32)

arrays = [
    ids(shapes[n], index[n]) if n in index else rng.standard_normal(shapes[n]).astype(np.float32)
    for n in module.INPUTS
]
floats = [k for k, n in enumerate(module.INPUTS) if n not in index]  # the inputs with a gradient
io = sum(a.nbytes for a in arrays)
result = {{}}

def outputs(y):  # an op with several outputs returns a tuple
    return y if isinstance(y, tuple) else (y,)

def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

if target == "tensorflow":
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(int(os.environ["SYMGRAD_BENCH_THREADS"]))
    tf.config.threading.set_inter_op_parallelism_threads(int(os.environ["SYMGRAD_BENCH_THREADS"]))
    args = [tf.constant(a) for a in arrays]
    def step():
        with tf.GradientTape() as tape:
            tape.watch([args[k] for k in floats])
            y = outputs(module.forward(*args, **attrs))
            loss = tf.add_n([tf.reduce_sum(o * o) for o in y])
        return [g.numpy() for g in tape.gradient(loss, [args[k] for k in floats])], y
    _, y = step()
    io += sum(o.numpy().nbytes for o in y)
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    grads, y = step()
    result["peak"] = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
    # the step makes its outputs and gradients and holds them at once: a peak below them
    # (or 0) was not measured on this step (its work done before the reset, or elsewhere)
    held = sum(g.nbytes for g in grads) + sum(o.numpy().nbytes for o in y)
    if result["peak"] <= 0 or result["peak"] < held:
        raise SystemExit(f"TF peak {{result['peak']}} B below the step's own {{held}} B: not measured")
elif target == "pytorch":
    import torch
    torch.set_num_threads(int(os.environ["SYMGRAD_BENCH_THREADS"]))
    args = [torch.from_numpy(a) for a in arrays]
    for k in floats:
        args[k].requires_grad_()
    def step():
        y = outputs(module.forward(*args, **attrs))
        loss = sum((o * o).sum() for o in y)
        grads = torch.autograd.grad(loss, [args[k] for k in floats])
        return grads, y
    _, y = step()
    io += sum(o.numel() * 4 for o in y)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as profile:
        step()
    events = [e for e in profile.profiler.kineto_results.events() if e.name() == "[memory]"]
    total = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        total += event.nbytes()
        peak = max(peak, total)
    result["peak"] = peak
else:
    import jax, jax.numpy as jnp
    args = [jnp.asarray(a) for a in arrays]
    def loss(*a):
        return sum(jnp.sum(o * o) for o in outputs(module.forward(*a, **attrs)))
    grad = jax.jit(jax.grad(loss, argnums=tuple(floats)))
    y = outputs(jax.jit(lambda *a: module.forward(*a, **attrs))(*args))
    io += sum(o.size * 4 for o in y)
    stats = grad.lower(*args).compile().memory_analysis()
    result["peak"] = stats.temp_size_in_bytes + stats.output_size_in_bytes + stats.argument_size_in_bytes
    def step():
        return [g.block_until_ready() for g in grad(*args)], None
times = []
for _ in range(6):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
result["time"] = statistics.median(times[1:])
result["io"] = io
print(json.dumps(result))
"""


def measure(folder: Path, target: str, op: str, case: tuple | None = None) -> dict:
    """One training step of `op` (or of `case`: module name, shapes, attrs) from the
    modules in `folder`, in a fresh process: its peak bytes, median time and io bytes."""
    name, shapes, attrs = case or CASES[op]
    index = INDEX_INPUTS.get(op, {})
    code = STEP.format(
        folder=str(folder), target=target, name=name, shapes=shapes, attrs=attrs, index=index
    )
    env = {**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.update(thread_env(THREADS["threads"]))
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": last[:200]}
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="tensorflow,pytorch,jax")
    parser.add_argument("--ops", default=",".join(CASES))
    parser.add_argument("--threads", type=int, default=1)
    options = parser.parse_args()
    THREADS["threads"] = options.threads
    targets = options.targets.split(",")
    ops = options.ops.split(",")
    path = HERE / "memory.json"  # updated per op and target: a partial run keeps the rest
    results: dict = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for target in targets:
            new = Path(tmp) / f"new_{target}"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "symgrad",
                    "generate",
                    str(HERE / "memory.toml"),
                    "--target",
                    target,
                    "--out",
                    str(new),
                ],
                check=True,
                capture_output=True,
                cwd=REPO,
            )
            for op in ops:
                old = measure(HERE / "baseline" / target, target, op)
                now = measure(new, target, op)
                results.setdefault(op, {})[target] = {"baseline": old, "tiled": now}
                print(_row(op, target, old, now), flush=True)
    path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


def _row(op: str, target: str, old: dict, now: dict) -> str:
    mib = 2**20

    def peak(r):
        return "failed" if "error" in r else f"{r['peak'] / mib:8.1f}M"

    io = now.get("io") or old.get("io")
    ratio = f"{now['time'] / old['time']:5.2f}" if "time" in now and "time" in old else "  -  "
    bound = f"{(4 * io + 16 * mib) / mib:7.1f}M" if io else "    -"
    notes = "; ".join(r["error"] for r in (old, now) if "error" in r)
    return (
        f"{op:18} {target:10} io {io / mib if io else 0:7.1f}M  bound {bound}  "
        f"baseline {peak(old)}  tiled {peak(now)}  time {ratio}  {notes}"
    )


if __name__ == "__main__":
    main()
