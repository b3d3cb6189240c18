"""Softmax over one axis: forward and backward (jnp reference; Pallas beside it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._util import upcast
from .dispatch import call


def softmax_reference(x: jax.Array, *, axis: int) -> jax.Array:
    xf = upcast(x)
    m = jnp.max(xf, axis=axis, keepdims=True)
    e = jnp.exp(xf - m)
    return (e / jnp.sum(e, axis=axis, keepdims=True)).astype(x.dtype)


def softmax_bwd_reference(y: jax.Array, g: jax.Array, *, axis: int) -> jax.Array:
    yf, gf = upcast(y), upcast(g)
    dot = jnp.sum(gf * yf, axis=axis, keepdims=True)
    return (yf * (gf - dot)).astype(g.dtype)


def softmax_fwd(x: jax.Array, axis: int = -1) -> jax.Array:
    """Numerically stable softmax of ``x`` along ``axis``."""
    return call(softmax_reference, None, x, axis=axis)


def softmax_bwd(y: jax.Array, g: jax.Array, axis: int = -1) -> jax.Array:
    """``dx = y * (g - sum(g * y))`` from the saved output ``y``."""
    return call(softmax_bwd_reference, None, y, g, axis=axis)
