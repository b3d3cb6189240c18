"""The in-place, view, version-counter and saved-tensor scenarios of PyTorch's
autograd test-suite (``test/test_autograd.py``: ``TestAutograd`` and
``TestAllowMutationOnSaved``; functorch's no_grad tests of
``test/functorch/test_eager_transforms.py``), ported to rumus_fx with
PyTorch's expected values written in (no torch import).

PyTorch accumulates gradients into ``.grad`` across backward calls; a rumus_fx
``Tape.backward`` returns the gradients of one call, so where PyTorch compares an
accumulated ``.grad`` the port compares the sum of the calls. Where rumus_fx
deliberately refuses (``rf.AutogradError``) what PyTorch allows, the test
asserts the refusal and the comment says why.
"""

from __future__ import annotations

import gc
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf

ONES = np.ones((5, 5))


# -- TestAutograd.test_inplace ----------------------------------------------------


def test_inplace_add_does_not_invalidate_add_but_invalidates_mul():
    with rf.Tape() as tape:
        x = rf.tensor(ONES, requires_grad=True)
        y = rf.tensor(ONES * 4, requires_grad=True)
        z = x * y
        q = z + y
        w = z * y
        z.add_(2.0)
    # Add doesn't need its inputs to do backward, so it shouldn't raise
    grads = tape.backward(q, retain=True, grad=ONES)
    np.testing.assert_allclose(grads[x], ONES * 4)  # dq/dx = y
    np.testing.assert_allclose(grads[y], ONES * 2)  # dq/dy = x + 1
    # Mul saves both inputs in forward, so it should raise
    with pytest.raises(rf.VersionMismatch):
        tape.backward(w, grad=ONES)


def test_inplace_result_is_usable_and_dirty_inputs_raise():
    with rf.Tape() as tape:
        x = rf.tensor(ONES, requires_grad=True)
        y = rf.tensor(ONES * 4, requires_grad=True)
        z = x * y
        q = z * y
        r = z + y
        w = z.add_(y)
        assert w is z
        # backward of a non-scalar output with an explicit cotangent, as PyTorch's
        # w.backward(torch.ones(5, 5))
    # w is the last expression, so this should succeed
    grads = tape.backward(w, retain=True, grad=ONES)
    np.testing.assert_allclose(grads[x], ONES * 4)
    np.testing.assert_allclose(grads[y], ONES * 2)
    # r doesn't use the modified value in backward, so it should succeed
    grads = tape.backward(r, retain=True, grad=ONES)
    np.testing.assert_allclose(grads[x], ONES * 4)
    # q uses dirty z, so it should raise
    with pytest.raises(rf.VersionMismatch):
        tape.backward(q, grad=ONES)


def test_inplace_exp_and_accumulated_gradient():
    # PyTorch: z.exp_(); rumus_fx has no exp_, z.copy_(rf.exp(z)) writes the same value
    with rf.Tape() as tape:
        x = rf.tensor(ONES, requires_grad=True)
        y = rf.tensor(ONES * 4, requires_grad=True)
        m = x / 2.0
        z = m + y / 8.0
        q = z * y
        r = z + y
        prev_version = z.version
        w = z.copy_(rf.exp(z))
        assert z.version != prev_version
    g_r = tape.backward(r, retain=True, grad=ONES)[x]
    np.testing.assert_allclose(g_r, ONES / 2)
    g_w = tape.backward(w, retain=True, grad=ONES)[x]
    np.testing.assert_allclose(g_r + g_w, np.full((5, 5), (1 + math.e) / 2))  # PyTorch's accumulated x.grad
    with pytest.raises(rf.VersionMismatch):
        tape.backward(q, grad=ONES)


def test_inplace_on_a_clone_of_a_leaf():
    with rf.Tape() as tape:
        leaf = rf.tensor(ONES, requires_grad=True)
        x = leaf * 1.0  # leaf.clone()
        x.add_(10.0)
        np.testing.assert_allclose(x.value, ONES * 11)
        # x should be still usable
        y = x + 2.0
    np.testing.assert_allclose(tape.backward(y, grad=ONES)[leaf], ONES)
    with rf.Tape() as tape:
        leaf = rf.tensor(ONES, requires_grad=True)
        x = leaf * 1.0
        x.add_(10.0)
        y = x + 2.0
        z = x * y
        x.add_(2.0)
    with pytest.raises(rf.VersionMismatch):
        tape.backward(z, grad=ONES)


