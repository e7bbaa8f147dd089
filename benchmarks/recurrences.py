"""Time and peak memory of a training step through a recurrence: the generated module
(a scan and its derived adjoint scan) against the same op written in plain framework
ops and differentiated by the framework's own autodiff.

    .venv/bin/python benchmarks/recurrences.py [--targets tensorflow,pytorch,jax]
        [--ops selective_scan,linear,lfilter] [--impls symgrad,plain,sequential] [--length 2048]

Ops (this repo's symgrad.toml): Mamba's selective scan (b=2, d=64, n=16), the linear
recurrence (b=8, d=256) and lfilter (b=8, order 3, 4 feed-forward taps), float32, at
length L. `sequential` is the generated module with the associative scan turned off: the
sequential scan that linear recurrences ran as before (generated into a temporary
folder). Each (target, op, implementation) runs in a fresh subprocess: one training step
(forward, loss sum(y * y), the gradient of every input), one warm-up, then the median of
3 steps. TensorFlow runs both under `tf.function` (an eager while_loop would dispatch op
by op), JAX under `jax.jit`, PyTorch eagerly.

Peak memory as in `memory.py`: TensorFlow the BFC allocator's peak, JAX the compiled
step's `memory_analysis()` (temporaries + outputs + arguments), PyTorch the running sum of
torch.profiler's memory events. `io` is the bytes of inputs and outputs.
Prints a table (figures go to the README by hand); this is not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLDERS = {"tensorflow": "generated", "pytorch": "generated_torch", "jax": "generated_jax"}


def shapes(op: str, length: int) -> dict:
    if op == "selective_scan":
        b, d, n = 2, 64, 16
        return {
            "delta": (b, d, length),
            "A": (d, n),
            "B": (b, n, length),
            "x": (b, d, length),
            "C": (b, n, length),
            "D": (d,),
        }
    if op == "linear_recurrence":
        return {"a": (8, length, 256), "x": (8, length, 256)}
    return {"x": (8, length), "a": (3,), "bb": (4,)}


STEP = r"""
import json, statistics, sys, time
import numpy as np
sys.path.insert(0, {folder!r})
target, op, impl, shapes = {target!r}, {op!r}, {impl!r}, {shapes!r}
rng = np.random.default_rng(0)
arrays = {{n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}}
if op == "selective_scan":
    arrays["delta"] = np.abs(arrays["delta"]) * 0.1
    arrays["A"] = -np.abs(arrays["A"])
elif op == "linear_recurrence":
    arrays["a"] = 0.9 * np.tanh(arrays["a"])
else:
    arrays["a"] = np.array([-0.5, 0.2, 0.1], np.float32)
    arrays["bb"] = np.array([0.4, -0.3, 0.2, 0.1], np.float32)
names = list(shapes)
result = {{}}


def plain_torch(*xs):
    import torch
    if op == "linear_recurrence":
        a, x = xs
        h = torch.zeros_like(x[:, 0])
        hs = []
        for t in range(x.shape[1]):
            h = a[:, t] * h + x[:, t]
            hs.append(h)
        return torch.stack(hs, 1)
    if op == "selective_scan":
        delta, A, B, x, C, D = xs
        h = delta.new_zeros((x.shape[0], x.shape[1], A.shape[1]))
        ys = []
        for t in range(x.shape[2]):
            h = torch.exp(delta[:, :, t, None] * A) * h + delta[:, :, t, None] * B[:, None, :, t] * x[:, :, t, None]
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]) + D * x[:, :, t])
        return torch.stack(ys, 2)
    x, a, bb = xs
    ys = []
    for t in range(x.shape[1]):
        y = bb[0] * x[:, t]
        for k in range(1, bb.shape[0]):
            if t - k >= 0:
                y = y + bb[k] * x[:, t - k]
        for k in range(a.shape[0]):
            if t - 1 - k >= 0:
                y = y - a[k] * ys[t - 1 - k]
        ys.append(y)
    return torch.stack(ys, 1)


