"""Scaled dot-product attention as one fused record (flash-style kernel on GPU)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..autograd.record import Record, VersionSnapshot, exact_value
from ..errors import AutogradError, ShapeError
from ..kernels import attention as kattn
from ..tensor import Tensor
from ._core import (
    array_of,
    broadcast_info,
    broadcast_shapes,
    is_real_scalar,
    new_output,
    reads,
    record,
    require_float,
    shape_of,
    sum_to,
    tape_for,
)
from ._declare import BadInput, Sample, array, integers, normal, op, tracked

Array = jax.Array
frozen = dataclasses.dataclass(frozen=True, eq=False)


@frozen
class ScaledDotProductAttentionBackward(Record):
    """``o = softmax(q k^T * scale + mask) v`` over the last two axes.

    Saves q, k, v (snapshotted), the output and the per-row log-sum-exp, so the
    backward recomputes the probabilities block by block instead of keeping the
    [Sq, Sk] matrix. The mask is kept at its own shape (broadcast to the scores
    again in backward). A float (additive) mask that is tracked gets a gradient.
    """

    q: Array
    q_version: VersionSnapshot | None
    k: Array
    k_version: VersionSnapshot | None
    v: Array
    v_version: VersionSnapshot | None
    mask: Array | None
    mask_version: VersionSnapshot | None
    out: Array
    lse: Array
    causal: bool
    scale: float
    mask_broadcast: Any
    derived_fields = ("lse",)

    def derive(self, entry: Any, env: dict[int, Any]) -> ScaledDotProductAttentionBackward:
        """The log-sum-exp as a function of the (substituted) q, k and mask."""
        if len(entry.inputs) > 3 and entry.inputs[3] is not None:
            if not any(name == "mask" and gid is not None for name, _, gid in entry.provenance):
                raise AutogradError(
                    "tape.backward(create_graph=True): scaled_dot_product_attention keeps its "
                    "tracked mask broadcast, not the mask itself, so its backward cannot be "
                    "differentiated through the mask; take the inner gradient with rf.grad / "
                    "rf.vjp inside the outer function instead."
                )
        lse = kattn.attention_lse(self.q, self.k, self.mask, causal=self.causal, scale=self.scale)
        return dataclasses.replace(self, lse=exact_value(self.lse, lse))

    def backward(self, g, needs):
        want_mask = len(needs) > 3 and needs[3]
        mask = None
        if self.mask is not None:
            mask = _broadcast_mask(self.mask, (*self.q.shape[:-1], self.k.shape[-2]))
        dq, dk, dv, dmask = kattn.attention_bwd(
            self.q,
            self.k,
            self.v,
            mask,
            self.out,
            self.lse,
            g,
            causal=self.causal,
            scale=self.scale,
            mask_grad=want_mask,
        )
        dm = sum_to(dmask, self.mask_broadcast) if want_mask else None
        return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None, dm)[: len(needs)]


def _broadcast_mask(mask: Array, scores_shape: tuple[int, ...]) -> Array:
    """``mask`` (broadcastable to the scores) at the scores' full shape."""
    return jnp.broadcast_to(mask.reshape((1,) * (len(scores_shape) - mask.ndim) + mask.shape), scores_shape)


def ref_attention(q: Any, k: Any, v: Any, mask: Any = None, causal: bool = False) -> Array:
    """The jax.numpy oracle of ``scaled_dot_product_attention`` (op table)."""
    s = jnp.einsum("...qd,...kd->...qk", q, k) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf) if mask.dtype == bool else s + mask
    if causal:
        sq, sk = s.shape[-2:]
        s = jnp.where(np.tril(np.ones((sq, sk), bool)), s, -jnp.inf)
    return jnp.einsum("...qk,...kd->...qd", jax.nn.softmax(s, axis=-1), v)


def _attention_samples(r: np.random.Generator) -> list[Sample]:
    mask = (r.uniform(size=(5, 5)) > 0.3) | np.eye(5, dtype=bool)
    return [
        Sample((normal(r, 2, 5, 3), normal(r, 2, 7, 3), normal(r, 2, 7, 4)), diff=(0, 1, 2)),
        Sample((normal(r, 2, 2, 6, 4), normal(r, 2, 2, 6, 4), normal(r, 2, 2, 6, 4)), {"causal": True}, diff=(0, 1, 2)),
        Sample((normal(r, 3, 5, 4), normal(r, 3, 5, 4), normal(r, 3, 5, 4), mask), diff=(0, 1, 2)),
        Sample((normal(r, 4, 3), normal(r, 5, 3), normal(r, 5, 2), normal(r, 4, 5)), diff=(0, 1, 2, 3)),
    ]


