"""Indexing and sorting rules of ``rf.lift`` beyond the primitive table (the cases
without a gradient are declared error cases of their rules, run by the error
audit): ``sort``/``top_k`` save only what they need."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

import rumus_fx as rf

IDX = jnp.array([0, 2, 2])


def _grad(f, *args, argnums=0):
    return rf.grad(lambda *a: rf.sum(rf.lift(f)(*a)), argnums=argnums)(*args)


def test_scatter_mul_operand_gradient_with_repeated_indices():
    """The updates' gradient raises here (a declared error case of the
    'scatter-mul' rule, run by tests/test_errors_audit.py); the operand's is defined."""
    x, u = jnp.ones((4, 2)), jnp.full((3, 2), 2.0)
    g = _grad(lambda x, u: x.at[IDX].multiply(u), x, u, argnums=0)
    np.testing.assert_allclose(g, [[2, 2], [1, 1], [4, 4], [1, 1]])


def _residual_bytes(f, *args):
    with rf.Tape() as tape:
        ts = [rf.tensor(a, requires_grad=True) for a in args]
        rf.lift(f)(*ts)
    (entry,) = tape.entries
    return sum(int(np.asarray(r).nbytes) for r in entry.op.residuals)


def test_argsort_saves_only_the_keys():
    x = jnp.arange(12.0).reshape(3, 4)[::-1]
    # the keys (float32) and nothing else: not the iota, not the sorted outputs
    assert _residual_bytes(lambda x: jnp.argsort(x, axis=1).astype(x.dtype) + jnp.sort(x, axis=0), x) == x.nbytes


def test_top_k_saves_only_the_indices():
    x = jnp.arange(12.0).reshape(3, 4)
    assert _residual_bytes(lambda x: lax.top_k(x, 2)[0], x) == 3 * 2 * 4  # int32 indices
