"""rf.nn layers against plain jax.numpy / lax implementations: forward values and
gradients (rf.grad on the tape vs jax.grad of the jnp reference)."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import rumus_fx as rf

from ._helpers import check_layer as _check_layer
from ._helpers import normal as _normal

KEY = jax.random.key(0)


# ---------------------------------------------------------------------------
# Linear
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(5, 3), (2, 4, 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_jnp(rng, shape, bias):
    lin = rf.nn.Linear(3, 4, bias=bias)
    params = lin.init(KEY)
    assert set(params) == ({"weight", "bias"} if bias else {"weight"})
    assert params["weight"].shape == (3, 4)

    def ref(p, x):
        y = x @ p["weight"]
        return y + p["bias"].reshape((1,) * (y.ndim - 1) + (-1,)) if bias else y

    _check_layer(lin, ref, params, _normal(rng, *shape), rng)


def test_linear_vector_input(rng):
    lin = rf.nn.Linear(3, 2)
    params = lin.init(KEY)
    x = _normal(rng, 3)
    _check_layer(lin, lambda p, x: x @ p["weight"] + p["bias"], params, x, rng)


def test_linear_init_is_pytorch_default():
    lin = rf.nn.Linear(100, 50)
    p = lin.init(KEY)
    bound = 1 / np.sqrt(100)
    for name in ("weight", "bias"):
        a = np.asarray(p[name])
        assert a.dtype == np.float32
        assert np.abs(a).max() <= bound
        assert np.abs(a).max() > 0.9 * bound  # uniform over the whole range
    # different keys -> different params; same key -> same params
    assert not np.array_equal(lin.init(jax.random.key(1))["weight"], p["weight"])
    np.testing.assert_array_equal(lin.init(KEY)["weight"], p["weight"])


def test_linear_dtype_bfloat16(rng):
    lin = rf.nn.Linear(4, 3, dtype=jnp.bfloat16)
    params = lin.init(KEY)
    assert params["weight"].dtype == jnp.bfloat16
    y = lin(params, _normal(rng, 2, 4).astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    g = rf.grad(lambda p: rf.sum(lin(p, jnp.ones((2, 4), jnp.bfloat16))).value.astype(jnp.float32))(params)
    assert g["weight"].dtype == jnp.bfloat16


# ---------------------------------------------------------------------------
# Conv2d
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("stride", "padding", "bias"), [(1, 0, True), (1, 1, True), (2, 1, False)])
def test_conv2d_matches_lax(rng, stride, padding, bias):
    conv = rf.nn.Conv2d(3, 4, 3, stride=stride, padding=padding, bias=bias)
    params = conv.init(KEY)
    assert params["weight"].shape == (4, 3, 3, 3)
    bound = 1 / np.sqrt(3 * 3 * 3)
    assert np.abs(np.asarray(params["weight"])).max() <= bound

    def ref(p, x):
        y = lax.conv_general_dilated(
            x, p["weight"], (stride, stride), [(padding, padding)] * 2, dimension_numbers=("NCHW", "OIHW", "NCHW")
        )
        return y + p["bias"].reshape(1, -1, 1, 1) if bias else y

    _check_layer(conv, ref, params, _normal(rng, 2, 3, 7, 7), rng, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------
# BatchNorm2d
# ---------------------------------------------------------------------------


def _bn_ref(p, x, mean, var, training, eps=1e-5):
    if training:
        mean = jnp.mean(x, axis=(0, 2, 3))
        var = jnp.var(x, axis=(0, 2, 3))
    xhat = (x - mean.reshape(1, -1, 1, 1)) / jnp.sqrt(var.reshape(1, -1, 1, 1) + eps)
    return xhat * p["weight"].reshape(1, -1, 1, 1) + p["bias"].reshape(1, -1, 1, 1)


def test_batchnorm_init_and_state():
    bn = rf.nn.BatchNorm2d(3)
    params, state = bn.init(KEY), bn.init_state()
    np.testing.assert_array_equal(params["weight"], np.ones(3))
    np.testing.assert_array_equal(params["bias"], np.zeros(3))
    assert set(state) == {"mean", "var"}
    np.testing.assert_array_equal(state["mean"], np.zeros(3))
    np.testing.assert_array_equal(state["var"], np.ones(3))


@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_matches_jnp(rng, training):
    bn = rf.nn.BatchNorm2d(3)
    params = {"weight": _normal(rng, 3) + 1.0, "bias": _normal(rng, 3)}
    state = {"mean": _normal(rng, 3), "var": jnp.abs(_normal(rng, 3)) + 0.5}
    x = _normal(rng, 4, 3, 5, 5) * 2.0 + 1.0

    def layer(p, x):
        y, _ = bn(p, x, state, training=training)
        return y

    _check_layer(
        layer, lambda p, x: _bn_ref(p, x, state["mean"], state["var"], training), params, x, rng, atol=1e-4, rtol=1e-4
    )


def test_batchnorm_state_updates_in_training_only(rng):
    bn = rf.nn.BatchNorm2d(2, momentum=0.25)
    params, state = bn.init(KEY), bn.init_state()
    x = _normal(rng, 8, 2, 3, 3) * 3.0 + 2.0
    _, new = bn(params, x, state, training=True)
    assert set(new) == {"mean", "var"}
    assert all(isinstance(v, jax.Array) for v in new.values())  # plain arrays, not Tensors
    batch_mean, batch_var = jnp.mean(x, axis=(0, 2, 3)), jnp.var(x, axis=(0, 2, 3))
    np.testing.assert_allclose(new["mean"], 0.25 * batch_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new["var"], 0.75 + 0.25 * batch_var, rtol=1e-5, atol=1e-6)
    # eval: uses (and returns unchanged) the running statistics
    y, same = bn(params, x, new, training=False)
    np.testing.assert_array_equal(same["mean"], new["mean"])
    np.testing.assert_array_equal(same["var"], new["var"])
    np.testing.assert_allclose(y.value, _bn_ref(params, x, new["mean"], new["var"], False), rtol=1e-5, atol=1e-5)


def test_batchnorm_state_threads_through_jit_and_grad(rng):
    bn = rf.nn.BatchNorm2d(2)
    params, state = bn.init(KEY), bn.init_state()
    x = _normal(rng, 4, 2, 3, 3)

    def loss(p, state, x):
        y, new_state = bn(p, x, state, training=True)
        return rf.mean(rf.mul(y, y)), new_state

    (value, new_state), grads = jax.jit(rf.value_and_grad(loss, has_aux=True))(params, state, x)
    assert value.shape == ()
    chex.assert_trees_all_equal_shapes_and_dtypes(grads, params)
    _, eager_state = bn(params, x, state, training=True)
    chex.assert_trees_all_close(new_state, eager_state, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# LayerNorm, Embedding
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(4, 6), (2, 3, 6)])
def test_layernorm_matches_jnp(rng, shape):
    ln = rf.nn.LayerNorm(6)
    params = {"weight": _normal(rng, 6), "bias": _normal(rng, 6)}
    np.testing.assert_array_equal(ln.init(KEY)["weight"], np.ones(6))

    def ref(p, x):
        mu = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean((x - mu) ** 2, axis=-1, keepdims=True)
        lead = (1,) * (x.ndim - 1)
        return (x - mu) / jnp.sqrt(var + 1e-5) * p["weight"].reshape(lead + (-1,)) + p["bias"].reshape(lead + (-1,))

    _check_layer(ln, ref, params, _normal(rng, *shape), rng, atol=1e-4, rtol=1e-4)


def test_embedding_matches_take(rng):
    emb = rf.nn.Embedding(10, 4)
    params = emb.init(KEY)
    assert set(params) == {"weight"} and params["weight"].shape == (10, 4)
    assert 0.5 < float(jnp.std(emb.init(KEY)["weight"])) < 1.5  # N(0, 1) as PyTorch
    idx = jnp.asarray([[1, 2, 2], [9, 0, 1]], jnp.int32)
    _check_layer(lambda p, i: emb(p, i), lambda p, i: p["weight"][i], params, idx, rng, argnums=0)


# ---------------------------------------------------------------------------
# parameter-free layers
# ---------------------------------------------------------------------------


def test_dropout(rng):
    x = _normal(rng, 50, 40)
    drop = rf.nn.Dropout(0.25)
    assert drop.init(KEY) == {}
    y = drop(x, key=KEY, training=True)
    kept = np.asarray(y.value) != 0
    assert 0.65 < kept.mean() < 0.85
    np.testing.assert_allclose(np.asarray(y.value)[kept], np.asarray(x)[kept] / 0.75, rtol=1e-6)
    np.testing.assert_array_equal(drop(x, key=KEY, training=True).value, y.value)  # same key, same mask
    np.testing.assert_array_equal(drop({}, x, key=KEY).value, y.value)  # params-first call form
    np.testing.assert_array_equal(drop(x, training=False).value, x)  # eval: identity, no key needed
    with pytest.raises(ValueError, match="key"):
        drop(x, training=True)
    # gradient: mask / (1 - p), as for the op
    g = rf.grad(lambda x: rf.sum(drop(x, key=KEY)))(x)
    np.testing.assert_allclose(g, kept / 0.75, rtol=1e-6)
    for bad in (-0.1, 1.0, True):
        with pytest.raises(ValueError):
            rf.nn.Dropout(bad)


@pytest.mark.parametrize(("k", "stride"), [(2, None), (3, 2)])
def test_maxpool_matches_reduce_window(rng, k, stride):
    pool = rf.nn.MaxPool2d(k, stride)
    s = stride or k

    def ref(p, x):
        return lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, k, k), (1, 1, s, s), "VALID")

    _check_layer(lambda p, x: pool(x), ref, {}, _normal(rng, 2, 3, 7, 7), rng, argnums=1)
    np.testing.assert_array_equal(pool({}, jnp.ones((1, 1, 4, 4))).value, pool(jnp.ones((1, 1, 4, 4))).value)


@pytest.mark.parametrize("size", [1, (2, 3)])
def test_adaptive_avg_pool_matches_mean(rng, size):
    pool = rf.nn.AdaptiveAvgPool2d(size)
    hash(pool)  # list/tuple sizes stay hashable (static config)
    if size == 1:
        ref = lambda p, x: jnp.mean(x, axis=(2, 3), keepdims=True)  # noqa: E731
        x = _normal(rng, 2, 3, 5, 5)
    else:  # bins divide evenly: plain average pooling 2x2
        ref = lambda p, x: x.reshape(2, 3, 2, 2, 3, 2).mean(axis=(3, 5))  # noqa: E731
        x = _normal(rng, 2, 3, 4, 6)
    _check_layer(lambda p, x: pool(x), ref, {}, x, rng, argnums=1)


def test_flatten(rng):
    x = _normal(rng, 2, 3, 4)
    _check_layer(lambda p, x: rf.nn.Flatten()(x), lambda p, x: x.reshape(2, 12), {}, x, rng, argnums=1)


def test_param_free_layers_reject_params():
    with pytest.raises(TypeError, match="no parameters"):
        rf.nn.Flatten()({"weight": jnp.ones(2)}, jnp.ones((2, 2)))
    with pytest.raises(TypeError):
        rf.nn.MaxPool2d(2)()


# ---------------------------------------------------------------------------
# Sequential, config objects
# ---------------------------------------------------------------------------


def test_sequential_matches_manual_chain(rng):
    layers = [rf.nn.Conv2d(1, 4, 3, padding=1), rf.relu, rf.nn.MaxPool2d(2), rf.nn.Flatten(), rf.nn.Linear(16, 3)]
    seq = rf.nn.Sequential(layers)
    assert rf.nn.Sequential(*layers) == seq and len(seq) == 5 and seq[4] == layers[4]
    params = seq.init(KEY)
    assert sorted(params) == ["0", "4"]  # only layers with parameters, PyTorch state-dict names

    def ref(p, x):
        y = lax.conv_general_dilated(
            x, p["0"]["weight"], (1, 1), [(1, 1)] * 2, dimension_numbers=("NCHW", "OIHW", "NCHW")
        )
        y = jax.nn.relu(y + p["0"]["bias"].reshape(1, -1, 1, 1))
        y = lax.reduce_window(y, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID").reshape(2, 16)
        return y @ p["4"]["weight"] + p["4"]["bias"].reshape(1, -1)

    _check_layer(seq, ref, params, _normal(rng, 2, 1, 4, 4), rng, atol=1e-4, rtol=1e-4)


def test_sequential_dropout_and_errors(rng):
    seq = rf.nn.Sequential([rf.nn.Linear(4, 4), rf.nn.Dropout(0.5)])
    params = seq.init(KEY)
    x = _normal(rng, 3, 4)
    a = seq(params, x, key=KEY)
    np.testing.assert_array_equal(seq(params, x, key=KEY).value, a.value)
    np.testing.assert_array_equal(seq(params, x, training=False).value, seq[0](params["0"], x).value)
    with pytest.raises(ValueError, match="key"):
        seq(params, x)
    with pytest.raises(KeyError, match="'0'"):
        seq({}, x, training=False)
    with pytest.raises(TypeError, match="BatchNorm2d"):
        rf.nn.Sequential([rf.nn.Conv2d(1, 2, 3), rf.nn.BatchNorm2d(2)])
    with pytest.raises(TypeError, match="not callable"):
        rf.nn.Sequential([rf.nn.Linear(2, 2), 3])


def test_layers_are_static_hashable_configs():
    layers = [
        rf.nn.Linear(2, 3),
        rf.nn.Conv2d(1, 2, 3),
        rf.nn.BatchNorm2d(2),
        rf.nn.LayerNorm(4),
        rf.nn.Embedding(5, 2),
        rf.nn.Dropout(0.1),
        rf.nn.MaxPool2d(2),
        rf.nn.AdaptiveAvgPool2d((1, 1)),
        rf.nn.Flatten(),
        rf.nn.MultiheadAttention(4, 2),
        rf.nn.TransformerBlock(4, 2),
        rf.nn.Sequential([rf.nn.Linear(2, 2), rf.relu]),
    ]
    for layer in layers:
        hash(layer)
        assert layer == dataclasses.replace(layer) if not isinstance(layer, rf.nn.Sequential) else True
        with pytest.raises(dataclasses.FrozenInstanceError):
            layer.foo = 1  # type: ignore[attr-defined]
    assert rf.nn.Linear(2, 3) == rf.nn.Linear(2, 3)


@pytest.mark.parametrize(
    "make",
    [
        lambda: rf.nn.Linear(0, 3),
        lambda: rf.nn.Linear(2.5, 3),
        lambda: rf.nn.Conv2d(1, 2, 0),
        lambda: rf.nn.Conv2d(1, 2, 3, stride=0),
        lambda: rf.nn.BatchNorm2d(2, momentum=1.5),
        lambda: rf.nn.LayerNorm(-1),
        lambda: rf.nn.MultiheadAttention(10, 3),
        lambda: rf.nn.AdaptiveAvgPool2d((1, 2, 3)),
    ],
)
def test_invalid_configs_raise(make):
    with pytest.raises(ValueError):
        make()


def test_wrong_params_name_the_layer():
    lin = rf.nn.Linear(2, 3)
    with pytest.raises(KeyError, match="Linear: params has no 'bias'"):
        lin({"weight": jnp.ones((2, 3))}, jnp.ones((1, 2)))
    with pytest.raises(TypeError, match="Linear"):
        lin(jnp.ones((2, 3)), jnp.ones((1, 2)))


def test_training_loop_with_optax_decreases_loss(rng):
    optax = pytest.importorskip("optax")
    model = rf.nn.Sequential([rf.nn.Linear(4, 16), rf.tanh, rf.nn.Linear(16, 3)])
    params = model.init(KEY)
    x = _normal(rng, 32, 4)
    y = jnp.asarray(np.argmax(np.asarray(x[:, :3]), axis=1), jnp.int32)
    opt = optax.adam(3e-2)
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        loss, grads = rf.value_and_grad(lambda p: rf.cross_entropy(model(p, x), y))(params)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    # optax's adam mixes a python float with its int32 step count (not strict-clean)
    with jax.numpy_dtype_promotion("standard"):
        for _ in range(40):
            params, state, loss = step(params, state)
            losses.append(float(loss))
    assert losses[-1] < 0.3 * losses[0]
