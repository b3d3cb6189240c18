"""Batch norm over ``[B, C, H, W]`` (statistics per channel): Pallas training
forward and backward kernels, their ``custom_jvp`` glue, and the jax.numpy
reference.

The input is viewed as ``[B, C, H*W]`` (a free reshape). A per-channel
reduction over the batch would leave only ``C / 8`` programs, far too few for
a GPU, so each direction is two kernels:

* a *partials* kernel, one program per (channel block, batch block, spatial
  chunk), reduces its tile in one read: the forward its mean and centred sum
  of squares (the samples' moments merged with Chan's update), the backward
  its ``sum(g)`` and ``sum(g * xhat)``; the host combines the partials per
  channel (Chan's combination, weighted by each chunk's count);
* an elementwise kernel, one program per (sample, channel block, spatial
  chunk), writes ``y`` (forward) or ``dx`` (backward).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from . import _norm_jvp, blocks, mosaic_gpu
from ._pallas import Config, f32, iota, merge_moments, pad_to, pallas_call
from ._sharding import sharded_call
from .dispatch import MOSAIC_GPU, call
from .precision import compute_dtype, upcast

_AXES = (0, 2, 3)

# ---------------------------------------------------------------- kernels


def _bn_moments_kernel(x_ref, mean_ref, m2_ref, *, hw: int):
    # Inputs: x_ref [batch_block, channels, chunk] (spatial chunk program_id(2))
    # Outputs: mean_ref, m2_ref [channels, 1]: this tile's mean and centred sum of squares
    batch, channels, chunk = x_ref.shape
    c0 = pl.program_id(2) * chunk
    count = jnp.minimum(hw - c0, chunk).astype(jnp.float32)  # every chunk holds a real position
    valid = iota((channels, chunk), 1, c0) < hw
    zero = jnp.zeros((channels, 1), jnp.float32)
    state = (jnp.float32(0.0), zero, zero)
    for b in range(batch):  # a few samples: unrolled
        x = f32(x_ref[b])
        total = jnp.sum(x, axis=1, keepdims=True)  # padded positions hold zeros
        xc = jnp.where(valid, x - total / count, 0.0)
        state = merge_moments(state, count, total, jnp.sum(xc * xc, axis=1, keepdims=True))
    _, mean, m2 = state
    mean_ref[...] = mean
    m2_ref[...] = m2


def _bn_apply_kernel(x_ref, mean_ref, scale_ref, shift_ref, y_ref):
    # Inputs: x_ref [channels, chunk]; mean_ref, scale_ref (rstd * w), shift_ref (b) [channels, 1]
    # Outputs: y_ref [channels, chunk]
    y = (f32(x_ref[...]) - mean_ref[...]) * scale_ref[...] + shift_ref[...]
    y_ref[...] = y.astype(y_ref.dtype)


def _bn_grad_sums_kernel(x_ref, g_ref, mean_ref, rstd_ref, sg_ref, sgx_ref):
    # Inputs: x_ref, g_ref [batch_block, channels, chunk]; mean_ref, rstd_ref [channels, 1]
    # Outputs: sg_ref = sum(g), sgx_ref = sum(g * xhat) over this tile [channels, 1]
    mean, rstd = mean_ref[...], rstd_ref[...]
    sg = sgx = jnp.zeros(sg_ref.shape, jnp.float32)
    for b in range(x_ref.shape[0]):
        g = f32(g_ref[b])  # zero at padded positions
        xhat = (f32(x_ref[b]) - mean) * rstd
        sg, sgx = sg + jnp.sum(g, axis=1, keepdims=True), sgx + jnp.sum(g * xhat, axis=1, keepdims=True)
    sg_ref[...] = sg
    sgx_ref[...] = sgx


def _bn_dx_kernel(x_ref, g_ref, mean_ref, rstd_ref, w_ref, c1_ref, c2_ref, dx_ref):
    # Inputs: x_ref, g_ref [channels, chunk]; per channel [channels, 1]: mean, rstd, w,
    #         c1 = w * mean(g), c2 = w * mean(g * xhat)
    # Outputs: dx_ref [channels, chunk]
    rstd = rstd_ref[...]
    xhat = (f32(x_ref[...]) - mean_ref[...]) * rstd
    dx = rstd * (f32(g_ref[...]) * w_ref[...] - c1_ref[...] - xhat * c2_ref[...])
    dx_ref[...] = dx.astype(dx_ref.dtype)


def _as_bchw(x: jax.Array, b: blocks.ChannelBlocks) -> jax.Array:
    n, c, h, w = x.shape
    return pad_to(x.reshape(n, c, h * w), (n, b.channels_pad, b.hw_pad))


def _as_col(v: jax.Array, b: blocks.ChannelBlocks) -> jax.Array:
    return pad_to(upcast(v).astype(jnp.float32).reshape(-1, 1), (b.channels_pad, 1))


def _partials_call(kernel, cfg: Config, b: blocks.ChannelBlocks, batch: int, n_big: int, n_small: int, name: str):
    """A (channel block, batch block, spatial chunk) grid reducing each tile to one
    ``[channels, 1]`` partial: outputs ``[groups, n_chunks, channels_pad, 1]``."""
    groups = batch // b.batch_block
    big = pl.BlockSpec((b.batch_block, b.block_channels, b.chunk), lambda i, j, c: (j, i, c))
    small = pl.BlockSpec((b.block_channels, 1), lambda i, j, c: (i, 0))
    part = pl.BlockSpec((pl.squeezed, pl.squeezed, b.block_channels, 1), lambda i, j, c: (j, c, i, 0))
    shape = jax.ShapeDtypeStruct((groups, b.n_chunks, b.channels_pad, 1), jnp.float32)
    return pallas_call(
        kernel,
        cfg,
        name=name,
        grid=(b.channels_pad // b.block_channels, groups, b.n_chunks),
        in_specs=[big] * n_big + [small] * n_small,
        out_specs=(part, part),
        out_shape=(shape, shape),
        num_warps=b.num_warps,
    )


def _elementwise_call(kernel, cfg: Config, b: blocks.ChannelBlocks, batch: int, n_big: int, n_small: int, dtype, name):
    """A (sample, channel block, spatial chunk) grid writing one [B, C, HW] array."""
    tile = pl.BlockSpec((pl.squeezed, b.block_channels, b.chunk), lambda n, i, c: (n, i, c))
    small = pl.BlockSpec((b.block_channels, 1), lambda n, i, c: (i, 0))
    return pallas_call(
        kernel,
        cfg,
        name=name,
        grid=(batch, b.channels_pad // b.block_channels, b.n_chunks),
        in_specs=[tile] * n_big + [small] * n_small,
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct((batch, b.channels_pad, b.hw_pad), dtype),
        num_warps=b.num_warps,
    )


@functools.partial(jax.jit, static_argnums=0)
def _bn_fwd_local(key: tuple, x: jax.Array, *params: jax.Array):
    cfg, eps, has_w, has_b = key
    n, c, h, w = x.shape
    b = blocks.channel_blocks(n, c, h * w, cfg.target)
    x3 = _as_bchw(x, b)
    kernel = functools.partial(_bn_moments_kernel, hw=h * w)
    means, m2s = _partials_call(kernel, cfg, b, n, 1, 0, "batch_norm_moments")(x3)
    # Chan's combination of the tiles, weighted by their counts (the last chunk may be partial)
    counts = np.minimum(h * w - b.chunk * np.arange(b.n_chunks), b.chunk) * b.batch_block
    counts = jnp.asarray(counts, jnp.float32).reshape(1, -1, 1, 1)
    total = n * h * w
    mean = jnp.sum(counts * means, axis=(0, 1)) / total
    var = (jnp.sum(m2s, axis=(0, 1)) + jnp.sum(counts * (means - mean[None, None]) ** 2, axis=(0, 1))) / total
    rstd = lax.rsqrt(var + eps)
    weight = _as_col(params[0], b) if has_w else jnp.ones_like(rstd)
    shift = _as_col(params[-1], b) if has_b else jnp.zeros_like(rstd)
    y = _elementwise_call(_bn_apply_kernel, cfg, b, n, 1, 3, x.dtype, "batch_norm_apply")(
        x3, mean, rstd * weight, shift
    )
    st = compute_dtype(x.dtype)
    y = y[:, :c, : h * w].reshape(n, c, h, w)
    return (y, *(v[:c, 0].astype(st) for v in (mean, var, rstd)))


@functools.partial(jax.jit, static_argnums=0)
def _bn_bwd_local(key: tuple, x: jax.Array, *rest: jax.Array):
    cfg, has_w = key
    n, c, h, w = x.shape
    b = blocks.channel_blocks(n, c, h * w, cfg.target)
    weight = _as_col(rest[0], b) if has_w else None
    mean, rstd, g = rest[1:] if has_w else rest
    x3, g3, mean, rstd = _as_bchw(x, b), _as_bchw(g, b), _as_col(mean, b), _as_col(rstd, b)
    sgs, sgxs = _partials_call(_bn_grad_sums_kernel, cfg, b, n, 2, 2, "batch_norm_grad_sums")(x3, g3, mean, rstd)
    sum_g, sum_gx = jnp.sum(sgs, axis=(0, 1)), jnp.sum(sgxs, axis=(0, 1))
    weight = jnp.ones_like(rstd) if weight is None else weight
    count = n * h * w
    c1, c2 = weight * sum_g / count, weight * sum_gx / count
    dx = _elementwise_call(_bn_dx_kernel, cfg, b, n, 2, 5, x.dtype, "batch_norm_dx")(x3, g3, mean, rstd, weight, c1, c2)
    return dx[:, :c, : h * w].reshape(n, c, h, w), sum_gx[:c, 0], sum_g[:c, 0]


# ---------------------------------------------------------------- custom_jvp glue
# Hand-written jax.numpy tangents (shared with layer norm), linear in the tangents.


def _chan(v: jax.Array) -> jax.Array:
    return v.reshape(1, -1, 1, 1)


_DIMS = dict(axes=_AXES, stat=_chan, param=_chan)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _bn_fwd(key: tuple, x: jax.Array, w: jax.Array | None, b: jax.Array | None):
    cfg, eps = key
    params = [p for p in (w, b) if p is not None]
    rule = "n c h w" + ", c" * len(params) + " -> n c h w, c, c, c"
    local_key = (cfg, eps, w is not None, b is not None)
    return sharded_call(_bn_fwd_local, local_key, rule, x, *params, replicated="n h w")


@_bn_fwd.defjvp
def _bn_fwd_jvp(key, primals, tangents):
    x, w, b = primals
    out = _bn_fwd(key, x, w, b)
    y, mean, var, rstd = out
    dy, dmean, dvar, drstd = _norm_jvp.forward_tangents(x, w, mean, rstd, *tangents, **_DIMS)
    return out, tuple(t.astype(o.dtype) for t, o in zip((dy, dmean, dvar, drstd), out))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _bn_bwd(cfg: Config, x, w, mean, rstd, g):
    has_w = w is not None
    arrays = (x, w, mean, rstd, g) if has_w else (x, mean, rstd, g)
    rule = "n c h w" + ", c" * has_w + ", c, c, n c h w -> n c h w, c, c"
    return sharded_call(_bn_bwd_local, (cfg, has_w), rule, *arrays, replicated="n h w")


@_bn_bwd.defjvp
def _bn_bwd_jvp(cfg, primals, tangents):
    out = _bn_bwd(cfg, *primals)
    t = _norm_jvp.backward_tangents(*primals, *tangents, param_axes=_AXES, **_DIMS)
    return out, tuple(ti.astype(o.dtype) for ti, o in zip(t, out))


def batch_norm_train_pallas(
    x: jax.Array, weight: jax.Array | None, bias: jax.Array | None, *, eps: float, cfg: Config
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The Pallas training forward (see :func:`batch_norm_train_fwd`)."""
    return _bn_fwd((cfg, eps), x, weight, bias)


