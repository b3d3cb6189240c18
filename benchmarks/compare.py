"""rumus_fx vs jax.grad on the benchmark models, measured interleaved in one process.

Usage: ``python -m benchmarks.models [--models mlp,cnn,gpt] [--repeats N]``

For each model it first asserts that both implementations give the same loss and
gradients, then reports ratios rf / jax.grad (below 1.00 means rumus_fx is
faster or smaller): the jit-compiled step (median of interleaved runs), trace +
compile time, the eager (un-jitted) step, and the compiled program's temporary
memory (``compiled.memory_analysis()``). With torch installed, a PyTorch eager
forward+backward step is shown as an extra column (ratio rf eager / torch).
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import rumus_fx as rf

from .models import MODELS, Model


def check_same(model: Model, rtol: float = 2e-4, atol: float = 2e-5) -> tuple[float, float]:
    """Assert rf and jax.grad agree on loss and gradients; returns the losses."""
    v_rf, g_rf = jax.jit(rf.value_and_grad(model.loss_rf))(model.params, model.batch)
    v_j, g_j = jax.jit(jax.value_and_grad(model.loss_jax))(model.params, model.batch)
    np.testing.assert_allclose(v_rf, v_j, rtol=rtol, atol=atol)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=atol), g_rf, g_j)
    return float(v_rf), float(v_j)


def _block(x: Any) -> Any:
    return jax.block_until_ready(x)


def _interleaved(fns: list[Callable[[], Any]], repeats: int, warmup: int = 2) -> list[float]:
    """Median seconds of each fn, running them alternately so drift hits both."""
    for f in fns:
        for _ in range(warmup):
            _block(f())
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            _block(f())
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def _compile_time(fun: Callable, args: tuple) -> tuple[float, Any]:
    # a fresh function object each time so no jit cache is reused
    wrapped = jax.jit(lambda *a: fun(*a))
    t0 = time.perf_counter()
    compiled = wrapped.lower(*args).compile()
    return time.perf_counter() - t0, compiled


def measure(model: Model, repeats: int = 30, eager_repeats: int = 5) -> dict[str, Any]:
    args = (model.params, model.batch)
    vg_rf = rf.value_and_grad(model.loss_rf)
    vg_j = jax.value_and_grad(model.loss_jax)

    # trace + compile (interleaved, median of 3) and compiled temp memory
    ct_rf, ct_j = [], []
    for _ in range(3):
        t, comp_rf = _compile_time(vg_rf, args)
        ct_rf.append(t)
        t, comp_j = _compile_time(vg_j, args)
        ct_j.append(t)
    mem_rf = comp_rf.memory_analysis().temp_size_in_bytes
    mem_j = comp_j.memory_analysis().temp_size_in_bytes

    jit_rf, jit_j = jax.jit(vg_rf), jax.jit(vg_j)
    t_jit_rf, t_jit_j = _interleaved([lambda: jit_rf(*args), lambda: jit_j(*args)], repeats)
    t_eager_rf, t_eager_j = _interleaved([lambda: vg_rf(*args), lambda: vg_j(*args)], eager_repeats, warmup=1)

    row = {
        "model": model.name,
        "jit_rf_ms": 1e3 * t_jit_rf,
        "jit_jax_ms": 1e3 * t_jit_j,
        "jit_ratio": t_jit_rf / t_jit_j,
        "compile_ratio": statistics.median(ct_rf) / statistics.median(ct_j),
        "eager_ratio": t_eager_rf / t_eager_j,
        "eager_rf_ms": 1e3 * t_eager_rf,
        "eager_jax_ms": 1e3 * t_eager_j,
        "mem_rf": mem_rf,
        "mem_jax": mem_j,
        "mem_ratio": mem_rf / mem_j if mem_j else float("nan"),
        "torch_ratio": None,
    }
    if model.torch_step is not None:
        try:
            import torch

            torch.set_num_threads(max(1, torch.get_num_threads()))
            step = model.torch_step()
            (t_torch,) = _interleaved([step], eager_repeats, warmup=1)
            row["torch_ms"] = 1e3 * t_torch
            row["torch_ratio"] = t_eager_rf / t_torch
        except ImportError:
            pass
    gc.collect()
    return row


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | jit step rf/jax.grad | trace+compile rf/jax | eager step rf/jax.grad "
        "| temp memory rf/jax | eager rf/torch |"
    )
    lines = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        torch_col = (
            "n/a (torch not installed)"
            if r["torch_ratio"] is None
            else (f"{r['torch_ratio']:.2f} ({r['eager_rf_ms']:.1f} / {r['torch_ms']:.1f} ms)")
        )
        lines.append(
            f"| {r['model']} | {r['jit_ratio']:.2f} ({r['jit_rf_ms']:.2f} / {r['jit_jax_ms']:.2f} ms) "
            f"| {r['compile_ratio']:.2f} | {r['eager_ratio']:.2f} ({r['eager_rf_ms']:.1f} / {r['eager_jax_ms']:.1f} ms) "
            f"| {r['mem_ratio']:.2f} ({r['mem_rf'] / 2**20:.1f} / {r['mem_jax'] / 2**20:.1f} MiB) | {torch_col} |"
        )
    return "\n".join(lines)


def main(
    argv: list[str] | None = None,
    *,
    description: str | None = None,
    prepare: Callable[[Model], Model] = lambda model: model,
    title: str = "ratios rf / jax.grad (< 1.00: rumus_fx faster or smaller), medians of interleaved runs",
) -> None:
    """Check and measure the models; ``prepare`` turns each into the pair to time."""
    parser = argparse.ArgumentParser(description=description or __doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn,gpt", help="comma-separated subset of mlp,cnn,gpt")
    parser.add_argument("--repeats", type=int, default=30, help="timed runs of each jit step")
    parser.add_argument("--eager-repeats", type=int, default=5, help="timed runs of each eager step")
    args = parser.parse_args(argv)
    print(
        f"jax {jax.__version__} on {jax.default_backend()} ({platform.processor() or platform.machine()}, "
        f"{jax.device_count()} device(s)); rumus_fx {rf.__version__}; kernels: {rf.kernels.backend()}"
    )
    rows = []
    for name in args.models.split(","):
        model = prepare(MODELS[name.strip()]())
        l_rf, l_j = check_same(model)
        print(f"{model.name}: same loss ({l_rf:.6f} vs {l_j:.6f}) and gradients; measuring ...", flush=True)
        rows.append(measure(model, args.repeats, args.eager_repeats))
    print()
    print(title)
    print(format_table(rows))


if __name__ == "__main__":  # pragma: no cover
    main()
