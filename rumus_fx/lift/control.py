"""``rf.lax``'s control flow: jax.lax's scan, cond, switch, fori_loop, map,
while_loop and associative_scan, lifted, with bodies that may return rf Tensors
(their values are handed back to jax.lax) and may close over tracked Tensors."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from ..tensor import Tensor
from .tracing import lift


def _arrays(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: x.value if isinstance(x, Tensor) else x, tree, is_leaf=lambda x: isinstance(x, Tensor)
    )


def _arrays_out(f: Callable) -> Callable:
    @functools.wraps(f)
    def g(*args: Any, **kwargs: Any) -> Any:
        return _arrays(f(*args, **kwargs))

    return g


def _scan(f, init, xs=None, length=None, reverse=False, unroll=1, _split_transpose=False):
    return lax.scan(_arrays_out(f), init, xs, length=length, reverse=reverse, unroll=unroll)


def _cond(pred, true_fun, false_fun, *operands):
    return lax.cond(pred, _arrays_out(true_fun), _arrays_out(false_fun), *operands)


def _switch(index, branches, *operands):
    return lax.switch(index, [_arrays_out(b) for b in branches], *operands)


def _fori_loop(lower, upper, body_fun, init_val, *, unroll=None):
    return lax.fori_loop(lower, upper, _arrays_out(body_fun), init_val, unroll=unroll)


def _map(f, xs, *, batch_size=None):
    return lax.map(_arrays_out(f), xs, batch_size=batch_size)


def _while_loop(cond_fun, body_fun, init_val):
    return lax.while_loop(_arrays_out(cond_fun), _arrays_out(body_fun), init_val)


def _associative_scan(fn, elems, reverse=False, axis=0):
    return lax.associative_scan(_arrays_out(fn), elems, reverse=reverse, axis=axis)


def _named(fn: Callable, name: str, doc_of: Callable) -> Callable:
    out = lift(fn, name=f"jax.lax.{name}")
    out.__name__ = name
    out.__qualname__ = f"rumus_fx.lax.{name}"
    out.__doc__ = f"``jax.lax.{name}`` recorded on the tape; bodies may use rf ops.\n\n{doc_of.__doc__ or ''}"
    out.__wrapped_lift__ = doc_of
    return out


CONTROL = {
    "scan": _named(_scan, "scan", lax.scan),
    "cond": _named(_cond, "cond", lax.cond),
    "switch": _named(_switch, "switch", lax.switch),
    "fori_loop": _named(_fori_loop, "fori_loop", lax.fori_loop),
    "map": _named(_map, "map", lax.map),
    "while_loop": _named(_while_loop, "while_loop", lax.while_loop),
    "associative_scan": _named(_associative_scan, "associative_scan", lax.associative_scan),
}
