"""``rf.grad(rf.lift(f))`` vs ``jax.grad(f)`` for the same pure-jnp models.

Usage: ``python -m benchmarks.lifted [--models mlp,cnn,gpt] [--repeats N]``

The jax.grad side of each benchmark model (``benchmarks/models.py``) is plain
``jax.numpy``/``lax`` code; here rumus_fx differentiates exactly that code through
``rf.lift`` (every primitive recorded with rf's own rules), so the two columns run
the same forward program. Same checks and ratios as ``python -m benchmarks.models``.
"""

from __future__ import annotations

import dataclasses

import rumus_fx as rf

from . import compare
from .models import Model


def lifted(model: Model) -> Model:
    return dataclasses.replace(
        model, name=f"{model.name} (lifted jnp)", loss_rf=rf.lift(model.loss_jax), torch_step=None
    )


def main(argv: list[str] | None = None) -> None:
    compare.main(
        argv,
        description=__doc__.splitlines()[0],
        prepare=lifted,
        title="ratios rf.grad(rf.lift(f)) / jax.grad(f) (< 1.00: rumus_fx faster or smaller)",
        chain=False,
    )


if __name__ == "__main__":  # pragma: no cover
    main()
