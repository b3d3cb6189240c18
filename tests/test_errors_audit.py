"""Error audit: every op of the op table (and every transform) rejects malformed
input with the right exception type, a message naming the op, and nothing
recorded on the tape.

Expected types: ``rf.ShapeError`` for shapes and ranks, ``TypeError`` /
``ValueError`` for dtypes and static arguments, ``IndexError`` for concrete
out-of-range indices.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf

from .ops.optable import OPS, OpInfo

ShapeError = rf.ShapeError


def f32(*shape):
    """A tracked float32 tensor (inside the test's tape the op would record)."""
    data = np.random.default_rng(sum(shape) + len(shape)).standard_normal(shape).astype(np.float32)
    return rf.tensor(data, requires_grad=True)


def i32(*shape, high=3):
    return jnp.asarray(np.random.default_rng(0).integers(0, high, shape), jnp.int32)


def ints(*shape):
    """An integer array where a float one is needed."""
    return jnp.ones(shape, jnp.int32)


@dataclasses.dataclass(frozen=True)
class Bad:
    what: str
    call: Callable[[], Any]
    exc: type[BaseException]
    also: tuple[str, ...] = ()  # more substrings the message must contain


KEY = jax.random.key(0)

CASES: dict[str, list[Bad]] = {
    "add": [
        Bad("shapes that do not broadcast", lambda: rf.add(f32(3, 4), f32(5)), ShapeError, ("(3, 4)", "(5,)")),
        Bad("swapped axes", lambda: rf.add(f32(2, 3), f32(3, 2)), ShapeError),
    ],
    "sub": [Bad("shapes that do not broadcast", lambda: rf.sub(f32(2, 3, 4), f32(3, 2)), ShapeError, ("(3, 2)",))],
    "mul": [Bad("shapes that do not broadcast", lambda: rf.mul(f32(4), f32(3)), ShapeError, ("(4,)", "(3,)"))],
    "div": [Bad("shapes that do not broadcast", lambda: rf.div(f32(2, 5), f32(2, 4)), ShapeError)],
    "neg": [Bad("a python list", lambda: rf.neg([1.0, 2.0]), TypeError, ("list",))],
    "exp": [Bad("None", lambda: rf.exp(None), TypeError, ("NoneType",))],
    "log": [Bad("a string", lambda: rf.log("1.0"), TypeError, ("str",))],
    "sum": [
        Bad("axis out of range", lambda: rf.sum(f32(3, 4), axis=2), ShapeError, ("axis 2",)),
        Bad("axis out of range in a tuple", lambda: rf.sum(f32(3, 4), axis=(0, -3)), ShapeError),
        Bad("float axis", lambda: rf.sum(f32(3, 4), axis=1.0), TypeError),
        Bad("repeated axis", lambda: rf.sum(f32(3, 4), axis=(1, -1)), ValueError),
    ],
    "mean": [
        Bad("axis out of range", lambda: rf.mean(f32(3), axis=1), ShapeError),
        Bad("string axis", lambda: rf.mean(f32(3), axis="0"), TypeError),
    ],
    "matmul": [
        Bad("rank-1 lhs", lambda: rf.matmul(f32(3), f32(3, 4)), ShapeError, ("(3,)",)),
        Bad("inner sizes differ", lambda: rf.matmul(f32(2, 3), f32(4, 5)), ShapeError, ("(2, 3)", "(4, 5)")),
        Bad("rank-3 rhs", lambda: rf.matmul(f32(2, 3), f32(2, 3, 4)), ShapeError),
        Bad("integer lhs", lambda: rf.matmul(ints(2, 3), f32(3, 4)), TypeError, ("int32",)),
    ],
    "relu": [Bad("an object", lambda: rf.relu(object()), TypeError)],
    "mse_loss": [
        Bad("different shapes", lambda: rf.mse_loss(f32(3, 4), f32(4, 3)), ShapeError, ("(3, 4)", "(4, 3)")),
        Bad("broadcastable but not equal", lambda: rf.mse_loss(f32(3, 4), f32(3, 1)), ShapeError),
    ],
    "add_bias": [
        Bad("rank-2 bias", lambda: rf.add_bias(f32(3, 5), f32(2, 5)), ShapeError, ("(2, 5)",)),
        Bad("bias size", lambda: rf.add_bias(f32(3, 5), f32(4)), ShapeError, ("(3, 5)", "(4,)")),
        Bad("scalar input", lambda: rf.add_bias(f32(), f32(1)), ShapeError),
    ],
    "reshape": [
        Bad("wrong size", lambda: rf.reshape(f32(3, 5), (4, 4)), ShapeError, ("(3, 5)", "(4, 4)")),
        Bad("two -1", lambda: rf.reshape(f32(3, 4), (2, -1, -1)), ShapeError),
        Bad("negative size", lambda: rf.reshape(f32(3, 4), (-2, -6)), ShapeError),
        Bad("float sizes", lambda: rf.reshape(f32(3, 4), (3.0, 4)), TypeError, ("3.0",)),
        Bad("a string shape", lambda: rf.reshape(f32(3, 4), "12"), TypeError),
        Bad("a shape of strings", lambda: rf.reshape(f32(3, 4), ("a", "b")), TypeError),
    ],
    "flatten": [Bad("scalar", lambda: rf.flatten(f32()), ShapeError)],
    "transpose": [
        Bad("dim out of range", lambda: rf.transpose(f32(3, 4), 0, 2), ShapeError, ("axis 2",)),
        Bad("float dim", lambda: rf.transpose(f32(3, 4), 0.0, 1), TypeError),
    ],
    "sigmoid": [Bad("integer input", lambda: rf.sigmoid(ints(3)), TypeError, ("int32",))],
    "tanh": [Bad("integer input", lambda: rf.tanh(ints(3)), TypeError, ("int32",))],
    "gelu": [
        Bad("integer input", lambda: rf.gelu(ints(3)), TypeError),
        Bad("approximate not a bool", lambda: rf.gelu(f32(3), approximate="tanh"), TypeError, ("'tanh'",)),
    ],
    "leaky_relu": [
        Bad("alpha a string", lambda: rf.leaky_relu(f32(3), alpha="0.1"), TypeError, ("'0.1'",)),
        Bad("integer input", lambda: rf.leaky_relu(ints(3)), TypeError),
    ],
    "softmax": [
        Bad("axis out of range", lambda: rf.softmax(f32(3, 4), axis=2), ShapeError),
        Bad("scalar", lambda: rf.softmax(f32()), ShapeError),
        Bad("integer input", lambda: rf.softmax(ints(3)), TypeError),
    ],
    "layer_norm": [
        Bad("weight size", lambda: rf.layer_norm(f32(3, 5), f32(4)), ShapeError, ("(5,)", "(4,)")),
        Bad("rank-2 bias", lambda: rf.layer_norm(f32(3, 5), f32(5), f32(5, 1)), ShapeError),
        Bad("negative eps", lambda: rf.layer_norm(f32(3, 5), eps=-1.0), ValueError, ("-1.0",)),
        Bad("scalar", lambda: rf.layer_norm(f32()), ShapeError),
        Bad("integer input", lambda: rf.layer_norm(ints(3, 5)), TypeError),
    ],
    "batch_norm_2d": [
        Bad(
            "rank-3 input",
            lambda: rf.batch_norm_2d(f32(3, 4, 5), f32(3), f32(3), f32(3), f32(3), training=True),
            ShapeError,
            ("(3, 4, 5)",),
        ),
        Bad(
            "weight size",
            lambda: rf.batch_norm_2d(f32(2, 4, 3, 3), f32(3), f32(4), f32(4), f32(4), training=True),
            ShapeError,
            ("weight",),
        ),
        Bad(
            "running stats size",
            lambda: rf.batch_norm_2d(f32(2, 4, 3, 3), f32(4), f32(4), f32(5), f32(4), training=False),
            ShapeError,
            ("running_mean",),
        ),
        Bad(
            "momentum above 1",
            lambda: rf.batch_norm_2d(f32(2, 4, 3, 3), None, None, f32(4), f32(4), training=True, momentum=1.5),
            ValueError,
            ("1.5",),
        ),
        Bad(
            "training not a bool",
            lambda: rf.batch_norm_2d(f32(2, 4, 3, 3), None, None, f32(4), f32(4), training="yes"),
            TypeError,
        ),
        Bad(
            "negative eps",
            lambda: rf.batch_norm_2d(f32(2, 4, 3, 3), None, None, f32(4), f32(4), training=True, eps=-1e-5),
            ValueError,
        ),
        Bad(
            "one value per channel in training",
            lambda: rf.batch_norm_2d(f32(1, 4, 1, 1), None, None, f32(4), f32(4), training=True),
            ValueError,
        ),
        Bad(
            "integer input",
            lambda: rf.batch_norm_2d(ints(2, 4, 3, 3), None, None, f32(4), f32(4), training=True),
            TypeError,
        ),
    ],
    "cross_entropy": [
        Bad("float targets", lambda: rf.cross_entropy(f32(6, 5), jnp.zeros(6)), TypeError, ("float32",)),
        Bad("targets shape", lambda: rf.cross_entropy(f32(6, 5), i32(5)), ShapeError, ("(6, 5)", "(5,)")),
        Bad("target == C", lambda: rf.cross_entropy(f32(3, 5), jnp.array([0, 5, 1])), IndexError, ("5",)),
        Bad("negative target", lambda: rf.cross_entropy(f32(3, 5), jnp.array([0, -1, 1])), IndexError, ("-1",)),
        Bad(
            "out of range beside ignore_index",
            lambda: rf.cross_entropy(f32(3, 5), jnp.array([-100, 7, 1]), ignore_index=-100),
            IndexError,
            ("7",),
        ),
        Bad(
            "float ignore_index",
            lambda: rf.cross_entropy(f32(3, 5), i32(3), ignore_index=1.5),
            TypeError,
            ("1.5",),
        ),
        Bad("integer logits", lambda: rf.cross_entropy(ints(3, 5), i32(3)), TypeError),
        Bad("scalar logits", lambda: rf.cross_entropy(f32(), jnp.array(0)), ShapeError),
    ],
    "im2col": [
        Bad("rank-2 input", lambda: rf.im2col(f32(5, 6), 3), ShapeError, ("(5, 6)",)),
        Bad("kernel larger than padded input", lambda: rf.im2col(f32(2, 5, 6), 8, 1, 1), ValueError, ("8",)),
        Bad("kernel 0", lambda: rf.im2col(f32(2, 5, 6), 0), ValueError),
        Bad("float kernel", lambda: rf.im2col(f32(2, 5, 6), 2.0), TypeError, ("2.0",)),
        Bad("stride 0", lambda: rf.im2col(f32(2, 5, 6), 3, 0), ValueError),
        Bad("negative padding", lambda: rf.im2col(f32(2, 5, 6), 3, 1, -1), ValueError),
    ],
    "conv2d": [
        Bad("channels differ", lambda: rf.conv2d(f32(2, 3, 6, 6), f32(4, 2, 3, 3)), ShapeError, ("(4, 2, 3, 3)",)),
        Bad("rank-3 input", lambda: rf.conv2d(f32(3, 6, 6), f32(4, 3, 3, 3)), ShapeError),
        Bad("non-square kernel", lambda: rf.conv2d(f32(2, 3, 6, 6), f32(4, 3, 3, 2)), ShapeError),
        Bad("bias size", lambda: rf.conv2d(f32(2, 3, 6, 6), f32(4, 3, 3, 3), f32(3)), ShapeError, ("bias",)),
        Bad(
            "kernel larger than padded input",
            lambda: rf.conv2d(f32(1, 2, 4, 4), f32(3, 2, 7, 7), None, 1, 1),
            ValueError,
        ),
        Bad("stride 0", lambda: rf.conv2d(f32(1, 2, 6, 6), f32(3, 2, 3, 3), None, 0), ValueError),
        Bad("float padding", lambda: rf.conv2d(f32(1, 2, 6, 6), f32(3, 2, 3, 3), None, 1, 1.5), TypeError),
        Bad("integer weight", lambda: rf.conv2d(f32(1, 2, 6, 6), ints(3, 2, 3, 3)), TypeError),
        Bad(
            "x and weight dtypes differ",
            lambda: rf.conv2d(f32(1, 2, 6, 6), rf.tensor(jnp.ones((3, 2, 3, 3), jnp.bfloat16))),
            TypeError,
            ("float32", "bfloat16"),
        ),
    ],
    "add_channel_bias": [
        Bad("channels differ", lambda: rf.add_channel_bias(f32(3, 5), f32(4)), ShapeError, ("(3, 5)", "(4,)")),
        Bad("rank-1 input", lambda: rf.add_channel_bias(f32(5), f32(5)), ShapeError),
        Bad("rank-2 bias", lambda: rf.add_channel_bias(f32(3, 5), f32(3, 1)), ShapeError),
    ],
    "max_pool2d": [
        Bad("rank-2 input", lambda: rf.max_pool2d(f32(6, 6), 2), ShapeError),
        Bad("kernel larger than input", lambda: rf.max_pool2d(f32(1, 6, 6), 8), ValueError, ("8",)),
        Bad("padding above kernel // 2", lambda: rf.max_pool2d(f32(1, 6, 6), 2, 2, 2), ValueError),
        Bad("float kernel", lambda: rf.max_pool2d(f32(1, 6, 6), 1.5), TypeError),
        Bad("stride 0", lambda: rf.max_pool2d(f32(1, 6, 6), 2, 0), ValueError),
        Bad("integer input", lambda: rf.max_pool2d(ints(1, 6, 6), 2), TypeError),
    ],
    "adaptive_avg_pool2d": [
        Bad("rank-2 input", lambda: rf.adaptive_avg_pool2d(f32(6, 6), 2), ShapeError),
        Bad("output size 0", lambda: rf.adaptive_avg_pool2d(f32(1, 6, 6), 0), ValueError),
        Bad("three output sizes", lambda: rf.adaptive_avg_pool2d(f32(1, 6, 6), (2, 3, 4)), ValueError),
        Bad("float output size", lambda: rf.adaptive_avg_pool2d(f32(1, 6, 6), 1.5), TypeError),
        Bad("negative output size", lambda: rf.adaptive_avg_pool2d(f32(1, 6, 6), (2, -1)), ValueError),
    ],
    "stack": [
        Bad("shapes differ", lambda: rf.stack([f32(3, 4), f32(3, 5)]), ShapeError, ("(3, 4)", "(3, 5)")),
        Bad("empty list", lambda: rf.stack([]), ValueError),
        Bad("a tensor, not a list", lambda: rf.stack(f32(3, 4)), TypeError),
        Bad("axis out of range", lambda: rf.stack([f32(3), f32(3)], axis=3), ShapeError),
    ],
    "slice_batch": [
        Bad("index == size", lambda: rf.slice_batch(f32(4, 3), 4), IndexError, ("4",)),
        Bad("index below -size", lambda: rf.slice_batch(f32(4, 3), -5), IndexError, ("-5",)),
        Bad("float index", lambda: rf.slice_batch(f32(4, 3), 1.0), TypeError),
        Bad("array index", lambda: rf.slice_batch(f32(4, 3), jnp.array(1)), TypeError),
        Bad("scalar input", lambda: rf.slice_batch(f32(), 0), ShapeError),
    ],
    "index": [
        Bad("int out of range", lambda: rf.index(f32(4, 3), 4), IndexError, ("4",)),
        Bad("array index out of range", lambda: rf.index(f32(4, 3), np.array([0, 7])), IndexError, ("7",)),
        Bad("negative array index below -size", lambda: rf.index(f32(4, 3), (np.array([-5]),)), IndexError),
        Bad("array index after an ellipsis", lambda: rf.index(f32(4, 3), (Ellipsis, np.array([3]))), IndexError),
        Bad("too many indices", lambda: rf.index(f32(4, 3), (0, 0, 0)), IndexError, ("(4, 3)",)),
        Bad("float index array", lambda: rf.index(f32(4, 3), np.array([0.5])), TypeError, ("float",)),
        Bad("boolean mask", lambda: rf.index(f32(4, 3), np.array([True, False, True, True])), TypeError, ("bool",)),
    ],
    "bmm": [
        Bad("rank-2 operands", lambda: rf.bmm(f32(3, 4), f32(4, 5)), ShapeError, ("(3, 4)",)),
        Bad("batch sizes differ", lambda: rf.bmm(f32(2, 3, 4), f32(3, 4, 5)), ShapeError),
        Bad("inner sizes differ", lambda: rf.bmm(f32(2, 3, 4), f32(2, 5, 5)), ShapeError),
        Bad("ranks differ", lambda: rf.bmm(f32(2, 2, 3, 4), f32(2, 4, 5)), ShapeError),
        Bad("integer operand", lambda: rf.bmm(ints(2, 3, 4), f32(2, 4, 5)), TypeError),
    ],
    "embedding": [
        Bad("float indices", lambda: rf.embedding(jnp.zeros(3), f32(7, 3)), TypeError, ("float32",)),
        Bad("index == V", lambda: rf.embedding(jnp.array([0, 7]), f32(7, 3)), IndexError, ("7",)),
        Bad("negative index", lambda: rf.embedding(jnp.array([[0, -1]]), f32(7, 3)), IndexError, ("-1",)),
        Bad("rank-1 weight", lambda: rf.embedding(i32(3), f32(7)), ShapeError),
        Bad("integer weight", lambda: rf.embedding(i32(3), ints(7, 3)), TypeError),
    ],
    "dropout": [
        Bad("p = 1", lambda: rf.dropout(f32(3, 4), 1.0, KEY), ValueError, ("1.0",)),
        Bad("p < 0", lambda: rf.dropout(f32(3, 4), -0.1, KEY), ValueError),
        Bad("p a string", lambda: rf.dropout(f32(3, 4), "0.5", KEY), (TypeError, ValueError)),
        Bad("no key", lambda: rf.dropout(f32(3, 4), 0.5, None), TypeError),
        Bad("an int key", lambda: rf.dropout(f32(3, 4), 0.5, 1), TypeError),
        Bad("a float array key", lambda: rf.dropout(f32(3, 4), 0.5, jnp.zeros(2)), TypeError),
        Bad("training not a bool", lambda: rf.dropout(f32(3, 4), 0.5, KEY, training="yes"), TypeError),
        Bad("integer input", lambda: rf.dropout(ints(3, 4), 0.5, KEY), TypeError),
    ],
    "scaled_dot_product_attention": [
        Bad("rank-1 q", lambda: rf.scaled_dot_product_attention(f32(4), f32(4), f32(4)), ShapeError),
        Bad(
            "ranks differ",
            lambda: rf.scaled_dot_product_attention(f32(2, 5, 4), f32(5, 4), f32(5, 4)),
            ShapeError,
        ),
        Bad("q and k widths", lambda: rf.scaled_dot_product_attention(f32(5, 4), f32(6, 3), f32(6, 2)), ShapeError),
        Bad("k and v lengths", lambda: rf.scaled_dot_product_attention(f32(5, 4), f32(6, 4), f32(7, 2)), ShapeError),
        Bad(
            "leading axes differ",
            lambda: rf.scaled_dot_product_attention(f32(2, 5, 4), f32(3, 6, 4), f32(3, 6, 2)),
            ShapeError,
        ),
        Bad(
            "mask shape",
            lambda: rf.scaled_dot_product_attention(f32(5, 4), f32(6, 4), f32(6, 2), jnp.ones((5, 5), bool)),
            ShapeError,
            ("(5, 5)",),
        ),
        Bad(
            "causal not a bool",
            lambda: rf.scaled_dot_product_attention(f32(5, 4), f32(5, 4), f32(5, 2), causal="yes"),
            TypeError,
        ),
        Bad(
            "integer mask",
            lambda: rf.scaled_dot_product_attention(f32(5, 4), f32(5, 4), f32(5, 2), jnp.ones((5, 5), jnp.int32)),
            TypeError,
        ),
        Bad(
            "scale a string",
            lambda: rf.scaled_dot_product_attention(f32(5, 4), f32(5, 4), f32(5, 2), scale="x"),
            TypeError,
        ),
        Bad(
            "integer q",
            lambda: rf.scaled_dot_product_attention(ints(5, 4), f32(5, 4), f32(5, 2)),
            TypeError,
        ),
    ],
}


def op_name(info: OpInfo) -> str:
    """The name the op's messages use (table entries may add a variant suffix)."""
    return info.name.removesuffix("_train").removesuffix("_eval")


def _case_params():
    out = []
    for name, cases in CASES.items():
        for case in cases:
            out.append(pytest.param(name, case, id=f"{name}-{case.what.replace(' ', '_')}"))
    return out


@pytest.mark.parametrize("info", OPS, ids=str)
def test_every_op_in_the_table_is_audited(info: OpInfo):
    assert op_name(info) in CASES, f"add malformed-input cases for {info.name} to CASES"


def _expect_rejected(fn: Callable[[], Any], exc, name: str, also: tuple[str, ...] = ()) -> BaseException:
    with rf.Tape() as tape:
        with pytest.raises(exc) as info:
            fn()
    msg = str(info.value)
    assert name in msg, f"{type(info.value).__name__} does not name {name!r}: {msg}"
    for part in also:
        assert part in msg, f"{part!r} missing from: {msg}"
    assert len(tape) == 0, f"{name} recorded before rejecting its input:\n{tape}"
    return info.value


@pytest.mark.parametrize("name,case", _case_params())
def test_malformed_input(name: str, case: Bad):
    _expect_rejected(case.call, case.exc, name, case.also)


# -- generic cases derived from the table: a non-tensor in each array slot ----


def _first_sample(info: OpInfo):
    return info.samples(np.random.default_rng(zlib.crc32(info.name.encode())))[0]


def _non_tensor_params():
    out = []
    for info in OPS:
        sample = _first_sample(info)
        for pos, arg in enumerate(sample.args):
            if isinstance(arg, np.ndarray):
                for label, bad in (("str", "abc"), ("object", object()), ("bool", True), ("list", [[1.0]])):
                    out.append(pytest.param(info, pos, bad, id=f"{info.name}-arg{pos}-{label}"))
    return out


@pytest.mark.parametrize("info,pos,bad", _non_tensor_params())
def test_non_tensor_operand(info: OpInfo, pos: int, bad: Any):
    sample = _first_sample(info)
    args = [
        rf.tensor(a.astype(np.float32), requires_grad=True) if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a
        for a in sample.args
    ]
    args[pos] = bad
    err = _expect_rejected(lambda: info.op(*args, **sample.kwargs), TypeError, op_name(info))
    assert type(bad).__name__ in str(err)


# -- mixed float dtypes: each gradient comes back in its own input's dtype ----


def _mixed_params():
    out = []
    for info in OPS:
        sample = _first_sample(info)
        floats = [i for i, a in enumerate(sample.args) if isinstance(a, np.ndarray) and a.dtype.kind == "f"]
        if len(floats) >= 2:
            out.append(pytest.param(info, id=info.name))
    return out


@pytest.mark.parametrize("info", _mixed_params())
def test_mixed_float_dtypes(info: OpInfo, x64):
    """The first float operand in float64, the others float32 (and bfloat16):
    either every gradient has its input's dtype or the op refuses at call time
    with a TypeError naming it (conv2d). Found: layer_norm's and batch_norm_2d's
    records returned the bias gradient in the output's dtype."""
    sample = _first_sample(info)
    floats = [i for i, a in enumerate(sample.args) if isinstance(a, np.ndarray) and a.dtype.kind == "f"]
    for low in (jnp.float32, jnp.bfloat16):
        args = list(sample.args)
        for j, i in enumerate(floats):
            args[i] = jnp.asarray(args[i], jnp.float64 if j == 0 else low)

        def f(*a):
            return rf.sum(rf.mul(info.output(info.op(*a, **sample.kwargs)), 1.0))

        try:
            with jax.numpy_dtype_promotion("standard"):  # float64 with float32/bfloat16 on purpose
                grads = rf.grad(f, argnums=sample.diff)(*args)
        except TypeError as e:
            assert op_name(info) in str(e) and info.name == "conv2d", str(e)
            continue
        for g, i in zip(grads, sample.diff):
            assert g.dtype == args[i].dtype and g.shape == args[i].shape, (i, g.dtype, args[i].dtype)


# -- traced indices cannot be range-checked: documented behaviour, no crash --


def test_traced_out_of_range_indices_do_not_raise():
    w = jnp.arange(6.0).reshape(3, 2)
    out = jax.jit(lambda i: rf.embedding(i, w).value)(jnp.array([0, 3]))
    assert np.isnan(np.asarray(out)[1]).all() and not np.isnan(np.asarray(out)[0]).any()
    g = jax.jit(rf.grad(lambda w, i: rf.sum(rf.mul(rf.embedding(i, w), 1.0)), argnums=0))(w, jnp.array([0, 3]))
    np.testing.assert_array_equal(g, [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])  # the bad lookup scatters nowhere


# ---------------------------------------------------------------------------
# transforms and the tape
# ---------------------------------------------------------------------------


def _sq(x):
    return rf.sum(x * x)


TRANSFORM_CASES = [
    ("grad", lambda: rf.grad(_sq)(jnp.arange(3)), TypeError, ("int32", "argnums")),
    ("grad", lambda: rf.grad(_sq)({"a": jnp.ones(2), "b": jnp.array([True])}), TypeError, ("bool",)),
    ("grad", lambda: rf.grad(_sq, argnums=2)(jnp.ones(2)), TypeError, ("argnums=2",)),
    ("grad", lambda: rf.grad(_sq, argnums=())(jnp.ones(2)), TypeError, ("argnums",)),
    ("scalar", lambda: rf.grad(lambda x: x * 2.0)(jnp.ones(3)), TypeError, ("(3,)",)),
    ("grad", lambda: rf.grad(lambda x: rf.sum(x).value.astype(jnp.int32))(jnp.ones(3)), TypeError, ("int32",)),
    ("grad", lambda: rf.grad(lambda x: "loss")(jnp.ones(3)), TypeError, ("str",)),
    ("has_aux", lambda: rf.grad(_sq, has_aux=True)(jnp.ones(3)), TypeError, ("pair",)),
    ("scalar", lambda: rf.value_and_grad(lambda x: x)(jnp.ones(2)), TypeError, ("(2,)",)),
    ("vjp", lambda: rf.vjp(lambda x: x * 2.0, jnp.ones(2))[1]((jnp.ones(2),)), TypeError, ("structure",)),
    ("vjp", lambda: rf.vjp(lambda x: x * 2.0, jnp.ones(2))[1](jnp.ones(3)), ValueError, ("(3,)", "(2,)")),
    ("has_aux", lambda: rf.vjp(lambda x: x * 2.0, jnp.ones(2), has_aux=True), TypeError, ("pair",)),
]


@pytest.mark.parametrize(
    "name,fn,exc,also", TRANSFORM_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(TRANSFORM_CASES)]
)
def test_transform_errors(name, fn, exc, also):
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    assert name in msg, msg
    for part in also:
        assert part in msg, f"{part!r} missing from: {msg}"


