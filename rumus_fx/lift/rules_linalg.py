"""Primitive rules: linear algebra (triangular_solve, cholesky, lu, qr, eigh, svd,
custom_linear_solve, tridiagonal_solve, eig). The special functions are in
``rules_special.py``.

Each backward formula is the transpose of the forward-mode derivative that
``jax.grad`` uses for the primitive, written out by hand (see Note [Primitive
rules] in ``rules.py``). Where JAX defines no gradient (a partial ``eigh``, a
full-matrices ``svd`` of a non-square matrix, ``custom_linear_solve`` without
``transpose_solve``) the rule raises ``AutogradError``; so it does for the one
case rf does not follow JAX (a pivoted QR of a wide matrix, whose JAX rule
reads the unpivoted trailing columns).

Matrix products in the formulas run at ``Precision.HIGHEST`` (as JAX's own
rules do), so float32 gradients are not computed in reduced precision on
accelerators.
"""

from __future__ import annotations

import jax.numpy as jnp
import jax.scipy as jsp
import numpy as np
from jax import lax

from ..autograd.registry import BadProgram, Sample, TableEntry
from ..errors import AutogradError
from ..ops._declare import Placeholder, normal, spd, unary_samples, wellcond
from .program import Program
from .rules import defrule, saves_outputs
from .rules_elementwise import as_dtype

_HI = lax.Precision.HIGHEST
_trsolve = lax.linalg.triangular_solve

# Note [No cotangent, no term]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# eigh's, eig's and svd's rules take a missing cotangent as None (``takes_none``), not as
# zeros: an output the program does not use (the eigenvectors of ``eigvalsh``, U and V
# of ``svd(a)[1]``) adds no term. Its term holds ``F``, the reciprocal gaps of the
# eigen- or singular values, which is infinite where two are equal, and ``F * 0`` is
# nan: the used values' gradient, finite there, would come out nan. JAX's transpose
# skips a symbolic zero's term, and so does rf. Where the program does use the
# vectors at a repeated value, both give nan (the vectors are not differentiable
# there). Tested in tests/lift/test_ties.py (repeated spectra).

# -- the primitive table's samples and programs --------------------------------------
# Matrices are small and well conditioned (``wellcond``; ``spd`` where a symmetric
# positive definite one is needed); eigen- and singular values are distinct.
# Eigen- and singular vectors are returned with a fixed sign (the sign of their
# first component), so the outputs are smooth functions of the input and finite
# differences apply.


def _systems(gen, *pairs):
    """(matrix, right-hand side) samples, both differentiable."""
    return lambda rng: [Sample((gen(rng, *a), normal(rng, *b)), diff=(0, 1)) for a, b in pairs]


def _cat(*xs):
    """Several outputs as one flat array (the table's functions return one array)."""
    return jnp.concatenate([jnp.ravel(x) for x in xs])


def _gauge(v, ref=None):
    """Columns of ``v`` with the sign that makes ``ref``'s first row positive."""
    ref = v if ref is None else ref
    return v * jnp.sign(ref[..., :1, :])


def _mat(*shape):
    """A well-conditioned float64 matrix for an error case (built when it runs)."""
    return Placeholder(lambda: np.random.default_rng(0).standard_normal(shape) + shape[-1] * np.eye(*shape[-2:]))


def _mm(a, b):
    return jnp.matmul(a, b, precision=_HI)


def _T(x):
    return jnp.swapaxes(x, -1, -2)


def _eye(n, dtype, ndim=2):
    """The identity with leading unit axes up to rank ``ndim`` (no implicit rank
    promotion: the formulas hold under ``jax_numpy_rank_promotion='raise'``)."""
    return jnp.eye(n, dtype=dtype).reshape((1,) * (ndim - 2) + (n, n))


def _diag(v):
    """Batched diagonal matrix from the last axis of ``v``."""
    return v[..., :, None] * _eye(v.shape[-1], v.dtype, v.ndim + 1)


def _reciprocal_gaps(w):
    """``F[i, j] = 1 / (w[j] - w[i])`` off the diagonal, 0 on it (batched over
    ``w``'s leading axes): the eigenvector factor of eigh's and eig's rules."""
    eye = _eye(w.shape[-1], w.dtype, w.ndim + 1)
    return jnp.where(_too_close(w), jnp.nan, 1 / (eye + w[..., None, :] - w[..., :, None]) - eye)


def _too_close(w):
    """The pairs ``i != j`` with ``|w[j] - w[i]| <= sqrt(eps) max|w|`` (batched over
    ``w``'s leading axes): Note [Close eigenvalues]."""
    gap = jnp.abs(w[..., None, :] - w[..., :, None])
    scale = jnp.max(jnp.abs(w), axis=-1, keepdims=True)[..., None]
    return (gap <= jnp.sqrt(jnp.finfo(w.dtype).eps) * scale) & (_eye(w.shape[-1], w.dtype, w.ndim + 1) == 0)


def _i_imag(x):
    """``i Im(x)``: the map ``X -> i Im X`` and its own transpose (Note [Complex
    gradients])."""
    return lax.complex(jnp.zeros_like(x.real), x.imag)


