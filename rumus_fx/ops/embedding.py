"""Embedding lookup: only the weight gets a gradient (scatter-add of rows)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import sharding as shd
from ..autograd.record import Record, VersionSnapshot
from ..errors import ShapeError
from ..kernels import embedding as kemb
from ..tensor import Tensor
from ._core import array_of, check_index_range, eager_jit, new_output, record, require_float, snapshot, tape_for
from ._declare import BadInput, Sample, array, indices, integers, normal, op, tracked

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
    weight_sharding: Any = None  # the table's explicit sharding (rumus_fx/sharding.py)

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


@eager_jit
def _embed(iv: Array, wv: Array) -> tuple[Array, Array]:
    """(the looked-up rows, NaN where an index is out of range; the indices
    with those replaced by V, so that their lookups scatter nowhere)."""
    v = wv.shape[0]
    valid = (iv >= 0) & (iv < v)
    rows = _lookup(wv, jnp.clip(iv, 0, v - 1))
    return jnp.where(valid[..., None], rows, np.nan), jnp.where(valid, iv, v)


@op(
    records=(EmbeddingBackward,),
    ref=lambda idx, w: jnp.take(w, idx, axis=0),
    samples=lambda r: [
        Sample((r.integers(0, 7, (5,)), normal(r, 7, 3)), diff=(1,)),
        Sample((r.integers(0, 5, (2, 6)), normal(r, 5, 4)), diff=(1,)),
        Sample((np.array([[1, 1], [1, 3]]), normal(r, 4, 3)), diff=(1,)),  # repeated rows accumulate
    ],
    errors=lambda: [
        BadInput("float indices", (array(np.zeros(3), jnp.float32), tracked(7, 3)), TypeError, ("float32",)),
        BadInput("index == V", (array([0, 7]), tracked(7, 3)), IndexError, ("7",)),
        BadInput("negative index", (array([[0, -1]]), tracked(7, 3)), IndexError, ("-1",)),
        BadInput("rank-1 weight", (indices(3), tracked(7)), ShapeError),
        BadInput("integer weight", (indices(3), integers(7, 3)), TypeError),
    ],
)
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
    out, safe = _embed(iv, wv)
    tape = tape_for(indices, weight)
    if tape is None:
        return Tensor._wrap(out)
    rec = EmbeddingBackward(safe, snapshot(indices), v, d, iv.size, wv.dtype, shd.sharding_of(wv))
    return record(tape, rec, (indices, weight), new_output(out, tape))