def test_transform_errors_also_under_jit():
    with pytest.raises(TypeError, match="scalar"):
        jax.jit(rf.grad(lambda x: x * 2.0))(jnp.ones(3))
    with pytest.raises(rf.ShapeError, match="matmul"):
        jax.jit(rf.grad(lambda w: rf.sum(rf.matmul(w, jnp.ones((4, 2))))))(jnp.ones((2, 3)))
    with pytest.raises(TypeError, match="int32"):
        jax.jit(rf.grad(_sq))(jnp.arange(3))


def test_tape_backward_errors():
    with rf.Tape() as tape:
        w = rf.tensor(np.ones(3, np.float32), requires_grad=True)
        y = w * 2.0
    with pytest.raises(rf.AutogradError, match="tracked Tensor"):
        tape.backward(jnp.ones(()), retain=True)
    with pytest.raises(TypeError, match="scalar"):
        tape.backward(y, retain=True)
    with pytest.raises(TypeError, match=r"\(2,\)"):
        tape.backward(y, retain=True, grad=jnp.ones(2))
    tape.backward(y, grad=jnp.ones(3))
    with pytest.raises(rf.AutogradError, match="consumed"):
        tape.backward(y, grad=jnp.ones(3))


def test_tensor_constructor_errors():
    with pytest.raises(TypeError, match="int32"):
        rf.tensor(np.arange(3, dtype=np.int32), requires_grad=True)
    with pytest.raises(TypeError, match="object"):
        rf.tensor(object())
