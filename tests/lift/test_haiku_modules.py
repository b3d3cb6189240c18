"""Every haiku module of haiku's own integration descriptors
(``haiku._src.integration.descriptors.ALL_MODULES``: linear, convolutions and their
transposes, the norms, attention, pooling, embeddings, the recurrent cores unrolled
statically and with ``dynamic_unroll``, nets such as ResNet and VectorQuantizer),
through ``hk.transform_with_state``, differentiated on the tape against ``jax.grad``:
with respect to the parameters, the input and both, float64 and float32, eagerly
and under ``jax.jit``. A sweep over code nobody here wrote (docs/testing.md); slow:
the default run has haiku's models in ``test_libraries.py``."""

from __future__ import annotations

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import pytest

import rumus_fx as rf

descriptors = pytest.importorskip("haiku._src.integration.descriptors")
MODULES = {d.name: d for d in descriptors.ALL_MODULES}


def _case(d, x64: bool):
    f = hk.transform_with_state(lambda x: d.create()(x))
    floating = jnp.issubdtype(d.dtype, jnp.floating)
    dtype = jnp.float64 if x64 else jnp.float32
    if floating:
        x = jax.random.normal(jax.random.PRNGKey(1), d.shape, dtype)
    else:  # token ids (Embed)
        x = jax.random.randint(jax.random.PRNGKey(1), d.shape, 0, 6).astype(d.dtype)
    params, state = f.init(jax.random.PRNGKey(42), x)
    params = jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)

    def loss(params, x, state):
        out, new_state = f.apply(params, state, jax.random.PRNGKey(3), x)
        floats = [o for o in jax.tree.leaves(out) if jnp.issubdtype(o.dtype, jnp.inexact)]
        return sum(jnp.sum(jnp.sin(o) ** 2) for o in floats), new_state

    argsets = ([(0,)] if jax.tree.leaves(params) else []) + ([(1,), (0, 1)] if floating else [])
    return loss, (params, x, state), argsets


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:w_init_scale is deprecated:DeprecationWarning")  # haiku's own, in its descriptors
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("x64", [True, False], ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(MODULES))
def test_haiku_module_matches_jax_grad(name, x64, jit):
    # haiku's own code mixes dtypes (an int32 count with a float, in batch norm, the
    # attention and the quantizers): the suite's strict promotion would fail it before rf
    with jax.enable_x64(x64), jax.numpy_dtype_promotion("standard"):
        loss, args, argsets = _case(MODULES[name], x64)
        assert argsets, name
        for argnums in argsets:
            want = jax.grad(loss, argnums=argnums, has_aux=True)
            got = rf.grad(rf.lift(loss), argnums=argnums, has_aux=True)
            if jit:
                want, got = jax.jit(want), jax.jit(got)
            tol = 1e-9 if x64 else 1e-4
            chex.assert_trees_all_close(got(*args), want(*args), rtol=tol, atol=tol)
