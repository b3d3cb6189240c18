"""Rules of ``jax.experimental.sparse``'s BCOO primitives: a sparse array's values
(``data``) carry gradients, its ``indices`` never do (they are integers).

A BCOO array of shape ``batch + sparse + dense`` is ``data`` of shape
``batch + (nse,) + dense`` and ``indices`` of shape ``batch + (nse, n_sparse)``;
an index equal to the dimension's size marks padding, which ``todense`` drops.
Each primitive is linear in ``data`` (and ``bcoo_dot_general`` in its dense
operand too), so each rule is the transpose of the primitive, written with the
other BCOO primitives:

- ``bcoo_todense`` -> ``bcoo_extract`` of the cotangent at the indices (every
  index, duplicates included: each value was added into its position);
- ``bcoo_extract`` (``assume_unique=True``) -> ``bcoo_todense``; with
  ``assume_unique=False`` jax sums duplicates into the first of them and its
  transpose is not implemented, so rf refuses it by name as jax.grad does;
- ``bcoo_fromdense`` -> ``bcoo_todense`` of the data's cotangent at the output's
  indices (the padding's values are constant zeros);
- ``bcoo_transpose`` -> the inverse permutation of the data's batch and dense
  axes (the sparse axes only reorder the indices' columns);
- ``bcoo_dot_general`` -> for the dense operand, a ``bcoo_dot_general`` of the
  sparse operand with the cotangent; for ``data``, the cotangent contracted with
  the dense operand and sampled at the indices (``bcoo_dot_general_sampled``:
  never the dense matrix, so a large sparse operand stays affordable) where the
  indices can be reordered to the product's axis order, else the dense product
  extracted at the indices;
- ``bcoo_dot_general_sampled`` -> the cotangent made dense at the indices, then
  ``dot_general``'s two gradients.

Sparse-sparse products (``bcoo_spdot_general``), ``bcoo_sort_indices``,
``bcoo_sum_duplicates`` and the BCSR/COO/CSR primitives have no rule: refused by name.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import sparse
from jax.experimental.sparse.util import SparseInfo

from ..autograd.registry import BadProgram, Sample, TableEntry
from ..errors import AutogradError
from .rules import defrule
from .rules_structural import _dot_lhs_grad

# -- helpers ------------------------------------------------------------------------


def _unbroadcast(aval: Any, x: Any) -> Any:
    """``x`` summed over the axes where ``aval`` has size 1 and ``x`` does not (a
    BCOO's data may broadcast its batch axes against the indices')."""
    axes = tuple(k for k, (a, b) in enumerate(zip(aval.shape, x.shape)) if a == 1 and b != 1)
    if axes:
        x = jnp.sum(x, axes, keepdims=True)
    return x.astype(aval.dtype)


def _todense(data: Any, indices: Any, shape: tuple[int, ...]) -> Any:
    return sparse.bcoo_todense_p.bind(data, indices, spinfo=SparseInfo(tuple(shape)))


def _extract(indices: Any, dense: Any) -> Any:
    return sparse.bcoo_extract_p.bind(indices, dense, assume_unique=True)


# -- bcoo_todense -------------------------------------------------------------------


def _todense_vjp(r, g):
    return _unbroadcast(r.in_avals[0], _extract(r.ins[1], g)), None


_INDICES = np.array([[0, 1], [2, 3], [1, 0], [2, 3], [3, 4]], np.int32)  # a duplicate and a padding row
_SHAPE = (3, 4)


def _data_samples(r):
    return [Sample((r.standard_normal(5),), diff=(0,))]


def _bcoo(data: Any, indices: Any = _INDICES, shape: tuple[int, ...] = _SHAPE) -> Any:
    return sparse.BCOO((data, jnp.asarray(indices)), shape=shape)


defrule(
    "bcoo_todense",
    _todense_vjp,
    lambda needs: ((1,) if needs[0] else (), ()),
    table=(
        TableEntry(
            "bcoo_todense", lambda d: jnp.sin(_bcoo(d).todense()) * jnp.arange(12.0).reshape(3, 4), _data_samples
        ),
        TableEntry(  # a batch axis and a dense axis
            "bcoo_todense_batched",
            lambda d: jnp.cos(
                sparse.BCOO((d, jnp.array([[[0], [2]], [[1], [1]]], np.int32)), shape=(2, 3, 2)).todense()
            ),
            lambda r: [Sample((r.standard_normal((2, 2, 2)),), diff=(0,))],
        ),
    ),
)


# -- bcoo_extract -------------------------------------------------------------------


def _extract_vjp(r, g):
    if not r.params["assume_unique"]:
        raise AutogradError(
            "rf.lift: bcoo_extract with assume_unique=False (jax.experimental.sparse.bcoo_extract of an array whose "
            "indices may repeat) sums repeated indices into the first of them and has no rule in rf.lift "
            "(jax.grad cannot transpose it either); pass assume_unique=True or sum_duplicates() first."
        )
    return None, _todense(g, r.ins[0], r.in_avals[1].shape)


def _extract_samples(r):
    return [Sample((r.standard_normal(_SHAPE),), diff=(0,))]


def _extract_refused() -> list[BadProgram]:
    def f(m):
        return jnp.sum(sparse.bcoo_extract(_bcoo(jnp.ones(5)), m, assume_unique=False).data ** 2)

    return [BadProgram("bcoo_extract_not_unique", f, (np.ones(_SHAPE, np.float32),), AutogradError, ("assume_unique",))]


defrule(
    "bcoo_extract",
    _extract_vjp,
    lambda needs: ((0,) if needs[1] else (), ()),
    table=(
        TableEntry(
            "bcoo_extract",
            lambda m: jnp.sin(sparse.bcoo_extract(_bcoo(jnp.ones(5)), m * m, assume_unique=True).data),
            _extract_samples,
        ),
    ),
    errors=_extract_refused,
)


# -- bcoo_fromdense -----------------------------------------------------------------


def _fromdense_vjp(r, g):
    gd, _ = g
    if gd is None:
        return (None,)
    return (_todense(gd, r.outs[1], r.in_avals[0].shape).astype(r.in_avals[0].dtype),)


def _fromdense_program(m):
    # the sparsity pattern is that of m's nonzeros, with two padding entries
    s = sparse.BCOO.fromdense(jnp.where(jnp.abs(m) > 0.5, m, 0.0), nse=8)
    return jnp.sum(jnp.sin(s.data) * jnp.arange(8.0)) + jnp.sum(s.todense() ** 2)


defrule(
    "bcoo_fromdense",
    _fromdense_vjp,
    lambda needs: ((), (1,) if needs[0] else ()),
    multiple_results=True,
    table=(
        TableEntry(
            "bcoo_fromdense",
            _fromdense_program,
            lambda r: [Sample((np.array([[0.9, 0.1, -1.2], [0.0, 2.0, 0.3], [-0.7, 0.8, 0.2]]),), diff=(0,))],
            fd=False,  # the pattern (|m| > 0.5) is constant near the sample: checked against jax.grad only
        ),
    ),
)


# -- bcoo_transpose -----------------------------------------------------------------


def _transpose_vjp(r, g):
    gd, _ = g
    if gd is None:
        return None, None
    perm = r.params["permutation"]
    a_data, a_idx = r.in_avals
    n_batch = len(a_idx.shape) - 2
    n_dense = len(a_data.shape) - n_batch - 1
    nd = len(perm)
    # the data's axes: the batch axes permuted among themselves, nse, the dense axes among themselves
    data_perm = list(perm[:n_batch]) + [n_batch] + [p - (nd - n_dense) + n_batch + 1 for p in perm[nd - n_dense :]]
    return lax.transpose(gd, tuple(int(k) for k in np.argsort(data_perm))), None


defrule(
    "bcoo_transpose",
    _transpose_vjp,
    ((), ()),
    multiple_results=True,
    table=(
        TableEntry(
            "bcoo_transpose", lambda d: jnp.sin(_bcoo(d).T.todense()) * jnp.arange(12.0).reshape(4, 3), _data_samples
        ),
        TableEntry(  # batch axes permuted, and dense axes
            "bcoo_transpose_batched",
            lambda d: (
                jnp.cos(
                    sparse.bcoo_transpose(
                        sparse.BCOO(
                            (d, jnp.zeros((2, 3, 2, 1), np.int32).at[:, :, 1, 0].set(2)), shape=(2, 3, 4, 2, 3)
                        ),
                        permutation=(1, 0, 2, 4, 3),
                    ).todense()
                )
                * jnp.arange(144.0).reshape(3, 2, 4, 3, 2)
            ),
            lambda r: [Sample((r.standard_normal((2, 3, 2, 2, 3)),), diff=(0,))],
        ),
    ),
)


# -- bcoo_dot_general ---------------------------------------------------------------


def _remaining(n: int, *taken: Any) -> list[int]:
    used = {int(d) for t in taken for d in t}
    return [d for d in range(n) if d not in used]


def _dot_general_vjp(r, g):
    (lc, rc), (lb, rb) = r.params["dimension_numbers"]
    spinfo = r.params["lhs_spinfo"]
    a_data, a_idx, a_rhs = r.in_avals
    lhs_nd, rhs_nd = len(spinfo.shape), len(a_rhs.shape)
    lhs_kept, rhs_kept = _remaining(lhs_nd, lc, lb), _remaining(rhs_nd, rc, rb)
    nb = len(lb)
    ans_batch = list(range(nb))
    ans_lhs = list(range(nb, nb + len(lhs_kept)))
    ans_rhs = list(range(nb + len(lhs_kept), nb + len(lhs_kept) + len(rhs_kept)))
    data, indices, rhs = r.ins
    n_batch = len(a_idx.shape) - 2
    n_dense = len(a_data.shape) - n_batch - 1
    g_data = g_rhs = None
    if r.needs[0]:
        dims = ((tuple(ans_rhs), tuple(rhs_kept)), (tuple(ans_batch), tuple(rb)))
        # the product's axes hold the lhs's batch, kept, then contracted axes (in the rhs's order)
        order = list(lb) + lhs_kept + [int(d) for d in np.take(lc, np.argsort(rc))]
        if order == list(range(lhs_nd)) or (n_batch == 0 and n_dense == 0):
            # every axis sparse (or none moved): reorder the index columns, sample the product there
            sampled = indices if order == list(range(lhs_nd)) else indices[..., np.array(order)]
            g_data = sparse.bcoo_dot_general_sampled_p.bind(g, rhs.astype(g.dtype), sampled, dimension_numbers=dims)
        else:  # batch or dense axes moved: the dense product, extracted at the indices
            dense = lax.transpose(lax.dot_general(g, rhs.astype(g.dtype), dims), tuple(np.argsort(order)))
            g_data = _extract(indices, dense)
        g_data = _unbroadcast(a_data, g_data)
    if r.needs[2]:
        dims = ((tuple(lhs_kept), tuple(ans_lhs)), (tuple(lb), tuple(ans_batch)))
        if any(d >= lhs_nd - n_dense for d in lhs_kept):  # bcoo_dot_general cannot contract a dense axis
            lhs = _todense(data.astype(g.dtype), indices, spinfo.shape)
            out = lax.dot_general(lhs, g, dims)
        else:
            out = sparse.bcoo_dot_general_p.bind(
                data.astype(g.dtype), indices, g, dimension_numbers=dims, lhs_spinfo=spinfo, preferred_element_type=None
            )
        # out's axes: batch, the lhs's contracted axes (in the lhs's order), the rhs's kept axes
        held = list(rb) + [int(d) for d in np.take(rc, np.argsort(lc))] + rhs_kept
        g_rhs = lax.transpose(out, tuple(int(k) for k in np.argsort(held))).astype(a_rhs.dtype)
    return g_data, None, g_rhs


def _dot_saves(needs):
    return tuple(k for k, n in ((1, needs[0] or needs[2]), (2, needs[0]), (0, needs[2])) if n), ()


def _batched(d: Any) -> Any:
    """A BCOO of shape (2, 3, 4): a batch axis, a sparse axis, a dense axis."""
    return sparse.BCOO((d, jnp.array([[[0], [2]], [[1], [1]]], np.int32)), shape=(2, 3, 4))


_BATCHED_DIMS = (((1,), (1,)), ((0,), (0,)))


def _sparse_dense(r):
    return [Sample((r.standard_normal(5), r.standard_normal((4, 2))), diff=(0, 1))]


defrule(
    "bcoo_dot_general",
    _dot_general_vjp,
    _dot_saves,
    table=(
        TableEntry("bcoo_dot_general", lambda d, x: jnp.tanh(_bcoo(d) @ x), _sparse_dense),
        TableEntry(  # S^T @ y: the sparse axes reordered for the sampled product
            "bcoo_dot_general_transposed",
            lambda d, y: jnp.tanh(_bcoo(d).T @ y),
            lambda r: [Sample((r.standard_normal(5), r.standard_normal((3, 2))), diff=(0, 1))],
        ),
        TableEntry(  # a dense lhs: x @ S (jax writes it as S^T x^T)
            "bcoo_dot_general_rdot",
            lambda d, x: jnp.sin(x @ _bcoo(d)),
            lambda r: [Sample((r.standard_normal(5), r.standard_normal((2, 3))), diff=(0, 1))],
        ),
        TableEntry(  # batch axes on both sides, and a dense axis on the sparse side (jax.grad fails on
            # it: the oracle is the same product of the dense matrix)
            "bcoo_dot_general_batched",
            lambda d, x: jnp.sin(sparse.bcoo_dot_general(_batched(d), x, dimension_numbers=_BATCHED_DIMS)),
            lambda r: [Sample((r.standard_normal((2, 2, 4)), r.standard_normal((2, 3, 5))), diff=(0, 1))],
            oracle=lambda d, x: jnp.sin(lax.dot_general(_batched(d).todense(), x, _BATCHED_DIMS)),
        ),
    ),
)


# -- bcoo_dot_general_sampled -------------------------------------------------------


def _sampled_vjp(r, g):
    dims = r.params["dimension_numbers"]
    (ac, bc), (ab, bb) = dims
    a, b, indices = r.ins
    a_aval, b_aval, _ = r.in_avals
    # the product's shape: batch, a's kept axes, b's kept axes
    shape = (
        [a_aval.shape[d] for d in ab]
        + [a_aval.shape[d] for d in _remaining(len(a_aval.shape), ac, ab)]
        + [b_aval.shape[d] for d in _remaining(len(b_aval.shape), bc, bb)]
    )
    dense = _todense(g, indices, tuple(shape))
    ga = _dot_lhs_grad(dense, b, a_aval, dims) if r.needs[0] else None
    gb = _dot_lhs_grad(dense, a, b_aval, ((bc, ac), (bb, ab)), swap=True) if r.needs[1] else None
    return ga, gb, None


defrule(
    "bcoo_dot_general_sampled",
    _sampled_vjp,
    lambda needs: (tuple(k for k, n in ((2, needs[0] or needs[1]), (1, needs[0]), (0, needs[1])) if n), ()),
    table=(
        TableEntry(
            "bcoo_dot_general_sampled",
            lambda a, b: jnp.sin(
                sparse.bcoo_dot_general_sampled(a, b, jnp.asarray(_INDICES), dimension_numbers=(((1,), (0,)), ((), ())))
            ),
            lambda r: [Sample((r.standard_normal((3, 2)), r.standard_normal((2, 4))), diff=(0, 1))],
        ),
    ),
)
