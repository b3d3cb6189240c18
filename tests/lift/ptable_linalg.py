"""Primitive-table entries for linear algebra and special functions (cholesky,
triangular_solve, lu, qr, eigh, svd, custom_linear_solve, igamma, zeta, ...).

Matrices are small and well conditioned (a normal matrix plus ``n I``; ``A A^T +
n I`` where a symmetric positive definite one is needed); eigen- and singular
values are distinct. Eigen- and singular vectors are returned with a fixed sign
(the sign of their first component), so the outputs are smooth functions of the
input and finite differences apply.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.scipy as jsp
import numpy as np
from jax import lax

from rumus_fx.lift.rules import RULES

from .ptable_base import PInfo, PSample, normal, positive

# -- samples ------------------------------------------------------------------------


def wellcond(rng, *shape):
    """A normal matrix plus ``n I``: far from singular."""
    n = shape[-1]
    return rng.standard_normal(shape) + n * np.eye(*shape[-2:])


def spd(rng, *shape):
    a = rng.standard_normal(shape)
    return a @ np.swapaxes(a, -1, -2) + shape[-1] * np.eye(shape[-1])


def mats(gen, *shapes, diff=(0,)):
    return lambda rng: [PSample((gen(rng, *s),), diff) for s in shapes]


def systems(gen, *pairs):
    """(matrix, right-hand side) samples, both differentiable."""
    return lambda rng: [PSample((gen(rng, *a), normal(rng, *b)), (0, 1)) for a, b in pairs]


def _cat(*xs):
    """Several outputs as one flat array (the table's functions return one array)."""
    return jnp.concatenate([jnp.ravel(x) for x in xs])


def _gauge(v, ref=None):
    """Columns of ``v`` with the sign that makes ``ref``'s first row positive."""
    ref = v if ref is None else ref
    return v * jnp.sign(ref[..., :1, :])


def _eigh(a):
    w, v = jnp.linalg.eigh(a)
    return _cat(w, _gauge(v))


def _svd(a, full_matrices=False):
    u, s, vt = jnp.linalg.svd(a, full_matrices=full_matrices)
    sign = jnp.sign(u[..., :1, :])
    return _cat(u * sign, s, vt * jnp.swapaxes(sign, -1, -2))


def _lu_logdet(a):
    """log |det a| from the packed LU factors (the diagonal of U)."""
    lu = jsp.linalg.lu_factor(a)[0]
    n = a.shape[-1]
    d = jnp.sum(lu * jnp.eye(n).reshape((1,) * (a.ndim - 2) + (n, n)), axis=-1)
    return jnp.sum(jnp.log(jnp.abs(d)), axis=-1)


def _cg_solve(a, b):
    """``A x = b`` through lax.custom_linear_solve, the (symmetric) matrix closed
    over by matvec and solve (symmetric: transpose_solve is solve)."""
    a = (a + a.T) / 2
    factor = jsp.linalg.cho_factor(a)
    return lax.custom_linear_solve(
        lambda x: a @ x, b, solve=lambda _, r: jsp.linalg.cho_solve(factor, r), symmetric=True
    )


def _pair_solve(a, b):
    """custom_linear_solve on a pytree right-hand side (two leaves) with an
    explicit transpose_solve: the block system [[a, I/2], [a^T/4, 2 I]]."""
    n = a.shape[-1]
    eye = jnp.eye(n)
    full = jnp.block([[a, 0.5 * eye], [0.25 * a.T, 2.0 * eye]])

    def matvec(x):
        return (a @ x[0] + 0.5 * x[1], 0.25 * a.T @ x[0] + 2.0 * x[1])

    def solver(m):
        def solve(_, r):
            z = jnp.linalg.solve(m, jnp.concatenate(r))
            return (z[:n], z[n:])

        return solve

    # both leaves of the right-hand side depend on b: jax.grad cannot take a
    # gradient with respect to a part of a pytree right-hand side
    x = lax.custom_linear_solve(matvec, (b, jnp.sin(b)), solve=solver(full), transpose_solve=solver(full.T))
    return _cat(x[0], x[1])


ENTRIES: list[PInfo] = [
    # -- triangular_solve ---------------------------------------------------------------
    PInfo(
        "triangular_solve_lower",
        lambda a, b: jsp.linalg.solve_triangular(a, b, lower=True),
        systems(wellcond, ((4, 4), (4, 3)), ((4, 4), (4,)), ((2, 3, 3), (2, 3, 2))),
        ("triangular_solve",),
        vmap=True,
    ),
    PInfo(
        "triangular_solve_upper_trans",
        lambda a, b: jsp.linalg.solve_triangular(a, b, lower=False, trans=1),
        systems(wellcond, ((4, 4), (4, 2))),
        ("triangular_solve",),
    ),
    PInfo(
        "triangular_solve_unit",
        lambda a, b: jsp.linalg.solve_triangular(a, b, lower=True, unit_diagonal=True),
        systems(wellcond, ((4, 4), (4, 2))),
        ("triangular_solve",),
    ),
    PInfo(
        "triangular_solve_right",
        lambda a, b: lax.linalg.triangular_solve(a, b, left_side=False, lower=True, transpose_a=True),
        systems(wellcond, ((4, 4), (3, 4))),
        ("triangular_solve",),
    ),
    # -- cholesky ---------------------------------------------------------------------------
    PInfo("cholesky", jnp.linalg.cholesky, mats(spd, (4, 4), (2, 3, 3)), ("cholesky",), vmap=True),
    PInfo(
        "cho_solve",
        # cho_factor reads one triangle: a symmetric input keeps finite differences meaningful
        lambda a, b: jsp.linalg.cho_solve(jsp.linalg.cho_factor((a + a.T) / 2, lower=True), b),
        systems(spd, ((4, 4), (4, 2))),
        ("cholesky", "triangular_solve"),
    ),
    # -- lu, det ------------------------------------------------------------------------------
    PInfo("lu_factor", lambda a: jsp.linalg.lu_factor(a)[0], mats(wellcond, (4, 4), (2, 3, 3)), ("lu",), vmap=True),
    PInfo(
        "lu_nonsquare",
        lambda a: lax.linalg.lu(a)[0],
        mats(normal, (5, 3), (3, 5)),
        ("lu",),
    ),
    PInfo("scipy_lu", lambda a: _cat(*jsp.linalg.lu(a)[1:]), mats(wellcond, (4, 4), (4, 3)), ("lu",)),
    PInfo("lu_logdet", _lu_logdet, mats(wellcond, (4, 4), (2, 3, 3)), ("lu",)),
    PInfo("det_small", jnp.linalg.det, mats(wellcond, (2, 2), (3, 3), (2, 3, 3)), ("mul",)),
    # -- solve, inv (custom_linear_solve) ---------------------------------------------------------
    PInfo(
        "solve",
        jnp.linalg.solve,
        systems(wellcond, ((4, 4), (4,)), ((3, 3), (3, 2)), ((2, 3, 3), (2, 3, 2))),
        ("custom_linear_solve",),
        vmap=True,
    ),
    PInfo("inv", jnp.linalg.inv, mats(wellcond, (4, 4), (2, 3, 3)), ("custom_linear_solve",)),
    PInfo("custom_linear_solve_symmetric", _cg_solve, systems(spd, ((4, 4), (4,))), ("custom_linear_solve",)),
    PInfo(
        "custom_linear_solve_pytree",
        _pair_solve,
        systems(wellcond, ((3, 3), (3,))),
        ("custom_linear_solve",),
    ),
    PInfo(
        "tridiagonal_solve",
        lambda dl, d, du, b: lax.linalg.tridiagonal_solve(dl, d, du, b),
        lambda rng: [
            PSample((normal(rng, 4), 4 + normal(rng, 4), normal(rng, 4), normal(rng, 4, 2)), (0, 1, 2, 3)),
            PSample((normal(rng, 2, 3), 4 + normal(rng, 2, 3), normal(rng, 2, 3), normal(rng, 2, 3, 1)), (0, 1, 2, 3)),
        ],
        ("tridiagonal_solve",),
    ),
    # -- eigh --------------------------------------------------------------------------------------
    PInfo("eigh", _eigh, mats(spd, (4, 4), (2, 3, 3)), ("eigh",), vmap=True),
    PInfo("eigvalsh", jnp.linalg.eigvalsh, mats(spd, (4, 4)), ("eigh",)),
    # -- qr -------------------------------------------------------------------------------------------
    PInfo("qr", lambda a: _cat(*jnp.linalg.qr(a)), mats(normal, (4, 4), (5, 3), (3, 5), (2, 4, 3)), ("qr",), vmap=True),
    PInfo(
        "qr_complete",
        lambda a: _cat(*jnp.linalg.qr(a, mode="complete")),
        mats(normal, (3, 3), (5, 3), (2, 4, 2)),
        ("qr",),
    ),
    PInfo(
        "qr_pivoting",
        lambda a: _cat(*lax.linalg.qr(a, pivoting=True, full_matrices=False)[:2]),
        mats(normal, (5, 3), (4, 4)),
        ("qr",),
    ),
    # -- svd, norms -----------------------------------------------------------------------------------
    PInfo("svd", _svd, mats(normal, (4, 4), (5, 3), (3, 5), (2, 4, 3)), ("svd",), vmap=True),
    PInfo("svd_full_square", lambda a: _svd(a, full_matrices=True), mats(normal, (3, 3)), ("svd",)),
    PInfo("svdvals", lambda a: jnp.linalg.svd(a, compute_uv=False), mats(normal, (4, 3), (3, 5), (2, 3, 3)), ("svd",)),
    PInfo("norm_2", lambda a: jnp.linalg.norm(a, 2), mats(normal, (4, 3), (3, 3)), ("svd",)),
    PInfo("norm_nuc", lambda a: jnp.linalg.norm(a, "nuc"), mats(normal, (3, 4)), ("svd",)),
    PInfo("norm_fro", lambda a: jnp.linalg.norm(a, "fro") + jnp.linalg.norm(a[0]), mats(normal, (3, 4)), ("sqrt",)),
    PInfo("pinv", jnp.linalg.pinv, mats(normal, (4, 3), (3, 4)), ("svd",)),
    # -- special functions --------------------------------------------------------------------------------
    PInfo(
        "igamma",
        jsp.special.gammainc,
        lambda rng: [PSample((positive(rng, 3, 4) * 2, positive(rng, 3, 4) * 2), (0, 1))],
        ("igamma",),
    ),
    PInfo(
        "igammac",
        jsp.special.gammaincc,
        lambda rng: [PSample((positive(rng, 3, 4) * 2, positive(rng, 3, 4) * 2), (0, 1))],
        ("igammac",),
    ),
    PInfo(
        "polygamma",
        lambda x: jsp.special.polygamma(2, x) + lax.polygamma(1.0, x),
        mats(positive, (3, 4)),
        ("polygamma",),
    ),
    PInfo("bessel_i0e", jsp.special.i0e, mats(normal, (3, 4)), ("bessel_i0e",)),
    PInfo(
        "bessel_i1e",
        jsp.special.i1e,
        mats(lambda rng, *s: normal(rng, *s) * (np.arange(12).reshape(s) % 5 != 0), (3, 4)),  # some exact zeros
        ("bessel_i1e",),
    ),
    PInfo("bessel_i0_i1", lambda x: jsp.special.i0(x) * jsp.special.i1(x), mats(normal, (3, 4)), ("bessel_i0e",)),
    PInfo(
        "zeta",
        jsp.special.zeta,
        lambda rng: [PSample((1.5 + 2 * positive(rng, 3, 4), positive(rng, 3, 4)), (0, 1))],
        ("zeta",),
    ),
    PInfo(
        "betainc",
        jsp.special.betainc,
        lambda rng: [PSample((2 * positive(rng, 3, 4), 2 * positive(rng, 3, 4), rng.uniform(0.1, 0.9, (3, 4))), (2,))],
        ("regularized_incomplete_beta",),
    ),
    PInfo(
        "random_gamma",
        lambda a: jax.random.gamma(jax.random.key(0), a) + jax.random.loggamma(jax.random.key(1), a + 1),
        mats(positive, (3, 4)),
        ("random_gamma",),
        # the gradient is the implicit (inverse-CDF) one, not the derivative of the
        # rejection sampler's output: finite differences do not apply
        fd=False,
    ),
]

# jnp.linalg.det (n > 3) and slogdet read the diagonal of the LU factors with
# jnp.diagonal (a cond on the platform and a gather): these entries run where
# rf.lift has rules for those primitives.
_NEEDS_COND_GATHER: list[PInfo] = [
    PInfo("det", jnp.linalg.det, mats(wellcond, (4, 4), (2, 4, 4)), ("lu",)),
    PInfo("slogdet", lambda a: jnp.linalg.slogdet(a)[1], mats(wellcond, (4, 4), (2, 5, 5)), ("lu",)),
]
if {"cond", "gather"} <= set(RULES):
    ENTRIES += _NEEDS_COND_GATHER
