"""Losses: mse_loss (cross_entropy lives beside it once added)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ..autograd.errors import ShapeError
from ..autograd.record import Record, VersionSnapshot
from ..tensor import Tensor
from ._core import acc_sum, array_of, cast, is_tracked, new_output, reads, record, shape_of, tape_for

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
        scale = g * jnp.asarray(2.0 / self.numel, g.dtype)
        gp = diff * scale
        return (
            cast(gp, self.pred_dtype) if needs[0] else None,
            cast(-gp, self.target_dtype) if needs[1] else None,
        )


def mse_loss(pred: Any, target: Any) -> Tensor:
    """Mean squared error over all elements; both inputs get gradients (records MseLossBackward)."""
    pv = array_of(pred, "mse_loss", "pred")
    tv = array_of(target, "mse_loss", "target")
    if shape_of(pv) != shape_of(tv):
        raise ShapeError(f"mse_loss: pred and target must have the same shape, got {shape_of(pv)} and {shape_of(tv)}")
    diff = pv - tv
    n = max(diff.size, 1)
    out = acc_sum(diff * diff) / jnp.asarray(n, diff.dtype)
    tape = tape_for(pred, target)
    if tape is None:
        return Tensor._wrap(out)
    need = is_tracked(pred) or is_tracked(target)
    p, p_v = reads(pred, need)
    t, t_v = reads(target, need)
    rec = MseLossBackward(p, p_v, t, t_v, diff.size, pv.dtype, tv.dtype)
    return record(tape, rec, (pred, target), new_output(out, tape))
