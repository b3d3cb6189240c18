"""Helpers every op uses: operands, recording, snapshots, broadcasting."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import lazy
from .. import tensor as _tensor_module
from ..autograd.record import Aval, Provenance, VersionSnapshot, metadata_type
from ..autograd.tape import Tape, current_tape, new_entry
from ..eager import PY_SCALARS
from ..eager import eager_jit as eager_jit
from ..eager import reshape as eager_reshape
from ..eager import scalar_operand as scalar_operand
from ..errors import ShapeError
from ..kernels.precision import is_low_precision as is_low_precision
from ..sharding import sharding_of
from ..tensor import Tensor, next_grad_id

Array = jax.Array


# ---------------------------------------------------------------------------
# operands
# ---------------------------------------------------------------------------


def value_of(x: Any, op: str, what: str = "input") -> Any:
    """The array (or python scalar) behind an operand."""
    if isinstance(x, Tensor):
        return x.value
    if isinstance(x, jax.Array):
        return x
    if isinstance(x, (np.ndarray, np.generic)):
        return jnp.asarray(x)
    if isinstance(x, PY_SCALARS) and not isinstance(x, bool):
        return x
    raise TypeError(f"{op}: {what} must be an rf.Tensor, a jax/numpy array or a python scalar, got {type(x).__name__}")


def shape_of(x: Any) -> tuple[int, ...]:
    return tuple(getattr(x, "shape", ()))


_tuple_new = tuple.__new__  # a NamedTuple in one C call (its ``__new__`` is Python)


def tensor_aval(x: Tensor) -> Aval:
    """``Aval(x.shape, x.dtype)``, kept on the storage for a tensor viewing all
    of it: one recorded op's output is the next one's input (Note [Eager fast
    path]). An in-place write keeps a buffer's shape and dtype, and resets it
    anyway."""
    storage = x._storage
    if x._layout is not None:
        return _tuple_new(Aval, (x._layout.shape, storage._buffer.dtype))
    aval = storage._aval
    if aval is None:
        buffer = storage._buffer
        aval = storage._aval = _tuple_new(Aval, (tuple(buffer.shape), buffer.dtype))
    return aval


def aval_of(x: Any) -> Aval | None:
    """Shape and dtype of a Tensor/array operand; None for python scalars."""
    if isinstance(x, Tensor):
        return Aval(x.shape, x.dtype)
    shape = getattr(x, "shape", None)
    if shape is None:
        return None
    return Aval(tuple(shape), x.dtype)


_FLOATS = frozenset(np.dtype(d) for d in ("float16", "float32", "float64", jnp.bfloat16))


def require_float(op: str, x: Any, what: str = "input") -> None:
    dtype = getattr(x, "dtype", None)
    if dtype is not None and dtype not in _FLOATS and not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{op}: {what} must have a floating dtype, got {np.dtype(dtype).name}")


def is_real_scalar(value: Any) -> bool:
    """A python or numpy real number (not a bool, not an array)."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


class IntArgumentError(TypeError, ValueError):
    """A non-int where a static int is needed: the TypeError of the ops' error
    convention, and the ValueError the rf.nn layers' configuration checks raise."""