# -- TestAutograd.test_version_counter, test_saved_variable_version_counter ------


def test_version_counter():
    x = rf.tensor(np.random.default_rng(0).standard_normal((1, 2)))
    saved = x.version
    x.add_(1.0).add_(1.0)  # in-place ops return self and bump the version
    assert x.version > saved
    xz = x.reshape(1, 2)  # a view shares the version counter
    assert x.version == xz.version
    xz.add_(1.0)
    assert x.version == xz.version
    x.add_(1.0)
    assert x.version == xz.version == 4


def test_saved_variable_version_counter():
    with rf.Tape() as tape:
        a = rf.tensor(np.random.default_rng(1).uniform(size=2), requires_grad=True)
        b = rf.exp(a)
        loss = rf.sum(b)
    rec = tape.entries[0].op
    snap = rec.snapshots()[0]
    np.testing.assert_allclose(rec.saved_arrays()["output"], b.value)
    assert snap.recorded_version == b.version
    with rf.no_grad():
        b.add_(1.0)
    # PyTorch's saved variable shares b's storage, so it reads b + 1 with b's new
    # version. rumus_fx's record keeps the immutable pre-write buffer (copy-on-write)
    # and the snapshot keeps the old version, so backward refuses instead of
    # differentiating with a value the record never saw.
    np.testing.assert_allclose(rec.saved_arrays()["output"], b.value - 1.0)
    assert snap.recorded_version == b.version - 1
    with pytest.raises(rf.VersionMismatch, match="ExpBackward"):
        tape.backward(loss)


def test_no_grad_modifies_version():
    with rf.Tape() as tape:
        x = rf.tensor(np.random.default_rng(2).standard_normal(5), requires_grad=True)
        y = rf.tensor(np.random.default_rng(3).standard_normal(5), requires_grad=True)
        z = rf.sum(x * y)
    with rf.no_grad():
        x.mul_(2.0)
    with pytest.raises(rf.VersionMismatch, match="version"):
        tape.backward(z)


# -- TestAutograd.test_detach ----------------------------------------------------


def test_detach():
    with rf.Tape() as tape:
        x = rf.tensor(np.random.default_rng(4).standard_normal((10, 10)), requires_grad=True)
        y = (x + 2.0).detach()
        z = y * 4.0 + 2.0
        assert not y.requires_grad and not z.requires_grad
        y = (x * 2.0).detach()
        assert not y.requires_grad
        z = x + y
    # "an incorrect gradient, but we assume that's what the user wanted"
    np.testing.assert_allclose(tape.backward(z, grad=np.ones((10, 10)))[x], np.ones((10, 10)))


def test_detach_shares_storage_and_version_but_not_history():
    with rf.Tape() as tape:
        x = rf.tensor(np.ones(3), requires_grad=True)
        a = x * 2.0
        d = a.detach()
        assert d.storage is a.storage and d.version == a.version
        loss = rf.sum(a + d)
    np.testing.assert_allclose(tape.backward(loss)[x], np.full(3, 2.0))


# -- TestAutograd.test_backward_twice* -------------------------------------------


def _b():
    return rf.tensor(np.random.default_rng(5).standard_normal(3), requires_grad=True)


def test_backward_twice_with_saved_values():
    # PyTorch: c[[1, 2]] = b[[1, 1]] into zeros; here c = zeros + index of b
    with rf.Tape() as tape:
        b = _b()
        c = rf.stack([b[0] * 0.0, b[1], b[1]]) * 1.0
    np.testing.assert_allclose(tape.backward(c, grad=np.ones(3))[b], [0.0, 2.0, 0.0])
    with pytest.raises(rf.AutogradError, match="retain=True"):
        tape.backward(c, grad=np.ones(3))


def test_backward_twice_retained_graph_with_saved_values():
    with rf.Tape() as tape:
        b = _b()
        c = rf.stack([b[0] * 0.0, b[1], b[1]]) * 1.0
    first = tape.backward(c, grad=np.ones(3), retain=True)[b]
    second = tape.backward(c, grad=np.ones(3))[b]
    np.testing.assert_allclose(first + second, [0.0, 4.0, 0.0])  # PyTorch's accumulated b.grad


