"""``rf.tensor`` and the recorded copy with a dtype cast that
``rf.tensor(t, dtype=...)`` of a tracked tensor means while a tape records."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..autograd.record import Record
from ..recording import current_tape
from ..tensor import Tensor
from ._core import new_output, record, tape_for, value_of
from ._declare import op

Array = jax.Array
frozen = dataclasses.dataclass(frozen=True, eq=False)


@frozen
class CastBackward(Record):
    """``y = x.astype(dtype)`` (a copy when the dtype is the same): ``dx = dy``
    cast back to ``x``'s dtype; no gradient for a non-floating result. Reads no
    data."""

    input_dtype: Any

    def backward(self, g, needs):
        return (g if g.dtype == self.input_dtype else g.astype(self.input_dtype),)


@op(records=(CastBackward,), toplevel=False)  # rf.tensor(t, dtype=...) and t.astype: tests/test_tensor.py
def cast_to(x: Any, dtype: Any) -> Tensor:
    """``x`` as a new tensor (new storage) of ``dtype``; recorded (CastBackward)
    when ``x`` is tracked, a tape records and ``dtype`` is floating."""
    xv = value_of(x, "cast")
    xv = jnp.asarray(xv)
    dtype = np.dtype(dtype)
    y = xv if xv.dtype == dtype else xv.astype(dtype)
    tape = tape_for(x) if jnp.issubdtype(dtype, jnp.floating) else None
    out = new_output(y, tape)
    if tape is None:
        return out
    return record(tape, CastBackward(np.dtype(xv.dtype)), (x,), out)


def tensor(data: Any, requires_grad: bool = False, dtype: Any = None) -> Tensor:
    """A new tensor (new storage, version 0) holding ``data``.

    Python floats become float32 unless ``dtype`` says otherwise; numpy and jax
    arrays keep their dtype. ``requires_grad=True`` makes it a tracked leaf.

    >>> import rumus_fx as rf
    >>> w = rf.tensor([[1.0, 2.0]], requires_grad=True)
    >>> w.shape, w.requires_grad
    ((1, 2), True)

    A tracked tensor ``data`` while a tape records gives a recorded copy (cast
    to ``dtype`` when given; records CastBackward), never a silent detach.
    """
    if not requires_grad and isinstance(data, Tensor) and data.grad_id is not None and current_tape() is not None:
        return cast_to(data, data.dtype if dtype is None else dtype)
    return Tensor(data, requires_grad=requires_grad, dtype=dtype)
