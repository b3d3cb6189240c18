"""``jax.shard_map`` and its collectives under ``rf.lift`` on 8 host CPU devices:
the checks live in ``tests/_shard_map_cases.py`` and run in one subprocess
(the device count is fixed when jax starts). The primitive table runs each rule
on a one-device mesh as well (``rumus_fx/lift/rules_parallel.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import rumus_fx as rf

from .._subprocess import child_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("part", ["0/2", "1/2"])  # two processes: the default run's workers share them
def test_shard_map_on_eight_devices(part):
    """Each case on one axis type (Auto and Explicit in turn from case to case) with
    all its arguments in both ``check_vma`` settings, each argument alone in one
    setting (``run_case`` in tests/_shard_map_cases.py); both axis types and every
    argument alone in every setting with -m slow."""
    _run_cases(part)


@pytest.mark.slow
@pytest.mark.parametrize("part", ["0/2", "1/2"])
def test_shard_map_every_argument_alone_in_every_setting(part):
    _run_cases(part, SHARD_MAP_EVERY_SUBSET="1")


def _run_cases(part: str, **extra_env: str) -> None:
    env = child_env(**extra_env)
    proc = subprocess.run(
        [sys.executable, "-m", "tests._shard_map_cases", f"--part={part}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-6000:] + proc.stderr[-6000:]


def _one_device_mesh():
    return jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])


@pytest.mark.parametrize("collective", ["pmax", "pmin"])
def test_collectives_without_a_gradient_in_jax_are_refused(collective):
    """jax.grad has no rule for pmax/pmin; rf.lift refuses them by name, never a zero."""
    reduce = getattr(lax, collective)

    def f(x):
        body = lambda x: reduce(jnp.sum(x**2), "x")  # noqa: E731
        return jax.shard_map(body, mesh=_one_device_mesh(), in_specs=P("x"), out_specs=P())(x)

    x = jnp.ones((2, 3))
    with pytest.raises(rf.AutogradError, match=collective):
        rf.grad(rf.lift(f))(x)
    with pytest.raises(NotImplementedError):
        jax.grad(f)(x)


def test_a_second_call_sees_new_values():
    """The residuals' layout is recorded by the first call of a lifted function
    (an abstract run of the forward) and reused after: a second eager call with
    new values gets their gradient."""
    mesh = _one_device_mesh()

    def f(w, x):
        body = lambda w, x: lax.psum(jnp.sum(jnp.sin(x * w[None])), "x")  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=P())(w, x)

    w, x = jnp.arange(3.0), jnp.ones((2, 3))
    g = rf.grad(rf.lift(f))
    first = g(w, x)
    np.testing.assert_allclose(first, jax.grad(f)(w, x), rtol=1e-6)
    np.testing.assert_allclose(g(w * 2, x), jax.grad(f)(w * 2, x), rtol=1e-6)


# -- a gradient taken inside a shard_map body ---------------------------------------
# (netket's chunked vjp: jax.vjp inside jax.shard_map with check_vma=True). rf traced the
# lifted function on types without the manual axes its values vary over, so a constant
# of the function was not made to vary as jax's trace makes it, and jax's type check
# refused ``x - 1.0`` when the program ran.


def _scan_loss(x, w):
    def step(c, xi):
        c = jnp.tanh(c * w[0] + xi)  # (a constant the body of the scan makes varies too)
        return c, jnp.sum(c)

    c, ys = lax.scan(step, x[0] * 0.5, x[1:])  # (the carry varies with x from the start)
    return jnp.sum(ys) + jnp.sum(c**2)


TABLE = np.linspace(0.5, 1.5, 2)  # read through the lifted loss's closure


def _closure_loss(x, w):
    return jnp.sum(jnp.sin(x @ w.T) * TABLE[None]) - 1.0


INSIDE_BODY = {
    "constant": lambda x, w: jnp.sum(jnp.tanh(x @ w.T) - 1.0),
    "relu_and_where": lambda x, w: jnp.sum(jnp.where(x[:, :2] > 0.1, jax.nn.relu(x @ w.T), 2.0 * x[:, :1])),
    "psum": lambda x, w: lax.psum(jnp.sum(jnp.cos(x * w[:1])), "x"),
    "scan": _scan_loss,
    "closure": _closure_loss,
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("argnums", [(0,), (1,), (0, 1)])
@pytest.mark.parametrize("case", list(INSIDE_BODY))
def test_a_gradient_taken_inside_a_shard_map_body(case, argnums, jit, x64):
    """rf.grad of a lifted loss inside a ``shard_map`` body with ``check_vma=True``:
    ``x`` varies over the mesh axis, ``w`` does not; each alone and both, against
    jax.grad in the same body and against central differences."""
    loss = INSIDE_BODY[case]
    mesh = _one_device_mesh()
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(4, 3)))
    w = jnp.asarray(rng.normal(size=(2, 3)))

    def body_of(grad):
        def body(x, w):
            return grad(loss, argnums=argnums)(x, w)

        out_specs = tuple(P("x") if k == 0 else P() for k in argnums)
        if any(k == 1 for k in argnums):
            # w's gradient varies over the axis (each device's share): summed over it
            def summed(x, w):
                gs = body(x, w)
                return tuple(g if k == 0 else lax.psum(g, "x") for k, g in zip(argnums, gs))

            return jax.shard_map(summed, mesh=mesh, in_specs=(P("x"), P()), out_specs=out_specs)
        return jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=out_specs)

    rf_grad = lambda f, argnums: rf.grad(rf.lift(f), argnums=argnums)  # noqa: E731
    got, want = body_of(rf_grad), body_of(jax.grad)
    if jit:
        got, want = jax.jit(got), jax.jit(want)
    got, want = got(x, w), want(x, w)
    for g, h in zip(got, want):
        np.testing.assert_allclose(g, h, rtol=1e-12, atol=1e-12)

    # central differences of the body's loss along a random direction per argument
    value = jax.jit(jax.shard_map(lambda x, w: loss(x, w)[None], mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))
    args = [x, w]
    for k, g in zip(argnums, got):
        d = jnp.asarray(rng.normal(size=args[k].shape))
        plus, minus = list(args), list(args)
        plus[k], minus[k] = args[k] + 1e-6 * d, args[k] - 1e-6 * d
        fd = (value(*plus)[0] - value(*minus)[0]) / 2e-6
        np.testing.assert_allclose(jnp.vdot(g, d), fd, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("jit", [False, True])
def test_a_function_closing_over_a_varying_value_inside_a_shard_map_body(jit, x64):
    """The lifted function reads the body's varying ``x`` through its closure; the
    gradient is taken with respect to the invariant ``w``."""
    mesh = _one_device_mesh()
    x = jnp.asarray(np.random.default_rng(7).normal(size=(4, 3)))
    w = jnp.asarray(np.random.default_rng(8).normal(size=(2, 3)))

    def body_of(grad):
        def body(x, w):
            g = grad(lambda w: jnp.sum(jnp.tanh(x @ w.T) - 1.0))(w)
            return lax.psum(g, "x")

        return jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P())

    got, want = body_of(lambda f: rf.grad(rf.lift(f))), body_of(jax.grad)
    if jit:
        got, want = jax.jit(got), jax.jit(want)
    np.testing.assert_allclose(got(x, w), want(x, w), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got(x * 2, w), want(x * 2, w), rtol=1e-12, atol=1e-12)  # a new value is seen


@pytest.mark.parametrize("jit", [False, True])
def test_a_vjp_taken_inside_a_shard_map_body(jit, x64):
    """``rf.vjp`` inside the body (netket's chunked vjp), with a varying cotangent."""
    mesh = _one_device_mesh()
    f = lambda x, w: jnp.tanh(x @ w.T) - 1.0  # noqa: E731
    x = jnp.asarray(np.random.default_rng(4).normal(size=(4, 3)))
    w = jnp.asarray(np.random.default_rng(5).normal(size=(2, 3)))
    ct = jnp.asarray(np.random.default_rng(6).normal(size=(4, 2)))

    def body_of(vjp):
        def body(x, w, ct):
            _, pullback = vjp(f, x, w)
            gx, gw = pullback(ct)
            return gx, lax.psum(gw, "x")

        return jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P("x")), out_specs=(P("x"), P()))

    got, want = body_of(lambda f, *a: rf.vjp(rf.lift(f), *a)), body_of(jax.vjp)
    if jit:
        got, want = jax.jit(got), jax.jit(want)
    for g, h in zip(got(x, w, ct), want(x, w, ct)):
        np.testing.assert_allclose(g, h, rtol=1e-12, atol=1e-12)
