"""Convolution and windowed-reduction rules where ``jax.grad`` is no oracle: max
pooling with window dilation (jax raises NotImplementedError), generic
``reduce_window`` bodies, and a strided convolution whose ``jax.grad`` aborts in
XLA. References: a brute-force numpy select-and-scatter and finite differences."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import rumus_fx as rf
from rumus_fx.testing import check_fd


def _first_extreme_grad(x, g, dims, strides, padding, base, wdil, is_max):
    """Each window's gradient to its first (row-major) extreme element; padding
    and dilation holes hold the identity and may take it (then it is dropped)."""
    fill = -np.inf if is_max else np.inf
    pshape = tuple((n - 1) * b + 1 + lo + hi for n, b, (lo, hi) in zip(x.shape, base, padding))
    padded = np.full(pshape, fill)
    src = -np.ones(pshape, int)
    for i in np.ndindex(x.shape):
        pos = tuple(lo + k * b for k, b, (lo, _) in zip(i, base, padding))
        padded[pos] = x[i]
        src[pos] = np.ravel_multi_index(i, x.shape)
    gx = np.zeros(x.size)
    for o in np.ndindex(g.shape):
        best, arg = None, None
        for k in np.ndindex(tuple(dims)):
            pos = tuple(oo * s + kk * w for oo, s, kk, w in zip(o, strides, k, wdil))
            v = padded[pos]
            if best is None or (v > best if is_max else v < best):
                best, arg = v, pos
        if src[arg] >= 0:
            gx[src[arg]] += g[o]
    return gx.reshape(x.shape)


def _pool(x, dims, strides, padding, base, wdil, is_max):
    init, op = (-jnp.inf, lax.max) if is_max else (jnp.inf, lax.min)
    return lax.reduce_window(x, init, op, dims, strides, padding, base_dilation=base, window_dilation=wdil)


def _rf_grad(f, x, ct):
    return np.asarray(rf.grad(lambda x: rf.sum(rf.lift(f)(x) * ct))(x))


CONFIGS = [
    # dims, strides, padding, base_dilation, window_dilation
    ((3, 2), (1, 1), ((1, 1), (0, 1)), (1, 1), (2, 1)),
    ((2, 3), (2, 1), ((0, 2), (2, 0)), (2, 1), (1, 2)),
    ((3,), (2,), ((1, 2),), (1,), (3,)),
]


@pytest.mark.parametrize("is_max", [True, False], ids=["max", "min"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["wdil", "base+wdil", "1d"])
def test_window_dilated_chooser_matches_select_and_scatter(cfg, is_max):
    dims, strides, padding, base, wdil = cfg
    rng = np.random.default_rng(3)
    shape = (5, 6)[: len(dims)]
    f = functools.partial(_pool, dims=dims, strides=strides, padding=padding, base=base, wdil=wdil, is_max=is_max)
    with jax.enable_x64(True):
        for x in (rng.standard_normal(shape), np.round(rng.standard_normal(shape) * 1.5)):  # distinct, ties
            x = jnp.asarray(x)
            ct = jnp.asarray(rng.standard_normal(jax.eval_shape(f, x).shape))
            want = _first_extreme_grad(np.asarray(x), np.asarray(ct), dims, strides, padding, base, wdil, is_max)
            np.testing.assert_allclose(_rf_grad(f, x, ct), want, rtol=1e-12, atol=1e-12)


def test_select_and_scatter_reference_is_jax_grad():
    """The numpy reference agrees with jax.grad where jax has one (ties included)."""
    dims, strides, padding, base, wdil = (3, 2), (2, 1), ((1, 1), (1, 0)), (1, 2), (1, 1)
    rng = np.random.default_rng(4)
    with jax.enable_x64(True):
        x = jnp.asarray(np.round(rng.standard_normal((5, 4)) * 1.5))
        f = functools.partial(_pool, dims=dims, strides=strides, padding=padding, base=base, wdil=wdil, is_max=True)
        ct = jnp.asarray(rng.standard_normal(jax.eval_shape(f, x).shape))
        want = jax.grad(lambda x: jnp.sum(f(x) * ct))(x)
        got = _first_extreme_grad(np.asarray(x), np.asarray(ct), dims, strides, padding, base, wdil, True)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_generic_reduce_window_max_init_takes_ties():
    """max(0, window max) written as a generic reduce_window: where the init value
    attains the maximum, x gets nothing (jax.grad of relu at 0 is 0 too)."""
    dims, strides, padding = (2, 2), (1, 1), ((0, 1), (1, 0))
    rng = np.random.default_rng(5)
    with jax.enable_x64(True):
        x = jnp.asarray(np.round(rng.standard_normal((4, 4)) * 1.5))

        def f(x):
            return lax.reduce_window(x, 0.0, lambda a, b: lax.max(a, b), dims, strides, padding)

        ct = jnp.asarray(rng.standard_normal(jax.eval_shape(f, x).shape))
        got = _rf_grad(f, x, ct)
        # windows the init value wins (ties included) pass nothing on; the others
        # go to their first maximum, as for reduce_window_max
        won = jnp.asarray(np.asarray(f(x)) > 0, x.dtype)
        want = _first_extreme_grad(np.asarray(x), np.asarray(ct * won), dims, strides, padding, (1, 1), (1, 1), True)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_strided_conv_where_jax_grad_aborts():
    """jax.grad of this strided convolution aborts in XLA's CPU algebraic
    simplifier; rf's backward dilates explicitly and matches finite differences."""

    def f(x, w):
        return lax.conv_general_dilated(x, w, (2, 2), ((1, 2), (0, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC"))

    rng = np.random.default_rng(6)
    with jax.enable_x64(True):
        x, w = jnp.asarray(rng.standard_normal((1, 6, 5, 2))), jnp.asarray(rng.standard_normal((2, 3, 2, 3)))
        ct = jnp.asarray(rng.standard_normal((1, 4, 2, 3)))
        check_fd(lambda x, w: rf.sum(rf.lift(f)(x, w) * ct), [x, w], (0, 1), tol=1e-6, directions=3)
        check_fd(lambda x, w: rf.sum(rf.lift(f)(x, w) * ct), [x, w], (0, 1), tol=1e-6, directions=1, jit=True)
