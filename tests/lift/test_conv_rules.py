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


# jax's own derivatives of a pool inside the lifted function: jax.grad emits
# select_and_scatter_add(cotangent, operand), jax.jvp select_and_gather_add(tangent,
# operand); both linear in their first argument, piecewise constant in the operand
# (dims, strides, padding, base_dilation; the vjp has no base dilation in jax)
_DERIV_CONFIGS = {
    "max_padded": ((2, 2), (2, 1), ((1, 0), (0, 1)), (1, 1), True),
    "min_same": ((3, 2), (1, 2), ((1, 1), (0, 1)), (1, 1), False),
    "max_base_dilation": ((3, 2), (2, 1), ((1, 1), (0, 1)), (2, 1), True),
}


def _derivative_program(kind, cfg):
    dims, strides, padding, base, is_max = cfg
    pool = functools.partial(
        _pool, dims=dims, strides=strides, padding=padding, base=base, wdil=(1,) * len(dims), is_max=is_max
    )
    if kind == "vjp":
        return lambda x, s: jax.vjp(pool, x)[1](s)[0]
    return lambda x, t: jax.jvp(pool, (x,), (t,))[1]


def _derivative_inputs(kind, cfg, values, rng):
    dims, strides, padding, base, is_max = cfg
    x = rng.standard_normal((5, 6))
    if values != "distinct":
        x = np.round(x * 1.5)  # ties
    if values == "nan":
        x[rng.random(x.shape) < 0.3] = np.nan
        x[rng.random(x.shape) < 0.2] = -np.inf if is_max else np.inf
    pool = functools.partial(_pool, dims=dims, strides=strides, padding=padding, base=base, wdil=(1, 1), is_max=is_max)
    other = x.shape if kind == "jvp" else jax.eval_shape(pool, jnp.asarray(x)).shape
    return jnp.asarray(x), jnp.asarray(rng.standard_normal(other))


def _adjoint(prog, x, v, w):
    """The gradient of ``sum(prog(x, v) * w)`` in ``v``, in which it is linear, from the
    program's own values at the unit vectors: the exact adjoint of the selection XLA
    ran, whatever jax's transpose rule selects."""
    basis = jnp.eye(v.size, dtype=v.dtype).reshape(v.size, *v.shape)
    return jnp.stack([jnp.sum(prog(x, e) * w) for e in basis]).reshape(v.shape)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("argnums", [(0,), (1,), (0, 1)], ids=["operand", "linear", "both"])
@pytest.mark.parametrize("cfg", list(_DERIV_CONFIGS))
@pytest.mark.parametrize("kind", ["vjp", "jvp"])
def test_jax_derivatives_of_a_pool_differentiate_on_the_tape(kind, cfg, argnums, jit):
    """``rf.grad`` of a function that takes jax's own vjp or jvp of a max/min pool (a
    gradient penalty, a Hessian through jax.grad): its ``select_and_scatter_add`` /
    ``select_and_gather_add`` were refused (no rule). Each argument alone and both, at
    distinct values, ties and windows holding nan and infinities: the exact adjoint of
    the selection the program ran, and jax.grad's values where jax's transpose selects
    the same element (every window without nan or infinity), eager and jit; central
    differences at distinct values."""
    if kind == "vjp" and cfg == "max_base_dilation":
        cfg = "max_padded"  # jax's vjp of a base-dilated pool emits a pad and a slice around it
    c = _DERIV_CONFIGS[cfg]
    prog = _derivative_program(kind, c)
    rng = np.random.default_rng(7)
    with jax.enable_x64(True):
        for values in ("distinct", "ties", "nan"):
            x, v = _derivative_inputs(kind, c, values, rng)
            w = jnp.asarray(rng.standard_normal(jax.eval_shape(prog, x, v).shape))

            def loss(x, v, w=w):
                return jnp.sum(prog(x, v) * w)

            prim = "select_and_scatter_add" if kind == "vjp" else "select_and_gather_add"
            assert prim in str(jax.make_jaxpr(loss)(x, v))
            g = rf.grad(rf.lift(loss), argnums=argnums)
            got = dict(zip(argnums, (jax.jit(g) if jit else g)(x, v)))
            if 0 in got:  # the selection is piecewise constant in the operand
                np.testing.assert_array_equal(got[0], np.zeros(x.shape))
            if 1 in got:
                np.testing.assert_allclose(got[1], _adjoint(prog, x, v, w), rtol=1e-12, atol=1e-12, err_msg=values)
            if values != "nan":
                for want in (jax.grad(loss, argnums)(x, v), jax.jit(jax.grad(loss, argnums))(x, v)):
                    for k, b in zip(argnums, want):
                        np.testing.assert_allclose(got[k], b, rtol=1e-12, atol=1e-12, err_msg=values)
            if values == "distinct":
                check_fd(rf.lift(loss), (x, v), argnums=argnums, jit=jit, grads=tuple(got[k] for k in argnums))


