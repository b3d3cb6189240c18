"""Elementwise arithmetic: add, sub, mul, div (NumPy broadcasting), neg, exp,
log (declared by family: Note [Unary op family] in ``_unary.py``), add_bias —
forward functions with their backward records side by side."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .. import lazy
from ..autograd.record import Aval, Record, VersionSnapshot
from ..eager import PY_SCALARS, compiled
from ..errors import ShapeError
from ..recording import current_tape
from ..tensor import Tensor, next_grad_id
from . import _formulas as formulas
from ._core import (
    BroadcastInfo,
    acc_sum,
    align_rank,
    aval_of,
    broadcast_info,
    broadcast_shapes,
    cast,
    deferrable,
    deferred_scalar,
    eager_jit,
    new_output,
    new_record,
    reads,
    record,
    record_deferred,
    same_shape_info,
    scalar_operand,
    shape_of,
    sum_to,
    tape_for,
    value_of,
)
from ._declare import BadInput, Sample, normal, op, positive, ranked, tracked, unary_samples
from ._unary import unary_op

Array = jax.Array
frozen = dataclasses.dataclass(frozen=True, eq=False)


# ---------------------------------------------------------------------------
# records
# ---------------------------------------------------------------------------


# One formula per arithmetic op, shared by its equal-shape record and its
# broadcasting record; the two differ only in how an output-shaped gradient is
# taken back to an operand (``_to``: a cast, or a sum over the broadcast axes).


class _AddFormula(Record):
    """``c = a + b``: ``da = dc``, ``db = dc``."""

    def _to(self, k: int, g: Array) -> Array:
        raise NotImplementedError

    def backward(self, g, needs):
        return (self._to(0, g) if needs[0] else None, self._to(1, g) if needs[1] else None)


class _SubFormula(_AddFormula):
    """``c = a - b``: ``da = dc``, ``db = -dc``."""

    def backward(self, g, needs):
        return (self._to(0, g) if needs[0] else None, self._to(1, -g) if needs[1] else None)


class _MulFormula(_AddFormula):
    """``c = a * b``: ``da = dc * b``, ``db = dc * a`` (saved: ``b`` only when
    ``a`` needs a gradient, ``a`` only when ``b`` does)."""

    def backward(self, g, needs):
        nd = g.ndim
        return (
            self._to(0, g * align_rank(self.rhs, nd)) if needs[0] else None,
            self._to(1, g * align_rank(self.lhs, nd)) if needs[1] else None,
        )


class _Broadcasting(_AddFormula):
    """Gradients summed over the axes each operand was broadcast along."""

    def _to(self, k, g):
        return sum_to(g, self.rhs_broadcast if k else self.lhs_broadcast)


@frozen
class AddBackward(_AddFormula):
    """``c = a + b`` (equal shapes): ``da = dc``, ``db = dc``. Reads no data."""

    lhs: Aval | None
    rhs: Aval | None

    def _to(self, k, g):
        return cast(g, (self.rhs if k else self.lhs).dtype)


@frozen
class SubBackward(_SubFormula):
    """``c = a - b`` (equal shapes): ``da = dc``, ``db = -dc``. Reads no data."""

    lhs: Aval | None
    rhs: Aval | None

    _to = AddBackward._to


@frozen
class MulBackward(_MulFormula):
    """``c = a * b`` (equal shapes): ``da = dc * b``, ``db = dc * a``.

    Saves ``b`` only when ``a`` needs a gradient and ``a`` only when ``b`` does.
    """

    lhs: Array | float | None
    lhs_version: VersionSnapshot | None
    rhs: Array | float | None
    rhs_version: VersionSnapshot | None
    lhs_aval: Aval | None
    rhs_aval: Aval | None

    def _to(self, k, g):
        return cast(g, (self.rhs_aval if k else self.lhs_aval).dtype)


@frozen
class BroadcastAddBackward(_Broadcasting):
    """``c = a + b`` with broadcasting: gradients summed over broadcast axes."""

    lhs_broadcast: BroadcastInfo | None
    rhs_broadcast: BroadcastInfo | None


@frozen
class BroadcastSubBackward(_Broadcasting, _SubFormula):
    """``c = a - b`` with broadcasting."""

    lhs_broadcast: BroadcastInfo | None
    rhs_broadcast: BroadcastInfo | None


@frozen
class BroadcastMulBackward(_Broadcasting, _MulFormula):
    """``c = a * b`` with broadcasting."""

    lhs: Array | float | None
    lhs_version: VersionSnapshot | None
    rhs: Array | float | None
    rhs_version: VersionSnapshot | None
    lhs_broadcast: BroadcastInfo | None
    rhs_broadcast: BroadcastInfo | None


@frozen
class DivBackward(Record):
    """``c = a / b`` (any broadcasting): ``da = dc / b``, ``db = -(dc / b) * a / b``."""

    lhs: Array | float | None
    lhs_version: VersionSnapshot | None
    rhs: Array | float | None
    rhs_version: VersionSnapshot | None
    lhs_broadcast: BroadcastInfo | None
    rhs_broadcast: BroadcastInfo | None

    def backward(self, g, needs):
        nd = g.ndim
        g_over_b = g / align_rank(self.rhs, nd)
        return (
            sum_to(g_over_b, self.lhs_broadcast) if needs[0] else None,
            sum_to(-g_over_b * (align_rank(self.lhs, nd) / align_rank(self.rhs, nd)), self.rhs_broadcast)
            if needs[1]
            else None,
        )


@frozen
class AddBiasBackward(Record):
    """``y = m + b`` with ``m:[..., n]``, ``b:[n]``: ``dm = dy``,
    ``db = dy`` summed over the leading rows. Reads no data."""

    input_dtype: Any
    bias_dtype: Any

    def backward(self, g, needs):
        gm = cast(g, self.input_dtype) if needs[0] else None
        gb = None
        if needs[1]:
            gb = cast(acc_sum(g, tuple(range(g.ndim - 1))), self.bias_dtype)
        return gm, gb


# ---------------------------------------------------------------------------
# forward functions
# ---------------------------------------------------------------------------

_FORWARD = {
    k: eager_jit(f) for k, f in (("add", jnp.add), ("sub", jnp.subtract), ("mul", jnp.multiply), ("div", jnp.divide))
}
_JITTED = {k: compiled(f.__wrapped__) for k, f in _FORWARD.items()}  # the jax.jit each one calls eagerly
_KINDS = {k: lazy.Kind(k, f.__wrapped__, binary=True) for k, f in _FORWARD.items()}  # ``t <op> scalar``, deferred


def binary_record(
    kind: str,
    a: Any,
    b: Any,
    av: Any,
    bv: Any,
    out_shape: tuple[int, ...],
    lhs_private: Any = None,
    rhs_private: Any = None,
) -> Record:
    """The record of ``a <kind> b``. In-place ops pass as ``*_private`` the
    pre-write value of operands living in the storage being written: that buffer
    is private to the record, so it needs no snapshot."""
    need_a = isinstance(a, Tensor) and a._gid is not None
    need_b = isinstance(b, Tensor) and b._gid is not None
    same = tuple(getattr(av, "shape", ())) == tuple(getattr(bv, "shape", ())) == out_shape
    if kind in ("add", "sub"):
        if same:
            cls = AddBackward if kind == "add" else SubBackward
            return cls(aval_of(av), aval_of(bv))
        cls = BroadcastAddBackward if kind == "add" else BroadcastSubBackward
        return cls(broadcast_info(av, out_shape), broadcast_info(bv, out_shape))
    # mul / div read data: save what the needed gradients read
    lhs_needed = need_b
    rhs_needed = need_a or (kind == "div" and need_b)
    lhs, lhs_v = _saved(a, av, lhs_needed, lhs_private)
    rhs, rhs_v = _saved(b, bv, rhs_needed, rhs_private)
    if kind == "mul":
        if same:
            return MulBackward(lhs, lhs_v, rhs, rhs_v, aval_of(av), aval_of(bv))
        return BroadcastMulBackward(
            lhs, lhs_v, rhs, rhs_v, broadcast_info(av, out_shape), broadcast_info(bv, out_shape)
        )
    return DivBackward(lhs, lhs_v, rhs, rhs_v, broadcast_info(av, out_shape), broadcast_info(bv, out_shape))


def _scalar_rhs_record(kind: str, a: Tensor, b: int | float, av: Any) -> Record:
    """``binary_record(kind, a, b, av, b, a.shape)`` for a tracked ``a`` and a
    python scalar ``b``, built directly (Note [Eager fast path]): the output has
    ``a``'s shape, so ``a`` broadcasts over no axis, ``b`` has no shape, and
    only ``a`` needs a gradient (mul and div save ``b``, never ``a``). A 0-d
    ``a`` (equal shapes: the plain records) takes ``binary_record``."""
    shape = tuple(av.shape)
    if not shape:
        return binary_record(kind, a, b, av, b, shape)
    info = same_shape_info(shape, av.dtype)  # broadcast_info(av, shape), shared
    if kind == "add":
        return new_record(BroadcastAddBackward, info, None)
    if kind == "sub":
        return new_record(BroadcastSubBackward, info, None)
    if kind == "mul":
        return new_record(BroadcastMulBackward, None, None, b, None, info, None)
    return new_record(DivBackward, None, None, b, None, info, None)


_SCALAR_RHS_PROVENANCE = {"add": (), "sub": (), "mul": (("rhs", None, None),), "div": (("rhs", None, None),)}


def _saved(x: Any, xv: Any, needed: bool, private: Any) -> tuple[Any, Any]:
    if not needed:
        return None, None
    if private is not None:  # the pre-write buffer of an in-place op
        return private, None
    if isinstance(x, Tensor):
        return reads(x, True)
    return xv, None


def _binary(kind: str, a: Any, b: Any) -> Tensor:
    if type(b) in PY_SCALARS and isinstance(a, Tensor):  # ``t * 2.0``: nothing to broadcast or align
        src = deferrable(a)
        if src is not None and deferred_scalar(b):  # Note [Deferred elementwise ops] (rumus_fx/lazy.py)
            out = lazy.defer(_KINDS[kind], src, b)
            tape = current_tape() if a._gid is not None else None
            if tape is None:
                return Tensor._wrap(out)
            res = Tensor._wrap(out, next_grad_id())
            rec = _scalar_rhs_record(kind, a, b, src)
            # what ``Provenance(rec, pairs)`` computes of the (output, a, b)
            # pairs: the record saves only ``b`` (mul, div), an untracked value
            return record_deferred(tape, rec, a, b, res, _SCALAR_RHS_PROVENANCE[kind])
        av = a.value
        if isinstance(av, jax.core.Tracer):
            out = _FORWARD[kind](av, b)  # traced inline (Note [Eager compilation])
        else:  # no tracer among the operands: eager_jit's own compiled call, directly
            out = _JITTED[kind](av, scalar_operand(b))
        tape = current_tape() if a._gid is not None else None
        if tape is None:
            return Tensor._wrap(out)
        res = Tensor._wrap(out, next_grad_id())
        return record(tape, _scalar_rhs_record(kind, a, b, av), (a, b), res)
    av = value_of(a, kind, "lhs")
    bv = value_of(b, kind, "rhs")
    out_shape = broadcast_shapes(kind, shape_of(av), shape_of(bv))
    nd = len(out_shape)
    out = _FORWARD[kind](align_rank(av, nd), align_rank(bv, nd))
    tape = tape_for(a, b)
    if tape is None:
        return Tensor._wrap(out)
    res = new_output(out, tape)
    return record(tape, binary_record(kind, a, b, av, bv, out_shape), (a, b), res)


def _binary_samples(positive_rhs: bool = False):
    rhs = positive if positive_rhs else normal
    pairs = [((3, 5), (3, 5)), ((2, 3, 7), (3, 7)), ((4, 1, 3), (5, 1)), ((3,), (2, 3)), ((), (3, 2))]
    return lambda rng: [Sample((normal(rng, *a), rhs(rng, *b)), diff=(0, 1)) for a, b in pairs]


_UNARY_SHAPES = [(3, 5), (2, 3, 7)]


@op(
    records=(AddBackward, BroadcastAddBackward),
    ref=ranked(jnp.add),
    samples=_binary_samples(),
    errors=lambda: [
        BadInput("shapes that do not broadcast", (tracked(3, 4), tracked(5)), ShapeError, ("(3, 4)", "(5,)")),
        BadInput("swapped axes", (tracked(2, 3), tracked(3, 2)), ShapeError),
    ],
)
def add(a: Any, b: Any) -> Tensor:
    """``a + b`` with NumPy broadcasting (records AddBackward or BroadcastAddBackward)."""
    return _binary("add", a, b)


@op(
    records=(SubBackward, BroadcastSubBackward),
    ref=ranked(jnp.subtract),
    samples=_binary_samples(),
    errors=lambda: [
        BadInput("shapes that do not broadcast", (tracked(2, 3, 4), tracked(3, 2)), ShapeError, ("(3, 2)",))
    ],
)
def sub(a: Any, b: Any) -> Tensor:
    """``a - b`` with NumPy broadcasting (records SubBackward or BroadcastSubBackward)."""
    return _binary("sub", a, b)


@op(
    records=(MulBackward, BroadcastMulBackward),
    ref=ranked(jnp.multiply),
    samples=_binary_samples(),
    errors=lambda: [BadInput("shapes that do not broadcast", (tracked(4), tracked(3)), ShapeError, ("(4,)", "(3,)"))],
)
def mul(a: Any, b: Any) -> Tensor:
    """``a * b`` with NumPy broadcasting (records MulBackward or BroadcastMulBackward)."""
    return _binary("mul", a, b)


@op(
    records=(DivBackward,),
    ref=ranked(jnp.divide),
    samples=_binary_samples(positive_rhs=True),
    errors=lambda: [BadInput("shapes that do not broadcast", (tracked(2, 5), tracked(2, 4)), ShapeError)],
)
def div(a: Any, b: Any) -> Tensor:
    """``a / b`` with NumPy broadcasting (records DivBackward)."""
    return _binary("div", a, b)


NegBackward, neg = unary_op(
    "neg",
    jnp.negative,
    formulas.neg,
    None,
    floats_only=False,
    doc="``-x`` (records NegBackward).",
    record_doc="``y = -x``: ``dx = -dy``. Reads no data.",
    ref=jnp.negative,
    samples=unary_samples(_UNARY_SHAPES),
    errors=lambda: [BadInput("a python list", ([1.0, 2.0],), TypeError, ("list",))],
)
neg: Callable[[Any], Tensor]  # declared for static readers (type checkers, the API reference)
"""``-x`` (records NegBackward)."""

ExpBackward, exp = unary_op(
    "exp",
    jnp.exp,
    formulas.exp,
    "output",
    floats_only=False,
    doc="``exp(x)`` (records ExpBackward, which saves the output).",
    record_doc="``y = exp(x)``: ``dx = dy * y``. Saves the **output**.",
    ref=jnp.exp,
    samples=unary_samples(_UNARY_SHAPES),
    errors=lambda: [BadInput("None", (None,), TypeError, ("NoneType",))],
)
exp: Callable[[Any], Tensor]  # declared for static readers (type checkers, the API reference)
"""``exp(x)`` (records ExpBackward, which saves the output)."""

LogBackward, log = unary_op(
    "log",
    jnp.log,
    formulas.log,
    "input",
    floats_only=False,
    doc="Natural logarithm (records LogBackward, which saves the input).",
    record_doc="``y = log(x)``: ``dx = dy / x``. Saves the input.",
    ref=jnp.log,
    samples=unary_samples(_UNARY_SHAPES, positive),
    errors=lambda: [BadInput("a string", ("1.0",), TypeError, ("str",))],
)
log: Callable[[Any], Tensor]  # declared for static readers (type checkers, the API reference)
"""Natural logarithm (records LogBackward, which saves the input)."""


def _ref_add_bias(m: Any, b: Any) -> Any:
    return m + b[None, :] if m.ndim == 2 else m + b.reshape((1,) * (m.ndim - 1) + b.shape)


@op(
    records=(AddBiasBackward,),
    ref=_ref_add_bias,
    samples=lambda r: [
        Sample((normal(r, 3, 5), normal(r, 5)), diff=(0, 1)),
        Sample((normal(r, 2, 3, 5), normal(r, 5)), diff=(0, 1)),
    ],
    errors=lambda: [
        BadInput("rank-2 bias", (tracked(3, 5), tracked(2, 5)), ShapeError, ("(2, 5)",)),
        BadInput("bias size", (tracked(3, 5), tracked(4)), ShapeError, ("(3, 5)", "(4,)")),
        BadInput("scalar input", (tracked(), tracked(1)), ShapeError),
    ],
)
def add_bias(m: Any, b: Any) -> Tensor:
    """``m + b`` for ``m:[M, N]`` (or ``[..., N]``) and ``b:[N]`` (records AddBiasBackward)."""
    mv = value_of(m, "add_bias", "input")
    bv = value_of(b, "add_bias", "bias")
    ms, bs = shape_of(mv), shape_of(bv)
    if len(bs) != 1 or len(ms) < 1 or ms[-1] != bs[0]:
        raise ShapeError(f"add_bias: expects input [..., N] and bias [N], got {ms} and {bs}")
    out = mv + align_rank(bv, len(ms))
    tape = tape_for(m, b)
    if tape is None:
        return Tensor._wrap(out)
    rec = AddBiasBackward(getattr(mv, "dtype", None), getattr(bv, "dtype", None))
    return record(tape, rec, (m, b), new_output(out, tape))
