"""MultiheadAttention and TransformerBlock against plain jax.numpy references,
including gradients under jax.jit."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf

from ._helpers import check_layer as _check_layer
from ._helpers import normal as _normal

KEY = jax.random.key(0)


def _linear(p, x):
    return x @ p["weight"] + p["bias"].reshape((1,) * (x.ndim - 1) + (-1,))


def _layer_norm(p, x, eps=1e-5):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, axis=-1, keepdims=True)
    lead = (1,) * (x.ndim - 1)
    return (x - mu) / jnp.sqrt(var + eps) * p["weight"].reshape(lead + (-1,)) + p["bias"].reshape(lead + (-1,))


def mha_ref(p, x, heads, causal=False, mask=None):
    *lead, s, d = x.shape
    dh = d // heads
    qkv = _linear(p["qkv"], x).reshape(*lead, s, 3, heads, dh)
    q, k, v = (jnp.moveaxis(qkv[..., i, :, :], -2, -3) for i in range(3))  # [..., H, S, Dh]
    scores = q @ jnp.swapaxes(k, -1, -2) / np.sqrt(dh)
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf)
    o = jax.nn.softmax(scores, axis=-1) @ v  # [..., H, S, Dh]
    o = jnp.moveaxis(o, -3, -2).reshape(*lead, s, d)
    return _linear(p["proj"], o)


def block_ref(p, x, heads, causal=False):
    x = x + mha_ref(p["attn"], _layer_norm(p["ln1"], x), heads, causal)
    h = jax.nn.gelu(_linear(p["fc1"], _layer_norm(p["ln2"], x)), approximate=True)
    return x + _linear(p["fc2"], h)


def _grad_check(fn, ref, params, x, rng, jit, atol=1e-4):
    _check_layer(fn, ref, params, x, rng, jit=jit, atol=atol, rtol=atol)


def test_mha_params_layout():
    params = rf.nn.MultiheadAttention(8, 2).init(KEY)
    assert jax.tree_util.tree_map(jnp.shape, params) == {
        "qkv": {"weight": (8, 24), "bias": (24,)},
        "proj": {"weight": (8, 8), "bias": (8,)},
    }


@pytest.mark.parametrize(("shape", "causal"), [((5, 8), True), ((2, 5, 8), False), ((2, 2, 3, 8), True)])
def test_mha_matches_jnp(rng, shape, causal):
    mha = rf.nn.MultiheadAttention(8, 2)
    params = mha.init(KEY)
    _grad_check(
        lambda p, x: mha(p, x, causal=causal),
        lambda p, x: mha_ref(p, x, 2, causal),
        params,
        _normal(rng, *shape),
        rng,
        jit=False,
    )


def test_mha_boolean_mask(rng):
    mha = rf.nn.MultiheadAttention(8, 4)
    params = mha.init(KEY)
    x = _normal(rng, 2, 5, 8)
    # key-padding mask: sequence 1 sees only its first 3 positions; shape [B, 1, 1, S]
    mask = jnp.asarray(np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)).reshape(2, 1, 1, 5)
    out = mha(params, x, mask=mask)
    np.testing.assert_allclose(out.value, mha_ref(params, x, 4, mask=mask), atol=1e-5, rtol=1e-5)
    # padded positions of sequence 1 do not influence the others
    x2 = x.at[1, 3:].set(100.0)
    np.testing.assert_allclose(mha(params, x2, mask=mask).value[1, :3], out.value[1, :3], atol=1e-5)


def test_mha_causal_ignores_the_future(rng):
    mha = rf.nn.MultiheadAttention(8, 2)
    params = mha.init(KEY)
    x = _normal(rng, 1, 6, 8)
    y = mha(params, x, causal=True).value
    y2 = mha(params, x.at[:, 4:].set(-7.0), causal=True).value
    np.testing.assert_allclose(y[:, :4], y2[:, :4], atol=1e-6)
    assert not np.allclose(y[:, 4:], y2[:, 4:])


def test_mha_rejects_wrong_width():
    mha = rf.nn.MultiheadAttention(8, 2)
    with pytest.raises(ValueError, match=r"\[\.\.\., S, 8\]"):
        mha(mha.init(KEY), jnp.ones((2, 5, 6)))


def test_transformer_block_params_layout():
    params = rf.nn.TransformerBlock(8, 2).init(KEY)
    assert sorted(params) == ["attn", "fc1", "fc2", "ln1", "ln2"]
    assert params["fc1"]["weight"].shape == (8, 32)  # 4x MLP
    assert params["fc2"]["weight"].shape == (32, 8)


@pytest.mark.parametrize("causal", [False, True])
def test_transformer_block_grads_under_jit(rng, causal):
    block = rf.nn.TransformerBlock(16, 4)
    params = block.init(KEY)
    x = _normal(rng, 2, 6, 16)
    _grad_check(
        lambda p, x: block(p, x, causal=causal), lambda p, x: block_ref(p, x, 4, causal), params, x, rng, jit=True
    )


def test_transformer_block_eager_equals_jit(rng):
    block = rf.nn.TransformerBlock(8, 2)
    params = block.init(KEY)
    x = _normal(rng, 3, 4, 8)
    f = rf.value_and_grad(
        lambda p, x: rf.mean(rf.mul(block(p, x, causal=True), block(p, x, causal=True))), argnums=(0, 1)
    )
    chex.assert_trees_all_close(f(params, x), jax.jit(f)(params, x), atol=1e-5, rtol=1e-5)


def test_transformer_block_dropout(rng):
    block = rf.nn.TransformerBlock(8, 2, dropout=0.5)
    params = block.init(KEY)
    x = _normal(rng, 2, 4, 8)
    run = jax.jit(lambda p, x, key: block(p, x, key=key).value)
    eval_out = jax.jit(lambda p, x: block(p, x, training=False).value)(params, x)
    np.testing.assert_allclose(eval_out, block_ref(params, x, 2), atol=1e-5, rtol=1e-5)
    a = run(params, x, KEY)
    np.testing.assert_array_equal(a, run(params, x, KEY))  # same key, same masks
    assert not np.allclose(a, eval_out)
    with pytest.raises(ValueError, match="key"):
        jax.jit(lambda p, x: block(p, x).value)(params, x)
    g = jax.jit(rf.grad(lambda p: rf.sum(block(p, x, key=KEY))))(params)
    chex.assert_trees_all_equal_shapes_and_dtypes(g, params)
