"""quax: gradients through ``quax.quaxify``'d functions on quax's example array types,
taken by jax.grad (or equinox's filter_grad) with respect to each argument alone and all,
eagerly and under jit: LoRA-adapted equinox MLPs (the frozen weight's gradient stopped,
and not), the symbolic ``Zero``, tridiagonal and BCOO sparse matrices (a repeated
index), named arrays, unitful arrays; both orders of ``quaxify`` and ``jax.grad``."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
import quax
from quax.examples import lora, named, sparse, structured_matrices, unitful, zero

jax.config.update("jax_enable_x64", True)
ARGNUMS = {2: [(0,), (1,), (0, 1)], 3: [(0,), (1,), (2,), (0, 1, 2)]}


def _grads(fn, *args, jit):
    """jax.grad of ``fn`` with respect to each argument alone and all, each called once."""
    for argnums in ARGNUMS[len(args)]:
        g = jax.grad(fn, argnums)
        (jax.jit(g) if jit else g)(*args)


def _mlp(stop_gradient):
    mlp = eqx.nn.MLP(3, 2, 5, 2, activation=jnp.tanh, key=jr.PRNGKey(0))
    mlp = jax.tree.map(lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a, mlp)
    mlp = lora.loraify(mlp, rank=2, scale=0.3, stop_gradient=stop_gradient, key=jr.PRNGKey(1))
    # b starts at zero: move it, so a's gradient is not zero
    bs = [jnp.full_like(layer.weight.b, 0.2 * (i + 1)) for i, layer in enumerate(mlp.layers)]
    return eqx.tree_at(lambda m: [layer.weight.b for layer in m.layers], mlp, bs)


def _lora_loss(model, x):
    y = jax.vmap(quax.quaxify(model))(x)
    return jnp.sum(jnp.sin(y) + y**2)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("stop_gradient", [True, False])
def test_lora_mlp(stop_gradient, jit):
    model = _mlp(stop_gradient)
    x = jr.normal(jr.PRNGKey(2), (4, 3), jnp.float64)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    _grads(lambda p, x: _lora_loss(eqx.combine(p, static), x), params, x, jit=jit)
    g = eqx.filter_grad(_lora_loss)
    (eqx.filter_jit(g) if jit else g)(model, x)


@pytest.mark.parametrize("jit", [False, True])
def test_grad_inside_quaxify(jit):
    model = _mlp(True)
    x = jr.normal(jr.PRNGKey(3), (3,), jnp.float64)

    def loss(m, x):
        return jnp.sum(jnp.tanh(m(x)) ** 2)

    g = quax.quaxify(jax.grad(loss, argnums=1))
    (eqx.filter_jit(g) if jit else g)(model, x)


def _zero_fn(scale, x):
    z = zero.Zero((3,), jnp.float64)
    return jnp.sum(quax.quaxify(lambda z, s, x: jnp.sin(z * s + x) * s + z)(z, scale, x))


@pytest.mark.parametrize("jit", [False, True])
def test_zero(jit):
    _grads(_zero_fn, jnp.array([0.5, -1.0, 2.0]), jnp.array([0.3, 0.0, -0.7]), jit=jit)


def _tridiagonal_fn(lower, main, upper, v):
    m = structured_matrices.TridiagonalMatrix(lower, main, upper)
    return jnp.sum(jnp.cos(quax.quaxify(lambda m, v: m @ v)(m, v)))


@pytest.mark.parametrize("jit", [False, True])
def test_tridiagonal_matvec(jit):
    lower, main, upper = jnp.array([0.5, -0.2, 1.1]), jnp.array([2.0, -1.0, 0.3, 0.7]), jnp.array([0.4, 0.9, -0.6])
    v = jnp.array([1.0, -0.5, 0.25, 2.0])
    _grads(lambda main, v: _tridiagonal_fn(lower, main, upper, v), main, v, jit=jit)
    _grads(lambda lower, upper, v: _tridiagonal_fn(lower, main, upper, v), lower, upper, v, jit=jit)


INDICES = jnp.array([[0, 1], [2, 0], [1, 1], [2, 0]])  # (2, 0) twice


def _sparse_fn(data, dense, materialise):
    s = sparse.BCOO(data, INDICES, (3, 2), allow_materialise=materialise)
    return jnp.sum(jnp.sin(quax.quaxify(lambda s, d: s * d + d)(s, dense)))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("materialise", [False, True])
def test_sparse(materialise, jit):
    data = jnp.array([1.5, -0.5, 2.0, 0.25])
    dense = jnp.array([[0.3, -1.2], [0.8, 0.1], [-0.4, 2.2]])
    _grads(lambda d, x: _sparse_fn(d, x, materialise), data, dense, jit=jit)


def _named_fn(a, b):
    i, j, k = named.Axis(3), named.Axis(3), named.Axis(None)
    x = named.NamedArray(a, (i, j))
    y = named.NamedArray(b, (i, j))

    def f(x, y, z):
        return (x * y - x * x + y) @ z

    out = quax.quaxify(f)(x, y, named.NamedArray(b[:, :2], (j, k)))
    return jnp.sum(jnp.sin(out.enable_materialise().materialise()))


@pytest.mark.parametrize("jit", [False, True])
def test_named(jit):
    a = jnp.arange(9.0).reshape(3, 3) / 5 - 0.4
    b = jnp.arange(9.0).reshape(3, 3) / 7 + 0.1
    _grads(_named_fn, a, b, jit=jit)


def _unitful_fn(m, v):
    mass = unitful.Unitful(m, unitful.kilograms)
    speed = unitful.Unitful(v, {unitful.meters: 1, unitful.seconds: -1})
    energy = quax.quaxify(lambda m, v: m * v**2 * 0.5 + m * v * v)(mass, speed)
    return jnp.sum(energy.array**2)


@pytest.mark.parametrize("jit", [False, True])
def test_unitful(jit):
    _grads(_unitful_fn, jnp.array([1.0, 2.5, 0.5]), jnp.array([3.0, -1.0, 0.0]), jit=jit)