def _unpermute(x, perm, axis):
    """``y`` with ``y[..., perm, :] == x`` (``axis=-2``) or ``y[..., perm] == x``
    (``axis=-1``): the transpose of indexing by the permutation ``perm``."""
    inv = jnp.argsort(perm, axis=-1)
    idx = inv[..., :, None] if axis == -2 else inv[..., None, :]
    return jnp.take_along_axis(x, idx, axis=axis)


# -- triangular_solve -------------------------------------------------------------


def _triangular_solve_vjp(r, g):
    """``x = op(a)^{-1} b`` (left side) or ``b op(a)^{-1}``, ``op(a)`` being ``a``,
    transposed with ``transpose_a`` and conjugated with ``conjugate_a``: ``gb``
    solves with ``op(a)^T``; ``ga = -gb x^T`` (or ``-x^T gb``) is the gradient with
    respect to ``op(a)``, taken back through the conjugation (``conj``: jax's
    convention is the transpose, not the adjoint, of the derivative, and the
    transpose of ``conj`` is ``conj``) and the transposition, onto ``a``'s
    triangle only."""
    p = r.params
    a = r.ins[0]
    kw = dict(
        left_side=p["left_side"],
        lower=p["lower"],
        conjugate_a=p["conjugate_a"],
        unit_diagonal=p["unit_diagonal"],
    )
    gb = _trsolve(a, g, transpose_a=not p["transpose_a"], **kw)
    ga = None
    if r.needs[0]:
        x = r.outs[0]
        gop = -_mm(gb, _T(x)) if p["left_side"] else -_mm(_T(x), gb)
        gop = jnp.conj(gop) if p["conjugate_a"] else gop
        ga = _T(gop) if p["transpose_a"] else gop
        k = 1 if p["unit_diagonal"] else 0
        ga = jnp.tril(ga, -k) if p["lower"] else jnp.triu(ga, k)
    return ga, (gb if r.needs[1] else None)


defrule(
    "triangular_solve",
    _triangular_solve_vjp,
    lambda needs: ((0,), (0,) if needs[0] else ()),
    table=(
        TableEntry(
            "triangular_solve_lower",
            lambda a, b: jsp.linalg.solve_triangular(a, b, lower=True),
            _systems(wellcond, ((4, 4), (4, 3)), ((4, 4), (4,)), ((2, 3, 3), (2, 3, 2))),
            vmap=True,
        ),
        TableEntry(
            "triangular_solve_upper_trans",
            lambda a, b: jsp.linalg.solve_triangular(a, b, lower=False, trans=1),
            _systems(wellcond, ((4, 4), (4, 2))),
        ),
        TableEntry(
            "triangular_solve_unit",
            lambda a, b: jsp.linalg.solve_triangular(a, b, lower=True, unit_diagonal=True),
            _systems(wellcond, ((4, 4), (4, 2))),
        ),
        TableEntry(
            "triangular_solve_right",
            lambda a, b: lax.linalg.triangular_solve(a, b, left_side=False, lower=True, transpose_a=True),
            _systems(wellcond, ((4, 4), (3, 4))),
        ),
    ),
)


# -- cholesky -----------------------------------------------------------------------


def _cholesky_vjp(r, g):
    """JAX's forward rule is ``dL = L phi(L^{-1} dA L^{-H})`` (``phi``: lower
    triangle, halved diagonal), linear in ``dA``; its transpose is ``L^{-T}
    phi(L^T g) conj(L)^{-1}`` (``L^{-T} phi(L^T g) L^{-1}`` for a real matrix; not
    symmetrized, as JAX's; ``jnp.linalg.cholesky`` symmetrizes its input)."""
    L = jnp.tril(r.outs[0])
    n = L.shape[-1]
    half = 1 - 0.5 * _eye(n, L.dtype, L.ndim)
    P = jnp.tril(_mm(_T(L), g)) * half
    S = _trsolve(L, P, left_side=True, lower=True, transpose_a=True)
    return (_trsolve(L, S, left_side=False, lower=True, transpose_a=False, conjugate_a=True),)


defrule(
    "cholesky",
    _cholesky_vjp,
    saves_outputs(0),
    table=(
        TableEntry("cholesky", jnp.linalg.cholesky, unary_samples([(4, 4), (2, 3, 3)], spd), vmap=True),
        TableEntry(
            "cho_solve",
            # cho_factor reads one triangle: a symmetric input keeps finite differences meaningful
            lambda a, b: jsp.linalg.cho_solve(jsp.linalg.cho_factor((a + a.T) / 2, lower=True), b),
            _systems(spd, ((4, 4), (4, 2))),
            prims=("cholesky", "triangular_solve"),
        ),
    ),
)


# -- lu -------------------------------------------------------------------------------


def _lu_factors(lu):
    """Unit lower ``L`` (m x m) and upper ``U`` (n x n) of a packed ``lu``
    (padded with the identity when the matrix is not square, as JAX's rule)."""
    *batch, m, n = lu.shape
    k = min(m, n)
    nb = len(batch)
    L = jnp.pad(jnp.tril(lu[..., :, :k], -1), [(0, 0)] * (nb + 1) + [(0, m - k)]) + _eye(m, lu.dtype, lu.ndim)
    U = jnp.pad(jnp.triu(lu[..., :k, :]), [(0, 0)] * nb + [(0, n - k), (0, 0)])
    U = U + jnp.pad(_eye(n - k, lu.dtype, lu.ndim), [(0, 0)] * nb + [(k, 0), (k, 0)])
    return L, U


