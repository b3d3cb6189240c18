"""Layer norm over the last axis: Pallas forward (saving mean and 1/std) and
backward kernels, their ``custom_jvp`` glue, and the jax.numpy reference.

Rows ``[N, D]`` are normalised per program: one pass over the row's chunks
gives the mean and variance (each chunk's centred moments merged with Chan's
update, as stable as two passes), a second pass writes. The backward writes ``dx`` per row and, for ``dw``/``db``,
one partial column sum per row block (in an 8-row tile for TPU alignment) that
the host adds up: GPU programs run concurrently, so they cannot accumulate into
one shared output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from . import _norm_jvp, blocks, mosaic_gpu
from ._pallas import Config, RowPasses, first_row, iota, merge_moments, pad_to, pallas_call, unpad
from ._sharding import sharded_call
from .dispatch import MOSAIC_GPU, call
from .precision import compute_dtype, upcast

_PARTIAL_ROWS = blocks.SUBLANE

# ---------------------------------------------------------------- kernels


def _ln_fwd_kernel(*refs, n_cols: int, eps: float, has_w: bool, has_b: bool, rp: RowPasses):
    # Inputs: x_ref [rows, cols_pad], w_ref [1, cols_pad]?, b_ref [1, cols_pad]? (or one chunk on the grid)
    # Outputs: y_ref like x_ref, mean_ref [rows, 1], rstd_ref [rows, 1]
    # Scratch on the grid: the running count, mean and centred sum of squares [rows, 1]
    n_in = 1 + has_w + has_b
    x_ref, params, (y_ref, mean_ref, rstd_ref), scratch = (
        refs[0],
        list(refs[1:n_in]),
        refs[n_in : n_in + 3],
        refs[n_in + 3 :],
    )
    w_ref = params.pop(0) if has_w else None
    b_ref = params.pop(0) if has_b else None
    rows = x_ref.shape[0]
    read = rp.reader()

    def moments(i, state):
        # one read per chunk: its own mean and centred squares, merged (padded columns hold zeros)
        x = read(x_ref, i)
        valid = iota((rows, rp.chunk), 1, i * rp.chunk) < n_cols
        count = jnp.minimum(n_cols - i * rp.chunk, rp.chunk).astype(jnp.float32)
        total = jnp.sum(x, axis=1, keepdims=True)
        xc = jnp.where(valid, x - total / count, 0.0)
        return merge_moments(state, count, total, jnp.sum(xc * xc, axis=1, keepdims=True))

    def stats(state):
        _, mean, m2 = state
        return mean, lax.rsqrt(m2 / n_cols + eps)

    def done(state):
        mean_ref[...], rstd_ref[...] = stats(state)

    def write(i, state):
        mean, rstd = stats(state)
        y = (read(x_ref, i) - mean) * rstd
        if w_ref is not None:
            y = y * read(w_ref, i)
        if b_ref is not None:
            y = y + read(b_ref, i)
        rp.store(y_ref, i, y)

    zero = jnp.zeros((rows, 1), jnp.float32)
    rp.run(scratch, (jnp.zeros((rows, 1), jnp.float32), zero, zero), moments, write, done)


def _ln_bwd_kernel(*refs, n_cols: int, has_w: bool, rp: RowPasses):
    # Inputs: x_ref [rows, cols_pad], w_ref [1, cols_pad]?, mean_ref, rstd_ref [rows, 1],
    #         g_ref [rows, cols_pad] (or one chunk on the grid)
    # Outputs: dx_ref like x_ref, dw_ref, db_ref [8, cols_pad] (row 0: this block's column sums,
    #          written by the first pass)
    # Scratch on the grid: the row sums c1, c2 [rows, 1]
    n_in = 4 + has_w
    ins, (dx_ref, dw_ref, db_ref), scratch = refs[:n_in], refs[n_in : n_in + 3], refs[n_in + 3 :]
    x_ref, rest = ins[0], list(ins[1:])
    w_ref = rest.pop(0) if has_w else None
    mean_ref, rstd_ref, g_ref = rest
    rows = x_ref.shape[0]
    read = rp.reader()
    mean, rstd = mean_ref[...], rstd_ref[...]

    def parts(i):
        g = read(g_ref, i)
        xhat = (read(x_ref, i) - mean) * rstd
        dxhat = g * read(w_ref, i) if w_ref is not None else g
        return g, xhat, dxhat

    def sums(i, carry):
        c1, c2 = carry
        g, xhat, dxhat = parts(i)
        rp.store(dw_ref, i, first_row(jnp.sum(g * xhat, axis=0, keepdims=True), _PARTIAL_ROWS))
        rp.store(db_ref, i, first_row(jnp.sum(g, axis=0, keepdims=True), _PARTIAL_ROWS))
        c1 = c1 + jnp.sum(dxhat, axis=1, keepdims=True)
        c2 = c2 + jnp.sum(dxhat * xhat, axis=1, keepdims=True)
        return c1, c2

    def write(i, carry):
        c1, c2 = carry[0] / n_cols, carry[1] / n_cols
        _, xhat, dxhat = parts(i)
        rp.store(dx_ref, i, rstd * (dxhat - c1 - xhat * c2))

    zero = jnp.zeros((rows, 1), jnp.float32)
    rp.run(scratch, (zero, zero), sums, write)


# Static keys: a tuple (Config, ...) so one jit/custom_partitioning cache entry
# serves each configuration.


@functools.partial(jax.jit, static_argnums=0)
def _ln_fwd_local(key: tuple, x: jax.Array, *params: jax.Array):
    cfg, eps, has_w, has_b = key
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    n, c = x2.shape
    b = blocks.row_blocks(n, c, cfg.target)
    rp = RowPasses.of(b)
    kernel = functools.partial(_ln_fwd_kernel, n_cols=c, eps=eps, has_w=has_w, has_b=has_b, rp=rp)
    args = [pad_to(x2, (b.rows_pad, b.cols_pad))] + [pad_to(p.reshape(1, c), (1, b.cols_pad)) for p in params]
    y, mean, rstd = pallas_call(
        kernel,
        cfg,
        name="layer_norm_fwd",
        grid=rp.grid(b.rows_pad // b.block_rows),
        in_specs=[rp.row_spec(b)] + [rp.param_spec(b)] * len(params),
        out_specs=(rp.row_spec(b, written=True), rp.stat_spec(b), rp.stat_spec(b)),
        out_shape=(
            jax.ShapeDtypeStruct((b.rows_pad, b.cols_pad), x.dtype),
            jax.ShapeDtypeStruct((b.rows_pad, 1), jnp.float32),
            jax.ShapeDtypeStruct((b.rows_pad, 1), jnp.float32),
        ),
        **rp.params(b, n_carry=3),
    )(*args)
    st = compute_dtype(x.dtype)
    stat = lambda v: v[:n, 0].reshape(shape[:-1]).astype(st)  # noqa: E731
    return unpad(y, (n, c)).reshape(shape), stat(mean), stat(rstd)


@functools.partial(jax.jit, static_argnums=0)
def _ln_bwd_local(key: tuple, x: jax.Array, *rest: jax.Array):
    cfg, has_w = key
    w = rest[0] if has_w else None
    mean, rstd, g = rest[1:] if has_w else rest
    shape = x.shape
    x2, g2 = x.reshape(-1, shape[-1]), g.reshape(-1, shape[-1])
    n, c = x2.shape
    b = blocks.row_blocks(n, c, cfg.target)
    grid = b.rows_pad // b.block_rows
    col = lambda v: pad_to(v.reshape(-1, 1).astype(jnp.float32), (b.rows_pad, 1))  # noqa: E731
    args = [pad_to(x2, (b.rows_pad, b.cols_pad))]
    if has_w:
        args.append(pad_to(w.reshape(1, c), (1, b.cols_pad)))
    args += [col(mean), col(rstd), pad_to(g2, (b.rows_pad, b.cols_pad))]
    rp = RowPasses.of(b)
    partial_spec = rp.partial_spec(b)
    partial_shape = jax.ShapeDtypeStruct((grid * _PARTIAL_ROWS, b.cols_pad), jnp.float32)
    kernel = functools.partial(_ln_bwd_kernel, n_cols=c, has_w=has_w, rp=rp)
    dx, dw, db = pallas_call(
        kernel,
        cfg,
        name="layer_norm_bwd",
        grid=rp.grid(grid),
        in_specs=[rp.row_spec(b)] + [rp.param_spec(b)] * has_w + [rp.stat_spec(b)] * 2 + [rp.row_spec(b)],
        out_specs=(rp.row_spec(b, written=True), partial_spec, partial_spec),
        out_shape=(jax.ShapeDtypeStruct((b.rows_pad, b.cols_pad), x.dtype), partial_shape, partial_shape),
        **rp.params(b, n_carry=2),
    )(*args)
    return unpad(dx, (n, c)).reshape(shape), jnp.sum(dw, axis=0)[:c], jnp.sum(db, axis=0)[:c]


# ---------------------------------------------------------------- custom_jvp glue
# Tangent rules are jax.numpy (shared with batch norm in _norm_jvp.py), linear
# in the tangents, so jax.jvp / linearize / grad all work on the Pallas path.


def _stat(v: jax.Array) -> jax.Array:
    return v[..., None]


def _last_axis(x: jax.Array):
    nd = x.ndim
    param = lambda v: v.reshape((1,) * (nd - 1) + v.shape)  # noqa: E731
    return dict(axes=(nd - 1,), stat=_stat, param=param)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _ln_fwd(key: tuple, x: jax.Array, w: jax.Array | None, b: jax.Array | None):
    cfg, eps = key
    params = [p for p in (w, b) if p is not None]
    rule = "... d" + ", d" * len(params) + " -> ... d, ..., ..."
    return sharded_call(_ln_fwd_local, (cfg, eps, w is not None, b is not None), rule, x, *params, replicated="d")


@_ln_fwd.defjvp
def _ln_fwd_jvp(key, primals, tangents):
    x, w, b = primals
    dx, dw, db = tangents
    y, mean, rstd = _ln_fwd(key, x, w, b)
    dy, dmean, _, drstd = _norm_jvp.forward_tangents(x, w, mean, rstd, dx, dw, db, **_last_axis(x))
    return (y, mean, rstd), (dy.astype(y.dtype), dmean.astype(mean.dtype), drstd.astype(rstd.dtype))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _ln_bwd(cfg: Config, x, w, mean, rstd, g):
    has_w = w is not None
    arrays = (x, w, mean, rstd, g) if has_w else (x, mean, rstd, g)
    rule = "... d" + ", d" * has_w + ", ..., ..., ... d -> ... d, d, d"
    return sharded_call(_ln_bwd_local, (cfg, has_w), rule, *arrays, replicated="d")


@_ln_bwd.defjvp
def _ln_bwd_jvp(cfg, primals, tangents):
    x, w, mean, rstd, g = primals
    out = _ln_bwd(cfg, x, w, mean, rstd, g)
    dims = _last_axis(x)
    t = _norm_jvp.backward_tangents(*primals, *tangents, param_axes=tuple(range(x.ndim - 1)), **dims)
    return out, tuple(ti.astype(o.dtype) for ti, o in zip(t, out))


def layer_norm_fwd_pallas(
    x: jax.Array, weight: jax.Array | None, bias: jax.Array | None, *, eps: float, cfg: Config
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The Pallas forward (see :func:`layer_norm_fwd`)."""
    if x.ndim == 1:  # one row: give the statistics a (size-1) row axis
        y, mean, rstd = _ln_fwd((cfg, eps), x[None], weight, bias)
        return y[0], mean[0], rstd[0]
    return _ln_fwd((cfg, eps), x, weight, bias)


