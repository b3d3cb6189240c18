"""Derivatives where a program picks among equal values or sits on a kink (max/min
ties, sort and top-k ties, median, pooling windows with equal entries, scatters with
duplicate indices, abs/sign/relu/clip at their kinks, ``arctan2(0, 0)``): rf's rule
must choose what jax's does. Each program under ``rf.grad(rf.lift(f))`` against
``jax.grad(f)`` in float64, eager and jit, per-example ``jax.vmap`` and as a
Hessian-vector product (``jax.jvp`` of the gradient)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import rumus_fx as rf
from rumus_fx.testing import check_fd

# rows with ties (1 3 3 0), all equal (2 2 2 2), and a zero/negative mix; every
# program's value at this point has equal candidates or a kink
X = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, -1.0, 5.0]])
IDX = np.array([1, 1, 3])
SEGMENTS = np.array([0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2])

PROGRAMS = {
    "max": lambda a: jnp.max(a),
    "max_axis": lambda a: jnp.sum(jnp.max(a, axis=1) * jnp.array([1.0, 2.0, 3.0])),
    "min_axis0": lambda a: jnp.sum(jnp.min(a, axis=0) * jnp.arange(1.0, 5.0)),
    "reduce_max": lambda a: jnp.sum(lax.reduce_max(a, (1,)) ** 2),
    "maximum_tie": lambda a: jnp.sum(jnp.maximum(a, 2.0)),
    "maximum_self": lambda a: jnp.sum(jnp.maximum(a, a[::-1])),
    "minimum": lambda a: jnp.sum(jnp.minimum(a, 0.0) * a),
    "relu0": lambda a: jnp.sum(jax.nn.relu(a - 2.0)),
    "abs0": lambda a: jnp.sum(jnp.abs(a - 2.0)),
    "clip_bounds": lambda a: jnp.sum(jnp.clip(a, 0.0, 3.0) * a),
    "cummax": lambda a: jnp.sum(lax.cummax(a, axis=1) * jnp.arange(1.0, 5.0)),
    "cummin_rev": lambda a: jnp.sum(lax.cummin(a, axis=1, reverse=True) * jnp.arange(1.0, 5.0)),
    "sort_ties": lambda a: jnp.sum(jnp.sort(a, axis=1) * jnp.arange(1.0, 5.0)),
    "argsort_take": lambda a: jnp.sum(jnp.take_along_axis(a, jnp.argsort(a, axis=1), 1) * jnp.arange(1.0, 5.0)),
    "top_k_ties": lambda a: jnp.sum(lax.top_k(a, 2)[0] * jnp.array([1.0, 2.0])),
    "median": lambda a: jnp.median(a),
    "median_axis": lambda a: jnp.sum(jnp.median(a, axis=1) * jnp.array([1.0, 2.0, 3.0])),
    "quantile": lambda a: jnp.quantile(a, 0.3),
    "percentile_nearest": lambda a: jnp.percentile(a, 40.0, method="nearest"),
    "maxpool": lambda a: jnp.sum(
        lax.reduce_window(a, -jnp.inf, lax.max, (2, 2), (1, 1), "VALID") * jnp.arange(1.0, 7.0).reshape(2, 3)
    ),
    "minpool_same": lambda a: jnp.sum(lax.reduce_window(a, jnp.inf, lax.min, (2, 2), (1, 1), "SAME") ** 2),
    "scatter_set_dup": lambda a: jnp.sum(jnp.zeros(5).at[IDX].set(a[0, :3]) * jnp.arange(1.0, 6.0)),
    "scatter_set_dup_base": lambda a: jnp.sum(a[1].at[jnp.array([0, 0, 2])].set(a[2, :3]) * jnp.arange(1.0, 5.0)),
    "scatter_max_ties": lambda a: jnp.sum(a[1].at[jnp.array([0, 0, 1])].max(a[0, :3]) * jnp.arange(1.0, 5.0)),
    "scatter_min_ties": lambda a: jnp.sum(a[1].at[jnp.array([0, 0, 1])].min(a[2, :3] + 2.0) * jnp.arange(1.0, 5.0)),
    "scatter_mul_dup": lambda a: jnp.sum(a[1].at[jnp.array([0, 0, 1])].mul(a[0, :3]) * jnp.arange(1.0, 5.0)),
    "segment_max": lambda a: jnp.sum(jax.ops.segment_max(a.ravel(), SEGMENTS, 3) * jnp.array([1.0, 2.0, 3.0])),
    "segment_min": lambda a: jnp.sum(jax.ops.segment_min(a.ravel(), SEGMENTS, 3) * jnp.array([1.0, 2.0, 3.0])),
    "logsumexp_ties": lambda a: jax.nn.logsumexp(a * 100.0),
    "softmax_big": lambda a: jnp.sum(jax.nn.softmax(a * 1e3, axis=1) * jnp.arange(1.0, 5.0)),
    "norm_zero": lambda a: jnp.linalg.norm(a - a),
    "norm_inf": lambda a: jnp.linalg.norm(a, ord=jnp.inf),
    "norm_axis_inf": lambda a: jnp.sum(jnp.linalg.norm(a, ord=jnp.inf, axis=1)),
    "norm_1": lambda a: jnp.linalg.norm(a, ord=1),
    "matrix_norm_2": lambda a: jnp.linalg.norm(a, ord=2),
    "amax_where": lambda a: jnp.max(a, where=a < 3, initial=-10.0),
    "nanmax": lambda a: jnp.nanmax(jnp.where(a > 2, jnp.nan, a)),
    "ptp": lambda a: jnp.ptp(a),
    "sign0": lambda a: jnp.sum(jnp.sign(a - 2.0) * a),
    "where_eq": lambda a: jnp.sum(jnp.where(a == 2.0, a * 3.0, a)),
    "pow0": lambda a: jnp.sum((a - 2.0) ** 2.0 + jnp.abs(a) ** 0.5),
    "sqrt0": lambda a: jnp.sum(jnp.sqrt(jnp.maximum(a, 0.0) + 0.0)),
    "hypot0": lambda a: jnp.sum(jnp.hypot(a - 2.0, a - 2.0)),
    "arctan2_00": lambda a: jnp.sum(jnp.arctan2(a - 2.0, a - 2.0)),
    "xlogy0": lambda a: jnp.sum(jax.scipy.special.xlogy(a - 2.0, jnp.abs(a) + 1)),
    "x_log_x0": lambda a: jnp.sum(jax.scipy.special.entr(jnp.abs(a - 2.0))),
    "round": lambda a: jnp.sum(jnp.round(a * 0.5) * a),
    "max_keepdims_bcast": lambda a: jnp.sum(a - jnp.max(a, axis=1, keepdims=True)),
    "argmax_gather": lambda a: jnp.sum(a[jnp.arange(3), jnp.argmax(a, axis=1)]),
    "lax_max_tie": lambda a: jnp.sum(lax.max(a, jnp.full_like(a, 2.0))),
    "lax_min_self": lambda a: jnp.sum(lax.min(a, a)),
    "max_self": lambda a: jnp.sum(jnp.maximum(a, a)),
}


def _outcome(fun):
    try:
        return np.asarray(fun())
    except Exception as exc:  # jax refuses: rf must refuse too
        return exc


def _same(got, want, rtol=1e-10, atol=1e-12):
    if isinstance(want, Exception) or isinstance(got, Exception):
        assert isinstance(want, Exception) and isinstance(got, Exception), (got, want)
        return
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_ties_and_kinks_match_jax_grad(name, jit):
    f = PROGRAMS[name]
    with jax.enable_x64(True):
        x = jnp.asarray(X)
        g = rf.grad(rf.lift(f))
        _same(_outcome(lambda: (jax.jit(g) if jit else g)(x)), _outcome(lambda: jax.jit(jax.grad(f))(x)))


# per-example and second order for every fourth program (all of them with -m slow); each
# program's first-order gradient runs eagerly and under jit above
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow if j % 4 else ()) for j, n in enumerate(PROGRAMS)]
)
def test_ties_and_kinks_per_example_and_second_order(name):
    f = PROGRAMS[name]
    with jax.enable_x64(True):
        x = jnp.asarray(X)
        xs = jnp.stack([x, x[::-1], jnp.round(x * 0.5)])  # ties at other places
        _same(_outcome(lambda: jax.vmap(rf.grad(rf.lift(f)))(xs)), _outcome(lambda: jax.jit(jax.vmap(jax.grad(f)))(xs)))
        v = jnp.asarray(np.random.default_rng(0).standard_normal(X.shape))
        _same(
            _outcome(lambda: jax.jvp(rf.grad(rf.lift(f)), (x,), (v,))[1]),
            _outcome(lambda: jax.jit(lambda x, v: jax.jvp(jax.grad(f), (x,), (v,))[1])(x, v)),
            rtol=1e-9,
            atol=1e-11,
        )


def test_pow_at_zero_to_the_zero():
    """``x ** y`` at ``x = y = 0`` with a floating ``y``: rf's derivative in ``x`` is
    0, the partial derivative (``h ** 0 == 1`` on both sides, which the central
    difference confirms) and PyTorch's value; ``jax.grad`` gives nan there (its own
    test calls 0 the preferred value). The derivative in ``y`` and every other point
    follow jax.grad."""
    with jax.enable_x64(True):
        f = lambda x, y: jnp.sum(lax.pow(x, y))  # noqa: E731
        x = jnp.array([0.0, 0.0, 1.5, 2.0])
        y = jnp.array([0.0, 1.0, 0.0, -0.5])
        gx, gy = rf.grad(rf.lift(f), argnums=(0, 1))(x, y)
        h = 1e-6
        fd = (lax.pow(x + h, y) - lax.pow(x - h, y)) / (2 * h)
        np.testing.assert_allclose(gx, fd, atol=1e-8)
        assert gx[0] == 0.0
        jx, jy = jax.grad(f, argnums=(0, 1))(x, y)
        np.testing.assert_allclose(gx[1:], jx[1:], rtol=1e-12)
        np.testing.assert_allclose(gy, jy, rtol=1e-12)
        # an integer power: jax.grad gives 0 too (and needs standard dtype promotion
        # for it, where rf's rule converts the power itself)
        n = jnp.array([0, 1, 0, 2])
        got = rf.grad(rf.lift(f))(x, n)
        with jax.numpy_dtype_promotion("standard"):
            np.testing.assert_array_equal(got, jax.grad(f)(x, n))
        # a Python scalar power or base: a literal of the program, or an argument
        # not differentiated (a Python float reaches the rule)
        g = lambda x: jnp.sum(lax.pow(x, 2.5) + lax.pow(2.0, x) + lax.pow(x, 0.0))  # noqa: E731
        np.testing.assert_allclose(rf.grad(rf.lift(g))(x + 1), jax.grad(g)(x + 1), rtol=1e-12)
        np.testing.assert_allclose(rf.grad(rf.lift(pow))(5.0, 1.5), jax.grad(pow)(5.0, 1.5), rtol=1e-12)


def _fused_logits(x):
    """Logits that a compiled forward computes twice, materialised (what a rule
    saves) and inline in the fusion of the op that reads them,
    ``(x c^T - sum_j |x_i - x_j|)^T / 0.5`` with a constant ``c``: XLA:CPU rounds
    the two copies of these float64 values apart in their last bit."""
    y = x[None, :, None]  # a batch of one: the product is a batched dot_general
    pd = jnp.abs(y - jnp.swapaxes(y, -1, -2))
    c = jnp.arange(3, -4, -2).astype(x.dtype)
    return jnp.swapaxes(y @ c[None, :] - jnp.sum(pd, axis=-1)[..., None], -1, -2) / 0.5


def _matches_eager_jax_grad(f, args, argnums_list):
    """rf's gradient, eager and under jit, finite and equal to jax.grad's run eagerly
    (op by op, so each value exists once)."""
    for argnums in argnums_list:
        want = jax.grad(f, argnums)(*args)
        for jit in (False, True):
            g = rf.grad(rf.lift(f), argnums)
            got = (jax.jit(g) if jit else g)(*args)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                assert np.all(np.isfinite(a)), (argnums, jit, a)
                np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=f"{argnums} jit={jit}")


def _softmax_of_a_fused_operand(x, extreme):
    """A softmax that subtracts the row's extreme without stopping its gradient
    (as TensorFlow Probability's JAX substrate writes it), of ``_fused_logits``."""
    p = _fused_logits(x)
    e = jnp.exp(p - extreme(p, axis=-1, keepdims=True))
    return jnp.sum(e / jnp.sum(e, axis=-1, keepdims=True) * jnp.arange(1.0, 1.0 + p.size).reshape(p.shape))


@pytest.mark.parametrize("extreme", [jnp.max, jnp.min], ids=["max", "min"])
def test_extreme_of_an_operand_computed_twice(extreme):
    """The max/min reduction's rule found its winners by comparing the saved
    operand with the saved output; XLA:CPU rounded the two copies of these
    float64 logits differently, no element equalled the output, and the eager
    gradient was nan with no error (found in TensorFlow Probability's
    ``soft_sorting_matrix``). The rule now takes the extreme of the saved operand."""
    with jax.enable_x64(True):
        _matches_eager_jax_grad(
            lambda x: _softmax_of_a_fused_operand(x, extreme), (jnp.array([-1.3, -0.2, 0.4, 2.1]),), [0]
        )


@pytest.mark.parametrize("pick", [jnp.maximum, jnp.minimum], ids=["maximum", "minimum"])
def test_elementwise_extreme_of_an_operand_computed_twice(pick):
    """The same for the elementwise max/min: the rule compared each saved input
    with the saved output, neither equalled it, and both inputs got a zero
    gradient (jnp.maximum(logits, c), a relu-like clip of these logits: wrong by up
    to 192 for the maximum and 384 for the minimum, with no error). The rule now
    picks the chosen value again from the saved inputs. Each argument alone and both."""
    with jax.enable_x64(True):
        x = jnp.array([-1.3, -0.2, 0.4, 2.1])
        c = jnp.array([-9.0, -5.0, -7.0, -3.0])
        w = jnp.arange(1.0, 17.0).reshape(1, 4, 4)

        def f(x, c):
            p = _fused_logits(x)
            return jnp.sum(pick(p, c[None, None, :]) * w) + jnp.sum(pick(p, jnp.swapaxes(p, -1, -2)) * w)

        _matches_eager_jax_grad(f, (x, c), [0, 1, (0, 1)])


# -- repeated spectra: eigen- and singular values a program uses without their vectors --
# At a repeated eigen- or singular value the vectors' factor (1 / the gap) is infinite;
# a program that uses only the values (or vectors away from the repeated values) has a
# finite gradient there, which jax.grad gives (a symbolic zero takes no term in its
# transpose) and central differences confirm: rf's eigh, eig and svd rules must give it too
# (Note [No cotangent, no term] in rumus_fx/lift/rules_linalg.py); they gave nan.


def _diagonal(values, rows=None, batch=()):
    """``diag(values)`` (``rows`` x ``len(values)``, zero rows below): a spectrum that
    repeats exactly (a rotated one repeats only to rounding, where ``1 / gap`` is
    finite)."""
    n = len(values)
    a = np.zeros((rows or n, n))
    a[:n, :n] = np.diag(values)
    return np.broadcast_to(a, batch + a.shape).copy()


_W5 = np.cos(np.arange(25.0)).reshape(5, 5)
_W4 = np.cos(np.arange(16.0)).reshape(4, 4)


def _svd(a):
    return jnp.linalg.svd(a, full_matrices=False)


def _eig(a, left):
    return lax.linalg.eig(a, compute_left_eigenvectors=left, enable_eigvec_derivs=True)


SPECTRA = {
    # eigenvalue 0 three times (and 1 once), the eigenvalues alone
    "eigvalsh": (lambda a: jnp.sum(jnp.linalg.eigvalsh(a) ** 3), _diagonal([1.0, 0.0, 0.0, 0.0])),
    "eigh_values": (lambda a: jnp.sum(jnp.sin(jnp.linalg.eigh(a)[0])), _diagonal([2.0, 0.5, 0.5, -1.0])),
    "scipy_eigh_values": (
        lambda a: jnp.sum(jnp.exp(jax.scipy.linalg.eigh(a, eigvals_only=True))),
        _diagonal([1.0, -1.0, 1.0, -1.0]),
    ),
    "eigvalsh_batched": (
        lambda a: jnp.sum(jnp.linalg.eigvalsh(a) ** 3),
        _diagonal([1.0, 0.0, 0.0, 2.0], batch=(2,)) * np.array([1.0, 3.0])[:, None, None],
    ),
    # the vectors with one output of the decomposition unused (None in the rule) at
    # distinct values (where a used vector's value repeats, jax's gradient and rf's are
    # nan: see below): the eigenvectors alone, through the projector onto the two
    # largest eigenvalues' space (sign-free)
    "eigh_top_projector": (
        lambda a: jnp.sum(jnp.linalg.eigh(a)[1][:, 2:] @ jnp.linalg.eigh(a)[1][:, 2:].T * _W4),
        _diagonal([0.0, 1.0, 3.0, -2.0]) + 0.1 * np.eye(4, k=1) + 0.1 * np.eye(4, k=-1),
    ),
    # a general matrix, eigenvalue 2 twice (diagonalisable), its vectors computed with
    # their derivatives enabled and unused: right ones, and left and right
    "eig_values": (
        lambda a: jnp.sum(_eig(a, left=False)[0].real ** 3),
        np.array([[1.0, 1.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 2.0]]),
    ),
    "eig_values_left_and_right": (
        lambda a: jnp.sum(jnp.sin(_eig(a, left=True)[0].real)),
        np.array([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.5, -1.0]]),
    ),
    # singular value 2 twice, the values of a full (square) and a thin (tall)
    # decomposition alone
    "svd_values": (lambda a: jnp.sum(jnp.linalg.svd(a)[1] ** 3), _diagonal([2.0, 1.0, 2.0])),
    "svd_values_tall": (lambda a: jnp.sum(_svd(a)[1] ** 3), _diagonal([2.0, 2.0, 1.0], rows=5)),
    # the values and the left vectors of a tall matrix, the right vectors alone of a
    # wide one (projectors onto their spans: sign-free)
    "svd_left_vectors_and_values": (
        lambda a: jnp.sum(_svd(a)[1]) + jnp.sum(_svd(a)[0][:, :1] @ _svd(a)[0][:, :1].T * _W5),
        _diagonal([3.0, 1.0, 2.0], rows=5) + 0.1 * np.eye(5, 3, -3),
    ),
    "svd_right_vectors": (
        lambda a: jnp.sum(_svd(a)[2][:1].T @ _svd(a)[2][:1] * _W5),
        (_diagonal([3.0, 1.0, 2.0], rows=5) + 0.1 * np.eye(5, 3, -3)).T,
    ),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(SPECTRA))
