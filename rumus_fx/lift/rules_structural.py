"""Primitive rules: reductions, dot_general and shape ops (broadcast, reshape,
transpose, squeeze, concatenate, pad, slice, dynamic slices, rev, split)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import sharding as shd
from ..autograd.registry import BadProgram, Sample, TableEntry
from ..errors import AutogradError
from ..ops._declare import distinct, normal, unary_samples
from ..ops.linalg import computed_in_trace, off_mesh
from .rules import defrule, saves_inputs
from .rules_elementwise import as_dtype, unbroadcast

# -- reductions ------------------------------------------------------------------


def _expand(g, aval, axes, sharding=None):
    """Broadcast a reduced gradient back over ``axes`` to ``aval``'s shape (with
    the operand's explicit ``sharding``)."""
    kept = tuple(d for d in range(len(aval.shape)) if d not in axes)
    # (shd.broadcast_in_dim: jax 0.11 drops out_sharding= for a meshless ``g``, such as
    # a backward seed, under jit without set_mesh; Note [Broadcasting a meshless value])
    return shd.broadcast_in_dim(g, aval.shape, kept, sharding)


def _reduce_sum_vjp(r, g):
    return (_expand(g, r.in_avals[0], tuple(r.params["axes"]), r.in_sharding(0)).astype(r.in_avals[0].dtype),)


defrule(
    "reduce_sum",
    _reduce_sum_vjp,
    table=(
        TableEntry(
            "reduce_sum",
            lambda x: jnp.sum(x, axis=(0, 2)) * jnp.sum(x),
            unary_samples([(2, 3, 4)]),
            vmap=True,
        ),
    ),
)


def _chooser_vjp(r, g, extreme):
    """max/min reductions (``extreme``: ``jnp.max`` or ``jnp.min``): the
    gradient is shared equally by every position that attains the extreme value.

    The extreme is taken again here from the saved operand, not read from the
    saved output: a compiled forward may compute the operand twice, once
    materialised (what is saved) and once inline in the reduction's fusion, and
    XLA:CPU rounds the two differently (a float64 ``(a @ b - c) / 0.5`` differed
    in its last bit), so the saved output could equal no saved element, and the
    count of winners was 0: a nan gradient (``tests/lift/test_ties.py``). A max
    or min is exact, so the operand's own extreme is always one of its elements."""
    aval = r.in_avals[0]
    axes = tuple(r.params["axes"])
    x = r.ins[0]
    sh = r.in_sharding(0)
    y = _expand(extreme(x, axis=axes), aval, axes, sh)
    hit = (x == y).astype(g.dtype)
    count = _expand(jnp.sum(hit, axis=axes), aval, axes, sh)
    return (_expand(g, aval, axes, sh) * hit / count,)


def _reduce_max_vjp(r, g):
    return _chooser_vjp(r, g, jnp.max)


def _reduce_min_vjp(r, g):
    return _chooser_vjp(r, g, jnp.min)


defrule(
    "reduce_max",
    _reduce_max_vjp,
    ((0,), ()),
    table=(
        TableEntry("reduce_max", lambda x: jnp.max(x, axis=1), unary_samples(gen=distinct)),
        TableEntry("reduce_max_ties", lambda x: jnp.max(jnp.round(x), axis=0), unary_samples([(6, 3)])),
    ),
)
defrule(
    "reduce_min",
    _reduce_min_vjp,
    ((0,), ()),
    table=(TableEntry("reduce_min", lambda x: jnp.min(x, axis=(0, 1)), unary_samples([(3, 4), (2, 3, 5)], distinct)),),
)


def _reduce_prod_vjp(r, g):
    """Product of all the other elements, without dividing (zeros are exact)."""
    aval = r.in_avals[0]
    axes = tuple(sorted(r.params["axes"]))
    x = r.ins[0]
    keep = [d for d in range(x.ndim) if d not in axes]
    perm = keep + list(axes)
    xt = jnp.transpose(x, perm)
    lead = xt.shape[: len(keep)]
    flat = shd.reshape(xt, (*lead, -1))
    ones = jnp.ones_like(flat[..., :1])
    left = jnp.concatenate([ones, lax.cumprod(flat, axis=flat.ndim - 1)[..., :-1]], axis=-1)
    right = jnp.concatenate([lax.cumprod(flat, axis=flat.ndim - 1, reverse=True)[..., 1:], ones], axis=-1)
    others = shd.reshape(left * right, xt.shape)
    others = jnp.transpose(others, np.argsort(perm))
    return (_expand(g, aval, axes, r.in_sharding(0)) * shd.conform(others, r.in_sharding(0)),)


