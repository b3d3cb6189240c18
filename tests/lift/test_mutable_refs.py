"""Mutable array references (``jax.new_ref``) made inside a lifted function: jax's
state discharge turns the program into the pure one it is before rf's rules see it
(``_discharged`` in rumus_fx/lift/tracing.py). Each program against ``jax.grad``
and finite differences in float64, each argument alone and both, eagerly and under
``jax.jit``. A reference from outside the function that a tracked value is written
to is refused by name (writing it is an effect the function keeps)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf
from rumus_fx.testing import check_grads


def written_twice(x, y):
    r = jax.new_ref(x)
    r[...] = jnp.sin(r[...]) * y
    r[...] = r[...] + r[...] * x
    return jnp.sum(jax.freeze(r) ** 2)


def written_in_a_jit(x, y):
    r = jax.new_ref(x)

    @jax.jit
    def step():
        r[...] = jnp.sin(r[...]) + jnp.cos(r[...]) * y

    step()
    step()
    return jnp.sum(jax.freeze(r) ** 2)


def written_in_a_scan(x, y):
    r = jax.new_ref(x)

    def body(c, yi):
        r[...] = jnp.sin(r[...]) * yi + c
        return c + 1.0, None

    jax.lax.scan(body, 0.0, y)
    return jnp.sum(jax.freeze(r) ** 2)


def made_in_a_scan_body(x, y):
    def body(c, yi):
        r = jax.new_ref(c)
        r[...] = r[...] * yi
        return jax.freeze(r) + 0.1, None

    out, _ = jax.lax.scan(body, x, y)
    return jnp.sum(out**2)


def made_in_a_checkpoint(x, y):
    @jax.checkpoint
    def f(x):
        r = jax.new_ref(x)
        r[...] = jnp.sin(r[...]) * y
        return jax.freeze(r)

    return jnp.sum(f(x) ** 2)


def checkpoint_without_references(x, y):
    # made_in_a_checkpoint's pure twin: its oracle, since jax.grad of the reference
    # program with respect to y alone fails inside jax (a KeyError in its remat
    # partial evaluation, jax 0.10.2)
    return jnp.sum(jax.checkpoint(lambda x: jnp.sin(x) * y)(x) ** 2)


def indexed_writes(x, y):
    r = jax.new_ref(jnp.zeros(4, x.dtype))
    r[1:3] = x[:2] * y[0]
    r[0] += x[2]
    r[3] = jnp.sum(y * x)
    return jnp.sum(jax.freeze(r) ** 2)


PROGRAMS = [
    written_twice,
    written_in_a_jit,
    written_in_a_scan,
    made_in_a_scan_body,
    made_in_a_checkpoint,
    indexed_writes,
]


# eagerly every program; under jax.jit two in the default run, all with -m slow
CASES = [
    pytest.param(f, jit, id=f"{f.__name__}-{'jit' if jit else 'eager'}", marks=[pytest.mark.slow] if slow else [])
    for f in PROGRAMS
    for jit in (False, True)
    for slow in [jit and f not in (written_in_a_jit, made_in_a_scan_body)]
]


@pytest.mark.parametrize("f, jit", CASES)
def test_references_made_inside(x64, f, jit):
    x, y = jnp.array([0.5, -1.0, 2.0]), jnp.array([1.5, 0.7, -0.2])
    oracle = checkpoint_without_references if f is made_in_a_checkpoint else f
    for nums in (0, 1, (0, 1)):
        check_grads(rf.lift(f), (x, y), nums, oracle=oracle, jit=jit, atol=1e-10, rtol=1e-10)


_OUTSIDE = jax.new_ref(jnp.zeros(3))


def test_reading_a_reference_from_outside():
    _OUTSIDE[...] = jnp.array([1.0, 2.0, 3.0])
    f = lambda x: jnp.sum(jnp.sin(x) * _OUTSIDE[...])  # noqa: E731
    x = jnp.array([0.5, -1.0, 2.0])
    np.testing.assert_allclose(rf.grad(rf.lift(f))(x), jax.grad(f)(x), rtol=1e-6)


def test_writing_a_tracked_value_to_a_reference_from_outside_is_refused():
    def f(x):
        _OUTSIDE[...] = x
        return jnp.sum(x**2)

    with pytest.raises(rf.AutogradError, match="'swap'"):
        rf.grad(rf.lift(f))(jnp.array([0.5, -1.0, 2.0]))


def test_a_jax_high_level_type_is_refused_by_name():
    hijax = pytest.importorskip("jax._src.hijax")  # jax-internal (a Box holding state)
    box = hijax.Box(0.0)

    def f(x):
        y = x * 2.0
        box.set(box.get() + jax.lax.stop_gradient(y))
        return y

    assert float(jax.grad(f)(1.0)) == 2.0
    with pytest.raises(rf.AutogradError, match="BoxTy"):
        rf.grad(rf.lift(f))(jnp.asarray(1.0))


def test_a_reference_from_outside_written_inside_a_jit():
    stats = jax.new_ref(jnp.zeros(()))

    @jax.jit
    def count(x):
        stats[...] += jnp.sum(jax.lax.stop_gradient(x))
        return jnp.sin(x)

    f = lambda x: jnp.sum(count(x) ** 2)  # noqa: E731
    x = jnp.array([0.5, -1.0, 2.0])
    np.testing.assert_allclose(rf.grad(rf.lift(f))(x), jax.grad(f)(x), rtol=1e-6)
    np.testing.assert_allclose(stats[...], 3.0)  # the write happened once per call


def test_a_reference_from_outside_passed_into_a_checkpoint_is_refused_by_name():
    stats = jax.new_ref(jnp.zeros(()))

    @jax.checkpoint
    def count(x):
        stats[...] += jnp.sum(jax.lax.stop_gradient(x))
        return jnp.sin(x)

    f = lambda x: jnp.sum(count(x) ** 2)  # noqa: E731
    x = jnp.array([0.5, -1.0, 2.0])
    jax.grad(f)(x)  # jax.grad takes it
    with pytest.raises(rf.AutogradError, match=r"from outside it into '(remat2|checkpoint)'"):
        rf.grad(rf.lift(f))(x)


def test_a_reference_in_a_function_traced_with_its_values(x64):
    """A Python branch on a value (Note [Concrete tracing]) next to a reference the
    function makes: traced with its values, then discharged."""

    def f(x):
        r = jax.new_ref(x)
        if jnp.sum(x) > 0:
            r[...] = jnp.sin(r[...])
        else:
            r[...] = r[...] ** 2
        return jnp.sum(jax.freeze(r) * x)

    for x in (jnp.array([0.5, 1.0]), jnp.array([-0.5, -1.0])):
        check_grads(rf.lift(f), (x,), 0, oracle=f, atol=1e-10, rtol=1e-10)


def test_a_reference_from_outside_written_inside_a_scan():
    counter = jax.new_ref(0)

    def f(x):
        def body(c, _):
            counter[...] += 1
            return jnp.sin(c) * x, ()

        c, () = jax.lax.scan(body, x, (), length=3)
        return jnp.sum(c)

    x = jnp.array([0.5, -1.0, 2.0])
    np.testing.assert_allclose(rf.grad(rf.lift(f))(x), jax.grad(f)(x), rtol=1e-6)
    assert int(counter[...]) == 6  # three steps per call, once each for jax.grad and rf


def test_a_reference_from_outside_passed_into_a_custom_vjp_is_refused_by_name():
    grads = jax.new_ref(jnp.float32(0.0))

    @jax.custom_vjp
    def stash(ref, x):
        return x

    def bwd(ref, g):
        ref[...] = g
        return None, g

    stash.defvjp(lambda ref, x: (x, ref), bwd)
    f = lambda x: jnp.sin(stash(grads, jnp.sin(x)))  # noqa: E731
    jax.grad(f)(jnp.float32(1.0))  # jax.grad takes it (the bwd stores the cotangent)
    with pytest.raises(rf.AutogradError, match="from outside it into 'custom_vjp_call"):
        rf.grad(rf.lift(f))(jnp.float32(1.0))
