"""Cross-entropy with integer targets, fused: one pass gives the mean loss and
its gradient with respect to the logits (as rumus does)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._util import upcast
from .dispatch import call


def cross_entropy_reference(logits: jax.Array, targets: jax.Array, *, ignore_index: int | None):
    """``logits:[N, C]``, ``targets:[N]`` -> (mean loss over kept rows, dloss/dlogits)."""
    lf = upcast(logits)
    n, c = lf.shape
    m = jnp.max(lf, axis=-1, keepdims=True)
    shifted = lf - m
    sumexp = jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True)
    log_z = jnp.log(sumexp)
    if ignore_index is None:
        valid = jnp.ones((n,), bool)
        safe_t = targets
    else:
        valid = targets != ignore_index
        safe_t = jnp.where(valid, targets, 0)
    onehot = safe_t[:, None] == jnp.arange(c, dtype=safe_t.dtype)[None, :]
    picked = jnp.sum(jnp.where(onehot, shifted, 0), axis=-1)
    count = jnp.sum(valid).astype(lf.dtype)
    losses = jnp.where(valid, log_z[:, 0] - picked, 0)
    loss = jnp.sum(losses) / count
    probs = jnp.exp(shifted - log_z)
    weight = jnp.where(valid, 1.0 / count, 0.0).astype(lf.dtype)[:, None]
    grad = (probs - onehot.astype(lf.dtype)) * weight
    return loss.astype(logits.dtype), grad.astype(logits.dtype)


def cross_entropy_fwd(logits: jax.Array, targets: jax.Array, ignore_index: int | None = None):
    """``(loss, grad)`` for 2-D logits and 1-D integer targets."""
    return call(cross_entropy_reference, None, logits, targets, ignore_index=ignore_index)