def _lu_vjp(r, g):
    """Forward: ``X = L^{-1} P^T dA U^{-1}``, ``d(lu) = L tril(X, -1) + triu(X) U``;
    transpose: ``M = tril(L^T g, -1) + triu(g U^T)``, ``gA = P L^{-T} M U^{-T}``."""
    lu, perm = r.outs[0], r.outs[2]
    G = g[0]
    L, U = _lu_factors(lu)
    M = jnp.tril(_mm(_T(L), G), -1) + jnp.triu(_mm(G, _T(U)))
    Z = _trsolve(L, M, left_side=True, lower=True, transpose_a=True, unit_diagonal=True)
    Z = _trsolve(U, Z, left_side=False, lower=False, transpose_a=True)
    return (_unpermute(Z, perm, -2),)


def _lu_logdet(a):
    """log |det a| from the packed LU factors (the diagonal of U)."""
    lu = jsp.linalg.lu_factor(a)[0]
    n = a.shape[-1]
    d = jnp.sum(lu * jnp.eye(n).reshape((1,) * (a.ndim - 2) + (n, n)), axis=-1)
    return jnp.sum(jnp.log(jnp.abs(d)), axis=-1)


defrule(
    "lu",
    _lu_vjp,
    saves_outputs(0, 2),
    multiple_results=True,
    table=(
        TableEntry(
            "lu_factor", lambda a: jsp.linalg.lu_factor(a)[0], unary_samples([(4, 4), (2, 3, 3)], wellcond), vmap=True
        ),
        TableEntry("lu_nonsquare", lambda a: lax.linalg.lu(a)[0], unary_samples([(5, 3), (3, 5)])),
        TableEntry("scipy_lu", lambda a: _cat(*jsp.linalg.lu(a)[1:]), unary_samples([(4, 4), (4, 3)], wellcond)),
        TableEntry("lu_logdet", _lu_logdet, unary_samples([(4, 4), (2, 3, 3)], wellcond)),
        # jnp.linalg.det (n > 3) and slogdet read the diagonal of the LU factors
        # with jnp.diagonal (a cond on the platform and a gather)
        TableEntry("det", jnp.linalg.det, unary_samples([(4, 4), (2, 4, 4)], wellcond)),
        TableEntry("slogdet", lambda a: jnp.linalg.slogdet(a)[1], unary_samples([(4, 4), (2, 5, 5)], wellcond)),
    ),
)


# -- qr -------------------------------------------------------------------------------


def _thin_qr_vjp(q, r, gq, gr):
    """Transpose of JAX's thin-QR forward rule (m >= n): with ``C = Q^H dX R^{-1}``,
    ``dQ = Q(dO - C) + dX R^{-1}``, ``dR = (C - dO) R``, ``dO = tril(C,-1) -
    tril(C,-1)^H + i Im(diag C)`` (the last term zero for a real matrix). With ``M =
    Q^T gQ - gR R^T``, the cotangent of ``C`` is ``tril(M - conj(M)^T, -1) - M + i
    Im(diag M)`` (``conj`` transposes to ``conj``; ``X -> i Im X`` to itself: Note
    [Complex gradients]), that of ``dX R^{-1}`` is ``gQ + conj(Q) gC``."""
    M = _mm(_T(q), gq) - _mm(gr, _T(r))
    N = jnp.tril(M - jnp.conj(_T(M)), -1) - M
    if jnp.iscomplexobj(M):
        N = N + _eye(M.shape[-1], M.dtype, M.ndim) * _i_imag(M)
    H = gq + _mm(jnp.conj(q), N)
    return _trsolve(r, H, left_side=False, lower=False, transpose_a=True)


def _full_qr_vjp(q, r, gq, gr, n):
    """Full QR of a tall matrix: JAX's rule extends the thin one with
    ``dQ_mp = dQ_mn Z^T - (Q_mn + Q_mp Z)(dQ_pn - Z dQ_nn)^T``, ``Z = Q_pn (Q_nn - I)^{-1}``
    (arXiv:2409.13374); its transpose feeds the thin rule's ``gQ``."""
    q_mn, q_mp = q[..., :, :n], q[..., :, n:]
    q_nn, q_pn = q_mn[..., :n, :], q_mn[..., n:, :]
    z = _T(jnp.linalg.solve(_T(q_nn - _eye(n, q.dtype, q.ndim)), _T(q_pn)))
    g_mn, g_mp = gq[..., :, :n], gq[..., :, n:]
    w = q_mn + _mm(q_mp, z)
    h = _mm(_T(g_mp), w)  # (m - n) x n: the cotangent of dQ_pn - Z dQ_nn
    g_eff = g_mn + _mm(g_mp, z)
    g_eff = g_eff + jnp.concatenate([_mm(_T(z), h), -h], axis=-2)
    return _thin_qr_vjp(q_mn, r[..., :n, :], g_eff, gr[..., :n, :])


def _qr_forward(step, vals):
    outs = tuple(step.bind(vals))
    m, n = step.in_avals[0].shape[-2:]
    extra = (vals[0],) if m < n else ()
    if step.params["pivoting"]:
        extra = extra + (outs[2],)
    return outs, extra


