"""Activations: relu, sigmoid, tanh, softplus (declared by family: Note [Unary op
family] in ``_unary.py``), gelu, leaky_relu, softmax."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..autograd.record import Record, VersionSnapshot
from ..errors import ShapeError
from ..kernels import softmax as ksoftmax
from ..tensor import Tensor
from . import _formulas as formulas
from ._core import (
    array_of,
    eager_jit,
    is_real_scalar,
    new_output,
    normalize_axis,
    reads,
    record,
    require_float,
    snapshot,
    tape_for,
)
from ._declare import BadInput, Sample, away_from_zero, integers, normal, op, tracked, unary_samples
from ._unary import unary_op

Array = jax.Array
frozen = dataclasses.dataclass(frozen=True, eq=False)


_UNARY_SHAPES = [(3, 5), (2, 3, 7)]

ReluBackward, relu = unary_op(
    "relu",
    lambda x: jnp.maximum(x, 0),
    formulas.relu,
    "input",
    floats_only=False,
    doc="``max(x, 0)``; the gradient at exactly 0 is 0, as ``jax.nn.relu`` (records ReluBackward).",
    record_doc="``y = max(x, 0)``: ``dx = dy`` where ``x > 0``, else 0. Saves the input.",
    ref=jax.nn.relu,
    samples=unary_samples(_UNARY_SHAPES, away_from_zero),
    errors=lambda: [BadInput("an object", (object(),), TypeError)],
)
relu: Callable[[Any], Tensor]  # declared for static readers (type checkers, the API reference)
"""``max(x, 0)``; the gradient at exactly 0 is 0, as ``jax.nn.relu`` (records ReluBackward)."""


_SQRT_2_OVER_PI = 0.7978845608028654
_GELU_C = 0.044715
_INV_SQRT_2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


@eager_jit(static_argnums=(1,))
def _gelu_forward(x: Array, approximate: bool) -> Array:
    if approximate:
        inner = _SQRT_2_OVER_PI * (x + _GELU_C * x * x * x)
        return 0.5 * x * (1 + jnp.tanh(inner))
    return 0.5 * x * (1 + lax.erf(x * _INV_SQRT_2))


@frozen
class GeluBackward(Record):
    """``y = gelu(x)`` (tanh approximation or exact erf). Saves the input."""

    input: Array
    input_version: VersionSnapshot | None
    approximate: bool

    def backward(self, g, needs):
        x = self.input
        if self.approximate:
            t = jnp.tanh(_SQRT_2_OVER_PI * (x + _GELU_C * x * x * x))
            dinner = _SQRT_2_OVER_PI * (1 + 3 * _GELU_C * x * x)
            d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * dinner
        else:
            cdf = 0.5 * (1 + lax.erf(x * _INV_SQRT_2))
            pdf = _INV_SQRT_2PI * jnp.exp(-0.5 * x * x)
            d = cdf + x * pdf
        return (g * d,)


@frozen
class LeakyReluBackward(Record):
    """``y = x if x >= 0 else alpha x``: ``dx = dy`` or ``alpha dy``. Saves the input."""

    input: Array
    input_version: VersionSnapshot | None
    alpha: float

    def backward(self, g, needs):
        return (jnp.where(self.input >= 0, g, g * self.alpha),)


@frozen
class SoftmaxBackward(Record):
    """``y = softmax(x, axis)``: ``dx = y * (dy - sum(dy * y, axis))``. Saves the
    **output**."""

    output: Array
    output_version: VersionSnapshot | None
    axis: int

    def backward(self, g, needs):
        return (ksoftmax.softmax_bwd(self.output, g, self.axis),)


def _saves_output(x: Any, out: Array, rec_cls: type, *extra: Any) -> Tensor:
    tape = tape_for(x)
    if tape is None:
        return Tensor._wrap(out)
    res = new_output(out, tape)
    return record(tape, rec_cls(out, snapshot(res), *extra), (x,), res)


def _saves_input(x: Any, out: Array, rec_cls: type, *extra: Any) -> Tensor:
    tape = tape_for(x)
    if tape is None:
        return Tensor._wrap(out)
    saved, version = reads(x, True)
    return record(tape, rec_cls(saved, version, *extra), (x,), new_output(out, tape))


SigmoidBackward, sigmoid = unary_op(
    "sigmoid",
    jax.nn.sigmoid,
    formulas.sigmoid,
    "output",
    doc="Logistic sigmoid (records SigmoidBackward, which saves the output).",
    record_doc="``y = sigmoid(x)``: ``dx = dy * y * (1 - y)``. Saves the **output**.",
    ref=jax.nn.sigmoid,
    samples=unary_samples(_UNARY_SHAPES),
    errors=lambda: [BadInput("integer input", (integers(3),), TypeError, ("int32",))],
)
sigmoid: Callable[[Any], Tensor]  # declared for static readers (type checkers, the API reference)
"""Logistic sigmoid (records SigmoidBackward, which saves the output)."""

TanhBackward, tanh = unary_op(
    "tanh",
    jnp.tanh,
    formulas.tanh,
    "output",
    doc="Hyperbolic tangent (records TanhBackward, which saves the output).",
    record_doc="``y = tanh(x)``: ``dx = dy * (1 - y^2)``. Saves the **output**.",
    ref=jnp.tanh,
    samples=unary_samples(_UNARY_SHAPES),
    errors=lambda: [BadInput("integer input", (integers(3),), TypeError, ("int32",))],
)
tanh: Callable[[Any], Tensor]  # declared for static readers (type checkers, the API reference)
"""Hyperbolic tangent (records TanhBackward, which saves the output)."""

SoftplusBackward, softplus = unary_op(
    "softplus",
    jax.nn.softplus,
    formulas.softplus,
    "input",
    defers=False,
    doc="``log(1 + exp(x))``, as ``jax.nn.softplus`` (records SoftplusBackward, which saves the input).",
    record_doc="``y = softplus(x)``: ``dx = dy * sigmoid(x)``. Saves the input.",
    ref=lambda x: jnp.logaddexp(x, 0.0),
    samples=unary_samples(_UNARY_SHAPES),
    errors=lambda: [BadInput("integer input", (integers(3),), TypeError, ("int32",))],
)
softplus: Callable[[Any], Tensor]  # declared for static readers (type checkers, the API reference)
"""``log(1 + exp(x))``, as ``jax.nn.softplus`` (records SoftplusBackward, which saves the input)."""


@op(
    records=(GeluBackward,),
    ref=jax.nn.gelu,
    samples=lambda r: [
        Sample((normal(r, 3, 5),)),
        Sample((normal(r, 2, 3, 7),), {"approximate": False}),
        Sample((normal(r, 4, 6),), {"approximate": True}),
    ],
    errors=lambda: [
        BadInput("integer input", (integers(3),), TypeError),
        BadInput("approximate not a bool", (tracked(3),), TypeError, ("'tanh'",), {"approximate": "tanh"}),
    ],
)
def gelu(x: Any, approximate: bool = True) -> Tensor:
    """GELU; the tanh approximation by default (as rumus), exact erf form with
    ``approximate=False`` (records GeluBackward)."""
    xv = array_of(x, "gelu")
    require_float("gelu", xv)
    if not isinstance(approximate, bool):
        raise TypeError(f"gelu: approximate must be a bool, got {approximate!r}")
    return _saves_input(x, _gelu_forward(xv, approximate), GeluBackward, approximate)


@op(
    records=(LeakyReluBackward,),
    ref=lambda x, alpha=0.01: jax.nn.leaky_relu(x, alpha),
    samples=lambda r: [Sample((away_from_zero(r, 3, 5),)), Sample((away_from_zero(r, 2, 3, 7), 0.2))],
    errors=lambda: [
        BadInput("alpha a string", (tracked(3),), TypeError, ("'0.1'",), {"alpha": "0.1"}),
        BadInput("integer input", (integers(3),), TypeError),
    ],
)
def leaky_relu(x: Any, alpha: float = 0.01) -> Tensor:
    """``x`` where ``x >= 0``, else ``alpha * x`` (records LeakyReluBackward)."""
    xv = array_of(x, "leaky_relu")
    require_float("leaky_relu", xv)
    if not is_real_scalar(alpha):
        raise TypeError(f"leaky_relu: alpha must be a python float, got {alpha!r}")
    alpha = float(alpha)
    out = jnp.where(xv >= 0, xv, xv * alpha)
    return _saves_input(x, out, LeakyReluBackward, alpha)


@op(
    records=(SoftmaxBackward,),
    ref=jax.nn.softmax,
    samples=lambda r: [
        Sample((normal(r, 3, 5),)),
        Sample((normal(r, 2, 3, 7),), {"axis": 1}),
        Sample((normal(r, 2, 3, 7) * 5,), {"axis": 0}),
    ],
    errors=lambda: [
        BadInput("axis out of range", (tracked(3, 4),), ShapeError, kwargs={"axis": 2}),
        BadInput("scalar", (tracked(),), ShapeError),
        BadInput("integer input", (integers(3),), TypeError),
    ],
)
def softmax(x: Any, axis: int = -1) -> Tensor:
    """Numerically stable softmax along ``axis`` (records SoftmaxBackward, which
    saves the output)."""
    xv = array_of(x, "softmax")
    require_float("softmax", xv)
    if xv.ndim == 0:
        raise ShapeError("softmax: expects a tensor of rank >= 1, got a scalar")
    ax = normalize_axis("softmax", axis, xv.ndim)
    out = ksoftmax.softmax_fwd(xv, ax)
    return _saves_output(x, out, SoftmaxBackward, ax)
