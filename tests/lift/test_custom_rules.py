"""Custom rules on the tape: ``custom_jvp`` rules honoured (rf's reverse walk over
the user's JVP rule, Note [Reverse mode from a custom JVP rule] in
``rumus_fx/lift/rules_custom.py``) and ``custom_vjp``'s symbolic-zeros protocol
(perturbed flags, symbolic-zero cotangents, ``None`` from ``bwd``, static
residuals). Every case against ``jax.grad`` of the same function and, in float64,
finite differences; each differentiable argument alone and all together.

The functions of jax.numpy / jax.nn / jax.scipy / lax defined with
``custom_jvp`` are checked in one sweep (slow); the default run keeps one case
per family and the values where the rule and the primal disagree (``relu`` at
0, ``frexp``, ``ldexp``, ``sinc``'s second derivative at 0).
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.custom_derivatives import SymbolicZero

import rumus_fx as rf
from rumus_fx.lift.tracing import clear_programs
from rumus_fx.testing import check_fd, check_grads


def _x64():
    return jax.enable_x64(True)


def _check(f, args, jit=False, fd=True, fd_tol=1e-6):
    """rf.grad(rf.lift(f)) against jax.grad(f): each argument alone, then all."""
    lifted = rf.lift(f)
    n = len(args)
    for nums in [*((k,) for k in range(n)), tuple(range(n))] if n > 1 else [0]:
        check_grads(lifted, args, nums, oracle=f, jit=jit, fd=fd, fd_tol=fd_tol, atol=1e-10, rtol=1e-10)


def _grad(f, jit=False, argnums=0):
    g = rf.grad(rf.lift(f), argnums=argnums)
    return jax.jit(g) if jit else g


# -- custom_jvp: values where the rule differs from the primal ------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_relu_at_zero_follows_the_rule(jit):
    f = lambda x: jnp.sum(jax.nn.relu(x))  # noqa: E731
    with _x64():
        x = jnp.array([0.0, 1.0, -1.0])
        np.testing.assert_array_equal(_grad(f, jit)(x), jax.grad(f)(x))
        np.testing.assert_array_equal(_grad(f, jit)(x), [0.0, 1.0, 0.0])


def test_frexp_and_ldexp_gradients_are_not_zero():
    with _x64():
        x = jnp.array([3.0, 0.7, -5.0, 12.5])
        fr = lambda x: jnp.sum(jnp.frexp(x)[0] * x)  # noqa: E731
        np.testing.assert_allclose(_grad(fr)(x), jax.grad(fr)(x), rtol=1e-12)
        _check(fr, (x,))
        ld = lambda x: jnp.sum(jnp.ldexp(x, jnp.array([3, -1, 0, 2])))  # noqa: E731
        np.testing.assert_allclose(_grad(ld)(x), [8.0, 0.5, 1.0, 4.0])
        _check(ld, (x,))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_sinc_second_derivative_at_zero(jit):
    f = lambda x: jnp.sinc(x)  # noqa: E731
    with _x64():
        gg = rf.grad(rf.grad(rf.lift(f)))
        if jit:
            gg = jax.jit(gg)
        np.testing.assert_allclose(gg(jnp.array(0.0)), -(np.pi**2) / 3, rtol=1e-12)
        np.testing.assert_allclose(gg(jnp.array(0.3)), jax.grad(jax.grad(f))(0.3), rtol=1e-10)
        _check(lambda x: jnp.sum(jnp.sinc(x)), (jnp.array([0.0, 0.3, -1.2]),), jit=jit)


def test_rule_not_primal_defines_the_gradient():
    """A rule that disagrees with its primal (derivative 3 for the identity): rf follows the rule."""

    @jax.custom_jvp
    def f(x):
        return x

    f.defjvp(lambda p, t: (f(p[0]), 3.0 * t[0]))
    g = lambda x: jnp.sum(f(jnp.sin(x)))  # noqa: E731
    with _x64():
        x = jnp.array([0.2, -0.4])
        np.testing.assert_allclose(_grad(g)(x), 3 * jnp.cos(x), rtol=1e-12)
        np.testing.assert_allclose(_grad(g, jit=True)(x), jax.grad(g)(x), rtol=1e-12)


# -- custom_jvp: the protocol -------------------------------------------------------------


def test_symbolic_zeros_jvp_rule_gets_markers():
    seen = []

    @jax.custom_jvp
    def k(x, y):
        return x * y

    def k_jvp(p, t):
        x, y = p
        dx, dy = t
        seen.append((type(dx) is SymbolicZero, type(dy) is SymbolicZero))
        dx = jnp.zeros_like(x) if type(dx) is SymbolicZero else dx
        dy = jnp.zeros_like(y) if type(dy) is SymbolicZero else dy
        return k(x, y), 3.0 * (dx * y + x * dy)

    k.defjvp(k_jvp, symbolic_zeros=True)
    f = lambda x, y: jnp.sum(k(x, y))  # noqa: E731
    with _x64():
        x, y = jnp.array([0.5, -1.0]), jnp.array([2.0, 0.25])
        seen.clear()
        np.testing.assert_allclose(_grad(f)(x, y), 3 * y)
        assert (False, True) in seen  # y carries no gradient: a marker, as jax.grad gives
        np.testing.assert_allclose(_grad(f, argnums=1)(x, y), jax.grad(f, argnums=1)(x, y))
        g = _grad(f, argnums=(0, 1))(x, y)
        chex.assert_trees_all_close(g, jax.grad(f, argnums=(0, 1))(x, y))


@jax.custom_jvp
def _inner(x):
    return jnp.exp(x)


_inner.defjvp(lambda p, t: (_inner(p[0]), 2.0 * _inner(p[0]) * t[0]))  # (not exp's own derivative)


@jax.custom_jvp
def _outer(x, y):
    return _inner(x) * y


@_outer.defjvp
def _outer_jvp(p, t):
    x, y = p
    dx, dy = t
    return _outer(x, y), _inner(x) * (dx * y + dy) + jnp.sin(x) * dx


def test_nested_custom_rules_first_and_second_order():
    f = lambda x, y: jnp.sum(_outer(x, y) * x)  # noqa: E731
    with _x64():
        x, y = jnp.array([0.3, -0.2]), jnp.array([1.5, 0.5])
        for nums in (0, 1, (0, 1)):
            chex.assert_trees_all_close(_grad(f, argnums=nums)(x, y), jax.grad(f, argnums=nums)(x, y), rtol=1e-12)
        h = lambda x: jnp.sum(jnp.cos(jax.grad(f)(x, y)))  # noqa: E731
        cos_sum = rf.lift(lambda g: jnp.sum(jnp.cos(g)))
        hr = lambda x: cos_sum(rf.grad(rf.lift(f))(x, y))  # noqa: E731
        np.testing.assert_allclose(rf.grad(hr)(x), jax.grad(h)(x), rtol=1e-10)


@jax.custom_jvp
def _transform(box, r):
    return r * box


@_transform.defjvp
def _transform_jvp(primals, tangents):
    box, r = primals
    dbox, dr = tangents
    return _transform(box, r), dr + _transform(dbox, r)  # the rule calls its own function


def _energy(box, r):
    d = lambda ra, rb: _transform(box, ra - rb)  # noqa: E731
    return jnp.sum(jax.vmap(jax.vmap(d, (None, 0)), (0, None))(r, r) ** 2)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_custom_jvp_rule_calling_its_own_function(jit):
    """A JVP rule that calls its own custom_jvp function on the tangents: rf
    unfolded the rule inside itself until Python's recursion limit. The call on
    the tangents runs as its primal, as in jax's linearisation (the rule says
    ``dr`` where the primal's derivative is ``box dr``; they agree at ``box = 1``,
    where finite differences check it)."""
    with _x64():
        r = jnp.asarray(np.random.default_rng(3).uniform(size=(4, 2)))
        _check(_energy, (jnp.asarray(1.0), r), jit=jit)
        box = jnp.asarray(1.3)
        _check(_energy, (box, r), jit=jit, fd=False)


_W = np.array([0.3, -0.4, 1.1])


@jax.custom_vjp
def _scaled_product(a, b):
    return a * b * jnp.asarray(_W, a.dtype)  # closes over a constant: the call's num_consts is 1


def _scaled_product_fwd(a, b):
    return _scaled_product(a, b), (b, a)  # both inputs as residuals, in the other order


def _scaled_product_bwd(res, ct):
    b, a = res
    w = jnp.asarray(_W, ct.dtype)
    return b * w * ct, a * w * ct


_scaled_product.defvjp(_scaled_product_fwd, _scaled_product_bwd)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_custom_vjp_with_constants_forwarding_its_inputs(jit):
    """A custom_vjp function closing over an array constant whose fwd returns its
    inputs as residuals: jax numbers such a forwarded residual among the call's
    inputs, constants first; rf read it among the arguments alone, so it handed the
    bwd the wrong input (a silent wrong gradient) or failed with an IndexError
    (``jax.experimental.ode.odeint``)."""
    f = lambda a, b: jnp.sum(jnp.sin(_scaled_product(a, b)))  # noqa: E731
    with _x64():
        a, b = jnp.array([1.0, 2.0, -0.5]), jnp.array([0.5, -1.5, 2.0])
        _check(f, (a, b), jit=jit)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_custom_vjp_integer_output_gets_a_float0_cotangent(jit):
    """A custom_vjp (or ``jax.custom_gradient``) function with an integer output:
    its bwd gets the cotangent jax gives, float0 zeros (rf gave int32 zeros, which a
    ``jax.custom_gradient`` bwd refuses with an AssertionError)."""

    @jax.custom_vjp
    def split(x):
        return x * 2.0, jnp.round(x).astype(jnp.int32)

    def split_bwd(_, g):
        assert g[1].dtype == jax.dtypes.float0, g[1].dtype
        return (g[0] * 2.0,)

    split.defvjp(lambda x: (split(x), None), split_bwd)

    @jax.custom_gradient
    def pair(x):
        return (x, jnp.round(x).astype(jnp.int32)), lambda g: jnp.ones_like(x)

    with _x64():
        x = jnp.array([0.3, 1.7, -2.0])
        for f in (lambda x: jnp.sum(jnp.sin(split(x)[0])), lambda x: jnp.sum(pair(pair(x)[0])[0] * x)):
            _check(f, (x,), jit=jit, fd=False)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_checkify_of_custom_rules(jit):
    """``checkify`` gives a custom_jvp call its error flag and code as two more
    outputs, first, and leaves the JVP rule as written: rf paired the rule's one
    tangent with the flag's cotangent and returned 0 for ``sin``'s gradient, with no
    error. The rule's outputs are now matched with the call's last ones (the extra
    ones carry no gradient). A checkified custom_vjp function, whose fwd has the
    same mismatch, is refused (jax.grad under jax.jit fails on both)."""
    from jax.experimental import checkify

    @jax.custom_jvp
    def sin(x):
        return jnp.sin(x)

    sin.defjvp(lambda p, t: (sin(p[0]), jnp.cos(p[0]) * t[0]))
    checked = checkify.checkify(sin, errors=checkify.float_checks)
    f = lambda x: jnp.sum(checked(x)[1] * x)  # noqa: E731
    with _x64():
        x = jnp.array([3.0, -0.7])
        _check(f, (x,), jit=jit)

        @jax.custom_vjp
        def sin2(x):
            return jnp.sin(x)

        sin2.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (jnp.cos(x) * g,))

        def h(x):
            checkify.check(True, "")
            return sin2(x)

        checked2 = checkify.checkify(h)
        with pytest.raises(
            rf.AutogradError, match=r"fwd of jax\.custom_vjp 'sin2' returns 1 outputs where the call has 3"
        ):
            _grad(lambda x: jnp.sum(checked2(x)[1]), jit)(x)


@pytest.mark.slow
def test_odeint_gradient():
    """``jax.experimental.ode.odeint``: a custom_vjp over a while loop, closing over
    the time grid; each argument alone and both, against jax.grad and finite
    differences."""
    from jax.experimental.ode import odeint

    def f(y0, k):
        ys = odeint(lambda y, t, k: -k * y + jnp.sin(t), y0, jnp.array([0.0, 0.5, 1.0]), k, rtol=1e-10, atol=1e-10)
        return jnp.sum(ys**2)

    with _x64():
        _check(f, (jnp.array([1.0, 2.0]), jnp.asarray(0.3)), fd_tol=1e-5)


def _closing_rule(x, w, scan: bool):
    @jax.custom_jvp
    def scaled(v):
        return jnp.tanh(v) * w

    @scaled.defjvp
    def scaled_jvp(p, t):
        return scaled(p[0]), 2.0 * w * t[0]  # closes over w (not differentiated)

    if not scan:
        return jnp.sum(jax.jit(scaled)(x * x))

    def body(c, xi):
        return c + jax.jit(scaled)(xi * c), None

    return jnp.sum(lax.scan(body, x, jnp.arange(3.0))[0])


def test_custom_jvp_under_jit_closing_over_a_value():
    f = functools.partial(_closing_rule, scan=False)
    with _x64():
        x, w = jnp.array([0.1, 0.4]), jnp.array([0.5, 2.0])
        np.testing.assert_allclose(_grad(f)(x, w), 4 * w * x, rtol=1e-12)
        np.testing.assert_allclose(_grad(f, jit=True)(x, w), jax.grad(f)(x, w), rtol=1e-12)


@pytest.mark.parametrize("full", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["grad", "full"])
def test_custom_jvp_in_scan(full):
    def f(x, w):
        def body(c, xi):
            return c + jnp.sinc(xi * c) * w + jax.nn.relu(c - xi), None

        return jnp.sum(lax.scan(body, x, jnp.arange(3.0))[0])

    with _x64():
        x, w = jnp.array([0.1, -0.3]), jnp.array([0.5, 2.0])
        if full:
            _check(f, (x, w))
        x0 = jnp.array([0.0, 1.0])  # relu's and sinc's rules at 0 (no finite differences there)
        chex.assert_trees_all_close(_grad(f, argnums=(0, 1))(x0, w), jax.grad(f, argnums=(0, 1))(x0, w))


def test_custom_jvp_in_scan_and_cond_closing_over_a_value():
    f = functools.partial(_closing_rule, scan=True)

    def g(x, w):
        @jax.custom_jvp
        def h(v):
            return jnp.sin(v) * w

        h.defjvp(lambda p, t: (h(p[0]), 3.0 * w * t[0]))
        return jnp.sum(lax.cond(x[0] > 0, lambda v: jax.checkpoint(h)(v * v), lambda v: v, x))

    with _x64():
        x, w = jnp.array([0.1, 0.4]), jnp.array([0.5, 2.0])
        for fun in (f, g):
            np.testing.assert_allclose(_grad(fun)(x, w), jax.grad(fun)(x, w), rtol=1e-12)
            np.testing.assert_allclose(_grad(fun, jit=True)(x, w), jax.grad(fun)(x, w), rtol=1e-12)
        np.testing.assert_allclose(_grad(g)(x, w), 6 * w * x, rtol=1e-12)


def test_custom_jvp_rule_alone_closing_over_a_value_outside_a_scan_body_raises():
    """A known limit, loud: only the rule uses a value from outside the scan body
    (it never reaches the body); jax.grad can."""

    def f(x, w):
        @jax.custom_jvp
        def g(v):
            return jnp.tanh(v)

        g.defjvp(lambda p, t: (g(p[0]), w * t[0]))
        return jnp.sum(lax.scan(lambda c, _: (g(c), None), x, None, length=2)[0])

    x = jnp.array([0.1, 0.4])
    jax.grad(f)(x, x)
    with pytest.raises(rf.AutogradError, match="pass the value to the custom_jvp function as an argument"):
        rf.grad(rf.lift(f))(x, x)


def test_vmap_of_the_gradient():
    f = lambda x: jnp.sum(jax.nn.relu(x) * jnp.sinc(x))  # noqa: E731
    with _x64():
        xs = jnp.array([[0.0, 1.0], [2.0, -1.0], [0.5, 0.0]])
        np.testing.assert_allclose(jax.vmap(_grad(f))(xs), jax.vmap(jax.grad(f))(xs), rtol=1e-12)


def test_custom_jvp_closing_over_a_tracked_value_raises():
    def f(x, w):
        @jax.custom_jvp
        def g(v):
            return jnp.sin(v) * w

        g.defjvp(lambda p, t: (g(p[0]), jnp.cos(p[0]) * t[0]))
        return jnp.sum(g(x))

    x = jnp.ones(2)
    with pytest.raises(rf.AutogradError, match="closes over a tracked value"):
        rf.grad(rf.lift(f), argnums=1)(x, x)


def test_equinox_filter_custom_jvp_in_scan():
    eqx = pytest.importorskip("equinox")

    @eqx.filter_custom_jvp
    def f(x, y, fn):
        return fn(x) * y

    @f.def_jvp
    def f_jvp(primals, tangents):
        x, y, fn = primals
        tx, ty, _ = tangents  # None: a symbolic zero
        tx = jnp.zeros_like(x) if tx is None else tx
        ty = jnp.zeros_like(y) if ty is None else ty
        return f(x, y, fn), 2.0 * (jnp.cos(x) * y * tx + fn(x) * ty)  # twice the primal's derivative

    def loss(x, y):
        return jnp.sum(lax.scan(lambda c, _: (c + f(c, y, jnp.sin), None), x, None, length=3)[0])

    with _x64():
        x, y = jnp.array([0.3, 0.5]), jnp.array([1.5, -2.0])
        for nums in (0, 1, (0, 1)):
            want = jax.grad(loss, argnums=nums)(x, y)
            chex.assert_trees_all_close(_grad(loss, argnums=nums)(x, y), want, rtol=1e-12)
            chex.assert_trees_all_close(_grad(loss, True, nums)(x, y), want, rtol=1e-12)


# -- lax.custom_root and lax.custom_linear_solve ----------------------------------------


def _newton_sqrt(a):
    def f(x):
        return x**2 - a

    def solve(f, x0):
        return lax.while_loop(lambda s: jnp.max(jnp.abs(f(s))) > 1e-12, lambda s: s - f(s) / (2 * s), x0)

    return lax.custom_root(f, jnp.ones_like(a), solve, lambda g, y: y / g(jnp.ones_like(y)))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_custom_root_with_iterative_solver(jit):
    f = lambda a: _newton_sqrt(a) * a  # noqa: E731
    with _x64():
        a = jnp.array(2.0)
        np.testing.assert_allclose(_grad(f, jit)(a), 1.5 * np.sqrt(2.0), rtol=1e-10)
        np.testing.assert_allclose(_grad(f, jit)(a), jax.grad(f)(a), rtol=1e-12)
        gg = rf.grad(rf.grad(rf.lift(f)))
        np.testing.assert_allclose(gg(a), jax.grad(jax.grad(f))(a), rtol=1e-10)


def _richardson(matvec, b):
    """An iterative solver (a while_loop): x <- x + (b - A x) / 4."""

    def body(s):
        return s + (b - matvec(s)) / 4.0

    return lax.while_loop(lambda s: jnp.max(jnp.abs(b - matvec(s))) > 1e-13, body, jnp.zeros_like(b))


def test_custom_linear_solve_with_iterative_solver():
    def f(m, b):
        a = m @ m.T + 3.0 * jnp.eye(3)
        x = lax.custom_linear_solve(lambda v: a @ v, b, _richardson, symmetric=True)
        return jnp.sum(jnp.sin(x))

    with _x64():
        m = jnp.array([[0.5, 0.1, -0.2], [0.3, 0.6, 0.0], [-0.4, 0.2, 0.5]])
        b = jnp.array([1.0, -0.5, 0.25])
        chex.assert_trees_all_close(_grad(f, argnums=(0, 1))(m, b), jax.grad(f, argnums=(0, 1))(m, b), rtol=1e-10)


@pytest.mark.slow
def test_custom_linear_solve_with_iterative_solver_each_argument_and_fd():
    def f(m, b):
        a = m @ m.T + 3.0 * jnp.eye(3)
        return jnp.sum(jnp.sin(lax.custom_linear_solve(lambda v: a @ v, b, _richardson, symmetric=True)))

    with _x64():
        m = jnp.array([[0.5, 0.1, -0.2], [0.3, 0.6, 0.0], [-0.4, 0.2, 0.5]])
        b = jnp.array([1.0, -0.5, 0.25])
        _check(f, (m, b), fd_tol=1e-5)


# -- custom_vjp: symbolic zeros, None, static residuals ---------------------------------


@jax.custom_vjp
def _scaled_mul(x, y):
    return x * y


def _scaled_mul_fwd(x, y):
    return x * y, (y, True, 3)  # a Python bool and int among the residuals


def _scaled_mul_bwd(res, g):
    y, flag, k = res
    assert isinstance(flag, bool)  # a static value, as jax.grad gives it
    return (g * y * k if flag else g, None)  # None: a zero cotangent for y


_scaled_mul.defvjp(_scaled_mul_fwd, _scaled_mul_bwd)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_custom_vjp_none_cotangent_and_static_residuals(jit):
    f = lambda x, y: jnp.sum(_scaled_mul(x, y))  # noqa: E731
    with _x64():
        x, y = jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
        for nums in (0, 1, (0, 1)):
            chex.assert_trees_all_close(_grad(f, jit, nums)(x, y), jax.grad(f, argnums=nums)(x, y))
        np.testing.assert_allclose(_grad(f, jit)(x, y), 3 * y)


_PERTURBED: list = []
_CTS: list = []


@jax.custom_vjp
def _sz(x, y):
    return jnp.sin(x) * y, x + y


def _sz_fwd(x, y):
    _PERTURBED.append((x.perturbed, y.perturbed))
    # a fwd that trusts the flags: nothing saved for an unperturbed input
    return _sz(x.value, y.value), (x.value, y.value, x.perturbed, y.perturbed)


def _sz_bwd(res, g):
    x, y, px, py = res
    g1, g2 = g
    _CTS.append((type(g1) is SymbolicZero, type(g2) is SymbolicZero))
    g1 = jnp.zeros_like(x) if type(g1) is SymbolicZero else g1
    g2 = jnp.zeros_like(x) if type(g2) is SymbolicZero else g2
    gx = jnp.cos(x) * y * g1 + g2 if px else None
    gy = jnp.sin(x) * g1 + g2 if py else SymbolicZero(jax.typeof(y).to_tangent_aval())
    return gx, gy


_sz.defvjp(_sz_fwd, _sz_bwd, symbolic_zeros=True)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_custom_vjp_symbolic_zeros_protocol(jit):
    f = lambda x, y: jnp.sum(_sz(x, y)[0])  # noqa: E731
    with _x64():
        x, y = jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
        _PERTURBED.clear()
        _CTS.clear()
        clear_programs()  # fwd and bwd record what they are given while traced: trace anew here
        got = _grad(f, jit)(x, y)
        assert _PERTURBED and all(p == (True, False) for p in _PERTURBED)
        assert _CTS and all(c == (False, True) for c in _CTS)  # the unused output's cotangent: a marker
        np.testing.assert_allclose(got, jax.grad(f)(x, y))
        assert float(jnp.max(jnp.abs(got))) > 0.1
        for nums in (1, (0, 1)):
            chex.assert_trees_all_close(_grad(f, jit, nums)(x, y), jax.grad(f, argnums=nums)(x, y))
        g2 = lambda x, y: jnp.sum(_sz(x, y)[0] * _sz(x, y)[1])  # noqa: E731
        chex.assert_trees_all_close(_grad(g2, jit, (0, 1))(x, y), jax.grad(g2, argnums=(0, 1))(x, y))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_equinox_filter_custom_vjp(jit):
    eqx = pytest.importorskip("equinox")

    @eqx.filter_custom_vjp
    def e(vjp_arg, w, scale):
        (x,) = vjp_arg
        return jnp.sin(x) * w * scale

    @e.def_fwd
    def e_fwd(perturbed, vjp_arg, w, scale):
        return e(vjp_arg, w, scale), None

    @e.def_bwd
    def e_bwd(res, g, perturbed, vjp_arg, w, scale):
        (x,) = vjp_arg
        return (jnp.cos(x) * w * scale * g,)

    f = lambda x, w: jnp.sum(e((x,), w, 2.0))  # noqa: E731
    with _x64():
        x, w = jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
        got = _grad(f, jit)(x, w)
        np.testing.assert_allclose(got, jax.grad(f)(x, w))
        np.testing.assert_allclose(got, 2 * jnp.cos(x) * w)


# -- the library's custom_jvp functions -------------------------------------------------

_P = np.array([0.3, 1.7, 0.9])  # positive
_R = np.array([-0.8, 0.4, 1.3])  # real
_U = np.array([0.2, 0.55, 0.85])  # in (0, 1)
_M = np.array([[1.2, 0.3, -0.1], [0.2, 0.9, 0.4], [-0.3, 0.1, 1.1]])

# (name, function, arguments, finite-difference tolerance or None for no fd check)
LIBRARY = [
    ("jax.nn.relu", lambda x: jnp.sum(jax.nn.relu(x) * x), (_R,), 1e-6),
    ("jax.nn.relu6", lambda x: jnp.sum(jax.nn.relu6(3 * x)), (_R,), 1e-6),
    ("jax.nn.softmax", lambda x: jnp.sum(jax.nn.softmax(x) * jnp.arange(3.0)), (_R,), 1e-6),
    ("jax.nn.log_softmax", lambda x: jnp.sum(jax.nn.log_softmax(x) * jnp.arange(3.0)), (_R,), 1e-6),
    ("jax.nn.logsumexp", lambda x: jax.nn.logsumexp(x), (_R,), 1e-6),
    ("jax.nn.softplus", lambda x: jnp.sum(jax.nn.softplus(x)), (_R,), 1e-6),
    ("jax.nn.silu", lambda x: jnp.sum(jax.nn.silu(x)), (_R,), 1e-6),
    ("jax.nn.gelu", lambda x: jnp.sum(jax.nn.gelu(x)), (_R,), 1e-6),
    ("jax.nn.gelu_exact", lambda x: jnp.sum(jax.nn.gelu(x, approximate=False)), (_R,), 1e-6),
    ("jax.nn.elu", lambda x: jnp.sum(jax.nn.elu(x)), (_R,), 1e-6),
    ("jax.nn.celu", lambda x: jnp.sum(jax.nn.celu(x)), (_R,), 1e-6),
    ("jax.nn.log_sigmoid", lambda x: jnp.sum(jax.nn.log_sigmoid(x)), (_R,), 1e-6),
    ("jax.nn.log1mexp", lambda x: jnp.sum(jax.nn.log1mexp(x)), (_P,), 1e-6),
    ("jax.nn.standardize", lambda x: jnp.sum(jax.nn.standardize(x) * jnp.arange(3.0)), (_R,), 1e-6),
    ("jnp.logaddexp", lambda x, y: jnp.sum(jnp.logaddexp(x, y)), (_R, _P), 1e-6),
    ("jnp.logaddexp2", lambda x, y: jnp.sum(jnp.logaddexp2(x, y)), (_R, _P), 1e-6),
    ("jnp.sinc", lambda x: jnp.sum(jnp.sinc(x)), (_R,), 1e-6),
    ("jnp.frexp", lambda x: jnp.sum(jnp.frexp(x)[0] * x), (_R,), 1e-6),
    ("jnp.ldexp", lambda x: jnp.sum(jnp.ldexp(x, 2)), (_R,), 1e-6),
    ("jnp.i0", lambda x: jnp.sum(jnp.i0(x)), (_R,), 1e-6),
    ("jnp.linalg.det", lambda m: jnp.linalg.det(m), (_M,), 1e-6),
    ("jnp.linalg.slogdet", lambda m: jnp.linalg.slogdet(m)[1], (_M,), 1e-6),
    ("jnp.linalg.pinv", lambda m: jnp.sum(jnp.linalg.pinv(m) ** 2), (_M,), 1e-5),
    ("jnp.linalg.norm", lambda m: jnp.linalg.norm(m, 2), (_M,), 1e-5),
    ("scipy.logsumexp", lambda x: jax.scipy.special.logsumexp(x, b=jnp.array([1.0, 2.0, 0.5])), (_R,), 1e-6),
    ("scipy.xlogy", lambda x, y: jnp.sum(jax.scipy.special.xlogy(x, y)), (_R, _P), 1e-6),
    ("scipy.xlog1py", lambda x, y: jnp.sum(jax.scipy.special.xlog1py(x, y)), (_R, _P), 1e-6),
    ("scipy.entr", lambda x: jnp.sum(jax.scipy.special.entr(x)), (_P,), 1e-6),
    ("scipy.expit", lambda x: jnp.sum(jax.scipy.special.expit(x)), (_R,), 1e-6),
    ("scipy.logit", lambda x: jnp.sum(jax.scipy.special.logit(x)), (_U,), 1e-6),
    ("scipy.log_ndtr", lambda x: jnp.sum(jax.scipy.special.log_ndtr(x)), (_R,), 1e-6),
    ("scipy.ndtri", lambda x: jnp.sum(jax.scipy.special.ndtri(x)), (_U,), 1e-6),
    ("scipy.erfcx", lambda x: jnp.sum(jax.scipy.special.erfcx(x)), (_R,), 1e-6),
    ("scipy.erf", lambda x: jnp.sum(jax.scipy.special.erf(x) * jax.scipy.special.erfc(x)), (_R,), 1e-6),
    ("scipy.dawsn", lambda x: jnp.sum(jax.scipy.special.dawsn(x)), (_R,), 1e-6),
    ("scipy.expi", lambda x: jnp.sum(jax.scipy.special.expi(x)), (_P,), 1e-6),
    ("scipy.sici", lambda x: jnp.sum(sum(jax.scipy.special.sici(x))), (_P,), 1e-6),
    ("scipy.kl_div", lambda x, y: jnp.sum(jax.scipy.special.kl_div(x, y)), (_P, _U), 1e-6),
    ("scipy.rel_entr", lambda x, y: jnp.sum(jax.scipy.special.rel_entr(x, y)), (_P, _U), 1e-6),
    ("scipy.i0e", lambda x: jnp.sum(jax.scipy.special.i0e(x) + jax.scipy.special.i1e(x)), (_R,), 1e-6),
    ("scipy.poch", lambda z: jnp.sum(jax.scipy.special.poch(z, jnp.array([1.5, 2.0, 0.5]))), (_P,), 1e-5),
    ("scipy.hyp1f1", lambda x: jnp.sum(jax.scipy.special.hyp1f1(1.5, 2.5, x)), (_U,), 1e-6),
    ("scipy.hyp2f1", lambda x: jnp.sum(jax.scipy.special.hyp2f1(0.5, 1.5, 2.5, x)), (_U,), 1e-6),
    ("scipy.owens_t", lambda h, a: jnp.sum(jax.scipy.special.owens_t(h, a)), (_R, _P), 1e-6),
    ("scipy.zeta", lambda q: jnp.sum(jax.scipy.special.zeta(3.0, q)), (_P,), 1e-5),
    ("lax.custom_root", lambda a: jnp.sum(_newton_sqrt(a) * a), (_P,), 1e-6),
]
# one fast case per family (nn, ufuncs, scipy.special, linalg, lax); the sweep is slow
FAST = {"jax.nn.softmax", "jnp.logaddexp", "scipy.xlogy", "jnp.linalg.det", "lax.custom_root"}


# functions whose own code mixes dtypes or ranks (the suite's strict settings refuse it)
LOOSE = {"scipy.hyp1f1", "scipy.hyp2f1", "scipy.owens_t", "scipy.zeta"}


def _library_params():
    for name, f, args, tol in LIBRARY:
        marks = () if name in FAST else (pytest.mark.slow,)
        yield pytest.param(name, f, args, tol, id=name, marks=marks)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name, f, args, tol", list(_library_params()))
def test_library_custom_jvp_functions(name, f, args, tol, jit):
    loose = name in LOOSE
    with (
        _x64(),
        jax.numpy_dtype_promotion("standard" if loose else "strict"),
        jax.numpy_rank_promotion("allow" if loose else "raise"),
    ):
        _check(f, tuple(jnp.asarray(a) for a in args), jit=jit, fd=tol is not None, fd_tol=tol or 1e-6)


@pytest.mark.slow
def test_library_second_order_sample():
    """Second order through a library rule (softplus, log_softmax): the recorded
    reverse walk over the rule differentiates again."""
    f = lambda x: jnp.sum(jax.nn.log_softmax(x) * jnp.arange(3.0)) + jnp.sum(jax.nn.softplus(x) ** 2)  # noqa: E731
    with _x64():
        x = jnp.asarray(_R)
        h = functools.partial(jnp.dot, jnp.array([0.5, -1.0, 2.0]))
        got = rf.grad(lambda x: rf.lift(h)(rf.grad(rf.lift(f))(x)))(x)
        np.testing.assert_allclose(got, jax.grad(lambda x: h(jax.grad(f)(x)))(x), rtol=1e-10)


def _fwd_closure(a, y):
    w = jnp.sin(y)  # computed in the function: the primal and the fwd close over it

    @jax.custom_vjp
    def scaled(v):
        return v * w

    scaled.defvjp(lambda v: (v * w, (v, w)), lambda res, g: (g * res[1],))
    return jnp.sum(scaled(a) ** 2 * y)


def _bwd_closure(a, y):
    w = jnp.sin(y)

    @jax.custom_vjp
    def scaled(v):
        return v * w

    scaled.defvjp(lambda v: (v * w, None), lambda res, g: (g * w,))  # the bwd reads w itself
    return jnp.sum(scaled(a) ** 2)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_custom_vjp_fwd_closing_over_a_value_of_the_function(jit):
    """The fwd reads a value computed in the lifted function (w = sin(y)): it
    becomes an input of the call (jax.grad accepts the program). y alone, whose
    value the primal closes over, is refused, as jax.grad refuses it."""
    with _x64():
        a, y = jnp.array([1.0, 2.0, -0.5]), jnp.array([0.3, -0.4, 1.1])
        check_grads(rf.lift(_fwd_closure), (a, y), 0, oracle=_fwd_closure, jit=jit, atol=1e-10, rtol=1e-10)
        with pytest.raises(rf.AutogradError, match="closes over a tracked value"):
            rf.grad(rf.lift(_fwd_closure), argnums=1)(a, y)
        np.testing.assert_allclose(jax.grad(_bwd_closure)(a, y), 2 * a * jnp.sin(y) ** 2)  # jax.grad eagerly
        with pytest.raises(rf.AutogradError, match=r"custom_vjp bwd that closes over a value computed.*residual"):
            rf.grad(rf.lift(_bwd_closure))(a, y)


def _nested_fwd_closure(a, y):
    c = jnp.sum(jnp.sin(y))  # read by both fwds, which return it as their residual

    @jax.custom_vjp
    def inner(v):
        return v * c

    inner.defvjp(lambda v: (v * c, c), lambda r, g: (g * r,))

    @jax.custom_vjp
    def outer(v):
        return jnp.tanh(inner(v))

    outer.defvjp(lambda v: (jnp.tanh(inner(v)), (c, v)), lambda r, g: (g * r[0] / jnp.cosh(r[0] * r[1]) ** 2,))
    return jnp.sum(outer(a) ** 2)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_custom_vjp_fwd_calling_a_custom_vjp_whose_fwd_closes_over_a_value(jit):
    """jaxopt's solvers built inside the function: a custom_vjp whose fwd calls
    another custom_vjp, whose own Python fwd reads a value the function computed.
    rf.grad follows the rules (jax.grad of jax.jit of the function fails on it).
    Under a JAX transformation around rf (jax.grad of a function that calls
    rf.value_and_grad) JAX traces the inner fwd again after the function's trace is
    over: refused by name, not JAX's leaked-tracer error."""
    with _x64():
        a, y = jnp.array([0.4, -0.2, 0.1]), jnp.array([0.3, 1.2])
        check_grads(
            rf.lift(_nested_fwd_closure), (a, y), 0, oracle=_nested_fwd_closure, jit=jit, atol=1e-10, rtol=1e-10
        )
        with pytest.raises(TypeError, match="constant handler"):
            jax.grad(jax.jit(_nested_fwd_closure))(a, y)  # jax's own limit
        value = lambda x: rf.value_and_grad(rf.lift(_nested_fwd_closure))(x, y)[0]  # noqa: E731
        np.testing.assert_allclose(value(a), _nested_fwd_closure(a, y), rtol=1e-12)
        for around in (jax.grad, lambda f: lambda x: jax.jvp(f, (x,), (x,))):
            with pytest.raises(rf.AutogradError, match=r"fwd of jax\.custom_vjp 'outer' calls a jax\.custom_vjp"):
                around(value)(a)
        with pytest.raises(rf.AutogradError, match="closes over a traced value"):
            rf.grad(value)(a)  # rf around rf: the inner fwd is traced again too