def _qr_vjp(r, g):
    q, rr = r.outs[0], r.outs[1]
    gq, gr = g[0], g[1]
    m, n = r.in_avals[0].shape[-2:]
    pivoting = r.params["pivoting"]
    if m > n and r.params["full_matrices"]:
        if jnp.iscomplexobj(q):
            raise AutogradError(
                "rf.lift: the gradient of a complete QR (full_matrices=True) of a tall complex matrix is not "
                "supported; use mode='reduced' (full_matrices=False) or a real matrix"
            )
        gx = _full_qr_vjp(q, rr, gq, gr, n)
    elif m < n:
        if pivoting:
            raise AutogradError("rf.lift: the gradient of qr(pivoting=True) of a wide matrix (m < n) is not supported")
        x = r.extra[0]
        gr1, gr2 = gr[..., :, :m], gr[..., :, m:]
        # dR2 = dQ^H X2 + Q^H dX2
        gq1 = gq + jnp.conj(_mm(x[..., :, m:], _T(gr2)))
        gx1 = _thin_qr_vjp(q, rr[..., :, :m], gq1, gr1)
        gx = jnp.concatenate([gx1, _mm(jnp.conj(q), gr2)], axis=-1)
    else:
        gx = _thin_qr_vjp(q, rr, gq, gr)
    if pivoting:
        gx = _unpermute(gx, r.extra[-1], -1)
    return (gx,)


def _qr_errors():
    return [
        BadProgram(
            "pivoting wide",  # JAX's rule reads the unpivoted trailing columns here
            lambda a: lax.linalg.qr(a, pivoting=True, full_matrices=False)[1],
            (_mat(3, 4),),
            AutogradError,
            ("rf.lift", "pivoting=True"),
        )
    ]


defrule(
    "qr",
    _qr_vjp,
    saves_outputs(0, 1),
    forward=_qr_forward,
    multiple_results=True,
    table=(
        TableEntry(
            "qr", lambda a: _cat(*jnp.linalg.qr(a)), unary_samples([(4, 4), (5, 3), (3, 5), (2, 4, 3)]), vmap=True
        ),
        TableEntry(
            "qr_complete",
            lambda a: _cat(*jnp.linalg.qr(a, mode="complete")),
            unary_samples([(3, 3), (5, 3), (2, 4, 2)]),
        ),
        TableEntry(
            "qr_pivoting",
            lambda a: _cat(*lax.linalg.qr(a, pivoting=True, full_matrices=False)[:2]),
            unary_samples([(5, 3), (4, 4)]),
        ),
    ),
    errors=_qr_errors,
)


# -- eigh -----------------------------------------------------------------------------


def _eigh_vjp(r, g):
    """Distinct eigenvalues: ``gA = conj(V) (F * (V^T gV) + diag(gw)) V^T`` with
    ``F[i, j] = 1 / (w[j] - w[i])`` off the diagonal, 0 on it (not symmetrized,
    as JAX's rule; ``jnp.linalg.eigh`` symmetrizes its input). For a complex
    Hermitian ``A`` this is the transpose of JAX's linear map ``dA -> (V (F *
    (V^H dA V)), re diag(V^H dA V))`` (Note [Complex gradients]); ``conj(V) = V``
    for a real one."""
    n = r.in_avals[0].shape[-1]
    sub = r.params["subset_by_index"]
    if not (sub is None or tuple(sub) == (0, n)):
        raise AutogradError(
            "rf.lift: the gradient of a partial eigendecomposition (eigh with subset_by_index) is not defined"
        )
    v, w = r.outs
    gv, gw = g
    # an output without a cotangent (None: the eigenvectors of ``eigvalsh``) takes no
    # term, as a symbolic zero takes none in JAX's transpose: at a repeated eigenvalue
    # ``F`` is infinite, and ``F * 0`` would make the eigenvalues' gradient nan
    K = _diag(gw.astype(v.dtype)) if gw is not None else jnp.zeros(v.shape, v.dtype)
    if gv is not None:
        K = K + _reciprocal_gaps(w.astype(v.dtype)) * _mm(_T(v), gv)
    return (_mm(_mm(jnp.conj(v), K), _T(v)),)


_eigh_vjp.takes_none = True  # Note [No cotangent, no term]


def _eigh(a):
    w, v = jnp.linalg.eigh(a)
    return _cat(w, _gauge(v))


defrule(
    "eigh",
    _eigh_vjp,
    saves_outputs(0, 1),
    multiple_results=True,
    table=(
        TableEntry("eigh", _eigh, unary_samples([(4, 4), (2, 3, 3)], spd), vmap=True),
        TableEntry("eigvalsh", jnp.linalg.eigvalsh, unary_samples([(4, 4)], spd)),
    ),
)


# -- eig (general, non-symmetric) ---------------------------------------------------------


def _eig_forward(step, vals):
    outs = tuple(step.bind(vals))
    if step.params["compute_right_eigenvectors"]:
        return outs, outs  # w, (vl,) vr: what the backward reads
    return outs, (vals[0],)  # the right eigenvectors are recomputed from the input


