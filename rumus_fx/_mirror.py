"""Build rf namespaces that mirror a jax namespace name for name.

Every function of the jax namespace becomes its ``rf.lift``-ed self, except the
names given a fused rf op (``matmul`` -> ``rf.matmul``, ...). The fused op is used
when the call fits its signature; anything else falls back to the lifted jax
function, so ``rnp.sum(x, dtype=...)`` still works. Types, constants and dtypes
are the jax objects themselves. Generated from the installed jax at import time,
so the mirror never drifts from it.
"""

from __future__ import annotations

import functools
import re
import sys
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import ops
from .errors import ShapeError, ShapeTypeError
from .lift import lift
from .tensor import Tensor

# words of a shape-related message of jax's TypeError/ValueError
_SHAPE_WORDS = re.compile(r"shape|size|dimension|broadcast|\brank|\baxis|\baxes|ndim", re.IGNORECASE)


def display_name(qualname: str) -> str:
    """``jax.numpy.linalg.solve`` -> ``rnp.linalg.solve``; ``jax.lax.x`` -> ``rf.lax.x``."""
    for jax_prefix, rf_prefix in (("jax.numpy.", "rnp."), ("jax.lax.", "rf.lax.")):
        if qualname.startswith(jax_prefix):
            return rf_prefix + qualname[len(jax_prefix) :]
    return qualname


def as_shape_error(name: str, e: BaseException) -> ShapeError | None:
    """jax's shape-related ``TypeError``/``ValueError`` (exactly those types) as
    an ``rf.ShapeError`` (``ShapeTypeError`` for a TypeError: still caught as
    one) whose message names the function ``name``; None for any other error."""
    if type(e) not in (TypeError, ValueError) or not _SHAPE_WORDS.search(str(e)):
        return None
    cls = ShapeTypeError if type(e) is TypeError else ShapeError
    return cls(f"{name}: {e}")


def lifted_function(fn: Callable, qualname: str) -> Callable:
    lifted = lift(fn, name=qualname)
    name = display_name(qualname)

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return lifted(*args, **kwargs)
        except (TypeError, ValueError) as e:
            err = as_shape_error(name, e)
            if err is None:
                raise
            raise err from e

    call.__wrapped_lift__ = lifted.__wrapped_lift__  # type: ignore[attr-defined]
    call.__wrapped__ = fn  # type: ignore[attr-defined]  # its signature
    call.__module__ = getattr(fn, "__module__", None) or call.__module__
    call.__name__ = getattr(fn, "__name__", qualname.rsplit(".", 1)[-1])
    call.__qualname__ = qualname
    call.__doc__ = f"``{qualname}``, recorded on the tape (see rf.lift).\n\n{getattr(fn, '__doc__', '') or ''}"
    return call


def with_fused(fused: Callable, fallback: Callable, accepts: Callable[..., bool]) -> Callable:
    """``fused(*args, **kwargs)`` when ``accepts(*args, **kwargs)``, else ``fallback``."""

    @functools.wraps(fallback)
    def call(*args: Any, **kwargs: Any) -> Any:
        if accepts(*args, **kwargs):
            return fused(*args, **kwargs)
        return fallback(*args, **kwargs)

    call.__wrapped_lift__ = getattr(fallback, "__wrapped_lift__", fallback)  # type: ignore[attr-defined]
    return call


def mirror(
    module_name: str,
    source: types.ModuleType,
    fused: dict[str, tuple[Callable, Callable[..., bool]]] | None = None,
    submodules: tuple[str, ...] = (),
    skip: tuple[str, ...] = (),
) -> types.ModuleType:
    """A module ``module_name`` mirroring ``source`` (registered in sys.modules)."""
    mod = sys.modules.get(module_name)
    if mod is None:
        mod = types.ModuleType(module_name)
        sys.modules[module_name] = mod
    fill(mod, source, module_name, fused or {}, skip)
    for sub in submodules:
        src = getattr(source, sub)
        child = mirror(f"{module_name}.{sub}", src)
        setattr(mod, sub, child)
    return mod


def fill(
    mod: types.ModuleType,
    source: types.ModuleType,
    prefix: str,
    fused: dict[str, tuple[Callable, Callable[..., bool]]],
    skip: tuple[str, ...] = (),
) -> None:
    src_name = source.__name__
    for name in dir(source):
        if name.startswith("_") or name in skip or (hasattr(mod, name) and name not in fused):
            continue
        value = getattr(source, name)
        if isinstance(value, (types.ModuleType, type)) or not callable(value):
            setattr(mod, name, value)
            continue
        lifted = lifted_function(value, f"{src_name}.{name}")
        if name in fused:
            op, accepts = fused[name]
            lifted = with_fused(op, lifted, accepts)
        setattr(mod, name, lifted)


# -- the fused ops of rumus_fx.numpy and when a call fits them ---------------


def _is_float(x: Any) -> bool:
    if isinstance(x, (Tensor, jax.Array, np.ndarray)):
        return jnp.issubdtype(x.dtype, jnp.floating)
    return False


def _operand(x: Any) -> bool:
    return _is_float(x) or (isinstance(x, (int, float)) and not isinstance(x, bool))


def _binary_ok(x: Any, y: Any, *rest: Any, **kw: Any) -> bool:
    return not rest and not kw and _operand(x) and _operand(y) and (_is_float(x) or _is_float(y))


def _unary_ok(x: Any, *rest: Any, **kw: Any) -> bool:
    return not rest and not kw and _is_float(x)


def _reduce_ok(x: Any, axis: Any = None, *rest: Any, keepdims: bool = False, **kw: Any) -> bool:
    return not rest and not kw and _is_float(x) and isinstance(keepdims, bool)


def matmul_fits(a: Any, b: Any) -> bool:
    """Whether ``a @ b`` is rf.matmul ([..., M, K] @ [K, N]) or rf.bmm."""
    if not (_is_float(a) and _is_float(b)) or a.dtype != b.dtype:
        return False
    na, nb = len(a.shape), len(b.shape)
    return na >= 2 and (nb == 2 or (na == nb and na >= 3 and tuple(a.shape[:-2]) == tuple(b.shape[:-2])))


def _matmul_ok(a: Any, b: Any, *rest: Any, **kw: Any) -> bool:
    return not rest and not kw and matmul_fits(a, b)


def _reshape_ok(a: Any, shape: Any = None, *rest: Any, **kw: Any) -> bool:
    return not rest and not kw and shape is not None and _is_float(a)


def _stack_ok(arrays: Any, axis: int = 0, *rest: Any, **kw: Any) -> bool:
    return not rest and not kw and isinstance(arrays, (list, tuple)) and arrays and all(_is_float(a) for a in arrays)


def _sum(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:
    return ops.sum(x, axis=axis, keepdims=keepdims)


def _mean(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:
    return ops.mean(x, axis=axis, keepdims=keepdims)


NUMPY_FUSED = {
    "matmul": (ops.matmul_or_bmm, _matmul_ok),
    "add": (ops.add, _binary_ok),
    "subtract": (ops.sub, _binary_ok),
    "multiply": (ops.mul, _binary_ok),
    "divide": (ops.div, _binary_ok),
    "true_divide": (ops.div, _binary_ok),
    "negative": (ops.neg, _unary_ok),
    "exp": (ops.exp, _unary_ok),
    "log": (ops.log, _unary_ok),
    "tanh": (ops.tanh, _unary_ok),
    "sum": (_sum, _reduce_ok),
    "mean": (_mean, _reduce_ok),
    "reshape": (ops.reshape, _reshape_ok),
    "stack": (ops.stack, _stack_ok),
}
