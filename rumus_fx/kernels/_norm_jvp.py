"""Tangent rules shared by layer norm and batch norm (forward and backward
kernels), written by hand in jax.numpy and linear in the tangents.

Both norms compute ``xhat = (x - mean) * rstd`` and ``y = xhat * w + b`` with the
statistics reduced over ``axes``; ``stat`` reshapes a statistic to broadcast
against ``x`` and ``param`` does the same for ``w``/``b``. Inputs are upcast to
float32 (bfloat16/float16 statistics accumulate in float32).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from .precision import upcast

Reshape = Callable[[jax.Array], jax.Array]


def _p(v: jax.Array | None, param: Reshape, default: float) -> jax.Array | float:
    return default if v is None else param(upcast(v))


def forward_tangents(
    x, w, mean, rstd, dx, dw, db, *, axes: tuple[int, ...], stat: Reshape, param: Reshape
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Tangents of ``(y, mean, biased var, rstd)`` given tangents of ``(x, w, b)``."""
    xf, dxf = upcast(x), upcast(dx)
    xc = xf - stat(mean)
    dmean = jnp.mean(dxf, axis=axes)
    dxc = dxf - stat(dmean)
    dvar = 2.0 * jnp.mean(xc * dxc, axis=axes)
    drstd = -0.5 * rstd**3 * dvar
    r = stat(rstd)
    xhat = xc * r
    dxhat = dxc * r + xc * stat(drstd)
    dy = dxhat * _p(w, param, 1.0)
    if dw is not None:
        dy = dy + xhat * param(upcast(dw))
    if db is not None:
        dy = dy + param(upcast(db))
    return dy, dmean, dvar, drstd


def backward(x, w, mean, rstd, g, *, axes: tuple[int, ...], param_axes: tuple[int, ...], stat: Reshape, param: Reshape):
    """``(dx, dw, db)`` in float32: the normalisation backward with the
    statistics as inputs (what the backward kernels compute)."""
    xf, gf = upcast(x), upcast(g)
    r = stat(rstd)
    xhat = (xf - stat(mean)) * r
    dxhat = gf * _p(w, param, 1.0)
    c1 = jnp.mean(dxhat, axis=axes, keepdims=True)
    c2 = jnp.mean(dxhat * xhat, axis=axes, keepdims=True)
    dx = r * (dxhat - c1 - xhat * c2)
    return dx, jnp.sum(gf * xhat, axis=param_axes), jnp.sum(gf, axis=param_axes)


def backward_tangents(
    x, w, mean, rstd, g, tx, tw, tmean, trstd, tg, *, axes, param_axes, stat: Reshape, param: Reshape
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Tangents of :func:`backward`'s ``(dx, dw, db)`` given tangents of all
    five inputs (the statistics are inputs here, as in the kernel)."""
    xf, gf = upcast(x), upcast(g)
    txf, tgf = upcast(tx), upcast(tg)
    r, tr = stat(rstd), stat(upcast(trstd))
    xc = xf - stat(mean)
    xhat = xc * r
    txhat = (txf - stat(upcast(tmean))) * r + xc * tr
    wv = _p(w, param, 1.0)
    dxhat = gf * wv
    tdxhat = tgf * wv
    if tw is not None:
        tdxhat = tdxhat + gf * param(upcast(tw))
    c1 = jnp.mean(dxhat, axis=axes, keepdims=True)
    c2 = jnp.mean(dxhat * xhat, axis=axes, keepdims=True)
    tc1 = jnp.mean(tdxhat, axis=axes, keepdims=True)
    tc2 = jnp.mean(tdxhat * xhat + dxhat * txhat, axis=axes, keepdims=True)
    tdx = tr * (dxhat - c1 - xhat * c2) + r * (tdxhat - tc1 - txhat * c2 - xhat * tc2)
    tdw = jnp.sum(tgf * xhat + gf * txhat, axis=param_axes)
    tdb = jnp.sum(tgf, axis=param_axes)
    return tdx, tdw, tdb
