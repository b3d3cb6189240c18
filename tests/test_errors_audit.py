"""Error audit: every op of the op table (and every transform) rejects malformed
input with the right exception type, a message naming the op, and nothing
recorded on the tape; every program a primitive rule of ``rf.lift`` declares it
refuses (``defrule(errors=...)``) raises its exception naming the primitive.

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
from rumus_fx.autograd.registry import BadInput, BadProgram, declarations
from rumus_fx.ops._declare import materialise

from .ops.optable import OPS, OpInfo

ShapeError = rf.ShapeError


@dataclasses.dataclass(frozen=True)
class Bad:
    what: str
    call: Callable[[], Any]
    exc: type[BaseException]
    also: tuple[str, ...] = ()  # more substrings the message must contain


def op_name(info: Any) -> str:
    """The name the op's messages use (table entries may add a variant suffix)."""
    return info.name.removesuffix("_train").removesuffix("_eval")


def _bad(fn: Callable, case: BadInput) -> Bad:
    """A declared malformed input (its placeholders built when the case runs)."""
    return Bad(case.what, lambda: fn(*materialise(case.args), **materialise(case.kwargs)), case.exc, case.also)


# the malformed inputs each op declares (``errors=`` of its @op declaration)
CASES: dict[str, list[Bad]] = {}
for _decl in declarations("op"):
    if _decl.errors is not None:
        CASES.setdefault(op_name(_decl), []).extend(_bad(_decl.fn, c) for c in _decl.errors())


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


# -- primitive rules and rf.lift: the programs they refuse ---------------------
# (``errors=`` of each ``defrule`` in rumus_fx/lift/rules_<family>.py, and of the
# "lift" declaration itself for primitives without a rule)


def _program_params():
    out = []
    for decl in declarations():
        if decl.kind in ("primitive", "composite") and decl.errors is not None:
            for case in decl.errors():
                out.append(pytest.param(decl, case, id=f"{decl.name}-{case.what.replace(' ', '_')}"))
    return out


PROGRAM_CASES = _program_params()


def _program_args(case: BadProgram) -> tuple:
    dtype = jnp.float64 if case.x64 else jnp.float32
    return tuple(
        jnp.asarray(a, dtype) if np.asarray(a).dtype.kind == "f" else jnp.asarray(a) for a in materialise(case.args)
    )


def run_bad_program(decl, case: BadProgram) -> BaseException:
    """``rf.grad`` of the lifted program raises ``case.exc`` naming the primitive
    (or ``case.names``) with ``case.also`` in its message; with ``jax_too``,
    ``jax.grad`` of the plain program raises as well."""
    with jax.enable_x64(case.x64):
        args = _program_args(case)
        if case.jax_too:
            with pytest.raises((NotImplementedError, ValueError, TypeError)):
                jax.grad(lambda *a: jnp.sum(case.fun(*a)), argnums=case.argnums)(*args)
        with pytest.raises(case.exc) as info:
            rf.grad(lambda *a: rf.sum(rf.lift(case.fun)(*a)), argnums=case.argnums)(*args)
    msg = str(info.value)
    for part in (case.names or (decl.name,)) + tuple(case.also):
        assert part in msg, f"{part!r} missing from: {msg}"
    return info.value


@pytest.mark.parametrize("decl,case", PROGRAM_CASES)
def test_lifted_program_refused(decl, case: BadProgram):
    run_bad_program(decl, case)


def test_primitive_error_cases_are_declared():
    names = {p.values[0].name for p in PROGRAM_CASES}
    want = {"while", "custom_vjp_call", "reduce_window", "scatter", "scatter-mul", "qr", "svd"}
    want |= {"custom_linear_solve", "polygamma", "regularized_incomplete_beta", "lift", "custom_jvp_call"}
    assert want <= names, sorted(want - names)
    assert all(isinstance(p.values[1], BadProgram) for p in PROGRAM_CASES)


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
