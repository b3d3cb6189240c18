"""``rf.Tensor``: a strided view of a copy-on-write storage, plus autograd identity.

This module sits below the autograd package and the ops: the methods that run
an op (``t.sum()``, ``t + u``, ``t.add_(u)``, ``t.T``, ...) are attached to
``Tensor`` from above, by ``rumus_fx/tensor_methods.py`` when the package is
imported (as jax attaches its own array methods)."""

from __future__ import annotations

import itertools
import math
import os
import sys
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# the one private JAX module rumus_fx reads: JAX asks pytype_aval_mappings what a value is,
# and no public hook lets a class refuse with its own message (jax.core's alias is gone,
# __jax_array__ is refused during abstractification); tests/test_imports.py allows this line only
from jax._src import core as _jax_core

from .errors import AutogradError
from .lazy import _LOCAL as _LAZY_LOCAL
from .lazy import Lazy
from .lazy import flush as lazy_flush
from .lazy import value as lazy_value
from .recording import current_tape
from .storage import Layout, StorageHandle

_grad_ids = itertools.count(1)

# set by rf.lift while it traces a function: finds and substitutes tracked
# Tensors the function reads without receiving them (see rumus_fx/lift)
CAPTURE: Any = None


def lifting() -> bool:
    """Whether an ``rf.lift`` trace is running (its program will be
    differentiated with the primitive rules, so an op must emit primitives
    that have one)."""
    return CAPTURE is not None


def next_grad_id() -> int:
    """A fresh, process-unique grad id for a recorded result (even).

    Leaves get odd ids (``next_leaf_id``), so the engine can tell from an id
    alone whether a gradient that reached it must have come from a record of
    the tape being walked (see ``engine.check_history``)."""
    return 2 * next(_grad_ids)


def next_leaf_id() -> int:
    """A fresh, process-unique grad id for a leaf that requires grad (odd)."""
    return 2 * next(_grad_ids) + 1


def is_leaf_id(grad_id: int) -> bool:
    """Whether ``grad_id`` was given to a leaf (``next_leaf_id``)."""
    return grad_id % 2 == 1


_NEW_LEAF_MESSAGE = (
    "rf.tensor(t, requires_grad=True) of a tracked Tensor (grad_id={gid}) while a tape is "
    "recording: the new leaf would silently cut t's history. Use rf.tensor(t) or "
    "rf.tensor(t, dtype=...) for a recorded copy/cast, or rf.tensor(t.detach(), "
    "requires_grad=True) for a new leaf on purpose."
)

_DETACH_MESSAGE = (
    "a tracked Tensor (grad_id={gid}) cannot be converted to an array while a tape is "
    "recording: the array would be cut out of the gradient. Use rumus_fx ops (jax "
    "operators with a Tensor operand such as `jax_array @ tensor` already do), or take "
    "`t.value` / `t.detach()` explicitly when you do want an untracked array."
)