def test_backward_twice_without_saved_values():
    with rf.Tape() as tape:
        b = _b()
        c = b + 1.0
    np.testing.assert_allclose(tape.backward(c, grad=np.ones(3))[b], np.ones(3))
    # PyTorch allows a second backward through records that saved nothing. A
    # rumus_fx tape releases all its records on the first backward (one rule,
    # whatever the records saved), so a second call without retain=True raises.
    with pytest.raises(rf.AutogradError, match="consumed"):
        tape.backward(c, grad=np.ones(3))


def test_backward_twice_retained_graph_without_saved_values():
    with rf.Tape() as tape:
        b = _b()
        c = b + 1.0
    first = tape.backward(c, grad=np.ones(3), retain=True)[b]
    second = tape.backward(c, grad=np.ones(3))[b]
    np.testing.assert_allclose(first + second, np.full(3, 2.0))


# -- TestAutograd.test_requires_grad_inplace, test_no_requires_grad_inplace ------


def test_requires_grad_inplace():
    with rf.Tape():
        a = rf.tensor(np.random.default_rng(6).standard_normal((5, 5)))
        b = rf.tensor(np.random.default_rng(7).standard_normal((5, 5)), requires_grad=True)
        a.add_(b)
        assert a.requires_grad
        a = rf.tensor(np.random.default_rng(6).standard_normal((5, 5))) + 0.0  # non-leaf
        a.add_(b)
        assert a.requires_grad


def test_no_requires_grad_inplace():
    # a write before the tensor requires grad is a plain mutation
    a = rf.tensor(np.zeros((2, 3)))
    a.add_(5.0)
    b = a.reshape(6)  # same but through a view
    b.add_(5.0)
    grads = rf.grad(lambda t: rf.sum(t))(a)
    np.testing.assert_allclose(grads, np.ones((2, 3)))
    # should fail if requires_grad=True when we modify in-place
    with rf.Tape():
        a = rf.tensor(np.zeros((2, 3)), requires_grad=True)
        b = a.reshape(6)
        with pytest.raises(rf.AutogradError, match="leaf"):
            a.add_(5.0)
        with pytest.raises(rf.AutogradError):
            b.add_(5.0)


# -- TestAutograd.test_inplace_on_view_* ------------------------------------------
# PyTorch rebases every view of a base onto the history of an in-place write
# (CopySlices). rumus_fx does not rebase: a write whose value depends on a tracked
# tensor into a storage that another live tensor views raises AutogradError, so
# no view can silently keep a stale history (see docs/design.md, "Decisions where the spec is silent").


def test_inplace_on_view_leaf_errors():
    with rf.Tape():
        x = rf.tensor(np.zeros(1), requires_grad=True)
        y = x.reshape(1)  # x.view_as(x)
        # PyTorch: "a view of a leaf Variable that requires grad is being used in an in-place operation."
        with pytest.raises(rf.AutogradError):
            y.add_(1.0)


def test_inplace_on_view_of_view():
    # PyTorch: root.grad == [[1, 2], [1, 1]] for v2 = x.narrow(0, 0, 1).narrow(1, 1, 1); v2.mul_(2)
    # (narrow is a copy in rumus_fx; transpose/reshape are its views). Refused: x is alive.
    def f(root):
        x = root * 1.0
        v2 = x.reshape(4).reshape(2, 2).T  # a view of a view of x
        v2.mul_(2.0)
        return rf.sum(x)

    with pytest.raises(rf.AutogradError):
        rf.grad(f)(jnp.ones((2, 2)))


def test_inplace_on_view_makes_base_require_grad():
    # PyTorch: x.narrow(1, 2, 2).mul_(b) makes the untracked clone x require grad.
    def f(b):
        x = rf.tensor(np.ones((2, 2)))
        x.T.mul_(b)
        return rf.sum(x)

    # refused: x would show b's values without b's history (the gradient would be zero)
    with pytest.raises(rf.AutogradError, match="untracked base"):
        rf.grad(f)(jnp.full((2, 2), 3.0))


