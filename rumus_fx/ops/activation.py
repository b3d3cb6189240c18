"""Activations: relu, sigmoid, tanh, gelu, leaky_relu, softmax."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..autograd.record import Record, VersionSnapshot
from ..tensor import Tensor
from ._core import array_of, new_output, reads, record, tape_for

Array = jax.Array
frozen = dataclasses.dataclass(frozen=True, eq=False)


@frozen
class ReluBackward(Record):
    """``y = max(x, 0)``: ``dx = dy`` where ``x > 0``, else 0. Saves the input."""

    input: Array
    input_version: VersionSnapshot | None

    def backward(self, g, needs):
        return (jnp.where(self.input > 0, g, jnp.zeros((), g.dtype)),)


def relu(x) -> Tensor:
    """``max(x, 0)``; the gradient at exactly 0 is 0, as ``jax.nn.relu`` (records ReluBackward)."""
    xv = array_of(x, "relu")
    out = jnp.maximum(xv, jnp.zeros((), xv.dtype))
    tape = tape_for(x)
    if tape is None:
        return Tensor._wrap(out)
    saved, version = reads(x, True)
    return record(tape, ReluBackward(saved, version), (x,), new_output(out, tape))