def _eig_vec_vjp(w, v, gv):
    """The transpose of JAX's eigenvector derivative (``_eig_vec_jvp``: with ``P =
    V^-1 dA V``, ``U = V (F * P)``, ``dv_j = u_j + c_j v_j``, where ``c_j`` keeps
    LAPACK's normalisation: unit norm and a real largest component ``v[k_j, j]``,
    ``c_j = -Re(v_j^H u_j) - i Im(u[k_j, j]) / v[k_j, j]``), from ``gv`` to the
    gradient of ``P``'s off-diagonal part, ``F * gQ``. Real and imaginary parts
    transpose as in Note [Complex gradients]: ``real``'s cotangent ``t`` becomes
    ``t + 0i``, ``imag``'s ``0 - t i``, and ``complex(x, y)``'s ``(Re t, -Im t)``."""
    n = w.shape[-1]
    F = _reciprocal_gaps(w)
    k = jnp.argmax(jnp.abs(v), axis=-2)
    rows = jnp.arange(n).reshape((1,) * (v.ndim - 2) + (n, 1))
    mask = (rows == k[..., None, :]).astype(v.dtype)
    d = jnp.real(jnp.sum(mask * v, axis=-2))
    gc = jnp.sum(v * gv, axis=-2)  # dv = U + v c
    ga, gb = -jnp.real(gc), jnp.imag(gc)  # c = complex(-a, -b)
    gs = lax.complex(jnp.zeros_like(gb), -gb / d)  # b = Im(sum(mask U)) / d
    gU = gv + jnp.conj(v) * ga[..., None, :].astype(v.dtype) + mask * gs[..., None, :]  # a = Re(sum(conj(v) U))
    return F * _mm(_T(v), gU)


def _eig_vjp(r, g):
    """Transpose of JAX's forward rule of ``eig``: the eigenvalues ``dw =
    diag(V^-1 dA V)`` give ``gA = V^-T diag(gw) V^T`` (``V`` the right
    eigenvectors); the right eigenvectors add ``_eig_vec_vjp`` to the middle
    factor, and the left ones the same for ``conj(w)``, ``VL`` and ``dA^H``
    (the transpose of ``dA -> dA^H`` is itself). A real input takes the real
    part. As in JAX, eigenvector gradients need ``enable_eigvec_derivs=True``
    (they hold only for distinct eigenvalues, which nothing can check)."""
    p = r.params
    left, right = p["compute_left_eigenvectors"], p["compute_right_eigenvectors"]
    if (left or right) and not p.get("enable_eigvec_derivs", False):
        raise AutogradError(
            "rf.lift: the gradient of eig's eigenvectors is only defined under assumptions JAX cannot check; "
            "pass enable_eigvec_derivs=True to jax.lax.linalg.eig to opt in (as jax.grad requires), "
            "or use jnp.linalg.eigvals for the eigenvalues alone"
        )
    if right:
        outs = r.extra
    else:
        kw = {k: p[k] for k in ("enable_eigvec_derivs", "implementation") if k in p}
        outs = lax.linalg.eig(r.extra[0], compute_left_eigenvectors=left, compute_right_eigenvectors=True, **kw)
    w, vr = outs[0], outs[-1]
    # an output without a cotangent (None) takes no term (Note [No cotangent, no term])
    mid = _diag(g[0].astype(vr.dtype)) if g[0] is not None else jnp.zeros(vr.shape, vr.dtype)
    if right and g[-1] is not None:
        mid = mid + _eig_vec_vjp(w, vr, g[-1].astype(vr.dtype))
    ga = _mm(jnp.linalg.solve(_T(vr), mid), _T(vr))
    if left and g[1] is not None:
        vl = outs[1]
        gl = _eig_vec_vjp(jnp.conj(w), vl, g[1].astype(vl.dtype))
        ga = ga + jnp.conj(_T(_mm(jnp.linalg.solve(_T(vl), gl), _T(vl))))
    return (as_dtype(ga, r.in_avals[0].dtype),)  # a real matrix's: the real part


_eig_vjp.takes_none = True  # Note [No cotangent, no term]


def _to_general_complex(a):
    """A complex, non-Hermitian matrix built from a real one: its eigenvectors,
    normalised by LAPACK (a real largest component), are smooth in ``a``."""
    return lax.complex(a, 0.5 * _T(a))


def _eig(a):
    """Eigenvalues and right eigenvectors as one real array."""
    w, v = lax.linalg.eig(_to_general_complex(a), compute_left_eigenvectors=False, enable_eigvec_derivs=True)
    return _cat(w.real, w.imag, v.real, v.imag)


def _eig_left(a):
    w, vl, vr = lax.linalg.eig(_to_general_complex(a), enable_eigvec_derivs=True)
    return _cat(w.real, w.imag, vl.real, vl.imag, vr.real, vr.imag)


def _eig_real(a):
    """A real matrix's right eigenvectors, each divided by the phase of its first
    component (LAPACK's sign of a real eigenvector is not smooth in ``a``)."""
    w, v = lax.linalg.eig(a, compute_left_eigenvectors=False, enable_eigvec_derivs=True)
    v0 = v[..., :1, :]
    v = v * (jnp.conj(v0) / jnp.abs(v0).astype(v.dtype))
    return _cat(w.real, w.imag, v.real, v.imag)


def _eigvals(a):
    w = jnp.linalg.eigvals(a)
    return _cat(w.real, w.imag)