def _nested_jvp_rule_closure(a, y):
    c = jnp.sum(jnp.sin(y))

    @jax.custom_jvp
    def inner(v):
        return v * c

    inner.defjvp(lambda p, t: (p[0] * c, t[0] * c))  # the JVP rule reads c

    @jax.custom_vjp
    def outer(v):
        return jnp.tanh(inner(v))

    outer.defvjp(lambda v: (jnp.tanh(inner(v)), (c, v)), lambda r, g: (g * r[0] / jnp.cosh(r[0] * r[1]) ** 2,))
    return jnp.sum(outer(a) ** 2)


def test_custom_vjp_fwd_calling_a_custom_jvp_whose_rule_closes_over_a_value():
    """As above with a custom_jvp inside the fwd: rf.grad follows the rules; under
    jax.grad around rf its JVP rule is traced again, refused by name."""
    with _x64():
        a, y = jnp.array([0.4, -0.2, 0.1]), jnp.array([0.3, 1.2])
        f = _nested_jvp_rule_closure
        check_grads(rf.lift(f), (a, y), 0, oracle=f, atol=1e-10, rtol=1e-10)
        with pytest.raises(rf.AutogradError, match=r"fwd of jax\.custom_vjp 'outer' calls a .*JVP rule"):
            jax.grad(lambda x: rf.value_and_grad(rf.lift(f))(x, y)[0])(a)


