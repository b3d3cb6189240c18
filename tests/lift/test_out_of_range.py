"""Out-of-range indices under ``rf.lift``: every gather / scatter mode and the
dynamic slices, the gradient landing exactly where the forward read or wrote
(a clamped index at the clamped position, a dropped one nowhere).

Oracles: ``jax.grad`` of the same program for ``clip``, ``fill`` and ``drop``
and for the dynamic slices; for ``promise_in_bounds`` (implementation-defined
with an index that breaks the promise) ``jax.grad`` of the program whose
forward is the same — XLA's gather clamps such an index like ``clip``, its
scatter skips the write like ``drop`` — checked value for value; float64 finite
differences on top. Each differentiable argument alone and both together."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import rumus_fx as rf
from rumus_fx.testing import check_fd

IDX = np.array([0, 3, 7, 3, -1, 1, -9, 12], np.int32)  # repeated, past the end, negative, below -size
W = np.arange(1.0, 25.0).reshape(8, 3) / 10


def _programs(mode):
    w = jnp.asarray(W)

    def get(x, u):
        return jnp.sum(jnp.sin(x.at[IDX].get(mode=mode, fill_value=0.5) * u * w))

    def add(x, u):
        return jnp.sum(x.at[IDX].add(u * w, mode=mode) ** 2)

    def put(x, u):
        return jnp.sum(x.at[IDX].set(u * w, mode=mode) ** 2 * x)

    def mx(x, u):
        return jnp.sum(jnp.sin(x.at[IDX].max(u * w, mode=mode)))

    return {"get": get, "add": add, "set": put, "max": mx}


def _all(programs):
    """One program summing every case (one trace per argument subset)."""
    return lambda x, u: sum(f(x, u) for f in programs.values())


def _subsets():
    return [(0,), (1,), (0, 1)]


def _args():
    rng = np.random.default_rng(3)
    return jnp.asarray(rng.standard_normal((5, 3))), jnp.asarray(rng.standard_normal((8, 3)))


def _assert_grads(f_rf, f_ref, args):
    for nums in _subsets():
        got = rf.grad(lambda *a: f_rf(*a), argnums=nums)(*args)
        want = jax.grad(f_ref, argnums=nums)(*args)
        chex.assert_trees_all_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "mode", ["clip", pytest.param("fill", marks=pytest.mark.slow), pytest.param("drop", marks=pytest.mark.slow)]
)
def test_gather_scatter_modes_match_jax_grad(mode):
    with jax.enable_x64(True):
        args = _args()
        f = _all(_programs(mode))
        _assert_grads(rf.lift(f), f, args)


# promise_in_bounds: the forward of the same program in the mode that does the same
_SAME_FORWARD = {"get": "clip", "add": "drop", "set": "drop", "max": "drop"}


def test_promise_in_bounds_follows_the_forward():
    with jax.enable_x64(True):
        args = _args()
        promised = _programs("promise_in_bounds")
        twins = {name: _programs(mode)[name] for name, mode in _SAME_FORWARD.items()}
        for name, f in promised.items():
            np.testing.assert_allclose(f(*args), twins[name](*args), rtol=1e-12)  # the forwards agree
        f = _all(promised)
        _assert_grads(rf.lift(f), _all(twins), args)
        check_fd(rf.lift(f), args, (0, 1), tol=1e-6)


def test_promise_in_bounds_gather_gradient_reaches_the_clamped_row():
    """jax.grad drops this row's gradient although its forward read it (an index
    past the end clamped to the last row)."""
    x = jnp.arange(6.0).reshape(3, 2)
    f = lambda x: jnp.sum(x.at[np.array([5])].get(mode="promise_in_bounds"))  # noqa: E731
    assert float(jnp.sum(f(x))) == 4.0 + 5.0  # the forward reads row 2
    np.testing.assert_array_equal(rf.grad(rf.lift(f))(x), [[0, 0], [0, 0], [1, 1]])


def _dynamic(x, u, i):
    """Slices and writes at starts below -size, negative, inside and past the end."""
    out = []
    for k in range(0, i.shape[0], 2):
        start = (i[k], i[k + 1])
        out.append(lax.dynamic_slice(x, start, (2, 3)).reshape(-1))
        x = lax.dynamic_update_slice(x, u * (k + 1.0), start)
    out.append(x.reshape(-1))
    y = jnp.concatenate(out)
    return jnp.sum(jnp.sin(y) * jnp.arange(1, 1 + y.shape[0]).astype(y.dtype))


STARTS = [
    np.array([-7, 1], np.int32),  # below -size: the forward reads from row 0
    np.array([-1, -9], np.int32),
    np.array([3, 4], np.int32),  # past the end: clamped to size - window
    np.array([9, -2], np.int32),
    np.array([1, 1], np.int32),
]


def test_dynamic_slices_clamp_like_the_forward():
    with jax.enable_x64(True):
        rng = np.random.default_rng(5)
        x, u = jnp.asarray(rng.standard_normal((4, 5))), jnp.asarray(rng.standard_normal((2, 3)))
        i = jnp.asarray(np.concatenate(STARTS + STARTS[::-1]))  # every start, before and after each write
        for nums in _subsets():
            got = rf.grad(rf.lift(_dynamic), argnums=nums)(x, u, i)
            want = jax.grad(_dynamic, argnums=nums)(x, u, i)
            chex.assert_trees_all_close(got, want, rtol=1e-10, atol=1e-10)
        check_fd(rf.lift(_dynamic), (x, u, i), (0, 1), tol=1e-6)


def test_dynamic_slice_below_minus_size_lands_on_row_zero():
    x = jnp.zeros((5, 2))
    g = rf.grad(lambda x: rf.sum(rf.lift(lambda x: lax.dynamic_slice_in_dim(x, -7, 2))(x)))(x)
    np.testing.assert_array_equal(g[:, 0], [1, 1, 0, 0, 0])
