"""Peak memory of a training step, read the way each framework allows (README, "Memory").

- TensorFlow: the BFC allocator's peak after `reset_memory_stats`, minus the bytes in use
  before. CPU statistics need `TF_CPU_ALLOCATOR_USE_BFC`, set before TensorFlow starts, so
  a test writes a script that measures with `peak` and runs it with `run_tensorflow`.
- PyTorch: the running sum of torch.profiler's allocation events, in the order they happen
  (`torch_peak`).
- JAX: the compiled step's `memory_analysis()` (`jax_step_memory`; `jax_step_bytes` for
  its temporaries, arguments and outputs together).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def held_bytes(result) -> int:
    """The bytes of the tensors and arrays in `result` (nested in lists, tuples and dicts;
    an IndexedSlices by its values and indices): what a step that returns them holds at
    once at its end."""
    import numpy as np

    if result is None or isinstance(result, (bool, int, float, str)):
        return 0
    if isinstance(result, dict):
        return sum(held_bytes(r) for r in result.values())
    if isinstance(result, (list, tuple)):
        return sum(held_bytes(r) for r in result)
    if hasattr(result, "indices") and hasattr(result, "values"):  # tf.IndexedSlices
        return held_bytes(result.values) + held_bytes(result.indices)
    if hasattr(result, "numpy"):  # a TF tensor: its shape, no copy
        return int(np.prod(result.shape, dtype=np.int64)) * result.dtype.size
    return int(np.asarray(result).nbytes)


def real_peak(measured: int, held: int, what: str = "step") -> int:
    """`measured` (peak bytes above the level before a step), refused unless it can be
    the step's: a step that makes `held` bytes it holds at once (its outputs and
    gradients) cannot peak at 0 or below them. Such a figure comes from a step whose work
    was done before the statistics were reset (a result computed earlier, a cached one)
    or elsewhere; a bound test would pass on it without measuring anything."""
    if measured <= 0 or measured < held:
        raise AssertionError(
            f"TensorFlow's peak for the {what} reads {measured} bytes, below the {held} "
            "bytes of outputs and gradients the step itself makes and holds at once: "
            "not a measurement of the step (its work done before reset_memory_stats, or "
            "outside the CPU:0 allocator)"
        )
    return measured


def peak(run) -> int:
    """TensorFlow's peak bytes for `run()` (once to warm up, then measured); in a process
    started by `run_tensorflow`. `run` returns what the step made and holds at once at its
    end (its gradients, as tensors or as arrays, and any outputs): a peak below their
    bytes (`held_bytes`), or 0, is refused (`real_peak`)."""
    import gc

    import tensorflow as tf

    run()
    gc.collect()  # the warm-up's garbage freed now, not during the measured step
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    result = run()
    measured = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
    return real_peak(measured, held_bytes(result))


def tf_step_peaks(module, args, budget, attrs=None, watched=None, repeats=1) -> dict:
    """In a process started by `run_tensorflow`: TensorFlow's peak bytes (`peak`) for a
    training step of `module` (the gradient of the sum of sin of every output with respect
    to `watched`, every arg by default), untiled and with MAX_TEMP_BYTES at `budget`, where
    it must tile (the largest of `repeats` steps: a bound holds for every step, and one
    step's peak moves with the allocator's free chunks and TensorFlow's schedule); and the
    bytes of its inputs and outputs (`io`)."""
    import tensorflow as tf

    attrs = attrs or {}
    watched = list(args) if watched is None else watched

    def outputs():
        out = module.forward(*args, **attrs)
        return out if isinstance(out, tuple) else (out,)

    def run():
        with tf.GradientTape() as tape:
            tape.watch(watched)
            out = outputs()
            if len(out) > 1:
                loss = tf.add_n([tf.reduce_sum(tf.sin(o)) for o in out])
            else:
                loss = tf.reduce_sum(tf.sin(out[0]))
        grads = tape.gradient(loss, watched)
        # tf.convert_to_tensor: a gathered input's gradient may be IndexedSlices
        for g in grads:
            tf.convert_to_tensor(g).numpy()
        return out, grads  # made by the step, held at once when the gradient returns

    io = sum(a.numpy().nbytes for a in args) + sum(o.numpy().nbytes for o in outputs())
    module.MAX_TEMP_BYTES = 2**40
    untiled = peak(run)
    module.MAX_TEMP_BYTES = budget
    assert module._tile_plan(*args, **attrs) is not None
    return {"io": io, "untiled": untiled, "tiled": max(peak(run) for _ in range(repeats))}


def run_tensorflow(script: str, timeout: int = 600):
    """Run a measuring script in a fresh process with TensorFlow's CPU statistics on; the
    JSON of its last printed line."""
    env = {**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def torch_peak(step) -> int:
    """Peak bytes PyTorch allocates while `step()` runs: the running sum of the profiler's
    allocation and free events."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as profile:
        step()
    events = [e for e in profile.profiler.kineto_results.events() if e.name() == "[memory]"]
    total = top = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        total += event.nbytes()
        top = max(top, total)
    return top


def jax_step_memory(module, args, attrs=None, wrt=None):
    """XLA's `memory_analysis()` of a jitted training step's gradient: of the sum of sin of
    every output of `module.forward`, with respect to the inputs at positions `wrt` (every
    one by default). Traced anew at each call, so under the module's current
    MAX_TEMP_BYTES."""
    import jax
    import jax.numpy as jnp

    attrs = attrs or {}
    wrt = tuple(range(len(args))) if wrt is None else wrt

    def loss(*a):
        outputs = module.forward(*a, **attrs)
        if isinstance(outputs, tuple):
            return sum(jnp.sum(jnp.sin(o)) for o in outputs)
        return jnp.sum(jnp.sin(outputs))

    def grad(*a):  # a new function: traced with the current budget
        return jax.grad(loss, argnums=wrt)(*a)

    return jax.jit(grad).lower(*args).compile().memory_analysis()


def jax_step_bytes(module, args, attrs=None, wrt=None) -> int:
    """The bytes a jitted training step's gradient holds (`jax_step_memory`): its
    temporaries, arguments and outputs."""
    analysis = jax_step_memory(module, args, attrs, wrt)
    return (
        analysis.temp_size_in_bytes
        + analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
    )


FORMULA_STEPS = """
import json, sys
sys.path.insert(0, {tests!r})
import numpy as np
import tensorflow as tf
if {inter_op}:
    tf.config.threading.set_inter_op_parallelism_threads({inter_op})
from pathlib import Path
from harness import Case, generate
from peaks import tf_step_peaks
rng = np.random.default_rng(0)

found = {{}}
for name, (formulas, shapes) in {cases!r}.items():
    module = generate(Case(formulas, {{}}), Path({folder!r}), prefix="Memory")
    args = [tf.constant(rng.uniform(-1, 1, shapes[n]).astype(np.float32)) for n in module.INPUTS]
    found[name] = tf_step_peaks(module, args, {budget})
print(json.dumps(found))
"""


def tf_formula_peaks(cases: dict, budget: int, folder, inter_op: int = 0) -> dict:
    """Per name of `cases` (name -> (formulas, input -> shape)), `tf_step_peaks` of its
    TensorFlow module at `budget`, on float32 inputs of those shapes drawn uniformly from
    [-1, 1) (one generator, seeded 0, in the order of `cases`): every case in one fresh
    process (`run_tensorflow`), generated into `folder`; with `inter_op`, that many
    inter-op threads (1: one schedule, comparable peaks), else TensorFlow's default."""
    tests = str(Path(__file__).resolve().parent)
    script = FORMULA_STEPS.format(
        tests=tests, cases=cases, folder=str(folder), budget=budget, inter_op=inter_op
    )
    return run_tensorflow(script)


def memory_inputs(names, shapes: dict, make) -> list:
    """Float32 inputs `names` of `shapes` (input -> shape) for a memory test, drawn
    uniformly from [-1, 1) (seed 6), each passed through `make` (a framework's tensor)."""
    import numpy as np

    rng = np.random.default_rng(6)
    return [make(rng.uniform(-1, 1, shapes[n]).astype(np.float32)) for n in names]


def io_bytes(xs, outputs) -> int:
    """The bytes of an op's inputs and outputs (arrays or detached tensors)."""
    import numpy as np

    return sum(int(np.asarray(a).nbytes) for a in (*xs, *outputs))


SWAPPED_PLAN_PEAKS = """
import json, sys
import tensorflow as tf
sys.path.insert(0, {folder!r})
sys.path.insert(0, {tests!r})
from peaks import peak
from {arrays_from} import {arrays}
from {swap_from} import {swap}
import {stem} as module

args = [tf.constant(a) for a in {arrays}()]
attrs = {attrs!r}

def step():
    with tf.GradientTape() as tape:
        tape.watch(args)
        loss = tf.reduce_sum(tf.sin(module.forward(*args, **attrs)))
    # a gathered input's gradient may be IndexedSlices
    return [tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, args)]

module.MAX_TEMP_BYTES = {budget}
planned = peak(step)
module.{plan} = {swap}(module.{plan})
print(json.dumps(dict(planned=planned, swapped=peak(step))))
"""


def tf_swapped_plan_peaks(folder, stem, arrays, attrs, budget, plan, swap) -> dict:
    """In a fresh process (`run_tensorflow`): TensorFlow's peak bytes (`peak`) for a training
    step of module `stem` in `folder` (the gradient of the sum of sin of its output with
    respect to every input) on `arrays()`, at MAX_TEMP_BYTES `budget`: under the module's
    own plan (`planned`), then with its function `plan` replaced by `swap(plan)`
    (`swapped`). `arrays` and `swap` are "test_module:function" of tests/."""
    arrays_from, arrays_name = arrays.split(":")
    swap_from, swap_name = swap.split(":")
    script = SWAPPED_PLAN_PEAKS.format(
        folder=str(folder),
        tests=str(Path(__file__).resolve().parent),
        arrays_from=arrays_from,
        arrays=arrays_name,
        swap_from=swap_from,
        swap=swap_name,
        stem=stem,
        attrs=attrs,
        budget=budget,
        plan=plan,
    )
    return run_tensorflow(script)


MODULE_STEP = """
import importlib, json, sys
sys.path.insert(0, {tests!r})
sys.path.insert(0, {folder!r})
import tensorflow as tf
from peaks import tf_step_peaks
from {arrays_from} import {arrays}

module = importlib.import_module({stem!r})
args = [tf.constant(a) for a in {arrays}()]
watched = None if {watched!r} is None else [args[k] for k in {watched!r}]
found = tf_step_peaks(module, args, {budget}, {attrs!r}, watched)
found["plan"] = [int(n) for n in module._tile_plan(*args, **{attrs!r})]
print(json.dumps(found))
"""


def tf_module_step_peaks(module, arrays: str, budget: int, attrs=None, watched=None) -> dict:
    """`tf_step_peaks` of a generated TensorFlow module, in a fresh process
    (`run_tensorflow`): its inputs from `arrays` ("test_file._function", float32 arrays
    in the module's order), the gradient of those at positions `watched` (every one by
    default); and its plan at `budget` ("plan")."""
    arrays_from, arrays_name = arrays.rsplit(".", 1)
    script = MODULE_STEP.format(
        tests=str(Path(__file__).resolve().parent),
        folder=str(Path(module.__file__).parent),
        stem=Path(module.__file__).stem,
        arrays_from=arrays_from,
        arrays=arrays_name,
        budget=budget,
        attrs=dict(attrs or {}),
        watched=None if watched is None else tuple(watched),
    )
    return run_tensorflow(script)


def jax_step_peaks(module, args, budget: int, attrs=None, wrt=None) -> tuple[int, int, int]:
    """(untiled, tiled, bound) for a jitted JAX training step (`jax_step_bytes`) untiled
    and at `budget`, where the module must plan; the bound is 4x the bytes of the inputs
    and outputs plus the budget. The module's MAX_TEMP_BYTES is restored after."""
    import jax

    attrs = attrs or {}
    out = jax.eval_shape(lambda *a: module.forward(*a, **attrs), *args)
    outs = out if isinstance(out, tuple) else (out,)
    held = sum(a.nbytes for a in args) + sum(o.size * o.dtype.itemsize for o in outs)
    saved = module.MAX_TEMP_BYTES
    try:
        module.MAX_TEMP_BYTES = 2**40
        untiled = jax_step_bytes(module, args, attrs, wrt)
        module.MAX_TEMP_BYTES = budget
        assert module._tile_plan(*args, **attrs) is not None
        tiled = jax_step_bytes(module, args, attrs, wrt)
    finally:
        module.MAX_TEMP_BYTES = saved
    return untiled, tiled, 4 * held + budget
