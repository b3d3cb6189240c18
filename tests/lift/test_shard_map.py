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
