"""Kernel dispatch: Pallas on GPU/TPU, the jax.numpy reference on CPU.

Modes: ``"auto"`` (default), ``"reference"``, ``"pallas"``, ``"interpret"``.
Choose one with ``rf.kernels.use(mode)`` or the ``RUMUS_FX_KERNELS`` variable.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax

MODES = ("auto", "reference", "pallas", "interpret")
_MODE: contextvars.ContextVar[str | None] = contextvars.ContextVar("rumus_fx_kernel_mode", default=None)


def _check(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown kernel mode {mode!r}; expected one of {MODES}")
    return mode


def mode() -> str:
    """The active kernel mode (context first, then $RUMUS_FX_KERNELS, then auto)."""
    m = _MODE.get()
    if m is None:
        m = os.environ.get("RUMUS_FX_KERNELS", "auto") or "auto"
    return _check(m)


@contextlib.contextmanager
def use(mode: str) -> Iterator[None]:
    """Force a kernel mode inside the block (per thread / asyncio task)."""
    token = _MODE.set(_check(mode))
    try:
        yield
    finally:
        _MODE.reset(token)


def backend() -> str:
    """What the next kernel call will run: ``"pallas"`` or ``"reference"``."""
    m = mode()
    if m == "auto":
        return "pallas" if jax.default_backend() in ("gpu", "tpu") else "reference"
    return "reference" if m == "reference" else "pallas"


def call(reference: Callable[..., Any], pallas: Callable[..., Any] | None, *args: Any, **static: Any) -> Any:
    """Run ``reference(*args, **static)`` or ``pallas(*args, interpret=..., **static)``."""
    m = mode()
    if pallas is None or m == "reference":
        return reference(*args, **static)
    if m == "interpret":
        return pallas(*args, interpret=True, **static)
    if m == "pallas":
        return pallas(*args, interpret=False, **static)
    if jax.default_backend() in ("gpu", "tpu"):
        return pallas(*args, interpret=False, **static)
    return reference(*args, **static)
