"""Primitive rules: reductions, dot_general and shape ops (broadcast, reshape,
transpose, squeeze, concatenate, pad, slice, dynamic slices, rev, split)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import sharding as shd
from .rules import defrule, in_
from .rules_elementwise import unbroadcast

# -- reductions ------------------------------------------------------------------


def _expand(g, aval, axes, sharding=None):
    """Broadcast a reduced gradient back over ``axes`` to ``aval``'s shape (with
    the operand's explicit ``sharding``)."""
    kept = tuple(d for d in range(len(aval.shape)) if d not in axes)
    return lax.broadcast_in_dim(g, tuple(aval.shape), kept, out_sharding=sharding)


def _reduce_sum_vjp(r, g):
    return (_expand(g, r.in_avals[0], tuple(r.p["axes"]), r.in_sharding(0)).astype(r.in_avals[0].dtype),)


defrule("reduce_sum", _reduce_sum_vjp)


def _chooser_vjp(r, g):
    """max/min reductions: the gradient is shared equally by every position that
    attains the extreme value."""
    aval = r.in_avals[0]
    axes = tuple(r.p["axes"])
    x = r.ins[0]
    sh = r.in_sharding(0)
    y = _expand(r.outs[0], aval, axes, sh)
    hit = (x == y).astype(g.dtype)
    count = _expand(jnp.sum(hit, axis=axes), aval, axes, sh)
    return (_expand(g, aval, axes, sh) * hit / count,)


defrule("reduce_max", _chooser_vjp, ((0,), (0,)))
defrule("reduce_min", _chooser_vjp, ((0,), (0,)))


def _reduce_prod_vjp(r, g):
    """Product of all the other elements, without dividing (zeros are exact)."""
    aval = r.in_avals[0]
    axes = tuple(sorted(r.p["axes"]))
    x = r.ins[0]
    keep = [d for d in range(x.ndim) if d not in axes]
    perm = keep + list(axes)
    xt = jnp.transpose(x, perm)
    lead = xt.shape[: len(keep)]
    flat = shd.reshape(xt, (*lead, -1))
    ones = jnp.ones_like(flat[..., :1])
    left = jnp.concatenate([ones, lax.cumprod(flat, axis=flat.ndim - 1)[..., :-1]], axis=-1)
    right = jnp.concatenate([lax.cumprod(flat, axis=flat.ndim - 1, reverse=True)[..., 1:], ones], axis=-1)
    others = shd.reshape(left * right, xt.shape)
    others = jnp.transpose(others, np.argsort(perm))
    return (_expand(g, aval, axes, r.in_sharding(0)) * shd.conform(others, r.in_sharding(0)),)


defrule("reduce_prod", _reduce_prod_vjp, in_(0))


# -- dot_general ----------------------------------------------------------------


def _ranges_except(n, *excluded):
    skip = set()
    for e in excluded:
        skip.update(e)
    return [d for d in range(n) if d not in skip]


def _dot_lhs_grad(g, y, x_aval, dims, swap=False, x_sharding=None):
    """Gradient of ``dot_general(x, y, dims)`` with respect to ``x`` (or to the
    rhs when ``swap``: the output's free dims then come in the other order).
    With ``x``'s explicit sharding the contraction is given it as ``out_sharding``
    (a contraction over a sharded axis, say the batch of a weight gradient, has
    no sharding JAX can infer)."""
    (xc, yc), (xb, yb) = dims
    x_nd, y_nd = len(x_aval.shape), y.ndim
    x_free = _ranges_except(x_nd, xc, xb)
    y_free = _ranges_except(y_nd, yc, yb)
    nb = len(xb)
    if not swap:  # output dims: batch, x_free, y_free
        g_yfree = list(range(nb + len(x_free), nb + len(x_free) + len(y_free)))
    else:  # output dims: batch, y_free (the lhs), x_free (the rhs)
        g_yfree = list(range(nb, nb + len(y_free)))
    g_batch = list(range(nb))
    # res dims: batch (xb order), x_free (g's order), then y's remaining dims = yc sorted
    yc_sorted = sorted(yc)
    x_for_yc = [xc[list(yc).index(d)] for d in yc_sorted]
    order = list(xb) + x_free + x_for_yc  # x dim held by each res dim
    perm = [order.index(d) for d in range(x_nd)]
    out_sharding = None
    if x_sharding is not None:
        spec = tuple(x_sharding.spec) + (None,) * (x_nd - len(x_sharding.spec))
        out_sharding = shd.with_spec(x_sharding, [spec[d] for d in order])
    res = lax.dot_general(g, y.astype(g.dtype), ((g_yfree, y_free), (g_batch, list(yb))), out_sharding=out_sharding)
    return lax.transpose(res, perm).astype(x_aval.dtype)