def static_int(op: str, name: str, value: Any, minimum: int = 0) -> int:
    """``value`` as an int ``>= minimum``: ``IntArgumentError`` for a non-int,
    ``ValueError`` below the minimum. The one int validator (ops and rf.nn layers)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise IntArgumentError(f"{op}: {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{op}: {name} must be >= {minimum}, got {value}")
    return int(value)


def normalize_axis(op: str, axis: int, ndim: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{op}: axis must be an int, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ShapeError(f"{op}: axis {axis} is out of range for a tensor of rank {ndim}")
    return int(axis) % ndim if ndim else 0


# ---------------------------------------------------------------------------
# recording
# ---------------------------------------------------------------------------

# Note [Eager fast path]
# ~~~~~~~~~~~~~~~~~~~~~~
# An eager op on a small tensor costs what Python does around one dispatch of
# its jitted forward (Note [Eager compilation] in rumus_fx/eager.py), so the
# per-op path does only what the semantics need, once:
#
# * the forward is one call of a jax.jit bound at the first eager call
#   (``eager_jit``): flat arguments are checked for tracers one by one, no
#   pytree flattening and no cache lookup per call, so JAX's C++ fast path
#   dispatches it;
# * ``t <op> python scalar`` (``elementwise._binary``) skips broadcasting and
#   rank alignment, which a scalar never needs, and builds the record
#   ``binary_record`` would directly (``_scalar_rhs_record``); the scalar goes
#   to the forward as a cached device array (``eager.scalar_operand``: per
#   type, value, x64 mode, default device and abstract mesh; zeros and nan are
#   never cached), which jit would otherwise transfer afresh on every call.
#   The compiled whole-tape walk gets the records' saved scalars the same way;
# * a storage costs a version cell, its trace token and a counter (no WeakSet);
#   its weak handle, which every version snapshot holds, is made once;
# * ``record()`` keeps the (id, grad id) pairs of the op's values and the
#   provenance is computed from them on first use (``record.Provenance``: only
#   ``backward(create_graph=True)`` reads it); ``f(t)`` and ``t <op> python
#   scalar`` (``t`` tracked, not explicitly sharded) take a path without the
#   general loop (``record_general``, which records the same entry: see
#   tests/test_tape.py); entries, version snapshots and the records of
#   ``t <op> python scalar`` and of the deferred ops fill their ``__dict__``
#   directly (``Tape.append`` through ``tape.new_entry``, the one way an entry
#   is made; ``VersionSnapshot.of``; ``new_record``), and a scalar operand's
#   ``BroadcastInfo`` is shared (``same_shape_info``);
# * a deferred op (Note [Deferred elementwise ops] in rumus_fx/lazy.py) is
#   recorded by ``record_deferred``, which gives the output's storage its
#   input's aval (an elementwise op keeps shape and dtype) and appends the
#   entry itself; a storage's trace token is shared by the storages made under
#   one trace (``storage._current_trace``).
#
# Backward, per record: the version checks and the whole-tape signature's
# structure key run as code emitted for the record class (Note [Per-class
# record code] in autograd/record.py), and the compiled walk takes each
# distinct saved array once (Note [Shared arguments of the compiled walk] in
# autograd/whole_tape.py).
#
# What stays per op: the grad id, the version snapshots of what the record
# reads, the avals and the explicit-sharding check of every tracked input.
# What each part costs: benchmarks/RESULTS.md, "Thresholds in the code".


_new_object = object.__new__
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}  # record class -> its dataclass fields' names, in order


def new_record(cls: type, *values: Any) -> Any:
    """``cls(*values)`` for a frozen record dataclass (every field given, in
    order; the records take no ``__post_init__``), filling its ``__dict__``
    directly rather than through one ``object.__setattr__`` per field (Note
    [Eager fast path])."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        if "__post_init__" in dir(cls):  # pragma: no cover - no record defines one
            return cls(*values)
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    if len(values) != len(names):
        raise TypeError(f"{cls.__name__} takes {len(names)} fields, got {len(values)}")
    rec = _new_object(cls)
    rec.__dict__.update(zip(names, values))
    return rec


_SAME_SHAPE_INFO: dict[tuple[Any, Any], Any] = {}  # (shape, dtype) -> BroadcastInfo(shape, dtype, ())
_SAME_SHAPE_INFO_MAX = 1024


def same_shape_info(shape: tuple[int, ...], dtype: Any) -> BroadcastInfo:
    """``BroadcastInfo(shape, dtype, ())``, what ``broadcast_info`` gives an
    operand of the output's own shape (``t * 2.0``), one per (shape, dtype):
    it is immutable metadata, so records may share it."""
    key = (shape, dtype)
    info = _SAME_SHAPE_INFO.get(key)
    if info is None:
        info = _tuple_new(BroadcastInfo, (shape, dtype, ()))
        if len(_SAME_SHAPE_INFO) < _SAME_SHAPE_INFO_MAX:
            _SAME_SHAPE_INFO[key] = info
    return info


def tape_for(*xs: Any) -> Tape | None:
    """The tape to record on: the active one, if any operand is tracked."""
    tape = current_tape()
    if tape is None:
        return None
    for x in xs:
        if isinstance(x, Tensor) and x._gid is not None:
            return tape
    return None


def is_tracked(x: Any) -> bool:
    return isinstance(x, Tensor) and x._gid is not None


def new_output(value: Array, tape: Tape | None) -> Tensor:
    """Wrap an op result; tracked (with a fresh grad id) when recording."""
    return Tensor._wrap(value, None if tape is None else next_grad_id())


def record(tape: Tape, op: Any, inputs: Sequence[Any], out: Tensor) -> Tensor:
    """Append ``op`` (the record of the op that produced ``out``) to ``tape``
    (Note [Eager fast path])."""
    buffer = out._storage._buffer
    out_gid = out._gid
    n = len(inputs)
    if 0 < n <= 2:  # the common ops: ``f(t)`` and ``t <op> python scalar``, t tracked
        x = inputs[0]
        other = inputs[1] if n == 2 else None
        if (
            isinstance(x, Tensor)
            and (n == 1 or type(other) in PY_SCALARS)
            and x._gid is not None
            and sharding_of(value := x.value) is None
        ):
            gid = x._gid
            in_aval = tensor_aval(x)
            if n == 1:
                ids, avals, pairs = (gid,), (in_aval,), (id(buffer), out_gid, id(value), gid)
            else:
                ids, avals, pairs = (gid, None), (in_aval, None), (id(buffer), out_gid, id(value), gid, id(other), None)
            out_aval = (tensor_aval(out),)
            tape.append(op, ids, (out_gid,), avals, out_aval, (), Provenance(op, pairs))
            return out
    return record_general(tape, op, inputs, out)


