"""Version snapshots: what is caught, what is not, and in-place differentiation."""

import dataclasses
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf
from rumus_fx.autograd import VersionSnapshot


def test_mismatch_on_saved_input():
    with rf.Tape() as tape:
        w = rf.tensor([1.0, 2.0], requires_grad=True)
        x = rf.tensor([3.0, 4.0])
        loss = rf.sum(w * x)  # MulBackward saves x for w's gradient
    x.add_(1.0)
    with pytest.raises(rf.VersionMismatch) as info:
        tape.backward(loss)
    err = info.value
    assert isinstance(err, rf.AutogradError)
    assert (err.grad_id, err.expected, err.found, err.op) == (x.grad_id, 0, 1, "MulBackward")
    assert "MulBackward" in str(err) and "version 1" in str(err) and "version 0" in str(err)
    assert "Hint" in str(err)


def test_mismatch_on_saved_output():
    with rf.Tape() as tape:
        w = rf.tensor([1.0, 2.0], requires_grad=True)
        y = rf.exp(w)  # ExpBackward saves its output
        loss = rf.sum(y)
    with rf.no_grad():
        y.mul_(2.0)
    with pytest.raises(rf.VersionMismatch, match="ExpBackward") as info:
        tape.backward(loss)
    assert info.value.grad_id == y.grad_id and info.value.op == "ExpBackward"


def test_no_error_for_data_a_record_does_not_read():
    with rf.Tape() as tape:
        w = rf.tensor([1.0, 2.0], requires_grad=True)
        x = rf.tensor([3.0, 4.0])
        y = w + x  # AddBackward reads no data
        loss = rf.sum(y * 2.0)
    x.add_(1.0)
    grads = tape.backward(loss)
    np.testing.assert_allclose(grads[w], [2.0, 2.0])


def test_record_reads_only_what_its_needed_gradients_use():
    with rf.Tape() as tape:
        w = rf.tensor([1.0, 2.0], requires_grad=True)
        x = rf.tensor([3.0, 4.0])
        loss = rf.sum(w * x)
    rec = tape.entries[0].op
    assert rec.lhs is None and rec.lhs_version is None  # w's data is not needed
    assert rec.rhs_version is not None
    w_data_unread = tape.backward(loss)
    np.testing.assert_allclose(w_data_unread[w], [3.0, 4.0])


def test_dropped_unmodified_storage_is_fine_and_not_kept_alive():
    with rf.Tape() as tape:
        w = rf.tensor([1.0, 2.0], requires_grad=True)
        x = rf.tensor([3.0, 4.0])
        loss = rf.sum(w * x)
    weak = x.storage.downgrade()
    del x
    gc.collect()
    assert weak.upgrade() is None  # recording did not keep the storage alive
    grads = tape.backward(loss)
    np.testing.assert_allclose(grads[w], [3.0, 4.0])


def test_written_then_dropped_storage_still_raises():
    with rf.Tape() as tape:
        w = rf.tensor([1.0, 2.0], requires_grad=True)
        x = rf.tensor([3.0, 4.0])
        loss = rf.sum(w * x)
    x.add_(1.0)
    weak = x.storage.downgrade()
    del x
    gc.collect()
    assert weak.upgrade() is None
    with pytest.raises(rf.VersionMismatch):
        tape.backward(loss)


def test_snapshot_check_directly():
    t = rf.tensor([1.0])
    snap = VersionSnapshot(7, t.storage.downgrade(), t.version)
    assert dataclasses.is_dataclass(snap)
    snap.check()
    t.add_(1.0)
    with pytest.raises(rf.VersionMismatch) as info:
        snap.check()
    assert (info.value.grad_id, info.value.expected, info.value.found) == (7, 0, 1)


def test_views_share_the_version():
    x = rf.tensor(np.ones((2, 3)))
    v = x.T
    r = x.reshape(6)
    d = x.detach()
    v.add_(1.0)
    assert x.version == v.version == r.version == d.version == 1


def test_inplace_through_view_invalidates_base_saved_data():
    with rf.Tape() as tape:
        w = rf.tensor(np.ones((2, 3)), requires_grad=True)
        x = rf.tensor(np.full((2, 3), 2.0))
        loss = rf.sum(w * x)
    x.T.add_(1.0)  # written through a view
    with pytest.raises(rf.VersionMismatch):
        tape.backward(loss)


