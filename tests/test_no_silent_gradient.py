"""Programs that once returned a wrong gradient without an error: each now gives
the jax.grad value of the same program written functionally, or raises
``rf.AutogradError``."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf
from rumus_fx.autograd.record import Record, saved, static
from rumus_fx.ops._core import new_output, record, tape_for

# -- 1. the leaves the transforms wrap are leaves that require grad -----------


def _inplace_on_argument(w):
    a = w * 3.0
    w.add_(1.0)
    return rf.sum(a + w)


@pytest.mark.parametrize(
    "call",
    [
        lambda f, x: rf.grad(f)(x),
        lambda f, x: rf.value_and_grad(f)(x),
        lambda f, x: rf.vjp(f, x),
        lambda f, x: jax.jit(rf.grad(f))(x),
    ],
    ids=["grad", "value_and_grad", "vjp", "jit"],
)
def test_inplace_on_a_differentiated_argument_raises(call):
    with pytest.raises(rf.AutogradError, match="leaf tensor that requires grad"):
        call(_inplace_on_argument, jnp.ones(2))


def test_wrapped_arguments_are_leaves_that_require_grad():
    seen = {}

    def f(w):
        seen["leaf"], seen["requires_grad"] = w.is_leaf, w.requires_grad
        return rf.sum(w * w)

    np.testing.assert_allclose(rf.grad(f)(jnp.array([1.0, 2.0])), [2.0, 4.0])
    assert seen == {"leaf": True, "requires_grad": True}


def test_inplace_on_a_copy_of_an_argument_is_differentiable():
    def f(w):
        y = w * 1.0  # a non-leaf: in-place is recorded
        y.mul_(w)
        return rf.sum(y * 3.0)

    x = jnp.array([0.5, -2.0])
    np.testing.assert_allclose(rf.grad(f)(x), jax.grad(lambda w: jnp.sum(w * w * 3.0))(x))


# -- 2./3. no alias is left silently stale ------------------------------------


def test_write_through_a_view_of_an_untracked_base_raises():
    def f(b):
        x = rf.tensor(jnp.ones((2, 2)))
        x.T.mul_(b)
        return rf.sum(x)

    with pytest.raises(rf.AutogradError, match="untracked base"):
        rf.grad(f)(jnp.full((2, 2), 2.0))


def test_write_through_the_only_view_of_a_dead_base_is_differentiable():
    def f(b):
        v = rf.tensor(jnp.arange(4.0).reshape(2, 2)).T  # the base dies here
        v.mul_(b)
        return rf.sum(v * v)

    b0 = jnp.array([[1.0, 2.0], [3.0, -1.0]])
    want = jax.grad(lambda b: jnp.sum((jnp.arange(4.0).reshape(2, 2).T * b) ** 2))(b0)
    np.testing.assert_allclose(rf.grad(f)(b0), want)


def test_base_written_after_an_untracked_view_was_taken_raises():
    def f(r):
        x = rf.tensor(jnp.ones((5, 1)))
        v = x.T
        x.add_(r)
        return rf.sum(v * 3.0)

    with pytest.raises(rf.AutogradError, match="untracked view"):
        rf.grad(f)(jnp.ones((1,)))


def test_base_written_after_its_view_died_is_differentiable():
    def f(r):
        x = rf.tensor(jnp.ones((5, 1)))
        v = x.T
        del v
        x.add_(r)
        return rf.sum(x.T * 3.0)

    np.testing.assert_allclose(rf.grad(f)(jnp.ones((1,))), [15.0])


def test_detached_aliases_are_exempt_and_show_the_new_value_as_a_constant():
    def f(w):
        y = w * 1.0
        d = y.detach()
        y.add_(w)  # d is cut from history on purpose: it shows 2w, as a constant
        return rf.sum(y * d)

    w0 = jnp.array([1.0, 2.0])
    want = jax.grad(lambda w: jnp.sum(2 * w * jax.lax.stop_gradient(2 * w)))(w0)
    np.testing.assert_allclose(rf.grad(f)(w0), want)


def test_write_through_a_detached_alias_of_a_live_base_raises():
    def f(w):
        y = w * 1.0
        d = y.detach()
        d.add_(w)  # y would show w + w without that history
        return rf.sum(y)

    with pytest.raises(rf.AutogradError):
        rf.grad(f)(jnp.ones(2))


def test_constant_write_next_to_a_tracked_alias_raises_while_recording():
    def through_detach(w):
        y = w * 2.0
        y.detach().mul_(2.0)  # y's value would double without its history
        return rf.sum(y)

    def through_no_grad_view(w):
        y = w * 2.0
        with rf.no_grad():
            v = y.T
        v.mul_(2.0)
        return rf.sum(y)

    for f in (through_detach, through_no_grad_view):
        with pytest.raises(rf.AutogradError, match="shared with another tracked tensor"):
            rf.grad(f)(jnp.ones((2, 2)))

    def under_no_grad(w):  # the optimizer-style update stays legal
        y = w * 2.0
        with rf.no_grad():
            y.detach().mul_(2.0)
        return rf.sum(y)

    np.testing.assert_allclose(rf.grad(under_no_grad)(jnp.ones((2, 2))), np.full((2, 2), 2.0))


# -- 4. the transforms differentiate inside an outer no_grad ------------------


def _sin_like(x):
    return rf.sum(rf.tanh(x) * x)


def _sin_like_ref(x):
    return jnp.sum(jnp.tanh(x) * x)


def test_transforms_inside_no_grad_differentiate():
    x = jnp.array([0.3, -1.2, 2.0])
    want = jax.grad(_sin_like_ref)(x)
    with rf.no_grad():
        np.testing.assert_allclose(rf.grad(_sin_like)(x), want, rtol=1e-6)
        value, g = rf.value_and_grad(_sin_like)(x)
        np.testing.assert_allclose(g, want, rtol=1e-6)
        np.testing.assert_allclose(value, _sin_like_ref(x), rtol=1e-6)
        out, vjp_fn = rf.vjp(_sin_like, x)
        np.testing.assert_allclose(vjp_fn(jnp.float32(1.0))[0], want, rtol=1e-6)
        np.testing.assert_allclose(jax.jit(rf.grad(_sin_like))(x), want, rtol=1e-6)
        # and no_grad is still on after the call
        with rf.Tape() as tape:
            w = rf.tensor(x, requires_grad=True)
            rf.sum(w * w)
        assert len(tape) == 0


def test_no_grad_inside_the_function_still_stops_recording():
    def f(x):
        with rf.no_grad():
            shift = x * x
        return rf.sum(x * x - shift)

    x = jnp.array([0.5, -1.5])
    np.testing.assert_allclose(rf.grad(f)(x), 2 * x)
    with rf.no_grad():
        np.testing.assert_allclose(rf.grad(f)(x), 2 * x)


# -- 5. a loss this tape did not record ----------------------------------------


def test_backward_on_a_foreign_loss_raises():
    with rf.Tape() as tape1:
        w = rf.tensor(jnp.ones(2), requires_grad=True)
        loss = rf.sum(w * w)
    tape2 = rf.Tape()
    with pytest.raises(rf.AutogradError, match="not recorded on this tape"):
        tape2.backward(loss)
    np.testing.assert_allclose(tape1.backward(loss)[w], [2.0, 2.0])


def test_backward_through_a_nested_tape_raises():
    with rf.Tape() as outer:
        w = rf.tensor(jnp.ones(2), requires_grad=True)
        a = w * 2.0
        with rf.Tape():
            b = w * 3.0  # recorded on the inner tape only
        loss = rf.sum(a + b)
    with pytest.raises(rf.AutogradError, match="another tape"):
        outer.backward(loss)


def test_nested_tape_inside_a_transform_raises():
    def f(w):
        with rf.Tape():
            b = w * 3.0
        return rf.sum(b + w)

    with pytest.raises(rf.AutogradError, match="another tape"):
        rf.grad(f)(jnp.ones(2))


def test_leaf_loss_and_unused_nested_tape_are_fine():
    with rf.Tape() as tape:
        w = rf.tensor(jnp.array(3.0), requires_grad=True)
        with rf.Tape():
            unused = w * 2.0
        del unused
        loss = w * w
    np.testing.assert_allclose(tape.backward(loss, retain=True)[w], 6.0)
    np.testing.assert_allclose(tape.backward(w)[w], 1.0)


def test_closure_over_a_tracked_tensor_under_an_enclosing_tape_is_differentiated():
    # the inner transform is recorded on the enclosing tape (Note [Higher order]):
    # the closed-over tensor is an input of that entry, so its path is not lost
    with rf.Tape() as tape:
        w = rf.tensor(jnp.array([1.0, 2.0]), requires_grad=True)
        g = rf.grad(lambda x: rf.sum(x * x * w))(jnp.ones(2))  # 2 x w
        assert g.requires_grad
        np.testing.assert_allclose(np.asarray(g.value), [2.0, 4.0])
        loss = rf.sum(g)
    np.testing.assert_allclose(tape.backward(loss)[w], [2.0, 2.0])
    # without an enclosing tape the closure is a constant of the function
    np.testing.assert_allclose(rf.grad(lambda x: rf.sum(x * w))(jnp.ones(2)), [1.0, 2.0])


# -- 6. normalisation with an untracked input ---------------------------------


def test_layer_norm_parameters_get_gradients_with_untracked_input():
    from .ops.optable import ref_layer_norm

    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 4)), jnp.float32)
    ct = jnp.asarray(np.random.default_rng(1).standard_normal((3, 4)), jnp.float32)
    w0, b0 = jnp.array([1.0, 0.5, 2.0, -1.0]), jnp.array([0.1, 0.2, 0.3, 0.4])
    got = rf.grad(lambda w, b: rf.sum(rf.layer_norm(x, w, b) * ct), argnums=(0, 1))(w0, b0)
    want = jax.grad(lambda w, b: jnp.sum(ref_layer_norm(x, w, b) * ct), argnums=(0, 1))(w0, b0)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
        assert float(jnp.abs(g).sum()) > 0


def test_batch_norm_weight_gets_a_gradient_with_untracked_input():
    from .ops.optable import ref_batch_norm

    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 2, 2)), jnp.float32)
    ct = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 2, 2)), jnp.float32)
    rm, rv = jnp.zeros(3), jnp.ones(3)

    def f(w, b):
        return rf.sum(rf.batch_norm_2d(x, w, b, rm, rv, training=True)[0] * ct)

    def ref(w, b):
        return jnp.sum(ref_batch_norm(x, w, b, rm, rv, training=True)[0] * ct)

    w0, b0 = jnp.array([1.0, 0.5, 2.0]), jnp.array([0.1, 0.2, 0.3])
    for argnums in ((0,), (1,), (0, 1)):
        got = rf.grad(f, argnums=argnums)(w0, b0)
        want = jax.grad(ref, argnums=argnums)(w0, b0)
        for g, r in zip(got, want):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


# -- rf.tensor of a tracked tensor is a recorded copy/cast ---------------------


@pytest.mark.parametrize("dtype", [None, jnp.float32, jnp.bfloat16])
def test_tensor_of_a_tracked_tensor_is_a_recorded_cast(dtype):
    x0 = jnp.array([0.5, -1.0, 2.0])

    def f(w):
        c = rf.tensor(w * 2.0, dtype=dtype)
        assert c.requires_grad and not c.is_leaf
        return rf.sum(c * c)

    want_dtype = jnp.float32 if dtype is None else dtype
    want = jax.grad(lambda w: jnp.sum(((w * 2.0).astype(want_dtype) ** 2).astype(jnp.float32)))(x0)
    tol = 1e-6 if want_dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(rf.grad(f)(x0), want, rtol=tol)
    with rf.Tape() as tape:
        w = rf.tensor(x0, requires_grad=True)
        rf.tensor(w, dtype=dtype)
    assert [e.op.name for e in tape.entries] == ["CastBackward"]


def test_tensor_of_a_tracked_tensor_as_a_new_leaf_raises():
    with rf.Tape():
        w = rf.tensor(jnp.ones(2), requires_grad=True)
        with pytest.raises(rf.AutogradError, match="detach"):
            rf.tensor(w, requires_grad=True)
        leaf = rf.tensor(w.detach(), requires_grad=True)  # on purpose: fine
        assert leaf.is_leaf and leaf.requires_grad
    # outside a tape nothing records: a plain copy
    assert not rf.tensor(w).requires_grad


# -- records say what their fields are; every record class is a pytree ---------

frozen = dataclasses.dataclass(frozen=True, eq=False)


@frozen
class ScaleByAny(Record):  # not named *Backward, array in a field annotated Any
    factor: Any

    def backward(self, g, needs):
        return (g * self.factor,)


@frozen
class ScaleExplicit(Record):
    factor: Any = saved()
    note: Any = static(default="x")

    def backward(self, g, needs):
        return (g * self.factor,)


def _scale(cls, x, factor):
    tape = tape_for(x)
    out = new_output(x.value * factor, tape)
    return out if tape is None else record(tape, cls(jnp.asarray(factor)), (x,), out)


@pytest.mark.parametrize("cls", [ScaleByAny, ScaleExplicit])
def test_record_with_an_array_in_any_field_and_any_name(cls):
    for factor in (2.0, 3.0, -1.5):  # second and third eager backward reuse the compiled rule
        np.testing.assert_allclose(rf.grad(lambda x, f=factor: rf.sum(_scale(cls, x, f)))(jnp.ones(2)), [factor] * 2)
    with rf.Tape() as tape:
        x = rf.tensor(jnp.ones(3), requires_grad=True)
        _scale(cls, x, 2.0)
    assert tape.saved_bytes == 4 and tape.entries[0].op.saved_bytes == 4
    leaves, treedef = jax.tree_util.tree_flatten(tape.entries[0].op)
    assert len(leaves) == 1
    assert isinstance(jax.tree_util.tree_unflatten(treedef, leaves), cls)
    assert dataclasses.fields(cls)[0].name == "factor"


def test_field_kinds_are_explicit_or_from_resolved_types():
    assert ScaleExplicit.field_kinds() == {"factor": "saved", "note": "static"}
    kinds = rf.autograd.record_types()
    mul = next(c for c in kinds if c.__name__ == "MulBackward")
    assert mul.field_kinds() == {
        "lhs": "saved",
        "lhs_version": "snapshot",
        "rhs": "saved",
        "rhs_version": "snapshot",
        "lhs_aval": "static",
        "rhs_aval": "static",
    }


# -- shape errors ----------------------------------------------------------------


def test_kernel_larger_than_the_padded_input_is_a_shape_error():
    with pytest.raises(rf.ShapeError, match="im2col"):
        rf.im2col(jnp.ones((1, 1, 2, 2)), 3)
    with pytest.raises(rf.ShapeError, match="conv2d"):
        rf.conv2d(jnp.ones((1, 1, 2, 2)), jnp.ones((1, 1, 3, 3)))
    with pytest.raises(rf.ShapeError, match="max_pool2d"):
        rf.max_pool2d(jnp.ones((1, 1, 2, 2)), 3)
