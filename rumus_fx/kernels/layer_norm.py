"""Layer norm over the last axis: forward (saving mean and 1/std) and backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ._util import upcast
from .dispatch import call


def _row(v: jax.Array, ndim: int) -> jax.Array:
    """A ``[D]`` parameter shaped to broadcast over ``ndim``-rank rows."""
    return upcast(v).reshape((1,) * (ndim - 1) + v.shape)


def layer_norm_fwd_reference(x, weight, bias, *, eps: float):
    xf = upcast(x)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    xc = xf - mean
    var = jnp.mean(xc * xc, axis=-1, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    y = xc * rstd
    if weight is not None:
        y = y * _row(weight, x.ndim)
    if bias is not None:
        y = y + _row(bias, x.ndim)
    return y.astype(x.dtype), mean[..., 0], rstd[..., 0]


def layer_norm_bwd_reference(x, weight, mean, rstd, g, *, has_bias: bool):
    xf, gf = upcast(x), upcast(g)
    rstd_ = rstd[..., None]
    xhat = (xf - mean[..., None]) * rstd_
    dxhat = gf * _row(weight, x.ndim) if weight is not None else gf
    c1 = jnp.mean(dxhat, axis=-1, keepdims=True)
    c2 = jnp.mean(dxhat * xhat, axis=-1, keepdims=True)
    dx = (rstd_ * (dxhat - c1 - xhat * c2)).astype(x.dtype)
    lead = tuple(range(x.ndim - 1))
    dw = jnp.sum(gf * xhat, axis=lead).astype(weight.dtype) if weight is not None else None
    db = jnp.sum(gf, axis=lead).astype(g.dtype) if has_bias else None
    return dx, dw, db


def layer_norm_fwd(x: jax.Array, weight: jax.Array | None, bias: jax.Array | None, eps: float = 1e-5):
    """``(y, mean, rstd)``; ``mean``/``rstd`` have shape ``x.shape[:-1]`` (float32
    for low-precision inputs)."""
    return call(layer_norm_fwd_reference, None, x, weight, bias, eps=eps)


def layer_norm_bwd(x, weight, mean, rstd, g, has_bias: bool = True):
    """``(dx, dweight | None, dbias | None)`` from the saved statistics."""
    return call(layer_norm_bwd_reference, None, x, weight, mean, rstd, g, has_bias=has_bias)
