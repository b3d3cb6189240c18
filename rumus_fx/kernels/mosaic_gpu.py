"""Mosaic GPU variants of the memory-bound kernels: softmax, layer norm,
cross-entropy and batch norm, forward and backward, in ``plgpu.kernel`` style
(the replacement for Pallas' Triton backend, which jax deprecates from 0.11).
matmul, attention and the embedding gradient keep Triton until a device can
measure a Mosaic GPU version.

NOTHING HERE HAS RUN ON A GPU. What is checked on a CPU host
(``tests/kernels/test_mosaic_gpu.py``):

* LOWERING ONLY: every kernel lowers for ``cuda`` with Mosaic GPU at the
  public shapes: jax's Mosaic GPU lowering accepts its layouts, transfers,
  barriers and shared-memory budget. Nothing is compiled to SASS or run, so
  the kernels' numerics on a device are unchecked until
  ``benchmarks/gpu_check.py`` (rows ``kernel[mgpu]``) runs on one;
* numerics of the block algorithm: each kernel is a :class:`RowAlgo`, pure
  functions of chunk tiles and row vectors; the kernel applies them to
  register tiles, and the emulation (:func:`emulate_rows`) applies the very
  same functions to the same padded blocks and chunks with jax.numpy. Its
  agreement with the references checks the padding, the masking of padded
  columns and the merges across chunks. The copies, barriers and register
  layouts are not in the emulation (jax 0.10's Mosaic GPU interpreter has no
  rule for ``plgpu.load`` or tiled/swizzled shared memory).

One kernel shape serves all (:func:`_row_kernel`): a program (one 128-thread
warpgroup) owns ``BLOCK_ROWS = 64`` rows of ``[rows, cols]`` operands; pass 1
copies each column chunk of every operand to shared memory and folds it into
per-row statistics, pass 2 copies the chunks again and writes the output
chunks; per-row outputs (a row's mean, rstd or loss) are copied out last.
Batch norm reads ``x[N, C, H, W]`` as rows ``[N*C, H*W]`` (a free reshape):
a moments kernel, XLA merging the N rows of each channel (``[N, C]`` values),
and an apply kernel (the backward likewise: gradient sums, then dx). The
layer norm backward's dw and db (column sums across programs) are left to XLA.

Block choices and the Mosaic GPU rules they obey (:func:`check_rules`):

* ``BLOCK_ROWS = 64``: the WGMMA register layout's row tile, in which row
  reductions are supported; ``CHUNK = 128`` columns per copy (async copies
  move at most 256 elements per dimension);
* rows are padded to 64 and columns to 128 on the host, so every copy is a
  whole tile and every stride is a multiple of 16 bytes;
* shared memory: one ``64 x 128`` buffer per tile operand and output (32 KiB
  in float32; three for the layer norm backward), under the 227 KiB limit at
  any row length; a whole-row block would need ``64 x cols x 4`` bytes, over
  227 KiB beyond ~900 float32 columns, which is why rows are walked in chunks;
* tiles are tiled ``(8, 128 // itemsize)`` and 128-byte swizzled in shared
  memory (bank-conflict-free WGMMA-layout loads and stores); each operand has
  its own barrier.

Selection (``dispatch.py``): the cuda branch keeps the Triton kernel while
this jax has Pallas' Triton backend (those kernels have lowering *and*
interpret-mode numeric checks); where it does not, or with
``RUMUS_FX_GPU_KERNELS=mosaic``, the Mosaic GPU variant is used where it
follows the rules and lowers at the call's shapes (:func:`why_not`, cached),
else the reference with one warning (``pallas`` mode: an error). Mosaic GPU
is NVIDIA-only: a rocm lowering of that branch gets the emulation.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from . import _norm_jvp
from ._pallas import pad_to, unpad
from ._platform import native_or_interpret
from .precision import upcast

BLOCK_ROWS = 64  # WGMMA layout row tile
CHUNK = 128  # columns per async copy (<= 256 per dimension)
SMEM_LIMIT = 227 * 1024  # bytes of shared memory per block on sm_90
WARPGROUP = 128
NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite -inf for padded columns


def preferred() -> bool:
    """``RUMUS_FX_GPU_KERNELS=mosaic``: Mosaic GPU first where it lowers."""
    return os.environ.get("RUMUS_FX_GPU_KERNELS", "triton") == "mosaic"


def smem_bytes(dtype: Any, buffers: int = 2) -> int:
    return buffers * BLOCK_ROWS * CHUNK * jnp.dtype(dtype).itemsize


def check_rules(dtype: Any, buffers: int = 2) -> str | None:
    """Why these blocks would break a Mosaic GPU rule for ``dtype``, or None."""
    itemsize = jnp.dtype(dtype).itemsize
    if CHUNK > 256 or BLOCK_ROWS > 256:
        return f"blocks of {BLOCK_ROWS}x{CHUNK} exceed 256 elements per dimension of an async copy"
    if (CHUNK * itemsize) % 16:
        return f"a {CHUNK}-element {jnp.dtype(dtype).name} row is not a multiple of 16 bytes"
    if smem_bytes(dtype, buffers) > SMEM_LIMIT:
        return f"{smem_bytes(dtype, buffers)} bytes of shared memory exceed {SMEM_LIMIT}"
    if (BLOCK_ROWS * CHUNK) % WARPGROUP:
        return "a chunk does not divide over the 128-thread warpgroup"
    return None


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# ---------------------------------------------------------------- block steps
# A row algorithm is pure functions of float32 chunks ([BLOCK_ROWS, CHUNK]
# tiles: the row operands' chunks, then each per-column parameter broadcast
# over the rows), int32 column positions of the chunk, and a carry of
# [BLOCK_ROWS] row vectors: the kernel applies them to register tiles, the
# emulation to jax.numpy arrays.


@dataclasses.dataclass(frozen=True)
class RowAlgo:
    """``carry = init(*row inputs)``; ``carry = stats(carry, chunks, cols)``
    over the chunks; ``write(carry, chunks, cols)`` -> the tile outputs of a
    chunk; ``rows_out(carry)`` -> the per-row outputs (float32)."""

    init: Callable[..., tuple]
    stats: Callable[[tuple, list, jax.Array], tuple]
    write: Callable[[tuple, list, jax.Array], tuple]
    rows_out: Callable[[tuple], tuple] = lambda carry: ()
    n_rows_out: int = 0


def _col(v: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return lax.broadcast_in_dim(v, shape, [0])


def _zeros_like_row(v: jax.Array) -> jax.Array:
    return v * 0.0


def softmax_algo() -> RowAlgo:
    """Padded columns hold NEG, so they need no mask: exp(NEG - m) is 0."""

    def init():
        return (jnp.full((BLOCK_ROWS,), NEG, jnp.float32), jnp.zeros((BLOCK_ROWS,), jnp.float32))

    def stats(carry, chunks, cols):
        (m, s), (x,) = carry, chunks
        m_new = jnp.maximum(m, x.max(axis=1))
        return m_new, s * jnp.exp(m - m_new) + jnp.exp(x - _col(m_new, x.shape)).sum(axis=1)

    def write(carry, chunks, cols):
        (m, s), (x,) = carry, chunks
        return (jnp.exp(x - _col(m, x.shape)) / _col(s, x.shape),)

    return RowAlgo(init, stats, write)


def softmax_bwd_algo() -> RowAlgo:
    """Padded y and g are zero, so they add nothing to sum(y * g)."""

    def init():
        return (jnp.zeros((BLOCK_ROWS,), jnp.float32),)

    def stats(carry, chunks, cols):
        y, g = chunks
        return (carry[0] + (y * g).sum(axis=1),)

    def write(carry, chunks, cols):
        y, g = chunks
        return (y * (g - _col(carry[0], y.shape)),)

    return RowAlgo(init, stats, write)


def layer_norm_algo(n_cols: int, eps: float) -> RowAlgo:
    """Mean and variance in one pass (Chan et al.'s merge of per-chunk counts,
    means and centred sums of squares over the valid columns), then
    ``y = (x - mean) * rstd * w + b``. Chunks: x, w, b."""

    def init():
        z = jnp.zeros((BLOCK_ROWS,), jnp.float32)
        return z, z, z

    def stats(carry, chunks, cols):
        n, mean, m2 = carry
        x = chunks[0]
        valid = cols < n_cols
        count = jnp.where(valid, 1.0, 0.0).sum(axis=1)
        safe = jnp.maximum(count, 1.0)
        chunk_mean = jnp.where(valid, x, 0.0).sum(axis=1) / safe
        xc = x - _col(chunk_mean, x.shape)
        centred_sq = jnp.where(valid, xc * xc, 0.0).sum(axis=1)
        n_new = n + count
        delta = chunk_mean - mean
        ratio = count / jnp.maximum(n_new, 1.0)
        return n_new, mean + delta * ratio, m2 + centred_sq + delta * delta * n * ratio

    def rstd_of(m2):
        return lax.rsqrt(m2 / float(n_cols) + eps)

    def write(carry, chunks, cols):
        _, mean, m2 = carry
        x, w, b = chunks
        return ((x - _col(mean, x.shape)) * _col(rstd_of(m2), x.shape) * w + b,)

    def rows_out(carry):
        _, mean, m2 = carry
        return mean, rstd_of(m2)

    return RowAlgo(init, stats, write, rows_out, 2)


def layer_norm_bwd_algo(n_cols: int) -> RowAlgo:
    """``dx = rstd * (w g - mean(w g) - xhat * mean(w g xhat))``; padded g is
    zero, so padded columns add nothing. Chunks: x, g, w; row inputs: mean, rstd."""

    def init(mean, rstd):
        z = _zeros_like_row(mean)
        return mean, rstd, z, z

    def parts(carry, chunks):
        mean, rstd = carry[0], carry[1]
        x, g, w = chunks
        xhat = (x - _col(mean, x.shape)) * _col(rstd, x.shape)
        return xhat, g * w

    def stats(carry, chunks, cols):
        xhat, wg = parts(carry, chunks)
        mean, rstd, s1, s2 = carry
        return mean, rstd, s1 + wg.sum(axis=1), s2 + (wg * xhat).sum(axis=1)

    def write(carry, chunks, cols):
        xhat, wg = parts(carry, chunks)
        _, rstd, s1, s2 = carry
        shape = xhat.shape
        c1, c2 = _col(s1 / float(n_cols), shape), _col(s2 / float(n_cols), shape)
        return (_col(rstd, shape) * (wg - c1 - xhat * c2),)

    return RowAlgo(init, stats, write)


# ---------------------------------------------------------------- emulation


def _emulate(
    algo: RowAlgo,
    tiles: tuple[jax.Array, ...],
    params: tuple[jax.Array, ...],
    rows_in: tuple[jax.Array, ...],
    out_dtypes: tuple[Any, ...],
) -> tuple[jax.Array, ...]:
    """The kernel's walk with jax.numpy on padded operands: per block of
    ``BLOCK_ROWS`` rows (the blocks vmapped, as the programs of the grid), the
    stats pass over the chunks, then the write pass."""
    rows_pad, cols_pad = tiles[0].shape
    n_chunks, n_blocks = cols_pad // CHUNK, rows_pad // BLOCK_ROWS
    shape = (BLOCK_ROWS, CHUNK)

    def program(block_tiles, block_rows):
        def chunks(c: int) -> list[jax.Array]:
            cs = slice(c * CHUNK, (c + 1) * CHUNK)
            got = [upcast(t[:, cs]) for t in block_tiles]
            return got + [jnp.broadcast_to(upcast(p[cs])[None, :], shape) for p in params]

        def cols(c: int) -> jax.Array:
            return lax.broadcasted_iota(jnp.int32, shape, 1) + c * CHUNK

        carry = algo.init(*(upcast(v) for v in block_rows))
        for c in range(n_chunks):
            carry = algo.stats(carry, chunks(c), cols(c))
        pieces: list[list[jax.Array]] = [[] for _ in out_dtypes]
        for c in range(n_chunks if out_dtypes else 0):
            for i, o in enumerate(algo.write(carry, chunks(c), cols(c))):
                pieces[i].append(o.astype(out_dtypes[i]))
        outs = tuple(jnp.concatenate(p, axis=1) for p in pieces)
        return outs + tuple(algo.rows_out(carry))

    blocked_tiles = tuple(t.reshape(n_blocks, BLOCK_ROWS, cols_pad) for t in tiles)
    blocked_rows = tuple(v.reshape(n_blocks, BLOCK_ROWS) for v in rows_in)
    outs = jax.vmap(program)(blocked_tiles, blocked_rows)
    n_o = len(out_dtypes)
    return tuple(o.reshape(rows_pad, cols_pad) for o in outs[:n_o]) + tuple(o.reshape(rows_pad) for o in outs[n_o:])


# ---------------------------------------------------------------- kernels


def _plgpu() -> Any:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


@functools.cache
def _load_takes_an_index() -> bool:
    """jax 0.10's ``plgpu.load`` takes the index as a second argument; jax 0.11
    deprecates that (the index goes into the ref, ``ref.at[idx]``) and makes it
    optional. Read once from the signature, not the version."""
    idx = inspect.signature(_plgpu().load).parameters.get("idx")
    return idx is not None and idx.default is inspect.Parameter.empty


def _load(ref: Any, layout: Any) -> Any:
    """The whole of a shared-memory ``ref`` in ``layout``, the index passed only
    where ``plgpu.load`` requires it."""
    if _load_takes_an_index():
        return _plgpu().load(ref, (), layout=layout)
    return _plgpu().load(ref, layout=layout)


def _smem(shape: tuple[int, ...], dtype: Any) -> Any:
    plgpu = _plgpu()
    if len(shape) == 1:
        return plgpu.SMEM(shape, dtype)
    swizzle = 128
    transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def _row_kernel(
    algo: RowAlgo,
    tiles: tuple[jax.Array, ...],
    params: tuple[jax.Array, ...],
    rows_in: tuple[jax.Array, ...],
    out_dtypes: tuple[Any, ...],
    name: str,
) -> tuple[jax.Array, ...]:
    """A ``plgpu.kernel`` over padded ``[rows_pad, cols_pad]`` tiles (plus
    ``[cols_pad]`` parameters and ``[rows_pad]`` row inputs): one program
    per ``BLOCK_ROWS`` rows. Pass 1 copies each chunk of every operand to
    shared memory (one barrier per operand) and folds it into the row carry;
    pass 2 copies them again, writes each output chunk to shared memory and
    copies it out; the per-row outputs are copied out last."""
    import jax.experimental.pallas as pl

    plgpu = _plgpu()
    rows_pad, cols_pad = tiles[0].shape
    n_chunks = cols_pad // CHUNK
    n_t, n_p, n_r, n_o, n_ro = len(tiles), len(params), len(rows_in), len(out_dtypes), algo.n_rows_out
    n_in = n_t + n_p + n_r
    wgmma = plgpu.Layout.WGMMA
    row_layout, col_layout = wgmma.reduce(1), wgmma.reduce(0)
    shape = (BLOCK_ROWS, CHUNK)

    def body(*refs):
        gm_in, gm_out = refs[:n_in], refs[n_in : n_in + n_o + n_ro]
        sm = refs[n_in + n_o + n_ro :]
        sm_in, sm_out, sm_rows_out, bar = sm[:n_in], sm[n_in : n_in + n_o], sm[n_in + n_o : -1], sm[-1]
        rows = pl.ds(lax.axis_index("rows") * BLOCK_ROWS, BLOCK_ROWS)

        def copy_in(indices, src):
            plgpu.commit_smem()  # every thread is done with the previous chunk before it is overwritten
            for i in indices:
                plgpu.copy_gmem_to_smem(src(i), sm_in[i], bar.at[i])
            for i in indices:
                plgpu.barrier_wait(bar.at[i])

        row_idx = list(range(n_t + n_p, n_in))
        if row_idx:
            copy_in(row_idx, lambda i: gm_in[i].at[rows])
        row_vals = [_load(sm_in[i], row_layout) for i in row_idx]

        def load(c):
            cols = pl.ds(c * CHUNK, CHUNK)
            copy_in(range(n_t), lambda i: gm_in[i].at[rows, cols])
            if n_p:
                copy_in(range(n_t, n_t + n_p), lambda i: gm_in[i].at[cols])
            got = [_load(sm_in[i], wgmma).astype(jnp.float32) for i in range(n_t)]
            for i in range(n_t, n_t + n_p):
                v = _load(sm_in[i], col_layout).astype(jnp.float32)
                got.append(lax.broadcast_in_dim(v, shape, [1]))
            return got

        def positions(c):
            return plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=wgmma) + c * CHUNK

        carry0 = tuple(plgpu.layout_cast(v, row_layout) for v in algo.init(*row_vals))
        carry = lax.fori_loop(0, n_chunks, lambda c, k: tuple(algo.stats(k, load(c), positions(c))), carry0)

        def write_chunk(c, token):
            outs = algo.write(carry, load(c), positions(c))
            for ref, o in zip(sm_out, outs):
                ref[...] = o.astype(ref.dtype)
            plgpu.commit_smem()
            for ref, g in zip(sm_out, gm_out):
                plgpu.copy_smem_to_gmem(ref, g.at[rows, pl.ds(c * CHUNK, CHUNK)])
            plgpu.wait_smem_to_gmem(0)
            return token

        if n_o:
            lax.fori_loop(0, n_chunks, write_chunk, 0)
        if n_ro:
            for ref, v in zip(sm_rows_out, algo.rows_out(carry)):
                ref[...] = v
            plgpu.commit_smem()
            for ref, g in zip(sm_rows_out, gm_out[n_o:]):
                plgpu.copy_smem_to_gmem(ref, g.at[rows])
            plgpu.wait_smem_to_gmem(0)

    body.__name__ = body.__qualname__ = name  # the name in the lowered module's debug info
    kernel = plgpu.kernel(
        body,
        out_type=tuple(jax.ShapeDtypeStruct((rows_pad, cols_pad), dt) for dt in out_dtypes)
        + tuple(jax.ShapeDtypeStruct((rows_pad,), jnp.float32) for _ in range(n_ro)),
        grid=(rows_pad // BLOCK_ROWS,),
        grid_names=("rows",),
        scratch_types=[
            *[_smem(shape, a.dtype) for a in tiles],
            *[_smem((CHUNK,), a.dtype) for a in params],
            *[_smem((BLOCK_ROWS,), a.dtype) for a in rows_in],
            *[_smem(shape, dt) for dt in out_dtypes],
            *[_smem((BLOCK_ROWS,), jnp.float32) for _ in range(n_ro)],
            plgpu.Barrier(num_arrivals=1, num_barriers=n_in),
        ],
    )
    return tuple(kernel(*tiles, *params, *rows_in))


def _rows_pad(n: int) -> int:
    return _round_up(max(n, 1), BLOCK_ROWS)


def _cols_pad(c: int) -> int:
    return _round_up(max(c, 1), CHUNK)


def run_rows(
    algo: RowAlgo,
    tiles: tuple[jax.Array, ...],
    params: tuple[jax.Array, ...] = (),
    rows_in: tuple[jax.Array, ...] = (),
    *,
    out_dtypes: tuple[Any, ...],
    name: str,
    tile_pad: float = 0.0,
) -> tuple[jax.Array, ...]:
    """Pad ``[n, c]`` tiles (with ``tile_pad``), ``[c]`` parameters and ``[n]``
    row inputs, run the Mosaic GPU kernel when lowered for cuda (the
    emulation on other platforms: dead branches of a multi-platform lowering),
    and cut the padding off."""
    n, c = tiles[0].shape
    rp, cp = _rows_pad(n), _cols_pad(c)
    args = (
        tuple(pad_to(t, (rp, cp), tile_pad) for t in tiles)
        + tuple(pad_to(p, (cp,)) for p in params)
        + tuple(pad_to(v, (rp,)) for v in rows_in)
    )
    n_t, n_p = len(tiles), len(params)

    def split(*a):
        return a[:n_t], a[n_t : n_t + n_p], a[n_t + n_p :]

    avals = tuple(jax.ShapeDtypeStruct((rp, cp), dt) for dt in out_dtypes) + tuple(
        jax.ShapeDtypeStruct((rp,), jnp.float32) for _ in range(algo.n_rows_out)
    )
    outs = native_or_interpret(
        lambda *a: _row_kernel(algo, *split(*a), out_dtypes, name),
        lambda *a: _emulate(algo, *split(*a), out_dtypes),
        ("cuda",),
        avals,
        *args,
    )
    n_o = len(out_dtypes)
    return tuple(unpad(o, (n, c)) for o in outs[:n_o]) + tuple(o[:n] for o in outs[n_o:])


def emulate_rows(
    algo: RowAlgo,
    tiles: tuple[jax.Array, ...],
    params: tuple[jax.Array, ...] = (),
    rows_in: tuple[jax.Array, ...] = (),
    *,
    out_dtypes: tuple[Any, ...],
    tile_pad: float = 0.0,
) -> tuple[jax.Array, ...]:
    """:func:`run_rows`' emulation on any platform (the CPU tests' numerics)."""
    n, c = tiles[0].shape
    rp, cp = _rows_pad(n), _cols_pad(c)
    outs = _emulate(
        algo,
        tuple(pad_to(t, (rp, cp), tile_pad) for t in tiles),
        tuple(pad_to(p, (cp,)) for p in params),
        tuple(pad_to(v, (rp,)) for v in rows_in),
        out_dtypes,
    )
    n_o = len(out_dtypes)
    return tuple(unpad(o, (n, c)) for o in outs[:n_o]) + tuple(o[:n] for o in outs[n_o:])


# ---------------------------------------------------------------- softmax


def _softmax_2d(x: jax.Array) -> jax.Array:
    return run_rows(softmax_algo(), (x,), out_dtypes=(x.dtype,), name="softmax_fwd_mgpu", tile_pad=NEG)[0]


def _softmax_bwd_2d(y: jax.Array, g: jax.Array) -> jax.Array:
    return run_rows(softmax_bwd_algo(), (y, g), out_dtypes=(g.dtype,), name="softmax_bwd_mgpu")[0]


def softmax_emulated(x: jax.Array) -> jax.Array:
    """The Mosaic GPU softmax's block algorithm in jax.numpy (last axis)."""
    x2 = x.reshape(-1, x.shape[-1])
    return emulate_rows(softmax_algo(), (x2,), out_dtypes=(x.dtype,), tile_pad=NEG)[0].reshape(x.shape)


