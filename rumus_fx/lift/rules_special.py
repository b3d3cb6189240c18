"""Primitive rules: special functions (igamma, igammac, polygamma,
bessel_i0e/i1e, zeta, regularized_incomplete_beta) and random_gamma's
implicit gradient.

Each backward formula is the transpose of the forward-mode derivative that
``jax.grad`` uses for the primitive, written out by hand (see Note [Primitive
rules] in ``rules.py``). Where JAX defines no gradient (``polygamma`` in its
order, ``betainc`` in ``a`` and ``b``) the rule raises ``AutogradError``.
"""

from __future__ import annotations

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import jax.scipy as jsp
import numpy as np
from jax import lax

from ..autograd.registry import BadProgram, Sample, TableEntry
from ..errors import AutogradError
from ..ops._declare import normal, positive, unary_samples
from .rules import defrule, saves_inputs
from .rules_elementwise import unbroadcast


def _igamma_dx(a, x):
    return jnp.exp(-x + (a - 1) * jnp.log(x) - lax.lgamma(a))


def _igamma_vjp(r, g, sign=1):
    a, x = r.ins
    aa, ax = r.in_avals
    ga = unbroadcast(sign * g * lax.igamma_grad_a(a, x), aa) if r.needs[0] else None
    gx = unbroadcast(sign * g * _igamma_dx(a, x), ax) if r.needs[1] else None
    return ga, gx


def _two_positive(rng):
    return [Sample((positive(rng, 3, 4) * 2, positive(rng, 3, 4) * 2), diff=(0, 1))]


defrule("igamma", _igamma_vjp, saves_inputs(0, 1), table=(TableEntry("igamma", jsp.special.gammainc, _two_positive),))
defrule(
    "igammac",
    lambda r, g: _igamma_vjp(r, g, -1),
    saves_inputs(0, 1),
    record_name="IgammacBackward",
    table=(TableEntry("igammac", jsp.special.gammaincc, _two_positive),),
)


def _polygamma_vjp(r, g):
    if r.needs[0]:
        raise AutogradError("rf.lift: the gradient of polygamma(m, x) with respect to the order m is not defined")
    m, x = r.ins
    return None, unbroadcast(g * lax.polygamma(m + 1, x), r.in_avals[1])


def _polygamma_errors():
    return [
        BadProgram(
            "order",
            lambda m, x: lax.polygamma(m, x),
            (np.array([1.0, 2.0]), np.array([0.5, 1.5])),
            AutogradError,
            ("rf.lift", "order m"),
            x64=True,
            jax_too=True,
        )
    ]


defrule(
    "polygamma",
    _polygamma_vjp,
    saves_inputs(0, 1),
    table=(
        TableEntry(
            "polygamma",
            lambda x: jsp.special.polygamma(2, x) + lax.polygamma(1.0, x),
            unary_samples([(3, 4)], positive),
        ),
    ),
    errors=_polygamma_errors,
)


def _betainc_vjp(r, g):
    if r.needs[0] or r.needs[1]:
        raise AutogradError(
            "rf.lift: the gradient of betainc(a, b, x) with respect to a and b is not supported (as in JAX)"
        )
    a, b, x = r.ins
    lbeta = lax.lgamma(a) + lax.lgamma(b) - lax.lgamma(a + b)
    dx = jnp.exp((b - 1) * jnp.log1p(-x) + (a - 1) * jnp.log(x) - lbeta)
    return None, None, unbroadcast(g * dx, r.in_avals[2])


def _betainc_errors():
    args = (np.array([1.5]), np.array([2.0]), np.array([0.3]))
    return [
        BadProgram(
            f"gradient in {v}",
            jsp.special.betainc,
            args,
            AutogradError,
            ("with respect to a and b",),
            argnums=k,
            names=("rf.lift", "betainc"),
            x64=True,
            jax_too=True,
        )
        for k, v in enumerate("ab")
    ]


def _betainc_samples(rng):
    return [Sample((2 * positive(rng, 3, 4), 2 * positive(rng, 3, 4), rng.uniform(0.1, 0.9, (3, 4))), diff=(2,))]


defrule(
    "regularized_incomplete_beta",
    _betainc_vjp,
    saves_inputs(0, 1, 2),
    table=(TableEntry("betainc", jsp.special.betainc, _betainc_samples),),
    errors=_betainc_errors,
)


def _i0e_vjp(r, g):
    x, y = r.ins[0], r.outs[0]
    return (g * (lax.bessel_i1e(x) - jnp.sign(x) * y),)


defrule(
    "bessel_i0e",
    _i0e_vjp,
    ((0,), (0,)),
    table=(
        TableEntry("bessel_i0e", jsp.special.i0e, unary_samples([(3, 4)])),
        TableEntry("bessel_i0_i1", lambda x: jsp.special.i0(x) * jsp.special.i1(x), unary_samples([(3, 4)])),
    ),
)


def _i1e_vjp(r, g):
    x, y = r.ins[0], r.outs[0]
    eps = jnp.finfo(x.dtype).eps
    big = jnp.abs(x) > eps
    safe = jnp.where(big, x, eps)
    dy = lax.bessel_i0e(safe) - y * (jnp.sign(safe) + 1 / safe)
    return (g * jnp.where(big, dy, 0.5),)