@pytest.mark.parametrize("through_a_converter", [False, True])
def test_custom_vjp_bwd_returning_an_extended_tangent_dtype_is_refused(through_a_converter):
    """A bwd may return a cotangent of a custom tangent dtype (jax's extended dtypes,
    accumulated by the dtype's own ``add``, here a max). rf's tape keeps gradients in
    their input's dtype: it cast such a cotangent to float32 and summed, a wrong
    gradient where nothing read the dtype back (2.0 here, jax.grad's is the max, 1.0),
    and crashed in the user's code where a second rule did. Refused by name."""
    import dataclasses

    from jax._src import core as jax_core
    from jax._src import dtypes as jax_dtypes

    class scale(jax_dtypes.extended):
        pass

    class Rules:
        allow_conversion = True

        @staticmethod
        def physical_element_aval(dtype):
            return jax_core.ShapedArray((), dtype.float_dtype)

        @staticmethod
        def add(dt, x, y):
            as_float = functools.partial(lax.convert_element_type, new_dtype=dt.float_dtype)
            return lax.convert_element_type(lax.max(as_float(x), as_float(y)), dt)

        @staticmethod
        def zero(dt):
            return lax.convert_element_type(np.array(-np.inf, dt.float_dtype), dt)

    @dataclasses.dataclass(frozen=True)
    class ScaleTy(jax_dtypes.ExtendedDType):
        float_dtype: Any
        name: str = "scale"
        _rules: type = Rules
        type: type = scale

    @jax.custom_vjp
    def g(x):
        return x

    g.defvjp(lambda x: (x, None), lambda _, ct: (lax.convert_element_type(ct, ScaleTy(jnp.float32)),))

    @jax.custom_vjp
    def convert(x):
        return x

    convert.defvjp(lambda x: (x, None), lambda _, ct: (lax.convert_element_type(ct, ct.dtype.float_dtype),))

    def f(x):
        x = convert(x) if through_a_converter else x
        return g(x) + g(x)

    x = jnp.array(3.0)
    if through_a_converter:
        assert jax.grad(jax.jit(f))(x) == 1.0  # the max of the two cotangents, not their sum
    with pytest.raises(rf.AutogradError, match=r"custom_vjp bwd of g returned a cotangent of the extended dtype"):
        rf.grad(rf.lift(f))(x)