def softmax_bwd_emulated(y: jax.Array, g: jax.Array) -> jax.Array:
    y2, g2 = y.reshape(-1, y.shape[-1]), g.reshape(-1, g.shape[-1])
    return emulate_rows(softmax_bwd_algo(), (y2, g2), out_dtypes=(g.dtype,))[0].reshape(y.shape)


@jax.custom_jvp
def _softmax_last(x: jax.Array) -> jax.Array:
    return _softmax_2d(x.reshape(-1, x.shape[-1])).reshape(x.shape)


@_softmax_last.defjvp
def _softmax_last_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    y = _softmax_last(x)
    yf, dxf = upcast(y), upcast(dx)
    return y, (yf * (dxf - jnp.sum(dxf * yf, axis=-1, keepdims=True))).astype(y.dtype)


@jax.custom_jvp
def _softmax_grad_last(y: jax.Array, g: jax.Array) -> jax.Array:
    return _softmax_bwd_2d(y.reshape(-1, y.shape[-1]), g.reshape(-1, g.shape[-1])).reshape(y.shape)


@_softmax_grad_last.defjvp
def _softmax_grad_last_jvp(primals, tangents):
    (y, g), (dy, dg) = primals, tangents
    dx = _softmax_grad_last(y, g)
    yf, gf, dyf, dgf = map(upcast, (y, g, dy, dg))
    s = jnp.sum(gf * yf, axis=-1, keepdims=True)
    ds_ = jnp.sum(dgf * yf + gf * dyf, axis=-1, keepdims=True)
    return dx, (dyf * (gf - s) + yf * (dgf - ds_)).astype(dx.dtype)


