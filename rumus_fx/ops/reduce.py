"""Reductions: sum and mean over any axes (bfloat16/float16 accumulate in float32)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import sharding as shd
from ..autograd.record import Record
from ..errors import ShapeError
from ..tensor import Tensor
from ._core import (
    acc_sum,
    array_of,
    cast,
    eager_jit,
    is_low_precision,
    new_output,
    normalize_axis,
    record,
    shape_of,
    tape_for,
)
from ._declare import BadInput, Sample, normal, op, tracked

Array = jax.Array
frozen = dataclasses.dataclass(frozen=True, eq=False)


def _axes(op: str, axis: Any, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, (tuple, list)):
        axes = tuple(normalize_axis(op, a, ndim) for a in axis)
        if len(set(axes)) != len(axes):
            raise ValueError(f"{op}: repeated axis in {tuple(axis)}")
        return tuple(sorted(axes))
    return (normalize_axis(op, axis, ndim),)


def _expand(g: Array, input_shape: tuple[int, ...], axes: tuple[int, ...], keepdims: bool, sharding: Any) -> Array:
    if not keepdims and axes:
        kept = [1 if d in axes else s for d, s in enumerate(input_shape)]
        g = shd.reshape(g, kept)
    return shd.broadcast_to(g, input_shape, sharding)


@frozen
class SumBackward(Record):
    """``y = sum(x, axes)``: ``dx = broadcast(dy)``. Reads no data."""

    input_shape: tuple[int, ...]
    axes: tuple[int, ...]
    keepdims: bool
    dtype: Any
    sharding: Any = None  # the input's explicit sharding (rumus_fx/sharding.py)

    def backward(self, g, needs):
        return (cast(_expand(g, self.input_shape, self.axes, self.keepdims, self.sharding), self.dtype),)


@frozen
class MeanBackward(Record):
    """``y = mean(x, axes)``: ``dx = broadcast(dy) / count``. Reads no data."""

    input_shape: tuple[int, ...]
    axes: tuple[int, ...]
    keepdims: bool
    count: int
    dtype: Any
    sharding: Any = None

    def backward(self, g, needs):
        g = g / self.count
        return (cast(_expand(g, self.input_shape, self.axes, self.keepdims, self.sharding), self.dtype),)


@eager_jit(static_argnums=(0, 2, 3))
def _reduce_value(kind: str, xv: Array, axes: tuple[int, ...], keepdims: bool) -> Array:
    if kind == "sum":
        return acc_sum(xv, axes, keepdims)
    if is_low_precision(xv.dtype):
        return jnp.mean(xv, axis=axes, keepdims=keepdims, dtype=jnp.float32).astype(xv.dtype)
    return jnp.mean(xv, axis=axes, keepdims=keepdims)


def _reduce(kind: str, x: Any, axis: Any, keepdims: bool) -> Tensor:
    xv = array_of(x, kind)
    if not isinstance(keepdims, (bool, np.bool_)):
        raise TypeError(f"{kind}: keepdims must be a bool, got {keepdims!r}")
    shape = shape_of(xv)
    axes = _axes(kind, axis, len(shape))
    count = 1
    for a in axes:
        count *= shape[a]
    out = _reduce_value(kind, xv, axes, bool(keepdims))
    tape = tape_for(x)
    if tape is None:
        return Tensor._wrap(out)
    if kind == "sum":
        rec: Record = SumBackward(shape, axes, keepdims, xv.dtype, shd.sharding_of(xv))
    else:
        rec = MeanBackward(shape, axes, keepdims, count, xv.dtype, shd.sharding_of(xv))
    return record(tape, rec, (x,), new_output(out, tape))


@op(
    records=(SumBackward,),
    ref=jnp.sum,
    samples=lambda r: [
        Sample((normal(r, 3, 5),)),
        Sample((normal(r, 2, 3, 7),), {"axis": 1}),
        Sample((normal(r, 2, 3, 7),), {"axis": (0, 2), "keepdims": True}),
        Sample((normal(r, 4, 6),), {"axis": -1}),
    ],
    errors=lambda: [
        BadInput("axis out of range", (tracked(3, 4),), ShapeError, ("axis 2",), {"axis": 2}),
        BadInput("axis out of range in a tuple", (tracked(3, 4),), ShapeError, kwargs={"axis": (0, -3)}),
        BadInput("float axis", (tracked(3, 4),), TypeError, kwargs={"axis": 1.0}),
        BadInput("repeated axis", (tracked(3, 4),), ValueError, kwargs={"axis": (1, -1)}),
    ],
)
def sum(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Sum over ``axis`` (int, tuple or None for all) (records SumBackward)."""
    return _reduce("sum", x, axis, keepdims)


@op(
    records=(MeanBackward,),
    ref=jnp.mean,
    samples=lambda r: [
        Sample((normal(r, 3, 5),)),
        Sample((normal(r, 2, 3, 7),), {"axis": 1}),
        Sample((normal(r, 2, 3, 7),), {"axis": (0, 2), "keepdims": True}),
    ],
    errors=lambda: [
        BadInput("axis out of range", (tracked(3),), ShapeError, kwargs={"axis": 1}),
        BadInput("string axis", (tracked(3),), TypeError, kwargs={"axis": "0"}),
    ],
)
def mean(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:
    """Mean over ``axis`` (int, tuple or None for all) (records MeanBackward)."""
    return _reduce("mean", x, axis, keepdims)
