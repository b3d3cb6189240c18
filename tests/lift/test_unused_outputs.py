"""An output of control flow, of a ``jax.custom_jvp`` call or of a multi-output
primitive (``sort``, ``device_put``, ``shard_alike``, a variadic ``reduce``) that the
program does not use adds no term to the gradient, nor does an input that only such
outputs read (a scan's constant, scanned-over input or initial value of a dead carry,
an operand no branch of a switch uses) (Note [An unused output adds nothing] in
rumus_fx/lift/program.py). Each unused output here has an infinite derivative at the
point (``sqrt`` at 0, eigenvectors at a repeated eigenvalue), so a zero cotangent in
its place made the used output's gradient nan where jax.grad's is finite. Each program
under ``rf.grad(rf.lift(f))`` against ``jax.grad(f)`` and float64 central differences,
eagerly and under jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.shard_alike import shard_alike
from jax.sharding import PartitionSpec as P

import rumus_fx as rf
from rumus_fx.testing import check_fd


def _two(x):
    return jnp.sqrt(x), x * 2.0


@jax.custom_jvp
def _two_rule(x):
    return jnp.sqrt(x), x * 2.0


@_two_rule.defjvp
def _two_rule_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    s = jnp.sqrt(x)
    return (s, x * 2.0), (0.5 / s * t, 2.0 * t)


def _eigh_pair(a):
    w, v = jnp.linalg.eigh(a)
    return w, v


PROGRAMS = {
    "cond": lambda x: jnp.sum(lax.cond(x[1] > 0, _two, lambda x: (x, x), x)[1]),
    "switch": lambda x: jnp.sum(lax.switch(1, [lambda x: (x, x), _two], x)[1]),
    "checkpoint": lambda x: jnp.sum(jax.checkpoint(_two)(x)[1]),
    "scan_stacked_output": lambda x: jnp.sum(lax.scan(lambda c, _: (c * 1.5, _two(c)), x, None, length=3)[1][1]),
    "scan_dead_carry": lambda x: jnp.sum(
        lax.scan(lambda c, _: ((c[0] * 1.5, jnp.sqrt(c[0])), c[0] * 2.0), (x, x), None, length=3)[1]
    ),
    "scan_dead_carry_chain": lambda x: jnp.sum(
        lax.scan(lambda c, _: ((c[0], jnp.sqrt(c[0]), c[1] * 3.0), c[0] ** 2), (x, x, x), None, length=2)[1]
    ),
    "scan_checkpointed_body": lambda x: jnp.sum(
        lax.scan(jax.checkpoint(lambda c, _: (c, _two(c))), x, None, length=2)[1][1]
    ),
    "custom_jvp": lambda x: jnp.sum(_two_rule(x)[1]),
    "custom_jvp_in_cond": lambda x: jnp.sum(lax.cond(True, _two_rule, lambda x: (x, x), x)[1]),
    "custom_jvp_in_scan": lambda x: jnp.sum(lax.scan(lambda c, _: (c, _two_rule(c)), x, None, length=2)[1][1]),
    "jit_inside": lambda x: jnp.sum(jax.jit(_two)(x)[1]),
    "shard_map": lambda x: jnp.sum(
        jax.shard_map(_two, mesh=jax.make_mesh((1,), ("i",)), in_specs=P(), out_specs=(P(), P()))(x)[1]
    ),
    # multi-output primitives: an unused output's operand gets no cotangent
    "sort_key_val": lambda x: jnp.sum(lax.sort_key_val(jnp.sqrt(x), x * 2.0)[1]),
    "sort_three_operands": lambda x: jnp.sum(lax.sort((x, jnp.sqrt(x), x * 3.0), num_keys=1)[2]),
    "device_put_pytree": lambda x: jnp.sum(jax.device_put(_two(x))[1]),
    "shard_alike": lambda x: jnp.sum(shard_alike(*_two(x))[1]),
    "reduce_two_operands": lambda x: lax.reduce(_two(x), (0.0, 0.0), _sum_pairs, (0,))[1],
    # an operand that only unused outputs read gets no cotangent: not zeros
    "switch_operand_no_branch_uses": lambda x: jnp.sum(
        lax.switch(1, [lambda y, z: (y, z), lambda y, z: (y * 2.0, z * 3.0)], *_two(x))[1]
    ),
    "shard_map_operand_unused": lambda x: jnp.sum(
        jax.shard_map(
            lambda y, z: (y, z * 2.0), mesh=jax.make_mesh((1,), ("i",)), in_specs=(P(), P()), out_specs=(P(), P())
        )(*_two(x))[1]
    ),
    "scan_constant_of_dead_carry": lambda x: _dead_first_carry(x, lambda c, s, xi: c * s),
    "scan_input_of_dead_carry": lambda x: _dead_first_carry(x, lambda c, s, xi: c * xi),
    "scan_initial_value_of_dead_carry": lambda x: jnp.sum(
        lax.scan(lambda c, _: ((c[0], c[1] * 2.0), None), _two(x), None, length=2)[0][1]
    ),
    # a live carry reads the dead one only where no gradient flows (a comparison)
    "scan_carry_read_through_a_comparison": lambda x: jnp.sum(
        lax.scan(
            lambda c, _: ((jnp.sqrt(c[0]), c[1] * 2.0 + jnp.where(c[0] > 100.0, 1.0, 0.0)), None),
            (x, x),
            None,
            length=2,
        )[0][1]
    ),
    # the dead carry found through a call in the body
    "scan_checkpointed_body_dead_carry": lambda x: _dead_first_carry(x, lambda c, s, xi: jnp.sqrt(c), jax.checkpoint),
    "scan_jit_body_dead_carry": lambda x: _dead_first_carry(x, lambda c, s, xi: jnp.sqrt(c), jax.jit),
    "scan_cond_in_body_dead_carry": lambda x: jnp.sum(
        lax.scan(
            lambda c, _: (lax.cond(c[1][0] > -1.0, lambda c: (jnp.sqrt(c[0]), c[1] * 2.0), lambda c: c, c), None),
            (x, x),
            None,
            length=2,
        )[0][1]
    ),
    "scan_in_scan_dead_carry": lambda x: jnp.sum(
        lax.scan(
            lambda c, _: (_dead_first_carry_loop(c), None),
            (x, x),
            None,
            length=2,
        )[0][1]
    ),
}


def _sum_pairs(a, b):
    return a[0] + b[0], a[1] + b[1]


def _dead_first_carry_loop(c, step=lambda c, s, xi: jnp.sqrt(c), wrap=lambda f: f, s=None):
    """Two scan iterations over ``(c0, c1)``: ``c0`` from ``step(c0, s, x_i)`` (dead:
    only the final ``c1`` is used), ``c1`` doubled; ``s`` (``c0`` by default) is the
    body's constant and, stacked twice, its scanned-over input; ``wrap`` wraps the
    body (``jax.checkpoint``, ``jax.jit``)."""
    s = c[0] if s is None else s
    body = wrap(lambda c, xi: ((step(c[0], s, xi), c[1] * 2.0), None))
    return lax.scan(body, c, jnp.stack([s, s]))[0]


def _dead_first_carry(x, step, wrap=lambda f: f):
    return jnp.sum(_dead_first_carry_loop((x, x), step, wrap, jnp.sqrt(x))[1])


X = np.array([0.0, 1.0, 4.0])

# eigenvalues used without their vectors at a repeated eigenvalue, through each call
A = np.diag([1.0, 0.0, 0.0, 0.0])
SPECTRA = {
    "cond": lambda a: jnp.sum(lax.cond(True, _eigh_pair, lambda a: _eigh_pair(a * 2.0), a)[0] ** 3),
    "checkpoint": lambda a: jnp.sum(jax.checkpoint(_eigh_pair)(a)[0] ** 3),
    "scan": lambda a: jnp.sum(lax.scan(lambda c, _: (c, _eigh_pair(c)), a, None, length=2)[1][0] ** 3),
}


def _check(f, x, jit):
    with jax.enable_x64(True):
        x = jnp.asarray(x)
        g = rf.grad(rf.lift(f))
        got = np.asarray((jax.jit(g) if jit else g)(x))
        want = np.asarray(jax.jit(jax.grad(f))(x))
    assert np.all(np.isfinite(want))
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_an_unused_output_with_an_infinite_derivative(name, jit):
    _check(PROGRAMS[name], X, jit)


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_an_unused_output_finite_differences(name):
    # the central difference needs the function smooth around the point: sqrt's
    # argument away from 0 (the gradient there is the same expression)
    check_fd(rf.lift(PROGRAMS[name]), (X + 0.5,), eps=1e-6, tol=1e-6, directions=3)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(SPECTRA))
def test_eigenvalues_through_control_flow_at_a_repeated_eigenvalue(name, jit):
    _check(SPECTRA[name], A, jit)
    check_fd(rf.lift(SPECTRA[name]), (A,), eps=1e-6, tol=1e-6, directions=3)


def test_a_used_carry_still_gets_its_zero_cotangent():
    """A carry the stacked outputs read is live even when the final carry is unused:
    its zero cotangent is kept (jax's scan makes it zeros too), so where its own
    derivative is infinite the gradient is nan on both sides."""
    f = lambda x: jnp.sum(lax.scan(lambda c, _: (jnp.sqrt(c), c * 2.0), x, None, length=2)[1])  # noqa: E731
    with jax.enable_x64(True):
        x = jnp.asarray(X)
        got, want = np.asarray(rf.grad(rf.lift(f))(x)), np.asarray(jax.jit(jax.grad(f))(x))
    np.testing.assert_allclose(got, want, rtol=1e-10, equal_nan=True)
    assert np.isnan(want[0])


# a value the program uses only through a function whose derivative is zero everywhere
# (a power 0, sign, floor, a comparison): no term reaches it, as no tangent does under
# jax.grad; zeros in its place were ``0 * inf`` through ``sqrt`` at 0 (``x ** 0``)
CONSTANT_OF = {
    "power_zero": lambda x: jnp.sum(jnp.sqrt(x) ** 0 + x),
    "integer_pow_zero": lambda x: jnp.sum(lax.integer_pow(jnp.sqrt(x), 0) * x),
    "sign": lambda x: jnp.sum(jnp.sign(jnp.sqrt(x)) * x),
    "floor": lambda x: jnp.sum(jnp.floor(jnp.sqrt(x)) + x),
    "round": lambda x: jnp.sum(jnp.round(jnp.sqrt(x)) + x),
    "comparison": lambda x: jnp.sum(jnp.where(jnp.sqrt(x) > 0.5, x, 2.0 * x)),
    "argsort": lambda x: jnp.sum(x[jnp.argsort(jnp.sqrt(x))] * jnp.arange(3.0)),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(CONSTANT_OF))
def test_a_value_used_through_a_zero_derivative_adds_nothing(name, jit):
    _check(CONSTANT_OF[name], X, jit)


# Note [A refusal no gradient reaches] (rumus_fx/lift/program.py): a step rf cannot
# differentiate refuses only where a gradient can reach it. lax.ragged_dot_general with
# a ragged contracting axis has a JVP rule in jax but no transpose; its value dropped,
# or read only through argmax, is dead code for jax.grad, which succeeds; rf refused it
# when it built the program. (jax.jvp of jax.grad of a ragged dot computes such a dot
# as a primal output nobody reads: rf.grad over it was refused.)
_CONTRACTING = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (0,)), ((), ())), lhs_ragged_dimensions=[1], rhs_group_dimensions=[]
)
_GROUPS = np.array([2, 0, 1], np.int32)


def _ragged_contracting(a, b):
    return lax.ragged_dot_general(a, b, jnp.asarray(_GROUPS), _CONTRACTING)


DEAD = {
    "dropped": lambda a, b: (_ragged_contracting(a, b), jnp.sum(jnp.sin(a) * a) + jnp.sum(b * b))[1],
    "through_argmax": lambda a, b: jnp.sum(jnp.sin(a)) * jnp.argmax(_ragged_contracting(a, b)).astype(a.dtype),
    "under_stop_gradient": lambda a, b: jnp.sum(lax.stop_gradient(_ragged_contracting(a, b))) * jnp.sum(a) * jnp.sum(b),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("argnums", [(0,), (1,), (0, 1)], ids=["a", "b", "both"])
@pytest.mark.parametrize("name", list(DEAD))
def test_a_step_without_a_gradient_no_gradient_reaches(name, argnums, jit):
    f = DEAD[name]
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        a, b = jnp.asarray(rng.standard_normal((3, 3))), jnp.asarray(rng.standard_normal((3, 2)))
        g = rf.grad(rf.lift(f), argnums=argnums)
        got = (jax.jit(g) if jit else g)(a, b)
        want = jax.grad(f, argnums=argnums)(a, b)
        for x, y in zip(got, want):
            np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12)
        if name != "under_stop_gradient":  # stop_gradient: not the value's derivative
            check_fd(rf.lift(f), (a, b), argnums=argnums, grads=got)


def test_a_step_without_a_gradient_refuses_where_one_reaches_it():
    """The same dot whose value reaches the output, directly, or only through a
    custom_jvp rule closing over it (its output stays tracked): refused by name."""
    rng = np.random.default_rng(1)
    a, b = jnp.asarray(rng.standard_normal((3, 3))), jnp.asarray(rng.standard_normal((3, 2)))

    @jax.custom_jvp
    def scaled(x):
        return 2.0 * x

    def closes_over(a, b):
        r = _ragged_contracting(a, b)

        @scaled.defjvp
        def _(primals, tangents):
            return scaled(primals[0]), 2.0 * tangents[0] + 0.0 * jnp.sum(r)

        return jnp.sum(scaled(a))

    used = lambda a, b: jnp.sum(_ragged_contracting(a, b) ** 2)  # noqa: E731
    with pytest.raises(rf.AutogradError, match="ragged axis"):
        rf.grad(rf.lift(used), argnums=(0, 1))(a, b)
    with pytest.raises(rf.AutogradError, match="closes over a tracked value"):
        rf.grad(rf.lift(closes_over), argnums=(0, 1))(a, b)


def test_a_primitive_without_a_rule_is_refused_even_where_its_value_is_dropped():
    """A primitive with no rule at all (``householder_product``) is refused when the
    function is lifted, its value used or dropped (SPEC section 8); jax.grad, which
    has no JVP rule for it, fails on both as well."""

    def dropped(x):
        _ = lax.linalg.householder_product(x, jnp.array([0.5, 0.2], x.dtype))
        return jnp.sum(jnp.sin(x) * x)

    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 3)))
    with pytest.raises(NotImplementedError):
        jax.grad(dropped)(x)
    with pytest.raises(rf.AutogradError, match="'householder_product'"):
        rf.grad(rf.lift(dropped))(x)
