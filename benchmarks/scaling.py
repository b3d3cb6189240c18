"""How rf's cost grows with the model: the GPT and the CNN at growing sizes.

Usage: ``python -m benchmarks.scaling [--quick] [--repeats N] [--png PATH] [--md PATH]``

One axis grows at a time from a small base model (GPT: depth 2-8, width
128-512, sequence 64-512; CNN: batch 16-256, channels x1-x4). At each size it
reports, in one process, rf / jax.grad for the jit step (median of
interleaved calls), trace + compile time and the compiled program's temporary
memory, and rf's jit step / PyTorch's eager step where torch is installed. The
claim checked: the ratios do not grow with size. The plot (``--png``) draws each
ratio against the growing axis, one panel per axis.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
from collections.abc import Callable

import jax
import numpy as np

import rumus_fx as rf

from .compare import _block, _interleaved, _torch_settle, compile_pair, torch_available
from .models import Model, cnn, tiny_gpt


@dataclasses.dataclass(frozen=True)
class Point:
    family: str  # "GPT" or "CNN"
    axis: str  # the growing axis
    value: int
    make: Callable[[], Model]


def points(quick: bool = False) -> list[Point]:
    g = dict(batch=4, seq=64, d=128, blocks=2)

    def gpt(**kw: int) -> Callable[[], Model]:
        args = {**g, **kw}
        return lambda: tiny_gpt(batch=args["batch"], seq=args["seq"], d=args["d"], blocks=args["blocks"])

    depth = (2, 4) if quick else (2, 4, 8)
    width = (128, 256) if quick else (128, 256, 512)
    seq = (64, 128) if quick else (64, 128, 256, 512)
    batch = (16, 32) if quick else (16, 64, 256)
    chans = (1, 2) if quick else (1, 2, 4)
    return (
        [Point("GPT", "depth", v, gpt(blocks=v)) for v in depth]
        + [Point("GPT", "width", v, gpt(d=v)) for v in width]
        + [Point("GPT", "sequence", v, gpt(seq=v)) for v in seq]
        + [Point("CNN", "batch", v, lambda v=v: cnn(batch=v)) for v in batch]
        + [Point("CNN", "channels x", v, lambda v=v: cnn(batch=16, width=v)) for v in chans]
    )


def measure(model: Model, repeats: int, with_torch: bool) -> dict[str, float]:
    args = (model.params, model.batch)
    vg_rf, vg_j = rf.value_and_grad(model.loss_rf), jax.value_and_grad(model.loss_jax)
    ct_rf, ct_j, comp_rf, comp_j = compile_pair(vg_rf, vg_j, args, 2)
    mem_rf = comp_rf.memory_analysis().temp_size_in_bytes
    mem_j = comp_j.memory_analysis().temp_size_in_bytes
    jit_rf, jit_j = jax.jit(vg_rf), jax.jit(vg_j)
    t_rf, t_j = _interleaved([lambda: jit_rf(*args), lambda: jit_j(*args)], repeats)
    row = {
        "jit": t_rf / t_j,
        "jit_jax_ms": 1e3 * t_j,
        "compile": statistics.median(ct_rf) / statistics.median(ct_j),
        "memory": mem_rf / mem_j if mem_j else float("nan"),
        "mem_jax_mib": mem_j / 2**20,
        "torch": float("nan"),
    }
    if with_torch and model.torch_step is not None:
        step = model.torch_step()
        for _ in range(2):
            step()
        times = []
        for _ in range(max(3, repeats // 2)):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        _torch_settle()
        for _ in range(2):  # XLA after PyTorch: warm again before timing rf alone
            _block(jit_rf(*args))
        t_rf_alone = []
        for _ in range(max(3, repeats // 2)):
            t0 = time.perf_counter()
            _block(jit_rf(*args))
            t_rf_alone.append(time.perf_counter() - t0)
        row["torch"] = statistics.median(t_rf_alone) / statistics.median(times)
    gc.collect()
    return row


RATIOS = ("jit", "compile", "memory", "torch")


def format_table(results: list[tuple[Point, dict[str, float]]]) -> str:
    lines = [
        "| model | growing | value | jit step rf/jax | compile rf/jax | temp memory rf/jax | rf jit / PyTorch eager | jax.grad step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p, r in results:
        torch = "n/a" if np.isnan(r["torch"]) else f"{r['torch']:.2f}"
        lines.append(
            f"| {p.family} | {p.axis} | {p.value} | {r['jit']:.2f} | {r['compile']:.2f} | "
            f"{r['memory']:.2f} ({r['mem_jax_mib']:.1f} MiB) | {torch} | {r['jit_jax_ms']:.1f} ms |"
        )
    return "\n".join(lines)


def plot(results: list[tuple[Point, dict[str, float]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_keys = list(dict.fromkeys((p.family, p.axis) for p, _ in results))
    fig, axes = plt.subplots(1, len(axes_keys), figsize=(3.2 * len(axes_keys), 3.2), sharey=True)
    for ax, (fam, axis) in zip(np.atleast_1d(axes), axes_keys):
        pts = [(p.value, r) for p, r in results if (p.family, p.axis) == (fam, axis)]
        xs = [v for v, _ in pts]
        for key in RATIOS:
            ys = [r[key] for _, r in pts]
            if not all(np.isnan(ys)):
                ax.plot(xs, ys, marker="o", label=key)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{fam}: {axis}")
        ax.set_xlabel(axis)
    np.atleast_1d(axes)[0].set_ylabel("ratio (rf / other)")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> list[tuple[Point, dict[str, float]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two sizes per axis")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--png", default=None, help="write the plot here")
    parser.add_argument("--md", default=None, help="write the table here")
    parser.add_argument("--no-torch", action="store_true")
    ns = parser.parse_args(argv)
    with_torch = torch_available() and not ns.no_torch
    results = []
    with jax.numpy_rank_promotion("allow"):
        for p in points(ns.quick):
            r = measure(p.make(), ns.repeats, with_torch)
            print(f"{p.family} {p.axis}={p.value}: " + ", ".join(f"{k} {r[k]:.2f}" for k in RATIOS), flush=True)
            results.append((p, r))
    table = format_table(results)
    print(table)
    if ns.md:
        with open(ns.md, "w") as f:
            f.write(table + "\n")
    if ns.png:
        plot(results, ns.png)
    return results


if __name__ == "__main__":  # pragma: no cover
    main()