def layer_norm_bwd_pallas(
    x: jax.Array,
    weight: jax.Array | None,
    mean: jax.Array,
    rstd: jax.Array,
    g: jax.Array,
    *,
    has_bias: bool,
    cfg: Config,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """The Pallas backward (see :func:`layer_norm_bwd`)."""
    if x.ndim == 1:
        dx, dw, db = _ln_bwd(cfg, x[None], weight, mean[None], rstd[None], g[None])
        dx = dx[0]
    else:
        dx, dw, db = _ln_bwd(cfg, x, weight, mean, rstd, g)
    return (
        dx,
        dw.astype(weight.dtype) if weight is not None else None,
        db.astype(g.dtype) if has_bias else None,
    )


# ---------------------------------------------------------------- reference


def _row(v: jax.Array, ndim: int) -> jax.Array:
    """A ``[D]`` parameter shaped to broadcast over ``ndim``-rank rows."""
    return upcast(v).reshape((1,) * (ndim - 1) + v.shape)


def layer_norm_fwd_reference(x, weight, bias, *, eps: float):
    xf = upcast(x)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    xc = xf - mean
    var = jnp.mean(xc * xc, axis=-1, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    y = xc * rstd
    if weight is not None:
        y = y * _row(weight, x.ndim)
    if bias is not None:
        y = y + _row(bias, x.ndim)
    return y.astype(x.dtype), mean[..., 0], rstd[..., 0]


def layer_norm_bwd_reference(x, weight, mean, rstd, g, *, has_bias: bool):
    xf, gf = upcast(x), upcast(g)
    rstd_ = rstd[..., None]
    xhat = (xf - mean[..., None]) * rstd_
    dxhat = gf * _row(weight, x.ndim) if weight is not None else gf
    c1 = jnp.mean(dxhat, axis=-1, keepdims=True)
    c2 = jnp.mean(dxhat * xhat, axis=-1, keepdims=True)
    dx = (rstd_ * (dxhat - c1 - xhat * c2)).astype(x.dtype)
    lead = tuple(range(x.ndim - 1))
    dw = jnp.sum(gf * xhat, axis=lead).astype(weight.dtype) if weight is not None else None
    db = jnp.sum(gf, axis=lead).astype(g.dtype) if has_bias else None
    return dx, dw, db


# ---------------------------------------------------------------- entry points


def layer_norm_fwd(
    x: jax.Array, weight: jax.Array | None, bias: jax.Array | None, eps: float = 1e-5
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(y, mean, rstd)``; ``mean``/``rstd`` have shape ``x.shape[:-1]`` (float32
    for low-precision inputs)."""
    return call(layer_norm_fwd_reference, layer_norm_fwd_pallas, x, weight, bias, eps=eps)


def layer_norm_bwd(
    x: jax.Array, weight: jax.Array | None, mean: jax.Array, rstd: jax.Array, g: jax.Array, has_bias: bool = True
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """``(dx, dweight | None, dbias | None)`` from the saved statistics."""
    return call(layer_norm_bwd_reference, layer_norm_bwd_pallas, x, weight, mean, rstd, g, has_bias=has_bias)


MOSAIC_GPU[layer_norm_fwd_pallas] = mosaic_gpu.layer_norm_fwd_mgpu
MOSAIC_GPU[layer_norm_bwd_pallas] = mosaic_gpu.layer_norm_bwd_mgpu
