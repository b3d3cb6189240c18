"""Embedding backward: scatter-add (segment sum) of row gradients into the
table, as a Pallas kernel with ``custom_jvp`` glue, and the jax.numpy reference.

Portable scatter-add without atomics: the host sorts the lookups by index (and
gathers their gradient rows in that order); each program owns a ``bv x bd``
tile of the table and adds ``onehot(indices)^T @ g`` for the chunks of sorted
lookups that can fall in its rows: on GPU exactly those chunks (their range,
found by a host-side ``searchsorted``, is read as two scalars), on TPU a static
loop that skips the others after a min/max test (TPU kernels read no scalars
from vector memory). The matrix-unit work is about
``(lookups + vocab) * bv * D`` rather than ``lookups * vocab * D``. Indices equal
to ``vocab_size`` ("drop") sort last and match no row.
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
from ._sharding import sharded_call
from ._util import upcast
from .dispatch import call

# ---------------------------------------------------------------- kernel


def _embedding_bwd_kernel(bounds_ref, idx_ref, g_ref, dw_ref, *, bn: int, n_chunks: int, ranged: bool):
    # Inputs: bounds_ref [1, 2] int32: the chunks [lo, hi) of sorted lookups that can hit this tile,
    #         idx_ref [n_pad, 1] int32 sorted lookups, g_ref [n_pad, bd] their gradient rows
    # Outputs: dw_ref [bv, bd] one tile of the table gradient
    bv = dw_ref.shape[0]
    v0 = pl.program_id(0) * bv

    def add(c, acc):
        idx = idx_ref[ds(c, bn), :]
        onehot = (idx == iota((bn, bv), 1, v0)).astype(g_ref.dtype)
        return acc + dot(onehot, g_ref[ds(c, bn), :], (0, 0))

    def maybe_add(c, acc):
        idx = idx_ref[ds(c, bn), :]
        hit = (jnp.max(idx) >= v0) & (jnp.min(idx) < v0 + bv)
        return lax.cond(hit, lambda a: add(c, a), lambda a: a, acc)

    acc = jnp.zeros(dw_ref.shape, jnp.float32)
    if n_chunks == 1:
        acc = add(0, acc)
    elif ranged:  # GPU: visit only this tile's chunks (bounds read as scalars)
        acc = lax.fori_loop(bounds_ref[0, 0], bounds_ref[0, 1], add, acc)
    else:  # TPU: a static loop that skips the chunks missing this tile
        acc = lax.fori_loop(0, n_chunks, maybe_add, acc)
    dw_ref[...] = acc.astype(dw_ref.dtype)


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
    # chunks of sorted lookups that can fall in each vocabulary tile
    starts = jnp.arange(b.v_pad // b.bv, dtype=jnp.int32) * b.bv
    lo = jnp.searchsorted(sorted_idx, starts, side="left") // b.bn
    hi = (jnp.searchsorted(sorted_idx, starts + b.bv, side="left") + b.bn - 1) // b.bn
    bounds = jnp.stack([lo, hi], axis=-1).astype(jnp.int32).reshape(-1, 1, 2)
    kernel = functools.partial(_embedding_bwd_kernel, bn=b.bn, n_chunks=b.n_chunks, ranged=cfg.target == blocks.GPU)
    dw = pallas_call(
        kernel,
        cfg,
        name="embedding_bwd",
        grid=(b.v_pad // b.bv, b.d_pad // b.bd),
        in_specs=[
            pl.BlockSpec((pl.squeezed, 1, 2), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((b.n_pad, 1), lambda i, j: (0, 0)),
            pl.BlockSpec((b.n_pad, b.bd), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((b.bv, b.bd), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((b.v_pad, b.d_pad), jnp.float32),
        num_warps=b.num_warps,
    )(bounds, idx, gs)
    return (dw[:vocab, :d].astype(dtype),)


# ---------------------------------------------------------------- custom_jvp glue


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _embedding_bwd(key: tuple, indices: jax.Array, g: jax.Array) -> jax.Array:
    # lookups sharded across devices: each shard scatters its own, then psum
    return sharded_call(_embedding_bwd_local, key, "n, n d -> v d", indices, g)[0]


@_embedding_bwd.defjvp
def _embedding_bwd_jvp(key, primals, tangents):
    # the map is linear in g: its tangent is the same scatter-add of dg (jax.numpy)
    (indices, g), (_, dg) = primals, tangents
    out = _embedding_bwd(key, indices, g)
    return out, embedding_bwd_reference(indices, dg, vocab_size=key[1], dtype=key[2])


def embedding_bwd_pallas(indices: jax.Array, g: jax.Array, *, vocab_size: int, dtype: Any, cfg: Config) -> jax.Array:
    """The sorted one-hot scatter-add kernel (see the module docstring)."""
    return _embedding_bwd((cfg, int(vocab_size), jnp.dtype(dtype)), indices, g)


# ---------------------------------------------------------------- reference


def embedding_bwd_reference(indices: jax.Array, g: jax.Array, *, vocab_size: int, dtype: Any) -> jax.Array:
    """``indices:[N]`` ints, ``g:[N, D]`` -> ``dW:[vocab_size, D]``; out-of-range
    indices contribute nothing."""
    dw = jax.ops.segment_sum(upcast(g), indices, num_segments=vocab_size)
    return dw.astype(dtype)


# ---------------------------------------------------------------- entry point


def embedding_bwd(indices: jax.Array, g: jax.Array, vocab_size: int, dtype: Any = None) -> jax.Array:
    """Scatter-add of the rows of ``g`` into a ``[vocab_size, D]`` table gradient."""
    return call(
        embedding_bwd_reference, embedding_bwd_pallas, indices, g, vocab_size=vocab_size, dtype=dtype or g.dtype
    )
