"""Primitive rules: indexing and sorting (gather, the scatters, sort, top_k).

Note [Indexing and sorting rules]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every formula here gives what ``jax.grad`` gives, including where the
mathematics leaves a choice:

* ``gather``'s gradient is a ``scatter-add`` of the cotangent with the gather's
  own mode, so out-of-bounds rows (``fill``) get nothing and clamped rows
  (``clip``) get the gradient of every read.
* ``scatter`` (``.at[].set``) with possibly duplicate indices: the winning update
  at each position is found in the backward by scattering update ids (1, 2, ...)
  with the forward's indices and mode and gathering them back (default mode). An
  update gets its cotangent where its id came back; the operand gets it where no
  id landed. This is the scheme of jax's own derivative, so ``mode='clip'``
  behaves as there too (a clamped out-of-bounds write gives its gradient to
  nobody). With ``unique_indices`` the operand gradient is the cotangent with
  the written positions zeroed.
* ``scatter-min``/``scatter-max`` share the cotangent of a position equally among
  the updates and the original value that attain it (jax's normalisation).
* ``scatter-mul``: the operand gradient is a ``scatter-mul`` of the cotangent by
  the updates; the updates gradient exists only with ``unique_indices`` (jax has
  none for duplicates, and neither has rf: ``AutogradError`` when it is needed).
* ``sort`` saves only its ``num_keys`` key operands; the backward sorts them
  again with an iota to recover the permutation and sorts the cotangents back by
  it. Integer operands (an ``argsort``'s iota) get no gradient.
* ``top_k``'s values scatter their cotangent back to the saved indices.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import sharding as shd
from ..errors import AutogradError
from .rules import defrule, in_, is_float, out_

_UINT32_MAX = int(np.iinfo(np.uint32).max)


# -- dimension-number conversions ---------------------------------------------------


def _scatter_dnums_of_gather(d):
    """The scatter that is the transpose of a gather with numbers ``d``."""
    return lax.ScatterDimensionNumbers(
        update_window_dims=tuple(d.offset_dims),
        inserted_window_dims=tuple(d.collapsed_slice_dims),
        scatter_dims_to_operand_dims=tuple(d.start_index_map),
        operand_batching_dims=tuple(d.operand_batching_dims),
        scatter_indices_batching_dims=tuple(d.start_indices_batching_dims),
    )


def _gather_of_scatter(d, operand_shape, updates_shape):
    """The gather that reads back what a scatter with numbers ``d`` wrote: its
    dimension numbers and slice sizes."""
    gd = lax.GatherDimensionNumbers(
        offset_dims=tuple(d.update_window_dims),
        collapsed_slice_dims=tuple(d.inserted_window_dims),
        start_index_map=tuple(d.scatter_dims_to_operand_dims),
        operand_batching_dims=tuple(d.operand_batching_dims),
        start_indices_batching_dims=tuple(d.scatter_indices_batching_dims),
    )
    sizes = []
    pos = 0
    for i in range(len(operand_shape)):
        if i in d.inserted_window_dims or i in d.operand_batching_dims:
            sizes.append(1)
        else:
            sizes.append(updates_shape[d.update_window_dims[pos]])
            pos += 1
    return gd, tuple(sizes)


def _read_back(r, x, mode=None, fill_value=None):
    """Gather from ``x`` (operand-shaped) what the scatter ``r`` wrote there, one
    value per update element; ``mode=None`` is the default (fill)."""
    gd, sizes = _gather_of_scatter(r.p["dimension_numbers"], r.in_avals[0].shape, r.in_avals[2].shape)
    return lax.gather(x, r.ins[1], gd, sizes, mode=mode, fill_value=fill_value)


def _scatter_kw(r):
    return dict(
        dimension_numbers=r.p["dimension_numbers"],
        indices_are_sorted=r.p["indices_are_sorted"],
        unique_indices=r.p["unique_indices"],
        mode=r.p["mode"],
    )


def _no_combiner(step):
    """A ``scatter`` that applies a function (``.at[].apply``) has no rule."""
    if step.params.get("update_jaxpr") is not None:
        raise AutogradError(
            "rf.lift: no backward rule for a 'scatter' that applies a function to the "
            "operand (x.at[...].apply); jax has none either"
        )


# -- gather ---------------------------------------------------------------------


def _gather_vjp(r, g):
    aval = r.in_avals[0]
    zeros = shd.zeros(aval.shape, g.dtype, r.in_sharding(0))
    out = lax.scatter_add(
        zeros,
        r.ins[1],
        g,
        _scatter_dnums_of_gather(r.p["dimension_numbers"]),
        indices_are_sorted=r.p["indices_are_sorted"],
        unique_indices=r.p["unique_indices"],
        mode=r.p["mode"],
    )
    return out.astype(aval.dtype), None


defrule("gather", _gather_vjp, in_(1))


# -- scatter-add / scatter-sub ----------------------------------------------------


def _scatter_add_vjp(r, g, sign=1):
    g_op = g if r.needs[0] else None
    g_up = None
    if r.needs[2]:
        g_up = _read_back(r, g, mode=r.p["mode"], fill_value=0)
        if sign < 0:
            g_up = -g_up
    return g_op, None, g_up


defrule("scatter-add", _scatter_add_vjp, in_(1))
defrule("scatter-sub", lambda r, g: _scatter_add_vjp(r, g, -1), in_(1))


# -- scatter-mul ----------------------------------------------------------------


def _scatter_mul_vjp(r, g):
    g_op = g_up = None
    if r.needs[0]:
        g_op = lax.scatter_mul(g, r.ins[1], r.ins[2], **_scatter_kw(r))
    if r.needs[2]:
        g_up = _read_back(r, g * r.ins[0], mode=r.p["mode"], fill_value=0)
    return g_op, None, g_up


def _scatter_mul_prepare(step):
    if step.needs[2] and not step.params["unique_indices"]:
        raise AutogradError(
            "rf.lift: the gradient of 'scatter-mul' (x.at[idx].multiply(y)) with respect to "
            "the updates y is only defined here for unique_indices=True (jax has none for "
            "possibly repeated indices either); pass unique_indices=True if the indices are "
            "distinct, or write the product another way"
        )


_scatter_mul_vjp.prepare = _scatter_mul_prepare


def _scatter_mul_saves(needs):
    ins = [1]
    if needs[0]:
        ins.append(2)
    if needs[2]:
        ins.append(0)
    return tuple(ins), ()


defrule("scatter-mul", _scatter_mul_vjp, _scatter_mul_saves)


# -- scatter-min / scatter-max ----------------------------------------------------


def _scatter_extremal_vjp(r, g):
    """jax's tie-sharing scheme: the cotangent of a position is split equally
    among the updates that attain it and (if it does) the original value."""
    x, idx, y = r.ins
    out = r.outs[0]
    dn = r.p["dimension_numbers"]
    initial = _read_back(r, x)
    target = _read_back(r, out)
    won = y == target
    kept = initial == target
    zeros = shd.zeros(x.shape, x.dtype, r.in_sharding(0))
    ones = jnp.ones_like(y)
    n_won = _read_back(r, lax.scatter_add(zeros, idx, lax.select(won, ones, jnp.zeros_like(y)), dn))
    n_refs = _read_back(r, lax.scatter_add(zeros, idx, ones, dn))
    up_norm = lax.select(kept, 1.0 / (n_won + 1), 1.0 / n_won)
    up_coef = lax.select(won, up_norm, jnp.zeros_like(y))
    op_norm = lax.select(kept, 1.0 / (n_won + 1), jnp.zeros_like(n_won))
    op_coef = (-1.0 + op_norm) / n_refs
    u = _read_back(r, g, mode=r.p["mode"], fill_value=0)
    g_op = g_up = None
    if r.needs[0]:
        g_op = g + lax.scatter_add(jnp.zeros_like(g), idx, u * op_coef, dn)
    if r.needs[2]:
        g_up = u * up_coef
    return g_op, None, g_up


defrule("scatter-min", _scatter_extremal_vjp, ((0, 1, 2), (0,)))
defrule("scatter-max", _scatter_extremal_vjp, ((0, 1, 2), (0,)))


# -- scatter (.at[].set) ----------------------------------------------------------


def _scatter_vjp(r, g):
    idx = r.ins[1]
    dn = r.p["dimension_numbers"]
    up_shape = tuple(r.in_avals[2].shape)
    g_op = g_up = None
    if r.p["unique_indices"]:
        if r.needs[0]:
            g_op = lax.scatter(g, idx, shd.zeros(up_shape, g.dtype, r.in_sharding(2)), **_scatter_kw(r))
        if r.needs[2]:
            g_up = _read_back(r, g, mode=r.p["mode"], fill_value=0)
        return g_op, None, g_up
    # which update won each position: scatter update ids, read them back
    ids_shape = [1 if d in dn.update_window_dims else s for d, s in enumerate(up_shape)]
    n_ids = math.prod(ids_shape)
    id_dtype = np.uint64 if n_ids > _UINT32_MAX else np.uint32
    ids = lax.iota(id_dtype, n_ids).reshape(ids_shape) + jnp.ones((), id_dtype)
    ids = lax.broadcast_in_dim(ids, up_shape, tuple(range(len(up_shape))), out_sharding=r.in_sharding(2))
    landed = lax.scatter(shd.zeros(r.in_avals[0].shape, id_dtype, r.in_sharding(0)), idx, ids, **_scatter_kw(r))
    if r.needs[0]:
        g_op = lax.select(landed == 0, g, jnp.zeros_like(g))
    if r.needs[2]:
        won = ids == _read_back(r, landed)
        g_up = _read_back(r, g, mode=r.p["mode"], fill_value=0)
        g_up = lax.select(won, g_up, jnp.zeros_like(g_up))
    return g_op, None, g_up


_scatter_vjp.prepare = _no_combiner

defrule("scatter", _scatter_vjp, in_(1))


# -- sort -----------------------------------------------------------------------


def _sort_vjp(r, g):
    dim = r.p["dimension"]
    nk = r.p["num_keys"]
    shape = tuple(r.in_avals[0].shape)
    keys = r.ins[:nk]
    iota = lax.broadcasted_iota(
        np.int32 if shape[dim] < 2**31 - 1 else np.int64, shape, dim, out_sharding=r.in_sharding(0)
    )
    perm = lax.sort((*keys, iota), dimension=dim, is_stable=r.p["is_stable"], num_keys=nk)[-1]
    want = [k for k, (a, n) in enumerate(zip(r.in_avals, r.needs)) if n and is_float(a)]
    if not want:
        return (None,) * len(r.in_avals)
    # sorting by the permutation puts each cotangent back where it came from
    back = lax.sort((perm, *(g[k] for k in want)), dimension=dim, is_stable=False, num_keys=1)[1:]
    out = [None] * len(r.in_avals)
    for k, gk in zip(want, back):
        out[k] = gk
    return tuple(out)


def _sort_saves(needs, params):
    return tuple(range(params["num_keys"])), ()


defrule("sort", _sort_vjp, _sort_saves, multiple_results=True)


# -- top_k ------------------------------------------------------------------------


def _top_k_vjp(r, g):
    aval = r.in_avals[0]
    idx = r.outs[1]
    rank = idx.ndim
    axis = r.p.get("axis", rank - 1)
    axis = axis % rank if rank else 0
    others = tuple(d for d in range(rank) if d != axis)
    dn = lax.ScatterDimensionNumbers(
        update_window_dims=(),
        inserted_window_dims=(axis,),
        scatter_dims_to_operand_dims=(axis,),
        operand_batching_dims=others,
        scatter_indices_batching_dims=others,
    )
    zeros = shd.zeros(aval.shape, g[0].dtype, r.in_sharding(0))
    return (lax.scatter_add(zeros, shd.reshape(idx, (*idx.shape, 1)), g[0], dn),)


defrule("top_k", _top_k_vjp, out_(1), multiple_results=True)