def test_inplace_on_view_backprop_view():
    # PyTorch: a = [2, 5] untracked, res = a.narrow(0, 1, 1).mul_(b), b = [3]: b.grad == [5]
    def f(b):
        a = rf.tensor(np.array([[2.0, 5.0]]))
        res = a.T.mul_(b)  # [[2], [5]] * b
        return rf.sum(res[1])

    # refused: the base a is alive and would be left stale
    with pytest.raises(rf.AutogradError):
        rf.grad(f)(jnp.array([3.0]))

    def g(b):  # with the base gone the view alone carries the write, as PyTorch's res
        res = rf.tensor(np.array([[2.0, 5.0]])).T.mul_(b)
        return rf.sum(res[1])

    np.testing.assert_allclose(rf.grad(g)(jnp.array([3.0])), [5.0])


def test_inplace_on_view_modify_base():
    # PyTorch: x = ones(5); v = x.select(0, 1); x.add_(r); gradcheck(v) passes (dv/dr = 1)
    def f(r):
        x = rf.tensor(np.ones((5, 1)))
        v = x.T
        x.add_(r)
        return rf.sum(v * 3.0)

    # refused: v would keep showing x's values without the history of the write
    with pytest.raises(rf.AutogradError, match="untracked view"):
        rf.grad(f)(jnp.ones((1,)))

    def g(r):  # the same program without the stale view: d/dr sum(3 * (1 + r)) = 15
        x = rf.tensor(np.ones((5, 1)))
        x.add_(r)
        return rf.sum(x.T * 3.0)

    np.testing.assert_allclose(rf.grad(g)(jnp.ones((1,))), [15.0])


def test_inplace_on_view_non_contig():
    # PyTorch: the same write through a non-contiguous root; root.grad [[1, 2], [1, 1], [1, 1]].
    # Refused in rumus_fx (x alive); the functional program gives PyTorch's value.
    def f(root):
        x = root * 1.0
        v = x.T
        v.mul_(2.0)
        return rf.sum(x)

    with pytest.raises(rf.AutogradError):
        rf.grad(f)(jnp.ones((3, 2)).T)

    def g(root):
        scale = jnp.array([[1.0, 2.0], [1.0, 1.0], [1.0, 1.0]])
        return rf.sum(root * scale)

    np.testing.assert_allclose(rf.grad(g)(jnp.ones((3, 2))), [[1.0, 2.0], [1.0, 1.0], [1.0, 1.0]])


def test_inplace_on_view_then_no_grad():
    # PyTorch: b = a * 2; c = b.view_as(b); c[0][0] = 3 (while recording); c.sum().backward()
    with rf.Tape():
        a = rf.tensor(np.ones((3, 1)), requires_grad=True)
        b = a * 2.0
        c = b.reshape(3, 1)
        # refused: b is a tracked alias of c's storage and would not show the write
        with pytest.raises(rf.AutogradError, match="shared with another tracked tensor"):
            c.fill_(3.0)
    # the same write under no_grad is a plain mutation (no history), as in PyTorch
    with rf.Tape() as tape:
        a = rf.tensor(np.ones((3, 1)), requires_grad=True)
        b = a * 2.0
        c = b.reshape(3, 1)
        with rf.no_grad():
            c.fill_(3.0)
        loss = rf.sum(c)
    np.testing.assert_allclose(loss.value, 9.0)
    np.testing.assert_allclose(tape.backward(loss)[a], np.full((3, 1), 2.0))


def test_inplace_on_view_weak_grad_fn():
    # PyTorch: b = a.narrow(0, 0, 2).clone().view(-1); b.relu_(); c = b.clone(); del b;
    # s = c.sum() == 1 for a = arange(10). relu_ is written as mul_ by the mask.
    def f(a):
        b = (a[0:2] * 1.0).reshape(-1)  # the clone's own tensor dies: b is its only view
        b.mul_(jnp.asarray(b.value > 0, b.dtype))
        c = b * 1.0
        del b
        gc.collect()
        return rf.sum(c)

    value, grad = rf.value_and_grad(f)(jnp.arange(10.0))
    np.testing.assert_allclose(value, 1.0)
    np.testing.assert_allclose(grad, [0.0, 1.0] + [0.0] * 8)


