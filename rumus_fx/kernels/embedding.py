"""Embedding backward: scatter-add (segment sum) of row gradients into the
table, as a Pallas kernel with ``custom_jvp`` glue, and the jax.numpy reference.

Portable scatter-add without atomics: the host sorts the lookups by index (and
gathers their gradient rows in that order), so the lookups that fall in one
``bv x bd`` tile of the table are a contiguous run of chunks of ``bn`` sorted
lookups; a tile's gradient is ``onehot(indices)^T @ g`` summed over its chunks.
The matrix-unit work is about ``(lookups + vocab) * bv * D`` rather than
``lookups * vocab * D``, and no program holds more than one chunk:

* GPU: one program per tile loops over exactly its chunks (their range, from a
  host-side ``searchsorted``, read as two scalars); the lookups stay in global
  memory and each iteration loads one chunk.
* TPU: the grid walks a host-built schedule of (tile, chunk) steps, at most
  ``tiles + chunks`` of them, in order ("arbitrary" semantics): the index maps
  read the schedule from scalar memory, so each step copies one chunk into
  VMEM, and the tile's output block accumulates over its consecutive steps.

Indices equal to ``vocab_size`` ("drop") sort last and match no row.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import blocks
from ._pallas import Config, dot, ds, iota, pad_to, pallas_call
from ._sharding import carries, sharded_call
from .dispatch import call
from .precision import upcast

# ---------------------------------------------------------------- kernel


def _embedding_bwd_gpu_kernel(bounds_ref, idx_ref, g_ref, dw_ref, *, bn: int, n_chunks: int):
    # Inputs: bounds_ref [1, 2] int32: the chunks [lo, hi) of sorted lookups that can hit this tile,
    #         idx_ref [n_pad, 1] int32 sorted lookups, g_ref [n_pad, bd] their gradient rows
    #         (whole arrays in global memory: each step loads one chunk)
    # Outputs: dw_ref [bv, bd] one tile of the table gradient
    bv = dw_ref.shape[0]
    v0 = pl.program_id(0) * bv

    def add(c, acc):
        idx = idx_ref[ds(c, bn), :]
        onehot = (idx == iota((bn, bv), 1, v0)).astype(g_ref.dtype)
        return acc + dot(onehot, g_ref[ds(c, bn), :], (0, 0))

    acc = jnp.zeros(dw_ref.shape, jnp.float32)
    if n_chunks == 1:
        acc = add(0, acc)
    else:
        acc = lax.fori_loop(bounds_ref[0, 0], bounds_ref[0, 1], add, acc)
    dw_ref[...] = acc.astype(dw_ref.dtype)


def _embedding_bwd_tpu_kernel(tile_ref, chunk_ref, valid_ref, idx_ref, g_ref, dw_ref):
    # Scalar prefetch: tile_ref, chunk_ref, valid_ref [steps] int32, the schedule (step p adds
    #         chunk chunk_ref[p] to tile tile_ref[p] when valid_ref[p]; a tile's steps are consecutive)
    # Inputs: idx_ref [bn, 1] int32 one chunk of sorted lookups, g_ref [bn, bd] their gradient rows
    # Outputs: dw_ref [bv, bd] float32, the tile being accumulated
    del chunk_ref
    bn, bv = idx_ref.shape[0], dw_ref.shape[0]
    p = pl.program_id(1)
    tile = tile_ref[p]

    @pl.when((p == 0) | (tile_ref[jnp.maximum(p - 1, 0)] != tile))
    def _():
        dw_ref[...] = jnp.zeros(dw_ref.shape, dw_ref.dtype)

    @pl.when(valid_ref[p] != 0)
    def _():
        onehot = (idx_ref[...] == iota((bn, bv), 1, tile * bv)).astype(g_ref.dtype)
        dw_ref[...] += dot(onehot, g_ref[...], (0, 0))


def _tpu_schedule(lo: jax.Array, hi: jax.Array, n_chunks: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(tile, chunk, valid) per step: tile ``t`` takes ``max(hi[t] - lo[t], 1)``
    consecutive steps (one to zero a tile no lookup hits). Chunk ranges of
    neighbouring tiles share at most one chunk, so ``tiles + chunks`` steps
    always suffice; the spare steps repeat the last one, invalid."""
    n_tiles = lo.shape[0]
    count = jnp.maximum(hi - lo, 1)
    end = jnp.cumsum(count)
    steps = jnp.arange(n_tiles + n_chunks, dtype=jnp.int32)
    tile = jnp.minimum(jnp.searchsorted(end, steps, side="right"), n_tiles - 1).astype(jnp.int32)
    k = steps - (end - count)[tile]
    valid = (steps < end[-1]) & (k < hi[tile] - lo[tile])
    # spare and empty steps keep the block of the previous step (no extra copy)
    chunk = jnp.clip(lo[tile] + jnp.minimum(k, jnp.maximum(hi[tile] - lo[tile] - 1, 0)), 0, n_chunks - 1)
    return tile, chunk.astype(jnp.int32), valid.astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=0)
