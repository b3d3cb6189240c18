"""Batch norm over [B, C, H, W] (statistics per channel): training forward and
backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ._util import upcast
from .dispatch import call

_AXES = (0, 2, 3)


def _chan(v: jax.Array) -> jax.Array:
    return v.reshape(1, -1, 1, 1)


def batch_norm_train_reference(x, weight, bias, *, eps: float):
    """-> (y, batch mean [C], biased batch var [C], rstd [C])."""
    xf = upcast(x)
    mean = jnp.mean(xf, axis=_AXES)
    xc = xf - _chan(mean)
    var = jnp.mean(xc * xc, axis=_AXES)
    rstd = lax.rsqrt(var + eps)
    y = xc * _chan(rstd)
    if weight is not None:
        y = y * _chan(upcast(weight))
    if bias is not None:
        y = y + _chan(upcast(bias))
    return y.astype(x.dtype), mean, var, rstd


def batch_norm_train_bwd_reference(x, weight, mean, rstd, g, *, has_bias: bool):
    """Training-mode gradients (the statistics depend on x)."""
    xf, gf = upcast(x), upcast(g)
    xhat = (xf - _chan(mean)) * _chan(rstd)
    dxhat = gf * _chan(upcast(weight)) if weight is not None else gf
    c1 = jnp.mean(dxhat, axis=_AXES, keepdims=True)
    c2 = jnp.mean(dxhat * xhat, axis=_AXES, keepdims=True)
    dx = (_chan(rstd) * (dxhat - c1 - xhat * c2)).astype(x.dtype)
    dw = jnp.sum(gf * xhat, axis=_AXES).astype(weight.dtype) if weight is not None else None
    db = jnp.sum(gf, axis=_AXES).astype(g.dtype) if has_bias else None
    return dx, dw, db


def batch_norm_train_fwd(x, weight, bias, eps: float = 1e-5):
    return call(batch_norm_train_reference, None, x, weight, bias, eps=eps)


def batch_norm_train_bwd(x, weight, mean, rstd, g, has_bias: bool = True):
    return call(batch_norm_train_bwd_reference, None, x, weight, mean, rstd, g, has_bias=has_bias)
