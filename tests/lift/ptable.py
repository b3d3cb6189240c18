"""The primitive table: jax.numpy / lax programs that exercise each primitive
rule of ``rf.lift`` (PyTorch OpInfo / jax LAX_GRAD_OPS style), derived from the
registry.

Each entry is declared with its rule, ``defrule(..., table=(TableEntry(...),))``
in ``rumus_fx/lift/rules_<family>.py`` (Note [Declaring an op] in
``rumus_fx/autograd/registry.py``): a plain jax function of arrays (the oracle is
``jax.grad`` of that same function: rf only ever sees it through ``rf.lift``), a
sample generator (``Sample``: arguments and differentiable positions), the
primitives it must emit (default: the rule's own), tolerances and which checks
apply. Adding a rule = one declaration with its entry (the coverage test of
``test_ptable.py`` fails otherwise).
"""

from __future__ import annotations

import dataclasses

from rumus_fx.autograd.registry import Sample, TableEntry, declarations

__all__ = ["ENTRIES", "Sample", "TableEntry", "entries"]


def entries() -> list[TableEntry]:
    """Every declared entry, its ``prims`` filled in (the rule's own by default)."""
    out = []
    for d in declarations("primitive"):
        for e in d.extra.get("table", ()):
            out.append(dataclasses.replace(e, prims=e.prims or (d.name,)))
    return out


ENTRIES: list[TableEntry] = entries()