def test_repeated_spectra_values_alone(name, jit):
    f, a = SPECTRA[name]
    with jax.enable_x64(True):
        a = jnp.asarray(a)
        g = rf.grad(rf.lift(f))
        got = np.asarray((jax.jit(g) if jit else g)(a))
        assert np.all(np.isfinite(got)), got
        _same(got, np.asarray(jax.jit(jax.grad(f))(a)), rtol=1e-9, atol=1e-10)
    check_fd(rf.lift(f), (a,), eps=1e-6, tol=1e-6, directions=3)


def test_repeated_eigenvalue_with_its_vectors_used_is_nan_as_in_jax():
    """Where the program uses the vectors of a repeated eigenvalue they are not
    differentiable: rf, as jax, gives nan (it does not make up a value)."""
    f = lambda a: jnp.sum(jnp.linalg.eigh(a)[1] ** 3)  # noqa: E731
    with jax.enable_x64(True):
        a = jnp.asarray(_diagonal([1.0, 0.0, 0.0, 0.0]))
        got, want = np.asarray(rf.grad(rf.lift(f))(a)), np.asarray(jax.grad(f)(a))
    assert not np.any(np.isfinite(want))
    _same(got, want)


# -- eigenvectors and singular vectors at close values: nan, never a finite wrong value --

