"""The FFT family beyond the primitive table's entries: ``rnp.fft`` on Tensors,
the ``norm`` options, a batch of axes, under ``jax.jit``; against ``jax.grad``."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

import rumus_fx as rf
import rumus_fx.numpy as rnp


def _loss(x, w):
    a = jnp.fft.rfft(x * w, axis=0, norm="ortho")
    b = jnp.fft.irfftn(a, s=(x.shape[0], x.shape[1]), norm="forward")
    c = jnp.fft.ifft2(jnp.fft.fft(lax_complex(x, w)), norm="backward")
    return jnp.sum(b * x) + jnp.sum(jnp.abs(c) ** 2) + jnp.sum(jnp.real(jnp.fft.hfft(a[:, 0])))


def lax_complex(x, y):
    return jax.lax.complex(x, y)


def test_fft_family_matches_jax_grad():
    rng = np.random.default_rng(8)
    with jax.enable_x64(True):
        x, w = jnp.asarray(rng.standard_normal((6, 5))), jnp.asarray(rng.standard_normal((6, 5)))
        for nums in ((0,), (1,), (0, 1)):
            got = jax.jit(rf.grad(rf.lift(_loss), argnums=nums))(x, w)
            want = jax.grad(_loss, argnums=nums)(x, w)
            chex.assert_trees_all_close(got, want, rtol=1e-10, atol=1e-10)


def test_rnp_fft_on_tensors():
    x = jnp.linspace(-1.0, 2.0, 8)
    got = rf.grad(lambda x: rf.sum(rnp.abs(rnp.fft.rfft(x))))(x)
    want = jax.grad(lambda x: jnp.sum(jnp.abs(jnp.fft.rfft(x))))(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
