"""lineax's ``linear_solve`` on the tape (``rumus_fx/lift/rules_lineax.py``), and what
is built on it: optimistix's root finds (their implicit gradient solves a linear
system in a custom JVP rule) and diffrax's events. Before the rule, each was refused
by name ("no backward rule for the primitive 'linear_solve'"); found by diffrax's
``test_event.py`` through ``tools/jax_suite`` with gradients inside traces probed.

The primitive table (``tests/lift/test_ptable.py``) checks the rule's entries
(LU, QR, Cholesky, a matrix-free operator; LU under ``jax.vmap``) against jax.grad
and finite differences; here each argument alone, the refusal, and the libraries.
"""

from __future__ import annotations

import diffrax
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import optimistix as optx
import pytest

import rumus_fx as rf
from rumus_fx.testing import check_fd

_SOLVERS = {
    "lu": (lx.LU(), lx.MatrixLinearOperator),
    "qr": (lx.QR(), lx.MatrixLinearOperator),
    "cholesky": (lx.Cholesky(), lambda a: lx.MatrixLinearOperator(a @ a.T, lx.positive_semidefinite_tag)),
    "function": (
        lx.LU(),
        lambda a: lx.FunctionLinearOperator(
            lambda v: a @ v + 0.5 * jnp.tanh(a) @ v, jax.ShapeDtypeStruct((3,), a.dtype)
        ),
    ),
}


def _loss(kind: str):
    solver, make = _SOLVERS[kind]

    def f(a, b):
        x = lx.linear_solve(make(a), b, solver=solver).value
        return jnp.sum(jnp.sin(x) * jnp.arange(1.0, 4.0))

    return f


def _args():
    rng = np.random.default_rng(3)
    return rng.standard_normal((3, 3)) + 3.0 * np.eye(3), rng.standard_normal(3)


@pytest.mark.parametrize("kind", list(_SOLVERS))
@pytest.mark.parametrize("argnums", [0, 1, (0, 1)])
def test_linear_solve_each_argument_alone(kind, argnums):
    f = _loss(kind)
    with jax.enable_x64(True):
        a, b = _args()
        want = jax.grad(f, argnums=argnums)(a, b)
        got = rf.grad(rf.lift(f), argnums=argnums)(a, b)
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-12), got, want)


@pytest.mark.parametrize("kind", list(_SOLVERS))
def test_linear_solve_finite_differences(kind):
    check_fd(rf.lift(_loss(kind)), _args(), argnums=(0, 1))


def _least_squares(shape, operator):
    """A QR least-squares (``shape`` tall) or minimum-norm (wide) solve; the
    operator a matrix or a matrix-free function of it."""
    m, n = shape

    def make(a):
        if operator == "matrix":
            return lx.MatrixLinearOperator(a)
        return lx.FunctionLinearOperator(lambda v: a @ v + 0.3 * jnp.tanh(a) @ v, jax.ShapeDtypeStruct((n,), a.dtype))

    def f(a, b):
        x = lx.linear_solve(make(a), b, solver=lx.QR()).value
        return jnp.sum(jnp.sin(x) * jnp.arange(1.0, n + 1))

    rng = np.random.default_rng(5)
    return f, (rng.standard_normal((m, n)), rng.standard_normal(m))


@pytest.mark.parametrize("operator", ["matrix", "function"])
@pytest.mark.parametrize("shape", [(5, 3), (3, 5)], ids=["tall", "wide"])
@pytest.mark.parametrize("argnums", [0, 1, (0, 1)])
def test_least_squares_each_argument_alone(shape, operator, argnums):
    """A full-rank non-square operator: the pseudo-inverse's further term (the
    residual's for a tall operator, the null space's for a wide one), against
    jax.grad (lineax's own JVP) and, with both arguments, finite differences; once
    refused by name, met in optimistix's Levenberg-Marquardt step inside jax-fdm's
    iterative solvers (fifteenth probe round)."""
    f, args = _least_squares(shape, operator)
    with jax.enable_x64(True):
        want = jax.grad(f, argnums=argnums)(*args)
        got = rf.grad(rf.lift(f), argnums=argnums)(*args)
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-9, atol=1e-12), got, want)
        got_jit = jax.jit(rf.grad(rf.lift(f), argnums=argnums))(*args)
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-9, atol=1e-12), got_jit, want)
    if argnums == (0, 1):
        check_fd(rf.lift(f), args, argnums=(0, 1))