class Tensor:
    """An array with autograd identity, viewing a copy-on-write storage.

    Build one with ``rf.tensor(data, requires_grad=False, dtype=None)``. A tensor
    is *tracked* when it has a ``grad_id``: leaves created with
    ``requires_grad=True`` and the results of ops recorded on a tape.
    ``transpose``, ``T`` and ``detach`` (and ``reshape``/``flatten`` when the
    layout allows) are views: they share the storage and its version counter.
    """

    __slots__ = ("__weakref__", "_cache", "_gid", "_layout", "_leaf", "_storage")
    __array_ufunc__ = None  # numpy defers to our reflected operators
    __array_priority__ = 1000

    def __init__(self, data: Any, requires_grad: bool = False, dtype: Any = None):
        if isinstance(data, Tensor) and data.grad_id is not None and current_tape() is not None:
            raise AutogradError(_NEW_LEAF_MESSAGE.format(gid=data.grad_id))
        arr = _to_array(data, dtype)
        self._storage = StorageHandle(arr)
        self._layout: Layout | None = None
        self._cache: tuple[int, jax.Array] | None = None
        self._leaf = True
        self._gid: int | None = None
        if requires_grad:
            if not jnp.issubdtype(arr.dtype, jnp.floating):
                raise TypeError(f"only floating-point tensors can require gradients, got dtype {arr.dtype}")
            self.grad_id = next_leaf_id()

    # -- construction helpers (internal) -------------------------------------
    @property
    def grad_id(self) -> int | None:
        """This tensor's autograd identity on the tape (None: not tracked)."""
        return self._gid

    @grad_id.setter
    def grad_id(self, gid: int | None) -> None:
        # tracked tensors are TrackedTensor instances: that class is not a
        # pytree, so jax.tree functions keep them as leaves (see _tracked_class)
        self._gid = gid
        self.__class__ = Tensor if gid is None else TrackedTensor

    @classmethod
    def _wrap(cls, value: jax.Array, grad_id: int | None = None) -> Tensor:
        """A tensor owning a new storage with ``value`` (an op result)."""
        t = Tensor.__new__(Tensor if grad_id is None else TrackedTensor)
        t._storage = StorageHandle(value)
        t._layout = None
        t._cache = None
        t._leaf = grad_id is None
        t._gid = grad_id
        return t

    def _view(self, layout: Layout, grad_id: int | None, detached: bool = False) -> Tensor:
        """A tensor sharing this tensor's storage through ``layout`` (``detached``:
        cut from this tensor's history on purpose, as ``detach()``)."""
        t = Tensor.__new__(Tensor if grad_id is None else TrackedTensor)
        t._storage = self._storage
        buf_shape = tuple(self._storage._buffer.shape)
        t._layout = None if layout == Layout.contiguous(buf_shape) and layout.shape == buf_shape else layout
        t._cache = None
        t._leaf = grad_id is None
        t._gid = grad_id
        self._storage._register_view(self, t, detached)
        return t

    # -- array-like attributes -----------------------------------------------
    @property
    def value(self) -> jax.Array:
        """The materialised (immutable) jax array this tensor currently shows."""
        if CAPTURE is not None:
            sub = CAPTURE.value(self)
            if sub is not None:
                return sub
        if _LAZY_LOCAL.q.nodes:  # a read computes this thread's deferred values (Note in lazy.py)
            lazy_flush()
        layout = self._layout
        storage = self._storage
        if layout is None:
            b = storage._buffer
            # the flush above computed every pending node, but a storage can still hold
            # a computed node in place of its array: swap the array in
            if type(b) is Lazy:  # (Note [Deferred elementwise ops] in lazy.py)
                b = storage._buffer = lazy_value(b)
            return b
        cache = self._cache
        version = storage._cell.value
        if cache is not None and cache[0] == version:
            return cache[1]
        value = storage.read(layout)
        self._cache = (version, value)
        return value

    @property
    def shape(self) -> tuple[int, ...]:
        if self._layout is None:
            return tuple(self._storage._buffer.shape)
        return self._layout.shape

    @property
    def dtype(self) -> np.dtype:
        return self._storage._buffer.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    @property
    def layout(self) -> Layout:
        if self._layout is None:
            return Layout.contiguous(self._storage._buffer.shape)
        return self._layout

    @property
    def storage(self) -> StorageHandle:
        return self._storage

    @property
    def version(self) -> int:
        return self._storage._cell.value

    @property
    def requires_grad(self) -> bool:
        return self.grad_id is not None

    @property
    def is_leaf(self) -> bool:
        """True unless this tensor is the recorded result of an op."""
        return self._leaf

    def is_contiguous(self) -> bool:
        return self.layout.is_contiguous

    # -- conversions -----------------------------------------------------------
    @property
    def __jax_array__(self) -> Any:
        # A tracked tensor hides __jax_array__ while a tape records: JAX's
        # operators then return NotImplemented and Python calls our reflected
        # operator, so `jax_array @ tensor` is recorded instead of silently
        # converting the tensor to an untracked array.
        if self.grad_id is not None and current_tape() is not None:
            raise AttributeError("__jax_array__")
        return self._materialise

    def _materialise(self) -> jax.Array:
        return self.value

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if self.grad_id is not None and current_tape() is not None:
            raise AutogradError(_DETACH_MESSAGE.format(gid=self.grad_id))
        arr = np.asarray(self.value)
        return arr if dtype is None else arr.astype(dtype)

    def numpy(self) -> np.ndarray:
        return np.asarray(self.value)

    def item(self) -> Any:
        return self.value.item()

    def __float__(self) -> float:
        return float(self.value)

    def __int__(self) -> int:
        return int(self.value)

    def __bool__(self) -> bool:
        return bool(self.value)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d Tensor")
        return self.shape[0]

    def __repr__(self) -> str:
        value = self.value
        if isinstance(value, jax.core.Tracer):
            body = f"traced {np.dtype(self.dtype).name}{list(self.shape)}"
        else:
            body = np.array2string(np.asarray(value), separator=", ", threshold=20)
        extra = f", grad_id={self.grad_id}" if self.grad_id is not None else ""
        return f"Tensor({body}, dtype={np.dtype(self.dtype).name}{extra})"

    # -- views -----------------------------------------------------------------
    def detach(self) -> Tensor:
        """An untracked view sharing this tensor's storage (and version)."""
        return self._view(self.layout, None, detached=True)

    def __pos__(self) -> Tensor:
        return self


class _TrackedMeta(type):
    """The type of ``TrackedTensor``: its repr, which JAX prints when it refuses
    one (``<class ...>``), explains the refusal (Note [A tracked Tensor in a
    plain JAX function])."""

    def __repr__(cls) -> str:
        detail = _REFUSED.__dict__.pop("detail", None)
        if detail is not None:
            return f"<{detail}>"
        return "<class 'rumus_fx.Tensor (tracked: pass it through rf.lift / rf.lax, not a raw jax transformation)'>"


