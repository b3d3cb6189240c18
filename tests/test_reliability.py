"""Reliability under use: deferred elementwise ops from several threads at once
(Note [Deferred ops and threads] in rumus_fx/lazy.py)."""

import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np

import rumus_fx as rf
from rumus_fx import lazy

_LENGTHS = (5, 50, 200, 7, 13, 1, 100, 33)  # one chain length per thread


def _chain_work(n: int, k: int) -> list:
    """Three tapes of ``tanh(h * 1.1 + 0.01)`` chains of ``n`` ops: the
    values, record names and gradients of each."""
    x0 = np.linspace(-1.0, 1.0, 6).astype(np.float32) * (k + 1) / 8
    out = []
    for _ in range(3):
        with rf.Tape() as tape:
            x = rf.tensor(x0, requires_grad=True)
            h = x
            for _ in range(n):
                h = rf.tanh(h * 1.1 + 0.01)
            loss = rf.sum(h)
        names = [type(e.op).__name__ for e in tape.entries]
        g = tape.backward(loss)[x]
        out.append((np.asarray(h.value), names, np.asarray(g)))
    return out


def _in_threads(target, args_list, at_once: bool) -> dict:
    results: dict = {}
    errors: list = []

    def run(i, args):
        try:
            results[i] = target(*args)
        except Exception as e:  # reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args_list)]
    if at_once:
        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            sys.setswitchinterval(old)
    else:  # one after the other: each alone
        for t in threads:
            t.start()
            t.join()
    assert not errors, errors[0]
    return results


def test_threads_record_and_backward_their_own_chains_exactly():
    """Eight threads at a tiny switch interval, each recording its own tapes of
    tanh chains of different lengths: each thread's values, records and
    gradients are bit for bit those of the same thread run alone."""
    args = [(n, k) for k, n in enumerate(_LENGTHS)]
    alone = _in_threads(_chain_work, args, at_once=False)
    together = _in_threads(_chain_work, args, at_once=True)
    for k, n in enumerate(_LENGTHS):
        for (v0, r0, g0), (v1, r1, g1) in zip(alone[k], together[k]):
            assert r1 == r0 and len(r0) == 3 * n + 1
            np.testing.assert_array_equal(v1, v0)
            np.testing.assert_array_equal(g1, g0)
    # and the gradient is the right one
    x0 = np.linspace(-1.0, 1.0, 6).astype(np.float32) / 8

    def f(x):
        for _ in range(5):
            x = jnp.tanh(x * 1.1 + 0.01)
        return jnp.sum(x)

    np.testing.assert_allclose(alone[0][0][2], jax.grad(f)(x0), rtol=1e-5)


def test_a_pending_value_handed_to_another_thread():
    """A tensor whose value still waits in one thread's run is read, and
    computed on, in another: that run is flushed under its own lock."""
    x0 = jnp.linspace(-1.0, 1.0, 5, dtype=jnp.float32)
    made: dict = {}
    ready, done = threading.Event(), threading.Event()

    def maker():
        h = rf.tensor(x0)
        for _ in range(10):
            h = rf.tanh(h * 0.9)
        made["h"] = h
        made["pending"] = lazy.pending()
        ready.set()
        done.wait(30)
        made["own"] = np.asarray(h.value)

    t = threading.Thread(target=maker)
    t.start()
    ready.wait(30)
    assert made["pending"] == 20 and lazy.pending() == 0
    h = made["h"]
    assert isinstance(h.storage._buffer, lazy.Lazy)
    reused = rf.exp(h * 2.0)  # a node made on another thread's pending node
    got = np.asarray(h.value)
    done.set()
    t.join()
    want = x0
    for _ in range(10):
        want = jnp.tanh(want * 0.9)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_array_equal(made["own"], got)
    np.testing.assert_allclose(reused.value, jnp.exp(want * 2.0), rtol=1e-6)


def test_a_tape_recorded_in_one_thread_backwarded_in_another():
    x0 = jnp.linspace(-1.0, 1.0, 5, dtype=jnp.float32)
    box: dict = {}

    def record():
        with rf.Tape() as tape:
            x = rf.tensor(x0, requires_grad=True)
            loss = rf.sum(rf.tanh(rf.sigmoid(x * 2.0) - 0.5))
        box.update(tape=tape, x=x, loss=loss)

    t = threading.Thread(target=record)
    t.start()
    t.join()
    g = box["tape"].backward(box["loss"])[box["x"]]
    want = jax.grad(lambda v: jnp.sum(jnp.tanh(jax.nn.sigmoid(v * 2.0) - 0.5)))(x0)
    np.testing.assert_allclose(g, want, rtol=1e-6)