defrule(
    "reduce_prod",
    _reduce_prod_vjp,
    saves_inputs(0),
    table=(
        TableEntry("reduce_prod", lambda x: jnp.prod(x, axis=1), unary_samples([(3, 4), (2, 3, 5)])),
        TableEntry(
            "reduce_prod_zero",
            lambda x: jnp.prod(x.at[0, 1].set(0.0), axis=1) + jnp.prod(x),
            unary_samples([(3, 4)]),
        ),
    ),
)


# -- dot_general ----------------------------------------------------------------


def _ranges_except(n, *excluded):
    skip = set()
    for e in excluded:
        skip.update(e)
    return [d for d in range(n) if d not in skip]


def _dot_lhs_grad(g, y, x_aval, dims, swap=False, x_sharding=None):
    """Gradient of ``dot_general(x, y, dims)`` with respect to ``x`` (or to the
    rhs when ``swap``: the output's free dims then come in the other order).
    With ``x``'s explicit sharding the contraction is given it as ``out_sharding``
    (a contraction over a sharded axis, say the batch of a weight gradient, has
    no sharding JAX can infer)."""
    (xc, yc), (xb, yb) = dims
    x_nd, y_nd = len(x_aval.shape), y.ndim
    x_free = _ranges_except(x_nd, xc, xb)
    y_free = _ranges_except(y_nd, yc, yb)
    nb = len(xb)
    if not swap:  # output dims: batch, x_free, y_free
        g_yfree = list(range(nb + len(x_free), nb + len(x_free) + len(y_free)))
    else:  # output dims: batch, y_free (the lhs), x_free (the rhs)
        g_yfree = list(range(nb, nb + len(y_free)))
    g_batch = list(range(nb))
    # res dims: batch (xb order), x_free (g's order), then y's remaining dims = yc sorted
    yc_sorted = sorted(yc)
    x_for_yc = [xc[list(yc).index(d)] for d in yc_sorted]
    order = list(xb) + x_free + x_for_yc  # x dim held by each res dim
    perm = [order.index(d) for d in range(x_nd)]
    out_sharding = None
    if x_sharding is not None:
        spec = tuple(x_sharding.spec) + (None,) * (x_nd - len(x_sharding.spec))
        out_sharding = shd.with_spec(x_sharding, [spec[d] for d in order])
    res = lax.dot_general(g, y.astype(g.dtype), ((g_yfree, y_free), (g_batch, list(yb))), out_sharding=out_sharding)
    return as_dtype(lax.transpose(res, perm), x_aval.dtype)


def _weight_gradient_2d(g, x, ay, dims, y_sharding):
    """``x[..., K]^T g[..., N]`` as one 2-D dot over the merged leading rows, for
    ``x @ W`` (``x:[..., K]`` contracting its last axis with ``W:[K, N]``'s
    first, no batch axes) when ``x`` has an elementwise producer in the trace
    and no mesh is set (Note [Weight gradient as one 2-D dot] in
    rumus_fx/ops/linalg.py); None for any other product."""
    (lc, rc), (lb, rb) = dims
    if lb or rb or x.ndim < 3 or len(ay.shape) != 2 or tuple(lc) != (x.ndim - 1,) or tuple(rc) != (0,):
        return None
    if y_sharding is not None or not off_mesh(x, g) or not computed_in_trace(x):
        return None
    k, n = ay.shape
    x2, g2 = x.reshape(-1, k), g.reshape(-1, n)
    return as_dtype(lax.dot_general(x2.astype(g2.dtype), g2, (((0,), (0,)), ((), ()))), ay.dtype)