def test_custom_vjp_on_extended_dtype_operands_is_refused_by_name():
    """flax's fp8 meta values converted to its max-accumulating dtype (``fp8_meta32``)
    inside a scan: the bwd's cotangent is of that dtype. Refused by name as above;
    before, describing the row for the error crashed first (``np.dtype`` of an
    extended dtype: "TypeError: Cannot interpret 'fp8_meta32' as a data type", found
    by flax's linen_test.py on tools/jax_suite)."""
    fp8_ops = pytest.importorskip("flax.linen.fp8_ops")
    f32 = jnp.dtype("float32")

    def outer(x, ah, sf):
        ah_m = lax.convert_element_type(ah, fp8_ops.fp32_max_grad)
        sf_m = lax.convert_element_type(sf, fp8_ops.fp32_max_grad)
        body = lambda c, _: (fp8_ops.in_qdq(f32, jnp.float8_e4m3fn, c, sf_m, ah_m), None)  # noqa: E731
        return lax.scan(body, jnp.array([x], f32), None, length=3)[0][0]

    ah, sf = jnp.zeros(3), jnp.ones(1)
    np.testing.assert_allclose(jax.grad(outer, (0, 1, 2))(2.0, ah, sf)[1], [2.0, 0.0, 0.0])
    with pytest.raises(rf.AutogradError, match="extended dtype fp8_meta32"):
        rf.grad(rf.lift(outer), (0, 1, 2))(2.0, ah, sf)