def _eig_errors():
    return [
        BadProgram(
            "eigenvectors without enable_eigvec_derivs",
            lambda a: jnp.real(jnp.linalg.eig(a)[1]),
            (_mat(3, 3),),
            AutogradError,
            ("rf.lift", "enable_eigvec_derivs"),
            x64=True,
            jax_too=True,
        ),
    ]


defrule(
    "eig",
    _eig_vjp,
    forward=_eig_forward,
    multiple_results=True,
    table=(
        TableEntry("eigvals", _eigvals, unary_samples([(4, 4), (2, 3, 3)]), vmap=True),
        TableEntry("eig_right", _eig, unary_samples([(3, 3), (2, 3, 3)])),
        TableEntry("eig_left_right", _eig_left, unary_samples([(3, 3)])),
        TableEntry("eig_real", _eig_real, unary_samples([(4, 4)])),
        TableEntry("poly", lambda a: _cat(jnp.poly(a).real, jnp.poly(a).imag), unary_samples([(4, 4)])),
    ),
    errors=_eig_errors,
)


# -- svd --------------------------------------------------------------------------------


def _svd_forward(step, vals):
    outs = tuple(step.bind(vals))
    p = step.params
    if p["compute_uv"] and not p["full_matrices"]:
        return outs, outs  # s, U, Vt: what JAX's rule recomputes
    return outs, (vals[0],)  # recomputed from the input in the backward


# Note [Close eigenvalues]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# The gradient through the eigenvectors of eigh or eig carries ``F[i, j] = 1 / (w[j] -
# w[i])``, and through ``U`` or ``V`` of an SVD ``F[i, j] = 1 / (s[j]^2 - s[i]^2)``.
#
# Where two singular values are equal, a loss that does not depend on the basis chosen
# inside their block (``U S V^T``, ``U V^T``, ``jnp.linalg.lstsq``, which jax computes
# through the SVD) still has a gradient, but it is a limit ``0/0`` that the cotangents
# of ``U``, ``S`` and ``V`` do not determine: at ``A = I`` the numerators are exactly 0
# for ``lstsq`` and the limit is not. Equal values give ``F = inf`` and a non-finite
# gradient (PyTorch's behaviour; jax.grad masks ``F`` to 0 at an exact tie and is then
# wrong or non-finite). Values a rounding error apart are worse: ``F`` is finite and
# huge, and the gradient silently wrong. Measured (jax 0.10.2, float64, against central
# differences): ``lstsq``, ``U S V^T`` and ``U V^T`` at a random orthogonal matrix
# (singular values 1 within ulps) and at ``[[2, 1, 0], [1, 2, 0], [0, 0, 3]]`` (3 and
# 3 - 4e-16) were wrong by 0.2 to 10 with no error, jax.grad's as well; eigh alike
# (``V diag(exp(w)) V^T`` and the projector onto two of three eigenvectors of
# ``Q diag(2, 2, 1) Q^T``, wrong by 5 and 0.75).
#
# So ``F`` is nan wherever two values are within ``sqrt(eps) * max|w|`` (``_too_close``):
# the values carry an error of about ``eps * max|w|``, so outside that band the error of
# ``1/(w[j] - w[i])`` stays below ``sqrt(eps)`` relative; inside it the gradient is nan.
# The values' own gradient (no vectors, no ``U`` or ``V``) takes no ``F`` and stays
# exact at ties (Note [No cotangent, no term]); ``jnp.linalg.pinv`` has its own rule in
# jax, and the matrix norms read the singular values only.