def batch_norm_train_bwd_pallas(
    x: jax.Array,
    weight: jax.Array | None,
    mean: jax.Array,
    rstd: jax.Array,
    g: jax.Array,
    *,
    has_bias: bool,
    cfg: Config,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """The Pallas training backward (see :func:`batch_norm_train_bwd`)."""
    dx, dw, db = _bn_bwd(cfg, x, weight, mean, rstd, g)
    return (
        dx,
        dw.astype(weight.dtype) if weight is not None else None,
        db.astype(g.dtype) if has_bias else None,
    )


# ---------------------------------------------------------------- reference


def batch_norm_train_reference(x, weight, bias, *, eps: float):
    """-> (y, batch mean [C], biased batch var [C], rstd [C])."""
    xf = upcast(x)
    mean = jnp.mean(xf, axis=_AXES)
    xc = xf - _chan(mean)
    var = jnp.mean(xc * xc, axis=_AXES)
    rstd = lax.rsqrt(var + eps)
    y = xc * _chan(rstd)
    if weight is not None:
        y = y * _chan(upcast(weight))
    if bias is not None:
        y = y + _chan(upcast(bias))
    return y.astype(x.dtype), mean, var, rstd


def batch_norm_train_bwd_reference(x, weight, mean, rstd, g, *, has_bias: bool):
    """Training-mode gradients (the statistics depend on x)."""
    xf, gf = upcast(x), upcast(g)
    xhat = (xf - _chan(mean)) * _chan(rstd)
    # two reductions over the activation: with dxhat = g * w per channel,
    # mean(dxhat) = w * sum(g) / n and mean(dxhat * xhat) = w * sum(g * xhat) / n
    sum_g = jnp.sum(gf, axis=_AXES)
    sum_gx = jnp.sum(gf * xhat, axis=_AXES)
    inv_n = 1.0 / (x.shape[0] * x.shape[2] * x.shape[3])
    scale = rstd * upcast(weight) if weight is not None else rstd
    dx = (_chan(scale) * (gf - _chan(sum_g * inv_n) - xhat * _chan(sum_gx * inv_n))).astype(x.dtype)
    dw = sum_gx.astype(weight.dtype) if weight is not None else None
    db = sum_g.astype(g.dtype) if has_bias else None
    return dx, dw, db


# ---------------------------------------------------------------- entry points


def batch_norm_train_fwd(
    x: jax.Array, weight: jax.Array | None, bias: jax.Array | None, eps: float = 1e-5
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(y, mean, var, rstd)`` with batch statistics per channel of ``x:[B, C, H, W]``."""
    return call(batch_norm_train_reference, batch_norm_train_pallas, x, weight, bias, eps=eps)


def batch_norm_train_bwd(
    x: jax.Array, weight: jax.Array | None, mean: jax.Array, rstd: jax.Array, g: jax.Array, has_bias: bool = True
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """``(dx, dweight | None, dbias | None)`` in training mode."""
    return call(
        batch_norm_train_bwd_reference, batch_norm_train_bwd_pallas, x, weight, mean, rstd, g, has_bias=has_bias
    )


MOSAIC_GPU[batch_norm_train_pallas] = mosaic_gpu.batch_norm_train_mgpu
MOSAIC_GPU[batch_norm_train_bwd_pallas] = mosaic_gpu.batch_norm_train_bwd_mgpu
