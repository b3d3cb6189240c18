"""In-place tensor methods: add_ sub_ mul_ div_ zero_ fill_ copy_.

Each one computes the new value out of place, then writes it copy-on-write into
the tensor's storage (swap the buffer, version + 1). While recording, the write is
differentiable: it appends the same record as the out-of-place op, built from the
*pre-write* buffer (private to the record, so it needs no snapshot), and moves the
tensor's grad id to the new value (history rebased, as in PyTorch).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ..autograd.record import Aval, Record, provenance_of
from ..autograd.tape import Tape, current_tape
from ..errors import AutogradError, ShapeError
from ..storage import Layout
from ..tensor import Tensor, next_grad_id
from ._core import (
    BroadcastInfo,
    acc_sum,
    align_rank,
    aval_of,
    broadcast_info,
    broadcast_shapes,
    cast,
    shape_of,
    sum_to,
    value_of,
)
from ._declare import op as declare_op
from .elementwise import _FORWARD, binary_record

Array = jax.Array
frozen = dataclasses.dataclass(frozen=True, eq=False)

LEAF_MESSAGE = (
    "{op}: in-place operation on a leaf tensor that requires grad (grad_id={gid}) "
    "while recording. Its gradient would be taken with respect to a value that no "
    "longer exists. Update parameters under `with rf.no_grad():` (or outside any "
    "tape), or use the out-of-place op (`y = x + 1`)."
)
SHARED_MESSAGE = (
    "{op}: in-place operation on a tensor whose storage is shared with another "
    "tracked tensor (a view such as a transpose or reshape, grad_id={other}) while "
    "recording. rumus_fx refuses rather than give that view a silently wrong "
    "gradient. Use the out-of-place op, or write under `with rf.no_grad():`."
)
ALIAS_MESSAGE = (
    "{op}: in-place write of a value that depends on a tracked tensor into a storage "
    "that another live tensor views (an untracked {what} of shape {shape}) while "
    "recording. That tensor would show the new value without its history, so its "
    "gradient would silently be zero (PyTorch rebases such views; rumus_fx refuses). "
    "Use the out-of-place op (`y = x * b`), write into a tensor that has no other "
    "views, or drop the other view first; `t.detach()` views are exempt."
)


@frozen
class FillBackward(Record):
    """``x.fill_(v)`` / ``x.zero_()``: the old value gets no gradient; a tensor
    ``v`` (0-d) gets the sum of the output gradient."""

    value_dtype: Any

    def backward(self, g, needs):
        gv = cast(acc_sum(g), self.value_dtype) if needs[1] else None
        return None, gv


@frozen
class CopyBackward(Record):
    """``x.copy_(src)``: the old value gets no gradient; ``src`` gets the output
    gradient summed over the axes it was broadcast along."""

    src_broadcast: BroadcastInfo | None

    def backward(self, g, needs):
        return None, (sum_to(g, self.src_broadcast) if needs[1] else None)


def _recording_tape(self: Tensor, other: Any, op: str) -> Tape | None:
    """The tape the write records on, None for a plain mutation; raises where a
    write while recording would leave an alias silently stale (Note [Aliases
    and in-place writes] in storage.py)."""
    tape = current_tape()
    if tape is None:  # no tape, or no_grad(): in-place ops only mutate
        return None
    if self.grad_id is not None and self._leaf:
        raise AutogradError(LEAF_MESSAGE.format(op=op, gid=self.grad_id))
    stale = self._storage.stale_aliases(self)
    for t in stale:  # a tracked alias: its history would not show the write
        if t.grad_id is not None:
            raise AutogradError(SHARED_MESSAGE.format(op=op, other=t.grad_id))
    other_tracked = isinstance(other, Tensor) and other.grad_id is not None
    if self.grad_id is None and not other_tracked:
        return None  # a constant written into constants
    if stale:  # an untracked alias would show a value that depends on a tracked one
        t = stale[0]
        what = "base" if t.layout == Layout.contiguous(self._storage.buffer.shape) else "view"
        raise AutogradError(ALIAS_MESSAGE.format(op=op, what=what, shape=t.shape))
    return tape


def _cast_result(new: Array, dtype: Any, op: str) -> Array:
    if new.dtype == dtype:
        return new
    if not jnp.can_cast(new.dtype, dtype, casting="same_kind"):
        raise TypeError(f"{op}: result of dtype {new.dtype} cannot be written into a tensor of dtype {dtype}")
    return new.astype(dtype)


def _write(self: Tensor, new: Array, tape: Tape | None, rec: Record | None, other: Any) -> Tensor:
    if tape is None:
        self._storage.write(self.layout, new)
        return self
    ids = (self.grad_id, other.grad_id if isinstance(other, Tensor) else None)
    avals = (Aval(self.shape, self.dtype), aval_of(other))
    # the record saved the pre-write value of self (and of other)
    known = {id(self.value): ids[0]}
    known.setdefault(id(other.value) if isinstance(other, Tensor) else id(other), ids[1])
    self._storage.write(self.layout, new)
    self.grad_id = next_grad_id()
    self._leaf = False
    tape.append(rec, ids, (self.grad_id,), avals, (Aval(self.shape, self.dtype),), provenance=provenance_of(rec, known))
    return self


def _check_into(op: str, self: Tensor, other_shape: tuple[int, ...]) -> None:
    out_shape = broadcast_shapes(op, self.shape, other_shape)
    if out_shape != self.shape:
        raise ShapeError(
            f"{op}: the result has shape {out_shape} but is written into a tensor of shape "
            f"{self.shape}; the other operand must broadcast to {self.shape}"
        )


def binary_(self: Tensor, other: Any, kind: str) -> Tensor:
    op = f"{kind}_"
    ov = value_of(other, op, "other")
    _check_into(op, self, shape_of(ov))
    tape = _recording_tape(self, other, op)
    old = self.value
    new = _cast_result(_FORWARD[kind](old, align_rank(ov, self.ndim)), self.dtype, op)
    rec = None
    if tape is not None:
        shares = isinstance(other, Tensor) and other._storage is self._storage
        rec = binary_record(kind, self, other, old, ov, self.shape, lhs_private=old, rhs_private=ov if shares else None)
    return _write(self, new, tape, rec, other)


@declare_op(records=(FillBackward,), export=False)  # the methods zero_/fill_: tests/test_tensor.py
def fill_(self: Tensor, value: Any, op: str) -> Tensor:
    vv = value_of(value, op, "value")
    if shape_of(vv) != ():
        raise ShapeError(f"{op}: value must be a python scalar or a 0-d tensor, got shape {shape_of(vv)}")
    tape = _recording_tape(self, value, op)
    new = jnp.full(self.shape, vv, self.dtype)
    rec = FillBackward(getattr(vv, "dtype", None)) if tape is not None else None
    return _write(self, new, tape, rec, value)


@declare_op(records=(CopyBackward,), export=False)  # the method copy_
def copy_(self: Tensor, src: Any) -> Tensor:
    op = "copy_"
    sv = value_of(src, op, "src")
    _check_into(op, self, shape_of(sv))
    tape = _recording_tape(self, src, op)
    new = jnp.broadcast_to(align_rank(jnp.asarray(sv), self.ndim), self.shape).astype(self.dtype)
    rec = CopyBackward(broadcast_info(sv, self.shape)) if tape is not None else None
    return _write(self, new, tape, rec, src)
