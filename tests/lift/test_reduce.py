"""The generic variadic ``reduce`` (``lax.reduce`` with a custom computation)
under ``rf.lift``: each operand alone and all together against ``jax.grad``
(which fails when an operand's tangent is a symbolic zero, so the oracle's
undifferentiated operands get a ``0 * x`` term), float64 finite differences, and
the refusals (a tracked initial value; a computation with a primitive rf
cannot differentiate, named with ``reduce``)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import rumus_fx as rf
from rumus_fx.testing import check_fd


def _pick(a, b):
    """Keep the pair whose first element is larger: an argmax carrying a value."""
    take_a = a[0] >= b[0]
    return jnp.where(take_a, a[0], b[0]), jnp.where(take_a, a[1], b[1])


def _pairs(x, y):
    v, w = lax.reduce((x, y), (jnp.array(-jnp.inf, x.dtype), jnp.array(0, y.dtype)), _pick, (0, 2))
    s, p = lax.reduce(
        (x, y), (jnp.array(0, x.dtype), jnp.array(1, y.dtype)), lambda a, b: (a[0] + b[0], a[1] * b[1]), (1,)
    )
    return jnp.sum(v * w) + jnp.sum(jnp.sin(s) * p)


def _oracle(f, nums):
    """``f`` with every operand carrying a (zero) tangent for jax.grad."""

    def g(*args):
        lifted = [a if k in nums else a + 0 * args[nums[0]].sum() for k, a in enumerate(args)]
        return f(*lifted)

    return g


def _args():
    rng = np.random.default_rng(4)
    x = (rng.permutation(30).reshape(5, 2, 3) / 7.0).astype(np.float64)  # distinct: no ties
    return jnp.asarray(x), jnp.asarray(rng.standard_normal((5, 2, 3)))


@pytest.mark.parametrize("nums", [(0,), (1,), (0, 1)])
def test_pair_reductions_match_jax_grad(nums):
    with jax.enable_x64(True):
        args = _args()
        got = rf.grad(rf.lift(_pairs), argnums=nums)(*args)
        want = jax.grad(_oracle(_pairs, nums), argnums=nums)(*args)
        chex.assert_trees_all_close(got, want, rtol=1e-10, atol=1e-10)


def test_pair_reductions_finite_differences():
    check_fd(rf.lift(_pairs), _args(), (0, 1), tol=1e-6)


def test_the_selected_element_gets_the_gradient():
    x = jnp.array([[1.0, 5.0], [3.0, 2.0], [0.0, 4.0]])
    y = jnp.arange(6.0).reshape(3, 2)
    f = lambda x, y: jnp.sum(lax.reduce((x, y), (-jnp.inf, 0.0), _pick, (0,))[1])  # noqa: E731
    g = rf.grad(rf.lift(f), argnums=1)(x, y)
    np.testing.assert_array_equal(g, [[0, 1], [1, 0], [0, 0]])


def test_under_jit_and_vmap():
    with jax.enable_x64(True):
        x, y = _args()
        got = jax.jit(rf.grad(rf.lift(_pairs), argnums=(0, 1)))(x, y)
        want = jax.grad(_pairs, argnums=(0, 1))(x, y)
        chex.assert_trees_all_close(got, want, rtol=1e-10, atol=1e-10)
        per = jax.vmap(rf.grad(rf.lift(_pairs)), in_axes=(0, None))(jnp.stack([x, 2 * x]), y)
        chex.assert_trees_all_close(per[1], jax.grad(_oracle(_pairs, (0,)))(2 * x, y), rtol=1e-10, atol=1e-10)