def test_custom_vjp_bwd_gets_a_numpy_constant_input_as_a_jax_array():
    """A custom_vjp whose fwd returns an input that is a NumPy constant of the
    traced function (odeint's time grid, built with np.arange inside a jax.jit)
    gives the bwd a jax array, as jax does: odeint's bwd indexes it with a traced
    integer inside a scan, which a NumPy array refuses (TracerArrayConversionError
    before; jax's ode_test.py::test_grad_closure_with_vmap through tools/jax_suite)."""
    from jax.experimental.ode import odeint

    @jax.jit
    def experiment(x):
        return odeint(lambda y, t: -x * y, 1.0, np.arange(0.0, 2.0, 0.1))[-1]

    t = np.arange(0.0, 1.0, 0.25)
    want = jax.vmap(jax.value_and_grad(experiment))(t)
    got = jax.vmap(rf.value_and_grad(rf.lift(experiment)))(t)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
    np.testing.assert_allclose(got[1], -1.9 * np.exp(-1.9 * t), rtol=1e-3)


def _stateful_rule_program(kind: str, after: str):
    """A custom function whose rule reads Python state (``state["w"]``) that the
    lifted function changes after the call, as flax nnx's custom_vjp with graph
    updates does. jax.grad run eagerly traces the rule during the call (it reads
    ``w``); rf traces it after the function has run, when ``state["w"]`` holds a
    value the call does not have yet (``after``: the call's own output, or a value
    computed after it)."""
    state: dict[str, Any] = {}

    if kind == "custom_vjp":

        @jax.custom_vjp
        def f(v):
            return jnp.sin(v) * 2.0

        f.defvjp(lambda v: (f(v), (jnp.cos(v), state["w"])), lambda r, g: (g * r[0] * r[1],))
    else:

        @jax.custom_jvp
        def f(v):
            return jnp.sin(v) * 2.0

        f.defjvp(lambda p, t: (f(p[0]), jnp.cos(p[0]) * state["w"] * t[0]))

    def loss(x, w, change: bool = True):
        state["w"] = w
        y = f(x)
        if change:
            state["w"] = y if after == "own output" else jnp.exp(y)
        return jnp.sum(y)

    return loss


