"""Embedding lookup: only the weight gets a gradient (scatter-add of rows)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..autograd.errors import ShapeError
from ..autograd.record import Record, VersionSnapshot
from ..kernels import embedding as kemb
from ..tensor import Tensor
from ._core import array_of, check_index_range, new_output, record, require_float, snapshot, tape_for

Array = jax.Array
frozen = dataclasses.dataclass(frozen=True, eq=False)


@frozen
class EmbeddingBackward(Record):
    """``y = weight[indices]``: ``dweight[i] += dy[lookup]`` for every lookup of
    row ``i`` (scatter-add / segment sum). Saves the indices (snapshotted when
    they live in a tensor's storage), never the weight."""

    indices: Array
    indices_version: VersionSnapshot | None
    vocab_size: int
    embed_dim: int
    total_lookups: int
    dtype: Any

    def backward(self, g, needs):
        flat_g = g.reshape(self.total_lookups, self.embed_dim)
        dw = kemb.embedding_bwd(self.indices.reshape(-1), flat_g, self.vocab_size, self.dtype)
        return (None, dw)


def embedding(indices: Any, weight: Any) -> Tensor:
    """Rows of ``weight:[V, D]`` picked by integer ``indices`` of any shape ->
    ``indices.shape + [D]``. Concrete out-of-range indices raise IndexError;
    traced ones give NaN rows and no gradient (records EmbeddingBackward)."""
    op = "embedding"
    iv = array_of(indices, op, "indices")
    wv = array_of(weight, op, "weight")
    if not jnp.issubdtype(iv.dtype, jnp.integer):
        raise TypeError(f"{op}: indices must have an integer dtype, got {iv.dtype}")
    require_float(op, wv, "weight")
    if wv.ndim != 2:
        raise ShapeError(f"{op}: weight must have shape [V, D], got {wv.shape}")
    v, d = wv.shape
    check_index_range(op, iv, v, "index")
    valid = (iv >= 0) & (iv < v)
    rows = jnp.take(wv, jnp.clip(iv, 0, v - 1), axis=0)
    out = jnp.where(valid[..., None], rows, np.nan)
    tape = tape_for(indices, weight)
    if tape is None:
        return Tensor._wrap(out)
    safe = jnp.where(valid, iv, v)  # out-of-range lookups scatter nowhere
    rec = EmbeddingBackward(safe, snapshot(indices), v, d, iv.size, wv.dtype)
    return record(tape, rec, (indices, weight), new_output(out, tape))
