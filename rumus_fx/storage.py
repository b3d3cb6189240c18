"""Copy-on-write storages with version counters, and strided layouts.

Note [Version counters]
~~~~~~~~~~~~~~~~~~~~~~~
A ``StorageHandle`` owns one immutable JAX array (its *buffer*) and a tiny
``_VersionCell``. Every tensor that views the storage (the base and all its
transposes, reshapes and detaches) reads the buffer through its own ``Layout``.
An in-place write never mutates a buffer: it builds a new one and swaps it in
(copy-on-write), then adds one to the version. Records therefore keep exactly the
immutable buffers they read, privately, and never the handle.

A ``VersionSnapshot`` (see ``autograd/record.py``) holds a weak reference to the
handle *and a strong one to its version cell*: the cell is a few bytes, so a
storage that is written and then dropped before backward is still caught, while
the storage (and its buffer) is free to die as soon as no tensor uses it.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from . import eager, lazy
from .errors import AutogradError
from .sharding import reshape as sharded_reshape
from .sharding import sharding_of

try:  # the trace a storage was created in; used to refuse tracer leaks
    from jax.extend.core import get_opaque_trace_state as _get_opaque_trace_state

    # the token's class, to make one for a tracer's own trace (public API only)
    _OpaqueTraceState = type(_get_opaque_trace_state(convention="rumus_fx"))
except ImportError:  # pragma: no cover - older/newer jax without the helper
    _get_opaque_trace_state = None
    _OpaqueTraceState = None

_Tracer = jax.core.Tracer

# storages alive right now: one more in StorageHandle.__init__, one less in
# __del__ (cheaper per op than a WeakSet, whose callbacks run in Python)
_ALIVE = [0]
_families = itertools.count(1)  # detach() families of views (0: the original one)


def live_storage_count() -> int:
    """Number of storages alive right now."""
    return _ALIVE[0]


def current_trace_state() -> Any:
    """An opaque token of the current jax trace (comparable with a storage's)."""
    return _current_trace()


def _current_trace() -> Any:
    if _get_opaque_trace_state is None:  # pragma: no cover
        return None
    return _get_opaque_trace_state(convention="rumus_fx")


def _trace_of(value: Any) -> Any:
    """The trace a tracer belongs to, comparable with ``_current_trace()``."""
    trace = getattr(value, "_trace", None)
    ref = getattr(trace, "_weakref", None)
    if ref is None or _OpaqueTraceState is None:  # pragma: no cover
        return _current_trace()
    return _OpaqueTraceState(ref)


TRACER_LEAK_MESSAGE = (
    "in-place write of a traced value into a storage created outside the current "
    "jax transformation (jax.jit / jax.vmap / jax.grad ...): the storage would keep "
    "a tracer alive after the trace ends. Create the tensor inside the transformed "
    "function, or pass its value in as an argument and return the updated value."
)


class _VersionCell:
    """The version counter of one storage; outlives it inside snapshots."""

    __slots__ = ("__weakref__", "value")

    def __init__(self) -> None:
        self.value = 0


class WeakStorageHandle:
    """A weak reference to a ``StorageHandle`` (``upgrade()`` -> handle or None)."""

    __slots__ = ("_cell", "_ref")

    def __init__(self, handle: StorageHandle):
        self._ref = weakref.ref(handle)
        self._cell = handle._cell

    def upgrade(self) -> StorageHandle | None:
        """The handle while the storage is alive, else ``None``."""
        return self._ref()

    @property
    def version(self) -> int:
        """The storage's version (also after the storage died: its last one)."""
        return self._cell.value

    def __repr__(self) -> str:
        state = "alive" if self._ref() is not None else "dead"
        return f"WeakStorageHandle({state}, version={self._cell.value})"


class StorageHandle:
    """One storage: an immutable JAX buffer, a version counter, its views.

    Tensors share a handle when they are views of each other. ``version`` starts
    at 0 and grows by one per in-place write.
    """

    __slots__ = ("__weakref__", "_aval", "_buffer", "_cell", "_trace", "_views", "_weak")

    def __init__(self, buffer: jax.Array):
        _ALIVE[0] += 1
        self._weak: WeakStorageHandle | None = None  # made by the first downgrade()
        self._buffer = buffer
        # (shape, dtype) of the buffer, kept by the recorder that reads it first
        # (``ops._core.tensor_aval``); a write resets it
        self._aval: Any = None
        self._cell = _VersionCell()
        self._trace = _current_trace()
        # (weak reference, family) of the tensors viewing this storage; only
        # filled once a second tensor (a view) appears, so plain tensors pay
        # nothing. See Note [Aliases and in-place writes].
        self._views: list[tuple[weakref.ref, int]] | None = None

    def __del__(self) -> None:
        _ALIVE[0] -= 1

    @property
    def version(self) -> int:
        return self._cell.value

    @property
    def buffer(self) -> jax.Array:
        """The current (immutable) buffer, in the base tensor's shape."""
        b = self._buffer
        if type(b) is lazy.Lazy:  # a deferred result (Note [Deferred elementwise ops])
            b = self._buffer = lazy.value(b)
        return b

    @property
    def nbytes(self) -> int:
        return nbytes_of(self._buffer)

    def downgrade(self) -> WeakStorageHandle:
        """A weak handle (one per storage, made once: it only reads the
        storage's fixed version cell and a weak reference)."""
        weak = self._weak
        if weak is None:
            weak = self._weak = WeakStorageHandle(self)
        return weak

    def read(self, layout: Layout) -> jax.Array:
        """Materialise the view ``layout`` of this storage."""
        return read_layout(self.buffer, layout)

    def write(self, layout: Layout, value: jax.Array) -> None:
        """Copy-on-write ``value`` into the view ``layout``; bumps the version."""
        if isinstance(value, _Tracer) and _trace_of(value) != self._trace:
            raise AutogradError(TRACER_LEAK_MESSAGE)
        self._buffer = write_layout(self.buffer, layout, value)
        self._aval = None
        self._cell.value += 1

    def _family(self, tensor: Any) -> int:
        if self._views is not None:
            for r, family in self._views:
                if r() is tensor:
                    return family
        return 0

    def _register_view(self, base: Any, view: Any, detached: bool = False) -> None:
        if self._views is None:
            self._views = [(weakref.ref(base), 0)]
            family = 0
        else:  # drop dead entries so the list stays small
            family = self._family(base)
            self._views = [e for e in self._views if e[0]() is not None]
        self._views.append((weakref.ref(view), next(_families) if detached else family))

    def stale_aliases(self, tensor: Any) -> list:
        """The other live tensors viewing this storage that a write through
        ``tensor`` while recording would leave with a stale history.

        Note [Aliases and in-place writes]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        Every tensor viewing a storage belongs to a *family*: the storage's
        first tensor and every transpose/reshape view of a family member are in
        family 0; ``detach()`` starts a new family (and views of a detached
        tensor join it). A write through ``tensor`` changes the value every
        alias shows. rumus_fx does not rebase aliases onto the write's history
        as PyTorch does; while a tape records, the write raises instead when an
        alias would be left stale: any tracked alias, and (for a write whose
        value depends on a tracked tensor) any alias in ``tensor``'s own family
        or in family 0. The untracked members of another ``detach()`` family
        were cut from history on purpose: they show the new value as a
        constant, as a ``detach()`` does in PyTorch. Under ``no_grad()`` every
        write just mutates.
        """
        if self._views is None:
            return []
        own = self._family(tensor)
        out = []
        for r, family in self._views:
            t = r()
            if t is None or t is tensor:
                continue
            if family == own or family == 0 or t.grad_id is not None:
                out.append(t)
        return out

    def __repr__(self) -> str:
        shape = tuple(self._buffer.shape)
        return f"StorageHandle(shape={shape}, dtype={self._buffer.dtype}, version={self.version})"


def nbytes_of(x: Any) -> int:
    """Bytes of an array or tracer (from its abstract value: no device sync)."""
    shape = getattr(x, "shape", None)
    if shape is None:
        return 0
    return math.prod(shape) * np.dtype(x.dtype).itemsize


# ---------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


class Layout(NamedTuple):
    """How a tensor sees its storage: shape, element strides, element offset."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0

    @classmethod
    def contiguous(cls, shape: Sequence[int]) -> Layout:
        shape = tuple(int(s) for s in shape)
        return cls(shape, contiguous_strides(shape), 0)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def transpose(self, dim0: int, dim1: int) -> Layout:
        shape = list(self.shape)
        strides = list(self.strides)
        shape[dim0], shape[dim1] = shape[dim1], shape[dim0]
        strides[dim0], strides[dim1] = strides[dim1], strides[dim0]
        return Layout(tuple(shape), tuple(strides), self.offset)

    def view(self, shape: Sequence[int]) -> Layout | None:
        """The layout of ``reshape(shape)`` as a view, or None if a copy is needed.

        Same rule as ``torch.Tensor.view``: every group of old dimensions that
        merges or splits into new ones must be contiguous within itself.
        """
        shape = tuple(shape)
        old_shape, old_strides = self.shape, self.strides
        if math.prod(shape) == 0 or not old_shape:
            return Layout(shape, contiguous_strides(shape), self.offset)
        new_strides = [0] * len(shape)
        view_d = len(shape) - 1
        chunk_base_stride = old_strides[-1]
        tensor_numel = 1
        view_numel = 1
        for tensor_d in range(len(old_shape) - 1, -1, -1):
            tensor_numel *= old_shape[tensor_d]
            if tensor_d == 0 or (
                old_shape[tensor_d - 1] != 1 and old_strides[tensor_d - 1] != tensor_numel * chunk_base_stride
            ):
                while view_d >= 0 and (view_numel < tensor_numel or shape[view_d] == 1):
                    new_strides[view_d] = view_numel * chunk_base_stride
                    view_numel *= shape[view_d]
                    view_d -= 1
                if view_numel != tensor_numel:
                    return None
                if tensor_d > 0:
                    chunk_base_stride = old_strides[tensor_d - 1]
                    tensor_numel = 1
                    view_numel = 1
        if view_d != -1:
            return None
        return Layout(shape, tuple(new_strides), self.offset)


def _permutation(layout: Layout, size: int) -> tuple[list[int], list[int]] | None:
    """For a layout that covers a whole buffer of ``size`` elements in some axis
    order, return (non-unit dims, those dims sorted from outermost to innermost);
    None when the layout is not such a permutation."""
    if layout.offset != 0 or layout.size != size:
        return None
    dims = [d for d in range(layout.ndim) if layout.shape[d] != 1]
    order = sorted(dims, key=lambda d: -layout.strides[d])
    expected = 1
    for d in reversed(order):
        if layout.strides[d] != expected:
            return None
        expected *= layout.shape[d]
    return dims, order


def _gather_index(layout: Layout) -> np.ndarray:
    index = np.full(layout.shape, layout.offset, dtype=np.int64)
    for d, (size, stride) in enumerate(zip(layout.shape, layout.strides)):
        shape = [1] * layout.ndim
        shape[d] = size
        index = index + (np.arange(size) * stride).reshape(shape)
    return index


def _permute(x: jax.Array, before: tuple[int, ...], axes: tuple[int, ...], after: tuple[int, ...]) -> jax.Array:
    """``x`` reshaped to ``before``, its axes permuted by ``axes``, reshaped to
    ``after``: eagerly one compiled call (``eager.relayout``; as separate calls
    each reshape was a copy of its own); a sharded ``x`` step by step, each
    reshape keeping the sharded axes sharded."""
    moved = axes != tuple(sorted(axes))
    if moved and sharding_of(x) is None:
        return eager.relayout(x, before, axes, tuple(after))
    x = sharded_reshape(x, before)
    if moved:
        x = eager.transpose(x, axes)
    return sharded_reshape(x, after)


def read_layout(buffer: jax.Array, layout: Layout) -> jax.Array:
    """Materialise a strided view of ``buffer`` (read as flat, row-major)."""
    shape = layout.shape
    if tuple(buffer.shape) == shape and layout.offset == 0 and layout.is_contiguous:
        return buffer
    size = math.prod(buffer.shape)
    if layout.is_contiguous and layout.offset == 0 and layout.size == size:
        return sharded_reshape(buffer, shape)
    perm = _permutation(layout, size)
    if perm is not None:
        dims, order = perm
        return _permute(buffer, tuple(shape[d] for d in order), tuple(order.index(d) for d in dims), shape)
    # a general strided window (never produced by rumus_fx's own views)
    return buffer.reshape(-1)[_gather_index(layout)]


def write_layout(buffer: jax.Array, layout: Layout, value: jax.Array) -> jax.Array:
    """The buffer after writing ``value`` (of ``layout.shape``) through ``layout``."""
    base_shape = tuple(buffer.shape)
    value = value.astype(buffer.dtype)
    size = math.prod(base_shape)
    if layout.is_contiguous and layout.offset == 0 and layout.size == size:
        return sharded_reshape(value, base_shape)
    perm = _permutation(layout, size)
    if perm is not None:
        dims, order = perm
        before = tuple(layout.shape[d] for d in dims)
        return _permute(value, before, tuple(dims.index(d) for d in order), base_shape)
    flat = buffer.reshape(-1).at[_gather_index(layout).reshape(-1)].set(value.reshape(-1))
    return flat.reshape(base_shape)
