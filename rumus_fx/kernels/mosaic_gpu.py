"""Mosaic GPU variants of the memory-bound row kernels (softmax so far), in
``plgpu.kernel`` style: the replacement for Pallas' Triton backend, which jax
deprecates from 0.11.

NOTHING HERE HAS RUN ON A GPU. What is checked on a CPU host:

* lowering: each kernel lowers for ``cuda`` with Mosaic GPU at the public
  shapes (``tests/kernels/test_mosaic_gpu.py``): jax's Mosaic GPU lowering
  accepts its layouts, transfers and shared-memory budget. It does not compile
  to SASS nor run, so the kernel's numerics on a device are unchecked;
* numerics of the block algorithm: the chunk steps (``_softmax_stats``,
  ``_softmax_write``, ...) are plain functions of arrays; the kernel applies
  them to register tiles, and :func:`softmax_emulated` applies the very same
  functions to the same padded blocks and chunks with jax.numpy. Its agreement
  with the reference checks the padding, the masking of padded columns and
  the online merge across chunks. The copies, barriers and layouts are not
  in that emulation (Pallas' Mosaic GPU interpreter in jax 0.10 has no rule
  for ``plgpu.load`` or tiled/swizzled shared memory).

Block choices and the Mosaic GPU rules they obey:

* one warpgroup (128 threads) per program; a program owns ``BLOCK_ROWS = 64``
  rows (the WGMMA register layout's row tile, in which row reductions are
  supported) and walks the row in column chunks of ``CHUNK = 128`` elements
  (async copies move at most 256 elements per dimension);
* rows are padded to 64 and columns to 128 on the host, so every copy is a
  whole tile and every stride is a multiple of 16 bytes;
* shared memory: an input chunk and an output chunk, ``64 x 128`` each
  (64 KiB in float32, 32 KiB in 16-bit types), far under the 227 KiB limit;
  a whole-row block would need ``64 x cols x 4`` bytes (over 227 KiB beyond
  ~900 float32 columns), which is why rows are walked in chunks;
* shared memory is tiled ``(8, 128 // itemsize)`` and 128-byte swizzled
  (bank-conflict-free WGMMA-layout loads and stores).

Selection (``dispatch.py``): the cuda branch keeps the Triton kernel while
this jax has Pallas' Triton backend (those kernels have lowering *and*
interpret-mode numeric checks); where it does not, or with
``RUMUS_FX_GPU_KERNELS=mosaic``, the Mosaic GPU variant is used where it
lowers at the call's shapes (:func:`lowers`, cached), else the reference with
one warning. ROCm keeps Triton (Mosaic GPU is NVIDIA-only).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

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
# Pure functions of [BLOCK_ROWS, CHUNK] float32 chunks and [BLOCK_ROWS] row
# vectors: the kernels apply them to register tiles, the emulation to arrays.


def _col(v: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return lax.broadcast_in_dim(v, shape, [0])


def _softmax_stats(m: jax.Array, s: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Online max and sum of exp over one more chunk (padded columns hold NEG)."""
    m_new = jnp.maximum(m, x.max(axis=1))
    s = s * jnp.exp(m - m_new) + jnp.exp(x - _col(m_new, x.shape)).sum(axis=1)
    return m_new, s


def _softmax_write(x: jax.Array, m: jax.Array, s: jax.Array) -> jax.Array:
    return jnp.exp(x - _col(m, x.shape)) / _col(s, x.shape)


def _softmax_bwd_stats(acc: jax.Array, y: jax.Array, g: jax.Array) -> jax.Array:
    return acc + (y * g).sum(axis=1)


def _softmax_bwd_write(y: jax.Array, g: jax.Array, acc: jax.Array) -> jax.Array:
    return y * (g - _col(acc, y.shape))


# ---------------------------------------------------------------- emulation