def softmax_mgpu(x: jax.Array, *, axis: int) -> jax.Array:
    """Softmax along ``axis`` with the Mosaic GPU kernel (see the module docstring)."""
    return jnp.moveaxis(_softmax_last(jnp.moveaxis(x, axis, -1)), -1, axis)


def softmax_bwd_mgpu(y: jax.Array, g: jax.Array, *, axis: int) -> jax.Array:
    dx = _softmax_grad_last(jnp.moveaxis(y, axis, -1), jnp.moveaxis(g, axis, -1))
    return jnp.moveaxis(dx, -1, axis)


# ---------------------------------------------------------------- layer norm


def _ln_params(x2: jax.Array, w: jax.Array | None, b: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    c = x2.shape[1]
    w = jnp.ones((c,), x2.dtype) if w is None else w
    b = jnp.zeros((c,), x2.dtype) if b is None else b
    return w, b


def _ln_fwd_2d(x2, w, b, eps, emulate=False):
    n, c = x2.shape
    w, b = _ln_params(x2, w, b)
    algo = layer_norm_algo(c, eps)
    if emulate:
        return emulate_rows(algo, (x2,), (w, b), out_dtypes=(x2.dtype,))
    return run_rows(algo, (x2,), (w, b), out_dtypes=(x2.dtype,), name="layer_norm_fwd_mgpu")


def _ln_bwd_dx_2d(x2, w, mean, rstd, g2, emulate=False):
    n, c = x2.shape
    w = jnp.ones((c,), x2.dtype) if w is None else w
    algo = layer_norm_bwd_algo(c)
    if emulate:
        return emulate_rows(algo, (x2, g2), (w,), (mean, rstd), out_dtypes=(x2.dtype,))[0]
    return run_rows(algo, (x2, g2), (w,), (mean, rstd), out_dtypes=(x2.dtype,), name="layer_norm_bwd_mgpu")[0]


def _last_axis(x: jax.Array) -> dict[str, Any]:
    nd = x.ndim
    return dict(axes=(nd - 1,), stat=lambda v: v[..., None], param=lambda v: v.reshape((1,) * (nd - 1) + v.shape))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _ln_fwd(eps: float, emulate: bool, x, w, b):
    lead, c = x.shape[:-1], x.shape[-1]
    y, mean, rstd = _ln_fwd_2d(x.reshape(-1, c), w, b, eps, emulate)
    return y.reshape(x.shape), mean.reshape(lead), rstd.reshape(lead)


@_ln_fwd.defjvp
def _ln_fwd_jvp(eps, emulate, primals, tangents):
    x, w, b = primals
    dx, dw, db = tangents
    y, mean, rstd = _ln_fwd(eps, emulate, x, w, b)
    dy, dmean, _, drstd = _norm_jvp.forward_tangents(x, w, mean, rstd, dx, dw, db, **_last_axis(x))
    return (y, mean, rstd), (dy.astype(y.dtype), dmean.astype(mean.dtype), drstd.astype(rstd.dtype))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _ln_bwd(emulate: bool, x, w, mean, rstd, g):
    c = x.shape[-1]
    dx = _ln_bwd_dx_2d(x.reshape(-1, c), w, mean.reshape(-1), rstd.reshape(-1), g.reshape(-1, c), emulate)
    # dw and db: column sums over all rows, left to XLA (a cross-program reduction)
    xf, gf = upcast(x), upcast(g)
    xhat = (xf - mean[..., None]) * rstd[..., None]
    lead = tuple(range(x.ndim - 1))
    dw = jnp.sum(gf * xhat, axis=lead)
    return dx.reshape(x.shape), dw, jnp.sum(gf, axis=lead)


@_ln_bwd.defjvp
def _ln_bwd_jvp(emulate, primals, tangents):
    x, w, mean, rstd, g = primals
    out = _ln_bwd(emulate, x, w, mean, rstd, g)
    dims = _last_axis(x)
    t = _norm_jvp.backward_tangents(*primals, *tangents, param_axes=tuple(range(x.ndim - 1)), **dims)
    return out, tuple(ti.astype(o.dtype) for ti, o in zip(t, out))


def layer_norm_fwd_mgpu(x, weight, bias, *, eps: float, emulate: bool = False):
    """Layer norm over the last axis with the Mosaic GPU kernel:
    ``(y, mean, rstd)`` like ``layer_norm.layer_norm_fwd_reference``."""
    if x.ndim == 1:
        y, mean, rstd = _ln_fwd(eps, emulate, x[None], weight, bias)
        return y[0], mean[0], rstd[0]
    return _ln_fwd(eps, emulate, x, weight, bias)


def layer_norm_bwd_mgpu(x, weight, mean, rstd, g, *, has_bias: bool, emulate: bool = False):
    """``(dx, dw, db)``: dx from the Mosaic GPU kernel, dw and db by XLA column sums."""
    if x.ndim == 1:
        dx, dw, db = _ln_bwd(emulate, x[None], weight, mean[None], rstd[None], g[None])
        dx = dx[0]
    else:
        dx, dw, db = _ln_bwd(emulate, x, weight, mean, rstd, g)
    return (
        dx,
        dw.astype(weight.dtype) if weight is not None else None,
        db.astype(g.dtype) if has_bias else None,
    )


# ---------------------------------------------------------------- cross-entropy


def cross_entropy_algo(n_cols: int) -> RowAlgo:
    """Online max and sum of exp, and the target's logit (found by column
    position), then ``dlogits = w_row * (softmax - onehot)``. Padded columns
    hold NEG. Row inputs: the target (as float32) and the row's weight."""

    def init(target, weight):
        return jnp.full_like(target, NEG), _zeros_like_row(target), _zeros_like_row(target), target, weight

    def stats(carry, chunks, cols):
        m, s, picked, target, weight = carry
        (x,) = chunks
        m_new = jnp.maximum(m, x.max(axis=1))
        s = s * jnp.exp(m - m_new) + jnp.exp(x - _col(m_new, x.shape)).sum(axis=1)
        hit = cols.astype(jnp.float32) == _col(target, x.shape)
        return m_new, s, picked + jnp.where(hit, x, 0.0).sum(axis=1), target, weight

    def write(carry, chunks, cols):
        m, s, _, target, weight = carry
        (x,) = chunks
        p = jnp.exp(x - _col(m, x.shape)) / _col(s, x.shape)
        hit = cols.astype(jnp.float32) == _col(target, x.shape)
        return ((p - jnp.where(hit, 1.0, 0.0)) * _col(weight, x.shape),)

    def rows_out(carry):
        m, s, picked, _, _ = carry
        return (m + jnp.log(s) - picked,)

    return RowAlgo(init, stats, write, rows_out, 1)


def _ce_2d(logits, targets, ignore_index, emulate):
    n, c = logits.shape
    valid = jnp.ones((n,), bool) if ignore_index is None else targets != ignore_index
    count = jnp.sum(valid).astype(jnp.float32)
    weights = jnp.where(valid, 1.0 / count, 0.0)
    safe_t = jnp.where(valid, targets, 0).astype(jnp.float32)
    run = emulate_rows if emulate else functools.partial(run_rows, name="cross_entropy_mgpu")
    grad, row_loss = run(
        cross_entropy_algo(c), (logits,), (), (safe_t, weights), out_dtypes=(logits.dtype,), tile_pad=NEG
    )
    loss = jnp.sum(jnp.where(valid, row_loss, 0.0)) / count
    return loss.astype(logits.dtype), grad, weights


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _ce(ignore_index, emulate, logits, targets):
    loss, grad, _ = _ce_2d(logits, targets, ignore_index, emulate)
    return loss, grad


@_ce.defjvp
def _ce_jvp(ignore_index, emulate, primals, tangents):
    logits, targets = primals
    dlogits = upcast(tangents[0])
    loss, grad, weights = _ce_2d(logits, targets, ignore_index, emulate)
    lf = upcast(logits)
    p = jnp.exp(lf - jax.nn.logsumexp(lf, axis=-1, keepdims=True))
    dloss = jnp.sum(upcast(grad) * dlogits)
    dgrad = weights[:, None] * p * (dlogits - jnp.sum(p * dlogits, axis=-1, keepdims=True))
    return (loss, grad), (dloss.astype(loss.dtype), dgrad.astype(grad.dtype))


def cross_entropy_mgpu(logits, targets, *, ignore_index: int | None, emulate: bool = False):
    """``(mean loss over kept rows, dloss/dlogits)`` with the Mosaic GPU kernel."""
    return _ce(ignore_index, emulate, logits, targets)


# ---------------------------------------------------------------- batch norm
# x [N, C, H, W] read as rows [N*C, H*W] (a free reshape): a kernel gives each
# row's count-weighted moments (or gradient sums), XLA merges the N rows of
# each channel ([N, C] values, negligible), and a second row kernel applies the
# per-row affine map.


def row_moments_algo(n_cols: int) -> RowAlgo:
    """Per-row mean and centred sum of squares (no tile output)."""
    ln = layer_norm_algo(n_cols, 0.0)

    def rows_out(carry):
        _, mean, m2 = carry
        return mean, m2

    return RowAlgo(ln.init, ln.stats, lambda carry, chunks, cols: (), rows_out, 2)


def row_affine_algo() -> RowAlgo:
    """``y = x * a + b`` with per-row ``a``, ``b`` (no statistics)."""

    def write(carry, chunks, cols):
        a, b = carry
        (x,) = chunks
        return (x * _col(a, x.shape) + _col(b, x.shape),)

    return RowAlgo(lambda a, b: (a, b), lambda carry, chunks, cols: carry, write)


def row_grad_sums_algo() -> RowAlgo:
    """Per-row ``sum(g)`` and ``sum(g * xhat)`` with per-row mean and rstd
    (padded g is zero, so padded columns add nothing)."""

    def init(mean, rstd):
        z = _zeros_like_row(mean)
        return mean, rstd, z, z

    def stats(carry, chunks, cols):
        mean, rstd, sg, sgx = carry
        x, g = chunks
        xhat = (x - _col(mean, x.shape)) * _col(rstd, x.shape)
        return mean, rstd, sg + g.sum(axis=1), sgx + (g * xhat).sum(axis=1)

    def rows_out(carry):
        return carry[2], carry[3]

    return RowAlgo(init, stats, lambda carry, chunks, cols: (), rows_out, 2)


def row_dx_algo() -> RowAlgo:
    """``dx = k_g * g + k_x * x + k_0`` with per-row coefficients."""

    def write(carry, chunks, cols):
        kg, kx, k0 = carry
        x, g = chunks
        return (g * _col(kg, x.shape) + x * _col(kx, x.shape) + _col(k0, x.shape),)

    return RowAlgo(lambda kg, kx, k0: (kg, kx, k0), lambda carry, chunks, cols: carry, write)


def _run(emulate: bool, name: str) -> Callable[..., tuple]:
    return emulate_rows if emulate else functools.partial(run_rows, name=name)


def _bn_fwd_impl(x, w, b, eps, emulate):
    n, c, h, wd = x.shape
    m = h * wd
    rows = x.reshape(n * c, m)
    row_mean, row_m2 = _run(emulate, "batch_norm_moments_mgpu")(row_moments_algo(m), (rows,), out_dtypes=())
    row_mean, row_m2 = row_mean.reshape(n, c), row_m2.reshape(n, c)
    mean = jnp.mean(row_mean, axis=0)  # equal counts per row: Chan's merge in closed form
    m2 = jnp.sum(row_m2, axis=0) + m * jnp.sum((row_mean - mean[None, :]) ** 2, axis=0)
    var = m2 / (n * m)
    rstd = lax.rsqrt(var + eps)
    a = rstd * (1.0 if w is None else upcast(w))
    shift = (0.0 if b is None else upcast(b)) - mean * a
    ra, rb = (jnp.broadcast_to(v, (n, c)).reshape(-1) for v in (a, shift))
    (y,) = _run(emulate, "batch_norm_apply_mgpu")(row_affine_algo(), (rows,), (), (ra, rb), out_dtypes=(x.dtype,))
    return y.reshape(x.shape), mean, var, rstd


def _bn_bwd_impl(x, w, mean, rstd, g, emulate):
    n, c, h, wd = x.shape
    m = h * wd
    xr, gr = x.reshape(n * c, m), g.reshape(n * c, m)
    rmean, rrstd = (jnp.broadcast_to(v, (n, c)).reshape(-1) for v in (mean, rstd))
    sg, sgx = _run(emulate, "batch_norm_grad_sums_mgpu")(
        row_grad_sums_algo(), (xr, gr), (), (rmean, rrstd), out_dtypes=()
    )
    db, dw = jnp.sum(sg.reshape(n, c), axis=0), jnp.sum(sgx.reshape(n, c), axis=0)
    total = float(n * m)
    scale = rstd * (1.0 if w is None else upcast(w))
    # dx = scale * (g - db/M - xhat * dw/M),  xhat = (x - mean) * rstd
    kg, kx = scale, -scale * rstd * dw / total
    k0 = -scale * db / total + scale * rstd * mean * dw / total
    coeffs = tuple(jnp.broadcast_to(v, (n, c)).reshape(-1) for v in (kg, kx, k0))
    (dx,) = _run(emulate, "batch_norm_dx_mgpu")(row_dx_algo(), (xr, gr), (), coeffs, out_dtypes=(x.dtype,))
    return dx.reshape(x.shape), dw, db


def _chan(v: jax.Array) -> jax.Array:
    return v.reshape(1, -1, 1, 1)


_BN_DIMS = dict(axes=(0, 2, 3), stat=_chan, param=_chan)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _bn_fwd(eps, emulate, x, w, b):
    return _bn_fwd_impl(x, w, b, eps, emulate)


@_bn_fwd.defjvp
def _bn_fwd_jvp(eps, emulate, primals, tangents):
    x, w, b = primals
    out = _bn_fwd(eps, emulate, x, w, b)
    _, mean, _, rstd = out
    t = _norm_jvp.forward_tangents(x, w, mean, rstd, *tangents, **_BN_DIMS)
    return out, tuple(ti.astype(o.dtype) for ti, o in zip(t, out))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _bn_bwd(emulate, x, w, mean, rstd, g):
    return _bn_bwd_impl(x, w, mean, rstd, g, emulate)


@_bn_bwd.defjvp
def _bn_bwd_jvp(emulate, primals, tangents):
    out = _bn_bwd(emulate, *primals)
    t = _norm_jvp.backward_tangents(*primals, *tangents, param_axes=(0, 2, 3), **_BN_DIMS)
    return out, tuple(ti.astype(o.dtype) for ti, o in zip(t, out))


def batch_norm_train_mgpu(x, weight, bias, *, eps: float, emulate: bool = False):
    """Training batch norm ``(y, mean, var, rstd)`` with Mosaic GPU row kernels."""
    return _bn_fwd(eps, emulate, x, weight, bias)


def batch_norm_train_bwd_mgpu(x, weight, mean, rstd, g, *, has_bias: bool, emulate: bool = False):
    dx, dw, db = _bn_bwd(emulate, x, weight, mean, rstd, g)
    return (
        dx,
        dw.astype(weight.dtype) if weight is not None else None,
        db.astype(g.dtype) if has_bias else None,
    )


# ---------------------------------------------------------------- selection


@functools.lru_cache(maxsize=512)
def _lowers_cached(fn: Callable[..., Any], avals: tuple, static: tuple) -> str | None:
    kw = dict(static)
    try:
        jax.jit(lambda *a: fn(*a, **kw)).trace(*avals).lower(lowering_platforms=("cuda",))
    except Exception as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    return None


def why_not(fn: Callable[..., Any], args: tuple, static: dict[str, Any]) -> str | None:
    """Why the Mosaic GPU variant ``fn`` cannot serve ``fn(*args, **static)``
    (a block rule it would break, or its lowering for cuda failing), or None."""
    leaves = [a for a in jax.tree.leaves(args) if hasattr(a, "dtype")]
    for a in leaves:
        reason = check_rules(a.dtype, buffers=len(leaves) + 1)
        if reason is not None:
            return reason
    avals = tuple(None if a is None else jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in args)
    return _lowers_cached(fn, avals, tuple(sorted(static.items())))


def lowers(fn: Callable[..., Any], args: tuple, static: dict[str, Any]) -> bool:
    return why_not(fn, args, static) is None