@pytest.mark.parametrize("after", ["own output", "later value"])
@pytest.mark.parametrize("kind", ["custom_vjp", "custom_jvp"])
def test_rule_reading_state_changed_after_the_call_is_refused(kind, after):
    """The rule would read a value of the call itself or of a later step: before,
    a TypeError from inside the rule's forward (None for the value) or a wrong value;
    now an AutogradError saying why, before anything runs."""
    loss = _stateful_rule_program(kind, after)
    x, w = jnp.array([0.3, 0.7]), jnp.array([2.0, 3.0])
    want = jax.grad(loss)(x, w)  # eagerly, jax reads w: cos(x) * w
    np.testing.assert_allclose(want, np.cos([0.3, 0.7]) * np.array([2.0, 3.0]), rtol=1e-6)
    with pytest.raises(rf.AutogradError, match="at or after the call itself"):
        rf.grad(rf.lift(loss))(x, w)
    with pytest.raises(rf.AutogradError, match="at or after the call itself"):
        jax.jit(rf.grad(rf.lift(loss)))(x, w)


@pytest.mark.parametrize("kind", ["custom_vjp", "custom_jvp"])
def test_rule_reading_state_left_as_the_call_found_it(kind):
    """The same rule, the state left alone: the value it reads becomes an input of
    the call, and the gradient is jax.grad's (x alone; w, read only by the rule,
    carries no gradient there for either)."""
    loss = _stateful_rule_program(kind, "own output")
    with _x64():
        x, w = jnp.array([0.3, 0.7, -1.2]), jnp.array([2.0, 3.0, 0.5])
        f = functools.partial(loss, change=False)
        got = rf.grad(rf.lift(f))(x, w)
        chex.assert_trees_all_close(got, jax.grad(f)(x, w), rtol=1e-12)
        chex.assert_trees_all_close(got, np.cos(np.asarray(x)) * np.asarray(w), rtol=1e-12)
        chex.assert_trees_all_close(jax.jit(rf.grad(rf.lift(f)))(x, w), got, rtol=1e-12)


