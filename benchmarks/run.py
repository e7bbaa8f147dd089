"""Generated gradients vs TensorFlow's own, and the generator's speed.

Run from anywhere:  .venv/bin/python benchmarks/run.py  [--budget S] [--ops A,B] [--jit]

1. Generation: regenerates benchmarks/generated/ from benchmarks/bench.toml with the CLI,
   times each op's module in a fresh interpreter that never imports TensorFlow, and times the
   repo's whole symgrad.toml (CLI wall time, written to a temporary folder).
2. For every op (float32, one process, same inputs), after a correctness guard:
   - registered gradient: `module.gradient(fake_op, grad)` with fake_op.inputs/outputs from
     the TF reference forward, vs TF's backward for the reference = median(tape forward +
     backward) - median(forward alone), both tf.function-compiled ("subtraction method");
     also without subtraction: reference forward + gradient(op) vs reference forward + tape
     backward, each as one tf.function;
   - training step: tape over the generated `forward` (custom_gradient) vs tape over the TF
     reference, forward + backward, upstream gradient G (i.e. loss = sum(y * G));
   - peak memory of each training step: TensorFlow's CPU allocator statistics
     (tf.config.experimental.get_memory_info('CPU:0') after reset_memory_stats), peak bytes
     above what was allocated before the call. Counts tensor buffers TF allocates; oneDNN
     scratch space outside TF's allocator is not counted.
   All callables run interleaved in shuffled order each round; medians are reported.
3. Prints the tables, writes benchmarks/results.json and benchmarks/results.png.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SPEC = HERE / "bench.toml"
OUT = HERE / "generated"

# ----------------------------------------------------------------------------- generation

GEN_TIMER = r"""
import json, sys, time
t0 = time.perf_counter()
from symgrad.spec import load_spec
from symgrad.pipeline import module_text
t_import = time.perf_counter() - t0
spec = load_spec(sys.argv[1])
times = {}
for op in spec.ops:
    t = time.perf_counter()
    module_text(op, "bench.toml")
    times[op.name] = time.perf_counter() - t
print(json.dumps({"import_s": t_import, "per_op_s": times,
                  "tensorflow_imported": "tensorflow" in sys.modules}))