def _chain(y0, x0):
    with rf.Tape() as tape:
        x = rf.tensor(x0, requires_grad=True)
        y = rf.tensor(y0) * 1.0  # non-leaf copy we may write into
        old_id = y.grad_id
        y.add_(x)
        y.mul_(y)
        assert y.grad_id != old_id and not y.is_leaf
        loss = rf.sum(y)
    assert [e.op.name for e in tape.entries] == ["AddBackward", "MulBackward", "SumBackward"]
    return tape.backward(loss)[x]


def test_chained_inplace_gradient_eager_and_jit():
    y0 = jnp.array([1.0, -2.0, 0.5])
    x0 = jnp.array([0.3, 0.7, -1.0])
    expected = jax.grad(lambda x: jnp.sum((y0 + x) ** 2))(x0)
    np.testing.assert_allclose(_chain(y0, x0), expected, rtol=1e-6)

    def f(x):
        y = rf.tensor(y0) * 1.0
        y.add_(x)
        y.mul_(y)
        return rf.sum(y)

    np.testing.assert_allclose(rf.grad(f)(x0), expected, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(rf.grad(f))(x0), expected, rtol=1e-6)


@pytest.mark.parametrize(
    "method,fn",
    [
        ("sub_", lambda y, x: y - x),
        ("div_", lambda y, x: y / x),
        ("copy_", lambda y, x: x),
    ],
)
def test_inplace_ops_are_differentiable(method, fn):
    y0 = jnp.array([1.0, -2.0, 0.5])
    x0 = jnp.array([0.3, 0.7, 1.5])

    def f(x):
        y = x * 3.0 + 1.0  # records that read no saved y: y may be written
        getattr(y, method)(x)
        return rf.sum(y * y)

    expected = jax.grad(lambda x: jnp.sum(fn(x * 3.0 + 1.0, x) ** 2))(x0)
    np.testing.assert_allclose(rf.grad(f)(x0), expected, rtol=1e-5)
    np.testing.assert_allclose(jax.jit(rf.grad(f))(x0), expected, rtol=1e-5)
    del y0


def test_inplace_on_a_saved_output_is_caught():
    def f(x):
        y = rf.exp(x)  # ExpBackward saves y itself
        y.sub_(x)
        return rf.sum(y)

    with pytest.raises(rf.VersionMismatch, match="ExpBackward"):
        rf.grad(f)(jnp.ones(3))


def test_fill_with_tensor_value_is_differentiable():
    def f(v):
        y = rf.tensor(jnp.zeros(4)) * 1.0
        y.fill_(v)
        return rf.sum(y * jnp.arange(4.0))

    np.testing.assert_allclose(rf.grad(f)(jnp.array(2.0)), 6.0)


def test_inplace_record_keeps_pre_write_buffer_privately():
    with rf.Tape() as tape:
        x = rf.tensor([2.0, 3.0], requires_grad=True)
        y = x * 1.0
        y.mul_(y)  # MulBackward keeps the pre-write y, no snapshot needed
        loss = rf.sum(y)
    rec = tape.entries[-2].op
    assert rec.name == "MulBackward"
    assert rec.lhs_version is None and rec.rhs_version is None
    np.testing.assert_allclose(np.asarray(rec.lhs), [2.0, 3.0])
    np.testing.assert_allclose(tape.backward(loss)[x], [4.0, 6.0])


def test_inplace_other_operand_is_snapshotted():
    with rf.Tape() as tape:
        w = rf.tensor([2.0, 3.0], requires_grad=True)
        y = w * 1.0
        x = rf.tensor([5.0, 7.0])
        y.mul_(x)  # saves x (other storage) with a snapshot
        loss = rf.sum(y)
    x.add_(1.0)
    with pytest.raises(rf.VersionMismatch):
        tape.backward(loss)


def test_mismatch_message_for_an_untracked_saved_tensor():
    with rf.Tape() as tape:
        w = rf.tensor([1.0, 2.0], requires_grad=True)
        x = rf.tensor([3.0, 4.0])  # untracked: no grad_id
        loss = rf.sum(w * x)
    with rf.no_grad():
        x.mul_(2.0)
    with pytest.raises(rf.VersionMismatch, match="an untracked tensor") as info:
        tape.backward(loss)
    assert info.value.grad_id is None and "grad_id=None" not in str(info.value)