def _emulate(
    inputs: tuple[jax.Array, ...],
    init: Callable[[], tuple],
    stats: Callable[..., tuple],
    write: Callable[..., jax.Array],
    out_dtype: Any,
) -> jax.Array:
    """Run the two-pass chunk walk of a row kernel with jax.numpy on padded
    ``[rows_pad, cols_pad]`` inputs: per block of ``BLOCK_ROWS`` rows,
    ``carry = stats(*carry, *chunks)`` over the chunks, then ``write``."""
    rows_pad, cols_pad = inputs[0].shape
    n_chunks = cols_pad // CHUNK
    out = []
    for r in range(0, rows_pad, BLOCK_ROWS):
        carry = init()
        for c in range(n_chunks):
            chunks = [upcast(a[r : r + BLOCK_ROWS, c * CHUNK : (c + 1) * CHUNK]) for a in inputs]
            carry = stats(*carry, *chunks)
        row = []
        for c in range(n_chunks):
            chunks = [upcast(a[r : r + BLOCK_ROWS, c * CHUNK : (c + 1) * CHUNK]) for a in inputs]
            row.append(write(*chunks, *carry).astype(out_dtype))
        out.append(jnp.concatenate(row, axis=1))
    return jnp.concatenate(out, axis=0)


def _sm_init() -> tuple[jax.Array, jax.Array]:
    return jnp.full((BLOCK_ROWS,), NEG, jnp.float32), jnp.zeros((BLOCK_ROWS,), jnp.float32)


def _sm_bwd_init() -> tuple[jax.Array]:
    return (jnp.zeros((BLOCK_ROWS,), jnp.float32),)


def _padded(x2: jax.Array, value: float = 0.0) -> jax.Array:
    n, c = x2.shape
    return pad_to(x2, (_round_up(max(n, 1), BLOCK_ROWS), _round_up(max(c, 1), CHUNK)), value)


def softmax_emulated(x: jax.Array) -> jax.Array:
    """The Mosaic GPU softmax's block algorithm in jax.numpy (last axis)."""
    x2 = x.reshape(-1, x.shape[-1])
    y = _emulate((_padded(x2, NEG),), _sm_init, _softmax_stats, _softmax_write, x.dtype)
    return unpad(y, x2.shape).reshape(x.shape)


def softmax_bwd_emulated(y: jax.Array, g: jax.Array) -> jax.Array:
    y2, g2 = y.reshape(-1, y.shape[-1]), g.reshape(-1, g.shape[-1])
    stats = lambda acc, yc, gc: (_softmax_bwd_stats(acc, yc, gc),)  # noqa: E731
    dx = _emulate((_padded(y2), _padded(g2)), _sm_bwd_init, stats, _softmax_bwd_write, g.dtype)
    return unpad(dx, y2.shape).reshape(y.shape)


# ---------------------------------------------------------------- kernels


def _plgpu() -> Any:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


