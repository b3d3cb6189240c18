"""jax.nn's functions in ``rf.nn``, next to the layers, each recorded on the tape.

``rf.nn.silu``, ``rf.nn.log_softmax``, ``rf.nn.one_hot``, ...: jax.nn's own
definitions run through ``rf.lift``; ``relu``, ``sigmoid``, ``tanh``, ``gelu``,
``softmax`` and ``leaky_relu`` use the fused rf ops when the call fits them.
"""

from __future__ import annotations

import sys
from typing import Any

import jax

from .. import ops
from .._mirror import fill


def _float(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.numpy.issubdtype(x.dtype, jax.numpy.floating)


def _unary_ok(x: Any, *rest: Any, **kw: Any) -> bool:
    return not rest and not kw and _float(x)


def _gelu_ok(x: Any, approximate: bool = True, *rest: Any, **kw: Any) -> bool:
    return not rest and not kw and _float(x) and isinstance(approximate, bool)


def _gelu(x: Any, approximate: bool = True) -> Any:
    return ops.gelu(x, approximate=approximate)


def _softmax_ok(x: Any, axis: Any = -1, *rest: Any, **kw: Any) -> bool:
    return not rest and not kw and _float(x) and isinstance(axis, int)


def _softmax(x: Any, axis: int = -1) -> Any:
    return ops.softmax(x, axis=axis)


def _leaky_ok(x: Any, negative_slope: float = 0.01, *rest: Any, **kw: Any) -> bool:
    return not rest and not kw and _float(x) and isinstance(negative_slope, (int, float))


def _leaky(x: Any, negative_slope: float = 0.01) -> Any:
    return ops.leaky_relu(x, negative_slope)


FUSED = {
    "relu": (ops.relu, _unary_ok),
    "sigmoid": (ops.sigmoid, _unary_ok),
    "tanh": (ops.tanh, _unary_ok),
    "gelu": (_gelu, _gelu_ok),
    "softmax": (_softmax, _softmax_ok),
    "leaky_relu": (_leaky, _leaky_ok),
}


def install(module_name: str) -> None:
    """Add jax.nn's functions to the module ``module_name`` (``rumus_fx.nn``)."""
    fill(sys.modules[module_name], jax.nn, "jax.nn", FUSED, skip=("initializers",))
