"""The frameworks symgrad writes modules for: each is a printer plus a template.

Everything before rendering (parse, model, derive, lower) is shared and knows no
framework: lowering produces `ir.Module`s whose calls name neutral ops (`ir.OPS`). A
target's printer turns those into its framework's code, and its template (in `templates/`)
is the module around that code.
"""

from __future__ import annotations

from dataclasses import dataclass

from .jax import JaxPrinter
from .printer import Printer
from .pytorch import PyTorchPrinter
from .tensorflow import TensorFlowPrinter


@dataclass(frozen=True)
class Target:
    name: str  # as written in the spec's [targets] table and after --target
    template: str  # file name in templates/
    printer: type[Printer]
    default_out: str  # the output folder when the spec names none


TARGETS: dict[str, Target] = {
    "tensorflow": Target("tensorflow", "module.py.j2", TensorFlowPrinter, "generated"),
    "pytorch": Target("pytorch", "pytorch.py.j2", PyTorchPrinter, "generated_torch"),
    "jax": Target("jax", "jax.py.j2", JaxPrinter, "generated_jax"),
}

__all__ = ["TARGETS", "Printer", "Target"]