def deferrable(x: Any) -> Any:
    """The operand an elementwise op on ``x`` defers on (a ``lazy.Lazy`` or a
    concrete array: Note [Deferred elementwise ops] in rumus_fx/lazy.py), or
    None when the op runs now: ``x`` is not a contiguous Tensor, an
    ``rf.lift`` trace runs, or its buffer does not qualify."""
    if not isinstance(x, Tensor) or x._layout is not None or _tensor_module.CAPTURE is not None:
        return None
    return lazy.operand(x._storage)


def deferred_scalar(b: Any) -> bool:
    """Whether the python scalar ``b`` of ``t <op> b`` can wait for the flush:
    a float, or an int that converts without overflow (others raise now)."""
    return type(b) is float or -(2**31) <= b < 2**31


def record_deferred(tape: Tape, op: Any, x: Tensor, scalar: Any, out: Tensor, provenance: Any) -> Tensor:
    """``record(tape, op, (x,) or (x, scalar), out)`` for a deferred op
    (``x`` tracked, contiguous, on one device), without reading a value:
    ``provenance`` is given (a tuple, or ``Provenance`` pairs). The output
    has ``x``'s shape and dtype, so its storage is given ``x``'s aval."""
    gid = x._gid
    aval = x._storage._aval
    if aval is None:
        aval = tensor_aval(x)
    out._storage._aval = aval
    if scalar is None:
        ids, avals = (gid,), (aval,)
    else:
        ids, avals = (gid, None), (aval, None)
    tape._entries.append(new_entry(op, ids, (out._gid,), avals, (aval,), (), provenance, ()))  # ``tape.append``
    return out


def deferred_unary(x: Tensor, src: Any, kind: lazy.Kind, rec_cls: type, saves: str | None) -> Tensor:
    """``kind`` on ``x`` deferred (Note [Deferred elementwise ops] in
    rumus_fx/lazy.py; ``src = deferrable(x)``), recorded as ``rec_cls``, whose
    record saves the ``"output"``, the ``"input"`` (then its version
    snapshot) or nothing (None): the record holds the pending value until the
    flush puts the array in its place."""
    out = lazy.defer(kind, src)
    tape = current_tape() if x._gid is not None else None  # ``tape_for(x)``
    if tape is None:
        return Tensor._wrap(out)
    res = Tensor._wrap(out, next_grad_id())
    if saves == "output":
        rec = new_record(rec_cls, out, VersionSnapshot.of(res._gid, res._storage))
        lazy.saves(rec, "output", out)
        provenance: Any = (("output", None, res._gid),)
    elif saves == "input":
        rec = new_record(rec_cls, src, VersionSnapshot.of(x._gid, x._storage))
        lazy.saves(rec, "input", src)
        provenance = (("input", None, x._gid),)
    else:
        rec, provenance = new_record(rec_cls), ()
    return record_deferred(tape, rec, x, None, res, provenance)


def record_general(tape: Tape, op: Any, inputs: Sequence[Any], out: Tensor) -> Tensor:
    """``record`` for any inputs (what its fast path records, for every op)."""
    buffer = out._storage._buffer
    if type(buffer) is lazy.Lazy:  # a deferred result, computed: its record saved the array
        buffer = lazy.value(buffer)
    out_gid = out._gid
    ids = []
    avals = []
    sharded = False
    # (id(value), grad id) of the output and each input, for the provenance
    pairs = [id(buffer), out_gid]
    for x in inputs:
        if isinstance(x, Tensor):
            gid = x._gid
            value = x.value
            pairs += (id(value), gid)
            ids.append(gid)
            avals.append(tensor_aval(x))
            if gid is not None and not sharded and sharding_of(value) is not None:
                sharded = True
        else:
            if x is not None:
                pairs += (id(x), None)
            ids.append(None)
            avals.append(aval_of(x))
    shardings = ()
    if sharded:
        shardings = tuple(sharding_of(x.value) if is_tracked(x) else None for x in inputs)
    out_aval = (tensor_aval(out),)
    tape.append(op, tuple(ids), (out_gid,), tuple(avals), out_aval, shardings, Provenance(op, tuple(pairs)))
    return out


