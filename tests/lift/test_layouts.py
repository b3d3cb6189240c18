"""``jax.experimental.layout.with_layout_constraint`` inside a lifted function: the
identity on values, dropped from rf's programs (Note [Layout constraints dropped]
in rumus_fx/lift/program.py). Kept, an eager lifted call handed a column-major
residual from its compiled forward to its compiled backward, which read it as
row-major (jax 0.10.2 on CPU): a permuted gradient with no error; so did a
custom_vjp's fwd that returns constrained residuals. Each program
under ``rf.grad(rf.lift(f))``, eagerly and under jit, against the compiled
``jax.grad(f)`` and float64 central differences, each argument alone and both."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.layout import Layout, with_layout_constraint

import rumus_fx as rf
from rumus_fx.testing import check_grads


def _cm(x):
    """``x`` constrained to the column-major layout (rows minor)."""
    return with_layout_constraint(x, Layout(tuple(range(x.ndim))[::-1]))


_C = np.arange(12.0).reshape(3, 4) / 7.0 - 0.5  # an untracked constant the program saves


def _scan_rows(x, y):
    def body(c, row):
        r = _cm(row[None, :] * y[:1])[0]
        return c + jnp.sin(r) * r, r * c

    c, ys = lax.scan(body, jnp.zeros(x.shape[1]), x)
    return c.sum() + ys.sum()


@jax.custom_vjp
def _scaled_sin(a, b):
    return jnp.sin(a) * b


def _scaled_sin_fwd(a, b):
    c = _cm(a)  # the residuals themselves constrained
    return jnp.sin(c) * b, (c, _cm(b))


def _scaled_sin_bwd(res, g):
    c, b = res
    return g * jnp.cos(c) * b, g * jnp.sin(c)


_scaled_sin.defvjp(_scaled_sin_fwd, _scaled_sin_bwd)


PROGRAMS = {
    # the constrained value saved for the product (the case that came out permuted)
    "times_itself": lambda x, y: jnp.sum(_cm(x) * x * y),
    "sin_of_constrained": lambda x, y: jnp.sum(jnp.sin(_cm(jnp.cos(x))) * y),
    "untracked_constant": lambda x, y: jnp.sum(_cm(jnp.asarray(_C) * 2.0) * jnp.sin(x) * y),
    "matmul": lambda x, y: jnp.sum(jnp.tanh(_cm(x) @ _cm(y.T))),
    "in_scan_body": _scan_rows,
    # a custom_vjp's fwd, which rf evaluates as it is, returns constrained residuals
    "custom_vjp_residuals": lambda x, y: jnp.sum(_scaled_sin(x, y) * x),
    "in_checkpoint": lambda x, y: jax.checkpoint(lambda a, b: jnp.sum(jnp.exp(_cm(a * b)) * a))(x, y),
}


def _args():
    r = np.random.default_rng(0)
    return r.standard_normal((3, 4)), r.standard_normal((3, 4))


@pytest.mark.parametrize("argnums", [(0,), (1,), (0, 1)], ids=["x", "y", "both"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_gradient_through_a_layout_constraint_is_jax_grads(name, jit, argnums):
    f = PROGRAMS[name]
    with jax.enable_x64(True):
        x, y = (jnp.asarray(a) for a in _args())
        got = check_grads(rf.lift(f), (x, y), argnums, oracle=f, jit=jit, atol=1e-12, rtol=1e-12)
        # a later compiled call reads the gradient as jax's (the misread was silent)
        want = jax.jit(jax.grad(f, argnums=argnums))(x, y)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(jax.jit(jnp.cos)(a)), np.cos(np.asarray(b)), rtol=1e-12)


def test_a_constrained_output_is_the_value_and_reads_back_in_order():
    """The lifted function returns the constrained value itself: the same values,
    read right by the rf ops and compiled calls that follow."""

    def g(x):
        return _cm(jnp.sin(x) * 2.0)

    with jax.enable_x64(True):
        x = jnp.asarray(_args()[0])
        out = rf.lift(g)(x)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(g)(x)))
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: a + 1.0)(out)), np.asarray(g(x)) + 1.0)

        def loss(x):
            return jnp.sum(rf.lift(g)(x) * x)

        want = jax.grad(lambda x: jnp.sum(g(x) * x))(x)
        np.testing.assert_allclose(np.asarray(rf.grad(rf.lift(loss))(x)), np.asarray(want), rtol=1e-12)