def _dot_general_vjp(r, g):
    (lc, rc), (lb, rb) = r.p["dimension_numbers"]
    x, y = r.ins
    ax, ay = r.in_avals
    gx = _dot_lhs_grad(g, y, ax, ((lc, rc), (lb, rb)), x_sharding=r.in_sharding(0)) if r.needs[0] else None
    gy = _dot_lhs_grad(g, x, ay, ((rc, lc), (rb, lb)), swap=True, x_sharding=r.in_sharding(1)) if r.needs[1] else None
    return gx, gy


def _dot_saves(needs):
    return tuple(k for k, n in ((1, needs[0]), (0, needs[1])) if n), ()


defrule("dot_general", _dot_general_vjp, _dot_saves)


# -- shape ops --------------------------------------------------------------------


def _broadcast_in_dim_vjp(r, g):
    aval = r.in_avals[0]
    bdims = tuple(r.p["broadcast_dimensions"])
    out_shape = tuple(r.out_avals[0].shape)
    new = [d for d in range(len(out_shape)) if d not in bdims]
    stretched = [bdims[i] for i, s in enumerate(aval.shape) if s == 1 and out_shape[bdims[i]] != 1]
    axes = tuple(sorted(new + stretched))
    if axes:
        g = jnp.sum(g, axis=axes)
    g = shd.conform(shd.reshape(g, aval.shape, out_sharding=r.in_sharding(0)), r.in_sharding(0))
    return (g.astype(aval.dtype),) + (None,) * (len(r.in_avals) - 1)


defrule("broadcast_in_dim", _broadcast_in_dim_vjp)


def _reshape_vjp(r, g):
    shape = tuple(r.in_avals[0].shape)
    sh = r.in_sharding(0)
    dims = r.p.get("dimensions")
    if dims is not None:  # the operand is transposed by ``dimensions`` first
        spec = None if sh is None else tuple(sh.spec) + (None,) * (len(shape) - len(sh.spec))
        moved = None if sh is None else shd.with_spec(sh, [spec[d] for d in dims])
        g = lax.transpose(shd.reshape(g, tuple(shape[d] for d in dims), out_sharding=moved), tuple(np.argsort(dims)))
    return (shd.conform(shd.reshape(g, shape, out_sharding=sh), sh),) + (None,) * (len(r.in_avals) - 1)


def _squeeze_vjp(r, g):
    sh = r.in_sharding(0)
    return (shd.conform(shd.reshape(g, r.in_avals[0].shape, out_sharding=sh), sh),)


defrule("reshape", _reshape_vjp)
defrule("squeeze", _squeeze_vjp)
defrule("expand_dims", _squeeze_vjp)


def _transpose_vjp(r, g):
    perm = tuple(r.p["permutation"])
    return (lax.transpose(g, tuple(np.argsort(perm))),)


defrule("transpose", _transpose_vjp)


def _rev_vjp(r, g):
    return (lax.rev(g, tuple(r.p["dimensions"])),)


defrule("rev", _rev_vjp)


