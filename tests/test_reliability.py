"""Reliability under use: deferred elementwise ops from several threads at once
(Note [Deferred ops and threads] in rumus_fx/lazy.py)."""

import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf
from rumus_fx import lazy


def _chain_work(n: int, k: int, reps: int = 3) -> list:
    """``reps`` tapes of ``tanh(h * 1.1 + 0.01)`` chains of ``n`` ops: the
    values, record names and gradients of each (the first sighting of a run
    goes op by op, later ones as one compiled program)."""
    x0 = np.linspace(-1.0, 1.0, 6).astype(np.float32) * (k + 1) / 8
    out = []
    for _ in range(reps):
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


@pytest.mark.parametrize(
    "lengths,reps",
    [
        pytest.param((3, 9, 5, 2, 1, 6, 4, 8), 2, id="short"),
        pytest.param((5, 50, 200, 7, 13, 1, 100, 260, 33, 2), 3, id="long", marks=pytest.mark.slow),
    ],
)
def test_threads_record_and_backward_their_own_chains_exactly(lengths, reps):
    """Eight or more threads at a tiny switch interval, each recording its own
    tapes of tanh chains of different lengths: each thread's values, records
    and gradients are bit for bit those of the same thread run alone."""
    args = [(n, k, reps) for k, n in enumerate(lengths)]
    alone = _in_threads(_chain_work, args, at_once=False)
    together = _in_threads(_chain_work, args, at_once=True)
    for k, n in enumerate(lengths):
        for (v0, r0, g0), (v1, r1, g1) in zip(alone[k], together[k]):
            assert r1 == r0 and len(r0) == 3 * n + 1
            np.testing.assert_array_equal(v1, v0)
            np.testing.assert_array_equal(g1, g0)
    # and the gradient is the right one
    x0 = np.linspace(-1.0, 1.0, 6).astype(np.float32) / 8

    def f(x):
        for _ in range(lengths[0]):
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


# -- backward(create_graph=True) on the Tape API, under an enclosing tape ---------

_X = np.random.default_rng(3).standard_normal((4, 3))
_W0 = np.random.default_rng(4).standard_normal(3)
_B0 = np.float64(0.3)


def _penalty_jnp(w, b, track="wb"):
    """The sum of squares of the loss's gradients with respect to ``track``."""
    x = jnp.asarray(_X)

    def loss(w, b):
        return jnp.sum(jnp.tanh(x @ w + b) * (x @ w))

    argnums = tuple(i for i, k in enumerate("wb") if k in track)
    return sum(jnp.sum(g * g) for g in jax.grad(loss, argnums=argnums)(w, b))


def _penalty_rf(w0, b0, track, backward=True):
    """The PyTorch-style gradient penalty: the inner tape's backward recorded
    on ``outer``; returns the penalty, ``outer``'s length and its gradients
    (with respect to the tensors in ``track``, the tracked ones)."""
    with rf.Tape() as outer:
        w = rf.tensor(w0, requires_grad="w" in track)
        b = rf.tensor(b0, requires_grad="b" in track)
        x = rf.tensor(jnp.asarray(_X))
        with rf.Tape() as inner:
            loss = rf.sum(rf.tanh(x @ w + b) * (x @ w))
        grads = inner.backward(loss, create_graph=True)
        wanted = [t for t, k in ((w, "w"), (b, "b")) if k in track]
        penalty = rf.sum(grads[wanted[0]] * grads[wanted[0]])
        for t in wanted[1:]:
            penalty = penalty + rf.sum(grads[t] * grads[t])
    n = len(outer)
    if not backward:
        return penalty.value, n, []
    g = outer.backward(penalty)
    return penalty.value, n, [g[t] for t in wanted]


def _fd(f, x, eps=1e-6):
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        d = np.zeros_like(x)
        d[i] = eps
        out[i] = (f(x + d) - f(x - d)) / (2 * eps)
    return out


@pytest.mark.parametrize("track", ["w", "b", "wb"])
def test_create_graph_gradient_penalty_recorded_on_the_enclosing_tape(x64, track):
    """Each differentiable argument alone and both together, against jax.grad."""
    w0, b0 = jnp.asarray(_W0), jnp.asarray(_B0)
    value, n, got = _penalty_rf(w0, b0, track)
    assert n > 0  # the walk (and the inner forward it reads) is on ``outer``
    np.testing.assert_allclose(value, _penalty_jnp(w0, b0, track), rtol=1e-12)
    argnums = tuple(i for i, k in enumerate("wb") if k in track)
    want = jax.grad(lambda w, b: _penalty_jnp(w, b, track), argnums=argnums)(w0, b0)
    for g, wv in zip(got, want):
        np.testing.assert_allclose(g, wv, rtol=1e-9, atol=1e-12)


@pytest.mark.slow
def test_create_graph_gradient_penalty_finite_differences(x64):
    w0, b0 = jnp.asarray(_W0), jnp.asarray(_B0)
    _, _, (gw, gb) = _penalty_rf(w0, b0, "wb")
    fd_w = _fd(lambda w: float(_penalty_rf(jnp.asarray(w), b0, "wb", False)[0]), w0)
    fd_b = _fd(lambda b: float(_penalty_rf(w0, jnp.asarray(b), "wb", False)[0]), b0)
    np.testing.assert_allclose(gw, fd_w, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(gb, fd_b, rtol=1e-5, atol=1e-7)


def test_create_graph_gradient_penalty_under_jit():
    w0 = jnp.asarray(_W0, jnp.float32)
    b0 = jnp.asarray(_B0, jnp.float32)

    @jax.jit
    def step(w, b):
        return _penalty_rf(w, b, "wb")[2]

    got = step(w0, b0)
    want = jax.grad(_penalty_jnp, argnums=(0, 1))(w0, b0)
    for g, wv in zip(got, want):
        np.testing.assert_allclose(g, wv, rtol=2e-5, atol=1e-6)


def test_third_derivative_through_three_nested_tapes(x64):
    w0 = jnp.asarray([0.3, -0.7, 1.1])

    def f_jnp(w):
        return jnp.sum(jnp.tanh(w) * w * w)

    def sum_grad(f):
        return lambda w: jnp.sum(jax.grad(f)(w))

    want = jax.grad(sum_grad(sum_grad(f_jnp)))(w0)
    with rf.Tape() as t1:
        w = rf.tensor(w0, requires_grad=True)
        with rf.Tape() as t2:
            with rf.Tape() as t3:
                y = rf.sum(rf.tanh(w) * w * w)
            s1 = rf.sum(t3.backward(y, create_graph=True)[w])  # recorded on t2
        s2 = rf.sum(t2.backward(s1, create_graph=True)[w])  # recorded on t1
    np.testing.assert_allclose(t1.backward(s2)[w], want, rtol=1e-10)
