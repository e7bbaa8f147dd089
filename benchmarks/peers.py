"""Pairwise reductions side by side with KeOps: time and memory of forward + gradient.

    .venv/bin/pip install -e '.[bench]'       # pykeops; it compiles with g++ on first use
    .venv/bin/python benchmarks/peers.py [--points 1000,5000,20000] [--targets ...]
        [--threads 1] [--keops-python /path/to/a/venv/with/pykeops/bin/python]

KeOps (`pykeops.torch.LazyTensor`: a compiled, tiled map-reduce with symbolic autodiff)
computes the same two ops as `memory.toml`'s MemChamfer and MemRbfSum (float32, CPU, N
points against 0.8 N, 3 coordinates, batch 1). Each measurement is a fresh process (see
`memory.py` for how peak memory is read per framework; KeOps is read like PyTorch, by
torch.profiler's allocation events: the torch tensors KeOps allocates, as its compiled
reduction holds no N x M buffer). KeOps has no gradient through a `min` reduction, so its
Chamfer is the usual KeOps idiom: `argmin` (no gradient), then a gather of the nearest
point and its distance through torch (a tie goes to one point, not split). Time: the median of 5 steps after a warm-up that
includes KeOps' compilation. Writes `peers.json` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from memory import HERE, REPO, THREADS, measure, thread_env

KEOPS = r"""
import json, statistics, time
import numpy as np
import torch
from pykeops.torch import LazyTensor
import os
torch.set_num_threads(int(os.environ["SYMGRAD_BENCH_THREADS"]))
op, n = {op!r}, {n!r}
rng = np.random.default_rng(0)
x = torch.from_numpy(rng.standard_normal((n, 3)).astype(np.float32)).requires_grad_()
z = torch.from_numpy(rng.standard_normal((int(0.8 * n), 3)).astype(np.float32)).requires_grad_()

def step():
    d = ((LazyTensor(x[:, None, :]) - LazyTensor(z[None, :, :])) ** 2).sum(-1)
    if op == "MemChamfer":  # KeOps has no gradient of a min: the argmin, then a gather
        j = d.argmin(1).view(-1).long()
        y = ((x - z[j]) ** 2).sum(-1)
    else:
        y = (-d).exp().sum(1)
    return torch.autograd.grad((y * y).sum(), (x, z))

step()
with torch.profiler.profile(
    activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
) as profile:
    step()
events = [e for e in profile.profiler.kineto_results.events() if e.name() == "[memory]"]
total = peak = 0
for event in sorted(events, key=lambda e: e.start_ns()):
    total += event.nbytes()
    peak = max(peak, total)
times = []
for _ in range(6):
    t = time.perf_counter(); step(); times.append(time.perf_counter() - t)
print(json.dumps({{"peak": peak, "time": statistics.median(times[1:])}}))
"""

MODULES = {"MemChamfer": "mem_chamfer", "MemRbfSum": "mem_rbf_sum"}


def keops(op: str, n: int, python: str) -> dict:
    run = subprocess.run(
        [python, "-c", KEOPS.format(op=op, n=n)],
        capture_output=True,
        text=True,
        env={**os.environ, **thread_env(THREADS["threads"])},
        check=False,
    )
    if run.returncode != 0:
        return {"error": (run.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", default="1000,5000,20000")
    parser.add_argument("--targets", default="tensorflow,pytorch,jax")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--keops-python", default=sys.executable, help="a Python with pykeops (its own venv)"
    )
    options = parser.parse_args()
    THREADS["threads"] = options.threads
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for target in options.targets.split(","):
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
                    str(Path(tmp) / f"new_{target}"),
                ],
                check=True,
                capture_output=True,
                cwd=REPO,
            )
        for op, name in MODULES.items():
            for n in (int(p) for p in options.points.split(",")):
                row = {"keops": keops(op, n, options.keops_python)}
                shapes = {"x": (1, n, 3), "z": (1, int(0.8 * n), 3)}
                for target in options.targets.split(","):
                    row[target] = measure(
                        Path(tmp) / f"new_{target}", target, op, (name, shapes, {})
                    )
                results[f"{op}@{n}"] = row
                print(
                    f"{op:11} {n:>6} "
                    + "  ".join(
                        f"{k}: "
                        + (
                            r["error"][:60]
                            if "error" in r
                            else f"{r['time'] * 1e3:8.1f} ms {r['peak'] / 2**20:8.1f} MiB"
                        )
                        for k, r in row.items()
                    ),
                    flush=True,
                )
    (HERE / "peers.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