def plain_jax(*xs):
    import jax, jax.numpy as jnp
    if op == "linear_recurrence":
        a, x = xs
        def step(h, s):
            h = s[0] * h + s[1]
            return h, h
        _, hs = jax.lax.scan(step, jnp.zeros_like(x[:, 0]), (jnp.moveaxis(a, 1, 0), jnp.moveaxis(x, 1, 0)))
        return jnp.moveaxis(hs, 0, 1)
    if op == "selective_scan":
        delta, A, B, x, C, D = xs
        def body(h, s):
            dt, bt, xt, ct = s
            h = jnp.exp(dt[:, :, None] * A) * h + dt[:, :, None] * bt[:, None, :] * xt[:, :, None]
            return h, jnp.einsum("bdn,bn->bd", h, ct) + D * xt
        h0 = jnp.zeros((x.shape[0], x.shape[1], A.shape[1]), x.dtype)
        seq = (jnp.moveaxis(delta, 2, 0), jnp.moveaxis(B, 2, 0), jnp.moveaxis(x, 2, 0), jnp.moveaxis(C, 2, 0))
        _, ys = jax.lax.scan(body, h0, seq)
        return jnp.moveaxis(ys, 0, 2)
    x, a, bb = xs
    xw = jnp.stack([jnp.pad(x, [(0, 0), (k, 0)])[:, : x.shape[1]] for k in range(bb.shape[0])])
    u = jnp.einsum("k,kbt->bt", bb, xw)
    def body(w, xt):
        y = xt - jnp.einsum("k,kb->b", a, w)
        return jnp.concatenate([y[None], w[:-1]], 0), y
    _, ys = jax.lax.scan(body, jnp.zeros((a.shape[0], x.shape[0]), x.dtype), u.T)
    return ys.T


def plain_tf(*xs):
    import tensorflow as tf
    if op == "linear_recurrence":
        a, x = xs
        seq = (tf.transpose(a, [1, 0, 2]), tf.transpose(x, [1, 0, 2]))
        hs = tf.scan(lambda h, s: s[0] * h + s[1], seq, initializer=tf.zeros_like(x[:, 0]))
        return tf.transpose(hs, [1, 0, 2])
    if op == "selective_scan":
        delta, A, B, x, C, D = xs
        def body(carry, s):
            h, _ = carry
            dt, bt, xt, ct = s
            h = tf.exp(dt[:, :, None] * A) * h + dt[:, :, None] * bt[:, None, :] * xt[:, :, None]
            return h, tf.einsum("bdn,bn->bd", h, ct) + D * xt
        h0 = tf.zeros((x.shape[0], x.shape[1], A.shape[1]), x.dtype)
        seq = tuple(tf.transpose(v, [2, 0, 1]) for v in (delta, B, x, C))
        _, ys = tf.scan(body, seq, initializer=(h0, tf.zeros(x.shape[:2], x.dtype)))
        return tf.transpose(ys, [1, 2, 0])
    x, a, bb = xs
    xw = tf.stack([tf.pad(x, [[0, 0], [k, 0]])[:, : x.shape[1]] for k in range(bb.shape[0])])
    u = tf.einsum("k,kbt->bt", bb, xw)
    def body(carry, xt):
        w, _ = carry
        y = xt - tf.einsum("k,kb->b", a, w)
        return tf.concat([y[None], w[:-1]], 0), y
    _, ys = tf.scan(body, tf.transpose(u), initializer=(tf.zeros((a.shape[0], x.shape[0]), x.dtype), tf.zeros(x.shape[:1], x.dtype)))
    return tf.transpose(ys)


if impl in ("symgrad", "sequential"):
    module = __import__(op)
    forward = module.forward
else:
    forward = {{"tensorflow": plain_tf, "pytorch": plain_torch, "jax": plain_jax}}[target]