def _concatenate_vjp(r, g):
    dim = r.p["dimension"]
    out = []
    start = 0
    for aval, need in zip(r.in_avals, r.needs):
        size = aval.shape[dim]
        if need:
            out.append(lax.slice_in_dim(g, start, start + size, axis=dim).astype(aval.dtype))
        else:
            out.append(None)
        start += size
    return tuple(out)


defrule("concatenate", _concatenate_vjp)


def _split_vjp(r, g):
    return (lax.concatenate(list(g), r.p["axis"]),)


defrule("split", _split_vjp, multiple_results=True)


def _pad_vjp(r, g):
    cfg = r.p["padding_config"]
    # zero-pad where the padding was negative, then take every (interior+1)-th
    undo = [(max(-lo, 0), max(-hi, 0), 0) for lo, hi, _ in cfg]
    g1 = lax.pad(g, jnp.zeros((), g.dtype), undo)
    starts = [max(lo, 0) for lo, _, _ in cfg]
    limits = [g1.shape[d] - max(hi, 0) for d, (_, hi, _) in enumerate(cfg)]
    strides = [interior + 1 for _, _, interior in cfg]
    g_operand = lax.slice(g1, starts, limits, strides)
    g_operand = g_operand.reshape(r.in_avals[0].shape)
    g_value = None
    if r.needs[1]:
        g_value = unbroadcast(jnp.sum(g) - jnp.sum(g_operand), r.in_avals[1])
    return (g_operand.astype(r.in_avals[0].dtype) if r.needs[0] else None, g_value)


defrule("pad", _pad_vjp)


def _slice_vjp(r, g):
    shape = r.in_avals[0].shape
    start = r.p["start_indices"]
    strides = r.p["strides"] or (1,) * len(shape)
    cfg = []
    for d, (s, st) in enumerate(zip(start, strides)):
        n = g.shape[d]
        used = s + (n - 1) * st + 1 if n else s
        cfg.append((s, shape[d] - used, st - 1) if n else (0, shape[d], 0))
    if any(g.shape[d] == 0 for d in range(g.ndim)):
        return (shd.zeros(shape, g.dtype, r.in_sharding(0)),)
    return (lax.pad(g, jnp.zeros((), g.dtype), cfg),)


defrule("slice", _slice_vjp)


def _dynamic_slice_vjp(r, g):
    aval = r.in_avals[0]
    idx = r.ins[1:]
    z = shd.zeros(aval.shape, g.dtype, r.in_sharding(0))
    return (lax.dynamic_update_slice(z, g, idx),) + (None,) * len(idx)


defrule("dynamic_slice", _dynamic_slice_vjp, lambda needs: (tuple(range(1, len(needs))), ()))


def _dynamic_update_slice_vjp(r, g):
    upd = r.in_avals[1]
    idx = r.ins[2:]
    g_op = lax.dynamic_update_slice(g, shd.zeros(upd.shape, g.dtype, r.in_sharding(1)), idx) if r.needs[0] else None
    g_up = lax.dynamic_slice(g, idx, upd.shape).astype(upd.dtype) if r.needs[1] else None
    return (g_op, g_up) + (None,) * len(idx)


defrule("dynamic_update_slice", _dynamic_update_slice_vjp, lambda needs: (tuple(range(2, len(needs))), ()))


def _stack_vjp(r, g):
    axis = r.p["axis"]
    return tuple(
        lax.index_in_dim(g, k, axis=axis, keepdims=False).astype(a.dtype) if n else None
        for k, (a, n) in enumerate(zip(r.in_avals, r.needs))
    )


defrule("stack", _stack_vjp)


# -- sharding annotations -----------------------------------------------------------


def _reshard_vjp(r, g):
    """``jax.sharding.reshard``: the gradient goes back to the operand's sharding."""
    return (shd.conform(g, r.in_sharding(0)),)


def _sharding_constraint_vjp(r, g):
    """``with_sharding_constraint``: the same constraint on the gradient."""
    return (r._step.prim.bind(g, **dict(r.p)),)


defrule("reshard", _reshard_vjp)
defrule("sharding_constraint", _sharding_constraint_vjp)