def _dot_general_vjp(r, g):
    (lc, rc), (lb, rb) = r.params["dimension_numbers"]
    x, y = r.ins
    ax, ay = r.in_avals
    gx = _dot_lhs_grad(g, y, ax, ((lc, rc), (lb, rb)), x_sharding=r.in_sharding(0)) if r.needs[0] else None
    gy = None
    if r.needs[1]:
        gy = _weight_gradient_2d(g, x, ay, ((lc, rc), (lb, rb)), r.in_sharding(1))
        if gy is None:
            gy = _dot_lhs_grad(g, x, ay, ((rc, lc), (rb, lb)), swap=True, x_sharding=r.in_sharding(1))
    return gx, gy


def _dot_saves(needs):
    return tuple(k for k, n in ((1, needs[0]), (0, needs[1])) if n), ()


def _dot_samples(r):
    return [
        Sample((normal(r, 3, 4), normal(r, 4, 5)), diff=(0, 1)),
        Sample((normal(r, 4), normal(r, 4, 5)), diff=(0, 1)),
        Sample((normal(r, 3, 4), normal(r, 4)), diff=(0, 1)),
        Sample((normal(r, 2, 3, 4), normal(r, 2, 4, 5)), diff=(0, 1)),
    ]


defrule(
    "dot_general",
    _dot_general_vjp,
    _dot_saves,
    table=(
        TableEntry("dot_general", lambda a, b: a @ b, _dot_samples, vmap=True),
        TableEntry(
            "dot_general_einsum",
            lambda a, b: jnp.einsum("bik,jbk->bji", a, b),
            lambda r: [Sample((normal(r, 2, 3, 4), normal(r, 5, 2, 4)), diff=(0, 1))],
        ),
        TableEntry(  # under jit: the weight gradient as one 2-D dot over the merged rows
            "dot_general_rows",
            lambda a, b: jnp.tanh(a) @ b,
            lambda r: [Sample((normal(r, 2, 3, 4), normal(r, 4, 5)), diff=(0, 1))],
        ),
        TableEntry(
            "dot_general_contract2",
            lambda a, b: lax.dot_general(a, b, (((2, 0), (0, 1)), ((), ()))),
            lambda r: [Sample((normal(r, 3, 4, 2), normal(r, 2, 3, 5)), diff=(0, 1))],
        ),
    ),
)


# -- ragged_dot_general (lax.ragged_dot: a grouped matmul, as in mixture-of-experts layers) --


def _ragged_parts(r):
    """(x contracting, y contracting), (x batch, y batch), x's kept axes, y's group
    and kept axes, and x's ragged axis; the gradient is defined (in jax as here)
    only where that axis is one of x's kept axes (``lax.ragged_dot``'s rows)."""
    dn = r.params["ragged_dot_dimension_numbers"]
    (xc, yc), (xb, yb) = dn.dot_dimension_numbers
    xc, yc, xb, yb = (tuple(int(a) for a in t) for t in (xc, yc, xb, yb))
    nx, ny = len(r.in_avals[0].shape), len(r.in_avals[1].shape)
    yg = tuple(int(a) for a in dn.rhs_group_dimensions)
    xk = [a for a in range(nx) if a not in xc + xb]
    yk = [a for a in range(ny) if a not in yc + yb + yg]
    (xr,) = dn.lhs_ragged_dimensions
    return (xc, yc), (xb, yb), xk, yg, yk, int(xr)


def _ragged_prepare(step):
    if step.params.get("group_offset") is not None:
        raise AutogradError(
            "rf.lift: the gradient of ragged_dot_general with a group_offset is not defined (nor in jax)"
        )
    dn = step.params["ragged_dot_dimension_numbers"]
    (xc, _), (xb, _) = dn.dot_dimension_numbers
    if len(dn.lhs_ragged_dimensions) != 1 or dn.lhs_ragged_dimensions[0] in (*xc, *xb):
        raise AutogradError(
            "rf.lift: the gradient of ragged_dot_general is defined only where the lhs's ragged axis is "
            "one it keeps (lax.ragged_dot's rows), not a contracting or batch axis (nor in jax)"
        )