_W = np.arange(9.0).reshape(3, 3)
_Q = np.linalg.qr(np.random.default_rng(0).standard_normal((3, 3)))[0]


def _svd_rebuilt(a):
    u, s, vt = jnp.linalg.svd(a, full_matrices=False)
    return jnp.sum((u * s[None, :]) @ vt * _W)


def _svd_polar(a):
    u, _, vt = jnp.linalg.svd(a, full_matrices=False)
    return jnp.sum((u @ vt) * _W)


def _eigh_exp(a):
    w, v = jnp.linalg.eigh(a)
    return jnp.sum((v * jnp.exp(w)[None, :]) @ v.T * (_W + _W.T))


def _eigh_projector(a):
    _, v = jnp.linalg.eigh(a)
    return jnp.sum((v[:, 1:] @ v[:, 1:].T) * (_W + _W.T))


_CLOSE_LOSSES = {
    "lstsq": lambda a: jnp.sum(jnp.linalg.lstsq(a, jnp.arange(1.0, 4.0))[0]),
    "svd_rebuilt": _svd_rebuilt,
    "svd_polar": _svd_polar,
    "eigh_exp": _eigh_exp,
    "eigh_projector": _eigh_projector,
}
# values a rounding error apart: an orthogonal matrix (singular values 1), Q diag(2, 2, 1)
# Q^T (eigenvalues 2 and 2), [[2, 1, 0], [1, 2, 0], [0, 0, 3]] (3 and 3 - 4e-16)
_CLOSE_MATRICES = {
    "orthogonal": _Q,
    "q_diag_2_2_1": _Q @ np.diag([2.0, 2.0, 1.0]) @ _Q.T,
    "three_three_one": np.array([[2.0, 1, 0], [1, 2, 0], [0, 0, 3]]),
}
_APART = (lambda m: m + m.T)(np.random.default_rng(1).standard_normal((3, 3)))