class TrackedTensor(Tensor, metaclass=_TrackedMeta):
    """A Tensor with a grad id. Not a pytree (untracked Tensors are): the
    ``jax.tree`` functions keep it as one leaf, so tree maps inside a loss keep
    gradients, and a raw JAX transformation refuses it, with a message (the
    class name below) that points to rf.lift / rf.lax instead of dropping it."""

    __slots__ = ()


TrackedTensor.__qualname__ = TrackedTensor.__name__ = (
    "Tensor (tracked: pass it through rf.lift / rf.lax, not a raw jax transformation)"
)

# Note [A tracked Tensor in a plain JAX function]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``jnp.sin(t)``, an optax update or ``jax.jit(f)(t)`` on a tracked Tensor
# would cut it out of the gradient, so JAX must refuse it: JAX asks
# ``pytype_aval_mappings`` (jax's core) for its abstract value, and the entry for
# TrackedTensor raises ``TypeError`` naming the function (found on the stack:
# the jitted function JAX is tracing, else the caller outside jax), the
# tensor in short (shape, dtype, grad id -- never its data) and the way out
# (``rf.lift``, ``rumus_fx.numpy``). Where JAX catches that TypeError and
# raises its own ("Error interpreting argument to <fn> ... of type <class>"),
# the class's repr is that same text (set per thread just before raising).
_REFUSED = threading.local()
_JAX_FILES = (os.sep + "jax" + os.sep, os.sep + "jaxlib" + os.sep, os.sep + "rumus_fx" + os.sep)


def _refused_function() -> tuple[str, bool]:
    """The function JAX refuses a tracked Tensor for, and whether JAX catches
    the TypeError to raise its own (then the class's repr carries the text)."""
    frame = sys._getframe(2)
    caller = None
    caught = False
    while frame is not None:
        code = frame.f_code
        if code.co_name in ("_infer_input_type", "valid_jaxtype"):
            caught = True
        if code.co_name in ("_infer_input_type", "_infer_params") and "fun" in frame.f_locals:
            fun = frame.f_locals["fun"]
            fun = getattr(fun, "__wrapped__", fun)
            name = getattr(fun, "__qualname__", None) or getattr(fun, "__name__", None)
            module = getattr(fun, "__module__", None) or ""
            if module.startswith("jax.") and ".numpy" in module:  # jax.numpy's implementation modules
                module = "jax.numpy"
            if name:
                return (f"{module}.{name}" if module and "<" not in name else name), caught
        if caller is None and not any(p in code.co_filename for p in _JAX_FILES):
            caller = f"{frame.f_globals.get('__name__', '?')}.{code.co_name}"
        frame = frame.f_back
    return caller or "a JAX function", caught


def _refuse_tracked(t: Tensor) -> Any:
    fn, caught = _refused_function()
    detail = (
        f"a tracked rf.Tensor (shape {tuple(t.shape)}, dtype {np.dtype(t.dtype).name}, grad_id={t.grad_id}) "
        f"passed to the plain JAX function {fn}, which would cut it out of the gradient: wrap that function "
        "in rf.lift (rf.lift(fn)(...)), or use its rumus_fx.numpy (rnp) / rf.lax counterpart; take "
        "t.value or t.detach() for an untracked array"
    )
    if caught:
        _REFUSED.detail = detail
    raise TypeError(detail)


_jax_core.pytype_aval_mappings[TrackedTensor] = _refuse_tracked


def _flatten_tensor(t: Tensor) -> tuple[tuple[jax.Array], None]:
    return (t.value,), None


def _unflatten_tensor(_: None, children: Any) -> Tensor:
    return Tensor._wrap(children[0])


# untracked Tensors are pytrees with one array leaf: jax.jit, jax.vmap,
# jax.eval_shape and lax.scan accept and return them
jax.tree_util.register_pytree_node(Tensor, _flatten_tensor, _unflatten_tensor)


def _to_array(data: Any, dtype: Any) -> jax.Array:
    if isinstance(data, Tensor):
        data = data.value
    if isinstance(data, jax.Array):
        return data if dtype is None or data.dtype == dtype else data.astype(dtype)
    if isinstance(data, (np.ndarray, np.generic)):
        return jnp.asarray(data, dtype=dtype)
    if dtype is None:
        probe = np.asarray(data)
        if probe.dtype.kind == "f":  # python floats: float32 by default, as torch
            dtype = jnp.float32
        elif probe.dtype.kind == "O":
            raise TypeError(f"cannot build a Tensor from {type(data).__name__}")
    return jnp.asarray(data, dtype=dtype)