def _ragged_dot_vjp(r, g):
    """The output's axes are (batch, x kept, y kept). ``gx`` groups ``g``'s rows as
    x's were grouped and contracts its y-kept axes with ``y``'s (each row with its
    group's matrix), then puts the axes back in x's order; ``gy`` contracts ``x``
    with ``g`` over the ragged rows, group by group (a ragged contracting axis: one
    result per group), then puts the axes back in y's order."""
    (xc, yc), (xb, yb), xk, yg, yk, xr = _ragged_parts(r)
    gs = r.ins[2]
    nb, nxk = len(xb), len(xk)
    g_b, g_x, g_y = list(range(nb)), list(range(nb, nb + nxk)), list(range(nb + nxk, nb + nxk + len(yk)))
    kw = dict(precision=r.params["precision"], preferred_element_type=r.params["preferred_element_type"])
    gx = gy = None
    if r.needs[0]:
        dn = lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=((g_y, yk), (g_b, list(yb))),
            lhs_ragged_dimensions=[nb + xk.index(xr)],
            rhs_group_dimensions=list(yg),
        )
        out = lax.ragged_dot_general(g, r.ins[1], gs, dn, **kw)
        # out: (batch, x kept, y's remaining axes = its contracting ones in y's order)
        order = [*xb, *xk, *(xc[i] for i in np.argsort(yc))]
        gx = as_dtype(jnp.transpose(out, np.argsort(order)), r.in_avals[0].dtype)
    if r.needs[1]:
        dn = lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=((xk, g_x), (list(xb), g_b)),
            lhs_ragged_dimensions=[xr],
            rhs_group_dimensions=[],
        )
        out = lax.ragged_dot_general(r.ins[0], g, gs, dn, **kw)
        # out: (group, batch, x's remaining axes = its contracting ones in x's order, y kept)
        order = [*yg, *yb, *(yc[i] for i in np.argsort(xc)), *yk]
        gy = as_dtype(jnp.transpose(out, np.argsort(order)), r.in_avals[1].dtype)
    return gx, gy, None


_ragged_dot_vjp.prepare = _ragged_prepare


def _ragged_saves(needs):
    return tuple(k for k, n in ((0, needs[1]), (1, needs[0]), (2, True)) if n), ()


_GROUPS = np.array([2, 0, 3, 1], np.int32)  # an empty group, and rows past the last group


def _ragged_contracting_x_axis_first(a, b):
    """x [k, m] (its rows on axis 1) against y [g, n, k]: axes permuted on both sides."""
    dn = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (2,)), ((), ())), lhs_ragged_dimensions=[1], rhs_group_dimensions=[0]
    )
    return lax.ragged_dot_general(a, b, jnp.asarray(_GROUPS), dn)


def _ragged_batched(a, b):
    """A batch axis on both sides: x [2, m, k], y [g, 2, k, n]."""
    dn = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((2,), (2,)), ((0,), (1,))), lhs_ragged_dimensions=[1], rhs_group_dimensions=[0]
    )
    return lax.ragged_dot_general(a, b, jnp.asarray(_GROUPS), dn)


def _ragged_errors():
    contracting = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (0,)), ((), ())), lhs_ragged_dimensions=[1], rhs_group_dimensions=[]
    )
    return [
        BadProgram(
            "ragged contracting axis",
            lambda a, b: lax.ragged_dot_general(a, b, jnp.asarray(_GROUPS[:3]), contracting),
            (np.ones((3, 5)), np.ones((5, 2))),
            AutogradError,
            ("rf.lift", "ragged axis"),
            jax_too=True,
        ),
    ]


defrule(
    "ragged_dot_general",
    _ragged_dot_vjp,
    _ragged_saves,
    table=(
        TableEntry(
            "ragged_dot",
            lambda a, b: lax.ragged_dot(a, b, jnp.asarray(_GROUPS)),
            lambda r: [Sample((normal(r, 7, 3), normal(r, 4, 3, 5)), diff=(0, 1))],
        ),
        TableEntry(
            "ragged_dot_permuted",
            _ragged_contracting_x_axis_first,
            lambda r: [Sample((normal(r, 3, 7), normal(r, 4, 5, 3)), diff=(0, 1))],
        ),
        TableEntry(
            "ragged_dot_batched",
            _ragged_batched,
            lambda r: [Sample((normal(r, 2, 7, 3), normal(r, 4, 2, 3, 5)), diff=(0, 1))],
        ),
    ),
    errors=_ragged_errors,
)


