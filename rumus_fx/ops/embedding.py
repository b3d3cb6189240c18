"""Embedding lookup: only the weight gets a gradient (scatter-add of rows)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..autograd import sharding as shd
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
    weight_sharding: Any = None  # the table's explicit sharding (autograd/sharding.py)

    def backward(self, g, needs):
        flat_g = shd.reshape(g, (self.total_lookups, self.embed_dim))
        flat_i = shd.reshape(self.indices, (-1,))
        # explicitly sharded: the gradient has the table's own sharding (the kernel
        # per shard of the lookups where that gives it, see kernels.embedding.embedding_bwd)
        return (None, kemb.embedding_bwd(flat_i, flat_g, self.vocab_size, self.dtype, self.weight_sharding))


def _lookup(wv: Array, iv: Array) -> Array:
    """``wv[iv]``; with explicit shardings the rows come out sharded like the
    indices (and like the table along D). A table sharded along the vocabulary
    is gathered first (FSDP style: its gradient is reduce-scattered back)."""
    ws, is_ = shd.spec_of(wv), shd.spec_of(iv)
    if ws is None and is_ is None:
        return jnp.take(wv, iv, axis=0)
    like = shd.sharding_of(wv) or shd.sharding_of(iv)
    if ws is not None and ws[0] is not None:
        wv = jax.sharding.reshard(wv, shd.with_spec(like, (None, ws[1])))
    out_spec = (*(is_ or (None,) * iv.ndim), ws[1] if ws is not None else None)
    return wv.at[iv].get(out_sharding=shd.with_spec(like, out_spec))


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
    rows = _lookup(wv, jnp.clip(iv, 0, v - 1))
    out = jnp.where(valid[..., None], rows, np.nan)
    tape = tape_for(indices, weight)
    if tape is None:
        return Tensor._wrap(out)
    safe = jnp.where(valid, iv, v)  # out-of-range lookups scatter nowhere
    rec = EmbeddingBackward(safe, snapshot(indices), v, d, iv.size, wv.dtype, shd.sharding_of(wv))
    return record(tape, rec, (indices, weight), new_output(out, tape))
