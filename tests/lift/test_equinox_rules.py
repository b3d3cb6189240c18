"""equinox's internal primitives (``lift/rules_equinox.py``) differentiated under a
``jax.vmap`` *around* the gradient: the lifted program is traced one example at a
time, so equinox chose its unbatched forms, and the rules run on batched values.

Found by running equinox's own test files with every ``jax.vjp`` also taken on the
tape (``tools/jax_suite``, ``PROBE_TRACED=1``): inside the backward of a vmapped
checkpointed while loop, rf gave a buffer write's value a gradient in the examples
whose predicate was False (no write happened), where equinox's transpose gives 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from equinox.internal._loop import common as eqx_loop

import rumus_fx as rf


def _write(false_steps: bool):
    def f(xs: jax.Array, x: jax.Array, p: jax.Array) -> jax.Array:
        # write x at position 1 where p > 0 (equinox's buffer write); position 1 is
        # never read before the write, as equinox's buffers require
        ys = eqx_loop._maybe_set(p > 0, xs, x, jnp.array(1), kwargs={}, makes_false_steps=false_steps)
        return jnp.sum(jnp.sin(ys) * jnp.arange(1.0, 4.0)) * x

    return f


def _inputs() -> tuple[jax.Array, jax.Array, jax.Array]:
    xs = jnp.asarray(np.linspace(0.2, 0.9, 9).reshape(3, 3))
    x = jnp.asarray([0.3, 0.7, -0.4])
    p = jnp.asarray([1.0, -1.0, 2.0])  # the second example writes nothing
    return xs, x, p


@pytest.mark.parametrize("false_steps", [False, True])
@pytest.mark.parametrize("argnums", [0, 1, (0, 1)])
def test_buffer_write_under_a_vmap_around_the_gradient(false_steps, argnums):
    f = _write(false_steps)
    with jax.enable_x64(True):
        args = _inputs()
        want = jax.vmap(jax.grad(f, argnums=argnums))(*args)
        got = jax.vmap(rf.grad(rf.lift(f), argnums=argnums))(*args)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12), got, want)
        got_jit = jax.jit(jax.vmap(rf.grad(rf.lift(f), argnums=argnums)))(*args)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12), got_jit, want)


@pytest.mark.parametrize("false_steps", [False, True])
def test_buffer_write_value_gradient_against_finite_differences(false_steps):
    """The written value's gradient (the buffer's own follows equinox's write-once
    convention, not finite differences): where nothing was written it is the
    gradient of ``* x`` alone."""
    f = _write(false_steps)
    with jax.enable_x64(True):
        xs, x, p = _inputs()
        got = np.asarray(jax.vmap(rf.grad(rf.lift(f), argnums=1))(xs, x, p))
        eps = 1e-6
        fd = []
        for k in range(x.shape[0]):
            e = np.zeros(x.shape)
            e[k] = eps
            up = jax.vmap(f)(xs, x + e, p)[k]
            down = jax.vmap(f)(xs, x - e, p)[k]
            fd.append((up - down) / (2 * eps))
        np.testing.assert_allclose(got, np.asarray(fd), rtol=1e-7, atol=1e-8)
