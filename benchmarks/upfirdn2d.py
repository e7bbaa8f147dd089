"""StyleGAN2's upfirdn2d: a float32 training step of the generated module (polyphase), of
the module generated without the polyphase rewrite, and of `upfirdn2d_native` (PyTorch:
F.pad and conv2d, rosinality/stylegan2-pytorch op/upfirdn2d.py), time and peak memory read
as `memory.py` reads them (each in a fresh process, one compute thread).

    .venv/bin/python benchmarks/upfirdn2d.py [--targets tensorflow,pytorch,jax]

Sizes: x 4x64x32x32 and 4x64x64x64, a 4x4 filter, up 2 (StyleGAN2's Upsample layer).
Prints a table; writes `upfirdn2d.json` beside this file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import memory

HERE = Path(__file__).resolve().parent
SIZES = {"32": (4, 64, 32, 32), "64": (4, 64, 64, 64)}

NATIVE = '''
import torch
import torch.nn.functional as F

INPUTS = ("x", "f")


def forward(x, f, up_x, up_y, down_x, down_y, pad_x0, pad_x1, pad_y0, pad_y1):
    """rosinality/stylegan2-pytorch op/upfirdn2d.py `upfirdn2d_native`, verbatim."""
    input, kernel = x, f
    _, channel, in_h, in_w = input.shape
    input = input.reshape(-1, in_h, in_w, 1)
    _, in_h, in_w, minor = input.shape
    kernel_h, kernel_w = kernel.shape
    out = input.view(-1, in_h, 1, in_w, 1, minor)
    out = F.pad(out, [0, 0, 0, up_x - 1, 0, 0, 0, up_y - 1])
    out = out.view(-1, in_h * up_y, in_w * up_x, minor)
    out = F.pad(out, [0, 0, max(pad_x0, 0), max(pad_x1, 0), max(pad_y0, 0), max(pad_y1, 0)])
    out = out[
        :,
        max(-pad_y0, 0) : out.shape[1] - max(-pad_y1, 0),
        max(-pad_x0, 0) : out.shape[2] - max(-pad_x1, 0),
        :,
    ]
    out = out.permute(0, 3, 1, 2)
    out = out.reshape([-1, 1, in_h * up_y + pad_y0 + pad_y1, in_w * up_x + pad_x0 + pad_x1])
    w = torch.flip(kernel, [0, 1]).view(1, 1, kernel_h, kernel_w)
    out = F.conv2d(out, w)
    out = out.reshape(
        -1,
        minor,
        in_h * up_y + pad_y0 + pad_y1 - kernel_h + 1,
        in_w * up_x + pad_x0 + pad_x1 - kernel_w + 1,
    )
    out = out.permute(0, 2, 3, 1)
    out = out[:, ::down_y, ::down_x, :]
    out_h = (in_h * up_y + pad_y0 + pad_y1 - kernel_h + down_y) // down_y
    out_w = (in_w * up_x + pad_x0 + pad_x1 - kernel_w + down_x) // down_x
    return out.view(-1, channel, out_h, out_w)
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="tensorflow,pytorch,jax")
    options = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        native = Path(tmp) / "native"
        native.mkdir()
        (native / "native_upfirdn2d.py").write_text(NATIVE, encoding="utf-8")
        for target in options.targets.split(","):
            new = Path(tmp) / f"new_{target}"
            subprocess.run(
                [sys.executable, "-m", "symgrad", "generate", str(HERE / "memory.toml")]
                + ["--target", target, "--out", str(new)],
                check=True,
                capture_output=True,
                cwd=memory.REPO,
            )
            for size, shape in SIZES.items():
                shapes = {"x": shape, "f": (4, 4)}
                case = ("mem_upfirdn2d", shapes, memory.UPSAMPLE_2X)
                row = {
                    "baseline": memory.measure(HERE / "baseline" / target, target, "", case),
                    "polyphase": memory.measure(new, target, "", case),
                }
                if target == "pytorch":
                    native_case = ("native_upfirdn2d", shapes, memory.UPSAMPLE_2X)
                    row["native"] = memory.measure(native, target, "", native_case)
                results.setdefault(size, {})[target] = row
                print(_row(size, target, row), flush=True)
    (HERE / "upfirdn2d.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


def _row(size: str, target: str, row: dict) -> str:
    mib = 2**20
    cells = []
    for name, r in row.items():
        if "error" in r:
            cells.append(f"{name} failed ({r['error']})")
        else:
            cells.append(f"{name} {r['time'] * 1e3:8.1f} ms {r['peak'] / mib:8.1f} MiB")
    io = next((r["io"] for r in row.values() if "io" in r), 0)
    return f"{size:>3} {target:10} io {io / mib:6.1f} MiB  " + "  ".join(cells)


if __name__ == "__main__":
    main()
