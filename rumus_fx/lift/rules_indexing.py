"""Primitive rules: indexing and sorting (gather, the scatters, sort, top_k).

Note [Indexing and sorting rules]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every formula here gives what ``jax.grad`` gives, including where the
mathematics leaves a choice:

* Out-of-range indices: each gradient lands where the forward read or wrote.
  ``gather``'s gradient is a ``scatter-add`` of the cotangent with the gather's
  own mode, so out-of-bounds rows (``fill``) get nothing and clamped rows
  (``clip``) get the gradient of every read; an update's gradient is read back
  with the scatter's mode (nothing for a dropped write). ``promise_in_bounds``
  with an index that breaks the promise is implementation-defined; rf follows
  what the forward did (XLA's gather clamps such an index, its scatter skips
  the write), so the gather's gradient goes to the clamped row and a skipped
  update gets none. ``jax.grad`` drops the first and gives the second one (its
  transposes swap the two behaviours); rf's values are the forward's
  derivatives (finite differences agree).
* ``scatter`` (``.at[].set``) with possibly duplicate indices: the winning update
  at each position is found by scattering update ids (1, 2, ...) with the
  forward's indices and mode, once, in the forward (XLA leaves the winner to the
  device; an H200 keeps another than this CPU, and not the same one in every
  program: ``_scatter_forward`` builds the
  output from those winners and keeps the ids), and gathering them back in the
  backward (default mode). An
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
from ..autograd.registry import BadProgram, Sample, TableEntry
from ..errors import AutogradError
from ..ops._declare import distinct, normal
from .rules import defrule, is_float, saves_inputs, saves_outputs

# -- primitive-table samples -----------------------------------------------------------


def _i(*v):
    return np.array(v, np.int32)


def _with(gen, shape, *extra, diff=(0,)):
    """Samples: one array of ``shape`` from ``gen`` followed by fixed extras."""
    return lambda r: [Sample((gen(r, *shape), *extra), diff=diff)]


def _upd(shape, idx, ushape, gen=normal, ugen=normal, diff=(0, 1)):
    """Samples for ``f(x, updates, idx)``."""
    return lambda r: [Sample((gen(r, *shape), ugen(r, *ushape), idx), diff=diff)]


DUP = (0, 3, 3, 1, 3)  # repeated indices
DUP_OOB = (0, 3, 7, 3, -1, 1, -9)  # repeated, out of bounds high and low

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
    gd, sizes = _gather_of_scatter(r.params["dimension_numbers"], r.in_avals[0].shape, r.in_avals[2].shape)
    return lax.gather(x, r.ins[1], gd, sizes, mode=mode, fill_value=fill_value)


def _written(r):
    """The gather mode that reads back, for each update, where the scatter ``r``
    wrote it: the scatter's own mode, except that an out-of-range index under
    ``promise_in_bounds`` (the forward's scatter skipped that write) reads 0."""
    mode = r.params["mode"]
    if mode == lax.GatherScatterMode.PROMISE_IN_BOUNDS:
        return lax.GatherScatterMode.FILL_OR_DROP
    return mode


def _scatter_kw(r):
    return dict(
        dimension_numbers=r.params["dimension_numbers"],
        indices_are_sorted=r.params["indices_are_sorted"],
        unique_indices=r.params["unique_indices"],
        mode=r.params["mode"],
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
    mode = r.params["mode"]
    if mode == lax.GatherScatterMode.PROMISE_IN_BOUNDS:
        mode = lax.GatherScatterMode.CLIP  # what the forward's gather did with such an index
    out = lax.scatter_add(
        zeros,
        r.ins[1],
        g,
        _scatter_dnums_of_gather(r.params["dimension_numbers"]),
        indices_are_sorted=r.params["indices_are_sorted"],
        unique_indices=r.params["unique_indices"],
        mode=mode,
    )
    return out.astype(aval.dtype), None


def _window_gather(x, i):
    """2x2 windows at (row, col) starts; clip mode clamps the windows that stick out."""
    dn = lax.GatherDimensionNumbers(offset_dims=(1, 2), collapsed_slice_dims=(), start_index_map=(0, 1))
    return lax.gather(x, i, dn, (2, 2), mode="clip")


def _embedding(table, w, ids):
    return jnp.tanh(table[ids] @ w)


defrule(
    "gather",
    _gather_vjp,
    saves_inputs(1),
    table=(
        TableEntry("gather_getitem", lambda x, i: x[i] ** 2, _with(normal, (5, 3), _i(*DUP)), vmap=True),
        TableEntry("gather_columns", lambda x, i: jnp.sin(x[:, i]), _with(normal, (3, 5), _i(4, 0, 4, -1))),
        TableEntry("gather_rows_slice", lambda x, i: x[i, 1:3] * 3.0, _with(normal, (5, 4), _i(*DUP))),
        TableEntry(
            "gather_points",
            lambda x, i, j: x[i, j] ** 2,
            _with(normal, (4, 5), _i(0, 3, 3, 1), _i(2, 4, 4, 0)),
        ),
        TableEntry(
            "gather_take_along_axis",
            lambda x, i: jnp.take_along_axis(x, i, axis=1) ** 2,
            _with(normal, (3, 4), np.array([[0, 3, 3], [1, 1, 1], [2, 0, -1]], np.int32)),
            vmap=True,
        ),
        TableEntry(
            "gather_take_clip",
            lambda x, i: jnp.take(x, i, axis=0, mode="clip") ** 2,
            _with(normal, (4, 3), _i(*DUP_OOB)),
        ),
        TableEntry(
            "gather_take_fill",
            lambda x, i: jnp.take(x, i, axis=1, mode="fill", fill_value=-1.0) ** 2,
            _with(normal, (3, 4), _i(*DUP_OOB)),
        ),
        TableEntry(
            "gather_window_clip",
            _window_gather,
            _with(normal, (4, 5), _i(0, 0, 3, 4, 1, 3, 1, 3).reshape(4, 2)),
        ),
        TableEntry(
            "gather_embedding",
            _embedding,
            lambda r: [
                Sample((normal(r, 6, 4), normal(r, 4, 3), np.array([[1, 5, 1], [0, 1, 2]], np.int32)), diff=(0, 1))
            ],
            prims=("gather", "dot_general"),
            vmap=True,
        ),
    ),
)


# -- scatter-add / scatter-sub ----------------------------------------------------


def _scatter_add_vjp(r, g, sign=1):
    g_op = g if r.needs[0] else None
    g_up = None
    if r.needs[2]:
        g_up = _read_back(r, g, mode=_written(r), fill_value=0)
        if sign < 0:
            g_up = -g_up
    return g_op, None, g_up


defrule(
    "scatter-add",
    _scatter_add_vjp,
    saves_inputs(1),
    table=(
        TableEntry(
            "scatter_add",
            lambda x, u, i: jnp.sin(x.at[i].add(u)),
            _upd((5, 3), _i(*DUP_OOB), (7, 3)),
            vmap=True,
        ),
        TableEntry(
            "scatter_add_clip",
            lambda x, u, i: jnp.sin(x.at[:, i].add(u, mode="clip")),
            _upd((3, 5), _i(*DUP_OOB), (3, 7)),
        ),
    ),
)


def _scatter_sub_vjp(r, g):
    return _scatter_add_vjp(r, g, -1)


defrule(
    "scatter-sub",
    _scatter_sub_vjp,
    saves_inputs(1),
    table=(TableEntry("scatter_sub", lambda x, u, i: jnp.sin(x.at[i].subtract(u)), _upd((5, 3), _i(*DUP), (5, 3))),),
)


# -- scatter-mul ----------------------------------------------------------------


def _scatter_mul_vjp(r, g):
    g_op = g_up = None
    if r.needs[0]:
        g_op = lax.scatter_mul(g, r.ins[1], r.ins[2], **_scatter_kw(r))
    if r.needs[2]:
        g_up = _read_back(r, g * r.ins[0], mode=_written(r), fill_value=0)
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


def _scatter_mul_errors():
    return [
        BadProgram(
            "updates with repeated indices",
            lambda x, u: x.at[np.array([0, 2, 2])].multiply(u),
            (np.ones((4, 2)), np.full((3, 2), 2.0)),
            AutogradError,
            ("rf.lift", "unique_indices"),
            argnums=1,
        )
    ]


defrule(
    "scatter-mul",
    _scatter_mul_vjp,
    _scatter_mul_saves,
    table=(
        # the updates' gradient needs unique indices
        TableEntry(
            "scatter_mul",
            lambda x, u, i: x.at[i].multiply(u) * x,
            _upd((5, 3), _i(*DUP_OOB), (7, 3), diff=(0,)),
        ),
        TableEntry(
            "scatter_mul_unique",
            lambda x, u, i: x.at[i].multiply(u, unique_indices=True) ** 2,
            _upd((5, 3), _i(3, 0, 4), (3, 3)),
        ),
    ),
    errors=_scatter_mul_errors,
)


# -- scatter-min / scatter-max ----------------------------------------------------


def _scatter_extremal_vjp(r, g, scatter):
    """``scatter``: ``lax.scatter_max`` or ``lax.scatter_min``. jax's
    tie-sharing scheme: the cotangent of a position is split equally among the
    updates that attain it and (if it does) the original value.

    The scatter is run again on the saved operand and updates rather than its
    output saved: the winners are found by comparing values, and a compiled
    forward may round a saved value and the copy it scattered differently (as
    for ``reduce_max``: ``_chooser_vjp`` in rules_structural.py); a max or min
    of the saved values is always one of them."""
    x, idx, y = r.ins
    out = scatter(x, idx, y, **_scatter_kw(r))
    dn = r.params["dimension_numbers"]
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
    u = _read_back(r, g, mode=_written(r), fill_value=0)
    g_op = g_up = None
    if r.needs[0]:
        g_op = g + lax.scatter_add(jnp.zeros_like(g), idx, u * op_coef, dn)
    if r.needs[2]:
        g_up = u * up_coef
    return g_op, None, g_up


def _round_normal(r, *s):
    return np.round(normal(r, *s))


def _twice_normal(r, *s):
    return 2 * normal(r, *s)


def _scatter_min_vjp(r, g):
    return _scatter_extremal_vjp(r, g, lax.scatter_min)


def _scatter_max_vjp(r, g):
    return _scatter_extremal_vjp(r, g, lax.scatter_max)


defrule(
    "scatter-min",
    _scatter_min_vjp,
    ((0, 1, 2), ()),
    table=(
        TableEntry(
            "scatter_min",
            lambda x, u, i: x.at[i].min(u) * 2.0,
            _upd((5, 3), _i(*DUP_OOB), (7, 3), distinct, distinct),
        ),
    ),
)
defrule(
    "scatter-max",
    _scatter_max_vjp,
    ((0, 1, 2), ()),
    table=(
        TableEntry(
            "scatter_max",
            lambda x, u, i: jnp.sin(x.at[:, i].max(u)),
            _upd((3, 5), _i(*DUP_OOB), (3, 7), distinct, distinct),
            vmap=True,
        ),
        TableEntry(
            "scatter_max_ties",  # equal updates and operand values share the gradient
            lambda x, u, i: x.at[i].max(jnp.round(u)) * jnp.arange(1.0, 16.0).reshape(5, 3),
            _upd((5, 3), _i(*DUP), (5, 3), _round_normal, _twice_normal),
            fd=False,
        ),
    ),
)


# -- scatter (.at[].set) ----------------------------------------------------------


def _update_ids(dn, up_shape, sharding):
    """A distinct id (1, 2, ...) for each update of a scatter, as an updates-shaped
    array (one id per window: a window is written as a whole)."""
    ids_shape = [1 if d in dn.update_window_dims else s for d, s in enumerate(up_shape)]
    n_ids = math.prod(ids_shape)
    id_dtype = np.uint64 if n_ids > _UINT32_MAX else np.uint32
    ids = lax.iota(id_dtype, n_ids).reshape(ids_shape) + jnp.ones((), id_dtype)
    return shd.broadcast_in_dim(ids, up_shape, tuple(range(len(up_shape))), sharding)  # ids: meshless (an iota)


def _scatter_forward(step, vals):
    """A ``scatter`` whose indices may repeat, run so that its backward knows
    which update won each position (Note [Indexing and sorting rules]).

    XLA leaves the winner among duplicate writes to the implementation, and on a
    GPU it is not the same in every program: a second scatter in the backward could pick
    another winner than the forward did, and give the gradient to an update whose
    value is not in the output. So the forward scatters update ids once, keeps
    them (the record's ``extra``), and builds its output from them: the winning
    update where an id landed (a scatter-add of the winners alone onto ``-0.0``,
    exact, signed zeros included), the operand elsewhere. The value is the
    scatter's own, read back with its mode, as jax's derivative builds its
    primal."""
    if step.params["unique_indices"]:
        return step.bind(vals), ()
    x, idx, u = vals
    dn = step.params["dimension_numbers"]
    kw = _scatter_kw(step)
    sh = step.in_shardings or (None,) * 3
    ids = _update_ids(dn, tuple(step.in_avals[2].shape), sh[2])
    landed = lax.scatter(shd.zeros(x.shape, ids.dtype, sh[0]), idx, ids, **kw)
    gd, sizes = _gather_of_scatter(dn, x.shape, u.shape)
    won = ids == lax.gather(landed, idx, gd, sizes, mode=_written(step), fill_value=0)
    nothing = jnp.array(-0.0, u.dtype)
    # (not jnp.full_like: on jax 0.11 it drops x's sharding under jit without set_mesh,
    # Note [Broadcasting a meshless value] in rumus_fx/sharding.py)
    fill_x, fill_u = (
        jnp.full_like(v, nothing) if s is None else shd.broadcast_to(nothing, v.shape, s)
        for v, s in ((x, sh[0]), (u, sh[2]))
    )
    written = lax.scatter_add(fill_x, idx, lax.select(won, u, fill_u), **kw)
    return (lax.select(landed == 0, x, written),), landed


def _scatter_vjp(r, g):
    idx = r.ins[1]
    dn = r.params["dimension_numbers"]
    up_shape = tuple(r.in_avals[2].shape)
    g_op = g_up = None
    if r.params["unique_indices"]:
        if r.needs[0]:
            g_op = lax.scatter(g, idx, shd.zeros(up_shape, g.dtype, r.in_sharding(2)), **_scatter_kw(r))
        if r.needs[2]:
            g_up = _read_back(r, g, mode=_written(r), fill_value=0)
        return g_op, None, g_up
    # which update won each position: the ids the forward scattered (``_scatter_forward``)
    landed = r.extra
    if r.needs[0]:
        g_op = lax.select(landed == 0, g, jnp.zeros_like(g))
    if r.needs[2]:
        won = _update_ids(dn, up_shape, r.in_sharding(2)) == _read_back(r, landed)
        g_up = _read_back(r, g, mode=_written(r), fill_value=0)
        g_up = lax.select(won, g_up, jnp.zeros_like(g_up))
    return g_op, None, g_up


_scatter_vjp.prepare = _no_combiner


def _window_scatter(x, u, i):
    """Overlapping 2x2 windows, one of them out of bounds (dropped)."""
    dn = lax.ScatterDimensionNumbers(
        update_window_dims=(1, 2), inserted_window_dims=(), scatter_dims_to_operand_dims=(0, 1)
    )
    return lax.scatter(x, i, u, dn) ** 2


def _scatter_errors():
    return [
        BadProgram(
            "apply",
            lambda x: x.at[np.array([0, 2, 2])].apply(jnp.sin),
            (np.ones(4),),
            AutogradError,
            ("rf.lift", "apply"),
        )
    ]


defrule(
    "scatter",
    _scatter_vjp,
    saves_inputs(1),
    forward=_scatter_forward,
    table=(
        TableEntry(
            "scatter_set",
            lambda x, u, i: x.at[i].set(u * 2.0) ** 2,
            _upd((5, 3), _i(*DUP_OOB), (7, 3)),
            vmap=True,
        ),
        TableEntry(
            "scatter_set_unique",
            lambda x, u, i: x.at[i].set(u, unique_indices=True) ** 2,
            _upd((5, 3), _i(4, 0, 2), (3, 3)),
        ),
        TableEntry(
            "scatter_set_clip",
            lambda x, u, i: x.at[:, i].set(u, mode="clip") ** 2,
            _upd((3, 5), _i(*DUP_OOB), (3, 7)),
        ),
        TableEntry(
            "scatter_set_scalar",
            lambda x, u, i: x.at[i, 1].set(u[0]) * x,
            _upd((4, 3), _i(2, 2, 0), (3,)),
        ),
        TableEntry(
            "scatter_window",
            _window_scatter,
            _upd((4, 5), _i(0, 0, 1, 1, 3, 4, 1, 1).reshape(4, 2), (4, 2, 2)),
        ),
        TableEntry(
            "scatter_put_along_axis",  # operand_batching_dims
            lambda x, u, i: jnp.put_along_axis(x, i, u, axis=1, inplace=False) ** 2,
            _upd((3, 5), np.array([[0, 4, 4], [1, 1, 0], [2, 3, 2]], np.int32), (3, 3)),
        ),
    ),
    errors=_scatter_errors,
)


# -- sort -----------------------------------------------------------------------


def _sort_vjp(r, g):
    dim = r.params["dimension"]
    nk = r.params["num_keys"]
    shape = tuple(r.in_avals[0].shape)
    keys = r.ins[:nk]
    iota = lax.broadcasted_iota(
        np.int32 if shape[dim] < 2**31 - 1 else np.int64, shape, dim, out_sharding=r.in_sharding(0)
    )
    perm = lax.sort((*keys, iota), dimension=dim, is_stable=r.params["is_stable"], num_keys=nk)[-1]
    # an output without a cotangent (None) gives its operand none: jax's transpose
    # leaves it a symbolic zero (Note [An unused output adds nothing] in program.py)
    want = [k for k, (a, n) in enumerate(zip(r.in_avals, r.needs)) if n and is_float(a) and g[k] is not None]
    if not want:
        return (None,) * len(r.in_avals)
    # sorting by the permutation puts each cotangent back where it came from
    back = lax.sort((perm, *(g[k] for k in want)), dimension=dim, is_stable=False, num_keys=1)[1:]
    out = [None] * len(r.in_avals)
    for k, gk in zip(want, back):
        out[k] = gk
    return tuple(out)


_sort_vjp.takes_none = True


def _sort_saves(needs, params):
    return tuple(range(params["num_keys"])), ()


def _sort_each_axis(x):  # (jnp.stack is a primitive of its own: concatenate here)
    return jnp.concatenate([jnp.sort(x, axis=a) for a in range(x.ndim)])


def _sort_pairs(k, v):
    a, b = lax.sort((k, v), dimension=1, num_keys=1)
    return jnp.concatenate([a, b * 2.0])


def _sort_two_keys(k1, k2, v):
    _, b, c = lax.sort((k1, k2, v), dimension=0, num_keys=2)
    return jnp.concatenate([b, c])


def _argsort_take(x, y):
    order = jnp.argsort(x, axis=1)
    return jnp.take_along_axis(y, order, axis=1) * jnp.take_along_axis(x, order, axis=1)


defrule(
    "sort",
    _sort_vjp,
    _sort_saves,
    multiple_results=True,
    table=(
        TableEntry(
            "sort",
            _sort_each_axis,
            lambda r: [Sample((distinct(r, 3, 4),)), Sample((distinct(r, 2, 3, 4),))],
            vmap=True,
        ),
        TableEntry(
            "sort_ties",  # tied keys: the stable order decides who gets which gradient
            lambda x: jnp.sort(jnp.round(x), axis=1) * jnp.arange(1.0, 9.0)[None] + jnp.sort(x, axis=1),
            lambda r: [Sample((normal(r, 3, 8),))],
            fd=False,
        ),
        TableEntry(
            "sort_unstable",
            lambda x: lax.sort(x, dimension=0, is_stable=False) ** 2,
            _with(distinct, (5, 3)),
        ),
        TableEntry(
            "sort_pairs",
            _sort_pairs,
            lambda r: [Sample((distinct(r, 3, 5), normal(r, 3, 5)), diff=(0, 1))],
        ),
        TableEntry(
            "sort_two_keys",
            _sort_two_keys,
            lambda r: [Sample((np.array([2, 0, 2, 1, 0, 2], np.int32), distinct(r, 6), normal(r, 6)), diff=(1, 2))],
        ),
        TableEntry(
            "argsort_take_along_axis",
            _argsort_take,
            lambda r: [Sample((distinct(r, 3, 5), normal(r, 3, 5)), diff=(0, 1))],
            prims=("sort", "gather"),
        ),
        TableEntry("median", lambda x: jnp.median(x, axis=0), _with(distinct, (5, 3)), prims=("sort", "gather")),
        TableEntry(
            "quantile",
            lambda x: jnp.quantile(x, jnp.array([0.1, 0.5, 0.75]), axis=1),
            _with(distinct, (3, 6)),
        ),
    ),
)


# -- top_k ------------------------------------------------------------------------


def _top_k_vjp(r, g):
    aval = r.in_avals[0]
    idx = r.outs[1]
    rank = idx.ndim
    axis = r.params.get("axis", r.params.get("reduction_dimension", rank - 1))  # top_k / approx_top_k
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


def _selected_and_gathered(select):
    """A program of ``(x, y)``: the values ``select(x)`` picks, squared, plus
    ``y`` gathered at their indices (both arguments reach the rule)."""

    def f(x, y):
        v, i = select(x)
        return v**2 + jnp.take_along_axis(y, i, axis=-1)

    return f


def _selected_weighted(select):
    """A program of ``x``: the values ``select(x)`` picks, each weighted differently."""

    def f(x):
        v, _ = select(x)
        return v * jnp.arange(1.0, 1.0 + v.size).reshape(v.shape)

    return f


def _pair_samples(r):
    return [Sample((distinct(r, 3, 6), normal(r, 3, 6)), diff=(0, 1))]


defrule(
    "top_k",
    _top_k_vjp,
    saves_outputs(1),
    multiple_results=True,
    table=(
        TableEntry("top_k", _selected_and_gathered(lambda x: lax.top_k(x, 3)), _pair_samples, vmap=True),
        TableEntry("top_k_axis", _selected_weighted(lambda x: lax.top_k(x, 2, axis=0)), _with(distinct, (5, 3))),
    ),
)


# approx_top_k (``lax.approx_max_k``/``approx_min_k``): the gradient goes back to
# the positions the returned indices name, along ``reduction_dimension`` (exact
# top-k on CPU and GPU; on TPU the same rule transposes whatever it selected).
defrule(
    "approx_top_k",
    _top_k_vjp,
    saves_outputs(1),
    multiple_results=True,
    table=(
        TableEntry("approx_max_k", _selected_and_gathered(lambda x: lax.approx_max_k(x, 3)), _pair_samples, vmap=True),
        TableEntry(
            "approx_min_k_axis",
            _selected_weighted(lambda x: lax.approx_min_k(x, 2, reduction_dimension=0)),
            _with(distinct, (5, 3)),
        ),
        TableEntry(  # not aggregated to k: more candidates than k come back
            "approx_top_k_candidates",
            _selected_weighted(lambda x: lax.approx_max_k(x, 2, reduction_dimension=0, aggregate_to_topk=False)),
            _with(distinct, (300, 2)),
        ),
    ),
)