def test_svd_solve_operator_gradient_is_refused_the_vector_taken():
    def f(a, b):
        return jnp.sum(lx.linear_solve(lx.MatrixLinearOperator(a), b, solver=lx.SVD()).value ** 2)

    a, b = _args()
    with pytest.raises(rf.AutogradError, match="SVD"):
        rf.grad(rf.lift(f), argnums=0)(a, b)
    with jax.enable_x64(True):
        got = rf.grad(rf.lift(f), argnums=1)(a, b)
        np.testing.assert_allclose(got, jax.grad(f, argnums=1)(a, b), rtol=1e-10)


def test_linear_solve_under_jit_and_vmap_around_the_gradient():
    f = _loss("lu")
    with jax.enable_x64(True):
        a, b = _args()
        bs = np.stack([b, 2.0 * b, -b])
        want = jax.vmap(jax.grad(f, argnums=(0, 1)), in_axes=(None, 0))(a, bs)
        got = jax.jit(jax.vmap(rf.grad(rf.lift(f), argnums=(0, 1)), in_axes=(None, 0)))(a, bs)
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-12), got, want)


def test_optimistix_root_find_implicit_gradient():
    def loss(p):
        fn = lambda y, p: jnp.tanh(y) * p[0] - p[1] + 0.1 * y  # noqa: E731
        return optx.root_find(fn, optx.Newton(1e-12, 1e-12), jnp.array(0.3), args=p).value ** 2

    with jax.enable_x64(True):
        p = jnp.array([1.5, 0.4])
        np.testing.assert_allclose(rf.grad(rf.lift(loss))(p), jax.grad(loss)(p), rtol=1e-10)
        check_fd(rf.lift(loss), (p,))


def test_diffrax_event_time_gradient():
    """y' = -y from y0 stops when y = 0.5: t* = log(2 y0), dt*/dy0 = 1 / y0."""

    def event_time(y0):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(lambda t, y, args: -y),
            diffrax.Tsit5(),
            0.0,
            10.0,
            0.1,
            y0,
            event=diffrax.Event(lambda t, y, args, **kw: y[0] - 0.5, root_finder=optx.Newton(1e-10, 1e-10)),
        )
        return sol.ts[-1]

    with jax.enable_x64(True):
        y0 = jnp.array([2.0])
        got = rf.grad(rf.lift(event_time))(y0)
        np.testing.assert_allclose(got, jax.grad(event_time)(y0), rtol=1e-8)
        np.testing.assert_allclose(got, [0.5], rtol=1e-5)


@pytest.mark.parametrize("shared", [False, True], ids=["batched_operator", "shared_operator"])
@pytest.mark.parametrize("argnums", [0, 1, (0, 1)])
def test_linear_solve_vmapped_inside_the_function(shared, argnums):
    """Under a jax.vmap inside the lifted function the solve is equinox's batched
    primitive (``vprim``): the rule runs per example, a shared operator's gradient
    summed over the batch."""

    def f(a, b):
        solve = lambda a, b: lx.linear_solve(lx.MatrixLinearOperator(a), b).value  # noqa: E731
        x = jax.vmap(solve, in_axes=(None if shared else 0, 0))(a, b)
        return jnp.sum(jnp.sin(x))

    rng = np.random.default_rng(5)
    a = rng.standard_normal((3, 3)) + 3.0 * np.eye(3)
    a = a if shared else np.stack([a, a.T, 2.0 * a])
    b = rng.standard_normal((3, 3))
    with jax.enable_x64(True):
        want = jax.grad(f, argnums=argnums)(a, b)
        got = rf.grad(rf.lift(f), argnums=argnums)(a, b)
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-12), got, want)


def test_an_operator_array_the_mv_reads_without_a_gradient_adds_nothing():
    """A matrix-free operator closing over an array its ``mv`` reads only through
    ``stop_gradient`` gives that array no term: jax's transpose leaves it a symbolic
    zero. With ``sqrt(x)`` as that array at ``x = 0``, the rule's zeros in its place
    made the gradient nan (``0 * inf``) where jax.grad's is finite."""

    def f(x):
        a, s = jnp.diag(x + 2.0), jnp.sqrt(x)
        mv = lambda v: a @ v + 0.0 * jax.lax.stop_gradient(s).sum()  # noqa: E731
        op = lx.FunctionLinearOperator(mv, jax.ShapeDtypeStruct((3,), x.dtype))
        return jnp.sum(lx.linear_solve(op, jnp.ones(3), solver=lx.LU()).value)

    with jax.enable_x64(True):
        x = jnp.array([0.0, 1.0, 4.0])
        want = np.asarray(jax.grad(f)(x))
        assert np.all(np.isfinite(want))
        for g in (rf.grad(rf.lift(f)), jax.jit(rf.grad(rf.lift(f)))):
            np.testing.assert_allclose(np.asarray(g(x)), want, rtol=1e-12)
