"""Eager backward compiled once per tape signature (Note [Whole-tape backward])."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf
from rumus_fx.autograd import whole_tape


def _loss(w, x):
    h = rf.tanh(x @ w) * 1.5 + 0.25
    return rf.sum(rf.relu(h).reshape(-1))


def _loss_jax(w, x):
    h = jnp.tanh(x @ w) * 1.5 + 0.25
    return jnp.sum(jax.nn.relu(h))


@pytest.mark.parametrize("keep_compiled", [True, False])
def test_repeated_tape_gives_the_same_gradients_compiled_or_not(monkeypatch, keep_compiled):
    # force the choice between the compiled walk and the rules (timing decides it otherwise)
    monkeypatch.setattr(whole_tape, "KEEP_IF_FASTER", float("inf") if keep_compiled else 0.0)
    whole_tape.clear_cache()
    w = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    want = jax.grad(_loss_jax)(w, jnp.ones((2, 4)))
    vg = rf.value_and_grad(_loss)
    # rules (1, 2 timed), compile (3), timed compiled and rule walks in turn (4 to 2 + 2 * TIMED), the choice
    for step in range(2 + 2 * whole_tape.TIMED + 2):
        x = jnp.full((2, 4), 1.0 + 0.0 * step)
        value, g = vg(w, x)
        np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(value, _loss_jax(w, x), rtol=1e-6)
    (state,) = whole_tape._CACHE.values()
    assert isinstance(state, whole_tape._Compiled) and state.rules is (not keep_compiled)


def test_version_check_still_runs_on_the_compiled_path(monkeypatch):
    monkeypatch.setattr(whole_tape, "KEEP_IF_FASTER", float("inf"))
    whole_tape.clear_cache()
    w0 = jnp.ones((3,))
    last = 2 + 2 * whole_tape.TIMED  # the first step after the choice runs the compiled walk
    for step in range(last + 1):
        with rf.Tape() as tape:
            w = rf.tensor(w0, requires_grad=True)
            y = w * 1.0
            z = rf.tanh(y)
            loss = rf.sum(z * z)
            if step == last:
                with rf.no_grad():
                    z.add_(1.0)  # z is saved by z * z: its backward must refuse
        if step < last:
            tape.backward(loss)
        else:
            with pytest.raises(rf.VersionMismatch):
                tape.backward(loss)
    (state,) = whole_tape._CACHE.values()
    assert isinstance(state, whole_tape._Compiled) and not state.rules


@pytest.mark.parametrize("x64", [False, True])
def test_compiled_walk_reads_saved_python_scalars_as_their_values(monkeypatch, x64):
    """Note [Eager fast path]: the compiled walk gets a record's saved python
    scalar (``t * s``) as its cached device array; the gradient follows each
    step's scalar (zero and -0.0 included: they stay python scalars), in the
    dtype the rules give, with and without x64."""
    monkeypatch.setattr(whole_tape, "KEEP_IF_FASTER", float("inf"))
    whole_tape.clear_cache()
    with jax.enable_x64(x64):
        w = jnp.linspace(-1.0, 1.0, 5)
        vg = rf.value_and_grad(lambda w, s: rf.sum(rf.tanh(w * s) * 3))
        for step, s in enumerate([2.0, 2.0, 2.0, 2.0, 2.0, 0.5, 0.0, -0.0, 3, 2.0]):
            _, g = vg(w, s)
            want = jax.grad(lambda w, s: jnp.sum(jnp.tanh(w * s) * 3))(w, s)
            assert g.dtype == want.dtype, step
            np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)
        compiled = [v for v in whole_tape._CACHE.values() if isinstance(v, whole_tape._Compiled)]
        assert compiled and not any(v.rules for v in compiled)


def test_timed_walks_take_turns_before_the_choice(monkeypatch):
    """The rule-by-rule and compiled walks are timed in turn (a burst of load on
    a shared machine then slows both, not one): after each step, how many timed
    rule walks and timed compiled calls the signature has, and its choice."""
    monkeypatch.setattr(whole_tape, "TIMED", 3)
    whole_tape.clear_cache()
    w, x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), jnp.ones((2, 4))
    vg = rf.value_and_grad(_loss)
    seen = []
    for _ in range(10):
        vg(w, x)
        (state,) = whole_tape._CACHE.values()
        timed = state.timed if isinstance(state, whole_tape._Compiled) else None
        seen.append((len(state.seconds), None if timed is None else len(timed)))
    assert seen == [(0, None), (1, None), (1, 0), (1, 1), (2, 1), (2, 2), (3, 2), (3, 3), (3, 3), (3, 3)]
    assert state.rules == (min(state.timed) > whole_tape.KEEP_IF_FASTER * min(state.seconds))


def test_compiled_walk_takes_the_records_compiler_options(monkeypatch):
    """Note [Eager compiler options]: a tape holding eager conv2d records
    compiles its whole-tape walk with the options they ask for, and the
    compiled walk gives jax.grad's gradients."""
    monkeypatch.setattr(whole_tape, "KEEP_IF_FASTER", float("inf"))
    whole_tape.clear_cache()
    options = []
    real = whole_tape._compile
    monkeypatch.setattr(whole_tape, "_compile", lambda *a: options.append(a[-1]) or real(*a))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 3, 6, 6)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 3, 3, 3)), jnp.float32) / 5

    def loss(w, x):
        return rf.sum(rf.relu(rf.conv2d(x, w, None, 1, 1)) * 0.5)

    def loss_jax(w, x):
        return jnp.sum(jax.nn.relu(jax.lax.conv_general_dilated(x, w, (1, 1), [(1, 1), (1, 1)])) * 0.5)

    want = jax.grad(loss_jax)(w, x)
    for _ in range(2 + 2 * whole_tape.TIMED + 1):  # past the choice
        np.testing.assert_allclose(rf.grad(loss)(w, x), want, rtol=1e-5, atol=1e-5)
    assert options == [rf.CPU_COMPILER_OPTIONS]
    (state,) = whole_tape._CACHE.values()
    assert isinstance(state, whole_tape._Compiled) and not state.rules


def test_one_record_tape_runs_its_compiled_walk_without_a_race(monkeypatch):
    """A tape of one record (a lifted loss) compiles its walk at the second
    sighting and keeps it, with no timed walks: the compiled walk is the record's
    own program with less Python work per call. KEEP_IF_FASTER = 0 would make any
    race choose the rules; here none runs. Every step equals jax.grad."""
    monkeypatch.setattr(whole_tape, "KEEP_IF_FASTER", 0.0)
    whole_tape.clear_cache()
    w, x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), jnp.ones((2, 4))
    g = rf.grad(rf.lift(_loss_jax))
    kinds = []
    for step in range(5):
        np.testing.assert_allclose(g(w, x * (1 + step)), jax.grad(_loss_jax)(w, x * (1 + step)), rtol=1e-6, atol=1e-6)
        (state,) = whole_tape._CACHE.values()
        kinds.append((type(state).__name__, len(state.seconds), len(getattr(state, "timed", ())), state.rules))
    assert kinds == [("_Seen", 0, 0, False)] + [("_Compiled", 0, 0, False)] * 4, kinds
