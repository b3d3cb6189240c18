"""Losses: mse_loss and cross_entropy."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import sharding as shd
from ..autograd.record import Record, VersionSnapshot
from ..errors import ShapeError
from ..kernels import cross_entropy as kce
from ..tensor import Tensor
from ._core import (
    acc_sum,
    array_of,
    cast,
    check_index_range,
    is_tracked,
    new_output,
    reads,
    record,
    require_float,
    shape_of,
    tape_for,
)
from ._declare import BadInput, Sample, array, indices, integers, normal, op, tracked

Array = jax.Array
frozen = dataclasses.dataclass(frozen=True, eq=False)


@frozen
class MseLossBackward(Record):
    """``L = mean((pred - target)^2)``: ``dpred = dL * 2 (pred - target) / N``,
    ``dtarget = -dpred``. Saves both operands."""

    pred: Array
    pred_version: VersionSnapshot | None
    target: Array
    target_version: VersionSnapshot | None
    numel: int
    pred_dtype: Any
    target_dtype: Any

    def backward(self, g, needs):
        diff = self.pred - self.target
        scale = g * (2.0 / self.numel if self.numel else np.nan)  # empty: the gradients are empty too
        gp = diff * scale
        return (
            cast(gp, self.pred_dtype) if needs[0] else None,
            cast(-gp, self.target_dtype) if needs[1] else None,
        )


@op(
    records=(MseLossBackward,),
    ref=lambda p, t: jnp.mean((p - t) ** 2),
    samples=lambda r: [
        Sample((normal(r, 3, 5), normal(r, 3, 5)), diff=(0, 1)),
        Sample((normal(r, 7), normal(r, 7)), diff=(0, 1)),
    ],
    errors=lambda: [
        BadInput("different shapes", (tracked(3, 4), tracked(4, 3)), ShapeError, ("(3, 4)", "(4, 3)")),
        BadInput("broadcastable but not equal", (tracked(3, 4), tracked(3, 1)), ShapeError),
    ],
)
def mse_loss(pred: Any, target: Any) -> Tensor:
    """Mean squared error over all elements; both inputs get gradients (records
    MseLossBackward). Empty inputs give NaN, as ``jnp.mean``."""
    pv = array_of(pred, "mse_loss", "pred")
    tv = array_of(target, "mse_loss", "target")
    if shape_of(pv) != shape_of(tv):
        raise ShapeError(f"mse_loss: pred and target must have the same shape, got {shape_of(pv)} and {shape_of(tv)}")
    diff = pv - tv
    out = acc_sum(diff * diff) / diff.size  # empty inputs: 0 / 0 = NaN, as jnp.mean
    tape = tape_for(pred, target)
    if tape is None:
        return Tensor._wrap(out)
    need = is_tracked(pred) or is_tracked(target)
    p, p_v = reads(pred, need)
    t, t_v = reads(target, need)
    rec = MseLossBackward(p, p_v, t, t_v, diff.size, pv.dtype, tv.dtype)
    return record(tape, rec, (pred, target), new_output(out, tape))


@frozen
class CrossEntropyBackward(Record):
    """Mean cross-entropy of ``logits[..., C]`` against integer targets.

    The gradient ``(softmax - onehot) / count`` is computed in the forward pass
    (fused with the log-sum-exp, as rumus does) and only scaled here, so the
    record reads no tensor data and snapshots nothing.
    """

    grad: Array
    # softmax - onehot cannot give back the logits: backward(create_graph=True)
    # raises here (Note [Create graph] in rumus_fx/lift/higher.py)
    derived_fields = ("grad",)

    def backward(self, g, needs):
        return (self.grad * g.astype(self.grad.dtype), None)


def ref_cross_entropy(logits: Any, targets: Any, ignore_index: int | None = None) -> Array:
    """The jax.numpy oracle of ``cross_entropy`` (op table)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    valid = jnp.ones(targets.shape, bool) if ignore_index is None else targets != ignore_index
    safe = jnp.where(valid, targets, 0)
    picked = jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]
    return -jnp.sum(jnp.where(valid, picked, 0)) / jnp.sum(valid).astype(picked.dtype)


