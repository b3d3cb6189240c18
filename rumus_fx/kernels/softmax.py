"""Softmax over one axis: Pallas forward and backward kernels, their
``custom_jvp`` glue, and the jax.numpy reference.

The kernels work on rows ``[N, C]`` (the softmax axis moved last). The forward
makes one pass over a row when it fits one chunk, else an online max/sum pass
over the chunks and a second pass that writes; the backward computes
``dx = y * (g - sum(g * y))`` the same way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import blocks, mosaic_gpu
from ._pallas import Config, RowPasses, iota, pad_to, pallas_call, unpad
from ._sharding import sharded_call
from .dispatch import MOSAIC_GPU, call
from .precision import upcast

# ---------------------------------------------------------------- kernels


def _softmax_fwd_kernel(x_ref, y_ref, *scratch, n_cols: int, rp: RowPasses):
    # Inputs: x_ref [rows, cols_pad] (or one chunk on the grid)
    # Outputs: y_ref likewise; scratch: the running max and sum [rows, 1] on the grid
    rows = x_ref.shape[0]
    read = rp.reader()

    def load(i):
        return jnp.where(iota((rows, rp.chunk), 1, i * rp.chunk) < n_cols, read(x_ref, i), -jnp.inf)

    if rp.n_chunks == 1:
        x = load(0)
        e = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))
        y_ref[...] = (e / jnp.sum(e, axis=1, keepdims=True)).astype(y_ref.dtype)
        return

    def stats(i, carry):
        m, s = carry
        x = load(i)
        m_new = jnp.maximum(m, jnp.max(x, axis=1, keepdims=True))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(x - m_new), axis=1, keepdims=True)
        return m_new, s

    def write(i, carry):
        m, s = carry
        rp.store(y_ref, i, jnp.exp(load(i) - m) / s)

    init = (jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.zeros((rows, 1), jnp.float32))
    rp.run(scratch, init, stats, write)


def _softmax_bwd_kernel(y_ref, g_ref, dx_ref, *scratch, rp: RowPasses):
    # Inputs: y_ref, g_ref [rows, cols_pad] (zero padded; or one chunk on the grid)
    # Outputs: dx_ref likewise; scratch: sum(g * y) [rows, 1] on the grid
    rows = y_ref.shape[0]
    read = rp.reader()

    def stats(i, carry):
        (s,) = carry
        return (s + jnp.sum(read(y_ref, i) * read(g_ref, i), axis=1, keepdims=True),)

    def write(i, carry):
        (s,) = carry
        rp.store(dx_ref, i, read(y_ref, i) * (read(g_ref, i) - s))

    rp.run(scratch, (jnp.zeros((rows, 1), jnp.float32),), stats, write)


@functools.partial(jax.jit, static_argnums=0)
def _softmax_fwd_local(cfg: Config, x: jax.Array) -> tuple[jax.Array]:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    n, c = x2.shape
    b = blocks.row_blocks(n, c, cfg.target)
    rp = RowPasses.of(b)
    y = pallas_call(
        functools.partial(_softmax_fwd_kernel, n_cols=c, rp=rp),
        cfg,
        name="softmax_fwd",
        grid=rp.grid(b.rows_pad // b.block_rows),
        in_specs=[rp.row_spec(b)],
        out_specs=rp.row_spec(b, written=True),
        out_shape=jax.ShapeDtypeStruct((b.rows_pad, b.cols_pad), x.dtype),
        **rp.params(b, n_carry=2),
    )(pad_to(x2, (b.rows_pad, b.cols_pad)))
    return (unpad(y, (n, c)).reshape(shape),)


@functools.partial(jax.jit, static_argnums=0)
def _softmax_bwd_local(cfg: Config, y: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    shape = y.shape
    y2, g2 = y.reshape(-1, shape[-1]), g.reshape(-1, shape[-1])
    n, c = y2.shape
    b = blocks.row_blocks(n, c, cfg.target)
    rp = RowPasses.of(b)
    dx = pallas_call(
        functools.partial(_softmax_bwd_kernel, rp=rp),
        cfg,
        name="softmax_bwd",
        grid=rp.grid(b.rows_pad // b.block_rows),
        in_specs=[rp.row_spec(b), rp.row_spec(b)],
        out_specs=rp.row_spec(b, written=True),
        out_shape=jax.ShapeDtypeStruct((b.rows_pad, b.cols_pad), g.dtype),
        **rp.params(b, n_carry=1),
    )(pad_to(y2, (b.rows_pad, b.cols_pad)), pad_to(g2, (b.rows_pad, b.cols_pad)))
    return (unpad(dx, (n, c)).reshape(shape),)


# ---------------------------------------------------------------- custom_jvp glue
# Tangent rules are jax.numpy, linear in the tangents, so jax.jvp, jax.linearize
# and jax.grad (which transposes them) all work on the Pallas path.


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _softmax_last(cfg: Config, x: jax.Array) -> jax.Array:
    return sharded_call(_softmax_fwd_local, cfg, "... c -> ... c", x, replicated="c")[0]


@_softmax_last.defjvp
def _softmax_last_jvp(cfg, primals, tangents):
    (x,), (dx,) = primals, tangents
    y = _softmax_last(cfg, x)
    yf, dxf = upcast(y), upcast(dx)
    dy = yf * (dxf - jnp.sum(dxf * yf, axis=-1, keepdims=True))
    return y, dy.astype(y.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _softmax_grad_last(cfg: Config, y: jax.Array, g: jax.Array) -> jax.Array:
    return sharded_call(_softmax_bwd_local, cfg, "... c, ... c -> ... c", y, g, replicated="c")[0]


@_softmax_grad_last.defjvp
def _softmax_grad_last_jvp(cfg, primals, tangents):
    (y, g), (dy, dg) = primals, tangents
    dx = _softmax_grad_last(cfg, y, g)
    yf, gf, dyf, dgf = map(upcast, (y, g, dy, dg))
    s = jnp.sum(gf * yf, axis=-1, keepdims=True)
    ds_ = jnp.sum(dgf * yf + gf * dyf, axis=-1, keepdims=True)
    ddx = dyf * (gf - s) + yf * (dgf - ds_)
    return dx, ddx.astype(dx.dtype)


def softmax_pallas(x: jax.Array, *, axis: int, cfg: Config) -> jax.Array:
    """The Pallas forward along any axis (moved last for the row kernel)."""
    x_last = jnp.moveaxis(x, axis, -1)
    return jnp.moveaxis(_softmax_last(cfg, x_last), -1, axis)


def softmax_bwd_pallas(y: jax.Array, g: jax.Array, *, axis: int, cfg: Config) -> jax.Array:
    """The Pallas backward along any axis."""
    dx = _softmax_grad_last(cfg, jnp.moveaxis(y, axis, -1), jnp.moveaxis(g, axis, -1))
    return jnp.moveaxis(dx, -1, axis)


# ---------------------------------------------------------------- reference


def softmax_reference(x: jax.Array, *, axis: int) -> jax.Array:
    xf = upcast(x)
    m = jnp.max(xf, axis=axis, keepdims=True)
    e = jnp.exp(xf - m)
    return (e / jnp.sum(e, axis=axis, keepdims=True)).astype(x.dtype)


def softmax_bwd_reference(y: jax.Array, g: jax.Array, *, axis: int) -> jax.Array:
    yf, gf = upcast(y), upcast(g)
    dot = jnp.sum(gf * yf, axis=axis, keepdims=True)
    return (yf * (gf - dot)).astype(g.dtype)


# ---------------------------------------------------------------- entry points


def softmax_fwd(x: jax.Array, axis: int = -1) -> jax.Array:
    """Numerically stable softmax of ``x`` along ``axis``."""
    return call(softmax_reference, softmax_pallas, x, axis=axis)


def softmax_bwd(y: jax.Array, g: jax.Array, axis: int = -1) -> jax.Array:
    """``dx = y * (g - sum(g * y))`` from the saved output ``y``."""
    return call(softmax_bwd_reference, softmax_bwd_pallas, y, g, axis=axis)


MOSAIC_GPU[softmax_pallas] = mosaic_gpu.softmax_mgpu
MOSAIC_GPU[softmax_bwd_pallas] = mosaic_gpu.softmax_bwd_mgpu
