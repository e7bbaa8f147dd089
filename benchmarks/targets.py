"""Generated gradients for PyTorch and JAX against each framework's own autodiff.

Run:  .venv/bin/python benchmarks/targets.py --target pytorch|jax [--budget S] [--ops A,B]

The ops and inputs are those of benchmarks/run.py (benchmarks/bench.toml, float32). For
each op, the module is generated for the target, and the baseline is the framework's own
autodiff through the same forward ops (the module's `_compute`), so the comparison is the
generated backward against the backward the framework would derive itself:

- step: forward + backward with an upstream gradient G, through `forward` (the generated
  backward: torch.autograd.Function, jax.custom_vjp) vs through `_compute` (autodiff);
- bwd: step minus the forward alone, for both (the same subtraction on both sides);
- PyTorch runs eagerly on the CPU (torch's threads as configured); JAX runs under jax.jit.

Medians of interleaved rounds; prints a table, writes results_<target>.json and a chart.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from run import cases, geomean, interleaved

from symgrad.pipeline import module_text
from symgrad.spec import load_spec, snake_case


def arrays(case, rng) -> list[np.ndarray]:
    found = []
    for spec in case["inputs"]:
        if spec[0] == "int":
            _, shape, high = spec
            found.append(rng.integers(0, high, shape).astype(np.int32))
        else:
            shape, scale = spec
            found.append((rng.standard_normal(shape) * scale).astype(np.float32))
    return found


def load(text: str, folder: Path, name: str):
    import importlib.util

    path = folder / f"{name}.py"
    path.write_text(text, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(f"symgrad_targets_bench.{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def torch_callables(module, xs, attrs):
    import torch

    inputs = [torch.from_numpy(x) for x in xs]
    floats = [k for k, x in enumerate(xs) if x.dtype.kind == "f"]

    def step(f):
        def run(*args):
            args = [a.detach().requires_grad_(k in floats) for k, a in enumerate(args)]
            y = f(*args)
            y = y[0] if isinstance(y, tuple) else y
            grads = torch.autograd.grad(y, [args[k] for k in floats], G)
            return y, grads

        return run

    def fwd(f):
        def run(*args):
            with torch.no_grad():
                return f(*args)

        return run

    def generated(*args):
        return module.forward(*args, **attrs)

    def autodiff(*args):
        return module._compute(*args, **attrs)[0][0]

    y = autodiff(*inputs)
    G = torch.from_numpy(
        np.random.default_rng(1).standard_normal(tuple(y.shape)).astype(np.float32)
    )
    fns = {
        "step@gen": step(generated),
        "step@auto": step(autodiff),
        "fwd@gen": fwd(generated),
        "fwd@auto": fwd(autodiff),
    }
    check = (step(generated)(*inputs)[1], step(autodiff)(*inputs)[1])
    error = max(
        float((a - b).abs().max() / (b.abs().max() + 1e-30)) for a, b in zip(*check, strict=True)
    )
    return fns, {name: inputs for name in fns}, error


def jax_callables(module, xs, attrs):
    import jax
    import jax.numpy as jnp

    inputs = [jnp.asarray(x) for x in xs]
    floats = tuple(k for k, x in enumerate(xs) if x.dtype.kind == "f")

    def generated(*args):
        return module.forward(*args, **attrs)

    def autodiff(*args):
        return module._compute(*args, **attrs)[0][0]

    y = autodiff(*inputs)
    G = jnp.asarray(np.random.default_rng(1).standard_normal(y.shape).astype(np.float32))

    def step(f):
        @jax.jit
        def run(*args):
            def of_floats(*fl):
                full = list(args)
                for k, v in zip(floats, fl, strict=True):
                    full[k] = v
                return f(*full)

            y, pullback = jax.vjp(of_floats, *(args[k] for k in floats))
            return y, pullback(G)

        return lambda *a: jax.block_until_ready(run(*a))

    def fwd(f):
        run = jax.jit(f)
        return lambda *a: jax.block_until_ready(run(*a))

    fns = {
        "step@gen": step(generated),
        "step@auto": step(autodiff),
        "fwd@gen": fwd(generated),
        "fwd@auto": fwd(autodiff),
    }
    check = (fns["step@gen"](*inputs)[1], fns["step@auto"](*inputs)[1])
    error = max(
        float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
        for a, b in zip(*check, strict=True)
    )
    return fns, {name: inputs for name in fns}, error


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=("pytorch", "jax"), required=True)
    parser.add_argument("--budget", type=float, default=3.0, help="seconds per op")
    parser.add_argument("--ops", help="comma-separated op names (default: all)")
    parser.add_argument("--out", default=str(HERE), help="folder for results_<target>.json")
    args = parser.parse_args()
    import tensorflow as tf  # only for the shared case table (inputs and attrs)

    table, _ = cases(tf)
    spec = load_spec(HERE / "bench.toml")
    by_module = {snake_case(op.name): op for op in spec.ops}
    chosen = args.ops.split(",") if args.ops else list(table)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for n, name in enumerate(chosen):
            case = table[name]
            op = by_module[case["module"]]
            text = module_text(op, "bench.toml", args.target)
            module = load(text, Path(folder), f"{case['module']}_{args.target}")
            xs = arrays(case, np.random.default_rng(n))
            attrs = case.get("attrs", {})
            build = torch_callables if args.target == "pytorch" else jax_callables
            fns, fargs, error = build(module, xs, attrs)
            ms, _, reps = interleaved(fns, fargs, args.budget)
            ms = {k: v * 1e3 for k, v in ms.items()}
            row = {
                "op": name,
                "reps": reps,
                "max_rel_err_vs_autodiff": error,
                "step_gen_ms": ms["step@gen"],
                "step_auto_ms": ms["step@auto"],
                "bwd_gen_ms": ms["step@gen"] - ms["fwd@gen"],
                "bwd_auto_ms": ms["step@auto"] - ms["fwd@auto"],
            }
            row["step_ratio"] = row["step_gen_ms"] / row["step_auto_ms"]
            row["bwd_ratio"] = (
                row["bwd_gen_ms"] / row["bwd_auto_ms"] if row["bwd_auto_ms"] > 0 else None
            )
            rows.append(row)
            print(
                f"{name:<18} bwd {row['bwd_gen_ms']:8.2f} {row['bwd_auto_ms']:8.2f} "
                f"{row['bwd_ratio'] or float('nan'):5.2f}   step {row['step_gen_ms']:8.2f} "
                f"{row['step_auto_ms']:8.2f} {row['step_ratio']:5.2f}   err {error:.1e}",
                flush=True,
            )
    summary = {
        "geomean_bwd_ratio": geomean([r["bwd_ratio"] for r in rows if r["bwd_ratio"]]),
        "max_bwd_ratio": max((r["bwd_ratio"] or 0) for r in rows),
        "geomean_step_ratio": geomean([r["step_ratio"] for r in rows]),
        "max_step_ratio": max(r["step_ratio"] for r in rows),
    }
    print(
        f"geomean ratio, backward: {summary['geomean_bwd_ratio']:.3f} "
        f"(max {summary['max_bwd_ratio']:.2f}); step: {summary['geomean_step_ratio']:.3f} "
        f"(max {summary['max_step_ratio']:.2f})"
    )
    out = Path(args.out)
    payload = {
        "target": args.target,
        "machine": platform.platform(),
        "baseline": "the framework's own autodiff through the module's _compute",
        "summary": summary,
        "results": rows,
    }
    (out / f"results_{args.target}.json").write_text(json.dumps(payload, indent=2) + "\n")
    _chart(rows, out / f"results_{args.target}.png", args.target)
    return 0


def _chart(rows, path: Path, target: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the bench extra installs it
        return
    names = [r["op"].removeprefix("Bench") for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(x - 0.2, [r["step_ratio"] for r in rows], 0.4, label="training step")
    ax.bar(x + 0.2, [r["bwd_ratio"] or 0 for r in rows], 0.4, label="backward")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x, names, rotation=45, ha="right")
    ax.set_ylabel("generated / autodiff (lower is faster)")
    ax.set_title(f"symgrad {target}: generated backward vs {target}'s autodiff, float32 CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
