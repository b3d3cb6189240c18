"""Shape ops: reshape, flatten, transpose (views when the layout allows), stack,
slice_batch, index, reshard."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import sharding as shd
from ..autograd.record import Record
from ..errors import ShapeError
from ..tensor import Tensor, next_grad_id
from ._core import (
    array_of,
    check_index_range,
    eager_jit,
    eager_reshape,
    new_output,
    normalize_axis,
    record,
    shape_of,
    tape_for,
    value_of,
)
from ._declare import BadInput, Sample, array, normal, op, tracked, unary_samples

Array = jax.Array
frozen = dataclasses.dataclass(frozen=True, eq=False)


@frozen
class _ReshapeRecord(Record):
    """``dx = reshape(dy, original_shape)``. Reads no data. (The body of
    ReshapeBackward and FlattenBackward.)"""

    original_shape: tuple[int, ...]
    sharding: Any = None  # the input's explicit sharding (rumus_fx/sharding.py)

    def backward(self, g, needs):
        return (shd.reshape(g, self.original_shape, self.sharding),)


@frozen
class ReshapeBackward(_ReshapeRecord):
    """``y = reshape(x)``: ``dx = reshape(dy, original_shape)``. Reads no data."""


@frozen
class FlattenBackward(_ReshapeRecord):
    """``y = flatten(x)`` (``[B, ...] -> [B, rest]``): ``dx = reshape(dy)``."""


@frozen
class TransposeBackward(Record):
    """``y = transpose(x, dim0, dim1)``: ``dx = transpose(dy, dim0, dim1)``."""

    dim0: int
    dim1: int

    def backward(self, g, needs):
        return (jnp.swapaxes(g, self.dim0, self.dim1),)


def resolve_shape(op: str, old: tuple[int, ...], shape: Any) -> tuple[int, ...]:
    """``shape`` with a -1 filled in; ShapeError if the sizes do not match."""
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        dims = None if isinstance(shape, (str, bytes)) else tuple(shape)
    except TypeError:
        dims = None
    # no int(s): it would truncate 2.5 and accept "3"
    if dims is None or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in dims):
        raise TypeError(f"{op}: shape must be a sequence of ints, got {shape!r}")
    shape = tuple(int(s) for s in dims)
    size = math.prod(old)
    unknown = [i for i, s in enumerate(shape) if s == -1]
    if len(unknown) > 1 or any(s < -1 for s in shape):
        raise ShapeError(f"{op}: invalid target shape {shape} for input of shape {old}")
    if unknown:
        known = math.prod(s for s in shape if s != -1)
        if known == 0 or size % known:
            raise ShapeError(f"{op}: cannot reshape input of shape {old} into {shape}")
        shape = tuple(size // known if s == -1 else s for s in shape)
    if math.prod(shape) != size:
        raise ShapeError(f"{op}: cannot reshape input of shape {old} ({size} elements) into {shape}")
    return shape


def _sharding_if_tracked(x: Any) -> Any:
    return shd.sharding_of(x) if isinstance(x, Tensor) and x.grad_id is not None else None


def _reshape_to(x: Any, shape: tuple[int, ...], rec: Record) -> Tensor:
    tape = tape_for(x)
    gid = None if tape is None else next_grad_id()
    if isinstance(x, Tensor):
        layout = x.layout.view(shape)
        if layout is not None:
            out = x._view(layout, gid)
        else:  # not expressible as a view: a contiguous copy, as torch.reshape
            out = Tensor._wrap(eager_reshape(x.value, tuple(shape)), gid)
    else:
        out = Tensor._wrap(shd.reshape(value_of(x, "reshape"), shape), gid)
    if tape is None:
        return out
    return record(tape, rec, (x,), out)


@op(
    records=(ReshapeBackward,),
    call=lambda x, shape: reshape(x, shape),
    ref=lambda x, shape: jnp.reshape(x, shape),
    samples=lambda r: [
        Sample((normal(r, 3, 5), (5, 3))),
        Sample((normal(r, 2, 3, 7), (6, -1))),
        Sample((normal(r, 6, 5), (2, 3, 5))),
    ],
    errors=lambda: [
        BadInput("wrong size", (tracked(3, 5), (4, 4)), ShapeError, ("(3, 5)", "(4, 4)")),
        BadInput("two -1", (tracked(3, 4), (2, -1, -1)), ShapeError),
        BadInput("negative size", (tracked(3, 4), (-2, -6)), ShapeError),
        BadInput("float sizes", (tracked(3, 4), (3.0, 4)), TypeError, ("3.0",)),
        BadInput("a string shape", (tracked(3, 4), "12"), TypeError),
        BadInput("a shape of strings", (tracked(3, 4), ("a", "b")), TypeError),
    ],
)
def reshape(x: Any, shape: Any) -> Tensor:
    """``x`` with a new shape (one -1 allowed): a view of the same storage when
    the layout allows, a contiguous copy otherwise (records ReshapeBackward)."""
    old = shape_of(x) if isinstance(x, Tensor) else shape_of(value_of(x, "reshape"))
    new = resolve_shape("reshape", old, shape)
    return _reshape_to(x, new, ReshapeBackward(old, _sharding_if_tracked(x)))


@op(
    records=(FlattenBackward,),
    ref=lambda x: jnp.reshape(x, (x.shape[0], -1)),
    samples=unary_samples([(3, 5), (2, 3, 7), (2, 3, 2, 5)]),
    errors=lambda: [BadInput("scalar", (tracked(),), ShapeError)],
)
def flatten(x: Any) -> Tensor:
    """``[B, d1, d2, ...] -> [B, d1*d2*...]`` keeping axis 0 (records FlattenBackward)."""
    old = shape_of(x) if isinstance(x, Tensor) else shape_of(value_of(x, "flatten"))
    if len(old) < 1:
        raise ShapeError(f"flatten: expects a tensor of rank >= 1 (axis 0 is kept), got shape {old}")
    new = (old[0], math.prod(old[1:]))
    return _reshape_to(x, new, FlattenBackward(old, _sharding_if_tracked(x)))


@op(
    records=(TransposeBackward,),
    ref=jnp.swapaxes,
    samples=lambda r: [
        Sample((normal(r, 3, 5), 0, 1)),
        Sample((normal(r, 2, 3, 7), 0, 2)),
        Sample((normal(r, 2, 3, 7), -1, 1)),
    ],
    errors=lambda: [
        BadInput("dim out of range", (tracked(3, 4), 0, 2), ShapeError, ("axis 2",)),
        BadInput("float dim", (tracked(3, 4), 0.0, 1), TypeError),
    ],
)
def transpose(x: Any, dim0: int, dim1: int) -> Tensor:
    """Swap two axes; a view of the same storage (records TransposeBackward)."""
    nd = len(shape_of(x)) if isinstance(x, Tensor) else len(shape_of(value_of(x, "transpose")))
    d0 = normalize_axis("transpose", dim0, nd)
    d1 = normalize_axis("transpose", dim1, nd)
    tape = tape_for(x)
    gid = None if tape is None else next_grad_id()
    if isinstance(x, Tensor):
        out = x._view(x.layout.transpose(d0, d1), gid)
    else:
        out = Tensor._wrap(jnp.swapaxes(value_of(x, "transpose"), d0, d1), gid)
    if tape is None:
        return out
    return record(tape, TransposeBackward(d0, d1), (x,), out)


@frozen
class StackBackward(Record):
    """``y = stack([t0, t1, ...], axis)``: ``dt_i = dy`` indexed at ``i`` along
    ``axis``. Reads no data."""

    count: int
    axis: int
    dtypes: tuple[Any, ...]

    def backward(self, g, needs):
        out = []
        for i in range(self.count):
            if not needs[i]:
                out.append(None)
                continue
            gi = lax.index_in_dim(g, i, axis=self.axis, keepdims=False)
            out.append(gi if gi.dtype == self.dtypes[i] else gi.astype(self.dtypes[i]))
        return tuple(out)


_stack = eager_jit(jnp.stack, static_argnums=(1,))  # (arrays, axis)


@eager_jit
def _row(xv: Array, index: Any) -> Array:
    """``xv[index]`` along axis 0 (``0 <= index < n``): one program for every row."""
    return lax.dynamic_index_in_dim(xv, index, axis=0, keepdims=False)


@op(
    records=(StackBackward,),
    call=lambda a, b, c, axis=0: stack([a, b, c], axis=axis),
    ref=lambda a, b, c, axis=0: jnp.stack([a, b, c], axis=axis),
    samples=lambda r: [
        Sample((normal(r, 3, 5), normal(r, 3, 5), normal(r, 3, 5)), diff=(0, 1, 2)),
        Sample((normal(r, 2, 3), normal(r, 2, 3), normal(r, 2, 3)), {"axis": -1}, diff=(0, 2)),
    ],
    errors=lambda: [
        BadInput("shapes differ", ([tracked(3, 4), tracked(3, 5)],), ShapeError, ("(3, 4)", "(3, 5)")),
        BadInput("empty list", ([],), ValueError),
        BadInput("a tensor, not a list", (tracked(3, 4),), TypeError),
        BadInput("axis out of range", ([tracked(3), tracked(3)],), ShapeError, kwargs={"axis": 3}),
    ],
)
def stack(tensors: Sequence[Any], axis: int = 0) -> Tensor:
    """Stack equally shaped tensors along a new ``axis`` (records StackBackward)."""
    op = "stack"
    if isinstance(tensors, (Tensor, jax.Array)) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{op}: expects a list or tuple of tensors, got {type(tensors).__name__}")
    if not tensors:
        raise ValueError(f"{op}: needs at least one tensor")
    values = [array_of(t, op, f"tensors[{i}]") for i, t in enumerate(tensors)]
    shape = shape_of(values[0])
    for i, v in enumerate(values):
        if shape_of(v) != shape:
            raise ShapeError(
                f"{op}: all tensors must have the same shape, got {shape} and {shape_of(v)} (tensors[{i}])"
            )
    ax = normalize_axis(op, axis, len(shape) + 1)
    out = _stack(values, ax)
    tape = tape_for(*tensors)
    if tape is None:
        return Tensor._wrap(out)
    rec = StackBackward(len(values), ax, tuple(v.dtype for v in values))
    return record(tape, rec, tuple(tensors), new_output(out, tape))


@frozen
class SliceBatchBackward(Record):
    """``y = x[index]`` along axis 0: ``dx`` is zero except ``dy`` at ``index``."""

    original_shape: tuple[int, ...]
    index: int
    sharding: Any = None  # the input's explicit sharding (rumus_fx/sharding.py)

    def backward(self, g, needs):
        return (index_grad(g, self.original_shape, g.dtype, (("int", self.index),), (), self.sharding),)


@op(
    records=(SliceBatchBackward,),
    ref=lambda x, i: x[i],
    samples=lambda r: [Sample((normal(r, 4, 3, 5), 2)), Sample((normal(r, 3, 5), -1)), Sample((normal(r, 5, 2), 0))],
    errors=lambda: [
        BadInput("index == size", (tracked(4, 3), 4), IndexError, ("4",)),
        BadInput("index below -size", (tracked(4, 3), -5), IndexError, ("-5",)),
        BadInput("float index", (tracked(4, 3), 1.0), TypeError),
        BadInput("array index", (tracked(4, 3), array(1)), TypeError),
        BadInput("scalar input", (tracked(), 0), ShapeError),
    ],
)
def slice_batch(x: Any, index: int) -> Tensor:
    """``x[index]`` along axis 0 (a static int; negative counts from the end); a
    new tensor, not a view (records SliceBatchBackward)."""
    op = "slice_batch"
    xv = array_of(x, op)
    if xv.ndim < 1:
        raise ShapeError(f"{op}: expects a tensor of rank >= 1, got a scalar")
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
        raise TypeError(f"{op}: index must be a python int, got {index!r}")
    n = xv.shape[0]
    check_index_range(op, index, n, axis=0)
    index = int(index) % n
    spec = shd.spec_of(xv)
    if spec is not None and spec[0] is not None:
        # one row of an explicitly sharded axis: its shard selects it, the others add zeros
        # (JAX slices a sharded axis only into whole shards)
        rows = lax.broadcasted_iota(jnp.int32, xv.shape, 0, out_sharding=shd.sharding_of(xv))
        out = jnp.sum(jnp.where(rows == index, xv, jnp.zeros((), xv.dtype)), axis=0)
    else:
        out = _row(xv, index)
    tape = tape_for(x)
    if tape is None:
        return Tensor._wrap(out)
    rec = SliceBatchBackward(tuple(xv.shape), index, shd.sharding_of(xv))
    return record(tape, rec, (x,), new_output(out, tape))


def _index_template(op: str, key: Any) -> tuple[tuple, tuple]:
    """Split an index into a hashable static template and its index arrays."""
    if not isinstance(key, tuple):
        key = (key,)
    template: list[tuple] = []
    arrays: list[Any] = []
    for k in key:
        if k is None:
            template.append(("none",))
        elif k is Ellipsis:
            template.append(("ellipsis",))
        elif isinstance(k, slice):
            template.append(("slice", k.start, k.stop, k.step))
        elif isinstance(k, (int, np.integer)) and not isinstance(k, bool):
            template.append(("int", int(k)))
        else:
            arr = k.value if isinstance(k, Tensor) else k
            if not hasattr(arr, "dtype"):
                arr = np.asarray(arr)
            if not jnp.issubdtype(arr.dtype, jnp.integer):
                raise TypeError(
                    f"{op}: index arrays must be integer (boolean masks have a data-dependent shape; "
                    f"multiply by the mask instead), got dtype {arr.dtype}"
                )
            template.append(("array", len(arrays)))
            arrays.append(jnp.asarray(arr))
    return tuple(template), tuple(arrays)


def _index_key(template: tuple, arrays: tuple) -> tuple:
    key = []
    for t in template:
        kind = t[0]
        if kind == "none":
            key.append(None)
        elif kind == "ellipsis":
            key.append(Ellipsis)
        elif kind == "slice":
            key.append(slice(*t[1:]))
        elif kind == "int":
            key.append(t[1])
        else:
            key.append(arrays[t[1]])
    return tuple(key)


@frozen
class IndexBackward(Record):
    """``y = x[key]``: ``dx = zeros_like(x).at[key].add(dy)`` (repeated indices
    accumulate). Saves only the integer index arrays of the key."""

    input_shape: tuple[int, ...]
    dtype: Any
    template: tuple
    arrays: tuple[Array, ...]
    sharding: Any = None  # the input's explicit sharding (rumus_fx/sharding.py)

    def backward(self, g, needs):
        return (index_grad(g, self.input_shape, self.dtype, self.template, self.arrays, self.sharding),)


def index_grad(g: Array, shape: tuple[int, ...], dtype: Any, template: tuple, arrays: tuple, sharding: Any) -> Array:
    """The gradient of ``x[key]`` (x of ``shape``/``dtype``): zeros with ``g``
    added at ``key`` (repeated indices accumulate). One body for IndexBackward
    and SliceBatchBackward. A single integer on an explicitly sharded axis 0 is
    a select per shard (JAX slices a sharded axis only into whole shards)."""
    g = g.astype(dtype)
    if sharding is not None and len(template) == 1 and template[0][0] == "int":
        spread = shd.broadcast_to(g[None], shape, sharding)
        rows = lax.broadcasted_iota(jnp.int32, shape, 0, out_sharding=sharding)
        return jnp.where(rows == template[0][1] % shape[0], spread, jnp.zeros((), dtype))
    key = _index_key(template, arrays)
    zeros = shd.zeros(shape, dtype, sharding)
    if sharding is None:
        return zeros.at[key].add(g)
    return zeros.at[key].add(g, out_sharding=sharding)


@op(
    records=(IndexBackward,),
    ref=lambda x, key: x[key],
    samples=lambda r: [
        Sample((normal(r, 4, 5), (slice(1, None), 2))),
        Sample((normal(r, 3, 4, 5), (Ellipsis, np.array([0, 2, 2, 4])))),  # repeats accumulate
        Sample((normal(r, 6, 3), (np.array([[5, 0], [0, 1]]), None, slice(None, None, 2)))),
        Sample((normal(r, 3, 5), -1)),
    ],
    errors=lambda: [
        BadInput("int out of range", (tracked(4, 3), 4), IndexError, ("4",)),
        BadInput("array index out of range", (tracked(4, 3), np.array([0, 7])), IndexError, ("7",)),
        BadInput("negative array index below -size", (tracked(4, 3), (np.array([-5]),)), IndexError),
        BadInput("array index after an ellipsis", (tracked(4, 3), (Ellipsis, np.array([3]))), IndexError),
        BadInput("too many indices", (tracked(4, 3), (0, 0, 0)), IndexError, ("(4, 3)",)),
        BadInput("float index array", (tracked(4, 3), np.array([0.5])), TypeError, ("float",)),
        BadInput("boolean mask", (tracked(4, 3), np.array([True, False, True, True])), TypeError, ("bool",)),
    ],
)
def index(x: Any, key: Any) -> Tensor:
    """``x[key]`` with NumPy basic and integer-array indexing (``t[key]`` calls
    it). The result is a new tensor, not a view: unlike PyTorch, writing into it
    does not change ``x``. Out-of-range concrete integers raise IndexError
    (records IndexBackward)."""
    op = "index"
    xv = array_of(x, op)
    template, arrays = _index_template(op, key)
    for t in template:
        if t[0] == "int":
            axis = _int_axis(template, t)
            if axis is not None and axis < xv.ndim:
                check_index_range(op, t[1], xv.shape[axis], axis=axis)
    for t in template:  # concrete index arrays: numpy's bounds, not jnp's silent clamping
        if t[0] == "array":
            axis = _array_axis(template, t, xv.ndim)
            if axis is not None:
                check_index_range(op, arrays[t[1]], xv.shape[axis], axis=axis)
    try:
        out = xv[_index_key(template, arrays)]
    except IndexError as e:
        raise IndexError(f"{op}: {e} (input shape {xv.shape})") from None
    tape = tape_for(x)
    if tape is None:
        return Tensor._wrap(out)
    rec = IndexBackward(tuple(xv.shape), xv.dtype, template, arrays, shd.sharding_of(xv))
    return record(tape, rec, (x,), new_output(out, tape))


def _array_axis(template: tuple, item: tuple, ndim: int) -> int | None:
    """The input axis an index array applies to (counted from the end after an
    ellipsis); None when the key does not fit the input (jnp reports that)."""
    axis = _int_axis(template, item)
    if axis is None:  # after an ellipsis: count the axes the rest of the key uses
        after = template[template.index(item) :]
        axis = ndim - sum(1 for t in after if t[0] != "none")
    return axis if 0 <= axis < ndim else None


def _int_axis(template: tuple, item: tuple) -> int | None:
    """The input axis an integer index applies to (None after an ellipsis)."""
    axis = 0
    for t in template:
        if t is item:
            return axis
        if t[0] == "ellipsis":
            return None
        if t[0] != "none":
            axis += 1
    return None


@frozen
class ReshardBackward(Record):
    """``y = reshard(x, sharding)``: ``dx = reshard(dy, x's sharding)`` (on
    Explicit mesh axes; with Auto axes XLA places ``dx``). Reads no data."""

    sharding: Any  # the input's explicit sharding, or None

    def backward(self, g, needs):
        return (shd.conform(g, self.sharding),)


@op(records=(ReshardBackward,))  # sharding: tested in tests/test_sharding.py
def reshard(x: Any, sharding: Any) -> Tensor:
    """``x`` with another sharding (a ``NamedSharding``, or a ``PartitionSpec`` on
    ``x``'s mesh): ``jax.sharding.reshard`` for arrays sharded over Explicit mesh
    axes, ``jax.lax.with_sharding_constraint`` otherwise. Its gradient goes back
    to ``x``'s sharding, so ``rf.reshard(w, P())`` gathers an FSDP-sharded
    weight for one layer and its gradient is reduce-scattered back. Without
    any mesh (one device) a ``PartitionSpec`` leaves ``x`` as it is (records
    ReshardBackward)."""
    op = "reshard"
    xv = array_of(x, op)
    have = shd.sharding_of(xv)
    if isinstance(sharding, jax.sharding.PartitionSpec) and have is not None:
        sharding = shd.with_spec(have, tuple(sharding))
    if have is not None:
        out = shd.conform(xv, sharding)
    elif isinstance(sharding, jax.sharding.PartitionSpec) and jax.sharding.get_abstract_mesh().empty:
        out = xv  # no mesh anywhere (one device): nothing to reshard
    else:
        out = jax.lax.with_sharding_constraint(xv, sharding)
    tape = tape_for(x)
    if tape is None:
        return Tensor._wrap(out)
    return record(tape, ReshardBackward(have), (x,), new_output(out, tape))
