"""Activation memory to a budget: the GPT at budgets of 100/50/25 % of its saved bytes.

Usage: ``python -m benchmarks.memory_budget [--blocks N] [--d D] [--seq T] [--batch B] [--repeats N]``

The TinyGPT of ``benchmarks/models.py`` is differentiated, in one process, as

- ``jax.grad`` of the plain-JAX loss, and the same with ``jax.checkpoint``
  placed by hand around each transformer block;
- ``rf.grad`` of the loss written with rf ops (no budget);
- ``rf.grad(rf.lift(loss_jax), memory_budget=b)`` for b = 1.0, 0.5, 0.25: the
  plain-JAX loss on the tape, with rf choosing what to recompute;
- ``rf.grad(loss_rf, memory_budget=b)`` for b = 0.5, 0.25.

For each: the compiled program's temporary memory
(``compiled.memory_analysis().temp_size_in_bytes``), the jit step (median of
interleaved calls) and the plan's estimate of the saved activations against
the unbudgeted ones. Ratios are against ``jax.grad`` without checkpoint. Every
variant's gradients are first checked against ``jax.grad``'s.
"""

from __future__ import annotations

import argparse
import platform
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import rumus_fx as rf
from rumus_fx.lift.budget import MemoryBudgetWarning, memory_plan

from .compare import _interleaved
from .models import Model, gpt_loss_jax, tiny_gpt

BUDGETS = (1.0, 0.5, 0.25)


def variants(model: Model, heads: int) -> list[tuple[str, Callable, float | None, Callable]]:
    """(label, grad function, budget, loss the plan is made for)."""
    plain = gpt_loss_jax(heads)
    lifted = rf.lift(plain)
    rows: list[tuple[str, Callable, float | None, Callable]] = [
        ("jax.grad", jax.grad(plain), None, plain),
        ("jax.grad, jax.checkpoint per block", jax.grad(gpt_loss_jax(heads, remat=True)), None, plain),
        ("rf.grad(loss_rf)", rf.grad(model.loss_rf), None, model.loss_rf),
    ]
    for b in BUDGETS:
        rows.append((f"rf.grad(rf.lift(loss_jax)), budget {b:.0%}", rf.grad(lifted, memory_budget=b), b, lifted))
    for b in BUDGETS[1:]:
        rows.append((f"rf.grad(loss_rf), budget {b:.0%}", rf.grad(model.loss_rf, memory_budget=b), b, model.loss_rf))
    return rows


def measure(
    blocks: int = 4, d: int = 128, seq: int = 64, batch: int = 16, heads: int = 4, repeats: int = 10
) -> list[dict[str, Any]]:
    model = tiny_gpt(batch=batch, seq=seq, d=d, heads=heads, blocks=blocks)
    args = (model.params, model.batch)
    expected = jax.grad(model.loss_jax)(*args)
    rows = []
    steps = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemoryBudgetWarning)  # an unmet budget is a column of the table
        for label, g, budget, loss in variants(model, heads):
            f = jax.jit(g)
            compiled = f.lower(*args).compile()
            got = f(*args)
            for u, v in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected), strict=True):
                scale = float(jnp.max(jnp.abs(v))) or 1.0
                if float(jnp.max(jnp.abs(u - v))) > 1e-3 * scale + 2e-5:
                    raise AssertionError(f"{label}: gradients differ from jax.grad's")
            plan = memory_plan(loss, budget)(*args) if budget is not None else None
            rows.append(
                {
                    "label": label,
                    "temp": compiled.memory_analysis().temp_size_in_bytes,
                    "plan": plan,
                }
            )
            steps.append(lambda f=f: f(*args))
    times = _interleaved(steps, repeats, warmup=1)
    for r, t in zip(rows, times):
        r["step_ms"] = t * 1e3
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    ref = rows[0]
    lines = [
        "| variant | temp memory | temp / jax.grad | jit step ms | step / jax.grad | planned / unbudgeted saved bytes |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        plan = r["plan"]
        if plan is None:
            planned = "-"
        else:
            planned = f"{plan.planned_bytes / 2**10:.0f} / {plan.base_bytes / 2**10:.0f} KiB"
            planned += "" if plan.met else " (budget not met)"
        lines.append(
            f"| {r['label']} | {r['temp'] / 2**20:.2f} MiB | {r['temp'] / max(ref['temp'], 1):.2f} | "
            f"{r['step_ms']:.2f} | {r['step_ms'] / ref['step_ms']:.2f} | {planned} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=10)
    a = parser.parse_args(argv)
    rows = measure(a.blocks, a.d, a.seq, a.batch, a.heads, a.repeats)
    print(
        f"TinyGPT d{a.d} h{a.heads} L{a.blocks} T{a.seq} b{a.batch}; jax {jax.__version__}, "
        f"numpy {np.__version__}, {platform.machine()}, {jax.devices()[0].platform}"
    )
    print(format_table(rows))
    return rows


if __name__ == "__main__":  # pragma: no cover
    main()
