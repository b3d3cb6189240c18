"""A ``jax.custom_vjp`` whose ``bwd`` does not vanish on a zero cotangent (flax's fp8
layers return the new scale and amax history as the "gradient" of the old ones):
jax.grad calls it wherever the differentiated computation uses the call's outputs,
even where their cotangents are all zero, and not where they are unused, cut by
``stop_gradient``/``sign``/``floor``, or inside a ``jax.jit``/``cond``/``checkpoint``
whose outputs' cotangents are all zero. rf's tape skipped every row without a
cotangent, so such a ``bwd`` never ran: a silent wrong gradient (0 where jax.grad
gives the new value). Each program here against jax.grad, eagerly and under jit,
with respect to the data alone, the scale alone and both (Note [A user's bwd on
zero cotangents] in rumus_fx/lift/program.py)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import rumus_fx as rf


@jax.custom_vjp
def overwrite(x, s):
    """Passes x and s through; its bwd returns a new s whatever the cotangent."""
    return x * 1.0, s * 1.0


overwrite.defvjp(lambda x, s: ((x * 1.0, s * 1.0), (s,)), lambda res, g: (None, res[0] + 41.0))


@jax.custom_vjp
def overwrite_sz(x, s):
    return x * 1.0, s * 1.0


overwrite_sz.defvjp(
    lambda x, s: ((x.value * 1.0, s.value * 1.0), (s.value,)),
    lambda res, g: (None, res[0] + 41.0),
    symbolic_zeros=True,
)


@jax.custom_vjp
def cut(x):
    """The identity whose bwd returns None: a zero cotangent for what feeds it."""
    return x


cut.defvjp(lambda x: (x, None), lambda r, g: (None,))


def _ow(x, s):
    return overwrite(x, s)[0]


def _sum(y):
    return jnp.sum(y)


PROGRAMS = {
    # the bwd runs (jax.grad: 44 per call)
    "used, zero cotangent": lambda x, s: _sum(cut(_ow(x, s))) + _sum(x),
    "inside a jit with the cut": lambda x, s: jax.jit(lambda x, s: _sum(cut(_ow(x, s))))(x, s) + _sum(x),
    "unused outputs of a jit": lambda x, s: _sum(x) + 0 * jax.jit(lambda x, s: _sum(_ow(x, s)))(x, s),
    "output times zero": lambda x, s: _sum(x) + _sum(0.0 * overwrite(x, s)[1]),
    "inside a scan": lambda x, s: (
        _sum(x) + jax.lax.scan(lambda c, _: (c + _sum(cut(_ow(x, s))), None), 0.0, None, length=2)[0]
    ),
    "inside a cond": lambda x, s: _sum(x) + jax.lax.cond(True, lambda: _sum(cut(_ow(x, s))), lambda: 0.0),
    "inside a checkpoint": lambda x, s: _sum(x) + jax.checkpoint(lambda x, s: _sum(cut(_ow(x, s))))(x, s),
    "cut after a scan carry": lambda x, s: (
        _sum(x) + _sum(cut(jax.lax.scan(lambda c, _: (c + _ow(x, s), None), x, None, length=2)[0]))
    ),
    "cut after sin": lambda x, s: _sum(x) + _sum(cut(jnp.sin(_ow(x, s)))),
    "symbolic zeros": lambda x, s: _sum(cut(overwrite_sz(x, s)[0])) + _sum(x),
    "two in a chain": lambda x, s: _sum(cut(_ow(_ow(x, s), s))) + _sum(x),
    "cut after relu (a custom_jvp)": lambda x, s: _sum(x) + _sum(cut(jax.nn.relu(_ow(x, s)))),
    "inside a vmap": lambda x, s: _sum(x) + _sum(cut(jax.vmap(lambda xi: _ow(xi[None], s))(x))),
    "cut after a fori_loop": lambda x, s: _sum(x) + _sum(cut(jax.lax.fori_loop(0, 2, lambda i, c: c + _ow(x, s), x))),
    "cut after a scan of a checkpoint": lambda x, s: (
        _sum(x) + _sum(cut(jax.lax.scan(lambda c, _: (c + jax.checkpoint(_ow)(x, s), None), x, None, length=2)[0]))
    ),
    # the bwd does not run (jax.grad: 0 from it)
    "unused outputs": lambda x, s: (overwrite(x, s), _sum(x))[1],
    "stop_gradient": lambda x, s: _sum(x) + _sum(jax.lax.stop_gradient(overwrite(x, s)[1])),
    "cut after sign": lambda x, s: _sum(x) + _sum(cut(jnp.sign(_ow(x, s)))),
    "floor": lambda x, s: _sum(x) + _sum(jnp.floor(_ow(x, s))),
    "cut after a jit": lambda x, s: _sum(x) + _sum(cut(jax.jit(_ow)(x, s))),
    "cut after a jit in a jit": lambda x, s: _sum(x) + jax.jit(lambda x, s: _sum(cut(jax.jit(_ow)(x, s))))(x, s),
    "cut after a cond": lambda x, s: _sum(x) + _sum(cut(jax.lax.cond(True, lambda: _ow(x, s), lambda: x))),
    "cut after a switch": lambda x, s: _sum(x) + _sum(cut(jax.lax.switch(1, [lambda: x, lambda: _ow(x, s)]))),
    "cut after a checkpoint": lambda x, s: _sum(x) + _sum(cut(jax.checkpoint(_ow)(x, s))),
    "cut after a map (no carry)": lambda x, s: _sum(x) + _sum(cut(jax.lax.map(lambda xi: _ow(xi[None], s), x))),
    "cut after a checkpoint of a scan": lambda x, s: (
        _sum(x)
        + _sum(
            cut(
                jax.checkpoint(lambda x, s: jax.lax.scan(lambda c, _: (c + _ow(x, s), None), x, None, length=2)[0])(
                    x, s
                )
            )
        )
    ),
    "cut after a scan whose carry does not carry s": lambda x, s: (
        _sum(x) + _sum(cut(jax.lax.scan(lambda c, _: (c * 2, _ow(x, s)), x, None, length=2)[1]))
    ),
    "a cond's unused output": lambda x, s: (
        _sum(jax.lax.cond(True, lambda: (x * 2.0, _ow(x, s)), lambda: (x, x))[0]) + _sum(s)
    ),
    "a scan's unused stacked output": lambda x, s: (
        _sum(jax.lax.scan(lambda c, _: (c * 2.0, _ow(x, s)), x, None, length=2)[0]) + _sum(s)
    ),
    "a checkpoint's unused output": lambda x, s: (
        _sum(jax.checkpoint(lambda x, s: (x * 2.0, _ow(x, s)))(x, s)[0]) + _sum(s)
    ),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("argnums", [0, 1, (0, 1)], ids=["data", "scale", "both"])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_bwd_on_zero_cotangents_as_jax_grad(name, argnums, jit):
    f = PROGRAMS[name]
    x, s = jnp.array([1.0, 2.0]), jnp.array([3.0])
    want, got = jax.grad(f, argnums=argnums), rf.grad(rf.lift(f), argnums=argnums)
    if jit:
        want, got = jax.jit(want), jax.jit(got)
    chex.assert_trees_all_close(got(x, s), want(x, s), rtol=1e-6, atol=0)


def test_the_programs_tell_the_two_apart():
    """The oracle is not trivially 0 or 44 everywhere: both kinds are covered."""
    x, s = jnp.array([1.0, 2.0]), jnp.array([3.0])
    values = {name: float(jax.grad(f, argnums=1)(x, s)[0]) for name, f in PROGRAMS.items()}
    assert values["used, zero cotangent"] == 44.0 and values["cut after a jit"] == 0.0
    assert {0.0, 1.0, 44.0, 88.0} == set(values.values())


def test_shard_map_with_the_bwd_inside():
    mesh = jax.make_mesh((1,), ("i",))

    def f(x, s):
        body = jax.shard_map(lambda x, s: _sum(cut(_ow(x, s)))[None], mesh=mesh, in_specs=(P(), P()), out_specs=P())
        return _sum(x) + _sum(body(x, s))

    x, s = jnp.array([1.0, 2.0]), jnp.array([3.0])
    for g in (rf.grad(rf.lift(f), argnums=1), jax.jit(rf.grad(rf.lift(f), argnums=1))):
        np.testing.assert_allclose(g(x, s), jax.jit(jax.grad(f, argnums=1))(x, s))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_flax_fp8_dense_overwrites_its_scales_as_jax_grad(jit):
    """flax's fp8 Dense: the `_overwrite_with_gradient` collection's gradients are
    the new amax histories and scales. rf gave zeros for the input's and the
    kernel's (their bwd's cotangents are all zero), 1.0 off jax.grad's."""
    nn = pytest.importorskip("flax.linen")
    key, init_key, x_key = jax.random.split(jax.random.PRNGKey(123), 3)
    x = jax.random.uniform(x_key, (8, 16))
    dense = nn.DenseGeneral(features=12, use_bias=True, dot_general_cls=nn.Fp8DotGeneral)
    variables = dense.init(init_key, x)
    dy = jax.random.normal(key, (8, 12))

    def loss(variables, x):
        return jnp.sum(dense.apply(variables, x) * dy)

    want, got = jax.grad(loss, argnums=(0, 1)), rf.grad(rf.lift(loss), argnums=(0, 1))
    if jit:
        want, got = jax.jit(want), jax.jit(got)
    w, g = want(variables, x), got(variables, x)
    meta = w[0]["_overwrite_with_gradient"]
    (layer,) = meta.values()
    assert float(layer["input_amax_history"][0]) > 0  # the new history, not a zero gradient
    chex.assert_trees_all_close(g, w, rtol=1e-6, atol=1e-6)
