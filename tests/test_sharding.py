"""Sharding (docs/SPEC.md section 10): every op family, the primitive rules of
``rf.lift``, the Pallas kernels and the models, inside ``jax.jit`` on 8 host CPU
devices, on meshes with Explicit axes (``jax.make_mesh``'s default) and Auto
axes, with and without ``jax.set_mesh`` (by default each case runs one of the
four settings, in turn from case to case; ``-m slow`` runs all four);
data parallel, tensor parallel (2x4 ("data", "model")) and FSDP. Gradients equal
the one-device ones and carry their arguments' shardings; no backward rule
leaves a gradient for the engine to reshard. The checks live in
``tests/_sharded_cases.py``; each group runs in one subprocess (the device count
is fixed when jax starts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import rumus_fx as rf

from ._subprocess import child_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "groups",
    [
        ("ops", "ops_tp", "lift", "lift_tp", "errors"),
        ("kernels",),
        # data parallel (tests/test_examples.py trains on 8 devices by data parallelism
        # against one device in the default run)
        pytest.param(("models_dp",), marks=pytest.mark.slow, id="models_dp"),
        ("models_tp",),
        pytest.param(("lift_slow",), marks=pytest.mark.slow, id="lift_slow"),
    ],
)
def test_sharded(groups):
    _run(groups)


@pytest.mark.slow
@pytest.mark.parametrize("groups", [("ops", "ops_tp", "lift", "lift_tp"), ("kernels", "models_dp", "models_tp")])
def test_sharded_every_case_in_all_four_settings(groups):
    """The default run gives each case one of the four settings, in turn
    (``combos`` in tests/_sharded_cases.py); this runs every case in all four."""
    _run(groups, SHARDED_ALL_COMBOS="1")


@pytest.mark.slow
def test_sharded_with_jax011_broadcast():
    """jax 0.11 drops ``out_sharding=`` when broadcasting a meshless value under
    ``jax.jit`` without ``jax.set_mesh`` (``emulate_jax011_broadcast`` in
    tests/_sharded_cases.py); on jax 0.10 the op and lift groups run with that
    behaviour emulated: sum/mean backward and the lifted reduce_sum and scatter rules
    keep their shardings. Slow (50 s): jax 0.11's behaviour emulated on jax 0.10,
    not op coverage (every case runs in the default run without the emulation, and
    on jax 0.11 the default run's sharded cases meet the real behaviour)."""
    _run(("ops", "lift", "kernels"), SHARDED_EMULATE_JAX011="1")


def _run(groups: tuple[str, ...], **extra_env: str) -> None:
    env = child_env(**extra_env)
    proc = subprocess.run(
        [sys.executable, "-m", "tests._sharded_cases", *groups],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-4000:] + proc.stderr[-8000:]


def test_norm_weight_gradient_with_untracked_input():
    """layer_norm/batch_norm_2d: the weight's gradient when the input is a plain
    array (the first norm of a model) is not silently zero."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tests.ops.optable import ref_batch_norm, ref_layer_norm

    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((4, 3, 5, 5)), jnp.float32)
    g = jnp.asarray(r.standard_normal((4, 3, 5, 5)), jnp.float32)
    w, b, rm, rv = jnp.full(3, 1.5), jnp.full(3, 0.1), jnp.zeros(3), jnp.ones(3)
    for t in (True, False):
        got = rf.grad(lambda w, t=t: rf.sum(rf.batch_norm_2d(x, w, b, rm, rv, training=t)[0] * g))(w)
        want = jax.grad(lambda w, t=t: jnp.sum(ref_batch_norm(x, w, b, rm, rv, training=t)[0] * g))(w)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    got = rf.grad(lambda w: rf.sum(rf.layer_norm(x, w, b[:1].repeat(5)) * g))(jnp.full(5, 1.5))
    want = jax.grad(lambda w: jnp.sum(ref_layer_norm(x, w, b[:1].repeat(5)) * g))(jnp.full(5, 1.5))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