def snapshot(x: Any) -> VersionSnapshot | None:
    """Snapshot of the storage behind ``x`` (None for arrays and scalars)."""
    if isinstance(x, Tensor):
        return VersionSnapshot.of(x._gid, x._storage)
    return None


def reads(x: Any, needed: bool) -> tuple[Any, VersionSnapshot | None]:
    """(saved value, snapshot) of an operand whose data backward reads when
    ``needed``; (None, None) otherwise, so nothing unused is kept."""
    if not needed:
        return None, None
    if isinstance(x, Tensor):
        return x.value, VersionSnapshot.of(x._gid, x._storage)
    return value_of(x, "save"), None


# ---------------------------------------------------------------------------
# broadcasting
# ---------------------------------------------------------------------------


@metadata_type
class BroadcastInfo(NamedTuple):
    """How one operand was broadcast to the output: its own shape and dtype and
    the output axes its gradient is summed over."""

    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[int, ...]


def broadcast_shapes(op: str, *shapes: tuple[int, ...]) -> tuple[int, ...]:
    if len(shapes) == 2:  # the common cases first: equal shapes, or a scalar operand
        a, b = shapes
        if a == b or not b:
            return a
        if not a:
            return b
    first = shapes[0]
    if all(s == first for s in shapes):
        return first
    nd = max(len(s) for s in shapes)
    out = []
    for i in range(nd):
        size = 1
        for s in shapes:
            d = s[i - nd + len(s)] if i - nd + len(s) >= 0 else 1
            if d != 1:
                if size != 1 and size != d:
                    shown = " and ".join(str(tuple(s)) for s in shapes)
                    raise ShapeError(f"{op}: shapes {shown} cannot be broadcast together")
                size = d
        out.append(size)
    return tuple(out)


def broadcast_info(x: Any, out_shape: tuple[int, ...]) -> BroadcastInfo | None:
    shape = getattr(x, "shape", None)
    if shape is None:
        return None
    shape = tuple(shape)
    if shape == out_shape:  # not broadcast (``t * 2.0``)
        return _tuple_new(BroadcastInfo, (shape, x.dtype, ()))
    aval = aval_of(x)
    assert aval is not None
    lead = len(out_shape) - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1 and out_shape[lead + i] != 1)
    return BroadcastInfo(shape, aval.dtype, axes)


def sum_to(g: Array, info: BroadcastInfo) -> Array:
    """Reduce a gradient of the output shape to an operand's shape and dtype."""
    if info.axes:
        g = acc_sum(g, info.axes)
    if tuple(g.shape) != info.shape:
        g = g.reshape(info.shape)
    if g.dtype != info.dtype:
        g = g.astype(info.dtype)
    return g


def align_rank(x: Any, ndim: int) -> Any:
    """Add leading unit axes so ``x`` has rank ``ndim`` (explicit broadcasting:
    the library never relies on NumPy rank promotion)."""
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) >= ndim:
        return x
    return eager_reshape(x, (1,) * (ndim - len(shape)) + tuple(shape))


def cast(g: Array, dtype: Any) -> Array:
    return g if g.dtype == dtype else g.astype(dtype)


def acc_sum(x: Array, axis: Any = None, keepdims: bool = False) -> Array:
    """Sum that accumulates bfloat16/float16 in float32."""
    if is_low_precision(x.dtype):
        return jnp.sum(x, axis=axis, keepdims=keepdims, dtype=jnp.float32).astype(x.dtype)
    return jnp.sum(x, axis=axis, keepdims=keepdims)


def array_of(x: Any, op: str, what: str = "input") -> Any:
    """Like ``value_of`` but python scalars become (weakly typed) arrays."""
    v = value_of(x, op, what)
    if not hasattr(v, "shape"):
        v = jnp.asarray(v)
    return v


def check_index_range(
    op: str, indices: Any, size: int, what: str = "index", ignore: int | None = None, axis: int | None = None
) -> None:
    """IndexError for concrete out-of-range indices (traced ones cannot be
    checked). Without ``axis``: ``0 <= i < size`` (lookups such as embedding
    rows and class targets; ``ignore`` is exempt); with ``axis``: numpy's
    indexing bounds ``-size <= i < size`` for that axis of the input."""
    if isinstance(indices, jax.core.Tracer):
        return
    arr = np.asarray(indices)
    if arr.size == 0:
        return
    bad = (arr < (0 if axis is None else -size)) | (arr >= size)
    if ignore is not None:
        bad &= arr != ignore
    if bad.any():
        first = int(arr[bad].reshape(-1)[0])
        where = f"size {size} (valid: 0..{size - 1})" if axis is None else f"axis {axis} of size {size}"
        raise IndexError(f"{op}: {what} {first} is out of range for {where}")