def _svd_vjp(r, g):
    """Transpose of JAX's forward rule for the thin SVD: with ``dS = U^H dA V``,
    ``ds = Re diag(dS)``, ``dU = U (F * (dS s + (dS s)^H) + D)``, ``dV = V (F * (s dS
    + (s dS)^H))`` (``F[i, j] = 1 / (s[j]^2 - s[i]^2)``; ``D = (dS - dS^H) / (2 s)``
    on the diagonal, zero for a real matrix) and, for a non-square matrix, the
    components outside the span of ``U`` (``V``). For a complex matrix ``conj`` and
    ``^H`` transpose as in Note [Complex gradients]; for a real one every ``conj`` is
    the identity."""
    p = r.params
    m, n = r.in_avals[0].shape[-2:]
    if p["compute_uv"] and p["full_matrices"] and m != n:
        raise AutogradError(
            "rf.lift: the gradient of svd(full_matrices=True) of a non-square matrix is not defined "
            "(JAX does not implement it); use full_matrices=False"
        )
    if p["compute_uv"] and not p["full_matrices"]:
        s, U, Vt = r.extra
    else:
        U, s, Vt = lax.linalg.svd(
            r.extra[0],
            full_matrices=False,
            compute_uv=True,
            subset_by_index=p["subset_by_index"],
            algorithm=p["algorithm"],
        )
    cplx = jnp.iscomplexobj(U)
    V = jnp.conj(_T(Vt))
    Uc, Vtc = jnp.conj(U), jnp.conj(Vt)  # conj(U) K V^T is the gradient of dS's K
    # an output without a cotangent (None) takes no term (Note [No cotangent, no term]):
    # at a repeated singular value ``F`` is infinite, and ``F * 0`` would be nan
    k = s.shape[-1]
    gs = g[0].astype(U.dtype) if g[0] is not None else jnp.zeros(s.shape, U.dtype)
    K = _diag(gs)
    if not p["compute_uv"]:
        return (_mm(Uc * gs[..., None, :], Vtc),)
    gU, gV = g[1], (jnp.conj(_T(g[2])) if g[2] is not None else None)
    eye = _eye(k, s.dtype, s.ndim + 1)
    srow = s[..., None, :]
    F = 1 / ((srow + _T(srow)) * (srow - _T(srow)) + eye) - eye
    F = jnp.where(_too_close(s), jnp.nan, F).astype(U.dtype)  # Note [Close eigenvalues]
    srow = srow.astype(U.dtype)
    if gU is not None:
        UgU = _mm(_T(U), gU)
        A1 = F * UgU
        K = K + (A1 + jnp.conj(_T(A1))) * srow
        if cplx:  # D's transpose: i Im(diag(U^T gU)) / s (0 where s is 0, as JAX's)
            zero = (s == 0).astype(s.dtype)
            inv = (1 / (s + zero) - zero).astype(U.dtype)
            d = jnp.diagonal(UgU, axis1=-2, axis2=-1)
            K = K + _diag(_i_imag(d) * inv)
    if gV is not None:
        A2 = F * _mm(_T(V), gV)
        K = K + _T(srow) * (A2 + jnp.conj(_T(A2)))
    gA = _mm(_mm(Uc, K), Vtc)
    if m > n and gU is not None:
        gUs = gU / srow
        gA = gA + _mm(gUs - _mm(Uc, _mm(_T(U), gUs)), Vtc)
    if n > m and gV is not None:
        gVs = gV / srow
        gA = gA + jnp.conj(_mm(U, _T(gVs - _mm(jnp.conj(V), _mm(_T(V), gVs)))))
    return (gA,)


_svd_vjp.takes_none = True  # Note [No cotangent, no term]


def _svd(a, full_matrices=False):
    u, s, vt = jnp.linalg.svd(a, full_matrices=full_matrices)
    sign = jnp.sign(u[..., :1, :])
    return _cat(u * sign, s, vt * jnp.swapaxes(sign, -1, -2))


def _svd_errors():
    return [
        BadProgram(
            "full_matrices tall",
            lambda a: jnp.linalg.svd(a, full_matrices=True)[0],
            (_mat(4, 3),),
            AutogradError,
            ("rf.lift", "full_matrices"),
            x64=True,
            jax_too=True,
        ),
        BadProgram(
            "full_matrices wide",
            lambda a: jnp.linalg.svd(a, full_matrices=True)[2],
            (_mat(3, 4),),
            AutogradError,
            ("rf.lift", "full_matrices"),
            x64=True,
            jax_too=True,
        ),
    ]


defrule(
    "svd",
    _svd_vjp,
    forward=_svd_forward,
    multiple_results=True,
    table=(
        TableEntry("svd", _svd, unary_samples([(4, 4), (5, 3), (3, 5), (2, 4, 3)]), vmap=True),
        TableEntry("svd_full_square", lambda a: _svd(a, full_matrices=True), unary_samples([(3, 3)])),
        TableEntry(
            "svdvals", lambda a: jnp.linalg.svd(a, compute_uv=False), unary_samples([(4, 3), (3, 5), (2, 3, 3)])
        ),
        TableEntry("norm_2", lambda a: jnp.linalg.norm(a, 2), unary_samples([(4, 3), (3, 3)])),
        TableEntry("norm_nuc", lambda a: jnp.linalg.norm(a, "nuc"), unary_samples([(3, 4)])),
        TableEntry("pinv", jnp.linalg.pinv, unary_samples([(4, 3), (3, 4)])),
    ),
    errors=_svd_errors,
)


# -- custom_linear_solve ------------------------------------------------------------------


def _linear_solve_split(r_or_step):
    cl = r_or_step.params["const_lengths"]
    n_c = sum(cl)
    return cl, n_c, len(r_or_step.in_avals) - n_c


def _linear_solve_prepare(step):
    """The matvec as a program of its own (rf's rules), for the gradient of the
    matrix it reads: its consts are tracked where the step's are."""
    cl, n_c, nb = _linear_solve_split(step)
    needs_mv = step.needs[: cl.matvec]
    if not any(needs_mv):
        return None
    matvec = step.params["jaxprs"].matvec
    return Program(matvec, tuple(needs_mv) + (False,) * nb, "custom_linear_solve.matvec")


def _linear_solve_forward(step, vals):
    outs = tuple(step.bind(vals))
    cl, n_c, nb = _linear_solve_split(step)
    return outs, (tuple(vals[:n_c]), tuple(outs[:nb]))


def _transposed_consts(consts, cl):
    """The consts of ``(matvec, vecmat, solve, transpose_solve)`` reordered for
    the transposed system ``(vecmat, matvec, transpose_solve, solve)``."""
    a = cl.matvec
    b = a + cl.vecmat
    c = b + cl.solve
    return (*consts[a:b], *consts[:a], *consts[c:], *consts[b:c])