@jax.custom_vjp
def _padded_sum(x, n):
    return jnp.sum(x)


def _padded_sum_fwd(x, n):
    return jnp.sum(x), (x, n)


def _padded_sum_bwd(res, g):
    x, n = res
    pad = jnp.zeros((int(n),))  # a shape from a residual's value (TFP's ODE adjoint sizes an array so)
    return jnp.full_like(x, g) + jnp.sum(pad), None


_padded_sum.defvjp(_padded_sum_fwd, _padded_sum_bwd)


def test_custom_vjp_bwd_that_needs_values_is_refused_by_name():
    """rf runs a backward pass compiled, as jax.jit(jax.grad) does: a bwd that builds
    a shape from a residual's value fails there as under jax.jit, now with an error
    that names the custom_vjp (it was a bare TypeError from inside rf's runner)."""
    x, n = jnp.arange(3.0), jnp.asarray(4)
    f = lambda x, n: _padded_sum(x * x, n)  # noqa: E731
    np.testing.assert_allclose(jax.grad(f)(x, n), 2 * x)  # eagerly, jax runs the bwd on values
    with pytest.raises(TypeError):
        jax.jit(jax.grad(f))(x, n)
    with pytest.raises(rf.AutogradError, match=r"custom_vjp bwd of _padded_sum needs the values") as info:
        rf.grad(rf.lift(f))(x, n)
    assert isinstance(info.value.__cause__, TypeError)


