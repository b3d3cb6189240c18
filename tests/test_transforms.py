"""rf.grad / rf.value_and_grad / rf.vjp against jax's, under jit, vmap and jvp."""

import gc
from typing import NamedTuple

import chex
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf


class Params(NamedTuple):
    w: jax.Array
    b: jax.Array


def _data():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {
        "layers": [
            Params(jax.random.normal(k1, (5, 7)) * 0.5, jnp.zeros(7)),
            Params(jax.random.normal(k2, (7, 3)) * 0.5, jnp.full(3, 0.1)),
        ],
        "scale": jnp.array(1.5),
    }
    x = jax.random.normal(k3, (6, 5))
    y = jax.random.normal(k4, (6, 3))
    return params, x, y


def loss_rf(params, x, y):
    h = x
    for i, layer in enumerate(params["layers"]):
        h = rf.add_bias(h @ layer.w, layer.b)
        if i == 0:
            h = rf.relu(h)
    return rf.mse_loss(h * params["scale"], y)


def loss_jnp(params, x, y):
    h = x
    for i, layer in enumerate(params["layers"]):
        h = h @ layer.w + layer.b[None, :]
        if i == 0:
            h = jax.nn.relu(h)
    return jnp.mean((h * params["scale"] - y) ** 2)


def test_grad_pytrees_match_jax():
    params, x, y = _data()
    got = rf.grad(loss_rf)(params, x, y)
    want = rf.testing.jax_oracle_grad(loss_jnp, (params, x, y))
    chex.assert_trees_all_equal_structs(got, want)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    assert isinstance(got["layers"][0], Params)
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(got))


@pytest.mark.parametrize("argnums", [0, 1, (0, 1), (1, 0), -2, (0, 2)])
def test_argnums(argnums):
    params, x, y = _data()
    got = rf.grad(loss_rf, argnums=argnums)(params, x, y)
    want = jax.grad(loss_jnp, argnums=argnums)(params, x, y)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


def test_value_and_grad_and_has_aux():
    params, x, y = _data()

    def f(p, x, y):
        loss = loss_rf(p, x, y)
        return loss, {"loss": loss, "twice": loss * 2.0, "n": 3}

    (value, aux), g = rf.value_and_grad(f, has_aux=True)(params, x, y)
    want_v, want_g = jax.value_and_grad(loss_jnp)(params, x, y)
    np.testing.assert_allclose(value, want_v, rtol=1e-6)
    assert isinstance(aux["loss"], jax.Array) and aux["n"] == 3
    np.testing.assert_allclose(aux["twice"], 2 * want_v, rtol=1e-6)
    chex.assert_trees_all_close(g, want_g, rtol=1e-5, atol=1e-6)
    g2, aux2 = rf.grad(f, has_aux=True)(params, x, y)
    chex.assert_trees_all_close(g2, want_g, rtol=1e-5, atol=1e-6)
    assert set(aux2) == {"loss", "twice", "n"}


def test_unused_leaf_gets_zeros():
    def f(p):
        return rf.sum(p["used"] * 2.0)

    g = rf.grad(f)({"used": jnp.ones(3), "unused": jnp.ones((2, 2), jnp.bfloat16)})
    np.testing.assert_array_equal(g["unused"], np.zeros((2, 2)))
    assert g["unused"].dtype == jnp.bfloat16
    g0 = rf.grad(lambda a: jnp.asarray(3.0))(jnp.ones(2))  # constant function
    np.testing.assert_array_equal(g0, np.zeros(2))


def test_grad_dtypes_follow_inputs():
    def f(a, b):
        return rf.sum(rf.mul(a, b))

    a = jnp.ones(3, jnp.bfloat16)
    b = jnp.arange(3.0)
    with jax.numpy_dtype_promotion("standard"):  # bfloat16 * float32 on purpose
        ga, gb = rf.grad(f, argnums=(0, 1))(a, b)
    assert ga.dtype == jnp.bfloat16 and gb.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(ga, np.float32), [0, 1, 2])
    assert rf.grad(lambda s: s * s)(3.0) == pytest.approx(6.0)  # python scalar input


