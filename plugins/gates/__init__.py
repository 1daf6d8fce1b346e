"""Benefit gates: an optimisation's structural upper bound, set against what it competes with, before anyone builds it.

A kestrel plugin package (entry point ``gates = "plugins.gates"``). It adds the ``kestrel gate``
command through ``register_commands`` and the built-in gates (kv-paging, l3-residency, window)
through ``register_gates``; a third-party gate subclasses ``plugins.gates.Gate`` and registers
the same way.

- ``figures``: units, verdicts, the kinds of figure, how a figure is written
- ``framework``: the Gate contract, quantities, flip axes, the threshold rule, ``run_gate``
- ``context``: what a gate sees (options, the model's config.json, memory, measured runs)
- ``shapes``: parameter counts from a ModelConfig
- ``memsampler``: peak memory while a workload runs, sampled and exact
- ``kv_mirror``, ``window``: the built-in gates
- ``render``: text and markdown output
- ``command``: ``kestrel gate``
"""

from __future__ import annotations

# plugins/ is also the package plugins, so this folder could load a second time as plugins.gates,
# with classes of its own that are not plugins.gates' (a gate subclassing one would not be a plugins.gates.Gate).
if __name__ != "plugins.gates":
    raise ImportError(f"the gates package is plugins.gates: import it under that name, not as {__name__}")

from kestrel_core.hookspecs import hookimpl  # noqa: E402

from .context import GateContext, GateOptions, Workload
from .figures import (ASSUMED, BUILD, COMPUTED, DONT_BUILD, GIVEN, MEASURED, REMEASURE, VERDICTS, WEIGHT_BYTES, GiB,
                      MiB, fmt_mib, fmt_ratio)
from .framework import (CARD_GB, MAX_SEQ, SLOTS, STANDARD_AXES, WEIGHT_DTYPE, Axis, Evaluation, Gate, GateResult,
                        Needs, Quantity, make_gate, run_gate, ten_percent_rule)
from .kv_mirror import KvPagingGate, L3ResidencyGate
from .render import render
from .window import WindowGate

__all__ = [
    "ASSUMED", "BUILD", "CARD_GB", "COMPUTED", "DONT_BUILD", "GIVEN", "MAX_SEQ", "MEASURED", "REMEASURE", "SLOTS",
    "STANDARD_AXES", "VERDICTS", "WEIGHT_BYTES", "WEIGHT_DTYPE", "Axis", "Evaluation", "Gate", "GateContext",
    "GateOptions", "GateResult", "GiB", "KvPagingGate", "L3ResidencyGate", "MiB", "Needs", "Quantity", "WindowGate",
    "Workload", "fmt_mib", "fmt_ratio", "make_gate", "render", "run_gate", "ten_percent_rule",
]


@hookimpl
def register_gates(register):
    register("kv-paging", KvPagingGate)
    register("l3-residency", L3ResidencyGate)
    register("window", WindowGate)


@hookimpl
def register_commands(register):
    from . import command

    register("gate", command)