def _smem(shape: tuple[int, int], dtype: Any) -> Any:
    plgpu = _plgpu()
    swizzle = 128
    transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def _row_kernel(
    inputs: tuple[jax.Array, ...],
    init: Callable[[], tuple],
    stats: Callable[..., tuple],
    write: Callable[..., jax.Array],
    out_dtype: Any,
    name: str,
) -> jax.Array:
    """A ``plgpu.kernel`` over padded ``[rows_pad, cols_pad]`` inputs: one
    program per ``BLOCK_ROWS`` rows; pass 1 copies each chunk of every input
    to shared memory and folds it into the row statistics, pass 2 copies them
    again, writes the output chunk to shared memory and copies it out."""
    import jax.experimental.pallas as pl

    plgpu = _plgpu()
    rows_pad, cols_pad = inputs[0].shape
    n_chunks = cols_pad // CHUNK
    n_in = len(inputs)
    wgmma = plgpu.Layout.WGMMA
    row_layout = wgmma.reduce(1)

    def body(*refs):
        in_gmem, out_gmem = refs[:n_in], refs[n_in]
        in_smem, out_smem, bar = refs[n_in + 1 : 2 * n_in + 1], refs[2 * n_in + 1], refs[2 * n_in + 2]
        rows = pl.ds(lax.axis_index("rows") * BLOCK_ROWS, BLOCK_ROWS)

        def load(c):
            cols = pl.ds(c * CHUNK, CHUNK)
            plgpu.commit_smem()  # every thread has read the previous chunk before it is overwritten
            for g, s in zip(in_gmem, in_smem):
                plgpu.copy_gmem_to_smem(g.at[rows, cols], s, bar)
            for _ in in_smem:
                plgpu.barrier_wait(bar)
            return [plgpu.load(s, (), layout=wgmma).astype(jnp.float32) for s in in_smem]

        carry0 = tuple(plgpu.layout_cast(v, row_layout) for v in init())
        carry = lax.fori_loop(0, n_chunks, lambda c, carry: tuple(stats(*carry, *load(c))), carry0)

        def write_chunk(c, token):
            out_smem[...] = write(*load(c), *carry).astype(out_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[rows, pl.ds(c * CHUNK, CHUNK)])
            plgpu.wait_smem_to_gmem(0)
            return token

        lax.fori_loop(0, n_chunks, write_chunk, 0)

    body.__name__ = body.__qualname__ = name  # the name in the lowered module's debug info
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((rows_pad, cols_pad), out_dtype),
        grid=(rows_pad // BLOCK_ROWS,),
        grid_names=("rows",),
        scratch_types=[
            *[_smem((BLOCK_ROWS, CHUNK), a.dtype) for a in inputs],
            _smem((BLOCK_ROWS, CHUNK), out_dtype),
            plgpu.Barrier(num_arrivals=1),
        ],
    )
    return kernel(*inputs)


def _on_cuda(kernel: Callable[..., jax.Array], emulated: Callable[..., jax.Array], *args: jax.Array) -> jax.Array:
    """The Mosaic GPU kernel when lowered for cuda; on other platforms (dead
    branches of a multi-platform lowering) the jax.numpy emulation."""
    out = jax.ShapeDtypeStruct(args[0].shape, args[-1].dtype)
    return native_or_interpret(lambda *a: (kernel(*a),), lambda *a: (emulated(*a),), ("cuda",), (out,), *args)[0]


def _softmax_mgpu_2d(x: jax.Array) -> jax.Array:
    n, c = x.shape
    y = _row_kernel((_padded(x, NEG),), _sm_init, _softmax_stats, _softmax_write, x.dtype, "softmax_fwd_mgpu")
    return unpad(y, (n, c))


def _softmax_bwd_mgpu_2d(y: jax.Array, g: jax.Array) -> jax.Array:
    stats = lambda acc, yc, gc: (_softmax_bwd_stats(acc, yc, gc),)  # noqa: E731
    dx = _row_kernel((_padded(y), _padded(g)), _sm_bwd_init, stats, _softmax_bwd_write, g.dtype, "softmax_bwd_mgpu")
    return unpad(dx, y.shape)


@jax.custom_jvp
def _softmax_last(x: jax.Array) -> jax.Array:
    x2 = x.reshape(-1, x.shape[-1])
    return _on_cuda(_softmax_mgpu_2d, lambda a: softmax_emulated(a), x2).reshape(x.shape)


@_softmax_last.defjvp
def _softmax_last_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    y = _softmax_last(x)
    yf, dxf = upcast(y), upcast(dx)
    return y, (yf * (dxf - jnp.sum(dxf * yf, axis=-1, keepdims=True))).astype(y.dtype)


@jax.custom_jvp
def _softmax_grad_last(y: jax.Array, g: jax.Array) -> jax.Array:
    y2, g2 = y.reshape(-1, y.shape[-1]), g.reshape(-1, g.shape[-1])
    return _on_cuda(_softmax_bwd_mgpu_2d, softmax_bwd_emulated, y2, g2).reshape(y.shape)


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
    avals = tuple(jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in args)
    return _lowers_cached(fn, avals, tuple(sorted(static.items())))


def lowers(fn: Callable[..., Any], args: tuple, static: dict[str, Any]) -> bool:
    return why_not(fn, args, static) is None
