"""Vision ops: im2col, conv2d, add_channel_bias, max_pool2d, adaptive_avg_pool2d.

Layouts follow rumus (and PyTorch): images ``[..., C, H, W]``, conv weights
``[O, C, K, K]``, square kernels, symmetric zero padding. conv2d's products
have several formulations (``_conv_formulations.py``) and a plan that picks
one per product (``_conv_plan.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import sharding as shd
from ..autograd.record import Record, VersionSnapshot
from ..compiler import CPU_COMPILER_OPTIONS, JitTracer, same_branches
from ..eager import compiled, cpu_options, eager_jit
from ..errors import ShapeError
from ..kernels.precision import compute_dtype, upcast
from ..tensor import Tensor, lifting
from ._conv_formulations import (
    col2im,
    conv_conv_dw,
    conv_conv_dx,
    conv_conv_forward,
    conv_dot_dw,
    conv_dot_dx,
    conv_dot_forward,
    conv_gemm_dw,
    conv_gemm_forward,
    spatial_pad,
    window_slices,
)
from ._conv_plan import cols_size, conv_plan
from ._core import (
    acc_sum,
    array_of,
    cast,
    is_tracked,
    new_output,
    reads,
    record,
    require_float,
    shape_of,
    static_int,
    tape_for,
)
from ._declare import BadInput, Placeholder, Sample, integers, normal, op, tracked

Array = jax.Array
frozen = dataclasses.dataclass(frozen=True, eq=False)


def _out_size(op: str, size: int, k: int, s: int, p: int, what: str) -> int:
    if size + 2 * p < k:
        raise ShapeError(
            f"{op}: kernel_size {k} is larger than the padded input ({what} {size} + 2*padding {p} = {size + 2 * p})"
        )
    return (size + 2 * p - k) // s + 1


def _window_args(op: str, kernel_size: Any, stride: Any, padding: Any) -> tuple[int, int, int]:
    k = static_int(op, "kernel_size", kernel_size, 1)
    s = static_int(op, "stride", k if stride is None else stride, 1)
    p = static_int(op, "padding", padding, 0)
    return k, s, p


# ---------------------------------------------------------------------------
# im2col
# ---------------------------------------------------------------------------


@frozen
class Im2ColBackward(Record):
    """``cols = im2col(x)``: ``dx = col2im(dcols)``, a sum of k*k strided
    placements. Reads no data."""

    c_in: int
    h: int
    w: int
    kernel_size: int
    stride: int
    padding: int
    out_h: int
    out_w: int

    def backward(self, g, needs):
        k, s, p = self.kernel_size, self.stride, self.padding
        lead = tuple(g.shape[:-2])
        g5 = shd.reshape(g, (*lead, self.c_in, k * k, self.out_h, self.out_w))
        return (col2im(lambda j: g5[..., j, :, :], k, s, p, self.h, self.w),)


@eager_jit(static_argnums=(1, 2, 3, 4, 5))
def _im2col_forward(xv: Array, k: int, s: int, p: int, oh: int, ow: int) -> Array:
    *lead, c, _, _ = xv.shape
    xp = jnp.pad(xv, [(0, 0)] * (xv.ndim - 2) + [(p, p), (p, p)]) if p else xv
    cols = jnp.stack(window_slices(xp, k, s, oh, ow), axis=-3)  # [..., C, K*K, OH, OW]
    return shd.reshape(cols, (*lead, c * k * k, oh * ow))


def ref_im2col(x: Any, k: int, stride: int = 1, padding: int = 0) -> Array:
    """The jax.numpy/lax oracle of ``im2col`` (op table)."""
    single = x.ndim == 3
    xb = x[None] if single else x.reshape((-1,) + x.shape[-3:])
    p = jax.lax.conv_general_dilated_patches(xb, (k, k), (stride, stride), [(padding, padding)] * 2)
    out = p.reshape(p.shape[0], p.shape[1], -1)
    return out[0] if single else out.reshape(x.shape[:-3] + out.shape[1:])


@op(
    records=(Im2ColBackward,),
    ref=ref_im2col,
    samples=lambda r: [
        Sample((normal(r, 2, 5, 6), 3)),
        Sample((normal(r, 2, 3, 7, 5), 3, 2, 1)),
        Sample((normal(r, 1, 2, 6, 6), 2, 2)),
        Sample((normal(r, 3, 5, 5), 3, 1, 1)),
    ],
    errors=lambda: [
        BadInput("rank-2 input", (tracked(5, 6), 3), ShapeError, ("(5, 6)",)),
        BadInput("kernel larger than padded input", (tracked(2, 5, 6), 8, 1, 1), ValueError, ("8",)),
        BadInput("kernel 0", (tracked(2, 5, 6), 0), ValueError),
        BadInput("float kernel", (tracked(2, 5, 6), 2.0), TypeError, ("2.0",)),
        BadInput("stride 0", (tracked(2, 5, 6), 3, 0), ValueError),
        BadInput("negative padding", (tracked(2, 5, 6), 3, 1, -1), ValueError),
    ],
)
def im2col(x: Any, kernel_size: int, stride: int = 1, padding: int = 0) -> Tensor:
    """Patches of ``x:[..., C, H, W]`` as ``[..., C*K*K, OH*OW]``: row
    ``c*K*K + kh*K + kw``, column ``oh*OW + ow``, zero padding; works on one
    sample ``[C, H, W]`` or a batch (records Im2ColBackward)."""
    op = "im2col"
    xv = array_of(x, op)
    if xv.ndim < 3:
        raise ShapeError(f"{op}: expects x of shape [..., C, H, W], got {xv.shape}")
    k, s, p = _window_args(op, kernel_size, stride, padding)
    *lead, c, h, w = xv.shape
    oh, ow = _out_size(op, h, k, s, p, "height"), _out_size(op, w, k, s, p, "width")
    out = _im2col_forward(xv, k, s, p, oh, ow)
    tape = tape_for(x)
    if tape is None:
        return Tensor._wrap(out)
    return record(tape, Im2ColBackward(c, h, w, k, s, p, oh, ow), (x,), new_output(out, tape))


# ---------------------------------------------------------------------------
# conv2d
# ---------------------------------------------------------------------------


def _conv_out_sharding(x: Array, w: Array) -> Any:
    """``[B, O, OH, OW]`` sharded like x's batch and w's output channels (explicit axes)."""
    xs, ws = shd.spec_of(x), shd.spec_of(w)
    if xs is None and ws is None:
        return None
    spec = ((xs or (None,))[0], (ws or (None,))[0], None, None)
    return shd.with_spec(shd.sharding_of(x) or shd.sharding_of(w), spec)


@frozen
class Conv2dBackward(Record):
    """``y = conv2d(x, w) (+ b)``, NCHW / OIHW, stride ``s``, padding ``p``.

    ``dx`` is the transposed convolution of ``dy`` (``dy`` dilated by ``s``,
    convolved with the flipped kernel, channels swapped); ``dw`` correlates
    ``x`` with ``dy`` dilated by ``s``; ``db`` sums ``dy``. One record for the
    whole op (rumus looped im2col + matmul per sample). Saves ``w`` only if
    ``x`` needs a gradient and ``x`` only if ``w`` does.
    """

    input: Array | None
    input_version: VersionSnapshot | None
    weight: Array | None
    weight_version: VersionSnapshot | None
    input_shape: tuple[int, ...]
    weight_shape: tuple[int, ...]
    stride: int
    padding: int
    input_dtype: Any
    weight_dtype: Any
    bias_dtype: Any
    input_sharding: Any = None  # explicit shardings (rumus_fx/sharding.py)
    weight_sharding: Any = None
    bias_sharding: Any = None
    # the forward ran eagerly on one CPU device: the rule, compiled on its own,
    # takes the eager plan with CPU_COMPILER_OPTIONS (``conv_plan``)
    cpu_eager: bool = False

    @property
    def compiler_options(self) -> Any:  # Note [Eager compiler options] (rumus_fx/eager.py)
        return CPU_COMPILER_OPTIONS if self.cpu_eager else None

    def backward(self, g, needs):
        s, p = self.stride, self.padding
        _, c, h, w = self.input_shape
        k = self.weight_shape[2]
        sharded = any(x is not None for x in (self.input_sharding, self.weight_sharding)) or shd.on_mesh(g)
        cols = cols_size(self.input_shape[0], c, h, w, k, s, p)
        _, plan_dx, plan_dw = ("conv",) * 3 if sharded else conv_plan(c, k, s, self.cpu_eager, cols)
        dx = dw = db = None
        if needs[0]:
            if plan_dx == "dot":
                dx = conv_dot_dx(self.weight, g, h, w, s, p, self.input_dtype)
            else:
                dx = conv_conv_dx(self.weight, g, h, w, s, p, self.input_dtype, self.input_sharding)
        if needs[1]:
            if plan_dw == "gemm":
                dw = conv_gemm_dw(self.input, g, k, s, p, self.weight_dtype)
            elif plan_dw in ("dot", "bdot"):
                dw = conv_dot_dw(self.input, g, k, s, p, self.weight_dtype, per_sample=plan_dw == "bdot")
            else:
                dw = conv_conv_dw(self.input, g, k, s, p, self.weight_dtype, self.weight_sharding)
        if len(needs) > 2 and needs[2]:
            db = shd.conform(cast(acc_sum(g, (0, 2, 3)), self.bias_dtype), self.bias_sharding)
        return (dx, dw, db)[: len(needs)]


def _conv2d_forward(xv: Array, wv: Array, bv: Array | None, s: int, p: int, options: Any) -> Array:
    """The forward product (plus bias): ``_conv2d_forward_impl`` through
    ``eager_jit``, or, with ``options`` (``eager.cpu_options``: concrete arrays
    on one CPU device), one cached compiled call with those XLA options."""
    if options is None:
        return _conv2d_forward_eager(xv, wv, bv, s, p, False)
    return compiled(_conv2d_forward_impl, (3, 4, 5), compiler_options=options)(xv, wv, bv, s, p, True)


def _conv2d_forward_impl(xv: Array, wv: Array, bv: Array | None, s: int, p: int, cpu_eager: bool) -> Array:
    out_dtype = jnp.result_type(xv, wv)
    out_sharding = _conv_out_sharding(xv, wv)
    _, c, k, _ = wv.shape
    b, _, h, w = xv.shape
    plan = "conv"
    if out_sharding is None and not shd.on_mesh(xv):
        plan = conv_plan(c, k, s, cpu_eager, cols_size(b, c, h, w, k, s, p))[0]
    if plan == "dot":
        y = conv_dot_forward(xv, wv, s, p, out_dtype)
    elif plan == "gemm":
        y = conv_gemm_forward(xv, wv, s, p, out_dtype)
    else:
        y = conv_conv_forward(xv, wv, s, p, out_dtype, out_sharding)
    if bv is not None:
        y = y + bv.reshape(1, -1, 1, 1).astype(out_dtype)
    return y


_conv2d_forward_eager = eager_jit(_conv2d_forward_impl, static_argnums=(3, 4, 5))


def ref_conv2d(x: Any, w: Any, b: Any = None, stride: int = 1, padding: int = 0) -> Array:
    """The lax oracle of ``conv2d`` (op table)."""
    y = jax.lax.conv_general_dilated(x, w, (stride, stride), [(padding, padding)] * 2)
    return y if b is None else y + b.reshape(1, -1, 1, 1)


@op(
    records=(Conv2dBackward,),
    ref=ref_conv2d,
    samples=lambda r: [
        Sample((normal(r, 2, 3, 7, 6), normal(r, 4, 3, 3, 3), normal(r, 4)), diff=(0, 1, 2)),
        Sample((normal(r, 2, 3, 7, 8), normal(r, 5, 3, 3, 3), None, 2, 1), diff=(0, 1)),
        Sample((normal(r, 1, 2, 6, 5), normal(r, 3, 2, 2, 2), normal(r, 3), 3, 0), diff=(0, 1, 2)),
        Sample((normal(r, 2, 1, 5, 5), normal(r, 2, 1, 5, 5), None, 1, 2), diff=(0, 1)),
        # one sample per formulation of conv_plan not taken above (Note [Convolution plan])
        Sample(
            (normal(r, 2, 4, 5, 5), normal(r, 3, 4, 1, 1), normal(r, 3), 2, 0), diff=(0, 1, 2)
        ),  # 1x1: y/dx dot, dw bdot
        Sample((normal(r, 1, 33, 3, 3), normal(r, 2, 33, 1, 1)), diff=(0, 1)),  # wide 1x1: dw dot
        Sample((normal(r, 1, 8, 5, 5), normal(r, 2, 8, 3, 3), None, 2, 1), diff=(0, 1)),  # y/dx conv, dw bdot
        Sample((normal(r, 1, 17, 4, 4), normal(r, 2, 17, 3, 3), None, 2, 1), diff=(0, 1)),  # all three conv
        # jit: y/dw gemm, dx conv; eagerly all three conv
        Sample((normal(r, 2, 5, 5, 4), normal(r, 3, 5, 3, 3), normal(r, 3), 1, 1), diff=(0, 1, 2)),
    ],
    errors=lambda: [
        BadInput("channels differ", (tracked(2, 3, 6, 6), tracked(4, 2, 3, 3)), ShapeError, ("(4, 2, 3, 3)",)),
        BadInput("rank-3 input", (tracked(3, 6, 6), tracked(4, 3, 3, 3)), ShapeError),
        BadInput("non-square kernel", (tracked(2, 3, 6, 6), tracked(4, 3, 3, 2)), ShapeError),
        BadInput("bias size", (tracked(2, 3, 6, 6), tracked(4, 3, 3, 3), tracked(3)), ShapeError, ("bias",)),
        BadInput("kernel larger than padded input", (tracked(1, 2, 4, 4), tracked(3, 2, 7, 7), None, 1, 1), ValueError),
        BadInput("stride 0", (tracked(1, 2, 6, 6), tracked(3, 2, 3, 3), None, 0), ValueError),
        BadInput("float padding", (tracked(1, 2, 6, 6), tracked(3, 2, 3, 3), None, 1, 1.5), TypeError),
        BadInput("integer weight", (tracked(1, 2, 6, 6), integers(3, 2, 3, 3)), TypeError),
        BadInput(
            "x and weight dtypes differ",
            (tracked(1, 2, 6, 6), Placeholder(lambda: Tensor._wrap(jnp.ones((3, 2, 3, 3), jnp.bfloat16)))),
            TypeError,
            ("float32", "bfloat16"),
        ),
    ],
    rtol32=1e-4,
    atol32=1e-4,
)
def conv2d(x: Any, weight: Any, bias: Any = None, stride: int = 1, padding: int = 0) -> Tensor:
    """2-D convolution (cross-correlation, as PyTorch) of ``x:[B, C, H, W]``
    with ``weight:[O, C, K, K]`` plus optional ``bias:[O]`` -> ``[B, O, OH, OW]``
    (records Conv2dBackward)."""
    op = "conv2d"
    xv = array_of(x, op, "input")
    wv = array_of(weight, op, "weight")
    require_float(op, xv, "input")
    require_float(op, wv, "weight")
    if xv.ndim != 4 or wv.ndim != 4 or wv.shape[2] != wv.shape[3] or wv.shape[1] != xv.shape[1]:
        raise ShapeError(
            f"{op}: expects x [B, C, H, W] and weight [O, C, K, K] with matching C, got {xv.shape} and {wv.shape}"
        )
    if xv.dtype != wv.dtype:  # lax.conv needs one dtype, and so do the backward convolutions
        raise TypeError(f"{op}: x and weight must have the same dtype, got {xv.dtype} and {wv.dtype}")
    bv = None if bias is None else array_of(bias, op, "bias")
    if bv is not None and shape_of(bv) != (wv.shape[0],):
        raise ShapeError(f"{op}: bias must have shape ({wv.shape[0]},) for weight {wv.shape}, got {shape_of(bv)}")
    k = wv.shape[2]
    _, s, p = _window_args(op, k, stride, padding)
    _out_size(op, xv.shape[2], k, s, p, "height")
    _out_size(op, xv.shape[3], k, s, p, "width")
    options = cpu_options(xv, wv, bv)
    y = _conv2d_forward(xv, wv, bv, s, p, options)
    inputs = (x, weight) if bias is None else (x, weight, bias)
    tape = tape_for(*inputs)
    if tape is None:
        return Tensor._wrap(y)
    saved_x, x_v = reads(x, is_tracked(weight))
    saved_w, w_v = reads(weight, is_tracked(x))
    rec = Conv2dBackward(
        saved_x,
        x_v,
        saved_w,
        w_v,
        tuple(xv.shape),
        tuple(wv.shape),
        s,
        p,
        xv.dtype,
        wv.dtype,
        getattr(bv, "dtype", None),
        shd.sharding_of(xv),
        shd.sharding_of(wv),
        shd.sharding_of(bv),
        options is not None,
    )
    return record(tape, rec, inputs, new_output(y, tape))


# ---------------------------------------------------------------------------
# add_channel_bias
# ---------------------------------------------------------------------------


@frozen
class AddChannelBiasBackward(Record):
    """``y = x + b[:, None]`` for ``x:[..., C, L]``: ``dx = dy``, ``db`` sums
    ``dy`` over everything but the channel axis. Reads no data."""

    input_dtype: Any
    bias_dtype: Any

    def backward(self, g, needs):
        gx = cast(g, self.input_dtype) if needs[0] else None
        gb = None
        if needs[1]:
            axes = tuple(i for i in range(g.ndim) if i != g.ndim - 2)
            gb = cast(acc_sum(g, axes), self.bias_dtype)
        return gx, gb


@eager_jit
def _add_channel_bias(xv: Array, bv: Array) -> Array:
    return xv + bv.reshape((1,) * (xv.ndim - 2) + (-1, 1))


@op(
    records=(AddChannelBiasBackward,),
    ref=lambda x, b: x + b.reshape((1,) * (x.ndim - 2) + (-1, 1)),
    samples=lambda r: [
        Sample((normal(r, 3, 5), normal(r, 3)), diff=(0, 1)),
        Sample((normal(r, 2, 4, 7), normal(r, 4)), diff=(0, 1)),
    ],
    errors=lambda: [
        BadInput("channels differ", (tracked(3, 5), tracked(4)), ShapeError, ("(3, 5)", "(4,)")),
        BadInput("rank-1 input", (tracked(5), tracked(5)), ShapeError),
        BadInput("rank-2 bias", (tracked(3, 5), tracked(3, 1)), ShapeError),
    ],
)
def add_channel_bias(x: Any, b: Any) -> Tensor:
    """``x:[..., C, L] + b:[C]`` broadcast over ``L`` (records AddChannelBiasBackward)."""
    op = "add_channel_bias"
    xv = array_of(x, op, "input")
    bv = array_of(b, op, "bias")
    if xv.ndim < 2 or bv.ndim != 1 or xv.shape[-2] != bv.shape[0]:
        raise ShapeError(f"{op}: expects x [..., C, L] and bias [C], got {xv.shape} and {bv.shape}")
    out = _add_channel_bias(xv, bv)
    tape = tape_for(x, b)
    if tape is None:
        return Tensor._wrap(out)
    rec = AddChannelBiasBackward(xv.dtype, bv.dtype)
    return record(tape, rec, (x, b), new_output(out, tape))


# ---------------------------------------------------------------------------
# max_pool2d
# ---------------------------------------------------------------------------


@frozen
class MaxPool2dBackward(Record):
    """Scatters ``dy`` to the argmax of each window (saved in the forward pass
    as the window offset ``kh*K + kw``); overlapping windows accumulate. The
    indices are private to the record: it snapshots nothing."""

    indices: Array
    h: int
    w: int
    out_h: int
    out_w: int
    kernel_size: int
    stride: int
    padding: int

    def backward(self, g, needs):
        k, s, p = self.kernel_size, self.stride, self.padding
        idx = self.indices
        if s == k and p == 0:  # tiling windows: broadcasts and one reshape, no transpose
            lead = tuple(g.shape[:-2])
            oh, ow = self.out_h, self.out_w
            nd = len(lead)
            # [..., OH, K, OW, K]: window offset kh*K + kw at [.., i, kh, j, kw]
            oshape = (1,) * (nd + 1) + (k, 1, k)
            offset = lax.broadcasted_iota(idx.dtype, oshape, nd + 1) * np.array(k, idx.dtype) + lax.broadcasted_iota(
                idx.dtype, oshape, nd + 3
            )
            hit = jnp.expand_dims(idx, (nd + 1, nd + 3)) == offset
            d = jnp.where(hit, jnp.expand_dims(g, (nd + 1, nd + 3)), np.zeros((), g.dtype))
            d = shd.reshape(d, (*lead, oh * k, ow * k))
            return (lax.pad(d, np.zeros((), g.dtype), spatial_pad(d.ndim, 0, self.h - oh * k, 0, self.w - ow * k)),)
        return (col2im(lambda j: jnp.where(idx == j, g, 0), k, s, p, self.h, self.w),)


def _max_first(x: tuple[Array, Array], y: tuple[Array, Array]) -> tuple[Array, Array]:
    """Reducer of (value, index) pairs: the larger value, NaN beating any number,
    the smaller index among equals (``jnp.max`` and ``jnp.argmax`` in one)."""
    xv, xi = x
    yv, yi = y
    x_nan, y_nan = xv != xv, yv != yv
    first = xi < yi
    pick_x = (xv > yv) | ((xv == yv) & first) | (x_nan & ~y_nan) | (x_nan & y_nan & first)
    return lax.select(pick_x, xv, yv), lax.select(pick_x, xi, yi)


def _max_argmax(win: Array, index: Array, dims: tuple[int, ...]) -> tuple[Array, Array]:
    """Max of ``win`` over ``dims`` and the ``index`` of its first maximum, as
    one variadic reduction: a producer fused into the pool (a batch norm, a
    relu) is computed once, where ``jnp.max`` + ``jnp.argmax`` read it twice."""
    init = (np.array(-np.inf, win.dtype), np.array(np.iinfo(index.dtype).max, index.dtype))
    if lifting():
        # rf.lift differentiates this program with the primitive rules, and the
        # variadic reduce has none: the max as its own reduction, the argmax of
        # the values without their gradient (the same values, NaN included)
        return jnp.max(win, axis=dims), lax.reduce((lax.stop_gradient(win), index), init, _max_first, dims)[1]
    return lax.reduce((win, index), init, _max_first, dims)


def _max_pool_forward(xv: Array, k: int, s: int, p: int, oh: int, ow: int) -> tuple[Array, Array]:
    """(max of each window, its argmax as the window offset kh*K + kw): under
    ``jax.jit`` the elementwise form behind a materialising ``lax.cond``
    (``_max_pool_materialised``, Note [Max pool under jit]); other traces
    (vmap, jvp, rf.lift, a mesh) inline as one variadic reduction
    (``_max_pool_reduce``); eagerly one cached compiled call of the elementwise
    form (``_max_pool_elementwise``)."""
    if isinstance(xv, JitTracer) and not lifting() and not shd.on_mesh(xv) and jax.default_backend() == "cpu":
        return _max_pool_materialised(xv, k, s, p, oh, ow)
    if isinstance(xv, jax.core.Tracer):
        return _max_pool_reduce(xv, k, s, p, oh, ow)
    return compiled(_max_pool_elementwise, (1, 2, 3, 4, 5))(xv, k, s, p, oh, ow)


# Note [Max pool under jit]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# XLA:CPU fuses a cheap elementwise producer (the batch norm and relu in front
# of a pool) into every consumer and recomputes it there, and
# ``lax.optimization_barrier`` does not stop it (XLA:CPU removes barriers before
# fusion). So under jit the pool's input stayed unmaterialised: the variadic
# max / first-argmax reduction ran as a scalar loop over the recomputed batch
# norm, and the elementwise form, fast on a materialised array, lost because
# its argmax chain was fused into the backward's scatter and recomputed at
# every input position. The operands of a ``lax.cond`` are materialised, and
# XLA keeps a conditional whose predicate it cannot evaluate: both branches are
# the same elementwise pool, so the predicate (the first input element is not
# NaN) only hides the choice, and the result is the same whichever branch
# runs. The CNN step's timings: (benchmarks/RESULTS.md, "Thresholds in the code"). Only on XLA:CPU (``jax.default_backend()``): a GPU runs a
# conditional by reading its predicate on the host, a sync per pool, and its
# fusions differ; not measured there. Only for a jit trace: under vmap a
# batched predicate turns the cond into a select of two equal branches, which
# XLA folds back to the unmaterialised elementwise form.


def _max_pool_materialised(xv: Array, k: int, s: int, p: int, oh: int, ow: int) -> tuple[Array, Array]:
    """``_max_pool_elementwise`` on a materialised input (Note [Max pool under jit])."""

    def pool(a: Array) -> tuple[Array, Array]:
        return _max_pool_elementwise(a, k, s, p, oh, ow)

    return same_branches(pool, xv, xv)


def _max_pool_elementwise(xv: Array, k: int, s: int, p: int, oh: int, ow: int) -> tuple[Array, Array]:
    """``_max_pool_reduce``'s values, elementwise over the K*K strided window
    slices: the max as a tree of ``max`` (NaN propagates, as the reduction's
    and ``reduce_window``'s), then the first offset whose slice equals it (or
    is NaN where it is NaN). Eagerly the input is a materialised array, on
    which XLA:CPU runs this form faster than the reduction (benchmarks/RESULTS.md, "Thresholds in the code"); under
    ``jax.jit`` it runs on an input materialised by a ``lax.cond`` (Note [Max
    pool under jit])."""
    idx_dtype = jnp.int8 if k * k <= 127 else jnp.int32
    neg = np.array(-np.inf, xv.dtype)
    xp = lax.pad(xv, neg, spatial_pad(xv.ndim, p, p, p, p)) if p else xv
    slices = window_slices(xp, k, s, oh, ow)
    level = slices
    while len(level) > 1:
        level = [lax.max(a, b) for a, b in zip(level[::2], level[1::2])] + ([level[-1]] if len(level) % 2 else [])
    m = level[0]
    nan = m != m
    idx = jnp.full(m.shape, len(slices) - 1, idx_dtype)
    for j in range(len(slices) - 2, -1, -1):
        sj = slices[j]
        idx = jnp.where((sj == m) | (nan & (sj != sj)), np.array(j, idx_dtype), idx)
    return m, idx


def _max_pool_reduce(xv: Array, k: int, s: int, p: int, oh: int, ow: int) -> tuple[Array, Array]:
    """(max of each window, its argmax) as one variadic reduction."""
    idx_dtype = jnp.int8 if k * k <= 127 else jnp.int32
    # the K*K strided window slices stacked on a new leading axis and reduced
    # over it: faster in the CNN step than the reduction over the minor
    # [.., K, .., K] axes of the window view, and than elementwise formulations
    # inline (benchmarks/RESULTS.md, "Thresholds in the code"). A jit trace takes the elementwise form behind a lax.cond instead (Note [Max
    # pool under jit]); vmap, jvp, rf.lift and meshes keep this reduction
    neg = np.array(-np.inf, xv.dtype)
    xp = lax.pad(xv, neg, spatial_pad(xv.ndim, p, p, p, p)) if p else xv
    win = jnp.stack(window_slices(xp, k, s, oh, ow))  # [K*K, ..., C, OH, OW]
    return _max_argmax(win, lax.broadcasted_iota(idx_dtype, win.shape, 0), (0,))


def ref_max_pool2d(x: Any, k: int, stride: int | None = None, padding: int = 0) -> Array:
    """The lax oracle of ``max_pool2d`` (op table)."""
    s = k if stride is None else stride
    nd = x.ndim
    pads = [(0, 0)] * (nd - 2) + [(padding, padding)] * 2
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1,) * (nd - 2) + (k, k), (1,) * (nd - 2) + (s, s), pads)


@op(
    records=(MaxPool2dBackward,),
    ref=ref_max_pool2d,
    samples=lambda r: [
        Sample((normal(r, 2, 3, 6, 7), 2)),
        Sample((normal(r, 2, 3, 7, 5), 3, 2)),  # overlapping windows
        Sample((normal(r, 3, 5, 6), 3, 1, 1)),  # unbatched, padded
        Sample((normal(r, 1, 2, 7, 7), 2, 3)),  # stride > kernel
    ],
    errors=lambda: [
        BadInput("rank-2 input", (tracked(6, 6), 2), ShapeError),
        BadInput("kernel larger than input", (tracked(1, 6, 6), 8), ValueError, ("8",)),
        BadInput("padding above kernel // 2", (tracked(1, 6, 6), 2, 2, 2), ValueError),
        BadInput("float kernel", (tracked(1, 6, 6), 1.5), TypeError),
        BadInput("stride 0", (tracked(1, 6, 6), 2, 0), ValueError),
        BadInput("integer input", (integers(1, 6, 6), 2), TypeError),
    ],
)
def max_pool2d(x: Any, kernel_size: int, stride: int | None = None, padding: int = 0) -> Tensor:
    """Max over ``kernel_size`` windows of ``x:[..., C, H, W]``; stride defaults
    to the kernel size; overlapping windows allowed; implicit ``-inf`` padding
    of at most ``kernel_size // 2`` (as PyTorch) (records MaxPool2dBackward).
    A window holding NaN gives NaN and hands its gradient to its first NaN
    (``jax.grad`` of ``lax.reduce_window`` picks otherwise there: Note [Windowed
    max gradients] in ``rumus_fx/lift/rules_conv.py``)."""
    op = "max_pool2d"
    xv = array_of(x, op)
    require_float(op, xv)
    if xv.ndim < 3:
        raise ShapeError(f"{op}: expects x of shape [..., C, H, W], got {xv.shape}")
    k, s, p = _window_args(op, kernel_size, stride, padding)
    if p > k // 2:
        raise ValueError(f"{op}: padding {p} must be at most kernel_size // 2 = {k // 2}")
    *_, h, w = xv.shape
    oh, ow = _out_size(op, h, k, s, p, "height"), _out_size(op, w, k, s, p, "width")
    out, indices = _max_pool_forward(xv, k, s, p, oh, ow)
    tape = tape_for(x)
    if tape is None:
        return Tensor._wrap(out)
    rec = MaxPool2dBackward(indices, h, w, oh, ow, k, s, p)
    return record(tape, rec, (x,), new_output(out, tape))


# ---------------------------------------------------------------------------
# adaptive_avg_pool2d
# ---------------------------------------------------------------------------


def _bin_matrix(size_in: int, size_out: int, dtype: Any) -> np.ndarray:
    """``[out, in]`` averaging weights for bins ``floor(i*in/out) .. ceil((i+1)*in/out)``."""
    m = np.zeros((size_out, size_in), dtype=np.float64)
    for i in range(size_out):
        start = (i * size_in) // size_out
        end = -((-(i + 1) * size_in) // size_out)
        m[i, start:end] = 1.0 / (end - start)
    return m.astype(dtype)


@eager_jit(static_argnums=(1, 2, 3, 4, 5, 6))
def _bin_pool(t: Array, h: int, w: int, oh: int, ow: int, dtype: Any, adjoint: bool) -> Array:
    """``P_h t P_w^T`` (``[..., h, w]`` -> ``[..., oh, ow]``) with the bin-averaging
    matrices, or with ``adjoint`` its transpose ``P_h^T t P_w`` (the gradient)."""
    cd = compute_dtype(dtype)
    ph, pw = _bin_matrix(h, oh, cd), _bin_matrix(w, ow, cd)
    spec = "...op,oh,pw->...hw" if adjoint else "...hw,oh,pw->...op"
    return jnp.einsum(spec, upcast(t), ph, pw).astype(dtype)


@frozen
class AdaptiveAvgPool2dBackward(Record):
    """Each input pixel receives ``dy / count`` from every bin that covers it:
    ``dx = P_h^T dy P_w`` with the (static) bin-averaging matrices. Reads no data."""

    h_in: int
    w_in: int
    h_out: int
    w_out: int
    dtype: Any

    def backward(self, g, needs):
        return (_bin_pool(g, self.h_in, self.w_in, self.h_out, self.w_out, self.dtype, True),)


def ref_adaptive_avg_pool2d(x: Any, out: Any) -> Array:
    """The jax.numpy oracle of ``adaptive_avg_pool2d`` (op table)."""
    oh, ow = (out, out) if isinstance(out, int) else out
    h, w = x.shape[-2:]
    rows = []
    for i in range(oh):
        h0, h1 = (i * h) // oh, -((-(i + 1) * h) // oh)
        cols = []
        for j in range(ow):
            w0, w1 = (j * w) // ow, -((-(j + 1) * w) // ow)
            cols.append(jnp.mean(x[..., h0:h1, w0:w1], axis=(-2, -1)))
        rows.append(jnp.stack(cols, axis=-1))
    return jnp.stack(rows, axis=-2)


@op(
    records=(AdaptiveAvgPool2dBackward,),
    ref=ref_adaptive_avg_pool2d,
    samples=lambda r: [
        Sample((normal(r, 2, 3, 7, 5), 3)),
        Sample((normal(r, 2, 3, 5, 6), (2, 4))),
        Sample((normal(r, 3, 4, 4), 1)),
        Sample((normal(r, 1, 2, 3, 5), (5, 7))),  # bins overlap when upsampling
    ],
    errors=lambda: [
        BadInput("rank-2 input", (tracked(6, 6), 2), ShapeError),
        BadInput("output size 0", (tracked(1, 6, 6), 0), ValueError),
        BadInput("three output sizes", (tracked(1, 6, 6), (2, 3, 4)), ValueError),
        BadInput("float output size", (tracked(1, 6, 6), 1.5), TypeError),
        BadInput("negative output size", (tracked(1, 6, 6), (2, -1)), ValueError),
    ],
)
def adaptive_avg_pool2d(x: Any, output_size: int | tuple[int, int]) -> Tensor:
    """Average of ``x:[..., C, H, W]`` over ``output_size`` bins per spatial
    axis, bin ``i`` covering ``floor(i*H/OH)`` to ``ceil((i+1)*H/OH)`` (records
    AdaptiveAvgPool2dBackward)."""
    op = "adaptive_avg_pool2d"
    xv = array_of(x, op)
    require_float(op, xv)
    if xv.ndim < 3:
        raise ShapeError(f"{op}: expects x of shape [..., C, H, W], got {xv.shape}")
    if isinstance(output_size, (tuple, list)):
        if len(output_size) != 2:
            raise ValueError(f"{op}: output_size must be an int or a pair, got {output_size!r}")
        oh = static_int(op, "output_size", output_size[0], 1)
        ow = static_int(op, "output_size", output_size[1], 1)
    else:
        oh = ow = static_int(op, "output_size", output_size, 1)
    *_, h, w = xv.shape
    if h == 0 or w == 0:
        raise ShapeError(f"{op}: input spatial size must be non-empty, got {xv.shape}")
    out = _bin_pool(xv, h, w, oh, ow, xv.dtype, False)
    tape = tape_for(x)
    if tape is None:
        return Tensor._wrap(out)
    rec = AdaptiveAvgPool2dBackward(h, w, oh, ow, xv.dtype)
    return record(tape, rec, (x,), new_output(out, tape))
