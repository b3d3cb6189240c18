"""Primitive-table entries for indexing and sorting (gather, the scatters, sort, top_k)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from .ptable_base import PInfo, PSample, distinct, normal


def _i(*v):
    return np.array(v, np.int32)


def _with(gen, shape, *extra, diff=(0,)):
    """Samples: one array of ``shape`` from ``gen`` followed by fixed extras."""
    return lambda r: [PSample((gen(r, *shape), *extra), diff)]


def _upd(shape, idx, ushape, gen=normal, ugen=normal, diff=(0, 1)):
    """Samples for ``f(x, updates, idx)``."""
    return lambda r: [PSample((gen(r, *shape), ugen(r, *ushape), idx), diff)]


def _window_gather(x, i):
    """2x2 windows at (row, col) starts; clip mode clamps the windows that stick out."""
    dn = lax.GatherDimensionNumbers(offset_dims=(1, 2), collapsed_slice_dims=(), start_index_map=(0, 1))
    return lax.gather(x, i, dn, (2, 2), mode="clip")


def _window_scatter(x, u, i):
    """Overlapping 2x2 windows, one of them out of bounds (dropped)."""
    dn = lax.ScatterDimensionNumbers(
        update_window_dims=(1, 2), inserted_window_dims=(), scatter_dims_to_operand_dims=(0, 1)
    )
    return lax.scatter(x, i, u, dn) ** 2


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


def _top_k(x, y):
    v, i = lax.top_k(x, 3)
    return v**2 + jnp.take_along_axis(y, i, axis=-1)


def _top_k_axis(x):
    v, _ = lax.top_k(x, 2, axis=0)
    return v * jnp.arange(1.0, 1.0 + v.size).reshape(v.shape)


def _embedding(table, w, ids):
    return jnp.tanh(table[ids] @ w)


DUP = _i(0, 3, 3, 1, 3)  # repeated indices
DUP_OOB = _i(0, 3, 7, 3, -1, 1, -9)  # repeated, out of bounds high and low

ENTRIES: list[PInfo] = [
    # -- gather -----------------------------------------------------------------------
    PInfo("gather_getitem", lambda x, i: x[i] ** 2, _with(normal, (5, 3), DUP), ("gather",), vmap=True),
    PInfo("gather_columns", lambda x, i: jnp.sin(x[:, i]), _with(normal, (3, 5), _i(4, 0, 4, -1)), ("gather",)),
    PInfo("gather_rows_slice", lambda x, i: x[i, 1:3] * 3.0, _with(normal, (5, 4), DUP), ("gather",)),
    PInfo(
        "gather_points",
        lambda x, i, j: x[i, j] ** 2,
        _with(normal, (4, 5), _i(0, 3, 3, 1), _i(2, 4, 4, 0)),
        ("gather",),
    ),
    PInfo(
        "gather_take_along_axis",
        lambda x, i: jnp.take_along_axis(x, i, axis=1) ** 2,
        _with(normal, (3, 4), np.array([[0, 3, 3], [1, 1, 1], [2, 0, -1]], np.int32)),
        ("gather",),
        vmap=True,
    ),
    PInfo(
        "gather_take_clip",
        lambda x, i: jnp.take(x, i, axis=0, mode="clip") ** 2,
        _with(normal, (4, 3), DUP_OOB),
        ("gather",),
    ),
    PInfo(
        "gather_take_fill",
        lambda x, i: jnp.take(x, i, axis=1, mode="fill", fill_value=-1.0) ** 2,
        _with(normal, (3, 4), DUP_OOB),
        ("gather",),
    ),
    PInfo(
        "gather_window_clip",
        _window_gather,
        _with(normal, (4, 5), _i(0, 0, 3, 4, 1, 3, 1, 3).reshape(4, 2)),
        ("gather",),
    ),
    PInfo(
        "gather_embedding",
        _embedding,
        lambda r: [PSample((normal(r, 6, 4), normal(r, 4, 3), np.array([[1, 5, 1], [0, 1, 2]], np.int32)), (0, 1))],
        ("gather", "dot_general"),
        vmap=True,
    ),
    # -- scatter (.at[].set) ---------------------------------------------------------
    PInfo(
        "scatter_set",
        lambda x, u, i: x.at[i].set(u * 2.0) ** 2,
        _upd((5, 3), DUP_OOB, (7, 3)),
        ("scatter",),
        vmap=True,
    ),
    PInfo(
        "scatter_set_unique",
        lambda x, u, i: x.at[i].set(u, unique_indices=True) ** 2,
        _upd((5, 3), _i(4, 0, 2), (3, 3)),
        ("scatter",),
    ),
    PInfo(
        "scatter_set_clip",
        lambda x, u, i: x.at[:, i].set(u, mode="clip") ** 2,
        _upd((3, 5), DUP_OOB, (3, 7)),
        ("scatter",),
    ),
    PInfo(
        "scatter_set_scalar",
        lambda x, u, i: x.at[i, 1].set(u[0]) * x,
        _upd((4, 3), _i(2, 2, 0), (3,)),
        ("scatter",),
    ),
    PInfo(
        "scatter_window",
        _window_scatter,
        _upd((4, 5), _i(0, 0, 1, 1, 3, 4, 1, 1).reshape(4, 2), (4, 2, 2)),
        ("scatter",),
    ),
    PInfo(
        "scatter_put_along_axis",  # operand_batching_dims
        lambda x, u, i: jnp.put_along_axis(x, i, u, axis=1, inplace=False) ** 2,
        _upd((3, 5), np.array([[0, 4, 4], [1, 1, 0], [2, 3, 2]], np.int32), (3, 3)),
        ("scatter",),
    ),
    # -- scatter-add / sub --------------------------------------------------------------
    PInfo(
        "scatter_add",
        lambda x, u, i: jnp.sin(x.at[i].add(u)),
        _upd((5, 3), DUP_OOB, (7, 3)),
        ("scatter-add",),
        vmap=True,
    ),
    PInfo(
        "scatter_add_clip",
        lambda x, u, i: jnp.sin(x.at[:, i].add(u, mode="clip")),
        _upd((3, 5), DUP_OOB, (3, 7)),
        ("scatter-add",),
    ),
    PInfo(
        "scatter_sub",
        lambda x, u, i: jnp.sin(x.at[i].subtract(u)),
        _upd((5, 3), DUP, (5, 3)),
        ("scatter-sub",),
    ),
    # -- scatter-mul: the updates' gradient needs unique indices ------------------------
    PInfo(
        "scatter_mul",
        lambda x, u, i: x.at[i].multiply(u) * x,
        _upd((5, 3), DUP_OOB, (7, 3), diff=(0,)),
        ("scatter-mul",),
    ),
    PInfo(
        "scatter_mul_unique",
        lambda x, u, i: x.at[i].multiply(u, unique_indices=True) ** 2,
        _upd((5, 3), _i(3, 0, 4), (3, 3)),
        ("scatter-mul",),
    ),
    # -- scatter-min / max ------------------------------------------------------------
    PInfo(
        "scatter_min",
        lambda x, u, i: x.at[i].min(u) * 2.0,
        _upd((5, 3), DUP_OOB, (7, 3), distinct, distinct),
        ("scatter-min",),
    ),
    PInfo(
        "scatter_max",
        lambda x, u, i: jnp.sin(x.at[:, i].max(u)),
        _upd((3, 5), DUP_OOB, (3, 7), distinct, distinct),
        ("scatter-max",),
        vmap=True,
    ),
    PInfo(
        "scatter_max_ties",  # equal updates and operand values share the gradient
        lambda x, u, i: x.at[i].max(jnp.round(u)) * jnp.arange(1.0, 16.0).reshape(5, 3),
        _upd((5, 3), DUP, (5, 3), lambda r, *s: np.round(normal(r, *s)), lambda r, *s: 2 * normal(r, *s)),
        ("scatter-max",),
        fd=False,
    ),
    # -- sort ---------------------------------------------------------------------------
    PInfo(
        "sort",
        _sort_each_axis,
        lambda r: [PSample((distinct(r, 3, 4),)), PSample((distinct(r, 2, 3, 4),))],
        ("sort",),
        vmap=True,
    ),
    PInfo(
        "sort_ties",  # tied keys: the stable order decides who gets which gradient
        lambda x: jnp.sort(jnp.round(x), axis=1) * jnp.arange(1.0, 9.0)[None] + jnp.sort(x, axis=1),
        lambda r: [PSample((normal(r, 3, 8),))],
        ("sort",),
        fd=False,
    ),
    PInfo(
        "sort_unstable",
        lambda x: lax.sort(x, dimension=0, is_stable=False) ** 2,
        _with(distinct, (5, 3)),
        ("sort",),
    ),
    PInfo("sort_pairs", _sort_pairs, lambda r: [PSample((distinct(r, 3, 5), normal(r, 3, 5)), (0, 1))], ("sort",)),
    PInfo(
        "sort_two_keys",
        _sort_two_keys,
        lambda r: [PSample((np.array([2, 0, 2, 1, 0, 2], np.int32), distinct(r, 6), normal(r, 6)), (1, 2))],
        ("sort",),
    ),
    PInfo(
        "argsort_take_along_axis",
        _argsort_take,
        lambda r: [PSample((distinct(r, 3, 5), normal(r, 3, 5)), (0, 1))],
        ("sort", "gather"),
    ),
    PInfo("median", lambda x: jnp.median(x, axis=0), _with(distinct, (5, 3)), ("sort", "gather")),
    PInfo(
        "quantile",
        lambda x: jnp.quantile(x, jnp.array([0.1, 0.5, 0.75]), axis=1),
        _with(distinct, (3, 6)),
        ("sort",),
    ),
    # -- top_k ----------------------------------------------------------------------------
    PInfo("top_k", _top_k, lambda r: [PSample((distinct(r, 3, 6), normal(r, 3, 6)), (0, 1))], ("top_k",), vmap=True),
    PInfo("top_k_axis", _top_k_axis, _with(distinct, (5, 3)), ("top_k",)),
]
