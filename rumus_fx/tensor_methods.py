"""Tensor methods and operators, each recorded: the rf ops as methods
(``t.sum()``, ``t + u``, ``t.T``, ``t[i]``, the in-place ``t.add_(u)``, ...) and
the methods and operators that mirror ``jax.Array``'s.

Attached to ``rf.Tensor`` when the package is imported (as jax attaches its own
array methods), so ``tensor.py``, which sits below the ops, imports none of
them. Comparisons and ``==`` are elementwise and return untracked boolean
Tensors; Tensors hash by identity, as torch's do.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from . import lax as rlax
from . import numpy as rnp
from . import ops
from ._mirror import matmul_fits
from .errors import ShapeError
from .lift import lift
from .ops import inplace
from .tensor import Tensor

# -- the rf ops as methods (installed first) --------------------------------


def _transpose(self: Tensor, dim0: int, dim1: int) -> Tensor:
    """Swap two dimensions (a view; see rf.transpose)."""
    return ops.transpose(self, dim0, dim1)


def _T(self: Tensor) -> Tensor:
    """The transpose of a 2-D tensor (a view)."""
    if self.ndim != 2:
        raise ShapeError(f"T: expects a 2-D tensor, got shape {self.shape}; use transpose(d0, d1)")
    return ops.transpose(self, 0, 1)


def _reshape(self: Tensor, *shape: Any) -> Tensor:
    """``t.reshape(2, 3)`` or ``t.reshape((2, 3))``: a view when the layout allows (see rf.reshape)."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return ops.reshape(self, shape)


def _flatten(self: Tensor) -> Tensor:
    """The tensor as 1-D (a view when the layout allows; see rf.flatten)."""
    return ops.flatten(self)


def _getitem(self: Tensor, key: Any) -> Tensor:
    """``t[key]``: a new tensor (a copy, not a view as in PyTorch); see rf.index."""
    return ops.index(self, key)


def _sum(self: Tensor, axis: Any = None, keepdims: bool = False) -> Tensor:
    return ops.sum(self, axis=axis, keepdims=keepdims)


def _mean(self: Tensor, axis: Any = None, keepdims: bool = False) -> Tensor:
    return ops.mean(self, axis=axis, keepdims=keepdims)


def _gelu(self: Tensor, approximate: bool = True) -> Tensor:
    return ops.gelu(self, approximate=approximate)


def _leaky_relu(self: Tensor, alpha: float = 0.01) -> Tensor:
    return ops.leaky_relu(self, alpha)


def _softmax(self: Tensor, axis: int = -1) -> Tensor:
    return ops.softmax(self, axis=axis)


def _unary_op(fn: Any, name: str) -> Any:
    def method(self: Tensor) -> Tensor:
        return fn(self)

    method.__name__ = name
    method.__doc__ = f"``rf.{name}`` of this tensor."
    return method


def _binary_op(fn: Any, name: str, reflected: bool = False) -> Any:
    def method(self: Tensor, other: Any) -> Tensor:
        return fn(other, self) if reflected else fn(self, other)

    method.__name__ = name
    return method


def _inplace_binary(kind: str) -> Any:
    def method(self: Tensor, other: Any) -> Tensor:
        return inplace.binary_(self, other, kind)

    method.__name__ = f"{kind}_"
    method.__doc__ = f"In place ``self {kind} other`` (copy-on-write, version + 1, differentiable while recording)."
    return method


def _zero_(self: Tensor) -> Tensor:
    """Fill with zeros in place (copy-on-write, version + 1)."""
    return inplace.fill_(self, 0, "zero_")


def _fill_(self: Tensor, value: Any) -> Tensor:
    """Fill with ``value`` in place (copy-on-write, version + 1)."""
    return inplace.fill_(self, value, "fill_")


def _copy_(self: Tensor, src: Any) -> Tensor:
    """Copy ``src`` into this tensor in place (copy-on-write, version + 1)."""
    return inplace.copy_(self, src)


