"""``python -m benchmarks.memory_budget`` at a tiny size: every variant's
gradients agree with jax.grad's (the benchmark checks them) and the table has
one row per variant."""

import jax
import pytest

from benchmarks import memory_budget
from rumus_fx.lift.budget import MemoryPlan


@pytest.mark.slow  # eight programs compiled: about a minute on 2 shared cores
def test_memory_budget_benchmark_runs_tiny():
    with jax.numpy_rank_promotion("allow"):  # the models' plain-JAX losses broadcast biases
        rows = memory_budget.measure(blocks=2, d=16, seq=8, batch=2, heads=2, repeats=1)
    labels = [r["label"] for r in rows]
    assert labels[0] == "jax.grad" and any("checkpoint per block" in x for x in labels)
    assert sum("budget" in x for x in labels) == 5
    table = memory_budget.format_table(rows)
    assert len(table.splitlines()) == 2 + len(rows)
    budgeted = [r for r in rows if r["plan"] is not None]
    assert all(r["plan"].planned_bytes <= r["plan"].base_bytes for r in budgeted)


def test_table_marks_an_unmet_budget():
    plan = MemoryPlan(100, 25, 40, [(0, 3)], 10.0, 50.0, False, 9)
    rows = [
        {"label": "jax.grad", "temp": 2**20, "step_ms": 2.0, "plan": None},
        {"label": "rf, budget 25%", "temp": 2**19, "step_ms": 3.0, "plan": plan},
    ]
    table = memory_budget.format_table(rows)
    assert "| 0.50 |" in table and "| 1.50 |" in table
    assert "(budget not met)" in table