def test_leaf_assignment():
    # PyTorch: x[0] = y; x[1] = 2 * z into an untracked x; y.grad == ones, z.grad == 2.
    # rumus_fx has no views by indexing; rows are written by copy_ into separate tensors.
    def f(y, z):
        x0, x1 = rf.tensor(np.zeros(5)), rf.tensor(np.zeros(5))
        x0.copy_(y)
        x1.copy_(z * 2.0)
        return rf.sum(rf.stack([x0, x1]))

    gy, gz = rf.grad(f, argnums=(0, 1))(jnp.ones(5), jnp.ones(5))
    np.testing.assert_allclose(gy, np.ones(5))
    np.testing.assert_allclose(gz, np.full(5, 2.0))


# -- TestAllowMutationOnSaved -------------------------------------------------------


def test_allow_mutation_on_saved_basic():
    # PyTorch, inside allow_mutation_on_saved_tensors(): b = a.clone(); out = (b**2).sum();
    # b.sin_(); out.backward() gives a.grad == 2 * a (the saved b is cloned before the
    # write). rumus_fx's records also keep the pre-write buffer (copy-on-write), but the
    # storage's version changed since MulBackward read it, and rumus_fx reports that
    # (docs/SPEC.md section 4: a record checks its snapshots before computing): it refuses.
    a0 = np.random.default_rng(8).uniform(size=(2, 3))
    with rf.Tape() as tape:
        a = rf.tensor(a0, requires_grad=True)
        b = a * 1.0
        out = rf.sum(b * b)
        b.copy_(rf.tanh(b))  # any recorded write
    with pytest.raises(rf.VersionMismatch):
        tape.backward(out)
    # the write's own record differentiates: PyTorch's second half of test_basic
    with rf.Tape() as tape:
        a = rf.tensor(a0, requires_grad=True)
        b = a * 1.0
        b.mul_(b)  # b ** 2 in place: the record keeps the pre-write b
        out = rf.sum(b)
    np.testing.assert_allclose(tape.backward(out)[a], 2 * a0)


# -- functorch: grad and no_grad (test_eager_transforms.py) ------------------------


def test_no_grad_outside():
    x = jnp.array(0.7)
    with rf.no_grad():
        y = rf.grad(lambda t: rf.tanh(t))(x)
    np.testing.assert_allclose(y, 1 - np.tanh(0.7) ** 2, rtol=1e-6)
    assert isinstance(y, jax.Array)


def test_no_grad_inside():
    def f(x):
        with rf.no_grad():
            shift = x * x
        return x * x - shift

    x = jnp.array(1.3)
    np.testing.assert_allclose(rf.grad(f)(x), 2 * x)
    # grad(grad(f)) == 2 in functorch: the inner rf.grad is recorded on the
    # enclosing tape; jax.grad of rf.grad gives the second derivative too
    np.testing.assert_allclose(rf.grad(lambda t: rf.grad(f)(t))(x), 2.0, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(rf.grad(f))(x), 2.0)


def test_no_grad_mixed():
    def f(x):
        with rf.no_grad():
            shift = x * x
        return x * x - shift

    x = jnp.array(-0.4)
    with rf.no_grad():
        np.testing.assert_allclose(rf.grad(f)(x), 2 * x)


def test_no_grad_nested_simple():
    def h(x):
        with rf.no_grad():
            shift = rf.grad(lambda t: 0.25 * t * t * t * t)(x)
        return x * x * x - shift

    x = jnp.array(1.5)
    np.testing.assert_allclose(rf.grad(h)(x), 3 * x**2)
    np.testing.assert_allclose(jax.grad(rf.grad(h))(x), 6 * x)


def test_no_grad_nested_complicated():
    def f(x):
        with rf.no_grad():
            shift = x * x * x
        return x * x * x - shift

    def g(x):
        r1 = rf.grad(f)(x)
        with rf.no_grad():
            shift = rf.grad(f)(x)
        return r1 - shift

    x = jnp.array(0.8)
    # the only differentiable part of g is r1 = 3 x ** 2: functorch gives 6 * x (the
    # inner rf.grad is recorded on the enclosing tape; the one under no_grad is not).
    # (rf.no_grad only concerns rf's tapes: jax.grad of g differentiates both terms.)
    np.testing.assert_allclose(rf.grad(g)(x), 6 * x, rtol=1e-6)
