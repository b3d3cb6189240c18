"""``rf.checkpoint``: rematerialisation with ``jax.checkpoint``'s semantics."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from ..tensor import Tensor
from .apart import KEPT_APART, KeptApart
from .tracing import is_array_leaf, lift


def checkpoint(fun: Callable, *, policy: Callable | None = None, prevent_cse: bool = True) -> Callable:
    """``fun`` recorded as one ``RematBackward`` that keeps only its inputs.

    Its backward re-runs ``fun``'s forward (with rf's rules) and walks it, so the
    memory of the activations inside ``fun`` is spent one segment at a time (on
    XLA:CPU too, where ``jax.checkpoint``'s barrier alone lets the compiler merge the
    recomputed matmuls back into the forward: Note [Recomputation kept apart] in
    rumus_fx/lift/apart.py).
    ``fun`` may use rf ops, ``rumus_fx.numpy``, jnp or lifted functions; wrap each
    layer of a deep model (also inside an ``rf.lax.scan`` body).

    >>> import jax.numpy as jnp, rumus_fx as rf
    >>> layer = rf.checkpoint(lambda w, x: rf.tanh(x @ w))
    >>> rf.grad(lambda w: rf.sum(layer(w, jnp.ones((2, 3)))))(jnp.ones((3, 3))).shape
    (3, 3)
    """

    @functools.wraps(fun)
    def run(*args: Any, **kwargs: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=lambda x: isinstance(x, Tensor))
        mask = [is_array_leaf(x) for x in leaves]
        arrays = [x for x, m in zip(leaves, mask) if m]
        statics = [x for x, m in zip(leaves, mask) if not m]

        def inner(*arrs: Any) -> Any:
            it_a, it_s = iter(arrs), iter(statics)
            a, k = jax.tree_util.tree_unflatten(tree, [next(it_a) if m else next(it_s) for m in mask])
            return fun(*a, **k)

        return jax.checkpoint(inner, policy=marked, prevent_cse=prevent_cse)(*arrays)

    marked = KEPT_APART if policy is None else KeptApart(policy)  # Note [Recomputation kept apart]

    return lift(run, name=f"checkpoint({getattr(fun, '__name__', 'fun')})")
