"""Anomaly mode: a NaN/Inf made by a backward record names that record, eagerly,
under jax.jit (debug callback), through checkify, and under vmap/jvp."""

from __future__ import annotations

import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import rumus_fx as rf
from rumus_fx.debug import CAUSE_FORWARD, CAUSE_RULE, CAUSE_SEED, AnomalyError


def log_chain(x):
    """Tape: 0 BroadcastMulBackward, 1 LogBackward, 2 BroadcastMulBackward, 3 SumBackward.
    At x = 0 the forward gives -inf, and LogBackward (1/x) is the first record in
    backward order whose gradient is not finite; record 0 only propagates it."""
    y = x * 2.0
    z = rf.log(y)
    return rf.sum(z * 3.0)


X0 = jnp.array([0.0, 1.0, 2.0])


def _assert_log_backward(err: AnomalyError):
    assert isinstance(err, rf.AutogradError)
    assert err.op == "LogBackward" and err.index == 1
    assert err.input_shapes == ("float32[3]",)
    assert err.inputs == (0,)
    msg = str(err)
    assert "LogBackward" in msg and "tape index 1" in msg and "float32[3]" in msg


def test_eager_names_record_index_and_shapes():
    with rf.Tape() as tape:
        x = rf.tensor(X0, requires_grad=True)
        loss = log_chain(x)
    assert tape.entries[1].op.name == "LogBackward"
    with pytest.raises(AnomalyError) as info, rf.debug.detect_anomaly():
        tape.backward(loss)
    _assert_log_backward(info.value)
    assert info.value.kind == "inf" and info.value.cause == CAUSE_RULE


def test_off_by_default_and_restored_after_the_block():
    g = rf.grad(log_chain)(X0)
    assert np.isinf(np.asarray(g)[0])  # no check without anomaly mode
    with pytest.raises(rf.AutogradError), rf.debug.detect_anomaly():
        rf.grad(log_chain)(X0)
    np.testing.assert_array_equal(rf.grad(log_chain)(X0), g)  # off again, also after an error
    with rf.debug.detect_anomaly():  # finite gradients pass through unchanged
        np.testing.assert_allclose(rf.grad(log_chain)(X0 + 1.0), 1.0 / (X0 + 1.0) * 3.0, rtol=1e-6)


def test_jit_raises_at_run_time_naming_the_record():
    with pytest.raises(rf.AutogradError) as info, rf.debug.detect_anomaly():
        jax.jit(rf.grad(log_chain))(X0)
    _assert_log_backward(info.value)
    assert info.value.cause == CAUSE_RULE
    # inside the block JAX's own error type carries the same message
    with rf.debug.detect_anomaly():
        with pytest.raises(jax.errors.JaxRuntimeError, match="LogBackward \\(tape index 1\\)"):
            jax.jit(rf.grad(log_chain))(X0)
        np.testing.assert_allclose(jax.jit(rf.grad(log_chain))(X0 + 1.0), 3.0 / (X0 + 1.0), rtol=1e-6)


def test_jit_cache_follows_the_mode():
    jg = jax.jit(rf.grad(log_chain))
    outside = jg(X0)  # traced without checks
    assert np.isinf(np.asarray(outside)[0])
    with pytest.raises(rf.AutogradError, match="LogBackward"), rf.debug.detect_anomaly():
        jg(X0)  # retraced with the checks
    np.testing.assert_array_equal(jg(X0), outside)  # back to the unchecked trace


def test_only_the_origin_is_reported_when_nan_propagates():
    """Many records downstream in backward order also see the NaN; the callbacks
    run unordered, yet only the first record (in backward order) is named."""

    def f(x):
        h = x * 1.0
        for _ in range(6):
            h = rf.tanh(h) * 1.0 + h
        y = rf.log(h - h + x)  # LogBackward at index 13; its input is x
        for _ in range(6):
            y = rf.tanh(y) * 1.0 + y  # -inf forward: tanh(-inf) = -1, fine
        return rf.sum(y)

    for _ in range(3):
        with pytest.raises(rf.AutogradError) as info, rf.debug.detect_anomaly():
            jax.jit(rf.grad(f))(X0)
        assert info.value.op == "LogBackward", str(info.value)
    with pytest.raises(rf.AutogradError) as eager, rf.debug.detect_anomaly():
        rf.grad(f)(X0)
    assert eager.value.op == "LogBackward" and eager.value.index == info.value.index


