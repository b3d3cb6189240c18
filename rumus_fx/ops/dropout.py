"""Dropout with inverted scaling and an explicit jax PRNG key (reproducible)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..autograd.record import Record
from ..sharding import sharding_of
from ..tensor import Tensor
from ._core import array_of, eager_jit, is_real_scalar, new_output, record, require_float, tape_for
from ._declare import KEY, BadInput, Sample, array, integers, normal, op, tracked

Array = jax.Array
frozen = dataclasses.dataclass(frozen=True, eq=False)


@frozen
class DropoutBackward(Record):
    """``y = x * mask / (1 - p)``: ``dx = dy * mask / (1 - p)``. Saves the mask
    (private: it snapshots nothing)."""

    mask: Array
    scale: float

    def backward(self, g, needs):
        return (jnp.where(self.mask, g * self.scale, 0),)


def ref_dropout(x: Any, p: float, key: Any, training: bool = True) -> Array:
    """The jax.numpy oracle of ``dropout`` (op table): the same mask bits."""
    if not training:
        return x
    keep = jax.random.bernoulli(key, 1.0 - p, x.shape)
    return jnp.where(keep, x / (1.0 - p), 0.0)


@eager_jit(static_argnums=(2, 3))
def _dropout(key: Any, xv: Array, p: float, scale: float) -> tuple[Array, Array]:
    """(the keep mask, ``x`` with the dropped entries zeroed and the kept ones scaled)."""
    # sharded like x (explicit mesh axes): each device draws its own part of the
    # mask, the same bits as on one device (jax's partitionable threefry)
    keep = jax.random.bernoulli(key, 1.0 - p, xv.shape, out_sharding=sharding_of(xv))
    return keep, jnp.where(keep, xv * scale, 0)


@op(
    records=(DropoutBackward,),
    ref=ref_dropout,
    samples=lambda r: [
        Sample((normal(r, 6, 7), 0.3, jax.random.key(1))),
        Sample((normal(r, 2, 3, 5), 0.5, jax.random.key(2))),
    ],
    errors=lambda: [
        BadInput("p = 1", (tracked(3, 4), 1.0, KEY), ValueError, ("1.0",)),
        BadInput("p < 0", (tracked(3, 4), -0.1, KEY), ValueError),
        BadInput("p a string", (tracked(3, 4), "0.5", KEY), (TypeError, ValueError)),
        BadInput("no key", (tracked(3, 4), 0.5, None), TypeError),
        BadInput("an int key", (tracked(3, 4), 0.5, 1), TypeError),
        BadInput("a float array key", (tracked(3, 4), 0.5, array(np.zeros(2), jnp.float32)), TypeError),
        BadInput("training not a bool", (tracked(3, 4), 0.5, KEY), TypeError, kwargs={"training": "yes"}),
        BadInput("integer input", (integers(3, 4), 0.5, KEY), TypeError),
    ],
)
def dropout(x: Any, p: float, key: Any, training: bool = True) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by
    ``1 / (1 - p)``; ``key`` is a ``jax.random`` key, so the same key gives the
    same mask. With ``training=False`` (or ``p == 0``) it returns ``x``
    unchanged (records DropoutBackward)."""
    op = "dropout"
    if not is_real_scalar(p) or not 0 <= p < 1:
        raise ValueError(f"{op}: p must be a float in [0, 1), got {p!r}")
    if not isinstance(training, bool):
        raise TypeError(f"{op}: training must be a bool, got {training!r}")
    xv = array_of(x, op)
    require_float(op, xv)
    key_dtype = getattr(key, "dtype", None)
    if key_dtype is None or not (jax.dtypes.issubdtype(key_dtype, jax.dtypes.prng_key) or key_dtype == jnp.uint32):
        shown = type(key).__name__ if key_dtype is None else f"an array of dtype {key_dtype}"
        raise TypeError(f"{op}: key must be a jax.random key (jax.random.key(seed)), got {shown}")
    if not training or p == 0:
        return x if isinstance(x, Tensor) else Tensor._wrap(xv)
    scale = 1.0 / (1.0 - p)
    keep, out = _dropout(key, xv, p, scale)
    tape = tape_for(x)
    if tape is None:
        return Tensor._wrap(out)
    return record(tape, DropoutBackward(keep, scale), (x,), new_output(out, tape))
