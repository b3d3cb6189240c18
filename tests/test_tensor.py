"""Tensor construction, views, operators, conversions and in-place semantics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf


def test_tensor_attributes_and_defaults():
    t = rf.tensor([[1.0, 2.0, 3.0]])
    assert t.shape == (1, 3) and t.ndim == 2 and t.size == 3
    assert t.dtype == jnp.float32  # python floats default to float32
    assert not t.requires_grad and t.grad_id is None
    assert isinstance(t.value, jax.Array)
    assert rf.tensor(np.arange(3)).dtype == jnp.int32
    assert rf.tensor([1.0], dtype=jnp.bfloat16).dtype == jnp.bfloat16
    w = rf.tensor([1.0], requires_grad=True)
    assert w.requires_grad and isinstance(w.grad_id, int) and w.is_leaf


def test_integer_tensor_cannot_require_grad():
    with pytest.raises(TypeError, match="floating"):
        rf.tensor([1, 2], requires_grad=True)


def test_conversions():
    t = rf.tensor([[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_array_equal(np.asarray(t), [[1, 2], [3, 4]])
    np.testing.assert_array_equal(jnp.asarray(t), [[1, 2], [3, 4]])
    assert float(rf.tensor(2.5)) == 2.5
    assert rf.tensor([3.0]).item() == 3.0


def test_tracked_tensor_refuses_silent_conversion_while_recording():
    with rf.Tape():
        w = rf.tensor([1.0, 2.0], requires_grad=True)
        with pytest.raises(rf.AutogradError, match="cut out of the gradient"):
            jnp.asarray(w)
        with pytest.raises(rf.AutogradError):
            np.asarray(w)
        # jax/numpy arrays on the left defer to the Tensor: still recorded
        out = jnp.ones(2) + w
        out2 = np.ones(2) * w
        assert isinstance(out, rf.Tensor) and out.requires_grad
        assert isinstance(out2, rf.Tensor) and out2.requires_grad
    np.testing.assert_array_equal(np.asarray(w), [1.0, 2.0])  # fine once the tape is closed


def test_transpose_T_detach_are_views():
    x = rf.tensor(np.arange(6.0).reshape(2, 3))
    for v in (x.T, x.transpose(0, 1), x.transpose(-1, -2), x.detach()):
        assert v.storage is x.storage
    np.testing.assert_array_equal(np.asarray(x.T), np.arange(6.0).reshape(2, 3).T)
    assert not x.T.is_contiguous()
    assert x.T.layout.strides == (1, 3)


def test_reshape_is_view_when_possible_copy_otherwise():
    x = rf.tensor(np.arange(12.0).reshape(3, 4))
    v = x.reshape(2, 6)
    assert v.storage is x.storage
    assert x.reshape((4, 3)).storage is x.storage
    xt = x.T  # [4, 3] non-contiguous
    c = xt.reshape(12)  # not expressible as a view
    assert c.storage is not x.storage
    np.testing.assert_array_equal(np.asarray(c), np.arange(12.0).reshape(3, 4).T.reshape(12))
    v2 = xt.reshape(2, 2, 3)  # splitting the outer axis stays a view
    assert v2.storage is x.storage
    np.testing.assert_array_equal(np.asarray(v2), np.arange(12.0).reshape(3, 4).T.reshape(2, 2, 3))


def test_flatten_noncontiguous_is_correct():
    # rumus copied the raw buffer here: flatten of a transpose was wrong
    a = np.arange(24.0).reshape(2, 3, 4)
    x = rf.tensor(a).transpose(0, 2)  # [4, 3, 2]
    np.testing.assert_array_equal(np.asarray(x.flatten()), a.transpose(2, 1, 0).reshape(4, 6))
    np.testing.assert_array_equal(np.asarray(rf.flatten(x)), a.transpose(2, 1, 0).reshape(4, 6))


def test_operators_and_scalars():
    a = rf.tensor([[1.0, 2.0], [3.0, 4.0]])
    b = np.array([[2.0, 2.0], [2.0, 2.0]], np.float32)
    cases = {
        "add": (a + b, 1.0 + a, np.asarray(a) + b),
        "sub": (a - b, 10.0 - a, None),
        "mul": (a * 3, 3 * a, np.asarray(a) * 3),
        "div": (a / 2.0, 2.0 / a, None),
    }
    np.testing.assert_allclose(np.asarray(cases["add"][0]), np.asarray(a) + b)
    np.testing.assert_allclose(np.asarray(cases["add"][1]), 1.0 + np.asarray(a))
    np.testing.assert_allclose(np.asarray(cases["sub"][1]), 10.0 - np.asarray(a))
    np.testing.assert_allclose(np.asarray(cases["mul"][1]), 3 * np.asarray(a))
    np.testing.assert_allclose(np.asarray(cases["div"][1]), 2.0 / np.asarray(a))
    np.testing.assert_allclose(np.asarray(-a), -np.asarray(a))
    np.testing.assert_allclose(np.asarray(a @ a), np.asarray(a) @ np.asarray(a))
    np.testing.assert_allclose(np.asarray(jnp.asarray(b) @ a), b @ np.asarray(a))
    assert (a * 3).dtype == jnp.float32  # python scalars are weakly typed
    np.testing.assert_allclose(np.asarray(a.sum()), 10.0)
    np.testing.assert_allclose(np.asarray(a.mean(axis=0)), [2.0, 3.0])


def test_matmul_operator_rank_errors():
    # 1-D operands follow jnp.matmul (a dot product); mismatched ones are a ShapeError
    np.testing.assert_allclose(np.asarray(rf.tensor(np.ones(3)) @ rf.tensor(np.ones(3))), 3.0)
    with rf.Tape(), pytest.raises(rf.ShapeError, match="matmul"):
        rf.tensor(np.ones(3), requires_grad=True) @ rf.tensor(np.ones(4))
    with pytest.raises(rf.ShapeError, match=r"matmul.*\(2, 3\).*\(4, 5\)"):
        rf.matmul(np.ones((2, 3)), np.ones((4, 5)))


def test_shape_errors_name_op_and_shapes_before_recording():
    with rf.Tape() as tape:
        x = rf.tensor(np.ones((2, 3)), requires_grad=True)
        with pytest.raises(rf.ShapeError, match=r"add.*\(2, 3\).*\(4,\)"):
            x + np.ones(4)
        with pytest.raises(rf.ShapeError, match="mse_loss"):
            rf.mse_loss(x, np.ones((3, 2)))
        with pytest.raises(rf.ShapeError, match="add_bias"):
            rf.add_bias(x, np.ones(2))
        with pytest.raises(rf.ShapeError, match="reshape"):
            x.reshape(4, 2)
        with pytest.raises(rf.ShapeError, match="transpose"):
            x.transpose(0, 2)
        with pytest.raises(rf.ShapeError, match="sum"):
            rf.sum(x, axis=3)
    assert len(tape) == 0


def test_nothing_records_outside_a_tape_or_under_no_grad():
    w = rf.tensor([1.0, 2.0], requires_grad=True)
    y = w * 2
    assert not y.requires_grad and y.grad_id is None
    with rf.Tape() as tape:
        with rf.no_grad():
            z = w * 2
            with rf.no_grad():  # nestable
                z2 = w + 1
            z3 = w - 1
        z4 = w / 2
    assert not z.requires_grad and not z2.requires_grad and not z3.requires_grad
    assert z4.requires_grad and len(tape) == 1


def test_no_grad_as_decorator():
    @rf.no_grad()
    def f(w):
        return w * 2

    with rf.Tape() as tape:
        w = rf.tensor([1.0], requires_grad=True)
        assert not f(w).requires_grad
    assert len(tape) == 0


# -- in-place ------------------------------------------------------------------


def test_inplace_bumps_version_and_is_visible_through_views():
    x = rf.tensor(np.arange(6.0).reshape(2, 3))
    xt = x.T
    xt.add_(np.ones((3, 2)) * 10)
    assert x.version == 1 and xt.version == 1
    np.testing.assert_array_equal(np.asarray(x), np.arange(6.0).reshape(2, 3) + 10)
    r = x.reshape(3, 2)
    r.mul_(2.0)
    assert x.version == 2
    np.testing.assert_array_equal(np.asarray(xt), ((np.arange(6.0).reshape(2, 3) + 10) * 2).T)


@pytest.mark.parametrize(
    "method,arg,expect",
    [
        ("add_", 2.0, [3.0, 4.0]),
        ("sub_", 1.0, [0.0, 1.0]),
        ("mul_", [2.0, 3.0], [2.0, 6.0]),
        ("div_", 2.0, [0.5, 1.0]),
        ("fill_", 7.0, [7.0, 7.0]),
        ("copy_", [5.0, 6.0], [5.0, 6.0]),
    ],
)
def test_inplace_methods_return_self(method, arg, expect):
    t = rf.tensor([1.0, 2.0])
    if isinstance(arg, list):
        arg = np.array(arg, np.float32)
    assert getattr(t, method)(arg) is t
    np.testing.assert_allclose(np.asarray(t), expect)
    assert t.version == 1
    assert t.zero_() is t and t.version == 2
    np.testing.assert_array_equal(np.asarray(t), [0.0, 0.0])


def test_inplace_shape_and_dtype_errors():
    t = rf.tensor(np.ones((2, 3)))
    with pytest.raises(rf.ShapeError, match="add_"):
        t.add_(np.ones((4, 2, 3)))  # would need to grow t
    with pytest.raises(TypeError, match="add_"), jax.numpy_dtype_promotion("standard"):
        rf.tensor(np.arange(3)).add_(1.5)  # int32 += float on purpose: add_ refuses the float result
    with pytest.raises(rf.ShapeError, match="fill_"):
        t.fill_(np.ones(3))
    assert t.version == 0


def test_inplace_on_leaf_requiring_grad_raises_while_recording():
    w = rf.tensor([1.0, 2.0], requires_grad=True)
    with rf.Tape():
        with pytest.raises(rf.AutogradError, match="leaf"):
            w.add_(1.0)
        with rf.no_grad():  # allowed: this is how optimizers update
            w.sub_(0.5)
    w.mul_(2.0)  # outside any tape: just a mutation
    np.testing.assert_allclose(np.asarray(w), [1.0, 3.0])
    assert w.requires_grad


def test_inplace_on_shared_view_raises_while_recording():
    with rf.Tape():
        w = rf.tensor(np.ones((2, 3)), requires_grad=True)
        y = w * 2
        yt = y.T  # tracked view of y's storage
        with pytest.raises(rf.AutogradError, match="shared"):
            yt.add_(1.0)
        with pytest.raises(rf.AutogradError, match="shared"):
            y.add_(1.0)
        with rf.no_grad():
            yt.add_(1.0)  # only mutates
    np.testing.assert_allclose(np.asarray(y), 3 * np.ones((2, 3)))


def test_traced_write_into_outside_storage_raises():
    buf = rf.tensor(np.zeros(3, np.float32))

    @jax.jit
    def f(x):
        buf.add_(x)
        return x

    with pytest.raises(rf.AutogradError, match="tracer"):
        f(jnp.ones(3))
    assert buf.version == 0

    with pytest.raises(rf.AutogradError, match="tracer"):
        jax.vmap(lambda x: buf.copy_(x).value)(jnp.ones((2, 3)))

    @jax.jit
    def g(x):  # a storage created inside the trace may be written
        t = rf.tensor(jnp.zeros(3))
        t.add_(x)
        return t.value

    np.testing.assert_array_equal(g(jnp.ones(3)), np.ones(3))


def test_getitem_is_a_copy_with_gradients():
    x = rf.tensor(np.arange(12.0, dtype=np.float32).reshape(3, 4))
    row = x[1]
    np.testing.assert_array_equal(np.asarray(row), [4, 5, 6, 7])
    assert row.storage is not x.storage  # a copy, unlike PyTorch's basic indexing
    row.add_(1.0)
    assert x.version == 0
    with pytest.raises(IndexError, match="index"):
        x[3]
    with pytest.raises(TypeError, match="boolean"):
        x[np.array([True, False, True])]
    g = rf.grad(lambda t: rf.sum(t[:, np.array([1, 1])]))(jnp.ones((2, 3)))
    np.testing.assert_array_equal(np.asarray(g), [[0, 2, 0], [0, 2, 0]])