def test_forward_nan_is_not_what_is_reported():
    """log(-1) is NaN in the forward pass; LogBackward itself returns a finite
    1/x. Anomaly mode is about backward: with only x differentiated nothing is
    raised, and when the NaN reaches a record's saved values the error names
    that backward record (MulBackward) and says the forward pass made it."""

    def f(x, w):
        return rf.sum(rf.log(x) * w)

    x = jnp.array([-1.0, 1.0])
    w = jnp.ones(2)
    with rf.debug.detect_anomaly():
        gx = rf.grad(f)(x, w)
        gx_jit = jax.jit(rf.grad(f))(x, w)
    np.testing.assert_allclose(gx, [-1.0, 1.0])
    np.testing.assert_allclose(gx_jit, [-1.0, 1.0])
    for jit in (False, True):
        g = rf.grad(f, argnums=(0, 1))
        with pytest.raises(rf.AutogradError) as info, rf.debug.detect_anomaly():
            (jax.jit(g) if jit else g)(x, w)
        err = info.value
        assert err.op == "MulBackward" and err.inputs == (1,) and err.kind == "nan"
        assert err.cause == CAUSE_FORWARD
        assert "MulBackward" in str(err) and "LogBackward" not in str(err)


def test_finite_forward_infinite_backward():
    def f(x):
        return rf.sum(rf.div(1.0, x))  # forward 1e30 is finite, d/dx = -1e60 is not

    x = jnp.array([1e-30, 1.0])
    assert np.isfinite(np.asarray(jax.jit(lambda a: 1.0 / a)(x))).all()
    for jit in (False, True):
        with pytest.raises(rf.AutogradError) as info, rf.debug.detect_anomaly():
            (jax.jit(rf.grad(f)) if jit else rf.grad(f))(x)
        assert info.value.op == "DivBackward" and info.value.inputs == (1,) and info.value.kind == "inf"
        assert info.value.input_shapes == ("scalar", "float32[2]")


def test_non_finite_seed_is_blamed_on_the_seed():
    with rf.Tape() as tape:
        w = rf.tensor([1.0, 2.0], requires_grad=True)
        y = w * 3.0
    with pytest.raises(rf.AutogradError) as info, rf.debug.detect_anomaly():
        tape.backward(y, grad=jnp.array([1.0, jnp.nan]))
    assert info.value.op == "BroadcastMulBackward" and info.value.cause == CAUSE_SEED


def test_checkify_mode():
    g = rf.grad(log_chain)
    with rf.debug.detect_anomaly(mode="checkify"):
        err, out = checkify.checkify(jax.jit(g))(X0 + 1.0)
        err.throw()  # finite: nothing to throw
        np.testing.assert_allclose(out, 3.0 / (X0 + 1.0), rtol=1e-6)
        err, _ = checkify.checkify(jax.jit(g))(X0)
        assert "LogBackward (tape index 1)" in err.get()
    with pytest.raises(rf.AutogradError) as info, rf.debug.detect_anomaly(mode="checkify"):
        err, _ = checkify.checkify(jax.jit(g))(X0)
        err.throw()
    assert info.value.op == "LogBackward" and info.value.index == 1 and info.value.inputs == (0,)
    with pytest.raises(AnomalyError, match="LogBackward"), rf.debug.detect_anomaly(mode="checkify"):
        g(X0)  # eagerly the check is immediate in both modes


def test_vmap_and_jit_of_vmap():
    batch = jnp.stack([X0 + 1.0, X0, X0 + 2.0])
    for fn in (jax.vmap(rf.grad(log_chain)), jax.jit(jax.vmap(rf.grad(log_chain)))):
        with pytest.raises(rf.AutogradError) as info, rf.debug.detect_anomaly():
            fn(batch)
        assert info.value.op == "LogBackward"
        with rf.debug.detect_anomaly():
            fn(batch + 1.0)