io = sum(a.nbytes for a in arrays.values())
if target == "tensorflow":
    import tensorflow as tf
    args = [tf.constant(arrays[n]) for n in names]
    @tf.function
    def grad_step(*xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            y = forward(*xs)
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, xs), y
    def step():
        grads, y = grad_step(*args)
        return [g.numpy() for g in grads], y
    _, y = step()
    io += y.numpy().nbytes
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    grads, y = step()
    result["peak"] = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
    # the step makes its outputs and gradients and holds them at once: a peak below them
    # (or 0) was not measured on this step (its work done before the reset, or elsewhere)
    held = sum(g.nbytes for g in grads) + y.numpy().nbytes
    if result["peak"] <= 0 or result["peak"] < held:
        raise SystemExit(f"TF peak {{result['peak']}} B below the step's own {{held}} B: not measured")
elif target == "pytorch":
    import torch
    torch.set_num_threads(2)
    args = [torch.from_numpy(arrays[n]).requires_grad_() for n in names]
    def step():
        y = forward(*args)
        grads = torch.autograd.grad((y * y).sum(), args)
        return grads, y
    _, y = step()
    io += y.numel() * 4
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        step()
    events = [e for e in profile.profiler.kineto_results.events() if e.name() == "[memory]"]
    total = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        total += event.nbytes()
        peak = max(peak, total)
    result["peak"] = peak
else:
    import jax, jax.numpy as jnp
    args = [jnp.asarray(arrays[n]) for n in names]
    def loss(*a):
        y = forward(*a)
        return jnp.sum(y * y)
    grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))
    io += jax.eval_shape(forward, *args).size * 4
    stats = grad.lower(*args).compile().memory_analysis()
    result["peak"] = stats.temp_size_in_bytes + stats.output_size_in_bytes + stats.argument_size_in_bytes
    def step():
        return [g.block_until_ready() for g in grad(*args)], None
times = []
for _ in range(4):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
result["time"] = statistics.median(times[1:])
result["io"] = io
print(json.dumps(result))
"""


def sequential_folder(target: str, op: str) -> str:
    """A folder holding the op's module generated with the sequential scan."""
    import tempfile

    sys.path.insert(0, str(REPO))
    from symgrad.scan_render import module_text
    from symgrad.spec import load_spec

    names = {"selective_scan": "SelectiveScan", "linear_recurrence": "LinearRecurrence"}
    spec = load_spec(REPO / "symgrad.toml")
    found = next(o for o in spec.ops if o.name == names.get(op, "Lfilter"))
    folder = Path(tempfile.mkdtemp(prefix="sequential_"))
    text = module_text(found, "symgrad.toml", target, associative=False)
    (folder / f"{op}.py").write_text(text)
    return str(folder)


def measure(target: str, op: str, impl: str, length: int) -> dict:
    folder = sequential_folder(target, op) if impl == "sequential" else REPO / FOLDERS[target]
    script = STEP.format(
        folder=str(folder),
        target=target,
        op=op,
        impl=impl,
        shapes=shapes(op, length),
    )
    env = {**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1][:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="tensorflow,pytorch,jax")
    parser.add_argument("--ops", default="selective_scan,linear_recurrence,lfilter")
    parser.add_argument("--impls", default="symgrad,plain,sequential")
    parser.add_argument("--length", type=int, default=2048)
    args = parser.parse_args()
    print(f"L = {args.length}, float32, a training step (forward + gradient of every input)")
    impls = args.impls.split(",")
    print(
        f"{'op':18} {'target':11} "
        + " ".join(f"{i + ' s':>13} {i + ' MB':>14}" for i in impls)
        + f" {'io MB':>7}"
    )
    for op in args.ops.split(","):
        for target in args.targets.split(","):
            row, io = [], None
            for impl in impls:
                found = measure(target, op, impl, args.length)
                if "error" in found:
                    row.append(f"{'error':>13} {found['error'][:14]:>14}")
                    continue
                io = found["io"]
                row.append(f"{found['time']:13.3f} {found['peak'] / 2**20:14.2f}")
            io_text = f"{io / 2**20:7.2f}" if io is not None else ""
            print(f"{op:18} {target:11} " + " ".join(row) + " " + io_text, flush=True)


if __name__ == "__main__":
    main()
