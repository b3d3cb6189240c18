"""Gradients that JAX does not define for linear algebra and special functions:
``rf.lift`` raises ``AutogradError`` where ``jax.grad`` raises, never a wrong
gradient; and where rf does not support a case JAX does, it raises too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import rumus_fx as rf
from rumus_fx import AutogradError


def _mat(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) + shape[-1] * np.eye(*shape[-2:]))


def _rf_grad(f, *args, argnums=0):
    return rf.grad(lambda *a: rf.sum(rf.lift(f)(*a)), argnums=argnums)(*args)


def _jax_grad(f, *args, argnums=0):
    return jax.grad(lambda *a: jnp.sum(f(*a)), argnums=argnums)(*args)


# (name, function, arguments, argnums): jax.grad raises for each
JAX_RAISES = [
    ("svd_full_matrices_tall", lambda a: jnp.linalg.svd(a, full_matrices=True)[0], (_mat(4, 3),), 0),
    ("svd_full_matrices_wide", lambda a: jnp.linalg.svd(a, full_matrices=True)[2], (_mat(3, 4),), 0),
    ("polygamma_order", lambda m, x: lax.polygamma(m, x), (jnp.array([1.0, 2.0]), jnp.array([0.5, 1.5])), 0),
    ("betainc_a", jax.scipy.special.betainc, (jnp.array([1.5]), jnp.array([2.0]), jnp.array([0.3])), 0),
    ("betainc_b", jax.scipy.special.betainc, (jnp.array([1.5]), jnp.array([2.0]), jnp.array([0.3])), 1),
    ("igamma_grad_a", lax.igamma_grad_a, (jnp.array([1.5, 2.0]), jnp.array([0.5, 3.0])), 1),
    ("householder_product", lambda a: lax.linalg.householder_product(a, jnp.ones(3)), (_mat(4, 3),), 0),
    (
        "custom_linear_solve_no_transpose",
        lambda a: lax.custom_linear_solve(lambda x: a @ x, jnp.ones(3), solve=lambda _, b: jnp.linalg.solve(a, b)),
        (_mat(3, 3),),
        0,
    ),
]


@pytest.mark.parametrize("name,f,args,argnums", JAX_RAISES, ids=[c[0] for c in JAX_RAISES])
def test_raises_where_jax_raises(name, f, args, argnums):
    with jax.enable_x64(True):
        args = tuple(jnp.asarray(a, jnp.float64) for a in args)
        with pytest.raises((NotImplementedError, ValueError, TypeError)):
            _jax_grad(f, *args, argnums=argnums)
        with pytest.raises(AutogradError):
            _rf_grad(f, *args, argnums=argnums)


# cases JAX differentiates and rf does not (it raises rather than guess)
RF_UNSUPPORTED = [
    # JAX's rule reads the unpivoted trailing columns here
    ("qr_pivoting_wide", lambda a: lax.linalg.qr(a, pivoting=True, full_matrices=False)[1], (_mat(3, 4),)),
    ("eigvals", lambda a: jnp.real(jnp.linalg.eigvals(a)), (_mat(3, 3),)),
]


@pytest.mark.parametrize("name,f,args", RF_UNSUPPORTED, ids=[c[0] for c in RF_UNSUPPORTED])
def test_raises_where_unsupported(name, f, args):
    with pytest.raises(AutogradError):
        _rf_grad(f, *args)


def test_svd_full_matrices_square_is_differentiable():
    """A square matrix has the same full and thin SVD: JAX differentiates it, so does rf."""
    with jax.enable_x64(True):
        a = _mat(3, 3)

        def f(x):
            u, s, vt = jnp.linalg.svd(x, full_matrices=True)
            return s * jnp.sum(u * vt.T, 0)

        np.testing.assert_allclose(_rf_grad(f, a), _jax_grad(f, a), rtol=1e-10, atol=1e-10)
