"""``rf.grad(rf.lift(f))`` vs ``jax.grad(f)`` for the same pure-jnp models.

Usage: ``python -m benchmarks.lifted [--models mlp,cnn,gpt] [--repeats N]``

The jax.grad side of each benchmark model (``benchmarks/models.py``) is plain
``jax.numpy``/``lax`` code; here rumus_fx differentiates exactly that code through
``rf.lift`` (every primitive recorded with rf's own rules), so the two columns run
the same forward program. Same checks and ratios as ``python -m benchmarks.models``.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform

import jax

import rumus_fx as rf

from .compare import check_same, format_table, measure
from .models import MODELS, Model


def lifted(model: Model) -> Model:
    return dataclasses.replace(
        model, name=f"{model.name} (lifted jnp)", loss_rf=rf.lift(model.loss_jax), torch_step=None
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn,gpt", help="comma-separated subset of mlp,cnn,gpt")
    parser.add_argument("--repeats", type=int, default=30, help="timed runs of each jit step")
    parser.add_argument("--eager-repeats", type=int, default=5, help="timed runs of each eager step")
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.default_backend()} ({platform.processor() or platform.machine()})")
    rows = []
    for name in args.models.split(","):
        model = lifted(MODELS[name.strip()]())
        l_rf, l_j = check_same(model)
        print(f"{model.name}: same loss ({l_rf:.6f} vs {l_j:.6f}) and gradients; measuring ...", flush=True)
        rows.append(measure(model, args.repeats, args.eager_repeats))
    print()
    print("ratios rf.grad(rf.lift(f)) / jax.grad(f) (< 1.00: rumus_fx faster or smaller)")
    print(format_table(rows))


if __name__ == "__main__":  # pragma: no cover
    main()
