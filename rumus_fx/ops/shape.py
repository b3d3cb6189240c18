"""Shape ops: reshape, flatten, transpose (views when the layout allows)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from ..autograd.errors import ShapeError
from ..autograd.record import Record
from ..tensor import Tensor, next_grad_id
from ._core import normalize_axis, record, shape_of, tape_for, value_of

Array = jax.Array
frozen = dataclasses.dataclass(frozen=True, eq=False)


@frozen
class ReshapeBackward(Record):
    """``y = reshape(x)``: ``dx = reshape(dy, original_shape)``. Reads no data."""

    original_shape: tuple[int, ...]

    def backward(self, g, needs):
        return (g.reshape(self.original_shape),)


@frozen
class FlattenBackward(Record):
    """``y = flatten(x)`` (``[B, ...] -> [B, rest]``): ``dx = reshape(dy)``."""

    original_shape: tuple[int, ...]

    def backward(self, g, needs):
        return (g.reshape(self.original_shape),)


@frozen
class TransposeBackward(Record):
    """``y = transpose(x, dim0, dim1)``: ``dx = transpose(dy, dim0, dim1)``."""

    dim0: int
    dim1: int

    def backward(self, g, needs):
        return (jnp.swapaxes(g, self.dim0, self.dim1),)


def resolve_shape(op: str, old: tuple[int, ...], shape: Any) -> tuple[int, ...]:
    """``shape`` with a -1 filled in; ShapeError if the sizes do not match."""
    if isinstance(shape, (int,)):
        shape = (shape,)
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError:
        raise TypeError(f"{op}: shape must be a sequence of ints, got {shape!r}") from None
    size = math.prod(old)
    unknown = [i for i, s in enumerate(shape) if s == -1]
    if len(unknown) > 1 or any(s < -1 for s in shape):
        raise ShapeError(f"{op}: invalid target shape {shape} for input of shape {old}")
    if unknown:
        known = math.prod(s for s in shape if s != -1)
        if known == 0 or size % known:
            raise ShapeError(f"{op}: cannot reshape input of shape {old} into {shape}")
        shape = tuple(size // known if s == -1 else s for s in shape)
    if math.prod(shape) != size:
        raise ShapeError(f"{op}: cannot reshape input of shape {old} ({size} elements) into {shape}")
    return shape


def _reshape_to(x: Any, shape: tuple[int, ...], rec: Record) -> Tensor:
    tape = tape_for(x)
    gid = None if tape is None else next_grad_id()
    if isinstance(x, Tensor):
        layout = x.layout.view(shape)
        if layout is not None:
            out = x._view(layout, gid)
        else:  # not expressible as a view: a contiguous copy, as torch.reshape
            out = Tensor._wrap(x.value.reshape(shape), gid)
    else:
        out = Tensor._wrap(jnp.reshape(value_of(x, "reshape"), shape), gid)
    if tape is None:
        return out
    return record(tape, rec, (x,), out)


def reshape(x: Any, shape: Any) -> Tensor:
    """``x`` with a new shape (one -1 allowed): a view of the same storage when
    the layout allows, a contiguous copy otherwise (records ReshapeBackward)."""
    old = shape_of(x) if isinstance(x, Tensor) else shape_of(value_of(x, "reshape"))
    new = resolve_shape("reshape", old, shape)
    return _reshape_to(x, new, ReshapeBackward(old))


def flatten(x: Any) -> Tensor:
    """``[B, d1, d2, ...] -> [B, d1*d2*...]`` keeping axis 0 (records FlattenBackward)."""
    old = shape_of(x) if isinstance(x, Tensor) else shape_of(value_of(x, "flatten"))
    if len(old) < 1:
        raise ShapeError(f"flatten: expects a tensor of rank >= 1 (axis 0 is kept), got shape {old}")
    new = (old[0], math.prod(old[1:]))
    return _reshape_to(x, new, FlattenBackward(old))


def transpose(x: Any, dim0: int, dim1: int) -> Tensor:
    """Swap two axes; a view of the same storage (records TransposeBackward)."""
    nd = len(shape_of(x)) if isinstance(x, Tensor) else len(shape_of(value_of(x, "transpose")))
    d0 = normalize_axis("transpose", dim0, nd)
    d1 = normalize_axis("transpose", dim1, nd)
    tape = tape_for(x)
    gid = None if tape is None else next_grad_id()
    if isinstance(x, Tensor):
        out = x._view(x.layout.transpose(d0, d1), gid)
    else:
        out = Tensor._wrap(jnp.swapaxes(value_of(x, "transpose"), d0, d1), gid)
    if tape is None:
        return out
    return record(tape, TransposeBackward(d0, d1), (x,), out)
