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
import importlib.util
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SPEC = HERE / "bench.toml"
OUT = HERE / "generated"

# ----------------------------------------------------------------------------- generation

GEN_TIMER = r"""
import json, sys, time
t0 = time.perf_counter()
from symgrad.spec import load_spec
from symgrad.emit import module_text
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
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
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
        repo_wall, proc = _wall([py, "-m", "symgrad", "generate", str(ROOT / "symgrad.toml"),
                                 "--out", tmp])
        repo_ok = proc.returncode == 0
        repo_ops = len(list(Path(tmp).glob("*.py"))) - 1
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

    e = tf.einsum
    mm = tf.linalg.matmul
    return {
        "BenchMatMul": dict(
            module="bench_mat_mul", inputs=[((32, 256, 256), 1), ((32, 256, 256), 1)],
            refs={"einsum": lambda A, B: e("bik,bkj->bij", A, B),
                  "tf.linalg.matmul": lambda A, B: mm(A, B)}),
        "BenchKron": dict(
            module="bench_kron", inputs=[((32, 32, 32), 1), ((32, 16, 16), 1)],
            refs={"einsum": kron_einsum, "broadcast*": kron_broadcast}),
        "BenchExpMatMul": dict(
            module="bench_exp_mat_mul", inputs=[((32, 256, 64), 0.125), ((32, 64, 256), 0.125)],
            refs={"einsum": lambda A, B: tf.exp(e("bik,bkj->bij", A, B))}),
        "BenchAttention": dict(
            module="bench_attention", inputs=[((32, 256, 64), 0.125), ((32, 256, 64), 1)],
            refs={"tf.nn.softmax": lambda Q, K: tf.nn.softmax(e("bid,bjd->bij", Q, K)),
                  "exp/sum literal": attention_literal}),
        "BenchLogSumExp": dict(
            module="bench_log_sum_exp", inputs=[((32, 256, 1024), 1)],
            refs={"tf.reduce_logsumexp": lambda A: tf.reduce_logsumexp(A, axis=2),
                  "log(sum(exp)) literal":
                      lambda A: tf.math.log(tf.reduce_sum(tf.exp(A), axis=2))}),
        "BenchGram": dict(
            module="bench_gram", inputs=[((32, 256, 128), 1)],
            refs={"einsum": lambda A: e("bik,bjk->bij", A, A),
                  "tf.linalg.matmul": lambda A: mm(A, A, transpose_b=True)}),
        "BenchTanhMatMul": dict(
            module="bench_tanh_mat_mul", inputs=[((32, 256, 256), 1), ((32, 256, 128), 1)],
            refs={"einsum": lambda A, B: e("bik,bkj->bij", tf.tanh(A), B)}),
        "BenchChain3": dict(
            module="bench_chain3",
            inputs=[((32, 128, 64), 1), ((32, 64, 256), 1), ((32, 256, 32), 1)],
            refs={"einsum": lambda A, B, C: e("bij,bjk,bkl->bil", A, B, C),
                  "tf.linalg.matmul": lambda A, B, C: mm(mm(A, B), C)}),
        "BenchPairDist": dict(
            module="bench_pair_dist", inputs=[((32, 256, 32), 1)],
            refs={"expanded": pair_expanded, "broadcast literal": pair_broadcast}),
        "BenchLayerNorm": dict(
            module="bench_layer_norm", inputs=[((4096, 1024), 1)],
            refs={"reduce_mean": layer_norm, "tf.nn.moments": layer_norm_moments}),
    }, rn


def load_module(name: str):
    path = OUT / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"symgrad_bench.{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeOp:
    """What a registered gradient function sees of a real op."""

    def __init__(self, op_type, inputs, outputs, attrs=None):
        self.type = op_type
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self._attrs = attrs or {}

    def get_attr(self, name):
        return self._attrs[name]


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
    return {name: median(ts) for name, ts in times.items()}, reps


def peak_bytes(tf, f, args, repeats=3):
    """Peak TF CPU allocator bytes above the level before the call (min over repeats)."""
    best = None
    for _ in range(repeats):
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        out = f(*args)
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
        del out
        best = peak if best is None else min(best, peak)
    return best


def max_rel_err(tf, got, want):
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        scale = float(tf.reduce_max(tf.abs(w))) or 1.0
        worst = max(worst, float(tf.reduce_max(tf.abs(g - w))) / scale)
    return worst


def bench_op(tf, name, case, rn, budget_s, jit, tol):
    module = load_module(case["module"])
    assert module.OP_TYPE == name, (module.OP_TYPE, name)
    tf.random.set_seed(hash(name) % 2**31)
    xs = [rn(shape, scale) for shape, scale in case["inputs"]]
    n = len(xs)
    refs = case["refs"]
    primary = next(iter(refs))
    y0 = refs[primary](*xs)
    G = rn(y0.shape)

    def tape_step(fwd):
        def step(*args):
            inputs, g = args[:n], args[n]
            with tf.GradientTape() as tape:
                tape.watch(inputs)
                y = fwd(*inputs)
            return y, tape.gradient(y, inputs, output_gradients=g)
        return step

    def registered(ref):
        def run(*args):
            inputs, g = args[:n], args[n]
            y = ref(*inputs)
            return y, module.gradient(FakeOp(name, inputs, [y]), g)
        return run

    def grad_only(*args):
        inputs, y, g = args[:n], args[n], args[n + 1]
        return module.gradient(FakeOp(name, inputs, [y]), g)

    fn = lambda f, **kw: tf.function(f, autograph=False, **kw)  # noqa: E731
    fns = {"gen_grad": fn(grad_only), "gen_fwd": fn(module.forward),
           "gen_step": fn(tape_step(module.forward))}
    args = {"gen_grad": (*xs, y0, G), "gen_fwd": xs, "gen_step": (*xs, G)}
    for r, ref in refs.items():
        fns[f"tf_fwd:{r}"] = fn(ref)
        fns[f"tf_step:{r}"] = fn(tape_step(ref))
        fns[f"reg_step:{r}"] = fn(registered(ref))
        args[f"tf_fwd:{r}"], args[f"tf_step:{r}"], args[f"reg_step:{r}"] = xs, (*xs, G), (*xs, G)
    if jit:
        fns["gen_step_xla"] = fn(tape_step(module.forward), jit_compile=True)
        fns["tf_step_xla"] = fn(tape_step(refs[primary]), jit_compile=True)
        args["gen_step_xla"] = args["tf_step_xla"] = (*xs, G)

    # Correctness guard: never time wrong code.
    y_ref, g_ref = fns[f"tf_step:{primary}"](*xs, G)
    errors = {
        "forward": max_rel_err(tf, [fns["gen_fwd"](*xs)], [y_ref]),
        "gradient(op)": max_rel_err(tf, fns["gen_grad"](*xs, y_ref, G), g_ref),
        "forward+tape": max_rel_err(tf, fns["gen_step"](*xs, G)[1], g_ref),
    }
    for r in list(refs)[1:]:
        errors[f"ref {r}"] = max_rel_err(tf, fns[f"tf_step:{r}"](*xs, G)[1], g_ref)
    bad = {k: v for k, v in errors.items() if not v <= tol}
    if bad:
        return {"op": name, "error": f"gradients disagree with TF (max rel err {bad})",
                "max_rel_err": errors}

    med, reps = interleaved(fns, args, budget_s)
    ms = {k: v * 1e3 for k, v in med.items()}
    memory = {k: peak_bytes(tf, fns[k], args[k]) / 2**20
              for k in ["gen_step", f"tf_step:{primary}", "gen_grad"]}
    per_ref = {}
    for r in refs:
        tf_bwd = ms[f"tf_step:{r}"] - ms[f"tf_fwd:{r}"]
        per_ref[r] = {
            "tf_fwd_ms": ms[f"tf_fwd:{r}"],
            "tf_step_ms": ms[f"tf_step:{r}"],
            "tf_bwd_ms": tf_bwd,
            "grad_ratio": ms["gen_grad"] / tf_bwd if tf_bwd > 0 else float("inf"),
            "reg_step_ms": ms[f"reg_step:{r}"],
            "reg_step_ratio": ms[f"reg_step:{r}"] / ms[f"tf_step:{r}"],
            "step_ratio": ms["gen_step"] / ms[f"tf_step:{r}"],
        }
    result = {
        "op": name, "primary_ref": primary, "reps": reps, "max_rel_err": errors,
        "shapes": [list(s) for s, _ in case["inputs"]], "output_shape": list(y0.shape),
        "gen_grad_ms": ms["gen_grad"], "gen_fwd_ms": ms["gen_fwd"],
        "gen_step_ms": ms["gen_step"], "refs": per_ref,
        "peak_mib": {"gen_step": memory["gen_step"], "tf_step": memory[f"tf_step:{primary}"],
                     "gen_grad": memory["gen_grad"]},
    }
    if jit:
        result["xla"] = {"gen_step_ms": ms["gen_step_xla"], "tf_step_ms": ms["tf_step_xla"],
                         "step_ratio": ms["gen_step_xla"] / ms["tf_step_xla"]}
    return result


# ----------------------------------------------------------------------------- report

def table(results, gen) -> str:
    head = (f"{'op':<16} {'grad gen':>9} {'TF bwd':>8} {'ratio':>6} {'reg f+b':>6} "
            f"{'step gen':>9} {'TF step':>8} {'ratio':>6} {'peak gen':>9} {'peak TF':>8} "
            f"{'gen s':>6}  TF reference")
    lines = [head, "-" * len(head)]
    for r in results:
        g = gen["per_op_s"].get(r["op"], float("nan"))
        if "error" in r:
            lines.append(f"{r['op']:<16} FAILED: {r['error']}")
            continue
        p = r["refs"][r["primary_ref"]]
        lines.append(
            f"{r['op']:<16} {r['gen_grad_ms']:>9.2f} {p['tf_bwd_ms']:>8.2f} "
            f"{p['grad_ratio']:>6.2f} {p['reg_step_ratio']:>6.2f} {r['gen_step_ms']:>9.2f} "
            f"{p['tf_step_ms']:>8.2f} {p['step_ratio']:>6.2f} "
            f"{r['peak_mib']['gen_step']:>8.1f}M {r['peak_mib']['tf_step']:>7.1f}M "
            f"{g:>6.3f}  {r['primary_ref']}")
    lines.append("")
    lines.append("Other TF references (ratios = generated / this reference):")
    lines.append(f"  {'op':<16} {'reference':<22} {'TF bwd':>8} {'grad':>6} {'reg f+b':>7} "
                 f"{'TF step':>8} {'step':>6}")
    for r in results:
        if "error" in r:
            continue
        for name, p in r["refs"].items():
            if name == r["primary_ref"]:
                continue
            lines.append(f"  {r['op']:<16} {name:<22} {p['tf_bwd_ms']:>8.2f} "
                         f"{p['grad_ratio']:>6.2f} {p['reg_step_ratio']:>7.2f} "
                         f"{p['tf_step_ms']:>8.2f} {p['step_ratio']:>6.2f}")
    if any("xla" in r for r in results):
        lines.append("")
        lines.append("XLA (jit_compile=True) training step vs primary reference:")
        for r in results:
            if "xla" in r:
                x = r["xla"]
                lines.append(f"  {r['op']:<16} gen {x['gen_step_ms']:8.2f} ms  "
                             f"TF {x['tf_step_ms']:8.2f} ms  ratio {x['step_ratio']:.2f}")
    return "\n".join(lines)


def summary(results, gen) -> dict:
    ok = [r for r in results if "error" not in r]
    prim = [r["refs"][r["primary_ref"]] for r in ok]
    best_grad = [r["gen_grad_ms"] / max(min(p["tf_bwd_ms"] for p in r["refs"].values()), 1e-9)
                 for r in ok]
    best_step = [r["gen_step_ms"] / min(p["tf_step_ms"] for p in r["refs"].values())
                 for r in ok]
    s = {
        "geomean_grad_ratio": geomean([p["grad_ratio"] for p in prim]),
        "max_grad_ratio": max((p["grad_ratio"] for p in prim), default=float("nan")),
        "geomean_reg_step_ratio": geomean([p["reg_step_ratio"] for p in prim]),
        "geomean_step_ratio": geomean([p["step_ratio"] for p in prim]),
        "max_step_ratio": max((p["step_ratio"] for p in prim), default=float("nan")),
        "geomean_grad_ratio_vs_fastest_tf": geomean(best_grad),
        "geomean_step_ratio_vs_fastest_tf": geomean(best_step),
        "ops_with_peak_memory_above_tf": [r["op"] for r in ok
                                          if r["peak_mib"]["gen_step"]
                                          > r["peak_mib"]["tf_step"] * 1.001],
        "failed": [r["op"] for r in results if "error" in r],
    }
    if any("xla" in r for r in ok):
        s["geomean_xla_step_ratio"] = geomean([r["xla"]["step_ratio"] for r in ok if "xla" in r])
    return s


def summary_text(s, gen) -> str:
    return "\n".join([
        f"geomean ratio, registered gradient vs TF backward: {s['geomean_grad_ratio']:.3f}"
        f" (max {s['max_grad_ratio']:.2f}); vs fastest TF reference per op: "
        f"{s['geomean_grad_ratio_vs_fastest_tf']:.3f}",
        f"geomean ratio, TF fwd + registered gradient vs TF fwd + tape (no subtraction): "
        f"{s['geomean_reg_step_ratio']:.3f}",
        f"geomean ratio, training step (forward+backward): {s['geomean_step_ratio']:.3f}"
        f" (max {s['max_step_ratio']:.2f}); vs fastest TF reference per op: "
        f"{s['geomean_step_ratio_vs_fastest_tf']:.3f}",
        *([f"geomean ratio, XLA training step: {s['geomean_xla_step_ratio']:.3f}"]
          if "geomean_xla_step_ratio" in s else []),
        f"peak memory above TF: {', '.join(s['ops_with_peak_memory_above_tf']) or 'none'}",
        f"generation: mean {gen['mean_per_op_s'] * 1e3:.0f} ms/op in-process (symgrad import "
        f"{gen['import_s']:.2f} s, TensorFlow imported: {gen['tensorflow_imported']}); CLI wall "
        f"{gen['bench_spec_cli_wall_s']:.2f} s for bench.toml ({len(gen['per_op_s'])} ops), "
        f"{gen['repo_spec_cli_wall_s']:.2f} s for the repo's symgrad.toml "
        f"({gen['repo_spec_ops']} ops{'' if gen['repo_spec_ok'] else ', FAILED'})",
        *([f"FAILED correctness guard: {', '.join(s['failed'])}"] if s["failed"] else []),
    ])


def chart(results, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "error" not in r]
    names = [r["op"].removeprefix("Bench") for r in ok]
    series = {
        "registered gradient / TF backward": [r["refs"][r["primary_ref"]]["grad_ratio"]
                                              for r in ok],
        "training step / TF step": [r["refs"][r["primary_ref"]]["step_ratio"] for r in ok],
        "peak memory / TF": [r["peak_mib"]["gen_step"] / max(r["peak_mib"]["tf_step"], 1e-9)
                             for r in ok],
    }
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(series)
    for n, (label, values) in enumerate(series.items()):
        xs = [i + (n - (len(series) - 1) / 2) * width for i in range(len(ok))]
        ax.bar(xs, values, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(ok)), names, rotation=20)
    ax.set_ylabel("generated / TensorFlow (lower is better)")
    ax.set_title("symgrad generated gradients vs TensorFlow (float32, CPU, medians)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=12.0,
                        help="seconds of timed runs per op (default 12)")
    parser.add_argument("--ops", help="comma-separated op names (default: all)")
    parser.add_argument("--jit", action="store_true", help="also time XLA training steps")
    parser.add_argument("--tol", type=float, default=2e-4,
                        help="max |gen - TF| / max|TF| per gradient (default 2e-4)")
    parser.add_argument("--out", default=str(HERE), help="folder for results.json/png")
    args = parser.parse_args()

    gen = generation()  # before TensorFlow is imported here
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    table_cases, rn = cases(tf)
    wanted = args.ops.split(",") if args.ops else list(table_cases)
    results = []
    for name in wanted:
        print(f"... {name}", file=sys.stderr, flush=True)
        results.append(bench_op(tf, name, table_cases[name], rn, args.budget, args.jit,
                                args.tol))
    s = summary(results, gen)
    text = table(results, gen) + "\n\n" + summary_text(s, gen)
    method = ("times: medians of interleaved tf.function calls; TF backward = median(tape fwd+bwd)"
              " - median(fwd) of the TF reference; 'reg f+b' = (TF fwd + gradient(op)) / (TF "
              "fwd + tape bwd) in one tf.function each; peak = TF CPU allocator peak above "
              "baseline during one training step (get_memory_info('CPU:0')), MiB")
    print(text)
    print(method)
    out = Path(args.out)
    payload = {
        "machine": {"python": platform.python_version(), "tensorflow": tf.__version__,
                    "cpus": os.cpu_count(), "platform": platform.platform()},
        "method": method, "generation": gen, "summary": s, "results": results,
        "table": text,
    }
    (out / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    chart(results, out / "results.png")
    print(f"wrote {out / 'results.json'} and {out / 'results.png'}")
    return 1 if s["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