def _some_zeros(rng, *s):
    return normal(rng, *s) * (np.arange(12).reshape(s) % 5 != 0)  # some exact zeros


defrule(
    "bessel_i1e",
    _i1e_vjp,
    ((0,), (0,)),
    table=(TableEntry("bessel_i1e", jsp.special.i1e, unary_samples([(3, 4)], _some_zeros)),),
)


def _bernoulli_ratios(count):
    """``(2k)! / B_{2k}`` for k = 1..count (B: the Bernoulli numbers)."""
    A = [Fraction(0)] * (2 * count + 1)
    B = []
    for m in range(2 * count + 1):
        A[m] = Fraction(1, m + 1)
        for j in range(m, 0, -1):
            A[j - 1] = j * (A[j - 1] - A[j])
        B.append(A[0])
    return np.array([float(Fraction(math.factorial(2 * k)) / B[2 * k]) for k in range(1, count + 1)])


_BERNOULLI = _bernoulli_ratios(16)


def _zeta_partials(s, a):
    """Partial derivatives in ``s`` and ``a`` of the Euler-Maclaurin series for
    the Hurwitz zeta function that ``jax.scipy.special.zeta`` differentiates
    (Johansson 2015, formula (5); N = M = 8 terms in float32, 16 in float64)."""
    dtype = a.dtype
    N = M = 8 if dtype == jnp.float32 else 16
    s_, a_ = s[..., None], a[..., None]
    lead = (1,) * a.ndim
    k = jnp.arange(N, dtype=dtype).reshape(lead + (N,))
    ak = a_ + k
    terms = ak**-s_
    dS_ds = -jnp.sum(jnp.log(ak) * terms, -1)
    dS_da = jnp.sum(-s_ * ak ** (-s_ - 1), -1)
    aN = a + N
    u = aN ** (1 - s)
    dI_ds = -jnp.log(aN) * u / (s - 1) - u / (s - 1) ** 2
    dI_da = (1 - s) * aN ** (-s) / (s - 1)
    T0 = aN**-s
    dT0_ds = -jnp.log(aN) * T0
    dT0_da = -s * aN ** (-s - 1)
    mm = jnp.arange(2 * M, dtype=dtype).reshape(lead + (2 * M,))
    aN_ = aN[..., None]
    ratio = (s_ + mm) / aN_
    C = jnp.cumprod(ratio, -1)
    dC_ds = C * jnp.cumsum(1 / (s_ + mm), -1)  # d ratio/ds / ratio = 1 / (s + m)
    dC_da = C * jnp.cumsum(jnp.broadcast_to(-1 / aN_, ratio.shape), -1)
    P, dP_ds, dP_da = C[..., ::2], dC_ds[..., ::2], dC_da[..., ::2]
    keep = P <= jnp.finfo(dtype).max
    coefs = jnp.asarray(_BERNOULLI[:M], dtype).reshape(lead + (M,))
    T1 = jnp.sum(jnp.minimum(P, jnp.finfo(dtype).max) / coefs, -1)
    dT1_ds = jnp.sum(jnp.where(keep, dP_ds, 0) / coefs, -1)
    dT1_da = jnp.sum(jnp.where(keep, dP_da, 0) / coefs, -1)
    dT_ds = dT0_ds * (0.5 + T1) + T0 * dT1_ds
    dT_da = dT0_da * (0.5 + T1) + T0 * dT1_da
    return dS_ds + dI_ds + dT_ds, dS_da + dI_da + dT_da


def _zeta_vjp(r, g):
    x, q = r.ins
    ds, da = _zeta_partials(jnp.broadcast_to(x, g.shape), jnp.broadcast_to(q, g.shape))
    return (
        unbroadcast(g * ds, r.in_avals[0]) if r.needs[0] else None,
        unbroadcast(g * da, r.in_avals[1]) if r.needs[1] else None,
    )


defrule(
    "zeta",
    _zeta_vjp,
    saves_inputs(0, 1),
    table=(
        TableEntry(
            "zeta",
            jsp.special.zeta,
            lambda rng: [Sample((1.5 + 2 * positive(rng, 3, 4), positive(rng, 3, 4)), diff=(0, 1))],
        ),
    ),
)


def _random_gamma_vjp(r, g):
    """``d sample / d a`` by implicit differentiation of the gamma CDF
    (``lax.random_gamma_grad``), in log space when the samples are logs."""
    a, sample = r.ins[1], r.outs[0]
    if r.params["log_space"]:
        x = jnp.exp(sample)
        x = jnp.where(x == 0, jnp.finfo(x.dtype).tiny, x)
        dx = lax.random_gamma_grad(a, x) / x
    else:
        dx = lax.random_gamma_grad(a, sample)
    return None, g * dx


defrule(
    "random_gamma",
    _random_gamma_vjp,
    ((1,), (0,)),
    table=(
        TableEntry(
            "random_gamma",
            lambda a: jax.random.gamma(jax.random.key(0), a) + jax.random.loggamma(jax.random.key(1), a + 1),
            unary_samples([(3, 4)], positive),
            # the gradient is the implicit (inverse-CDF) one, not the derivative of the
            # rejection sampler's output: finite differences do not apply
            fd=False,
        ),
    ),
)