@jax.custom_vjp
def _doubled_sin(x):
    return 2 * jnp.sin(x)


_doubled_sin.defvjp(lambda x: (_doubled_sin(x), jnp.cos(x)), lambda c, g: (2 * c * g,))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("transform", ["jvp", "linearize"])
def test_forward_mode_of_a_custom_vjp_inside_the_function_is_refused_by_name(transform, jit):
    """jax.jvp or jax.linearize of a jax.custom_vjp function emits ``custom_lin``, which
    jax cannot run ("can't apply forward-mode autodiff") nor differentiate. rf.lift
    treated it as a call with a body and crashed with an AttributeError; it now
    refuses it by name and says what to do."""
    x, t = jnp.array([0.3, 0.5, 0.9]), jnp.array([1.0, -1.0, 2.0])
    if transform == "jvp":
        loss = lambda x, t: jnp.sum(jax.jvp(_doubled_sin, (x,), (t,))[1])  # noqa: E731
    else:
        loss = lambda x, t: jnp.sum(jax.linearize(_doubled_sin, x)[1](t))  # noqa: E731
    assert "custom_lin" in str(jax.make_jaxpr(loss)(x, t))
    with pytest.raises(TypeError, match="forward-mode autodiff"):
        loss(x, t)
    with pytest.raises(NotImplementedError, match="custom_lin"):
        jax.grad(loss, argnums=(0, 1))(x, t)
    g = rf.grad(rf.lift(loss), argnums=(0, 1))
    with pytest.raises(rf.AutogradError, match=r"'custom_lin'.*jax\.custom_vjp function.*jax\.custom_jvp"):
        (jax.jit(g) if jit else g)(x, t)


# -- jax.custom_derivatives.linear_call -------------------------------------------------


def _lin_pair(r, a):
    return a[0] * r + a[1], a[1] * 3.0


def _lin_pair_transpose(r, ct):
    return ct[0] * r, ct[0] + ct[1] * 3.0


def _lin_pair_transpose_7(r, ct):
    return ct[0] * r * 7.0, ct[0] + ct[1] * 3.0  # not the transpose: the rule defines it


def _linear_call_loss(transpose):
    from jax.custom_derivatives import linear_call

    def loss(x, y):
        u, v = linear_call(_lin_pair, transpose, jnp.cos(jnp.arange(3.0)), (jnp.sin(x), y * y))
        return jnp.sum(u * x) + jnp.sum(jnp.tanh(v))

    return loss


_LIN_ARGS = (np.linspace(-1.0, 1.0, 3), np.linspace(0.5, 2.0, 3))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("argnums", [(0,), (1,), (0, 1)], ids=["x", "y", "both"])
def test_linear_call_gradient_is_its_transpose_functions(argnums, jit):
    """The linear arguments' gradient is what the transpose function gives, as under
    jax.grad, even where it is not the callee's true transpose; each linear argument
    alone and both (jax.grad of one argument alone fails: it binds the other's
    symbolic zero tangent into the call)."""
    loss = _linear_call_loss(_lin_pair_transpose_7)
    with jax.enable_x64(True):
        x, y = (jnp.asarray(a) for a in _LIN_ARGS)
        want = jax.grad(loss, argnums=(0, 1))(x, y)
        g = rf.grad(rf.lift(loss), argnums=argnums)
        got = (jax.jit(g) if jit else g)(x, y)
        for a, k in zip(got, argnums, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(want[k]), rtol=1e-13)
        with pytest.raises(TypeError, match="linear_call"):
            jax.grad(loss, argnums=1)(x, y)


@pytest.mark.parametrize("argnums", [(0,), (1,), (0, 1)], ids=["x", "y", "both"])
def test_linear_call_first_and_second_order_by_finite_differences(argnums):
    """With the true transpose: rf's gradient, and rf's gradient of jax.grad's
    (whose program holds the transposed call, paired back with the callee), against
    central differences."""
    loss = _linear_call_loss(_lin_pair_transpose)

    def grad_norm(x, y):
        gx, gy = jax.grad(loss, argnums=(0, 1))(x, y)
        return jnp.sum(gx**2) + jnp.sum(jnp.sin(gy))

    with jax.enable_x64(True):
        args = tuple(jnp.asarray(a) for a in _LIN_ARGS)
        check_fd(rf.lift(loss), args, argnums=argnums, directions=3)
        check_fd(rf.lift(grad_norm), args, argnums=argnums, directions=3)


@jax.custom_vjp
def _sin_times(x, y):
    return jnp.sin(x) * y


def _sin_times_fwd(x, y):
    return jnp.sin(x) * y, (jnp.cos(x), jnp.sin(x), y)


def _sin_times_bwd(res, g):
    c, s, y = res
    return g * c * y, g * s


_sin_times.defvjp(_sin_times_fwd, _sin_times_bwd, optimize_remat=True)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("argnums", [(0,), (1,), (0, 1)], ids=["x", "y", "both"])
def test_custom_vjp_with_optimize_remat_first_and_second_order(argnums, jit):
    """A ``custom_vjp`` defined with ``optimize_remat=True``: its gradient, and rf's
    gradient of jax.grad's program, which runs the fwd as the primitive
    ``remat_opt`` (refused by name before). jax.grad of that program fails (jax has
    no transpose for ``remat_opt``): the second order is checked against
    forward-over-reverse, ``jax.jvp`` of jax.grad along each unit vector."""

    def loss(x, y):
        return jnp.sum(_sin_times(x, y) ** 2)

    def grad_norm(x, y):
        return jnp.sum(jax.grad(loss, argnums=(0, 1))(x, y)[0] ** 2)

    with jax.enable_x64(True):
        args = (jnp.linspace(-1.0, 1.0, 4), jnp.linspace(0.5, 2.0, 4))
        with pytest.raises(ValueError, match="Linearization failed"):
            jax.grad(grad_norm)(*args)
        for fun in (loss, grad_norm):
            g = rf.grad(rf.lift(fun), argnums=argnums)
            got = (jax.jit(g) if jit else g)(*args)
            for k, gk in zip(argnums, got, strict=True):
                # (jax.jvp of the custom_vjp function itself fails: jax.grad for the first order)
                want = jax.grad(fun, argnums=k)(*args) if fun is loss else _forward_mode_gradient(fun, args, k)
                np.testing.assert_allclose(np.asarray(gk), np.asarray(want), rtol=1e-12, atol=1e-13)


def _forward_mode_gradient(fun, args, k):
    """The gradient of ``fun`` in its argument ``k`` by ``jax.jvp`` along each unit
    vector (forward mode: no transpose of any primitive)."""
    n = args[k].size
    basis = np.eye(n).reshape(n, *args[k].shape)

    def along(e):
        def moved(t):
            return fun(*(a + t * e if j == k else a for j, a in enumerate(args)))

        return jax.jvp(moved, (0.0,), (1.0,))[1]

    return np.array([along(e) for e in basis]).reshape(args[k].shape)