def _attention_errors() -> list[BadInput]:
    return [
        BadInput("rank-1 q", (tracked(4), tracked(4), tracked(4)), ShapeError),
        BadInput("ranks differ", (tracked(2, 5, 4), tracked(5, 4), tracked(5, 4)), ShapeError),
        BadInput("q and k widths", (tracked(5, 4), tracked(6, 3), tracked(6, 2)), ShapeError),
        BadInput("k and v lengths", (tracked(5, 4), tracked(6, 4), tracked(7, 2)), ShapeError),
        BadInput("leading axes differ", (tracked(2, 5, 4), tracked(3, 6, 4), tracked(3, 6, 2)), ShapeError),
        BadInput(
            "mask shape",
            (tracked(5, 4), tracked(6, 4), tracked(6, 2), array(np.ones((5, 5), bool))),
            ShapeError,
            ("(5, 5)",),
        ),
        BadInput(
            "causal not a bool", (tracked(5, 4), tracked(5, 4), tracked(5, 2)), TypeError, kwargs={"causal": "yes"}
        ),
        BadInput(
            "integer mask", (tracked(5, 4), tracked(5, 4), tracked(5, 2), array(np.ones((5, 5)), jnp.int32)), TypeError
        ),
        BadInput("scale a string", (tracked(5, 4), tracked(5, 4), tracked(5, 2)), TypeError, kwargs={"scale": "x"}),
        BadInput("integer q", (integers(5, 4), tracked(5, 4), tracked(5, 2)), TypeError),
        BadInput("zero keys", (tracked(5, 4), tracked(0, 4), tracked(0, 2)), ShapeError, ("Sk = 0",)),
    ]


@op(
    records=(ScaledDotProductAttentionBackward,),
    ref=ref_attention,
    samples=_attention_samples,
    errors=_attention_errors,
    rtol32=1e-4,
    atol32=1e-4,
)
def scaled_dot_product_attention(
    q: Any, k: Any, v: Any, mask: Any = None, causal: bool = False, scale: float | None = None
) -> Tensor:
    """Attention of ``q:[..., Sq, D]`` over ``k:[..., Sk, D]``, ``v:[..., Sk, Dv]``.

    ``mask`` (broadcastable to ``[..., Sq, Sk]``) is boolean (True = attend) or
    float (added to the scores); ``causal=True`` lets query ``i`` see keys
    ``j <= i`` (top-left aligned, as PyTorch); ``scale`` defaults to
    ``1/sqrt(D)``. A row with every key masked attends uniformly, as with a
    large negative bias (records ScaledDotProductAttentionBackward)."""
    op = "scaled_dot_product_attention"
    qv, kv, vv = (array_of(t, op, n) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    for name, t in (("q", qv), ("k", kv), ("v", vv)):
        require_float(op, t, name)
    if qv.ndim < 2 or kv.ndim != qv.ndim or vv.ndim != qv.ndim:
        raise ShapeError(f"{op}: q, k, v must have the same rank >= 2, got {qv.shape}, {kv.shape}, {vv.shape}")
    if qv.shape[:-2] != kv.shape[:-2] or kv.shape[:-2] != vv.shape[:-2]:
        raise ShapeError(f"{op}: q, k, v must share leading axes, got {qv.shape}, {kv.shape}, {vv.shape}")
    if qv.shape[-1] != kv.shape[-1] or kv.shape[-2] != vv.shape[-2]:
        raise ShapeError(
            f"{op}: expects q [..., Sq, D], k [..., Sk, D], v [..., Sk, Dv], got {qv.shape}, {kv.shape}, {vv.shape}"
        )
    if kv.shape[-2] == 0:
        raise ShapeError(f"{op}: k and v have zero keys (Sk = 0, k {kv.shape}): there is nothing to attend to")
    if not isinstance(causal, bool):
        raise TypeError(f"{op}: causal must be a bool, got {causal!r}")
    sk = kv.shape[-2]
    scores_shape = (*qv.shape[:-1], sk)
    mv = None
    mask_info = None
    if mask is not None:
        mv = array_of(mask, op, "mask")
        if mv.dtype != jnp.bool_:
            require_float(op, mv, "mask")
        if broadcast_shapes(op, shape_of(mv), scores_shape) != scores_shape:
            raise ShapeError(f"{op}: mask of shape {shape_of(mv)} does not broadcast to the scores {scores_shape}")
        mask_info = broadcast_info(mask if not isinstance(mask, Tensor) else mask.value, scores_shape)
    if scale is None:
        scale = 1.0 / math.sqrt(qv.shape[-1])
    if not is_real_scalar(scale):
        raise TypeError(f"{op}: scale must be a python float or None, got {scale!r}")
    scale = float(scale)
    full_mask = None if mv is None else _broadcast_mask(mv, scores_shape)
    out, lse = kattn.attention_fwd(qv, kv, vv, full_mask, causal=causal, scale=scale)
    inputs = (q, k, v) if mask is None else (q, k, v, mask)
    tape = tape_for(*inputs)
    if tape is None:
        return Tensor._wrap(out)
    saved = [reads(t, True) for t in (q, k, v)]
    mask_version = reads(mask, True)[1] if mask is not None else None
    rec = ScaledDotProductAttentionBackward(
        *saved[0], *saved[1], *saved[2], mv, mask_version, out, lse, causal, scale, mask_info
    )
    return record(tape, rec, inputs, new_output(out, tape))
