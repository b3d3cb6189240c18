"""One rule runner for both reverse walks (Note [One rule runner] in
rumus_fx/autograd/runner.py): a gradient of the wrong shape or dtype raises the
same ``AutogradError`` whether the record is a tape entry or a row of a lifted
call, eagerly and under jit; a lifted row's gradient is never silently cast."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import mlir

import rumus_fx as rf
from rumus_fx.autograd.record import Record
from rumus_fx.autograd.tape import current_tape
from rumus_fx.ops._core import record
from rumus_fx.tensor import Tensor, next_grad_id


def _sin_primitive(name: str) -> Primitive:
    p = Primitive(name)
    p.def_impl(jnp.sin)
    p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(p, mlir.lower_fun(jnp.sin, multiple_results=False))
    return p


SIN_BAD_DTYPE = _sin_primitive("sin_bad_dtype_test")
SIN_BAD_SHAPE = _sin_primitive("sin_bad_shape_test")


def _wrong_dtype(r, g):
    return ((g * jnp.cos(r.ins[0])).astype(jnp.bfloat16),)


def _wrong_shape(r, g):
    return (jnp.sum(g * jnp.cos(r.ins[0]), keepdims=True),)


@dataclasses.dataclass(frozen=True)
class WrongDtypeBackward(Record):
    x: jax.Array

    def backward(self, g, needs):
        return ((g * jnp.cos(self.x)).astype(jnp.bfloat16),)


def _wrong_dtype_op(x: Tensor) -> Tensor:
    """sin(x), recorded with a hand-made record whose rule returns bfloat16."""
    out = Tensor._wrap(jnp.sin(x.value), next_grad_id())
    return record(current_tape(), WrongDtypeBackward(x.value), [x], out)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_tape_record_returning_a_wrong_dtype_raises_the_same_way(jit):
    wrap = jax.jit if jit else (lambda h: h)
    with pytest.raises(
        rf.AutogradError, match=r"bfloat16\[3\] for its input 0, which is float32\[3\] \(a bug in WrongDtypeBackward\)"
    ):
        wrap(rf.grad(lambda x: rf.sum(_wrong_dtype_op(x * 1.0))))(jnp.linspace(0.0, 1.0, 3))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    ("prim", "vjp", "message"),
    [
        (SIN_BAD_DTYPE, _wrong_dtype, r"bfloat16\[3\] for its input 0, which is float32\[3\]"),
        (SIN_BAD_SHAPE, _wrong_shape, r"float32\[1\] for its input 0, which is float32\[3\]"),
    ],
    ids=["dtype", "shape"],
)
def test_a_lifted_rule_returning_a_wrong_gradient_raises(prim, vjp, message, jit):
    rf.defrule(prim, vjp, saves=((0,), ()))
    try:
        f = rf.lift(lambda x: jnp.sum(prim.bind(x)))
        wrap = jax.jit if jit else (lambda h: h)
        with pytest.raises(rf.AutogradError, match=message + r" \(a bug in SinBad\w+Backward in rf\.lift"):
            wrap(rf.grad(f))(jnp.linspace(0.0, 1.0, 3))
    finally:
        rf.undefrule(prim)


def test_the_same_rule_done_right_gives_jax_grad():
    """The control: the rule returning the right dtype and shape passes."""
    rf.defrule(SIN_BAD_DTYPE, lambda r, g: (g * jnp.cos(r.ins[0]),), saves=((0,), ()))
    try:
        x = jnp.linspace(0.0, 1.0, 3)
        got = rf.grad(rf.lift(lambda x: jnp.sum(SIN_BAD_DTYPE.bind(x))))(x)
        np.testing.assert_allclose(got, jax.grad(lambda x: jnp.sum(jnp.sin(x)))(x), rtol=1e-6)
    finally:
        rf.undefrule(SIN_BAD_DTYPE)
