"""Gradient checking: rf's tape against ``jax.grad`` and finite differences.

This is the one module of rumus_fx that calls JAX's autodiff: it is the oracle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from .autograd.transforms import grad as rf_grad
from .tensor import Tensor


def as_array(x: Any) -> jax.Array:
    """The jax array behind a Tensor (or ``x`` itself)."""
    return x.value if isinstance(x, Tensor) else jnp.asarray(x)


def _nums(argnums: int | Sequence[int]) -> tuple[int, ...]:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def _to_f64(tree: Any) -> Any:
    def conv(x: Any) -> Any:
        x = as_array(x)
        return x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree_util.tree_map(conv, tree, is_leaf=lambda x: isinstance(x, Tensor))


# what jax raises where a function needs its arguments' values, or an argument that is
# not an array, while ``jax.jit`` traces it: the oracle then runs eagerly
_NOT_TRACEABLE = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
    TypeError,
)


def jax_oracle_grad(fun: Callable, args: Sequence[Any], argnums: int | Sequence[int] = 0) -> Any:
    """``jax.grad`` of ``fun`` run on plain arrays (no tape records then).

    Compiled with ``jax.jit`` (one program; eagerly jax compiles one per primitive,
    several times slower for a one-off check); run eagerly instead where ``fun``
    does not trace (it needs an argument's value, or an argument is not an array),
    so that it gives, or raises, what ``jax.grad`` does there."""
    g = jax.grad(lambda *a: as_array(fun(*a)).reshape(()), argnums=argnums)
    try:
        return jax.jit(g)(*args)
    except _NOT_TRACEABLE:
        return g(*args)


def check_grads(
    fun: Callable,
    args: Sequence[Any],
    argnums: int | Sequence[int] = 0,
    *,
    oracle: Callable | None = None,
    jit: bool = False,
    atol: float = 2e-5,
    rtol: float = 2e-5,
    fd: bool = True,
    fd_eps: float = 1e-6,
    fd_tol: float = 1e-6,
    directions: int = 2,
    seed: int = 0,
) -> Any:
    """Check ``rf.grad(fun, argnums)`` at ``args``; returns the rf gradients.

    1. against ``jax.grad`` of ``oracle`` (a plain ``jax.numpy`` function) or,
       when no oracle is given, of ``fun`` itself run on untracked arrays, at the
       arguments' own dtypes (tolerances ``atol``/``rtol``);
    2. when ``fd``: in float64, the directional derivative ``<grad, v>`` for
       ``directions`` random directions ``v`` against a central finite difference
       of ``fun`` (tolerance ``fd_tol``, relative to the scale of the terms).

    ``jit=True`` runs ``rf.grad`` under ``jax.jit``. Assertions use chex.
    """
    args = tuple(args)
    g = rf_grad(fun, argnums=argnums)
    if jit:
        g = jax.jit(g)
    got = g(*args)
    ref_fun = oracle if oracle is not None else fun
    expected = jax_oracle_grad(ref_fun, args, argnums)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, expected)
    chex.assert_trees_all_close(got, expected, atol=atol, rtol=rtol)
    if fd:
        check_fd(fun, args, argnums, eps=fd_eps, tol=fd_tol, directions=directions, seed=seed, jit=jit)
    return got


def check_fd(
    fun: Callable,
    args: Sequence[Any],
    argnums: int | Sequence[int] = 0,
    *,
    eps: float = 1e-6,
    tol: float = 1e-6,
    directions: int = 2,
    seed: int = 0,
    jit: bool = False,
    grads: Any = None,
) -> None:
    """Float64 central-difference check of ``rf.grad`` along random directions.

    ``grads``: rf's gradients with respect to ``argnums`` (a tuple, one per
    argument), already computed at ``args`` in float64, to check instead of
    computing them again."""
    nums = _nums(argnums)
    with jax.enable_x64(True):
        args64 = list(_to_f64(tuple(args)))
        g = rf_grad(fun, argnums=nums)
        f = lambda *a: as_array(fun(*a)).reshape(())  # noqa: E731
        if jit:
            g, f = jax.jit(g), jax.jit(f)
        if grads is None:
            grads = g(*args64)
        elif len(grads) != len(nums):
            raise ValueError(f"check_fd: {len(grads)} gradients given for argnums {nums}")
        rng = np.random.default_rng(seed)
        # the steps and dot products in NumPy (the same float64 arithmetic): jnp
        # eagerly would compile a program per primitive and shape
        host = {i: jax.tree_util.tree_map(np.asarray, args64[i]) for i in nums}
        for _ in range(directions):
            vs = [jax.tree_util.tree_map(lambda x: rng.standard_normal(np.shape(x)), host[i]) for i in nums]
            plus, minus = list(args64), list(args64)
            for i, v in zip(nums, vs):
                plus[i] = jax.tree_util.tree_map(lambda x, d: jnp.asarray(x + eps * d), host[i], v)
                minus[i] = jax.tree_util.tree_map(lambda x, d: jnp.asarray(x - eps * d), host[i], v)
            numeric = (float(f(*plus)) - float(f(*minus))) / (2 * eps)
            terms = [
                float(np.vdot(np.asarray(gl), vl))
                for gi, vi in zip(grads, vs)
                for gl, vl in zip(jax.tree_util.tree_leaves(gi), jax.tree_util.tree_leaves(vi))
            ]
            analytic = sum(terms)
            scale = max(1.0, abs(numeric), *(abs(t) for t in terms))
            chex.assert_trees_all_close(analytic / scale, numeric / scale, atol=tol, rtol=0)
