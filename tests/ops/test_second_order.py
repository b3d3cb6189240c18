"""Second order through every op of the op table: ``rf.grad`` of a function that
calls ``rf.grad`` (the inner backward is recorded on the enclosing tape) against
``jax.grad`` of ``jax.grad`` of the op's jnp oracle, float64 (1e-9), eager and jit;
third order for a few ops."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf

from .test_optable import FIRST_CASES, _setup


def _dot_rf(gs, vs):
    return sum(rf.sum(g * v) for g, v in zip(gs, vs))


def _dot_jax(gs, vs):
    return sum(jnp.sum(g * v) for g, v in zip(gs, vs))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("info,k", FIRST_CASES)
def test_grad_of_grad_matches_jax(info, k, jit):
    with jax.enable_x64(True):
        arrays, fun_rf, fun_ref, diff, _, _ = _setup(info, k, jnp.float64)
        rng = np.random.default_rng(3)
        vs = [jnp.asarray(rng.standard_normal(arrays[d].shape)) for d in diff]
        outer = diff

        def rf_hvp(*a):
            gs = rf.grad(fun_rf, argnums=diff)(*a)
            return _dot_rf(gs, vs)

        def jax_hvp(*a):
            gs = jax.grad(fun_ref, argnums=diff)(*a)
            return _dot_jax(gs, vs)

        g = rf.grad(rf_hvp, argnums=outer)
        if jit:
            g = jax.jit(g)
        got = g(*arrays)
        want = rf.testing.jax_oracle_grad(jax_hvp, arrays, outer)
        chex.assert_trees_all_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", ["exp", "mul", "softmax", "layer_norm", "gelu"])
def test_third_order(name):
    from .optable import OPS

    info = next(i for i in OPS if i.name == name)
    with jax.enable_x64(True):
        arrays, fun_rf, fun_ref, diff, _, _ = _setup(info, 0, jnp.float64)
        d = diff[0]
        rng = np.random.default_rng(4)
        v1, v2 = (jnp.asarray(rng.standard_normal(arrays[d].shape)) for _ in range(2))

        def rf2(*a):
            return rf.sum(rf.grad(fun_rf, argnums=d)(*a) * v1)

        def rf3(*a):
            return rf.sum(rf.grad(rf2, argnums=d)(*a) * v2)

        def j2(*a):
            return jnp.sum(jax.grad(fun_ref, argnums=d)(*a) * v1)

        def j3(*a):
            return jnp.sum(jax.grad(j2, argnums=d)(*a) * v2)

        chex.assert_trees_all_close(
            rf.grad(rf3, argnums=d)(*arrays), jax.grad(j3, argnums=d)(*arrays), rtol=1e-8, atol=1e-8
        )
