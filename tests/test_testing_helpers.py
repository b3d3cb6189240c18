"""``rumus_fx.testing``: the oracle is compiled where the function traces and eager
where it needs its values; ``check_fd`` checks gradients handed to it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf
from rumus_fx.testing import check_fd, jax_oracle_grad


def test_oracle_is_compiled_where_the_function_traces():
    seen = []

    def f(x):
        try:  # a value is readable under an eager jax.grad, not inside jax.jit
            seen.append(bool(x[0] > 0))
        except jax.errors.ConcretizationTypeError:
            seen.append("traced")
        return jnp.sum(jnp.sin(x) * x)

    x = jnp.linspace(-1.0, 1.0, 5)
    got = jax_oracle_grad(f, (x,))
    np.testing.assert_allclose(got, jnp.cos(x) * x + jnp.sin(x), rtol=1e-6)
    # one trace, by jax.jit: jax.grad ran inside the compiled program
    assert seen == ["traced"], seen


def test_oracle_runs_eagerly_where_the_function_needs_a_value():
    def f(x, n):
        # a Python branch on a value and a shape from an argument: neither traces under jit
        return jnp.sum(x**2) if x[0] > 0 else jnp.sum(jnp.tile(x, n) ** 3)

    x = jnp.asarray([0.5, -2.0])
    got = jax_oracle_grad(f, (x, 2))
    np.testing.assert_allclose(got, 2 * x, rtol=1e-6)
    np.testing.assert_allclose(jax_oracle_grad(f, (-x, 2)), 2 * 3 * x**2, rtol=1e-6)


def test_oracle_raises_what_jax_grad_raises():
    def f(x):
        return jnp.sum(x.astype(jnp.int32))

    with pytest.raises(TypeError, match="grad requires real- or complex-valued inputs"):
        jax_oracle_grad(f, (jnp.arange(3),))


def test_check_fd_checks_the_gradients_it_is_given():
    def f(x, w):
        return rf.sum(rf.tanh(x @ w))

    with jax.enable_x64(True):
        x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 4)))
        w = jnp.asarray(np.random.default_rng(1).standard_normal((4, 2)))
        good = rf.grad(f, argnums=(0, 1))(x, w)
        check_fd(f, (x, w), (0, 1), grads=good)
        with pytest.raises(AssertionError):
            check_fd(f, (x, w), (0, 1), grads=(good[0], good[1] * 1.01))
        with pytest.raises(ValueError, match="1 gradients given for argnums"):
            check_fd(f, (x, w), (0, 1), grads=good[:1])