def test_error_types():
    with pytest.raises(TypeError, match="scalar"):
        rf.grad(lambda x: x * 2.0)(jnp.ones(3))
    with pytest.raises(TypeError, match="int32"):
        rf.grad(lambda x: rf.sum(x))(jnp.arange(3))
    with pytest.raises(TypeError, match="real-valued outputs"):
        rf.grad(lambda x: jnp.asarray(1))(jnp.ones(3))
    with pytest.raises(TypeError, match="argnums"):
        rf.grad(lambda x: rf.sum(x), argnums=1)(jnp.ones(3))
    with pytest.raises(TypeError, match="pair"):
        rf.grad(lambda x: rf.sum(x), has_aux=True)(jnp.ones(3))
    # jax raises the same types for the same mistakes
    with pytest.raises(TypeError, match="scalar"):
        jax.grad(lambda x: x * 2.0)(jnp.ones(3))
    with pytest.raises(TypeError):
        jax.grad(jnp.sum)(jnp.arange(3))


def test_size_one_output_is_allowed():
    g = rf.grad(lambda x: rf.sum(x, axis=0, keepdims=True))(jnp.ones(4))
    np.testing.assert_array_equal(g, np.ones(4))


def test_vjp_pytree_outputs_and_repeated_calls():
    x = jnp.array([1.0, 2.0, 3.0])
    w = jnp.array([[1.0, 0.5], [0.0, -1.0], [2.0, 1.0]])

    def f(x, w):
        h = x.reshape(1, 3) @ w
        return {"h": h, "e": rf.exp(x), "const": jnp.ones(2)}

    def fj(x, w):
        return {"h": x.reshape(1, 3) @ w, "e": jnp.exp(x), "const": jnp.ones(2)}

    out, vjp_fn = rf.vjp(f, x, w)
    out_j, vjp_j = jax.vjp(fj, x, w)
    chex.assert_trees_all_close(out, out_j)
    ct = {"h": jnp.array([[1.0, -2.0]]), "e": jnp.array([0.5, 1.0, 2.0]), "const": jnp.ones(2)}
    for _ in range(2):  # may be called more than once
        chex.assert_trees_all_close(vjp_fn(ct), vjp_j(ct), rtol=1e-6)
    with pytest.raises(TypeError, match="structure"):
        vjp_fn({"h": ct["h"]})


def test_vjp_has_aux_and_integer_primal():
    def f(x, idx):
        return rf.sum(x * 2.0), {"idx": idx}

    out, vjp_fn, aux = rf.vjp(f, jnp.ones(3), jnp.arange(2), has_aux=True)
    gx, gidx = vjp_fn(jnp.array(1.0))
    np.testing.assert_allclose(gx, 2 * np.ones(3))
    assert gidx.dtype == jax.dtypes.float0 and gidx.shape == (2,)
    assert aux["idx"].shape == (2,)


def _int_and_float_outputs(xi, xf):
    return 2 * xi.T, xf.T * xf.T


@pytest.mark.parametrize("lifted", [False, True])
def test_vjp_takes_float0_cotangents_of_integer_outputs(lifted):
    # jax's pullback takes a float0 (or integer) cotangent for an integer output; rf's
    # cast it with astype and failed with "invalid literal for int()".
    xi = np.arange(6, dtype=np.int32).reshape(2, 3)
    xf = np.arange(12, dtype=np.float32).reshape(3, 4)
    f = rf.lift(_int_and_float_outputs) if lifted else _int_and_float_outputs
    ctf = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    _, want = jax.vjp(_int_and_float_outputs, xi, xf)
    _, got = rf.vjp(f, xi, xf)
    for cti in (np.zeros((3, 2), jax.dtypes.float0), np.ones((3, 2), np.int32)):
        gi, gf = got((cti, ctf))
        assert gi.dtype == jax.dtypes.float0 and gi.shape == (2, 3)
        np.testing.assert_allclose(gf, want((cti, ctf))[1], rtol=1e-6)
        np.testing.assert_allclose(gf, 2 * xf * ctf.T, rtol=1e-6)  # d(x^2) = 2x, transposed back
    under_jit = jax.jit(lambda c: rf.vjp(f, xi, xf)[1]((np.zeros((3, 2), jax.dtypes.float0), c))[1])
    np.testing.assert_allclose(under_jit(ctf), 2 * xf * ctf.T, rtol=1e-6)
    with pytest.raises(ValueError, match=r"float0\[4, 3\] cotangent for an output of type float32\[4, 3\]"):
        got((np.zeros((3, 2), jax.dtypes.float0), np.zeros((4, 3), jax.dtypes.float0)))


def test_jit_traces_once_and_leaves_nothing_behind():
    params, x, y = _data()
    traces = []

    def f(p, x, y):
        traces.append(1)
        return loss_rf(p, x, y)

    step = jax.jit(rf.value_and_grad(f))
    gc.collect()
    before = rf.debug.live_storages()
    with jax.checking_leaks():
        for _ in range(3):
            value, g = step(params, x, y)
    gc.collect()
    assert len(traces) == 1
    assert rf.debug.live_storages() == before
    chex.assert_trees_all_close(g, jax.grad(loss_jnp)(params, x, y), rtol=1e-5, atol=1e-6)


