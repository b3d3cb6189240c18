"""Scaled dot-product attention: forward (output + log-sum-exp) and backward.

The reference materialises the [Sq, Sk] score matrix; the Pallas kernel beside it
is flash-style (online softmax, blocks of keys) and never does.
"""

from __future__ import annotations

import jax.numpy as jnp

from ._util import upcast
from .dispatch import call


def _scores(q, k, mask, *, causal: bool, scale: float):
    s = jnp.einsum("...qd,...kd->...qk", upcast(q), upcast(k)) * scale
    neg = jnp.finfo(s.dtype).min
    if mask is not None:
        if mask.dtype == jnp.bool_:
            s = jnp.where(mask, s, neg)
        else:
            s = s + upcast(mask)
    if causal:
        sq, sk = s.shape[-2], s.shape[-1]
        keep = jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None]
        s = jnp.where(keep, s, neg)
    return s


def attention_fwd_reference(q, k, v, mask, *, causal: bool, scale: float):
    """-> (out [..., Sq, Dv], lse [..., Sq] in float32 or wider)."""
    s = _scores(q, k, mask, causal=causal, scale=scale)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - m)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / denom
    out = jnp.einsum("...qk,...kd->...qd", p, upcast(v))
    lse = (m + jnp.log(denom))[..., 0]
    return out.astype(q.dtype), lse


def attention_bwd_reference(q, k, v, mask, out, lse, g, *, causal: bool, scale: float, mask_grad: bool = False):
    """-> (dq, dk, dv, dmask | None); dmask only for a float (additive) mask."""
    s = _scores(q, k, mask, causal=causal, scale=scale)
    p = jnp.exp(s - lse[..., None])
    gf = upcast(g)
    dv = jnp.einsum("...qk,...qd->...kd", p, gf)
    dp = jnp.einsum("...qd,...kd->...qk", gf, upcast(v))
    delta = jnp.sum(gf * upcast(out), axis=-1, keepdims=True)
    ds = p * (dp - delta)
    dq = jnp.einsum("...qk,...kd->...qd", ds, upcast(k)) * scale
    dk = jnp.einsum("...qk,...qd->...kd", ds, upcast(q)) * scale
    dmask = ds if mask_grad else None
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dmask


def attention_fwd(q, k, v, mask=None, causal: bool = False, scale: float = 1.0):
    return call(attention_fwd_reference, None, q, k, v, mask, causal=causal, scale=scale)


def attention_bwd(q, k, v, mask, out, lse, g, causal: bool = False, scale: float = 1.0, mask_grad: bool = False):
    return call(
        attention_bwd_reference, None, q, k, v, mask, out, lse, g, causal=causal, scale=scale, mask_grad=mask_grad
    )