def _central_differences(loss, a, symmetric, h=1e-6):
    out = np.zeros((3, 3))
    for i in range(3):
        for j in range(3):
            e = np.zeros((3, 3))
            if symmetric:
                e[i, j] += h / 2
                e[j, i] += h / 2
            else:
                e[i, j] = h
            out[i, j] = (loss(a + e) - loss(a - e)) / (2 * h)
    return out


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("loss", list(_CLOSE_LOSSES))
def test_vectors_at_close_values_give_nan_not_a_wrong_gradient(loss, jit):
    """Note [Close eigenvalues] (rumus_fx/lift/rules_linalg.py): through eigenvectors or
    singular vectors, two values a rounding error apart made ``1/(w[j] - w[i])`` huge and
    the gradient finite and wrong (by 0.2 to 15 here, jax.grad's as well). rf's is now
    nan there; with the values apart it equals central differences."""
    f = _CLOSE_LOSSES[loss]
    symmetric = loss.startswith("eigh")
    with jax.enable_x64(True):
        grad = rf.grad(rf.lift(f))
        grad = jax.jit(grad) if jit else grad
        got = np.asarray(grad(jnp.asarray(_APART)))
        if symmetric:  # eigh reads one triangle: compare the symmetric parts
            got = (got + got.T) / 2
        np.testing.assert_allclose(got, _central_differences(f, jnp.asarray(_APART), symmetric), atol=1e-6)
        for name, m in _CLOSE_MATRICES.items():
            if symmetric and not np.allclose(m, m.T):
                continue
            got = np.asarray(grad(jnp.asarray(m)))
            assert not np.isfinite(got).all(), (name, got)