def test_vmap_per_example_gradients():
    params, x, y = _data()

    def per_example(p, xi, yi):
        return loss_rf(p, xi.reshape(1, 5), yi.reshape(1, 3))

    def per_example_j(p, xi, yi):
        return loss_jnp(p, xi.reshape(1, 5), yi.reshape(1, 3))

    got = jax.vmap(rf.grad(per_example), in_axes=(None, 0, 0))(params, x, y)
    want = jax.jit(jax.vmap(jax.grad(per_example_j), in_axes=(None, 0, 0)))(params, x, y)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    assert got["layers"][0].w.shape == (6, 5, 7)
    jitted = jax.jit(jax.vmap(rf.grad(per_example), in_axes=(None, 0, 0)))(params, x, y)
    chex.assert_trees_all_close(jitted, want, rtol=1e-5, atol=1e-6)


def test_jvp_forward_over_reverse_hvp():
    params, x, y = _data()
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    v = jax.random.normal(jax.random.key(7), flat.shape)

    def g_rf(flat):
        return jax.flatten_util.ravel_pytree(rf.grad(loss_rf)(unravel(flat), x, y))[0]

    def g_j(flat):
        return jax.flatten_util.ravel_pytree(jax.grad(loss_jnp)(unravel(flat), x, y))[0]

    _, hvp = jax.jvp(g_rf, (flat,), (v,))
    _, hvp_j = jax.jit(lambda f, t: jax.jvp(g_j, (f,), (t,)))(flat, v)  # the oracle compiled
    np.testing.assert_allclose(hvp, hvp_j, rtol=1e-4, atol=1e-5)
    _, hvp_jit = jax.jit(lambda f, t: jax.jvp(g_rf, (f,), (t,)))(flat, v)
    np.testing.assert_allclose(hvp_jit, hvp_j, rtol=1e-4, atol=1e-5)
    # and against the explicit Hessian
    hess = jax.jit(jax.hessian(lambda f: loss_jnp(unravel(f), x, y)))(flat)
    np.testing.assert_allclose(hvp, hess @ v, rtol=1e-4, atol=1e-5)


def test_linearize_of_rf_grad():
    x = jnp.array([0.3, -0.2, 0.9])
    g = rf.grad(lambda x: rf.sum(rf.exp(x) * x))
    _, lin = jax.linearize(g, x)
    v = jnp.array([1.0, 0.0, 2.0])
    want = jax.jvp(jax.grad(lambda x: jnp.sum(jnp.exp(x) * x)), (x,), (v,))[1]
    np.testing.assert_allclose(lin(v), want, rtol=1e-6)


def test_float64_matches_to_1e10(x64):
    params, x, y = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), _data())
    got = rf.grad(loss_rf)(params, x, y)
    want = rf.testing.jax_oracle_grad(loss_jnp, (params, x, y))
    chex.assert_trees_all_close(got, want, rtol=1e-10, atol=1e-12)
    assert got["scale"].dtype == jnp.float64


def test_errors_name_the_transform_called():
    with pytest.raises(TypeError, match=r"^grad: "):
        rf.grad(lambda x: rf.sum(x), argnums=1)(jnp.ones(3))
    with pytest.raises(TypeError, match=r"^value_and_grad: "):
        rf.value_and_grad(lambda x: rf.sum(x), argnums=1)(jnp.ones(3))


def test_nested_reverse_mode_is_recorded_on_the_enclosing_tape():
    f = lambda x: rf.sum(rf.exp(x))  # noqa: E731
    x = jnp.array([0.1, 0.2, 0.3])
    want = jax.grad(lambda x: jnp.sum(jax.grad(lambda y: jnp.sum(jnp.exp(y)))(x)))(x)
    np.testing.assert_allclose(rf.grad(lambda x: rf.sum(rf.grad(f)(x)))(x), want, rtol=1e-6)
    # the other second-order routes
    np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(rf.grad(f)(x)))(x), want, rtol=1e-6)
    # an independent rf.grad on plain arrays inside a recording tape gives arrays
    with rf.Tape():
        g = rf.grad(f)(x)
        assert isinstance(g, jax.Array)
        np.testing.assert_allclose(g, jnp.exp(x), rtol=1e-6)