# -- shape ops --------------------------------------------------------------------


def _broadcast_in_dim_vjp(r, g):
    aval = r.in_avals[0]
    bdims = tuple(r.params["broadcast_dimensions"])
    out_shape = tuple(r.out_avals[0].shape)
    new = [d for d in range(len(out_shape)) if d not in bdims]
    stretched = [bdims[i] for i, s in enumerate(aval.shape) if s == 1 and out_shape[bdims[i]] != 1]
    axes = tuple(sorted(new + stretched))
    if axes:
        g = jnp.sum(g, axis=axes)
    g = shd.conform(shd.reshape(g, aval.shape, out_sharding=r.in_sharding(0)), r.in_sharding(0))
    return (g.astype(aval.dtype),) + (None,) * (len(r.in_avals) - 1)


defrule(
    "broadcast_in_dim",
    _broadcast_in_dim_vjp,
    table=(
        TableEntry(
            "broadcast_in_dim",
            lambda x: jnp.broadcast_to(x, (2, 3, 4)) * jnp.arange(24.0).reshape(2, 3, 4),
            unary_samples([(3, 1), (4,)]),
        ),
    ),
)


def _reshape_vjp(r, g):
    shape = tuple(r.in_avals[0].shape)
    sh = r.in_sharding(0)
    dims = r.params.get("dimensions")
    if dims is not None:  # the operand is transposed by ``dimensions`` first
        spec = None if sh is None else tuple(sh.spec) + (None,) * (len(shape) - len(sh.spec))
        moved = None if sh is None else shd.with_spec(sh, [spec[d] for d in dims])
        g = lax.transpose(shd.reshape(g, tuple(shape[d] for d in dims), out_sharding=moved), tuple(np.argsort(dims)))
    return (shd.conform(shd.reshape(g, shape, out_sharding=sh), sh),) + (None,) * (len(r.in_avals) - 1)


def _squeeze_vjp(r, g):
    sh = r.in_sharding(0)
    return (shd.conform(shd.reshape(g, r.in_avals[0].shape, out_sharding=sh), sh),)


defrule(
    "reshape",
    _reshape_vjp,
    table=(
        TableEntry(
            "reshape_transpose",
            lambda x: jnp.transpose(x.reshape(4, 3), (1, 0)) * jnp.arange(12.0).reshape(3, 4),
            unary_samples([(3, 4)]),
            prims=("reshape", "transpose"),
        ),
        TableEntry(
            "reshape_dimensions",  # jnp.column_stack of a 2-D array: reshape with a transpose
            lambda x: jnp.column_stack(x) * jnp.arange(12.0).reshape(4, 3),
            unary_samples([(3, 4)]),
            prims=("reshape", "transpose"),
        ),
    ),
)
defrule(
    "squeeze",
    _squeeze_vjp,
    table=(
        TableEntry(
            "squeeze_expand",
            lambda x: jnp.squeeze(jnp.expand_dims(x, 0), 0)[None] * 2.0,
            unary_samples([(3, 4)]),
        ),
    ),
)
defrule("expand_dims", _squeeze_vjp)


def _transpose_vjp(r, g):
    perm = tuple(r.params["permutation"])
    return (lax.transpose(g, tuple(np.argsort(perm))),)


defrule("transpose", _transpose_vjp)


def _rev_vjp(r, g):
    return (lax.rev(g, tuple(r.params["dimensions"])),)


defrule(
    "rev",
    _rev_vjp,
    table=(TableEntry("rev", lambda x: jnp.flip(x, (0, 1)) * jnp.arange(12.0).reshape(3, 4), unary_samples([(3, 4)])),),
)


def _concatenate_vjp(r, g):
    dim = r.params["dimension"]
    out = []
    start = 0
    for aval, need in zip(r.in_avals, r.needs):
        size = aval.shape[dim]
        if need:
            out.append(lax.slice_in_dim(g, start, start + size, axis=dim).astype(aval.dtype))
        else:
            out.append(None)
        start += size
    return tuple(out)


