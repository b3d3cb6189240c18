"""Debugging helpers: live storage count and anomaly detection."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from .autograd.engine import ANOMALY
from .autograd.errors import AutogradError
from .storage import live_storage_count


def live_storages() -> int:
    """Number of storages alive right now (use it to check for leaks)."""
    return live_storage_count()


@contextlib.contextmanager
def detect_anomaly() -> Iterator[None]:
    """Raise ``rf.AutogradError`` naming the record when backward produces NaN/Inf."""
    token = ANOMALY.set(True)
    try:
        yield
    finally:
        ANOMALY.reset(token)


def _describe_entry(entry: Any) -> str:
    shapes = ", ".join("scalar" if a is None else str(list(a[0])) for a in entry.input_avals)
    return shapes


def check_finite(g: jax.Array, name: str, index: int, entry: Any) -> None:
    """Raise if ``g`` (a gradient produced by record ``name``) has NaN/Inf."""
    if isinstance(g, jax.core.Tracer):
        return  # traced: see rumus_fx.debug for the jit path
    if not bool(jnp.all(jnp.isfinite(g))):
        raise AutogradError(
            f"anomaly: {name} (tape index {index}) produced a non-finite gradient; the "
            f"forward op's inputs had shapes {_describe_entry(entry)}"
        )