def _install_ops() -> None:
    """The rf ops as methods and operators of ``rf.Tensor``."""
    Tensor.transpose = _transpose
    Tensor.T = property(_T, doc=_T.__doc__)
    Tensor.reshape = _reshape
    Tensor.flatten = _flatten
    Tensor.__getitem__ = _getitem
    Tensor.sum = _sum
    Tensor.mean = _mean
    for name in ("relu", "sigmoid", "tanh", "exp", "log"):
        setattr(Tensor, name, _unary_op(getattr(ops, name), name))
    Tensor.gelu = _gelu
    Tensor.leaky_relu = _leaky_relu
    Tensor.softmax = _softmax
    Tensor.matmul = _binary_op(ops.matmul, "matmul")
    for dunder, name in (("add", "add"), ("sub", "sub"), ("mul", "mul"), ("truediv", "div")):
        setattr(Tensor, f"__{dunder}__", _binary_op(getattr(ops, name), f"__{dunder}__"))
        setattr(Tensor, f"__r{dunder}__", _binary_op(getattr(ops, name), f"__r{dunder}__", reflected=True))
    Tensor.__neg__ = _unary_op(ops.neg, "__neg__")
    for kind in ("add", "sub", "mul", "div"):
        setattr(Tensor, f"{kind}_", _inplace_binary(kind))
    Tensor.zero_ = _zero_
    Tensor.fill_ = _fill_
    Tensor.copy_ = _copy_


# -- jax.Array's methods ---------------------------------------------------

# jax.Array methods that take the array first and are jax.numpy functions
_ARRAY_METHODS = (
    "all", "any", "argmax", "argmin", "argsort", "astype", "clip", "conj", "conjugate", "cumprod",
    "cumsum", "diagonal", "dot", "max", "min", "prod", "ptp", "ravel", "repeat", "round", "sort",
    "squeeze", "std", "swapaxes", "take", "trace", "var", "nonzero", "searchsorted", "choose",
)  # fmt: skip
# elementwise math as methods ("sqrt and friends")
_MATH = ("sqrt", "rsqrt", "abs", "sin", "cos", "tan", "sinh", "cosh", "arcsin", "arccos", "arctan",
         "log1p", "expm1", "square", "sign", "floor", "ceil", "reciprocal", "log2", "log10", "exp2",
         "arcsinh", "arccosh", "arctanh", "cbrt")  # fmt: skip
_BINARY = {
    "__pow__": "power", "__mod__": "remainder", "__floordiv__": "floor_divide",
    "__lt__": "less", "__le__": "less_equal", "__gt__": "greater", "__ge__": "greater_equal",
    "__and__": "bitwise_and", "__or__": "bitwise_or", "__xor__": "bitwise_xor",
    "__lshift__": "left_shift", "__rshift__": "right_shift",
}  # fmt: skip
_REFLECTED = {"__rpow__": "power", "__rmod__": "remainder", "__rfloordiv__": "floor_divide",
              "__rand__": "bitwise_and", "__ror__": "bitwise_or", "__rxor__": "bitwise_xor"}  # fmt: skip


def _arraylike(x: Any) -> bool:
    return isinstance(x, (Tensor, jax.Array, np.ndarray, np.generic, int, float, bool, complex))