@pytest.mark.parametrize("kind", ["vjp", "jvp"])
def test_jax_transposes_a_pool_derivative_with_the_other_selection(kind):
    """In a window of -inf alone jax.grad's transpose of these primitives selects
    otherwise than the primitive did: ``select_and_scatter_add`` hands the cotangent to
    the window's first element (XLA's select-and-scatter) while its transpose gathers
    from the identity (reduce_window), and the other way round. jax.grad's gradient in
    the linear argument is then not the program's derivative; rf's is."""
    prog = _derivative_program(kind, ((2,), (1,), ((0, 0),), (1,), True))
    with jax.enable_x64(True):
        x = jnp.array([-jnp.inf, -jnp.inf, 1.0])
        v = jnp.array([0.5, -2.0] if kind == "vjp" else [0.5, -2.0, 3.0])
        w = jnp.array([1.0, 2.0, 4.0] if kind == "vjp" else [1.0, 2.0])

        def loss(x, v):
            return jnp.sum(prog(x, v) * w)

        want = _adjoint(prog, x, v, w)
        # the vjp puts v[0] on x[0] (weight 1), the jvp's first window gives 0
        np.testing.assert_array_equal(want, [1.0, 4.0] if kind == "vjp" else [0.0, 0.0, 2.0])
        np.testing.assert_array_equal(rf.grad(rf.lift(loss), argnums=1)(x, v), want)
        h = 1e-3  # linear in v: the central difference is exact up to rounding
        fd = [(loss(x, v + h * e) - loss(x, v - h * e)) / (2 * h) for e in jnp.eye(v.size)]
        np.testing.assert_allclose(fd, want, atol=1e-9)
        assert not np.array_equal(jax.grad(loss, argnums=1)(x, v), want)


@pytest.mark.parametrize("kind", ["vjp", "jvp"])
def test_jax_derivatives_of_a_pool_per_example_and_second_order(kind):
    """The same programs per example under ``jax.vmap`` and as a Hessian-vector
    product (``jax.jvp`` of rf's gradient) against jax's."""
    c = _DERIV_CONFIGS["min_same"]
    prog = _derivative_program(kind, c)
    rng = np.random.default_rng(8)
    with jax.enable_x64(True):
        x, v = _derivative_inputs(kind, c, "ties", rng)
        w = jnp.asarray(rng.standard_normal(jax.eval_shape(prog, x, v).shape))

        def loss(x, v):
            return jnp.sum(prog(x, v) * w) + jnp.sum(jnp.sin(v) * v)

        xs, vs = jnp.stack([x, x[::-1], -x]), jnp.stack([v, 2 * v, v[::-1]])
        got = jax.vmap(rf.grad(rf.lift(loss), argnums=(0, 1)))(xs, vs)
        want = jax.vmap(jax.grad(loss, argnums=(0, 1)))(xs, vs)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
        tx, tv = jnp.asarray(rng.standard_normal(x.shape)), jnp.asarray(rng.standard_normal(v.shape))
        got = jax.jvp(rf.grad(rf.lift(loss), argnums=(0, 1)), (x, v), (tx, tv))[1]
        want = jax.jvp(jax.grad(loss, argnums=(0, 1)), (x, v), (tx, tv))[1]
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_jax_jvp_of_a_window_dilated_pool():
    """jax.jvp of a pool with window and base dilation: jax.grad cannot transpose its
    ``select_and_gather_add`` (NotImplementedError); rf's gradient in the tangent is the
    exact adjoint of the selection, nan and -inf entries included."""
    rng = np.random.default_rng(9)

    def pool(y):
        return lax.reduce_window(
            y, -jnp.inf, lax.max, (2, 3), (1, 2), ((1, 0), (1, 1)), base_dilation=(1, 2), window_dilation=(2, 1)
        )

    with jax.enable_x64(True):
        x = jnp.asarray(np.round(rng.standard_normal((5, 4)) * 1.5)).at[0, 1].set(jnp.nan).at[2, 2].set(-jnp.inf)
        t = jnp.asarray(rng.standard_normal((5, 4)))
        w = jnp.asarray(rng.standard_normal(jax.eval_shape(pool, x).shape))
        prog = lambda x, t: jax.jvp(pool, (x,), (t,))[1]  # noqa: E731

        def loss(x, t):
            return jnp.sum(prog(x, t) * w)

        with pytest.raises(NotImplementedError, match="window dilation"):
            jax.grad(loss, argnums=1)(x, t)
        for jit in (False, True):
            g = rf.grad(rf.lift(loss), argnums=(0, 1))
            gx, gt = (jax.jit(g) if jit else g)(x, t)
            np.testing.assert_array_equal(gx, np.zeros(x.shape))
            np.testing.assert_allclose(gt, _adjoint(prog, x, t, w), rtol=1e-12, atol=1e-12)