defrule(
    "concatenate",
    _concatenate_vjp,
    table=(
        TableEntry(
            "concatenate",
            lambda x, y: jnp.concatenate([x, y, x], axis=1) ** 2,
            lambda r: [Sample((normal(r, 3, 2), normal(r, 3, 4)), diff=(0, 1))],
        ),
    ),
)


def _split_vjp(r, g):
    return (lax.concatenate(list(g), r.params["axis"]),)


defrule(
    "split",
    _split_vjp,
    multiple_results=True,
    table=(TableEntry("split", lambda x: jnp.split(x, [1, 3], axis=1)[1] ** 2, unary_samples([(3, 5)])),),
)


def _pad_vjp(r, g):
    cfg = r.params["padding_config"]
    # zero-pad where the padding was negative, then take every (interior+1)-th
    undo = [(max(-lo, 0), max(-hi, 0), 0) for lo, hi, _ in cfg]
    g1 = lax.pad(g, jnp.zeros((), g.dtype), undo)
    starts = [max(lo, 0) for lo, _, _ in cfg]
    limits = [g1.shape[d] - max(hi, 0) for d, (_, hi, _) in enumerate(cfg)]
    strides = [interior + 1 for _, _, interior in cfg]
    g_operand = lax.slice(g1, starts, limits, strides)
    g_operand = g_operand.reshape(r.in_avals[0].shape)
    g_value = None
    if r.needs[1]:
        g_value = unbroadcast(jnp.sum(g) - jnp.sum(g_operand), r.in_avals[1])
    return (g_operand.astype(r.in_avals[0].dtype) if r.needs[0] else None, g_value)


defrule(
    "pad",
    _pad_vjp,
    table=(
        TableEntry(
            "pad",
            # (x + 0 * v: jax.grad itself cannot transpose pad w.r.t. the padding
            # value alone when the operand is a constant)
            lambda x, v: lax.pad(x + 0.0 * v, v, ((1, 2, 1), (-1, 1, 0))) ** 2,
            lambda r: [Sample((normal(r, 3, 4), normal(r)), diff=(0, 1))],
        ),
    ),
)


def _slice_vjp(r, g):
    shape = r.in_avals[0].shape
    start = r.params["start_indices"]
    strides = r.params["strides"] or (1,) * len(shape)
    cfg = []
    for d, (s, st) in enumerate(zip(start, strides)):
        n = g.shape[d]
        used = s + (n - 1) * st + 1 if n else s
        cfg.append((s, shape[d] - used, st - 1) if n else (0, shape[d], 0))
    if any(g.shape[d] == 0 for d in range(g.ndim)):
        return (shd.zeros(shape, g.dtype, r.in_sharding(0)),)
    return (lax.pad(g, jnp.zeros((), g.dtype), cfg),)


defrule(
    "slice",
    _slice_vjp,
    table=(
        TableEntry(
            "slice",
            lambda x: x[1:3, ::2] ** 2 + lax.slice(x, (0, 1), (3, 4), (2, 2)).sum(),
            unary_samples([(4, 5)]),
        ),
    ),
)


def _clamped_starts(idx, operand_shape, window_shape):
    """The start indices as the primitive used them: each clamped to
    ``[0, size - window]`` (a start below ``-size`` reads from 0, one past the end
    from ``size - window``). Given to ``lax.dynamic_*`` as non-negative values, so
    its wrapper does not add ``size`` to a negative start a second time."""
    return tuple(jnp.clip(i, 0, max(n - w, 0)).astype(i.dtype) for i, n, w in zip(idx, operand_shape, window_shape))


def _dynamic_slice_vjp(r, g):
    aval = r.in_avals[0]
    idx = _clamped_starts(r.ins[1:], aval.shape, r.params["slice_sizes"])
    z = shd.zeros(aval.shape, g.dtype, r.in_sharding(0))
    return (lax.dynamic_update_slice(z, g, idx),) + (None,) * len(idx)


def _dynamic_slice_oob(x, i):
    """Starts below -size, negative, and past the end: the forward clamps each."""
    rows = [lax.dynamic_slice(x, (i[k], i[k + 1]), (2, 3)) for k in range(0, i.shape[0], 2)]
    return jnp.concatenate(rows) ** 2