def _method(name: str):
    fn = getattr(rnp, name) if name != "rsqrt" else rf_lax_rsqrt

    def method(self: Tensor, *args: Any, **kwargs: Any) -> Any:
        return fn(self, *args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"``jax.numpy.{name}`` of this tensor, recorded (see rumus_fx.numpy)."
    return method


def rf_lax_rsqrt(x: Any) -> Any:
    return rlax.rsqrt(x)


def _binary(jname: str, reflected: bool = False):
    fn = getattr(rnp, jname)

    def op(self: Tensor, other: Any) -> Any:
        if not _arraylike(other):
            return NotImplemented
        return fn(other, self) if reflected else fn(self, other)

    op.__name__ = jname
    return op


def _eq(self: Tensor, other: Any) -> Any:
    if not _arraylike(other):
        return NotImplemented
    return rnp.equal(self, other)


def _ne(self: Tensor, other: Any) -> Any:
    if not _arraylike(other):
        return NotImplemented
    return rnp.not_equal(self, other)


def _matmul(self: Tensor, other: Any) -> Any:
    if matmul_fits(self, other):
        return ops.matmul_or_bmm(self, other)
    return rnp.matmul(self, other)


def _rmatmul(self: Tensor, other: Any) -> Any:
    if matmul_fits(other, self):
        return ops.matmul_or_bmm(other, self)
    return rnp.matmul(other, self)


class _At:
    """``t.at[idx]``: functional, recorded updates (``set``, ``add``, ...)."""

    __slots__ = ("_t",)

    def __init__(self, t: Tensor):
        self._t = t

    def __getitem__(self, idx: Any) -> _AtRef:
        return _AtRef(self._t, idx)


class _AtRef:
    __slots__ = ("_idx", "_t")

    def __init__(self, t: Tensor, idx: Any):
        self._t, self._idx = t, idx

    def _apply(self, kind: str, *values: Any, **kwargs: Any) -> Any:
        return rnp_at(self._t, _encode_index(self._idx), kind, values, kwargs)

    def get(self, **kwargs: Any) -> Any:
        return self._apply("get", **kwargs)

    def set(self, v: Any, **kwargs: Any) -> Any:
        return self._apply("set", v, **kwargs)

    def add(self, v: Any, **kwargs: Any) -> Any:
        return self._apply("add", v, **kwargs)

    def subtract(self, v: Any, **kwargs: Any) -> Any:
        return self._apply("subtract", v, **kwargs)

    def multiply(self, v: Any, **kwargs: Any) -> Any:
        return self._apply("multiply", v, **kwargs)

    def divide(self, v: Any, **kwargs: Any) -> Any:
        return self._apply("divide", v, **kwargs)

    def power(self, v: Any, **kwargs: Any) -> Any:
        return self._apply("power", v, **kwargs)

    def min(self, v: Any, **kwargs: Any) -> Any:
        return self._apply("min", v, **kwargs)

    def max(self, v: Any, **kwargs: Any) -> Any:
        return self._apply("max", v, **kwargs)


class _Slice:
    """A hashable stand-in for a ``slice`` inside an index (a static leaf)."""

    __slots__ = ("args",)

    def __init__(self, s: slice):
        self.args = (s.start, s.stop, s.step)

    def __hash__(self) -> int:
        return hash(("slice", self.args))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Slice) and other.args == self.args


def _encode_index(idx: Any) -> Any:
    if isinstance(idx, tuple):
        return tuple(_encode_index(i) for i in idx)
    if isinstance(idx, slice):
        return _Slice(idx)
    return idx


def _decode_index(idx: Any) -> Any:
    if isinstance(idx, tuple):
        return tuple(_decode_index(i) for i in idx)
    if isinstance(idx, _Slice):
        return slice(*idx.args)
    return idx


def _at_update(x: Any, idx: Any, kind: str, values: tuple, kwargs: dict) -> Any:
    return getattr(x.at[_decode_index(idx)], kind)(*values, **kwargs)


rnp_at = None  # set below (a lifted function)


def install() -> None:
    """Attach the methods to ``rf.Tensor``."""
    global rnp_at
    _install_ops()
    rnp_at = lift(_at_update, name="Array.at")
    for name in _ARRAY_METHODS + _MATH:
        if name not in Tensor.__dict__:
            setattr(Tensor, name, _method(name))
    for dunder, jname in _BINARY.items():
        setattr(Tensor, dunder, _binary(jname))
    for dunder, jname in _REFLECTED.items():
        setattr(Tensor, dunder, _binary(jname, reflected=True))
    Tensor.__eq__ = _eq
    Tensor.__ne__ = _ne
    Tensor.__hash__ = object.__hash__
    Tensor.__abs__ = _method("abs")
    Tensor.__matmul__ = _matmul
    Tensor.__rmatmul__ = _rmatmul
    Tensor.__invert__ = lambda self: rnp.invert(self)
    Tensor.at = property(lambda self: _At(self), doc="Functional, recorded updates: ``t.at[idx].set(v)``.")