def test_hvp_under_anomaly_mode():
    def f(x):
        return rf.sum(rf.tanh(x) * x)

    def hvp(x, v):
        return jax.jvp(rf.grad(f), (x,), (v,))[1]

    x, v = jnp.array([0.3, -0.2]), jnp.array([1.0, 0.5])
    want = jax.jvp(jax.grad(lambda a: jnp.sum(jnp.tanh(a) * a)), (x,), (v,))[1]
    with rf.debug.detect_anomaly():
        np.testing.assert_allclose(hvp(x, v), want, rtol=1e-5)
        np.testing.assert_allclose(jax.jit(hvp)(x, v), want, rtol=1e-5)
    with pytest.raises(rf.AutogradError, match="LogBackward"), rf.debug.detect_anomaly():
        jax.jit(lambda a, t: jax.jvp(rf.grad(log_chain), (a,), (t,))[1])(X0, X0)


def test_mode_is_per_thread():
    seen = []

    def other():
        seen.append(np.asarray(rf.grad(log_chain)(X0)))

    with rf.debug.detect_anomaly():
        th = threading.Thread(target=other)
        th.start()
        th.join()
    assert len(seen) == 1 and np.isinf(seen[0][0])


def test_no_jax_callback_log_noise(caplog):
    with caplog.at_level(logging.ERROR, logger="jax"):
        with pytest.raises(rf.AutogradError), rf.debug.detect_anomaly():
            jax.jit(rf.grad(log_chain))(X0)
    assert not [r for r in caplog.records if "callback failed" in r.getMessage()]


def test_bad_mode():
    with pytest.raises(ValueError, match="mode"), rf.debug.detect_anomaly("pdb"):
        pass


def test_error_pickles():
    import pickle

    err = AnomalyError("LogBackward", 1, ("float32[3]",), (0,), "inf", CAUSE_RULE)
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and back.op == "LogBackward"


def test_several_devices_defer_the_error_to_check_anomalies(monkeypatch):
    """With several devices a raising callback could hang the other devices'
    collectives (tests/test_multidevice.py runs that case on 8 devices): the
    callback records the error, check_anomalies() or the block's exit raises it."""
    monkeypatch.setattr(jax, "device_count", lambda *a, **k: 8)
    g = jax.jit(rf.grad(log_chain))
    with pytest.raises(rf.AutogradError) as info, rf.debug.detect_anomaly():
        out = g(X0)  # returns: nothing raised inside the program
        assert np.isinf(np.asarray(out)[0])
        with pytest.raises(AnomalyError) as checked:
            rf.debug.check_anomalies()
        _assert_log_backward(checked.value)
        rf.debug.check_anomalies()  # each report is raised once
        g(X0 + 0.0)  # a second bad step, left to the block's exit
    _assert_log_backward(info.value)
    with rf.debug.detect_anomaly():  # nothing left over for the next block
        g(X0 + 1.0)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_lifted_call_between_records_in_anomaly_mode(jit):
    """A lifted call's rows are checked inside its own compiled call; eagerly,
    the check's traced state stays inside that call, so the records walked
    after it (here the product ``x * 3.0``) still run: the gradient equals
    jax.grad's, and a NaN in a row is still reported as that row."""
    import rumus_fx.numpy as rnp

    def f(x):
        return rnp.sum(rnp.sqrt(x * 3.0)) * 2.0

    wrap = jax.jit if jit else (lambda h: h)
    x = jnp.asarray([1.0, 2.0])
    with rf.debug.detect_anomaly():
        got = wrap(rf.grad(f))(x)
    want = jax.grad(lambda x: jnp.sum(jnp.sqrt(x * 3.0)) * 2.0)(x)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    with pytest.raises(AnomalyError, match=r"SqrtBackward in rf\.lift\(jax\.numpy\.sqrt\) \(tape index 1\.0\)"):
        with rf.debug.detect_anomaly():
            wrap(rf.grad(f))(jnp.asarray([0.0, 2.0]))