"""


def _wall(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    return time.perf_counter() - t, proc


def generation() -> dict:
    py = sys.executable
    wall, proc = _wall([py, "-m", "symgrad", "generate", str(SPEC), "--out", str(OUT)])
    if proc.returncode != 0:
        sys.exit(f"symgrad generate failed:\n{proc.stdout}{proc.stderr}")
    _, proc = _wall([py, "-c", GEN_TIMER, str(SPEC)])
    if proc.returncode != 0:
        sys.exit(f"generation timer failed:\n{proc.stderr}")
    timed = json.loads(proc.stdout.strip().splitlines()[-1])
    with tempfile.TemporaryDirectory() as tmp:
        # The repo's spec writes three targets, each into its folder beside the spec.
        shutil.copy(ROOT / "symgrad.toml", Path(tmp) / "symgrad.toml")
        repo_wall, proc = _wall([py, "-m", "symgrad", "generate", str(Path(tmp) / "symgrad.toml")])
        if proc.returncode != 0:
            sys.exit(f"symgrad generate of the repo's spec failed:\n{proc.stdout}{proc.stderr}")
        repo_ok = True
        repo_ops = len(list((Path(tmp) / "generated").glob("*.py"))) - 1
    per_op = timed["per_op_s"]
    return {
        "bench_spec_cli_wall_s": wall,
        "per_op_s": per_op,
        "mean_per_op_s": sum(per_op.values()) / len(per_op),
        "import_s": timed["import_s"],
        "tensorflow_imported": timed["tensorflow_imported"],
        "repo_spec_cli_wall_s": repo_wall,
        "repo_spec_ok": repo_ok,
        "repo_spec_ops": repo_ops,
    }


# ----------------------------------------------------------------------------- op table


def cases(tf):
    """Per op: input shapes and scales, and TF references (first = the primary one)."""

    def rn(shape, scale=1.0):
        return tf.random.normal(shape, dtype=tf.float32) * scale

    def kron_einsum(A, B):
        b, i, j = A.shape
        _, k, l = B.shape
        return tf.reshape(tf.einsum("bij,bkl->bikjl", A, B), [b, i * k, j * l])

    def kron_broadcast(A, B):
        b, i, j = A.shape
        _, k, l = B.shape
        y = A[:, :, None, :, None] * B[:, None, :, None, :]
        return tf.reshape(y, [b, i * k, j * l])

    def attention_literal(Q, K):
        e = tf.exp(tf.einsum("bid,bjd->bij", Q, K))
        return e / tf.reduce_sum(e, axis=2, keepdims=True)

    def layer_norm(x):
        mu = tf.reduce_mean(x, axis=1, keepdims=True)
        var = tf.reduce_mean(tf.square(x - mu), axis=1, keepdims=True)
        return (x - mu) * tf.math.rsqrt(var + 1e-5)

    def layer_norm_moments(x):
        mu, var = tf.nn.moments(x, axes=[1], keepdims=True)
        return (x - mu) * tf.math.rsqrt(var + 1e-5)

    def pair_expanded(x):
        sq = tf.reduce_sum(tf.square(x), axis=2)
        return sq[:, :, None] + sq[:, None, :] - 2 * tf.einsum("bik,bjk->bij", x, x)

    def pair_broadcast(x):
        return tf.reduce_sum(tf.square(x[:, :, None, :] - x[:, None, :, :]), axis=3)

    def causal_softmax(A):
        n = A.shape[-1]
        keep = tf.linalg.band_part(tf.ones((n, n), tf.bool), -1, 0)
        return tf.nn.softmax(tf.where(keep, A, tf.constant(-float("inf"), A.dtype)), axis=-1)

    def chamfer_expanded(x, z):
        d = (
            tf.reduce_sum(tf.square(x), 2)[:, :, None]
            + tf.reduce_sum(tf.square(z), 2)[:, None, :]
            - 2 * tf.einsum("bic,bjc->bij", x, z)
        )
        return tf.reduce_min(d, axis=2)

    def correlation(f1, f2, r):
        """FlowNet's cost volume: pad f2, stack the (2r+1)^2 shifted products."""
        padded = tf.pad(f2, [[0, 0], [r, r], [r, r], [0, 0]])
        h, w = f1.shape[1], f1.shape[2]
        rows = [
            tf.stack(
                [
                    tf.reduce_mean(f1 * padded[:, u : u + h, v : v + w, :], axis=-1)
                    for v in range(2 * r + 1)
                ],
                axis=-1,
            )
            for u in range(2 * r + 1)
        ]
        return tf.stack(rows, axis=-2)

    e = tf.einsum
    mm = tf.linalg.matmul
    return {
        "BenchMatMul": {
            "module": "bench_mat_mul",
            "inputs": [((32, 256, 256), 1), ((32, 256, 256), 1)],
            "refs": {
                "einsum": lambda A, B: e("bik,bkj->bij", A, B),
                "tf.linalg.matmul": lambda A, B: mm(A, B),
            },
        },
        "BenchKron": {
            "module": "bench_kron",
            "inputs": [((32, 32, 32), 1), ((32, 16, 16), 1)],
            "refs": {"einsum": kron_einsum, "broadcast multiply": kron_broadcast},
        },
        "BenchExpMatMul": {
            "module": "bench_exp_mat_mul",
            "inputs": [((32, 256, 64), 0.125), ((32, 64, 256), 0.125)],
            "refs": {"einsum": lambda A, B: tf.exp(e("bik,bkj->bij", A, B))},
        },
        "BenchAttention": {
            "module": "bench_attention",
            "inputs": [((32, 256, 64), 0.125), ((32, 256, 64), 1)],
            "refs": {
                "tf.nn.softmax": lambda Q, K: tf.nn.softmax(e("bid,bjd->bij", Q, K)),
                "exp/sum literal": attention_literal,
            },
        },
        "BenchLogSumExp": {
            "recomputes": "exp(A - y)",
            "module": "bench_log_sum_exp",
            "inputs": [((32, 256, 1024), 1)],
            "refs": {
                "tf.reduce_logsumexp": lambda A: tf.reduce_logsumexp(A, axis=2),
                "log(sum(exp)) literal": lambda A: tf.math.log(tf.reduce_sum(tf.exp(A), axis=2)),
            },
        },
        "BenchGram": {
            "module": "bench_gram",
            "inputs": [((32, 256, 128), 1)],
            "refs": {
                "einsum": lambda A: e("bik,bjk->bij", A, A),
                "tf.linalg.matmul": lambda A: mm(A, A, transpose_b=True),
            },
        },
        "BenchTanhMatMul": {
            "recomputes": "tanh(A)",
            "module": "bench_tanh_mat_mul",
            "inputs": [((32, 256, 256), 1), ((32, 256, 128), 1)],
            "refs": {"einsum": lambda A, B: e("bik,bkj->bij", tf.tanh(A), B)},
        },
        "BenchChain3": {
            "recomputes": "a product of two inputs",
            "module": "bench_chain3",
            "inputs": [((32, 128, 64), 1), ((32, 64, 256), 1), ((32, 256, 32), 1)],
            "refs": {
                "einsum": lambda A, B, C: e("bij,bjk,bkl->bil", A, B, C),
                "tf.linalg.matmul": lambda A, B, C: mm(mm(A, B), C),
            },
        },
        "BenchPairDist": {
            "module": "bench_pair_dist",
            "inputs": [((32, 256, 32), 1)],
            "refs": {"expanded": pair_expanded, "broadcast literal": pair_broadcast},
        },
        "BenchLayerNorm": {
            "recomputes": "the row mean and variance",
            "module": "bench_layer_norm",
            "inputs": [((4096, 1024), 1)],
            "refs": {"reduce_mean": layer_norm, "tf.nn.moments": layer_norm_moments},
        },
        "BenchConv2d": {
            "module": "bench_conv2d",
            "inputs": [((32, 64, 64, 32), 1), ((3, 3, 32, 32), 0.1)],
            "refs": {"tf.nn.conv2d SAME": lambda x, w: tf.nn.conv2d(x, w, 1, "SAME")},
        },
        "BenchMaxPool": {
            "module": "bench_max_pool",
            "inputs": [((32, 64, 64, 32), 1)],
            "refs": {"tf.nn.max_pool2d": lambda x: tf.nn.max_pool2d(x, 2, 2, "VALID")},
        },
        "BenchEmbedding": {
            "module": "bench_embedding",
            "inputs": [((20000, 128), 1), ("int", (64, 256), 20000)],
            "refs": {"tf.gather": lambda W, ids: tf.gather(W, ids)},
        },
        "BenchCausalSoftmax": {
            "module": "bench_causal_softmax",
            "inputs": [((32, 256, 256), 4)],
            "refs": {"masked tf.nn.softmax": causal_softmax},
        },
        "BenchChamfer": {
            "module": "bench_chamfer",
            "inputs": [((4, 1024, 3), 1), ((4, 1024, 3), 1)],
            "refs": {"expanded + reduce_min": chamfer_expanded},
        },
        "BenchCorrelation": {
            "module": "bench_correlation",
            "inputs": [((4, 32, 32, 64), 1), ((4, 32, 32, 64), 1)],
            "attrs": {"r": 4},
            "refs": {"pad and stack": correlation},
        },
        "BenchPrefixSum": {
            "module": "bench_prefix_sum",
            "inputs": [((64, 2048), 1)],
            "refs": {"tf.cumsum": lambda x: tf.cumsum(x, axis=1)},
        },
    }, rn


