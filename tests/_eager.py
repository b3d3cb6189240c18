"""What an eager call binds outside compiled calls (Note [Eager compilation])."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax._src import core


def primitives_bound_one_by_one(fn: Callable[[], Any], warmup: int = 3) -> list[str]:
    """The primitives that one call of ``fn`` binds through JAX's Python
    dispatch (a jnp function applied to concrete arrays: 20-60 µs each), after
    ``warmup`` calls that compile its programs and let a repeated tape's
    signature be seen."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    bound: list[str] = []
    plain = core.EvalTrace.process_primitive

    def spy(self, primitive, *args, **kwargs):
        bound.append(primitive.name)
        return plain(self, primitive, *args, **kwargs)

    core.EvalTrace.process_primitive = spy
    try:
        jax.block_until_ready(fn())
    finally:
        core.EvalTrace.process_primitive = plain
    return bound
