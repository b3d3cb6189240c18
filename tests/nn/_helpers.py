"""Shared checks for the rf.nn tests."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

import rumus_fx as rf


def normal(rng: np.random.Generator, *shape: int) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def check_layer(layer_fn, ref_fn, params, x, rng, *, jit=False, argnums=(0, 1), atol=2e-5, rtol=2e-5):
    """``layer_fn(params, x)`` (an rf.Tensor) equals ``ref_fn(params, x)`` (jnp), and
    the gradients of ``<out, ct>`` for a random ``ct`` from rf's tape (``rf.grad``,
    eager or under jit) equal ``jax.grad`` of the jnp reference (the oracle, jitted
    to keep the suite fast)."""
    out = layer_fn(params, x)
    assert isinstance(out, rf.Tensor)
    expected = ref_fn(params, x)
    chex.assert_trees_all_close(out.value, expected, atol=atol, rtol=rtol)
    ct = normal(rng, *expected.shape)
    got_fn = rf.grad(lambda p, x: rf.sum(rf.mul(layer_fn(p, x), ct)), argnums=argnums)
    got = (jax.jit(got_fn) if jit else got_fn)(params, x)
    want = jax.jit(jax.grad(lambda p, x: jnp.sum(ref_fn(p, x) * ct), argnums=argnums))(params, x)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    chex.assert_trees_all_close(got, want, atol=atol, rtol=rtol)
    return got
