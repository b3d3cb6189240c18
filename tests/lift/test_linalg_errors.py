"""Gradients that JAX does not define for linear algebra and special functions:
``rf.lift`` raises ``AutogradError`` where ``jax.grad`` raises, never a wrong
gradient; and where rf does not support a case JAX does, it raises too. Those
cases are declared with their rules (``defrule(errors=...)`` in
``rumus_fx/lift/rules_linalg.py``, and the primitives without a rule with
``rf.lift``'s own declaration) and run by the error audit
(``tests/test_errors_audit.py``); here: the boundary case that is differentiable."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import rumus_fx as rf


def _mat(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) + shape[-1] * np.eye(*shape[-2:]))


def _rf_grad(f, *args, argnums=0):
    return rf.grad(lambda *a: rf.sum(rf.lift(f)(*a)), argnums=argnums)(*args)


def _jax_grad(f, *args, argnums=0):
    return jax.grad(lambda *a: jnp.sum(f(*a)), argnums=argnums)(*args)


def test_svd_full_matrices_square_is_differentiable():
    """A square matrix has the same full and thin SVD: JAX differentiates it, so does rf."""
    with jax.enable_x64(True):
        a = _mat(3, 3)

        def f(x):
            u, s, vt = jnp.linalg.svd(x, full_matrices=True)
            return s * jnp.sum(u * vt.T, 0)

        np.testing.assert_allclose(_rf_grad(f, a), _jax_grad(f, a), rtol=1e-10, atol=1e-10)
