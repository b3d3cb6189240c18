"""Real models written with JAX libraries nobody on this project wrote — flax
(linen and nnx), haiku, equinox and diffrax — differentiated on the tape with
``rf.lift`` and compared with ``jax.grad`` of the same function: float64 and
float32, eager and under ``jax.jit``, each differentiable argument alone and
all together, and float64 finite differences as a second oracle.

The programs are what users of each library write: a ResNet with batch-norm
state (linen's ``mutable=["batch_stats"]``, haiku's ``transform_with_state``),
a transformer block (nnx), an LSTM and a GRU over ``lax.scan`` (haiku's
``dynamic_unroll``; equinox under ``jax.vmap``), and an ODE solve (diffrax,
with each of its three adjoints). The default run has one float64 eager case
per library (all arguments together, and the finite differences); the other
modes and the arguments one by one run with ``-m slow``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import chex
import diffrax
import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import rumus_fx as rf
from rumus_fx.testing import check_fd


def _cast(tree: Any, dtype: Any) -> Any:
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _normal(seed: int, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _sumsq(tree: Any) -> jax.Array:
    return sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree))


# -- flax linen: a small ResNet with batch norm (training mode, running stats updated)


class _LinenBlock(nn.Module):
    features: int
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.dtype)
        y = nn.Conv(self.features, (3, 3), **kw)(x)
        y = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9, **kw)(y))
        y = nn.Conv(self.features, (3, 3), **kw)(y)
        y = nn.BatchNorm(use_running_average=False, momentum=0.9, **kw)(y)
        return nn.relu(x + y)


class _LinenResNet(nn.Module):
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.dtype)
        x = nn.Conv(4, (3, 3), strides=(1, 1), **kw)(x)
        for _ in range(2):
            x = _LinenBlock(4, self.dtype)(x)
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(3, **kw)(x.reshape(x.shape[0], -1))


def linen_resnet(dtype: Any) -> tuple[Callable, tuple]:
    model = _LinenResNet(dtype)
    x = _normal(0, (2, 6, 6, 3), dtype)
    variables = model.init(jax.random.key(0), x)
    params, stats = _cast(variables["params"], dtype), _cast(variables["batch_stats"], dtype)

    def loss(params: Any, stats: Any, x: jax.Array) -> jax.Array:
        out, updates = model.apply({"params": params, "batch_stats": stats}, x, mutable=["batch_stats"])
        # the new running statistics are outputs too (they depend on params and x)
        return jnp.sum(jnp.tanh(out)) + 0.1 * _sumsq(updates["batch_stats"])

    return loss, (params, stats, x)


# -- flax nnx: a pre-norm transformer block ------------------------------------------


class _NnxBlock(nnx.Module):
    def __init__(self, d: int, heads: int, dtype: Any, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.ln1 = nnx.LayerNorm(d, **kw)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False, **kw)
        self.ln2 = nnx.LayerNorm(d, **kw)
        self.up = nnx.Linear(d, 2 * d, **kw)
        self.down = nnx.Linear(2 * d, d, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.ln1(x)
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.attn(h, mask=mask)
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


def nnx_transformer(dtype: Any) -> tuple[Callable, tuple]:
    block = _NnxBlock(8, 2, dtype, nnx.Rngs(0))
    graphdef, state = nnx.split(block)
    x = _normal(1, (2, 5, 8), dtype)

    def loss(state: Any, x: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, state)
        return jnp.sum(jnp.sin(model(x)))

    return loss, (state, x)


# -- haiku: an LSTM unrolled with lax.scan, and a CNN with batch norm ------------------


def haiku_lstm(dtype: Any) -> tuple[Callable, tuple]:
    def forward(xs: jax.Array) -> jax.Array:
        core = hk.LSTM(5)
        out, _ = hk.dynamic_unroll(core, xs, core.initial_state(xs.shape[1]))
        return hk.Linear(2)(out)

    f = hk.without_apply_rng(hk.transform(forward))
    xs = _normal(2, (4, 2, 3), dtype)  # time, batch, features
    params = _cast(f.init(jax.random.key(1), xs), dtype)

    def loss(params: Any, xs: jax.Array) -> jax.Array:
        return jnp.sum(f.apply(params, xs) ** 2)

    return loss, (params, xs)


def haiku_cnn_bn(dtype: Any) -> tuple[Callable, tuple]:
    def forward(x: jax.Array) -> jax.Array:
        x = hk.Conv2D(4, 3)(x)
        x = hk.BatchNorm(True, True, 0.9)(x, is_training=True)
        x = jax.nn.relu(x)
        x = hk.MaxPool((1, 2, 2, 1), (1, 2, 2, 1), "VALID")(x)
        return hk.Linear(3)(x.reshape(x.shape[0], -1))

    f = hk.without_apply_rng(hk.transform_with_state(forward))
    x = _normal(3, (2, 6, 6, 2), dtype)
    params, state = f.init(jax.random.key(2), x)
    params, state = _cast(params, dtype), _cast(state, dtype)

    def loss(params: Any, state: Any, x: jax.Array) -> jax.Array:
        out, new_state = f.apply(params, state, x)
        return jnp.sum(jax.nn.log_softmax(out)[:, 0]) + 0.1 * _sumsq(new_state)

    return loss, (params, state, x)


# -- equinox: a GRU over lax.scan, batched with vmap ----------------------------------------


def equinox_gru(dtype: Any) -> tuple[Callable, tuple]:
    cell = eqx.nn.GRUCell(3, 4, key=jax.random.key(3))
    params, static = eqx.partition(cell, eqx.is_array)
    params = _cast(params, dtype)
    xs = _normal(4, (2, 5, 3), dtype)  # batch, time, features

    def loss(params: Any, xs: jax.Array) -> jax.Array:
        gru = eqx.combine(params, static)

        def run(seq: jax.Array) -> jax.Array:
            def step(h: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
                h = gru(x, h)
                return h, h

            _, hs = lax.scan(step, jnp.zeros(4, xs.dtype), seq)
            return hs

        return jnp.sum(jnp.tanh(jax.vmap(run)(xs)) ** 2)

    return loss, (params, xs)


# -- diffrax: an ODE solve, each adjoint ---------------------------------------------------


def diffrax_ode(adjoint: Any, batch: int = 0) -> Callable[[Any], tuple[Callable, tuple]]:
    """An ODE solve; with ``batch``, ``jax.vmap`` over a batch of initial values
    (equinox's loop buffers then appear as ``vprim``)."""

    def build(dtype: Any) -> tuple[Callable, tuple]:
        y0 = _normal(5, (batch, 3) if batch else (3,), dtype)
        params = {"a": _normal(6, (3, 3), dtype) * 0.3, "b": _normal(7, (3,), dtype)}

        def vector_field(t: Any, y: jax.Array, p: Any) -> jax.Array:
            return jnp.tanh(p["a"] @ y) - 0.5 * y + p["b"] * jnp.cos(t)

        def solve(y0: jax.Array, params: Any) -> jax.Array:
            sol = diffrax.diffeqsolve(
                diffrax.ODETerm(vector_field),
                diffrax.Tsit5(),
                t0=0.0,
                t1=1.0,
                dt0=0.125,
                y0=y0,
                args=params,
                saveat=diffrax.SaveAt(ts=jnp.linspace(0.25, 1.0, 4, dtype=dtype)),
                adjoint=adjoint,
                max_steps=16,
            )
            return jnp.sum(sol.ys**2)

        def loss(y0: jax.Array, params: Any) -> jax.Array:
            if batch:
                return jnp.sum(jax.vmap(solve, in_axes=(0, None))(y0, params))
            return solve(y0, params)

        return loss, (y0, params)

    return build


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    build: Callable[[Any], tuple[Callable, tuple]]
    diff: tuple[int, ...]
    fd: bool = True  # the gradient is the exact derivative of the discrete program
    fd_default: bool = False  # its finite-difference check runs by default
    default: bool = True  # its float64 eager case runs by default
    tol64: float = 1e-9  # float64 rtol (and atol / 10)


MODELS = [
    # the slowest default case (10 s): flax stays in the default run through nnx
    Model("flax_linen_resnet_batchnorm", linen_resnet, (0, 1, 2), default=False),
    # flax computes the attention softmax in float32 whatever the model's dtype: the
    # gradients through it (query, key, the first layer norm, x) agree to float32's
    # precision, and finite differences of the float32 softmax are noise
    Model("flax_nnx_transformer_block", nnx_transformer, (0, 1), fd=False, tol64=2e-6),
    Model("haiku_lstm_dynamic_unroll", haiku_lstm, (0, 1), fd_default=True),
    # (haiku's state holds integer counters: it is data here, its new value an output)
    Model("haiku_cnn_batchnorm_state", haiku_cnn_bn, (0, 2), default=False),
    Model("equinox_gru_scan_vmap", equinox_gru, (0, 1)),
    Model("diffrax_recursive_checkpoint_adjoint", diffrax_ode(diffrax.RecursiveCheckpointAdjoint()), (0, 1)),
    Model("diffrax_direct_adjoint", diffrax_ode(diffrax.DirectAdjoint()), (0, 1), default=False),
    Model("diffrax_direct_adjoint_vmapped", diffrax_ode(diffrax.DirectAdjoint(), batch=2), (0, 1), default=False),
    # the continuous adjoint: jax.grad's value (not the discrete derivative finite differences see)
    Model("diffrax_backsolve_adjoint", diffrax_ode(diffrax.BacksolveAdjoint()), (0, 1), fd=False, default=False),
]


def _tols(model: Model, dtype: Any) -> dict[str, float]:
    if dtype == jnp.float64:
        return dict(rtol=model.tol64, atol=model.tol64 / 10)
    return dict(rtol=2e-4, atol=2e-5)


def _run(model: Model, dtype: Any, jit: bool, argnums: tuple[int, ...]) -> None:
    with (
        jax.enable_x64(dtype == jnp.float64),
        jax.numpy_dtype_promotion("standard"),
        jax.numpy_rank_promotion("allow"),
    ):
        loss, args = model.build(dtype)
        g = rf.grad(lambda *a: rf.lift(loss)(*a), argnums=argnums)
        if jit:
            g = jax.jit(g)
        got = g(*args)
        want = rf.testing.jax_oracle_grad(loss, args, argnums)
        chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
        chex.assert_trees_all_close(got, want, **_tols(model, dtype))
        # the forward value is the library's own
        np.testing.assert_allclose(
            np.asarray(rf.lift(loss)(*args)), np.asarray(jax.jit(loss)(*args)), rtol=_tols(model, dtype)["rtol"] * 10
        )


MODES = [
    pytest.param(jnp.float64, False, id="f64-eager"),
    pytest.param(jnp.float64, True, id="f64-jit"),
    pytest.param(jnp.float32, False, id="f32-eager"),
    pytest.param(jnp.float32, True, id="f32-jit"),
]


def _cases() -> list[Any]:
    out = []
    for m in MODELS:
        for mode in MODES:
            fast = m.default and mode.id == "f64-eager"
            out.append(pytest.param(m, *mode.values, id=f"{m.name}-{mode.id}", marks=() if fast else pytest.mark.slow))
    return out


@pytest.mark.parametrize("model,dtype,jit", _cases())
def test_model_matches_jax_grad(model: Model, dtype: Any, jit: bool):
    _run(model, dtype, jit, model.diff)


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS, ids=[m.name for m in MODELS])
def test_each_argument_alone(model: Model):
    for r in range(1, len(model.diff)):
        for subset in itertools.combinations(model.diff, r):
            _run(model, jnp.float64, False, subset)


@pytest.mark.parametrize(
    "model",
    [pytest.param(m, marks=() if m.fd_default else pytest.mark.slow) for m in MODELS if m.fd],
    ids=[m.name for m in MODELS if m.fd],
)
def test_finite_differences(model: Model):
    with jax.enable_x64(True), jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        loss, args = model.build(jnp.float64)
        check_fd(lambda *a: rf.lift(loss)(*a), args, model.diff, tol=max(1e-6, model.tol64), directions=1)