def _embedding_bwd_local(key: tuple, indices: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    cfg, vocab, dtype = key
    n, d = g.shape
    b = blocks.embedding_blocks(n, vocab, d, cfg.target)
    indices = indices.astype(jnp.int32)
    order = jnp.argsort(indices, stable=True)
    sorted_idx = indices[order]
    idx = pad_to(sorted_idx.reshape(n, 1), (b.n_pad, 1), vocab)
    gs = pad_to(g[order], (b.n_pad, b.d_pad))
    # chunks of sorted lookups that can fall in each vocabulary tile: [lo, hi)
    starts = jnp.arange(b.v_pad // b.bv, dtype=jnp.int32) * b.bv
    lo = (jnp.searchsorted(sorted_idx, starts, side="left") // b.bn).astype(jnp.int32)
    hi = ((jnp.searchsorted(sorted_idx, starts + b.bv, side="left") + b.bn - 1) // b.bn).astype(jnp.int32)
    out_shape = jax.ShapeDtypeStruct((b.v_pad, b.d_pad), jnp.float32)
    if cfg.target == blocks.GPU:
        bounds = jnp.stack([lo, hi], axis=-1).reshape(-1, 1, 2)
        dw = pallas_call(
            functools.partial(_embedding_bwd_gpu_kernel, bn=b.bn, n_chunks=b.n_chunks),
            cfg,
            name="embedding_bwd",
            grid=(b.v_pad // b.bv, b.d_pad // b.bd),
            in_specs=[
                pl.BlockSpec((pl.squeezed, 1, 2), lambda i, j: (i, 0, 0)),
                pl.BlockSpec((b.n_pad, 1), lambda i, j: (0, 0)),
                pl.BlockSpec((b.n_pad, b.bd), lambda i, j: (0, j)),
            ],
            out_specs=pl.BlockSpec((b.bv, b.bd), lambda i, j: (i, j)),
            out_shape=out_shape,
            num_warps=b.num_warps,
        )(bounds, idx, gs)
    else:
        tile, chunk, valid = _tpu_schedule(lo, hi, b.n_chunks)
        dw = pallas_call(
            _embedding_bwd_tpu_kernel,
            cfg,
            name="embedding_bwd",
            grid=(b.d_pad // b.bd, tile.shape[0]),
            in_specs=[
                pl.BlockSpec((b.bn, 1), lambda j, p, tile, chunk, valid: (chunk[p], 0)),
                pl.BlockSpec((b.bn, b.bd), lambda j, p, tile, chunk, valid: (chunk[p], j)),
            ],
            out_specs=pl.BlockSpec((b.bv, b.bd), lambda j, p, tile, chunk, valid: (tile[p], j)),
            out_shape=out_shape,
            semantics=("parallel", "arbitrary"),
            num_scalar_prefetch=3,
        )(tile, chunk, valid, idx, gs)
    return (dw[:vocab, :d].astype(dtype),)


# ---------------------------------------------------------------- custom_jvp glue


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _embedding_bwd(key: tuple, indices: jax.Array, g: jax.Array) -> jax.Array:
    # lookups sharded across devices: each shard scatters its own, then psum
    return sharded_call(_embedding_bwd_local, key, _RULE, indices, g)[0]


_RULE = "n, n d -> v d"


@_embedding_bwd.defjvp
def _embedding_bwd_jvp(key, primals, tangents):
    # the map is linear in g: its tangent is the same scatter-add of dg (jax.numpy)
    (indices, g), (_, dg) = primals, tangents
    out = _embedding_bwd(key, indices, g)
    return out, embedding_bwd_reference(indices, dg, vocab_size=key[1], dtype=key[2])


def embedding_bwd_pallas(
    indices: jax.Array, g: jax.Array, *, vocab_size: int, dtype: Any, cfg: Config, out_sharding: Any = None
) -> jax.Array:
    """The sorted one-hot scatter-add kernel (see the module docstring); run per
    shard it gives ``out_sharding`` by itself (``embedding_bwd`` checks that)."""
    return _embedding_bwd((cfg, int(vocab_size), jnp.dtype(dtype)), indices, g)


# ---------------------------------------------------------------- reference


def embedding_bwd_reference(
    indices: jax.Array, g: jax.Array, *, vocab_size: int, dtype: Any, out_sharding: Any = None
) -> jax.Array:
    """``indices:[N]`` ints, ``g:[N, D]`` -> ``dW:[vocab_size, D]``; out-of-range
    indices contribute nothing. ``out_sharding``: the table's explicit sharding."""
    dw = jax.ops.segment_sum(upcast(g), indices, num_segments=vocab_size, out_sharding=out_sharding)
    return dw.astype(dtype)


# ---------------------------------------------------------------- entry point


def embedding_bwd(
    indices: jax.Array, g: jax.Array, vocab_size: int, dtype: Any = None, out_sharding: Any = None
) -> jax.Array:
    """Scatter-add of the rows of ``g`` into a ``[vocab_size, D]`` table gradient.

    ``out_sharding``: the table's sharding, for lookups sharded over Explicit
    mesh axes. The kernel runs per shard of the lookups and sums the shards'
    tables (an all-reduce), so its result is whole along the vocabulary and
    sharded like ``g`` along D: where that is the table's sharding (a replicated
    table, or one sharded along D) the kernel runs. A table sharded along the
    vocabulary (FSDP, a vocabulary-parallel head's tied table) takes XLA's
    scatter-add (``segment_sum``) with ``out_sharding`` instead: XLA
    reduce-scatters the contributions into the vocabulary shards, where the
    kernel would all-reduce the whole table and then drop all but a slice."""
    dtype = dtype or g.dtype
    static = dict(vocab_size=vocab_size, dtype=dtype, out_sharding=out_sharding)
    if out_sharding is not None and not carries(_RULE, (out_sharding,), indices, g):
        return embedding_bwd_reference(indices, g, **static)
    return call(embedding_bwd_reference, embedding_bwd_pallas, indices, g, **static)