defrule(
    "dynamic_slice",
    _dynamic_slice_vjp,
    lambda needs: (tuple(range(1, len(needs))), ()),
    table=(
        TableEntry(
            "dynamic_slice",
            lambda x, i: lax.dynamic_slice(x, (i[0], i[1]), (2, 3)) ** 2,
            lambda r: [Sample((normal(r, 4, 5), np.array([1, 1], np.int32)))],
        ),
        TableEntry(
            "dynamic_slice_out_of_range",
            _dynamic_slice_oob,
            lambda r: [Sample((normal(r, 4, 5), np.array([-7, 1, -1, -9, 3, 4, 9, -2], np.int32)))],
        ),
    ),
)


def _dynamic_update_slice_vjp(r, g):
    upd = r.in_avals[1]
    idx = _clamped_starts(r.ins[2:], r.in_avals[0].shape, upd.shape)
    g_op = lax.dynamic_update_slice(g, shd.zeros(upd.shape, g.dtype, r.in_sharding(1)), idx) if r.needs[0] else None
    g_up = lax.dynamic_slice(g, idx, upd.shape).astype(upd.dtype) if r.needs[1] else None
    return (g_op, g_up) + (None,) * len(idx)


def _dynamic_update_slice_oob(x, u, i):
    """Writes at starts below -size, negative and past the end (clamped by the forward)."""
    for k in range(0, i.shape[0], 2):
        x = lax.dynamic_update_slice(x, u * (k + 1.0), (i[k], i[k + 1]))
    return x**2


defrule(
    "dynamic_update_slice",
    _dynamic_update_slice_vjp,
    lambda needs: (tuple(range(2, len(needs))), ()),
    table=(
        TableEntry(
            "dynamic_update_slice",
            lambda x, u, i: lax.dynamic_update_slice(x, u * 3.0, (i[0], i[1])) ** 2,
            lambda r: [Sample((normal(r, 4, 5), normal(r, 2, 3), np.array([2, 1], np.int32)), diff=(0, 1))],
        ),
        TableEntry(
            "dynamic_update_slice_out_of_range",
            _dynamic_update_slice_oob,
            lambda r: [
                Sample(
                    (normal(r, 4, 5), normal(r, 2, 3), np.array([-7, 1, -1, -9, 3, 4, 9, -2], np.int32)),
                    diff=(0, 1),
                )
            ],
        ),
    ),
)


def _stack_vjp(r, g):
    axis = r.params["axis"]
    return tuple(
        lax.index_in_dim(g, k, axis=axis, keepdims=False).astype(a.dtype) if n else None
        for k, (a, n) in enumerate(zip(r.in_avals, r.needs))
    )


defrule(
    "stack",
    _stack_vjp,
    table=(
        TableEntry(
            "stack",
            lambda x, y: jnp.stack([x, y * 2.0, x], axis=1) ** 2,
            lambda r: [Sample((normal(r, 3, 4), normal(r, 3, 4)), diff=(0, 1))],
        ),
    ),
)


def _unstack_vjp(r, g):
    """``lax.unstack`` (``jnp.unstack``; on jax 0.11 also iterating over an array
    and ``jnp.concat`` of one): the cotangents stacked back along the axis."""
    return (jnp.stack(list(g), axis=r.params["axis"]).astype(r.in_avals[0].dtype),)


defrule(
    "unstack",
    _unstack_vjp,
    multiple_results=True,
    table=(
        TableEntry(
            "unstack",
            lambda x: sum((k + 1.0) * jnp.sin(a) for k, a in enumerate(jnp.unstack(x, axis=1))),
            unary_samples([(3, 4)]),
        ),
        TableEntry("unstack_one_output_used", lambda x: jnp.unstack(x)[1] ** 2, unary_samples([(3, 2)])),
    ),
)


# -- sharding annotations -----------------------------------------------------------


def _reshard_vjp(r, g):
    """``jax.sharding.reshard``: the gradient goes back to the operand's sharding."""
    return (shd.conform(g, r.in_sharding(0)),)


