"""Primitive rules: the ``fft`` primitive (``jnp.fft``'s ``fft``/``ifft``/
``rfft``/``irfft`` and their n-dimensional forms, ``fft_lengths`` the sizes of
the transformed trailing axes).

Note [FFT rules]
~~~~~~~~~~~~~~~~
Each transform is linear, so its rule is its transpose (Note [Complex
gradients] in ``rules_complex.py``: transposes, not conjugate transposes):

* ``FFT``/``IFFT``: the DFT matrix is symmetric, so the transpose of ``fft`` is
  ``fft`` of the cotangent and that of ``ifft`` is ``ifft``.
* ``RFFT``: ``rfft(x) = fft(x + 0i)[..., :n//2+1]``; its transpose pads the
  cotangent with zeros back to ``n`` on the last axis, applies ``fft`` over the
  ``fft_lengths`` axes, and keeps the real part.
* ``IRFFT``: the cotangent ``t`` (real, last axis ``n``) gives ``rfft(t)``
  weighted by the Hermitian multiplicities, 1 for the zero frequency (and the
  Nyquist one when ``n`` is even) and 2 for the others, scaled by
  ``1 / prod(fft_lengths)``, and conjugated.

These are the formulas ``jax.grad`` uses, so every case equals it exactly
(``tests/lift/test_fft.py``).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..autograd.registry import Sample, TableEntry
from ..ops._declare import normal
from .rules import COMPLEX_OK, defrule

FFT, IFFT, RFFT, IRFFT = lax.FftType.FFT, lax.FftType.IFFT, lax.FftType.RFFT, lax.FftType.IRFFT


def _rfft_transpose(t, lengths, dtype):
    n = lengths[-1]
    pad = [(0, 0, 0)] * (t.ndim - 1) + [(0, n - t.shape[-1], 0)]
    full = lax.pad(t, jnp.zeros((), t.dtype), pad)
    return jnp.real(lax.fft(full, FFT, lengths)).astype(dtype)


def _irfft_transpose(t, lengths, dtype):
    x = lax.fft(t, RFFT, lengths)
    m = x.shape[-1]
    odd = lengths[-1] % 2
    weight = np.concatenate([np.ones(1), np.full(m - 2 + odd, 2.0), np.ones(1 - odd)]) / math.prod(lengths)
    weight = jnp.asarray(weight.reshape((1,) * (x.ndim - 1) + (m,)), x.dtype)
    return jnp.conj(x * weight).astype(dtype)


def _fft_vjp(r, g):
    kind = lax.FftType(int(r.params["fft_type"]))
    lengths = tuple(r.params["fft_lengths"])
    dtype = r.in_avals[0].dtype
    if kind == RFFT:
        return (_rfft_transpose(g, lengths, dtype),)
    if kind == IRFFT:
        return (_irfft_transpose(g.astype(jnp.real(jnp.zeros((), dtype)).dtype), lengths, dtype),)
    return (lax.fft(g.astype(dtype), kind, lengths),)


def _on_complex(f):
    return lambda x, y: f(lax.complex(x, y))


def _two(*shape):
    return lambda r: [Sample((normal(r, *shape), normal(r, *shape)), diff=(0, 1))]


def _one(*shapes):
    return lambda r: [Sample((normal(r, *s),)) for s in shapes]


def _ramp(y):
    return y * jnp.arange(y.shape[-1]).astype(y.dtype).reshape((1,) * (y.ndim - 1) + (-1,))


def _real_loss(z):
    """A real function of a complex result that weighs its two parts differently."""
    return jnp.real(z) * 1.5 - jnp.imag(z) ** 2


def _cat(*ys):
    return jnp.concatenate([y.reshape(-1) for y in ys])


defrule(
    "fft",
    _fft_vjp,
    table=(
        TableEntry(
            "fft_ifft",
            _on_complex(lambda z: _real_loss(_cat(jnp.fft.fft(z), jnp.fft.ifft(z * z, axis=0)))),
            _two(3, 5),
        ),
        TableEntry(
            "fft2_ifftn",
            _on_complex(lambda z: _real_loss(_cat(jnp.fft.fft2(z), jnp.fft.ifftn(jnp.sin(z))))),
            _two(2, 3, 4),
        ),
        TableEntry(
            "rfft",  # odd and even lengths, zero-padded, two-dimensional
            lambda x: _real_loss(_cat(jnp.fft.rfft(x), jnp.fft.rfft(x[:, 1:], n=8), jnp.fft.rfft2(x * x))),
            _one((3, 6)),
        ),
        TableEntry(
            "irfft",  # even and odd output lengths
            _on_complex(lambda z: _cat(jnp.fft.irfft(z) ** 2, _ramp(jnp.fft.irfft(z, n=7)))),
            _two(3, 4),
        ),
        TableEntry(
            "irfft2_irfftn",
            _on_complex(lambda z: _cat(jnp.sin(jnp.fft.irfft2(z)), jnp.fft.irfftn(z, s=(3, 5)) ** 2)),
            _two(2, 3, 3),
        ),
        TableEntry(
            "rfft_irfft",  # a spectral filter: rfft, a complex weight, irfft
            lambda x, w: jnp.fft.irfft(jnp.fft.rfft(x) * lax.complex(w, w * 0.5)[None], n=x.shape[-1]),
            lambda r: [Sample((normal(r, 3, 8), normal(r, 5)), diff=(0, 1))],
        ),
    ),
)
COMPLEX_OK.add("fft")
