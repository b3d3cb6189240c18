"""A ``jax.enable_x64()`` block inside a lifted function, with 64-bit types off
outside it (and on, where it changes nothing). jax.grad runs each rule at its call,
inside the block; rf runs the lifted program's rules, a custom rule's trace and the
backward's seed after the block has ended, so it turns 64-bit types on for a program
with a 64-bit value (``rumus_fx.eager.x64_as_made``). Before: a MulBackward
"float32 for a float64 input" error, and jax's "fwd rule ... float32[] while the
function had float64[]" for a custom_vjp."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf


@jax.custom_jvp
def _square_jvp(x):
    return x**2.0


@_square_jvp.defjvp
def _square_jvp_rule(xs, ts):
    (x,), (t,) = xs, ts
    if not jax.config.jax_enable_x64:
        raise AssertionError("the JVP rule ran outside the call's jax.enable_x64() block")
    return _square_jvp(x), t * jnp.sin(x)  # not the true derivative: the rule must be the one used


@jax.custom_vjp
def _square_vjp(x):
    return x**2.0


_square_vjp.defvjp(lambda x: (_square_vjp(x), jnp.sin(x)), lambda res, t: (res * t,))


def _plain(x):
    return jnp.sin(x**2.0) * 3.0


def _in_a_block(inner):
    def f(x, y):
        with jax.enable_x64():
            x64 = jnp.asarray(x, jnp.float64)
            return inner(x64) * jnp.asarray(y, jnp.float64)

    return f


def _expected(inner, x, y):
    """The derivatives in float64 with numpy: the true ones for the plain function,
    the rules' for the custom ones."""
    x, y = np.float64(x), np.float64(y)
    if inner is _plain:
        return 6 * x * np.cos(x * x) * y, 3 * np.sin(x * x)
    return np.sin(x) * y, x * x


@pytest.mark.parametrize("inner", [_plain, _square_jvp, _square_vjp], ids=["plain", "custom_jvp", "custom_vjp"])
@pytest.mark.parametrize("argnums", [0, 1, (0, 1)], ids=["x", "y", "both"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("x64", [False, True], ids=["x64_off", "x64_on"])
def test_a_jax_enable_x64_block_inside_a_lifted_function(inner, argnums, jit, x64):
    f = _in_a_block(inner)
    x, y = 0.7, -1.3
    with jax.enable_x64(x64), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "float64 ... truncated to float32" anywhere
        g = rf.grad(rf.lift(f), argnums=argnums)
        got = (jax.jit(g) if jit else g)(x, y)
        want = jax.grad(f, argnums=argnums)(x, y)
    expected = _expected(inner, x, y)
    if argnums == 0:
        got, want, expected = (got,), (want,), expected[:1]
    elif argnums == 1:
        got, want, expected = (got,), (want,), expected[1:]
    for a, b, e in zip(got, want, expected):
        assert a.dtype == b.dtype  # the argument's dtype: float32 for a Python float with 64-bit types off
        np.testing.assert_allclose(a, b, rtol=1e-6)
        np.testing.assert_allclose(a, e, rtol=1e-6)


def test_second_order_through_a_jax_enable_x64_block():
    f = _in_a_block(_plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        got = rf.grad(rf.grad(rf.lift(f)))(0.7, -1.3)
    x, y = 0.7, -1.3
    want = (6 * np.cos(x * x) - 12 * x * x * np.sin(x * x)) * y
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(got, jax.grad(jax.grad(f))(x, y), rtol=1e-6)


@jax.custom_jvp
def _checks_32_bit(x):
    return jnp.sin(x)


@_checks_32_bit.defjvp
def _checks_32_bit_rule(xs, ts):
    if jax.config.jax_enable_x64:
        raise AssertionError("64-bit types turned on for a program with no 64-bit value")
    return jnp.sin(xs[0]), jnp.cos(xs[0]) * ts[0]


def test_complex64_values_do_not_turn_64_bit_types_on():
    """complex64 is 8 bytes but two float32s: a program with complex64 values (an FFT)
    stays in 32-bit mode (the first version took any 8-byte dtype for a 64-bit one,
    and the eig rule's iota then asked for int64)."""
    assert not rf.eager.is_64_bit(jnp.zeros(2, jnp.complex64))
    assert rf.eager.is_64_bit(np.zeros(2, np.complex128)) and rf.eager.is_64_bit(np.zeros(2, np.int64))

    def f(x):
        return jnp.sum(jnp.abs(jnp.fft.fft(_checks_32_bit(x))) ** 2)

    x = jnp.linspace(-1.0, 1.0, 8)
    got = rf.grad(rf.lift(f))(x)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, jax.grad(f)(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, 16 * jnp.sin(x) * jnp.cos(x), rtol=1e-5, atol=1e-5)  # Parseval: 8 sum sin^2
