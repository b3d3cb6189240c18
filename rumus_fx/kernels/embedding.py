"""Embedding backward: scatter-add (segment sum) of row gradients into the table."""

from __future__ import annotations

from typing import Any

import jax

from ._util import upcast
from .dispatch import call


def embedding_bwd_reference(indices: jax.Array, g: jax.Array, *, vocab_size: int, dtype: Any) -> jax.Array:
    """``indices:[N]`` ints, ``g:[N, D]`` -> ``dW:[vocab_size, D]``; out-of-range
    indices contribute nothing."""
    dw = jax.ops.segment_sum(upcast(g), indices, num_segments=vocab_size)
    return dw.astype(dtype)


def embedding_bwd(indices: jax.Array, g: jax.Array, vocab_size: int, dtype: Any = None) -> jax.Array:
    return call(embedding_bwd_reference, None, indices, g, vocab_size=vocab_size, dtype=dtype or g.dtype)
