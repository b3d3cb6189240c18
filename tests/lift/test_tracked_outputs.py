"""Which outputs of a control-flow step depend on a tracked input (Note [Tracked
outputs] in ``rumus_fx/lift/program.py``): a ``cond`` output if some branch makes it
so, a ``scan`` or ``while_loop`` carry at its body's fixed point, a ``custom_jvp``
output if its rule's tangent depends on a tracked input's tangent.

Before, every float output of a step with a tracked input was tracked. Two programs
``jax.grad`` differentiates were refused: a ``while_loop`` whose condition alone reads
the differentiated value (it decides the trip count; no float carry depends on it),
and a value that never depends on the input passing through a ``cond`` in a ``scan``
into a rule that refuses a tangent (equinox's ``nondifferentiable``, found by running
equinox's ``test_while_loop.py`` through ``tools/jax_suite``), and the same after a
``custom_jvp`` output whose rule gives it a tangent that does not depend on the input's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import rumus_fx as rf
from rumus_fx.testing import check_fd


@jax.custom_jvp
def _no_tangent(v):
    return v


@_no_tangent.defjvp
def _no_tangent_jvp(primals, tangents):
    raise RuntimeError("a tangent reached _no_tangent")


def _trip_count_from_x(x, w):
    """The condition alone reads x: y doubles until it passes x; w scales outside."""
    n, y = lax.while_loop(lambda c: jnp.sum(c[1]) < jnp.sum(x), lambda c: (c[0] + 1, c[1] * 2.0), (0, jnp.ones_like(x)))
    return jnp.sum(y * w + x * n.astype(x.dtype) + jnp.sin(x) * w)


def _untracked_carry_through_cond(x, w):
    """z never depends on x or w; the cond's branches pass it to _no_tangent."""

    def body(c, _):
        a, z = c
        a, z = lax.cond(z > 0, lambda a, z: (jnp.tanh(a * w) + _no_tangent(z), z + 1.0), lambda a, z: (a, z), a, z)
        return (a, z), None

    (a, z), _ = lax.scan(body, (x, jnp.ones((), x.dtype)), None, length=3)
    return jnp.sum(a) + z


def _one_branch_tracks(x, w):
    """The second output is tracked in one branch only (the other returns a constant)."""
    a, b = lax.cond(jnp.sum(x) > 0, lambda x, w: (x * 2.0, jnp.sin(x) * w), lambda x, w: (x, jnp.ones_like(x)), x, w)
    return jnp.sum(a * b)


@jax.custom_jvp
def _sin_and_floor(x):
    return jnp.sin(x), jnp.floor(x)


@_sin_and_floor.defjvp
def _sin_and_floor_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _sin_and_floor(x), (jnp.cos(x) * t, jnp.zeros_like(x))  # the floor's tangent: no tangent's


def _custom_rule_with_a_constant_tangent(x, w):
    """A custom_jvp output whose rule's tangent does not depend on the input's, read by _no_tangent."""
    a, b = _sin_and_floor(x * w)
    return jnp.sum(a * w + _no_tangent(b))


def _checkpoint_passing_an_untracked_value(x, w):
    """A jax.checkpoint output that does not depend on the inputs, read by _no_tangent."""
    a, z = jax.checkpoint(lambda a, z: (jnp.sin(a) * w, z + 1.0))(x, jnp.ones((), x.dtype))
    return jnp.sum(a) + _no_tangent(z)


FUNCTIONS = [
    _checkpoint_passing_an_untracked_value,
    _trip_count_from_x,
    _untracked_carry_through_cond,
    _one_branch_tracks,
    _custom_rule_with_a_constant_tangent,
]


def _args(f):
    x = np.array([0.7, 1.9, 3.1]) if f is _trip_count_from_x else np.array([0.3, -0.6, 0.5])
    return x, np.array([1.3, -0.4, 0.9])


@pytest.mark.parametrize("f", FUNCTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("argnums", [0, 1, (0, 1)])
@pytest.mark.parametrize("jit", [False, True])
def test_matches_jax_grad_each_argument_alone(f, argnums, jit):
    with jax.enable_x64(True):
        args = _args(f)
        want = jax.grad(f, argnums=argnums)(*args)
        g = rf.grad(rf.lift(f), argnums=argnums)
        got = (jax.jit(g) if jit else g)(*args)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12), got, want)


@pytest.mark.parametrize("f", FUNCTIONS, ids=lambda f: f.__name__)
def test_finite_differences(f):
    # the trip count is constant near these points, so the function is smooth there
    check_fd(rf.lift(f), _args(f), argnums=(0, 1))


def test_negative_argument_also_takes_the_first_branch_gradient():
    """The cond's other branch (sum(x) <= 0): its second output is a constant."""
    x, w = -np.abs(_args(_one_branch_tracks)[0]), np.array([1.3, -0.4, 0.9])
    with jax.enable_x64(True):
        want = jax.grad(_one_branch_tracks, argnums=(0, 1))(x, w)
        got = rf.grad(rf.lift(_one_branch_tracks), argnums=(0, 1))(x, w)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12), got, want)


def test_a_while_loop_whose_carry_depends_on_the_value_is_still_refused():
    def f(x):
        return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * x), (0, 1.0))[1]

    with pytest.raises(rf.AutogradError, match="while_loop"):
        rf.grad(rf.lift(f))(2.0)


def test_a_tangent_reaching_the_refusing_rule_still_raises():
    def f(x):
        return lax.cond(x > 0, lambda v: _no_tangent(v * 2.0), lambda v: v, x)

    with pytest.raises(RuntimeError, match="a tangent reached"):
        rf.grad(rf.lift(f))(1.0)


@pytest.mark.parametrize(
    "argnums", [(0, 1), pytest.param(0, marks=pytest.mark.slow), pytest.param(1, marks=pytest.mark.slow)]
)
def test_diffrax_sde_with_the_direct_adjoint(argnums):
    """diffrax's DirectAdjoint runs equinox's bounded while loop (scans of
    checkpoints and conds); the time carried through it never depends on the
    inputs and reaches the Brownian tree's ``nondifferentiable`` check (with more
    than 16 steps allowed, the loop nests checkpoints). Found by
    diffrax's ``test_adjoint.py::test_sde_against`` through ``tools/jax_suite``."""
    import diffrax
    import lineax

    def drift(t, y, args):
        return -args[0] * y

    def diffusion(t, y, args):
        return lineax.DiagonalLinearOperator(args[1] * y)

    bm = diffrax.VirtualBrownianTree(0.0, 1.0, 1e-3, (2,), key=jax.random.PRNGKey(0))
    terms = diffrax.MultiTerm(diffrax.ODETerm(drift), diffrax.ControlTerm(diffusion, bm))

    def run(y0, args):
        sol = diffrax.diffeqsolve(
            terms, diffrax.Heun(), 0.0, 1.0, 0.1, y0, args, adjoint=diffrax.DirectAdjoint(), max_steps=32
        )
        return jnp.sum(sol.ys)

    y0, args = jnp.array([1.0, 2.0]), (jnp.array(0.5), jnp.array(0.1))
    want = jax.grad(run, argnums=argnums)(y0, args)
    got = rf.grad(rf.lift(run), argnums=argnums)(y0, args)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