# windows holding nan (and -inf beside padding): (window, strides, padding, base_dilation)
_NAN_WINDOWS = {
    "valid": ((2, 2), (1, 1), "VALID", None),
    "same_strided": ((3, 2), (2, 1), "SAME", None),
    "padded_base_dilation": ((3, 2), (1, 2), ((1, 2), (0, 1)), (2, 1)),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("extreme", ["max", "min"])
@pytest.mark.parametrize("window", list(_NAN_WINDOWS))
def test_pooling_windows_holding_nan_send_the_gradient_where_jax_does(window, extreme, jit):
    """Note [Windowed max gradients] (rumus_fx/lift/rules_conv.py): a window whose
    maximum is nan used to drop its gradient (no element equals nan), where jax.grad
    gives it to the element XLA's select-and-scatter selects (``[nan, 1]``: the 1)."""
    dims, strides, padding, base = _NAN_WINDOWS[window]
    init, pick = (-jnp.inf, lax.max) if extreme == "max" else (jnp.inf, lax.min)

    def f(a):
        out = lax.reduce_window(a, init, pick, dims, strides, padding, base_dilation=base)
        return jnp.sum(out * jnp.arange(1.0, out.size + 1.0).reshape(out.shape))

    rng = np.random.default_rng(3)
    for trial in range(4):
        a = np.round(rng.standard_normal((5, 6)) * 2)  # ties
        a[rng.random(a.shape) < 0.25] = np.nan
        a[rng.random(a.shape) < 0.15] = -np.inf if extreme == "max" else np.inf
        with jax.enable_x64(True):
            x = jnp.asarray(a)
            g = rf.grad(rf.lift(f))
            got = (jax.jit(g) if jit else g)(x)
            np.testing.assert_array_equal(got, jax.grad(f)(x), err_msg=f"trial {trial}")
            np.testing.assert_array_equal(got, jax.jit(jax.grad(f))(x), err_msg=f"trial {trial}")