MODULES = OUT  # where the modules under test are loaded from (--modules)


def load_module(name: str, folder: Path | None = None):
    folder = folder or MODULES
    path = folder / f"{name}.py"
    tag = f"{abs(hash(str(folder))):x}"
    spec = importlib.util.spec_from_file_location(f"symgrad_bench_{tag}.{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeOp:
    """What a registered gradient function sees of a real op: its type, its definition
    (the names of its inputs, outputs and attrs: the module's own), tensors and attrs."""

    def __init__(self, module, inputs, outputs, attrs=None):
        self.type = module.OP_TYPE
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self._attrs = attrs or {}
        self.op_def = SimpleNamespace(
            input_arg=_args(module.INPUTS),
            output_arg=_args(module.OUTPUTS),
            attr=_args(module.ATTRS),
        )

    def get_attr(self, name):
        return self._attrs[name]


def _args(names):
    return [SimpleNamespace(name=n, number_attr="", type_list_attr="") for n in names]


# ----------------------------------------------------------------------------- timing


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def interleaved(fns: dict, args: dict, budget_s: float, min_reps=15, max_reps=400):
    """Median seconds per callable, calls interleaved in shuffled order each round."""
    for _ in range(3):  # trace + warm up
        for name, f in fns.items():
            f(*args[name])
    t = time.perf_counter()
    for name, f in fns.items():
        f(*args[name])
    one_round = time.perf_counter() - t
    reps = int(max(min_reps, min(max_reps, budget_s / max(one_round, 1e-6))))
    times = {name: [] for name in fns}
    order = list(fns)
    rng = random.Random(0)
    for _ in range(reps):
        rng.shuffle(order)
        for name in order:
            f, a = fns[name], args[name]
            t = time.perf_counter()
            f(*a)
            times[name].append(time.perf_counter() - t)
    return (
        {name: median(ts) for name, ts in times.items()},
        {name: min(ts) for name, ts in times.items()},
        reps,
    )


def peak_bytes(tf, f, args, repeats=3):
    """Peak TF CPU allocator bytes above the level before the call (min over repeats)."""
    best = None
    for _ in range(repeats):
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        out = f(*args)
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
        # f made `out` and holds it at its end: a peak below its bytes (or 0) was not
        # measured on the call (its work done before the reset, or elsewhere)
        held = sum(
            t.shape.num_elements() * t.dtype.size
            for t in tf.nest.flatten(out)
            if isinstance(t, tf.Tensor)
        )
        if peak <= 0 or peak < held:
            raise RuntimeError(
                f"TF peak {peak} B below the {held} B the call returns: not measured"
            )
        del out
        best = peak if best is None else min(best, peak)
    return best


def max_rel_err(tf, got, want):
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        g, w = tf.convert_to_tensor(g), tf.convert_to_tensor(w)  # gathers: IndexedSlices
        scale = float(tf.reduce_max(tf.abs(w))) or 1.0
        worst = max(worst, float(tf.reduce_max(tf.abs(g - w))) / scale)
    return worst


def bench_op(tf, name, case, rn, budget_s, jit, tol, compare=()):
    """Time one op: every module set in `compare` too, all in the same interleaved rounds."""
    sets = {"gen": load_module(case["module"])}
    for label, folder in compare:
        sets[label] = load_module(case["module"], folder)
    assert sets["gen"].OP_TYPE == name, (sets["gen"].OP_TYPE, name)
    tf.random.set_seed(zlib.crc32(name.encode()))

    def make(spec):  # (shape, scale) for values, ("int", shape, high) for index tensors
        if spec[0] == "int":
            return tf.random.uniform(spec[1], 0, spec[2], dtype=tf.int32)
        return rn(*spec)

    xs = [make(spec) for spec in case["inputs"]]
    n = len(xs)
    floats = [k for k, x in enumerate(xs) if x.dtype.is_floating]  # get gradients
    attrs = case.get("attrs", {})
    refs = {r: functools.partial(f, **attrs) for r, f in case["refs"].items()}
    primary = next(iter(refs))
    ref0 = refs[primary]
    y0 = ref0(*xs)
    G = rn(y0.shape)

    def tape_step(fwd):
        def step(*args):
            inputs, g = args[:n], args[n]
            watched = [inputs[k] for k in floats]
            with tf.GradientTape() as tape:
                tape.watch(watched)
                y = fwd(*inputs)
            return y, tape.gradient(y, watched, output_gradients=g)

        return step

    def registered(mod):  # the op's forward (the TF reference), then gradient(op)
        def run(*args):
            inputs, g = args[:n], args[n]
            y = ref0(*inputs)
            grads = mod.gradient(FakeOp(mod, inputs, [y], attrs), g)
            return y, [grads[k] for k in floats]

        return run

    def grad_alone(mod):
        def run(*args):
            inputs, y, g = args[:n], args[n], args[n + 1]
            grads = mod.gradient(FakeOp(mod, inputs, [y], attrs), g)
            return [grads[k] for k in floats]

        return run

    fn = lambda f, **kw: tf.function(f, autograph=False, **kw)
    fns, args = {}, {}
    for r, ref in refs.items():
        fns[f"tf_fwd:{r}"], args[f"tf_fwd:{r}"] = fn(ref), xs
        fns[f"tf_step:{r}"], args[f"tf_step:{r}"] = fn(tape_step(ref)), (*xs, G)
    for label, mod in sets.items():
        forward = functools.partial(mod.forward, **attrs)
        fns[f"reg@{label}"], args[f"reg@{label}"] = fn(registered(mod)), (*xs, G)
        fns[f"grad@{label}"], args[f"grad@{label}"] = fn(grad_alone(mod)), (*xs, y0, G)
        fns[f"step@{label}"], args[f"step@{label}"] = fn(tape_step(forward)), (*xs, G)
    fns["fwd@gen"], args["fwd@gen"] = fn(functools.partial(sets["gen"].forward, **attrs)), xs
    # Eager training steps (no tf.function): Python and per-op dispatch costs show here.
    fns["eager_step:tf"], args["eager_step:tf"] = tape_step(ref0), (*xs, G)
    for label, mod in sets.items():
        fns[f"eager_step@{label}"] = tape_step(functools.partial(mod.forward, **attrs))
        args[f"eager_step@{label}"] = (*xs, G)
    if jit:
        gen_forward = functools.partial(sets["gen"].forward, **attrs)
        fns["xla_step@gen"] = fn(tape_step(gen_forward), jit_compile=True)
        fns["xla_step:tf"] = fn(tape_step(ref0), jit_compile=True)
        args["xla_step@gen"] = args["xla_step:tf"] = (*xs, G)

    # Correctness guard: never time wrong code.
    y_ref, g_ref = fns[f"tf_step:{primary}"](*xs, G)
    errors = {"forward@gen": max_rel_err(tf, [fns["fwd@gen"](*xs)], [y_ref])}
    for label in sets:
        errors[f"gradient(op)@{label}"] = max_rel_err(tf, fns[f"reg@{label}"](*xs, G)[1], g_ref)
        errors[f"forward+tape@{label}"] = max_rel_err(tf, fns[f"step@{label}"](*xs, G)[1], g_ref)
    for r in list(refs)[1:]:
        errors[f"reference {r}"] = max_rel_err(tf, fns[f"tf_step:{r}"](*xs, G)[1], g_ref)
    bad = {k: v for k, v in errors.items() if not v <= tol}
    if bad:
        return {
            "op": name,
            "error": f"gradients disagree with TF (max rel err {bad})",
            "max_rel_err": errors,
        }

    med, mins, reps = interleaved(fns, args, budget_s)
    ms = {k: v * 1e3 for k, v in med.items()}
    mem_keys = [
        f"tf_step:{primary}",
        *(f"step@{lab}" for lab in sets),
        *(f"reg@{lab}" for lab in sets),
    ]
    mib = {k: peak_bytes(tf, fns[k], args[k]) / 2**20 for k in mem_keys}
    tf_fwd0 = ms[f"tf_fwd:{primary}"]
    tf_bwd = {r: ms[f"tf_step:{r}"] - ms[f"tf_fwd:{r}"] for r in refs}
    variants = {}
    for label in sets:
        bwd = ms[f"reg@{label}"] - tf_fwd0
        variants[label] = {
            "bwd_ms": bwd,  # TF forward + gradient(op), minus the TF forward
            "gradient_alone_ms": ms[f"grad@{label}"],
            "step_ms": ms[f"step@{label}"],
            "grad_ratio": {r: _ratio(bwd, tf_bwd[r]) for r in refs},
            "step_ratio": {r: _ratio(ms[f"step@{label}"], ms[f"tf_step:{r}"]) for r in refs},
            "eager_step_ms": ms[f"eager_step@{label}"],
            "eager_step_ratio": _ratio(ms[f"eager_step@{label}"], ms["eager_step:tf"]),
            "peak_step_mib": mib[f"step@{label}"],
            "peak_registered_mib": mib[f"reg@{label}"],
        }
    result = {
        "op": name,
        "primary_ref": primary,
        "reps": reps,
        "max_rel_err": errors,
        "shapes": [list(spec[1] if spec[0] == "int" else spec[0]) for spec in case["inputs"]],
        "output_shape": list(y0.shape),
        "recomputes": case.get("recomputes", ""),
        "tf": {
            r: {"fwd_ms": ms[f"tf_fwd:{r}"], "step_ms": ms[f"tf_step:{r}"], "bwd_ms": tf_bwd[r]}
            for r in refs
        },
        "tf_peak_step_mib": mib[f"tf_step:{primary}"],
        "tf_eager_step_ms": ms["eager_step:tf"],
        "gen_fwd_ms": ms["fwd@gen"],
        "variants": variants,
        "median_ms": ms,
        "min_ms": {k: v * 1e3 for k, v in mins.items()},
    }
    if jit:
        result["xla"] = {
            "gen_step_ms": ms["xla_step@gen"],
            "tf_step_ms": ms["xla_step:tf"],
            "step_ratio": ms["xla_step@gen"] / ms["xla_step:tf"],
        }
    return result


def _ratio(a, b):
    return a / b if b > 0 else float("inf")


# ----------------------------------------------------------------------------- report


def table(results, gen, label="gen") -> str:
    head = (
        f"{'op':<15} {'bwd gen':>8} {'bwd TF':>8} {'ratio':>6} {'step gen':>9} "
        f"{'step TF':>8} {'ratio':>6} {'eager gen':>9} {'eager TF':>8} {'ratio':>6} "
        f"{'peak gen':>9} {'peak TF':>8} {'gen ms':>7}  notes"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['op']:<15} FAILED: {r['error']}")
            continue
        v, p = r["variants"][label], r["primary_ref"]
        t = r["tf"][p]
        g = gen.get("per_op_s", {}).get(r["op"], float("nan")) * 1e3
        notes = f"vs {p}" + (
            f"; gradient(op) recomputes {r['recomputes']}" if r["recomputes"] else ""
        )
        lines.append(
            f"{r['op']:<15} {v['bwd_ms']:>8.2f} {t['bwd_ms']:>8.2f} {v['grad_ratio'][p]:>6.2f} "
            f"{v['step_ms']:>9.2f} {t['step_ms']:>8.2f} {v['step_ratio'][p]:>6.2f} "
            f"{v['eager_step_ms']:>9.2f} {r['tf_eager_step_ms']:>8.2f} "
            f"{v['eager_step_ratio']:>6.2f} {v['peak_step_mib']:>8.1f}M {r['tf_peak_step_mib']:>7.1f}M {g:>7.0f}  {notes}"
        )
    return "\n".join(lines)


def other_refs_table(results, label="gen") -> str:
    lines = [
        "Other TF formulations of the same op (ratios = generated / this one):",
        (
            f"  {'op':<15} {'TF reference':<22} {'bwd TF':>8} {'ratio':>6} {'step TF':>8} "
            f"{'ratio':>6}"
        ),
    ]
    for r in results:
        if "error" in r:
            continue
        v = r["variants"][label]
        for name, t in r["tf"].items():
            if name != r["primary_ref"]:
                lines.append(
                    f"  {r['op']:<15} {name:<22} {t['bwd_ms']:>8.2f} "
                    f"{v['grad_ratio'][name]:>6.2f} {t['step_ms']:>8.2f} "
                    f"{v['step_ratio'][name]:>6.2f}"
                )
    return "\n".join(lines)


def compare_table(results, label) -> str:
    lines = [
        f"Modules from {label}, timed in the same rounds (vs the primary TF reference):",
        (
            f"  {'op':<15} {'bwd ms':>8} {'ratio':>6} {'(gen)':>6} {'step ms':>8} "
            f"{'ratio':>6} {'(gen)':>6} {'eager ms':>8} {'ratio':>6} {'(gen)':>6} {'peak':>8}"
        ),
    ]
    for r in results:
        if "error" in r or label not in r["variants"]:
            continue
        v, g, p = r["variants"][label], r["variants"]["gen"], r["primary_ref"]
        lines.append(
            f"  {r['op']:<15} {v['bwd_ms']:>8.2f} {v['grad_ratio'][p]:>6.2f} "
            f"{g['grad_ratio'][p]:>6.2f} {v['step_ms']:>8.2f} "
            f"{v['step_ratio'][p]:>6.2f} {g['step_ratio'][p]:>6.2f} "
            f"{v['eager_step_ms']:>8.2f} {v['eager_step_ratio']:>6.2f} "
            f"{g['eager_step_ratio']:>6.2f} {v['peak_step_mib']:>7.1f}M"
        )
    s = summary(results, label)
    lines.append(
        f"  geomean: backward {s['geomean_grad_ratio']:.3f} (max "
        f"{s['max_grad_ratio']:.2f}), step {s['geomean_step_ratio']:.3f} (max "
        f"{s['max_step_ratio']:.2f}); from fastest rounds: backward "
        f"{s['geomean_grad_ratio_from_minima']:.3f}, step "
        f"{s['geomean_step_ratio_from_minima']:.3f}"
    )
    return "\n".join(lines)


def summary(results, label="gen") -> dict:
    ok = [r for r in results if "error" not in r and label in r["variants"]]
    grad = [r["variants"][label]["grad_ratio"][r["primary_ref"]] for r in ok]
    step = [r["variants"][label]["step_ratio"][r["primary_ref"]] for r in ok]
    s = {
        "geomean_grad_ratio": geomean(grad),
        "max_grad_ratio": max(grad, default=float("nan")),
        "geomean_step_ratio": geomean(step),
        "max_step_ratio": max(step, default=float("nan")),
        "geomean_eager_step_ratio": geomean([r["variants"][label]["eager_step_ratio"] for r in ok]),
        "max_eager_step_ratio": max(
            (r["variants"][label]["eager_step_ratio"] for r in ok), default=float("nan")
        ),
        "geomean_grad_ratio_vs_fastest_tf": geomean(
            [max(r["variants"][label]["grad_ratio"].values()) for r in ok]
        ),
        "geomean_step_ratio_vs_fastest_tf": geomean(
            [max(r["variants"][label]["step_ratio"].values()) for r in ok]
        ),
        "ops_with_step_peak_above_tf": [
            r["op"]
            for r in ok
            if r["variants"][label]["peak_step_mib"] > r["tf_peak_step_mib"] * 1.001
        ],
        "ops_with_registered_peak_above_tf": [
            r["op"]
            for r in ok
            if r["variants"][label]["peak_registered_mib"] > r["tf_peak_step_mib"] * 1.001
        ],
        "failed": [r["op"] for r in results if "error" in r],
    }
    # The same ratios from each callable's fastest round: less sensitive to other load.
    mins = [(r["min_ms"], r["primary_ref"]) for r in ok]
    s["geomean_grad_ratio_from_minima"] = geomean(
        [
            _ratio(m[f"reg@{label}"] - m[f"tf_fwd:{p}"], m[f"tf_step:{p}"] - m[f"tf_fwd:{p}"])
            for m, p in mins
        ]
    )
    s["geomean_step_ratio_from_minima"] = geomean(
        [_ratio(m[f"step@{label}"], m[f"tf_step:{p}"]) for m, p in mins]
    )
    xla = [r["xla"]["step_ratio"] for r in ok if "xla" in r]
    if xla:
        s["geomean_xla_step_ratio"] = geomean(xla)
    return s


def summary_text(s, gen) -> str:
    lines = [
        (
            f"geomean ratio, registered gradient (backward only): {s['geomean_grad_ratio']:.3f} "
            f"(max {s['max_grad_ratio']:.2f}); vs the fastest TF formulation per op: "
            f"{s['geomean_grad_ratio_vs_fastest_tf']:.3f}"
        ),
        (
            f"geomean ratio, training step through forward (forward+backward): "
            f"{s['geomean_step_ratio']:.3f} (max {s['max_step_ratio']:.2f}); vs the fastest TF "
            f"formulation per op: {s['geomean_step_ratio_vs_fastest_tf']:.3f}"
        ),
    ]
    lines.append(
        f"geomean ratio, eager training step (no tf.function): "
        f"{s['geomean_eager_step_ratio']:.3f} (max {s['max_eager_step_ratio']:.2f})"
    )
    lines.append(
        f"(the same geomeans from each callable's fastest round instead of medians: "
        f"backward {s['geomean_grad_ratio_from_minima']:.3f}, step "
        f"{s['geomean_step_ratio_from_minima']:.3f})"
    )
    if "geomean_xla_step_ratio" in s:
        lines.append(f"geomean ratio, XLA training step: {s['geomean_xla_step_ratio']:.3f}")
    lines.append(
        "peak memory above TF: training step: "
        f"{', '.join(s['ops_with_step_peak_above_tf']) or 'none'}; TF forward + "
        f"gradient(op): {', '.join(s['ops_with_registered_peak_above_tf']) or 'none'}"
    )
    if gen.get("per_op_s"):
        lines.append(
            f"generation: mean {gen['mean_per_op_s'] * 1e3:.0f} ms/op (max "
            f"{max(gen['per_op_s'].values()) * 1e3:.0f}) in-process after a {gen['import_s']:.2f}"
            f" s symgrad import; TensorFlow imported: {gen['tensorflow_imported']}. CLI wall: "
            f"{gen['bench_spec_cli_wall_s']:.2f} s for bench.toml ({len(gen['per_op_s'])} ops), "
            f"{gen['repo_spec_cli_wall_s']:.2f} s for the repo's symgrad.toml "
            f"({gen['repo_spec_ops']} ops{'' if gen['repo_spec_ok'] else ', FAILED'})"
        )
    if s["failed"]:
        lines.append(f"FAILED the correctness guard (not timed): {', '.join(s['failed'])}")
    return "\n".join(lines)


METHOD = """\
Method: float32, CPU, one process, same inputs; every callable but the eager steps is a
tf.function (autograph off), called in shuffled order each round (interleaved), medians over
the rounds.
- bwd gen: median(TF reference forward + gradient(fake_op, G)) - median(TF reference forward),
  fake_op.inputs/outputs being the reference's inputs and output (what a registered gradient
  sees); bwd TF: median(TF reference forward + tape.gradient) - median(TF reference forward).
  The same subtraction on both sides, so the bias of running a backward alone cancels.
- step: tape.gradient through the generated forward (tf.custom_gradient) vs through the TF
  reference, forward + backward, output_gradients=G (loss = sum(y * G)).
- eager: the same training step run eagerly (no tf.function), where Python and per-op
  dispatch costs (the custom-gradient wrapper, call-time checks, shape reads) show.
- peak: TensorFlow's CPU allocator, tf.config.experimental.get_memory_info('CPU:0')['peak']
  after reset_memory_stats, minus the bytes in use before the call, for one training step
  (min of 3). Counts TF tensor buffers; oneDNN scratch outside TF's allocator is not counted.
- gen ms: one op's module (build, lower, render, ruff format, compile) in a fresh interpreter
  that has not imported TensorFlow."""


def chart(results, path: Path, label="gen"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    ok = [r for r in results if "error" not in r]
    names = [r["op"].removeprefix("Bench") for r in ok]
    series = {
        "registered gradient: backward / TF backward": [
            r["variants"][label]["grad_ratio"][r["primary_ref"]] for r in ok
        ],
        "training step / TF training step": [
            r["variants"][label]["step_ratio"][r["primary_ref"]] for r in ok
        ],
        "training-step peak memory / TF": [
            r["variants"][label]["peak_step_mib"] / max(r["tf_peak_step_mib"], 1e-9) for r in ok
        ],
    }
    fig, ax = plt.subplots(figsize=(11, 4.8))
    width = 0.8 / len(series)
    for n, (name, values) in enumerate(series.items()):
        xs = [i + (n - (len(series) - 1) / 2) * width for i in range(len(ok))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, labels=[f"{v:.2f}" for v in values], fontsize=6, rotation=90, padding=2)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    plain = matplotlib.ticker.FormatStrFormatter("%.2g")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_xticks(range(len(ok)), names, rotation=20)
    ax.set_ylabel("generated / TensorFlow (lower is better)")
    ax.set_title("symgrad vs TensorFlow: float32, CPU, medians of interleaved runs")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget", type=float, default=12.0, help="seconds of timed rounds per op (default 12)"
    )
    parser.add_argument("--ops", help="comma-separated op names (default: all)")
    parser.add_argument("--jit", action="store_true", help="also time XLA training steps")
    parser.add_argument(
        "--tol",
        type=float,
        default=2e-4,
        help="max |gen - TF| / max|TF| per gradient (default 2e-4)",
    )
    parser.add_argument("--out", default=str(HERE), help="folder for results.json/png")
    parser.add_argument(
        "--modules",
        help="load the op modules from this folder instead of "
        "benchmarks/generated (e.g. a prototype lowering's output)",
    )
    parser.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="DIR",
        help="also time the modules in DIR in the same rounds (repeatable)",
    )
    parser.add_argument(
        "--skip-generation", action="store_true", help="neither regenerate nor time the generator"
    )
    args = parser.parse_args()

    global MODULES
    if args.modules:
        MODULES = Path(args.modules).resolve()
    if args.skip_generation:
        gen = {}
    else:
        gen = generation()  # before TensorFlow is imported in this process
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # TF's default CPU allocator keeps no statistics (reset_memory_stats raises); its BFC
    # allocator does, for the peak-memory column.
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")  # retracing notes: each tf.function here traces once
    table_cases, rn = cases(tf)
    wanted = args.ops.split(",") if args.ops else list(table_cases)
    unknown = [w for w in wanted if w not in table_cases]
    if unknown:
        sys.exit(f"unknown ops {unknown}; known: {', '.join(table_cases)}")
    compare = [(str(Path(d)), Path(d).resolve()) for d in args.compare]
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    results = []
    for name in wanted:
        print(f"... {name}", file=sys.stderr, flush=True)
        results.append(
            bench_op(tf, name, table_cases[name], rn, args.budget, args.jit, args.tol, compare)
        )
    load_after = os.getloadavg()
    s = summary(results)
    parts = [table(results, gen), other_refs_table(results)]
    parts += [compare_table(results, label) for label, _ in compare]
    if any("xla" in r for r in results):
        parts.append(
            "XLA (jit_compile=True) training step vs the primary TF reference:\n"
            + "\n".join(
                f"  {r['op']:<15} gen {r['xla']['gen_step_ms']:8.2f} ms  TF "
                f"{r['xla']['tf_step_ms']:8.2f} ms  ratio "
                f"{r['xla']['step_ratio']:.2f}"
                for r in results
                if "xla" in r
            )
        )
    parts.append(summary_text(s, gen))
    busy = max(load_before[0], load_after[0]) > (os.cpu_count() or 1)
    parts.append(
        f"load average {load_before[0]:.1f} -> {load_after[0]:.1f} on "
        f"{os.cpu_count()} CPUs"
        + (
            "  (machine busy: absolute times are noisy; ratios come from interleaved rounds)"
            if busy
            else ""
        )
    )
    text = "\n\n".join(parts)
    print(text)
    print()
    print(METHOD)
    out = Path(args.out)
    payload = {
        "machine": {
            "python": platform.python_version(),
            "tensorflow": tf.__version__,
            "cpus": os.cpu_count(),
            "platform": f"{platform.system()} {platform.machine()}",
            "loadavg_before": load_before,
            "loadavg_after": load_after,
        },
        "benchmark_s": time.perf_counter() - t0,
        "method": METHOD,
        "generation": gen,
        "summary": s,
        "results": results,
        "compare_summaries": {label: summary(results, label) for label, _ in compare},
        "table": text,
    }
    (out / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    chart(results, out / "results.png")
    print(f"wrote {out / 'results.json'} and {out / 'results.png'}")
    return 1 if s["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
