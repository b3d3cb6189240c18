"""rf's jit training step on a GPU against jax.grad's, per kernel choice.

    python benchmarks/gpu_steps.py --out $OUT/gpu_steps.md --time-limit 150   # on a GPU
    python benchmarks/gpu_steps.py --cpu --out /tmp/steps.md                  # anywhere: tiny models

For each model (benchmarks/models.py) the compiled step ``value_and_grad`` is
built four ways and timed interleaved in one process (median of ``--repeats``
rounds, each round one call of each):

* ``jax.grad``: ``jax.value_and_grad`` of the plain jax.numpy loss;
* ``rf triton``: ``rf.value_and_grad`` under ``auto`` dispatch (Pallas kernels,
  Triton first, the default);
* ``rf mosaic``: the same with ``RUMUS_FX_GPU_KERNELS=mosaic`` (the Mosaic GPU
  row kernels first where they lower);
* ``rf reference``: ``rf.kernels.use("reference")`` (XLA's fusions, no kernel).

Each rf gradient is compared with jax.grad's (max error over all parameters
relative to the largest gradient; both run at the default float32 matmul
precision, TF32 on a GPU). Ratios are rf / jax.grad: below 1.00 rf is faster.
The table is rewritten after every model, so a run cut short by
``--time-limit`` keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp

import rumus_fx as rf
from benchmarks import models
from benchmarks.compare import _interleaved

WAYS = ("jax.grad", "rf triton", "rf mosaic", "rf reference")


@contextlib.contextmanager
def _gpu_kernels(choice: str) -> Iterator[None]:
    old = os.environ.get("RUMUS_FX_GPU_KERNELS")
    os.environ["RUMUS_FX_GPU_KERNELS"] = choice
    try:
        yield
    finally:
        if old is None:
            del os.environ["RUMUS_FX_GPU_KERNELS"]
        else:
            os.environ["RUMUS_FX_GPU_KERNELS"] = old


def _compiled(model: models.Model, way: str, mode: str) -> Callable[..., Any]:
    """The step compiled now, under the way's dispatch (the choice is made at trace time)."""
    args = (model.params, model.batch)
    if way == "jax.grad":
        return jax.jit(jax.value_and_grad(model.loss_jax)).lower(*args).compile()
    step = jax.jit(rf.value_and_grad(model.loss_rf))
    kernels = "mosaic" if way == "rf mosaic" else "triton"
    with rf.kernels.use("reference" if way == "rf reference" else mode), _gpu_kernels(kernels):
        return step.lower(*args).compile()


def _max_rel(got: Any, want: Any) -> float:
    scale = max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want))
    err = max(float(jnp.max(jnp.abs(g - w))) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
    return err / scale


def measure(model: models.Model, mode: str, repeats: int) -> dict[str, Any]:
    args = (model.params, model.batch)
    steps = {way: _compiled(model, way, mode) for way in WAYS}
    outs = {way: jax.block_until_ready(f(*args)) for way, f in steps.items()}
    medians = _interleaved([functools.partial(f, *args) for f in steps.values()], repeats)
    ms = {way: 1e3 * t for way, t in zip(steps, medians, strict=True)}
    err = {way: _max_rel(outs[way][1], outs["jax.grad"][1]) for way in WAYS[1:]}
    return {"model": model.name, "ms": ms, "err": err}


def render(rows: list[dict[str, Any]]) -> str:
    head = "| model | jax.grad ms | " + " | ".join(f"{w} ms (ratio; grad err)" for w in WAYS[1:]) + " |"
    lines = [head, "|" + "---|" * (2 + len(WAYS) - 1)]
    for r in rows:
        base = r["ms"]["jax.grad"]
        cells = [f"{r['ms'][w]:.3f} ({r['ms'][w] / base:.2f}; {r['err'][w]:.0e})" for w in WAYS[1:]]
        lines.append(f"| {r['model']} | {base:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def model_list(cpu: bool) -> list[Callable[[], models.Model]]:
    if cpu:
        return [
            lambda: models.mlp(batch=8, widths=(20, 16, 10)),
            lambda: models.tiny_gpt(batch=2, seq=8, vocab=17, d=32, heads=2, blocks=1),
        ]
    return [
        models.mlp,
        models.cnn,
        models.tiny_gpt,
        lambda: models.mlp(batch=4096, widths=(1024, 4096, 4096, 1000)),
        lambda: models.tiny_gpt(batch=16, seq=512, vocab=8192, d=512, heads=8, blocks=4),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny models, interpret-mode kernels (any platform)")
    parser.add_argument("--out", type=Path, default=None, help="markdown file for the table")
    parser.add_argument("--time-limit", type=float, default=150.0, help="hard limit on the whole run, seconds")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    device = ", ".join(sorted({d.device_kind for d in jax.devices()}))
    if jax.default_backend() != "gpu" and not args.cpu:
        print(f"no GPU: jax backend is {jax.default_backend()!r}; pass --cpu to run tiny models anywhere")
        return 0
    mode = "interpret" if args.cpu else "auto"
    rows: list[dict[str, Any]] = []

    def flush() -> None:
        text = "\n".join(
            [
                "## GPU training steps (`benchmarks/gpu_steps.py`)",
                "",
                f"- Date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}; jax {jax.__version__}",
                f"- Device: {device}; rf dispatch `{mode}`; median of {args.repeats} interleaved rounds",
                "",
                render(rows),
                "",
            ]
        )
        print(text, flush=True)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)

    def at_limit() -> None:
        print(f"time limit of {args.time_limit:.0f} s reached after {len(rows)} models", flush=True)
        os._exit(2)

    timer = threading.Timer(args.time_limit, at_limit)
    timer.daemon = True
    timer.start()
    for make in model_list(args.cpu):
        rows.append(measure(make(), mode, args.repeats))
        flush()
    timer.cancel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