def _sharding_constraint_vjp(r, g):
    """``with_sharding_constraint``: the same constraint on the gradient."""
    return (r._step.prim.bind(g, **dict(r.params)),)


@functools.cache
def _mesh1(axis_type: AxisType = AxisType.Explicit) -> jax.sharding.Mesh:
    """A one-device mesh for the table's sharding programs (built on first use;
    tests/_sharded_cases.py runs them on 8 devices)."""
    return jax.make_mesh((1,), ("x",), axis_types=(axis_type,), devices=jax.devices()[:1])


defrule(
    "reshard",
    _reshard_vjp,
    table=(
        TableEntry(
            "reshard",
            lambda x: jnp.sin(jax.sharding.reshard(x, NamedSharding(_mesh1(), P()))) * x,
            unary_samples(),
        ),
    ),
)
defrule(
    "sharding_constraint",
    _sharding_constraint_vjp,
    table=(
        TableEntry(
            "sharding_constraint",
            lambda x: jnp.sin(lax.with_sharding_constraint(x, NamedSharding(_mesh1(AxisType.Auto), P()))) * x,
            unary_samples(),
        ),
    ),
)


def _device_put_prepare(step):
    for cp in step.params["copy_semantics"]:
        if cp.name == "DONATE_INPUT":
            raise AutogradError(
                "rf.lift: the gradient of jax.device_put(..., donate=True) is not defined (nor in jax); "
                "drop donate=True inside a differentiated function"
            )


def _device_put_vjp(r, g):
    """``jax.device_put`` moves values and leaves them as they are: each operand's
    gradient is its output's, moved back where the operand came from (the
    transfer with destinations and sources swapped, a copy)."""
    p = r.params
    want = [k for k, n in enumerate(r.needs) if n and g[k] is not None]
    out: list = [None] * len(r.in_avals)
    if want:
        copy = type(p["copy_semantics"][0]).ALWAYS_COPY
        moved = r._step.prim.bind(
            *(g[k].astype(r.in_avals[k].dtype) for k in want),
            devices=tuple(p["srcs"][k] for k in want),
            srcs=tuple(p["devices"][k] for k in want),
            copy_semantics=(copy,) * len(want),
        )
        for k, m in zip(want, moved):
            out[k] = m
    return tuple(out)


_device_put_vjp.prepare = _device_put_prepare
_device_put_vjp.takes_none = True  # an unused output's operand gets none


defrule(
    "device_put",
    _device_put_vjp,
    multiple_results=True,
    table=(
        TableEntry(
            "device_put",
            lambda x, y: jnp.sin(jax.device_put(x, jax.devices()[0])) * jax.device_put(y),
            lambda r: [Sample((normal(r, 3, 4), normal(r, 3, 4)), diff=(0, 1))],
        ),
        TableEntry(
            "device_put_tree",
            lambda x, y: (lambda a, b: a * b + a)(*jax.device_put((x, y), jax.devices()[0])),
            lambda r: [Sample((normal(r, 3, 4), normal(r, 3, 4)), diff=(0, 1))],
        ),
    ),
    errors=lambda: [
        BadProgram(
            "donate",
            lambda x: jnp.sin(jax.device_put(x, jax.devices()[0], donate=True)),
            (np.ones((3, 4)),),
            AutogradError,
            ("rf.lift", "donate=True"),
            jax_too=True,
        )
    ],
)


def _tile_vjp(r, g):
    """``tile``'s output is the operand repeated ``reps[d]`` times along each
    axis ``d``: the gradient sums the copies (a reshape to (rep, size) pairs)."""
    shape = tuple(r.in_avals[0].shape)
    reps = tuple(r.params["reps"])
    pairs = tuple(k for pair in zip(reps, shape) for k in pair)
    return (jnp.sum(g.reshape(pairs), axis=tuple(range(0, 2 * len(shape), 2))),)


defrule(
    "tile",
    _tile_vjp,
    table=(
        TableEntry("tile", lambda x: jnp.sin(jnp.tile(x, (2, 3))), unary_samples([(2, 3), (1, 4)]), vmap=True),
        TableEntry("tile_rank_up", lambda x: jnp.tile(x, (3, 1, 2)) ** 2, unary_samples([(2, 3)])),
    ),
)
