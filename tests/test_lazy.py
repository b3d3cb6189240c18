"""Deferred elementwise ops (Note [Deferred elementwise ops] in rumus_fx/lazy.py):
values, gradients and records equal to the per-op path; what is deferred and
what is not; the bounds on what waits."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf
from rumus_fx import lazy

# each deferrable op, as rf code and as its jnp oracle
OPS = [
    ("mul", lambda h: h * 1.01, lambda h: h * 1.01),
    ("add", lambda h: h + 0.1, lambda h: h + 0.1),
    ("sub", lambda h: h - 3, lambda h: h - 3),
    ("div", lambda h: h / 1.7, lambda h: h / 1.7),
    ("relu", rf.relu, jax.nn.relu),
    ("tanh", rf.tanh, jnp.tanh),
    ("sigmoid", rf.sigmoid, jax.nn.sigmoid),
    ("mul0", lambda h: h * 0.0 + 1.0, lambda h: h * 0.0 + 1.0),  # zero: never a cached scalar
    ("neg", rf.neg, jnp.negative),
    ("exp", lambda h: rf.exp(h * 0.1), lambda h: jnp.exp(h * 0.1)),
    ("log", lambda h: rf.log(rf.sigmoid(h) + 0.5), lambda h: jnp.log(jax.nn.sigmoid(h) + 0.5)),
]


@contextlib.contextmanager
def deferral(on: bool):
    old = lazy.set_enabled(on)
    try:
        yield
    finally:
        lazy.set_enabled(old)


def chain(ops, n):
    def f(h):
        for i in range(n):
            h = ops[i % len(ops)](h)
        return h

    return f


RF_OPS = [o[1] for o in OPS]
JNP_OPS = [o[2] for o in OPS]


def _loss_rf(x):
    return rf.sum(chain(RF_OPS, 23)(x))


def _loss_jnp(x):
    return jnp.sum(chain(JNP_OPS, 23)(x))


def test_ops_defer_and_values_wait_for_a_read():
    x = rf.tensor(jnp.linspace(-2, 2, 8, dtype=jnp.float32))
    lazy.flush()
    y = rf.tanh(x * 2.0 + 1.0)
    assert isinstance(y.storage._buffer, lazy.Lazy)
    assert lazy.pending() == 3
    assert y.shape == (8,) and y.dtype == jnp.float32  # known without computing
    np.testing.assert_array_equal(y.value, jnp.tanh(jnp.linspace(-2, 2, 8, dtype=jnp.float32) * 2.0 + 1.0))
    assert lazy.pending() == 0
    assert isinstance(y.storage._buffer, jax.Array)
    z = y * 3.0
    assert lazy.pending() == 1
    x.value  # reading any tensor computes what waits
    assert lazy.pending() == 0 and z.storage._buffer.array is not None


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
def test_values_equal_the_per_op_path_bit_for_bit(dtype):
    """The first sighting runs op by op, later ones as one compiled program:
    both give exactly what each op gives undeferred (XLA:CPU)."""
    with jax.enable_x64(dtype == "float64"):
        x0 = jnp.asarray(np.random.default_rng(1).normal(size=(3, 5)), dtype)
        with deferral(False):
            want = chain(RF_OPS, 41)(rf.tensor(x0)).value
        for _ in range(3):  # per-op, compiled, compiled again
            lazy.flush()
            got = chain(RF_OPS, 41)(rf.tensor(x0))
            assert isinstance(got.storage._buffer, lazy.Lazy)
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(np.asarray(got.value, np.float64), np.asarray(want, np.float64))
            assert got.value.committed == want.committed and got.value.weak_type == want.weak_type


@pytest.mark.parametrize("name,rf_op,jnp_op", OPS, ids=[o[0] for o in OPS])
def test_each_op_alone_gradient_matches_jax(name, rf_op, jnp_op):
    x = jnp.asarray(np.random.default_rng(2).normal(size=(4, 3)), jnp.float32)
    for _ in range(3):  # the same tape three times: per-op, then one compiled run
        v, g = rf.value_and_grad(lambda h: rf.sum(rf_op(rf_op(h))))(x)
        v0, g0 = jax.value_and_grad(lambda h: jnp.sum(jnp_op(jnp_op(h))))(x)
        # a float32 sum of 12 terms of size ~1 that cancel to ~0.03: its rounding depends on the
        # order of the sum (jax 0.11's eager sum and rf's compiled one differ by ~2e-7)
        np.testing.assert_allclose(v, v0, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-6)


def test_chain_gradient_matches_jax_and_finite_differences(x64):
    x = jnp.asarray(np.random.default_rng(3).normal(size=(6,)), jnp.float64)
    want = jax.grad(_loss_jnp)(x)
    for _ in range(3):
        np.testing.assert_allclose(rf.grad(_loss_rf)(x), want, rtol=1e-12, atol=1e-12)
    eps = 1e-6
    fd = np.array([(_loss_jnp(x.at[i].add(eps)) - _loss_jnp(x.at[i].add(-eps))) / (2 * eps) for i in range(6)])
    np.testing.assert_allclose(rf.grad(_loss_rf)(x), fd, rtol=1e-6, atol=1e-8)


def test_records_show_arrays_once_inspected():
    x = rf.tensor(jnp.linspace(-1, 1, 6, dtype=jnp.float32), requires_grad=True)
    with rf.Tape() as tape:
        y = rf.tanh(x * 3.0)
        z = rf.relu(y)
        loss = rf.sum(z)
    entries = tape.entries
    assert [e.op.name for e in entries[:3]] == ["BroadcastMulBackward", "TanhBackward", "ReluBackward"]
    assert entries[1].op.output is y.value  # the saved output *is* the tensor's value
    assert entries[2].op.input is y.value
    assert entries[1].provenance == (("output", None, y.grad_id),)
    assert entries[2].provenance == (("input", None, y.grad_id),)
    grads = tape.backward(loss)
    np.testing.assert_allclose(
        grads[x], jax.grad(lambda v: jnp.sum(jax.nn.relu(jnp.tanh(v * 3.0))))(jnp.linspace(-1, 1, 6)), rtol=1e-6
    )


def test_a_write_after_a_deferred_record_is_caught():
    x = rf.tensor(jnp.ones((4,), jnp.float32), requires_grad=True)
    with rf.Tape() as tape:
        y = rf.tanh(x * 0.5)  # saves its (pending) output
        y.mul_(2.0)  # flushes, then writes
        loss = rf.sum(y)
    with pytest.raises(rf.VersionMismatch):
        tape.backward(loss)


def test_only_referenced_nodes_leave_the_compiled_run():
    x = rf.tensor(jnp.ones((5,), jnp.float32))
    for _ in range(3):
        lazy.flush()
        a = x * 2.0
        kept = a + 1.0  # referenced: an output of the run
        b = kept * 3.0 - 1.0  # the ``* 3.0`` node is referenced by nothing but its consumer
        del a
        b_value = b.value
    key = next(k for k in lazy._PROGRAMS if [kind.name for kind, _ in k[0]] == ["mul", "add", "mul", "sub"])
    assert key[1] == (1, 3), key  # ``a`` was dropped, ``b * 3.0`` only fed ``- 1.0``
    np.testing.assert_array_equal(b_value, jnp.full((5,), 8.0, jnp.float32))
    np.testing.assert_array_equal(kept.value, jnp.full((5,), 3.0, jnp.float32))


def test_an_unreferenced_node_read_after_all_is_recomputed():
    x = rf.tensor(jnp.arange(4, dtype=jnp.float32))
    lazy.flush()
    a = x * 2.0
    node = a.storage._buffer
    b = a + 1.0
    del a  # ``node`` is held here (a reference the run counts), so it stays an output
    b.value
    assert node.array is not None
    np.testing.assert_array_equal(lazy.value(node), jnp.arange(4, dtype=jnp.float32) * 2.0)


def test_what_waits_stays_bounded():
    x = rf.tensor(jnp.ones((3,), jnp.float32), requires_grad=True)
    lazy.flush()
    h = x
    with rf.Tape():
        for _ in range(3 * lazy.MAX_PENDING):
            h = rf.tanh(h * 0.5)  # records that save pending values, never read
            assert lazy.pending() <= lazy.MAX_PENDING
            assert len(lazy.queue().saved) <= lazy.MAX_PENDING
    np.testing.assert_allclose(h.value, np.zeros(3), atol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda: jnp.arange(6, dtype=jnp.int32),  # not floating
        lambda: jnp.asarray(2.0),  # 0-d
        lambda: jnp.broadcast_to(jnp.asarray(1.5), (3,)),  # weakly typed
    ],
    ids=["int", "0-d", "weak"],
)
def test_what_does_not_defer(make):
    arr = make()
    lazy.flush()
    t = rf.tensor(arr)
    out = rf.relu(t) if arr.dtype == jnp.float32 and arr.ndim else t * 2
    assert not isinstance(out.storage._buffer, lazy.Lazy)
    assert lazy.pending() == 0


def test_views_and_traces_do_not_defer():
    x = rf.tensor(jnp.ones((2, 3), jnp.float32))
    lazy.flush()
    assert not isinstance((x.T * 2.0).storage._buffer, lazy.Lazy)  # a view: not contiguous

    def f(v):
        out = rf.tanh(rf.tensor(v) * 2.0)
        assert not isinstance(out.storage._buffer, lazy.Lazy)
        return out.value

    np.testing.assert_allclose(jax.jit(f)(jnp.ones(3)), jnp.tanh(2.0 * jnp.ones(3)), rtol=1e-6)
    assert lazy.pending() == 0


def test_a_run_computes_under_the_device_it_was_made_under():
    devices = jax.devices()
    target = devices[-1]
    x = rf.tensor(jnp.ones((3,), jnp.float32))
    lazy.flush()
    with jax.default_device(target):
        y = rf.tanh(x * 2.0)
        with deferral(False):
            want = rf.tanh(x * 2.0).value
    assert isinstance(y.storage._buffer, lazy.Lazy)
    got = y.value  # computed outside the block
    assert got.sharding == want.sharding and got.committed == want.committed
    np.testing.assert_array_equal(got, want)


def test_a_changed_default_device_flushes_the_run():
    x = rf.tensor(jnp.ones((3,), jnp.float32))
    lazy.flush()
    y = x * 2.0
    assert lazy.pending() == 1
    with jax.default_device(jax.devices()[-1]):
        z = y + 1.0
        assert lazy.pending() == 1  # ``y`` was computed first, ``z`` waits alone
    np.testing.assert_array_equal(z.value, jnp.full((3,), 3.0, jnp.float32))


def test_large_int_scalars_raise_at_the_op():
    x = rf.tensor(jnp.ones((3,), jnp.float32))
    with pytest.raises(OverflowError):
        x * 2**40


def test_a_run_made_under_x64_converts_its_scalars_there():
    with jax.enable_x64(True):
        x = rf.tensor(jnp.full((3,), 2.0, jnp.float64))
        lazy.flush()
        y = (x * 1.01) * 1.01  # python scalars convert to float64 here
        with deferral(False):
            want = ((x * 1.01) * 1.01).value
    got = y.value  # computed outside the block
    assert got.dtype == jnp.float64
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_debug_nans_checks_at_the_op():
    x = rf.tensor(-jnp.ones((3,), jnp.float32))
    with jax.debug_nans(True):
        with pytest.raises(FloatingPointError):
            rf.log(x)
    assert lazy.pending() == 0


def test_threads_each_get_their_own_values():
    """Runs made and computed from several threads at once (a flush takes
    whatever waits, from any thread) give each thread its own chain's values."""
    import threading

    errors = []

    def work(k):
        try:
            x0 = jnp.full((4,), 0.1 * k, jnp.float32)
            for _ in range(20):
                got = chain(RF_OPS, 17)(rf.tensor(x0)).value
                np.testing.assert_allclose(got, chain(JNP_OPS, 17)(x0), rtol=1e-6)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_gradients_of_gradients_through_deferred_records(x64):
    """The nested backward differentiates deferred records' rules through their
    saved (then computed) values: tanh's and sigmoid's outputs, relu's input."""
    x = jnp.linspace(-1.0, 1.0, 5, dtype=jnp.float64)

    def f(h):
        return rf.sum(rf.sigmoid(rf.relu(rf.tanh(h * 2.0) + 0.5)) * 3.0)

    def f_jnp(h):
        return jnp.sum(jax.nn.sigmoid(jax.nn.relu(jnp.tanh(h * 2.0) + 0.5)) * 3.0)

    want = jax.grad(lambda h: jnp.sum(jax.grad(f_jnp)(h) ** 2))(x)
    for _ in range(3):
        got = rf.grad(lambda h: rf.sum(rf.grad(f)(h) * rf.grad(f)(h)))(x)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
