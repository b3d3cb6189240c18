"""The derivative formulas of the fused elementwise unary ops: one function per
op, ``formula(g, saved)`` (``formula(g)`` for an op that saves nothing) -> the
input's gradient, ``saved`` being the op's input or its output as the op's
declaration says (Note [Unary op family] in ``_unary.py``).

The primitive rules of ``rf.lift`` for the same functions
(``lift/rules_elementwise.py``: ``exp``, ``log``, ``tanh``, ``logistic``,
``neg``) call these too, so each derivative is written once."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def relu(g: Array, x: Array) -> Array:
    """``dx = dy`` where ``x > 0``, else 0 (from the input)."""
    return jnp.where(x > 0, g, 0)


def sigmoid(g: Array, y: Array) -> Array:
    """``dx = dy * y * (1 - y)`` (from the output)."""
    return g * y * (1 - y)


def tanh(g: Array, y: Array) -> Array:
    """``dx = dy * (1 - y^2)`` (from the output)."""
    return g * (1 - y * y)


def exp(g: Array, y: Array) -> Array:
    """``dx = dy * y`` (from the output)."""
    return g * y


def log(g: Array, x: Array) -> Array:
    """``dx = dy / x`` (from the input)."""
    return g / x


def neg(g: Array) -> Array:
    """``dx = -dy`` (reads nothing)."""
    return -g


def softplus(g: Array, x: Array) -> Array:
    """``dx = dy * sigmoid(x)`` (from the input)."""
    return g * jax.nn.sigmoid(x)
