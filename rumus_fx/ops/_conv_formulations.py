"""conv2d's formulations: the products ``y``, ``dx`` and ``dw`` of a 2-D
convolution (NCHW / OIHW, square kernels, symmetric zero padding) written as
one convolution ("conv"), as im2col and dots ("dot", "bdot") or as one matrix
product over a channel-major im2col ("gemm"), and the window helpers they share
with im2col and max_pool2d. Which one runs: ``_conv_plan.conv_plan``.

Note [Convolution formulations]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each of conv2d's three products (y, dx, dw) has formulations that give the
same numbers (up to float summation order):

* "conv": one ``lax.conv_general_dilated`` (dx the transposed convolution,
  dw the input/gradient correlation).
* "dot": im2col as K*K strided slices of the (padded) input, then one
  ``dot_general`` against the weight as an ``[O, C*K*K]`` matrix; dx is the
  dot's transpose followed by col2im (K*K placements, see ``col2im``).
* "bdot" (dw only): the same im2col, one product per sample contracting the
  positions, summed over the batch.
* "gemm" (y and dw, under a trace): the im2col laid out channel-major,
  ``[C*K*K, B*OH*OW]`` (x's batch and channel axes swapped first, a move of
  whole image rows), so y is one plain matrix product ``[O, C*K*K] x
  [C*K*K, B*OH*OW]`` and dw another (dy's batch and channel axes swapped the
  same way, contracting batch and positions together): two large products
  where "bdot" makes B small ones. Under ``jax.jit`` the forward's im2col and
  dw's are the same expression of the saved x, which XLA computes once.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..kernels.precision import is_low_precision

Array = jax.Array


def spatial_pad(ndim: int, lo_h: int, hi_h: int, lo_w: int, hi_w: int, interior: int = 0) -> list:
    return [(0, 0, 0)] * (ndim - 2) + [(lo_h, hi_h, interior), (lo_w, hi_w, interior)]


def window_slices(xp: Array, k: int, s: int, oh: int, ow: int) -> list[Array]:
    """The k*k strided slices ``xp[..., kh::s, kw::s]`` (row-major over kh, kw)."""
    out = []
    for kh in range(k):
        for kw in range(k):
            start = (0,) * (xp.ndim - 2) + (kh, kw)
            limit = tuple(xp.shape[:-2]) + (kh + s * (oh - 1) + 1, kw + s * (ow - 1) + 1)
            strides = (1,) * (xp.ndim - 2) + (s, s)
            out.append(lax.slice(xp, start, limit, strides))
    return out


def _place(piece: Array, kh: int, kw: int, s: int, p: int, h: int, w: int) -> Array:
    """Scatter a ``[..., OH, OW]`` window slice back to ``[..., H, W]`` positions
    ``(kh + s*i - p, kw + s*j - p)`` with one ``lax.pad`` (interior = stride - 1,
    negative edges crop the zero padding)."""
    oh, ow = piece.shape[-2:]
    span_h, span_w = s * (oh - 1) + 1, s * (ow - 1) + 1
    lo_h, lo_w = kh - p, kw - p
    hi_h, hi_w = h - lo_h - span_h, w - lo_w - span_w
    return lax.pad(piece, np.zeros((), piece.dtype), spatial_pad(piece.ndim, lo_h, hi_h, lo_w, hi_w, s - 1))


def col2im(piece_of: Any, k: int, s: int, p: int, h: int, w: int) -> Array:
    """The sum over window offsets ``j = kh*K + kw`` of ``piece_of(j)`` (a
    ``[..., OH, OW]`` gradient slice) placed back at its input positions: the
    adjoint of taking the k*k strided window slices."""
    dx = None
    for j in range(k * k):
        kh, kw = divmod(j, k)
        placed = _place(piece_of(j), kh, kw, s, p, h, w)
        dx = placed if dx is None else dx + placed
    return dx


_NCHW = ("NCHW", "OIHW", "NCHW")


def _conv(lhs: Array, rhs: Array, out_dtype: Any, out_sharding: Any = None, **kw: Any) -> Array:
    pref = jnp.float32 if is_low_precision(out_dtype) else None
    if out_sharding is None:
        return lax.conv_general_dilated(lhs, rhs, preferred_element_type=pref, **kw).astype(out_dtype)
    y = lax.conv_general_dilated(lhs, rhs, preferred_element_type=pref, out_sharding=out_sharding, **kw)
    return y.astype(out_dtype)


def _pref(dtype: Any) -> Any:
    return jnp.float32 if is_low_precision(dtype) else None


def _cols(xv: Array, k: int, s: int, p: int, oh: int, ow: int) -> Array:
    """im2col of ``x:[B, C, H, W]`` as ``[B, C*K*K, OH*OW]`` (row ``c*K*K + kh*K + kw``)."""
    b, c = xv.shape[:2]
    if k == 1 and s == 1 and p == 0:
        return xv.reshape(b, c, oh * ow)
    xp = jnp.pad(xv, [(0, 0), (0, 0), (p, p), (p, p)]) if p else xv
    cols = jnp.stack(window_slices(xp, k, s, oh, ow), axis=2)  # [B, C, K*K, OH, OW]
    return cols.reshape(b, c * k * k, oh * ow)


def conv_dot_forward(xv: Array, wv: Array, s: int, p: int, out_dtype: Any) -> Array:
    """``conv2d(x, w)`` as im2col + one dot (the "dot" formulation): a 1x1
    kernel as one channels-last matrix product (``_dot_forward_nhwc``), larger
    kernels as one product per sample in NCHW (``_dot_forward_nchw``)."""
    if wv.shape[2] == 1:
        return _dot_forward_nhwc(xv, wv, s, p, out_dtype)
    return _dot_forward_nchw(xv, wv, s, p, out_dtype)


def _dot_forward_nchw(xv: Array, wv: Array, s: int, p: int, out_dtype: Any) -> Array:
    """``y[b] = w @ im2col(x[b])``: ``[O, C*K*K]`` times ``[C*K*K, OH*OW]`` per
    sample, batched, so ``y`` comes out NCHW: the batch norm, relu and pool
    fusions XLA builds behind the convolution read ``y`` in NCHW order, and
    from a channels-last ``y`` every one of them reads through a transpose
    (RESULTS.md, "Thresholds in the code")."""
    b, c, h, w = xv.shape
    o, _, k, _ = wv.shape
    oh, ow = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    cols = _cols(xv, k, s, p, oh, ow)  # [B, CKK, P]
    wb = jnp.broadcast_to(wv.reshape(1, o, c * k * k), (b, o, c * k * k))
    y = lax.dot_general(wb, cols, (((2,), (1,)), ((0,), (0,))), preferred_element_type=_pref(out_dtype))
    return y.reshape(b, o, oh, ow).astype(out_dtype)


def _dot_forward_nhwc(xv: Array, wv: Array, s: int, p: int, out_dtype: Any) -> Array:
    """One plain matrix product, laid out channels-last: patches
    ``[B*OH*OW, K*K*C]`` (the K*K strided slices of the NHWC input side by
    side) times ``[K*K*C, O]``."""
    b, c, h, w = xv.shape
    o, _, k, _ = wv.shape
    oh, ow = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    xn = xv.reshape(b, h, w, 1) if c == 1 else jnp.transpose(xv, (0, 2, 3, 1))
    if p:
        xn = jnp.pad(xn, [(0, 0), (p, p), (p, p), (0, 0)])
    pieces = [
        lax.slice(xn, (0, kh, kw, 0), (b, kh + s * (oh - 1) + 1, kw + s * (ow - 1) + 1, c), (1, s, s, 1))
        for kh in range(k)
        for kw in range(k)
    ]
    cols = (pieces[0] if k == 1 else jnp.concatenate(pieces, axis=-1)).reshape(b * oh * ow, k * k * c)
    w2 = jnp.transpose(wv, (2, 3, 1, 0)).reshape(k * k * c, o)
    y = lax.dot_general(cols, w2, (((1,), (0,)), ((), ())), preferred_element_type=_pref(out_dtype))
    return jnp.transpose(y.reshape(b, oh, ow, o), (0, 3, 1, 2)).astype(out_dtype)


def conv_dot_dw(xv: Array, g: Array, k: int, s: int, p: int, out_dtype: Any, per_sample: bool = False) -> Array:
    """``dw[o, c, kh, kw]`` as ``g`` contracted with the im2col of ``x``: over
    batch and positions in one product ("dot"), or with ``per_sample`` one
    batched product per sample (``g[b]`` against the im2col of ``x[b]``, both
    NCHW, contracting the positions) summed over the batch ("bdot")."""
    b, o, oh, ow = g.shape
    c = xv.shape[1]
    cols = _cols(xv, k, s, p, oh, ow)  # [B, CKK, P]
    dims = (((2,), (2,)), ((0,), (0,))) if per_sample else (((0, 2), (0, 2)), ((), ()))
    dw = lax.dot_general(g.reshape(b, o, oh * ow), cols, dims, preferred_element_type=_pref(out_dtype))
    if per_sample:  # [B, O, CKK]
        dw = jnp.sum(dw, axis=0)
    return dw.reshape(o, c, k, k).astype(out_dtype)


def conv_dot_dx(wv: Array, g: Array, h: int, w: int, s: int, p: int, out_dtype: Any) -> Array:
    """``dx`` as the transposed dot (``w^T g`` per position) followed by col2im."""
    b, o, oh, ow = g.shape
    _, c, k, _ = wv.shape
    d = lax.dot_general(
        g.reshape(b, o, oh * ow),
        wv.reshape(o, c * k * k),
        (((1,), (0,)), ((), ())),
        preferred_element_type=_pref(out_dtype),
    )  # [B, P, CKK]
    d = jnp.transpose(d, (0, 2, 1)).reshape(b, c, k * k, oh, ow)
    return col2im(lambda j: d[:, :, j], k, s, p, h, w).astype(out_dtype)


def _cols_channel_major(xv: Array, k: int, s: int, p: int, oh: int, ow: int) -> Array:
    """im2col of ``x:[B, C, H, W]`` as ``[C*K*K, B*OH*OW]``: row ``c*K*K + kh*K +
    kw``, column ``b*OH*OW + oh*OW + ow`` (the "gemm" formulation's operand)."""
    b, c = xv.shape[:2]
    xt = jnp.transpose(xv, (1, 0, 2, 3))  # [C, B, H, W]: whole rows of W move
    xp = jnp.pad(xt, [(0, 0), (0, 0), (p, p), (p, p)]) if p else xt
    cols = jnp.stack(window_slices(xp, k, s, oh, ow), axis=1)  # [C, K*K, B, OH, OW]
    return cols.reshape(c * k * k, b * oh * ow)


def _channel_major(g: Array) -> Array:
    """``g:[B, O, OH, OW]`` as ``[O, B*OH*OW]``."""
    b, o, oh, ow = g.shape
    return jnp.transpose(g, (1, 0, 2, 3)).reshape(o, b * oh * ow)


def conv_gemm_forward(xv: Array, wv: Array, s: int, p: int, out_dtype: Any) -> Array:
    """``conv2d(x, w)`` as one matrix product ``[O, C*K*K] x [C*K*K, B*OH*OW]``
    over the channel-major im2col (the "gemm" formulation), the result's
    batch and channel axes swapped back."""
    b, c, h, w = xv.shape
    o, _, k, _ = wv.shape
    oh, ow = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    cols = _cols_channel_major(xv, k, s, p, oh, ow)
    yt = lax.dot_general(
        wv.reshape(o, c * k * k), cols, (((1,), (0,)), ((), ())), preferred_element_type=_pref(out_dtype)
    )
    return jnp.transpose(yt.reshape(o, b, oh, ow), (1, 0, 2, 3)).astype(out_dtype)


def conv_gemm_dw(xv: Array, g: Array, k: int, s: int, p: int, out_dtype: Any) -> Array:
    """``dw`` as one matrix product ``[O, B*OH*OW] x [C*K*K, B*OH*OW]^T``
    contracting batch and positions together (the "gemm" formulation)."""
    b, o, oh, ow = g.shape
    c = xv.shape[1]
    cols = _cols_channel_major(xv, k, s, p, oh, ow)
    dw = lax.dot_general(_channel_major(g), cols, (((1,), (1,)), ((), ())), preferred_element_type=_pref(out_dtype))
    return dw.reshape(o, c, k, k).astype(out_dtype)


def conv_conv_forward(xv: Array, wv: Array, s: int, p: int, out_dtype: Any, out_sharding: Any = None) -> Array:
    return _conv(
        xv, wv, out_dtype, out_sharding, window_strides=(s, s), padding=[(p, p), (p, p)], dimension_numbers=_NCHW
    )


def conv_conv_dx(wv: Array, g: Array, h: int, w: int, s: int, p: int, out_dtype: Any, out_sharding: Any = None):
    k = wv.shape[2]
    oh, ow = g.shape[2], g.shape[3]
    return _conv(
        g,
        jnp.flip(wv, (2, 3)),
        out_dtype,
        out_sharding,
        window_strides=(1, 1),
        padding=[(k - 1 - p, h - 1 - (oh - 1) * s + p), (k - 1 - p, w - 1 - (ow - 1) * s + p)],
        lhs_dilation=(s, s),
        dimension_numbers=("NCHW", "IOHW", "NCHW"),
    )


def conv_conv_dw(xv: Array, g: Array, k: int, s: int, p: int, out_dtype: Any, out_sharding: Any = None) -> Array:
    h, w = xv.shape[2], xv.shape[3]
    oh, ow = g.shape[2], g.shape[3]
    r_h = (h + 2 * p - k) - (oh - 1) * s
    r_w = (w + 2 * p - k) - (ow - 1) * s
    return _conv(
        xv,
        g,
        out_dtype,
        out_sharding,
        window_strides=(1, 1),
        padding=[(p, p - r_h), (p, p - r_w)],
        rhs_dilation=(s, s),
        dimension_numbers=("CNHW", "IOHW", "CNHW"),
    )