def _linear_solve_vjp(r, g):
    """``A x = b``: ``gb = A^{-T} gx``, solved as the transposed system (one more
    ``custom_linear_solve``, matvec and vecmat swapped, solved by
    ``transpose_solve``), as JAX's transpose does: differentiated again, its
    derivative reaches the matrix through vecmat's consts, where evaluating
    ``transpose_solve`` alone would differentiate only its own consts (for
    ``jnp.linalg.solve`` the LU factors of ``stop_gradient(A)``: a Hessian of
    ``solve``, ``inv`` or ``slogdet`` would lose its matrix terms). The matrix
    (the consts of ``matvec``) gets ``-(d matvec(x) / d consts)^T gb``, taken by
    rf's own rules on the matvec program. The consts of ``vecmat``, ``solve`` and
    ``transpose_solve`` get no gradient (as in JAX); neither do aux outputs."""
    cl, n_c, nb = _linear_solve_split(r)
    jaxprs = r.params["jaxprs"]
    if jaxprs.transpose_solve is None:
        raise AutogradError("rf.lift: custom_linear_solve needs transpose_solve (or symmetric=True) for its gradient")
    consts, x = r.extra
    params = {**r.params, "const_lengths": cl.transpose(), "jaxprs": jaxprs.transpose()}
    gb = list(r._step.prim.bind(*_transposed_consts(consts, cl), *g[:nb], **params))[:nb]
    out = [None] * n_c + [gb[i] if r.needs[n_c + i] else None for i in range(nb)]
    sub = r._step.sub
    if sub is not None:
        _, res = sub.forward([*consts[: cl.matvec], *x])
        grads = sub.backward(res, [-v for v in gb])
        for i in range(cl.matvec):
            if r.needs[i]:
                out[i] = grads[i]
    return tuple(out)


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


def _no_transpose_solve(a):
    return lax.custom_linear_solve(lambda x: a @ x, jnp.ones(3), solve=lambda _, b: jnp.linalg.solve(a, b))


def _linear_solve_errors():
    return [
        BadProgram(
            "no transpose_solve",
            _no_transpose_solve,
            (_mat(3, 3),),
            AutogradError,
            ("rf.lift", "transpose_solve"),
            x64=True,
            jax_too=True,
        )
    ]


_linear_solve_vjp.prepare = _linear_solve_prepare
defrule(
    "custom_linear_solve",
    _linear_solve_vjp,
    forward=_linear_solve_forward,
    multiple_results=True,
    table=(
        TableEntry(
            "solve",
            jnp.linalg.solve,
            _systems(wellcond, ((4, 4), (4,)), ((3, 3), (3, 2)), ((2, 3, 3), (2, 3, 2))),
            vmap=True,
        ),
        TableEntry("inv", jnp.linalg.inv, unary_samples([(4, 4), (2, 3, 3)], wellcond)),
        TableEntry("custom_linear_solve_symmetric", _cg_solve, _systems(spd, ((4, 4), (4,)))),
        TableEntry("custom_linear_solve_pytree", _pair_solve, _systems(wellcond, ((3, 3), (3,)))),
    ),
    errors=_linear_solve_errors,
)


# -- tridiagonal_solve ----------------------------------------------------------------------


def _tridiagonal_solve_vjp(r, g):
    """``A x = b`` with ``A`` given by its three diagonals: ``gb`` solves with
    ``A^T`` (the off-diagonals swapped and shifted); a diagonal gets ``-gb x``
    summed over the columns, shifted as the diagonal sits (``dl[0]`` and
    ``du[-1]`` are not read and get no gradient)."""
    dl, d, du = r.ins[:3]
    x = r.outs[0]
    dl_t = jnp.concatenate([jnp.zeros_like(du[..., -1:]), du[..., :-1]], axis=-1)
    du_t = jnp.concatenate([dl[..., 1:], jnp.zeros_like(dl[..., :1])], axis=-1)
    gb = lax.linalg.tridiagonal_solve(dl_t, d, du_t, g, perturb_singular=r.params["perturb_singular"])
    zero = jnp.zeros_like(gb[..., :1, 0])
    g_dl = g_d = g_du = None
    if r.needs[0]:
        g_dl = jnp.concatenate([zero, -jnp.sum(gb[..., 1:, :] * x[..., :-1, :], -1)], axis=-1)
    if r.needs[1]:
        g_d = -jnp.sum(gb * x, -1)
    if r.needs[2]:
        g_du = jnp.concatenate([-jnp.sum(gb[..., :-1, :] * x[..., 1:, :], -1), zero], axis=-1)
    return g_dl, g_d, g_du, (gb if r.needs[3] else None)


def _tridiagonal_samples(rng):
    return [
        Sample((normal(rng, 4), 4 + normal(rng, 4), normal(rng, 4), normal(rng, 4, 2)), diff=(0, 1, 2, 3)),
        Sample((normal(rng, 2, 3), 4 + normal(rng, 2, 3), normal(rng, 2, 3), normal(rng, 2, 3, 1)), diff=(0, 1, 2, 3)),
    ]


defrule(
    "tridiagonal_solve",
    _tridiagonal_solve_vjp,
    ((0, 1, 2), (0,)),
    table=(
        TableEntry(
            "tridiagonal_solve", lambda dl, d, du, b: lax.linalg.tridiagonal_solve(dl, d, du, b), _tridiagonal_samples
        ),
    ),
)