@op(
    records=(CrossEntropyBackward,),
    ref=ref_cross_entropy,
    samples=lambda r: [
        Sample((normal(r, 6, 5), r.integers(0, 5, (6,))), diff=(0,)),
        Sample((normal(r, 2, 3, 7), r.integers(0, 7, (2, 3))), diff=(0,)),
        Sample((normal(r, 7, 4), np.array([0, 3, -100, 1, 2, -100, 3])), {"ignore_index": -100}, diff=(0,)),
    ],
    errors=lambda: [
        BadInput("float targets", (tracked(6, 5), array(np.zeros(6), jnp.float32)), TypeError, ("float32",)),
        BadInput("targets shape", (tracked(6, 5), indices(5)), ShapeError, ("(6, 5)", "(5,)")),
        BadInput("target == C", (tracked(3, 5), array([0, 5, 1])), IndexError, ("5",)),
        BadInput("negative target", (tracked(3, 5), array([0, -1, 1])), IndexError, ("-1",)),
        BadInput(
            "out of range beside ignore_index",
            (tracked(3, 5), array([-100, 7, 1])),
            IndexError,
            ("7",),
            {"ignore_index": -100},
        ),
        BadInput("float ignore_index", (tracked(3, 5), indices(3)), TypeError, ("1.5",), {"ignore_index": 1.5}),
        BadInput("integer logits", (integers(3, 5), indices(3)), TypeError),
        BadInput("scalar logits", (tracked(), array(0)), ShapeError),
    ],
)
def cross_entropy(logits: Any, targets: Any, *, ignore_index: int | None = None) -> Tensor:
    """Mean cross-entropy over all positions of ``logits[..., C]`` with integer
    class ``targets[...]``; positions whose target equals ``ignore_index`` are
    left out of the mean (records CrossEntropyBackward).

    A concrete target outside ``0..C-1`` (other than ``ignore_index``) raises
    ``IndexError``; a traced one (under ``jax.jit``) cannot be checked, so the
    loss and every gradient are then NaN -- as ``embedding`` gives NaN rows
    for out-of-range ids -- never a finite loss of a wrapped-around class."""
    op = "cross_entropy"
    lv = array_of(logits, op, "logits")
    tv = array_of(targets, op, "targets")
    require_float(op, lv, "logits")
    if not jnp.issubdtype(tv.dtype, jnp.integer):
        raise TypeError(f"{op}: targets must be integer class indices, got dtype {tv.dtype}")
    if lv.ndim < 1 or shape_of(tv) != shape_of(lv)[:-1]:
        raise ShapeError(f"{op}: expects logits [..., C] and targets [...], got {shape_of(lv)} and {shape_of(tv)}")
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
        raise TypeError(f"{op}: ignore_index must be an int or None, got {ignore_index!r}")
    c = lv.shape[-1]
    check_index_range(op, tv, c, "target class", ignore_index)
    loss, grad = kce.cross_entropy_fwd(shd.reshape(lv, (-1, c)), shd.reshape(tv, (-1,)), ignore_index)
    if isinstance(tv, jax.core.Tracer):  # unchecked above: an out-of-range target makes it all NaN
        bad = (tv < 0) | (tv >= c)
        if ignore_index is not None:
            bad &= tv != ignore_index
        bad = jnp.any(bad)
        loss, grad = jnp.where(bad, np.nan, loss), jnp.where(bad, np.nan, grad)
    tape = tape_for(logits)
    if tape is None:
        return Tensor._wrap(loss)
    rec = CrossEntropyBackward(shd.reshape(grad, lv.shape, shd.sharding_of(lv)))
    return record(tape, rec, (logits, targets), new_output(loss, tape))
