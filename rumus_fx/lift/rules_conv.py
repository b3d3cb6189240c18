"""Primitive rules: convolutions, windowed reductions and cumulative reductions
(``conv_general_dilated``, ``reduce_window_{sum,max,min}``, ``reduce_window``,
``cumsum``, ``cumprod``, ``cummax``, ``cummin``, ``cumlogsumexp``).

Note [Convolution gradients]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Ignoring space, a convolution contracts ``[n, c] x [o, c] -> [n, o]``, so both
gradients are convolutions again. Per spatial dimension, with input size ``i``,
kernel extent ``k = (w - 1) * rhs_dilation + 1``, input extent
``I = (i - 1) * lhs_dilation + 1`` and output extent ``O = (m - 1) * stride + 1``:

* the input gradient correlates the output gradient with the flipped kernel,
  the roles of ``window_strides`` and ``lhs_dilation`` swapped, padded by
  ``k - 1 - lo`` before and whatever makes the result ``i`` long after;
* the kernel gradient correlates the input with the output gradient (batch and
  feature dimensions of both swapped), ``rhs_dilation`` and ``window_strides``
  swapped, padded by ``lo`` before and ``O - I + k - 1 - lo`` after.

Feature groups turn into batch groups for the kernel gradient (each group's
kernel sees only its slice of the input features) and batch groups into feature
groups; for the input gradient the kernel's group axis moves from its output
feature dimension into its input feature dimension.

The dilated operand of either gradient (the output gradient dilated by the
strides, the input by ``lhs_dilation``) is dilated explicitly with ``lax.pad``
rather than through ``lhs_dilation``: XLA's CPU algebraic simplifier aborts the
process on some base-dilated convolutions whose kernel is wider than their input
(``jax.grad`` of a strided convolution crashes there, e.g. a ``(1, 6, 5, 2)``
NHWC input, ``(2, 3, 2, 3)`` HWIO kernel, strides 2, padding ``((1, 2), (0, 1))``).

Note [Windowed max gradients]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``jax.grad`` sends each window's gradient to exactly one element, the one XLA's
select-and-scatter selects: a scan over the window in row-major order that keeps
its current choice while it is ``>=`` the next candidate (``<=`` for a min), so
the first element that attains the maximum. A nan breaks the comparison both
ways: a nan candidate replaces the choice, and the candidate after a chosen nan
replaces it, so a window whose maximum is nan hands its gradient to its last
element if that is nan, else to the first maximum after its last nan (a window
``[nan, 1]`` to the 1). Padding and the holes of ``base_dilation`` are
candidates holding the reduction's identity, so a window whose maximum is
``-inf`` may hand its gradient to padding, where it is dropped. The rule
rebuilds the padded operand from the saved input and runs the same scan over the
window offsets.

jax's own derivatives of a pool, inside a lifted function, emit two primitives
linear in their first argument: ``select_and_scatter_add`` (``jax.grad``: the
select-and-scatter above) and ``select_and_gather_add`` (``jax.jvp``: each
window's tangent at its choice, as XLA:CPU's ``reduce_window`` finds it, a scan
that starts from the identity and skips padding and holes, so a window of
``-inf`` alone gathers 0). rf's rule for each is the exact adjoint of the
selection the primitive made. jax transposes each into the other, so in a window
of ``-inf`` alone, or one holding nan, jax.grad's gradient in the linear
argument is not the program's derivative (``tests/lift/test_conv_rules.py``).

Note [Generic reduce_window]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``lax.reduce_window`` emits the generic ``reduce_window`` primitive (a jaxpr
body and an init value) when the computation is not ``lax.add``/``lax.max``/
``lax.min`` itself or the init value is not that monoid's identity (a sum
starting at 1, a max starting at 0). ``jax.grad`` has no rule for it at all. rf
differentiates the bodies that are one ``add``, ``max`` or ``min`` of the two
arguments, with respect to the operand only: a sum like ``reduce_window_sum``;
a max/min like ``reduce_window_max``/``min`` with the init value as every
window's first candidate (where it attains the extreme, ties included, the
operand gets nothing). Any other body, several operands, or a gradient for the
init value raise ``AutogradError`` when the program is built.

Note [Cumulative reductions]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``jax.grad`` differentiates ``cumprod``/``cummax``/``cummin``/``cumlogsumexp``
through a parallel prefix scan (odd/even recursion, ``lax.associative_scan``),
so where the combining function has a kink (ties of ``max``/``min``, which split
the gradient in halves) the gradient depends on the scan's tree. The rules
replay that same tree on the saved input and walk it backwards, with the partial
derivatives of the combining function at each node.
"""

from __future__ import annotations

import functools
import itertools

import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import sharding as shd
from ..autograd.registry import BadProgram, Sample, TableEntry
from ..errors import AutogradError
from ..ops._declare import distinct, normal, unary_samples
from .rules import add_table, defrule, saves_inputs


def _dilated(n: int, d: int) -> int:
    return 0 if n == 0 else 1 + d * (n - 1)


def _zeros(aval, sharding=None):
    return shd.zeros(aval.shape, aval.dtype, sharding)


# -- conv_general_dilated ------------------------------------------------------------


def _axis_out_of(src: int, size1: int, x):
    """Split axis ``src`` into ``(size1, rest)``."""
    shape = list(x.shape)
    shape[src : src + 1] = [size1, shape[src] // size1]
    return x.reshape(shape)


def _axis_into(src: int, dst: int, x):
    """Merge axis ``src`` into axis ``dst`` (numbered without ``src``), as its major part."""
    perm = [i for i in range(x.ndim) if i != src]
    perm.insert(dst, src)
    shape = [s for i, s in enumerate(x.shape) if i != src]
    shape[dst] *= x.shape[src]
    return lax.reshape(x, tuple(shape), tuple(perm))


def _swap(spec):
    return (spec[1], spec[0], *spec[2:])


def _dilate(x, spec, dilation):
    """``x`` with ``dilation - 1`` zeros between neighbours along its spatial
    dimensions (see Note [Convolution gradients] on why not ``lhs_dilation``)."""
    if all(d == 1 for d in dilation):
        return x
    cfg = [(0, 0, 0)] * x.ndim
    for d, k in zip(spec[2:], dilation):
        cfg[d] = (0, 0, k - 1)
    return lax.pad(x, jnp.zeros((), x.dtype), cfg)


def _conv_lhs_grad(g, rhs, lhs_aval, p, sharding=None):
    lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
    fgc, bgc = p["feature_group_count"], p["batch_group_count"]
    strides, lhs_dil, rhs_dil = p["window_strides"], p["lhs_dilation"], p["rhs_dilation"]
    w_shape = [rhs.shape[d] for d in rhs_spec[2:]]
    groups = max(fgc, bgc)
    if groups > 1:  # the group axis of the kernel's outputs moves into its inputs
        rhs = _axis_into(rhs_spec[0], rhs_spec[1], _axis_out_of(rhs_spec[0], groups, rhs))
    pads = []
    for k, (lo, _) in enumerate(p["padding"]):
        i = lhs_aval.shape[lhs_spec[2 + k]]
        m = g.shape[out_spec[2 + k]]
        ext = _dilated(w_shape[k], rhs_dil[k])
        before = ext - 1 - lo
        after = _dilated(i, lhs_dil[k]) + ext - 1 - _dilated(m, strides[k]) - before
        pads.append((before, after))
    w = lax.rev(rhs, tuple(rhs_spec[2:]))
    if w.dtype != g.dtype:
        w = w.astype(g.dtype)
    out = lax.conv_general_dilated(
        _dilate(g, out_spec, strides),
        w,
        window_strides=tuple(lhs_dil),
        padding=pads,
        rhs_dilation=tuple(rhs_dil),
        dimension_numbers=lax.ConvDimensionNumbers(tuple(out_spec), _swap(rhs_spec), tuple(lhs_spec)),
        feature_group_count=groups,
        precision=p["precision"],
        preferred_element_type=p["preferred_element_type"],
        out_sharding=sharding if bgc == 1 else None,
    )
    if out.dtype != lhs_aval.dtype:
        out = out.astype(lhs_aval.dtype)
    if bgc > 1:  # the batch groups came out as feature groups: move them back
        out = _axis_into(lhs_spec[1], lhs_spec[0], _axis_out_of(lhs_spec[1], bgc, out))
    return out


def _conv_rhs_grad(g, lhs, rhs_aval, p, sharding=None):
    lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
    fgc, bgc = p["feature_group_count"], p["batch_group_count"]
    strides, lhs_dil, rhs_dil = p["window_strides"], p["lhs_dilation"], p["rhs_dilation"]
    pads = []
    for k, (lo, _) in enumerate(p["padding"]):
        i = lhs.shape[lhs_spec[2 + k]]
        m = g.shape[out_spec[2 + k]]
        ext = _dilated(rhs_aval.shape[rhs_spec[2 + k]], rhs_dil[k])
        pads.append((lo, _dilated(m, strides[k]) - _dilated(i, lhs_dil[k]) + ext - 1 - lo))
    if lhs.dtype != g.dtype:
        lhs = lhs.astype(g.dtype)
    out = lax.conv_general_dilated(
        _dilate(lhs, lhs_spec, lhs_dil),
        g,
        window_strides=tuple(rhs_dil),
        padding=pads,
        rhs_dilation=tuple(strides),
        dimension_numbers=lax.ConvDimensionNumbers(_swap(lhs_spec), _swap(out_spec), _swap(rhs_spec)),
        feature_group_count=bgc,
        batch_group_count=fgc,
        precision=p["precision"],
        preferred_element_type=p["preferred_element_type"],
        out_sharding=sharding,
    )
    if out.dtype != rhs_aval.dtype:
        out = out.astype(rhs_aval.dtype)
    return out


def _conv_vjp(r, g):
    lhs, rhs = r.ins
    a_lhs, a_rhs = r.in_avals
    empty = g.size == 0
    gl = gr = None
    if r.needs[0]:
        sh = r.in_sharding(0)
        gl = _zeros(a_lhs, sh) if empty or rhs.size == 0 else _conv_lhs_grad(g, rhs, a_lhs, r.params, sh)
    if r.needs[1]:
        sh = r.in_sharding(1)
        gr = _zeros(a_rhs, sh) if empty or lhs.size == 0 else _conv_rhs_grad(g, lhs, a_rhs, r.params, sh)
    return gl, gr


def _conv_saves(needs):
    return tuple(k for k, n in ((1, needs[0]), (0, needs[1])) if n), ()


# -- primitive-table programs -----------------------------------------------------------


def _pair(*shapes):
    """Samples of (input, kernel), both differentiable."""
    return lambda rng: [Sample((normal(rng, *a), normal(rng, *b)), diff=(0, 1)) for a, b in shapes]


def _ties(rng, *shape):
    """Small integers: many equal values in every window."""
    return np.round(rng.standard_normal(shape) * 1.5)


conv = lax.conv_general_dilated
NHWC = ("NHWC", "HWIO", "NHWC")

_CONV_TABLE = (
    TableEntry("conv2d_nchw", lambda x, w: conv(x, w, (1, 1), "VALID"), _pair(((2, 3, 6, 5), (4, 3, 3, 2))), vmap=True),
    TableEntry(
        "conv2d_nhwc_strided_padded",
        lambda x, w: conv(x, w, (2, 2), ((1, 2), (0, 1)), dimension_numbers=NHWC),
        _pair(((2, 7, 6, 3), (3, 3, 3, 4)), ((1, 6, 5, 2), (3, 2, 2, 3))),
    ),
    TableEntry("conv2d_same_stride2", lambda x, w: conv(x, w, (2, 2), "SAME"), _pair(((2, 2, 7, 6), (3, 2, 3, 3)))),
    TableEntry(
        "conv1d_rhs_dilation",
        lambda x, w: conv(x, w, (2,), ((2, 1),), rhs_dilation=(2,), dimension_numbers=("NWC", "WIO", "NWC")),
        _pair(((2, 11, 3), (3, 3, 2))),
    ),
    TableEntry(
        "conv_jnp_convolve",
        lambda x, w: jnp.convolve(x, w, mode="same") + jnp.correlate(x, w, mode="full").sum(),
        _pair(((9,), (4,))),
    ),
    TableEntry(
        "conv3d",
        lambda x, w: conv(x, w, (1, 2, 1), ((1, 0), (0, 1), (1, 1))),
        _pair(((1, 2, 4, 5, 4), (3, 2, 2, 3, 2))),
    ),
    TableEntry(
        "conv2d_lhs_dilation",
        lambda x, w: conv(x, w, (1, 1), ((1, 1), (2, 1)), lhs_dilation=(2, 2)),
        _pair(((1, 2, 4, 3), (3, 2, 3, 3))),
    ),
    TableEntry(
        "conv_transpose",
        lambda x, w: lax.conv_transpose(x, w, (2, 2), "SAME", dimension_numbers=NHWC),
        _pair(((2, 3, 4, 2), (3, 3, 2, 3))),
    ),
    TableEntry(
        "conv2d_rhs_dilation_strided",
        lambda x, w: conv(x, w, (1, 2), ((0, 1), (1, 0)), rhs_dilation=(2, 1), lhs_dilation=(1, 2)),
        _pair(((2, 2, 7, 5), (3, 2, 2, 3))),
    ),
    TableEntry(
        "conv2d_feature_groups",
        lambda x, w: conv(x, w, (1, 2), ((1, 0), (0, 0)), feature_group_count=2),
        _pair(((2, 4, 5, 5), (6, 2, 3, 3))),
        vmap=True,
    ),
    TableEntry(
        "conv2d_depthwise",
        lambda x, w: conv(x, w, (1, 1), "SAME", feature_group_count=3, dimension_numbers=NHWC),
        _pair(((2, 5, 4, 3), (3, 3, 1, 6))),
    ),
    TableEntry(
        "conv2d_batch_groups",
        lambda x, w: conv(x, w, (2, 1), ((0, 1), (1, 1)), batch_group_count=2),
        _pair(((4, 3, 5, 4), (6, 3, 3, 2))),
    ),
    TableEntry(
        "conv2d_batch_groups_mixed_layout",
        lambda x, w: conv(
            x, w, (1, 1), ((1, 0), (0, 2)), rhs_dilation=(1, 2), batch_group_count=3,
            dimension_numbers=("NHWC", "OHWI", "CNHW"),
        ),
        _pair(((6, 5, 4, 2), (6, 2, 2, 2))),
    ),
    TableEntry(
        "conv2d_feature_groups_mixed_layout",
        lambda x, w: conv(
            x, w, (2, 1), ((1, 1), (0, 0)), lhs_dilation=(1, 2), feature_group_count=2,
            dimension_numbers=("NWHC", "IHOW", "HCNW"),
        ),
        _pair(((2, 5, 4, 4), (2, 3, 4, 2))),
    ),
    TableEntry(
        "conv2d_preferred_element_type",
        lambda x, w: conv(
            x.astype(jnp.float16), w.astype(jnp.float16), (1, 1), "SAME",
            preferred_element_type=jnp.float32,
        ).astype(x.dtype),
        _pair(((2, 2, 4, 4), (3, 2, 3, 3))),
        fd=False,
    ),
)  # fmt: skip

defrule("conv_general_dilated", _conv_vjp, _conv_saves, table=_CONV_TABLE)


# -- windowed reductions -------------------------------------------------------------


def _window(p):
    return (
        tuple(p["window_dimensions"]),
        tuple(p["window_strides"]),
        tuple(tuple(lh) for lh in p["padding"]),
        tuple(p["base_dilation"]),
        tuple(p["window_dilation"]),
    )


def _pad_transpose(g, cfg, shape):
    """Gradient of ``lax.pad(x, v, cfg)`` with respect to ``x`` (of ``shape``)."""
    undo = [(max(-lo, 0), max(-hi, 0), 0) for lo, hi, _ in cfg]
    g = lax.pad(g, jnp.zeros((), g.dtype), undo)
    starts = [max(lo, 0) for lo, _, _ in cfg]
    limits = [s + (n - 1) * (it + 1) + 1 for s, n, (_, _, it) in zip(starts, shape, cfg)]
    return lax.slice(g, starts, limits, [it + 1 for _, _, it in cfg])


def _window_sum_grad(g, shape, window):
    """Gradient of a windowed sum of an operand of ``shape``: the output gradient,
    dilated by the strides and padded, summed over (dilated) windows taken with
    ``base_dilation`` as strides."""
    dims, strides, padding, base, wdil = window
    cfg = []
    for d in range(len(shape)):
        ext = _dilated(dims[d], wdil[d])
        lo = ext - 1 - padding[d][0]
        hi = (shape[d] - 1) * base[d] + ext - lo - _dilated(g.shape[d], strides[d])
        cfg.append((lo, hi, strides[d] - 1))
    gp = lax.pad(g, jnp.zeros((), g.dtype), cfg)
    zero = np.zeros((), g.dtype)
    return lax.reduce_window(gp, zero, lax.add, dims, base, [(0, 0)] * len(shape), window_dilation=wdil)


def _window_choice(x, window, out_shape, is_max, init, sharding, inside_only=False):
    """Where each window of ``x`` (padded with ``init``, or the extreme's identity)
    selects (Note [Windowed max gradients]): a scan over the window offsets in
    row-major order that keeps the current choice while it is ``>=`` (``<=`` for a
    min) the next candidate. By default it starts from the first offset, padding
    and holes included (XLA's select-and-scatter); with ``init`` or ``inside_only``
    it starts from the init value (the identity) as an offset -1 before every
    other, and ``inside_only`` skips padding and holes (XLA:CPU's reduce_window,
    which ``select_and_gather_add`` runs). Returns the padding config, the padded
    operand, each offset's (starts, limits) in the padded operand (strided by the
    window strides) and the chosen offset per window."""
    dims, strides, padding, base, wdil = window
    if init is None:
        fill = jnp.asarray(-np.inf if is_max else np.inf, x.dtype)
    else:
        fill = jnp.asarray(init, x.dtype)
    cfg = [(lo, hi, b - 1) for (lo, hi), b in zip(padding, base)]
    padded = lax.pad(x, fill, cfg)
    offsets = []
    for k in itertools.product(*(range(w) for w in dims)):
        starts = [kk * wd for kk, wd in zip(k, wdil)]
        offsets.append((starts, [s + (m - 1) * st + 1 for s, m, st in zip(starts, out_shape, strides)]))
    views = [lax.slice(padded, starts, limits, strides) for starts, limits in offsets]
    skips = [None] * len(views)
    if inside_only:
        outside = lax.pad(jnp.zeros(x.shape, bool), np.True_, cfg)
        skips = [lax.slice(outside, starts, limits, strides) for starts, limits in offsets]
    keeps = lax.ge if is_max else lax.le
    if init is None and not inside_only:
        chosen, choice, rest = views[0], shd.zeros(out_shape, np.int32, sharding), list(enumerate(views))[1:]
    else:
        chosen, choice = (
            shd.broadcast_to(fill, out_shape, sharding),
            shd.broadcast_to(np.int32(-1), out_shape, sharding),
        )
        rest = list(enumerate(views))
    for k, v in rest:
        keep = keeps(chosen, v) if skips[k] is None else keeps(chosen, v) | skips[k]
        chosen, choice = jnp.where(keep, chosen, v), jnp.where(keep, choice, np.int32(k))
    return cfg, padded, offsets, choice


def _window_chooser_grad(g, x, window, is_max, init=None, inside_only=False):
    """Each window's gradient to the element it selects (the first that attains
    its extreme value; see Note [Windowed max gradients] and ``_window_choice``),
    dropped where that is padding or ``init``: the transpose of a windowed
    selection (``select_and_gather_add``'s with ``inside_only``)."""
    strides = window[1]
    cfg, padded, offsets, choice = _window_choice(x, window, g.shape, is_max, init, shd.sharding_of(g), inside_only)
    zeros = jnp.zeros_like(g)
    gp = jnp.zeros_like(padded, dtype=g.dtype)
    for k, (starts, limits) in enumerate(offsets):
        place = [(s, n - lim, st - 1) for s, lim, n, st in zip(starts, limits, padded.shape, strides)]
        gp = gp + lax.pad(jnp.where(choice == k, g, zeros), jnp.zeros((), g.dtype), place)
    return _pad_transpose(gp, cfg, x.shape)


def _window_chooser_gather(g, x, window, out_shape, is_max):
    """Each window's entry of ``g`` (shaped like ``x``) at the element
    select-and-scatter selects, 0 where that is padding: the transpose of
    ``select_and_scatter_add``."""
    strides = window[1]
    cfg, _, offsets, choice = _window_choice(x, window, out_shape, is_max, None, shd.sharding_of(g))
    gp = lax.pad(g, jnp.zeros((), g.dtype), cfg)
    out = None
    for k, (starts, limits) in enumerate(offsets):
        v = lax.slice(gp, starts, limits, strides)
        out = jnp.where(choice == k, v, jnp.zeros_like(v) if out is None else out)
    return out


def _reduce_window_sum_vjp(r, g):
    aval = r.in_avals[0]
    if g.size == 0 or 0 in aval.shape:
        return (_zeros(aval, r.in_sharding(0)),)
    return (_window_sum_grad(g, tuple(aval.shape), _window(r.params)).astype(aval.dtype),)


def _max_pool(x, dims, strides, padding, base=None):
    return lax.reduce_window(x, -jnp.inf, lax.max, dims, strides, padding, base_dilation=base)


def _min_pool(x, dims, strides, padding, base=None):
    return lax.reduce_window(x, jnp.inf, lax.min, dims, strides, padding, base_dilation=base)


def _sum_pool(x, dims, strides, padding, base=None, wdil=None):
    return lax.reduce_window(x, 0.0, lax.add, dims, strides, padding, base_dilation=base, window_dilation=wdil)


def _avg_pool(x):
    dims, strides = (1, 3, 3, 1), (1, 2, 2, 1)
    total = _sum_pool(x, dims, strides, "SAME")
    count = _sum_pool(jnp.ones_like(x), dims, strides, "SAME")
    return total / count


defrule(
    "reduce_window_sum",
    _reduce_window_sum_vjp,
    table=(
        TableEntry(
            "reduce_window_sum",
            functools.partial(_sum_pool, dims=(2, 2), strides=(2, 1), padding=((1, 0), (0, 2))),
            unary_samples([(5, 6)]),
            vmap=True,
        ),
        TableEntry(
            "reduce_window_sum_dilations",
            functools.partial(
                _sum_pool, dims=(3, 2), strides=(1, 2), padding=((2, 1), (0, 1)), base=(2, 1), wdil=(1, 2)
            ),
            unary_samples([(4, 7)]),
        ),
        TableEntry("reduce_window_avg_pool", _avg_pool, unary_samples([(2, 5, 5, 3)])),
    ),
)


def _chooser_vjp(is_max):
    def vjp(r, g):
        aval = r.in_avals[0]
        if g.size == 0 or 0 in aval.shape:
            return (_zeros(aval, r.in_sharding(0)),)
        return (_window_chooser_grad(g, r.ins[0], _window(r.params), is_max),)

    vjp.__name__ = f"_reduce_window_{'max' if is_max else 'min'}_vjp"
    return vjp


defrule(
    "reduce_window_max",
    _chooser_vjp(True),
    saves_inputs(0),
    table=(
        TableEntry(
            "reduce_window_max_pool",
            functools.partial(_max_pool, dims=(1, 1, 2, 2), strides=(1, 1, 2, 2), padding="VALID"),
            unary_samples([(2, 3, 6, 6)], distinct),
            vmap=True,
        ),
        TableEntry(
            "reduce_window_max_same_strided",
            functools.partial(_max_pool, dims=(1, 3, 3, 1), strides=(1, 2, 2, 1), padding="SAME"),
            unary_samples([(2, 7, 6, 3)], distinct),
        ),
        TableEntry(
            "reduce_window_max_padded_base_dilation",
            functools.partial(_max_pool, dims=(3, 2), strides=(2, 1), padding=((1, 0), (1, 1)), base=(2, 1)),
            unary_samples([(5, 6)], distinct),
        ),
        TableEntry(
            "reduce_window_max_ties",
            functools.partial(_max_pool, dims=(3, 3), strides=(1, 2), padding=((1, 1), (2, 1)), base=(1, 2)),
            unary_samples([(6, 5), (4, 4)], _ties),
            fd=False,
        ),
    ),
)
defrule(
    "reduce_window_min",
    _chooser_vjp(False),
    saves_inputs(0),
    table=(
        TableEntry(
            "reduce_window_min",
            functools.partial(_min_pool, dims=(2, 3), strides=(1, 2), padding=((0, 1), (1, 0))),
            unary_samples([(5, 7)], distinct),
        ),
        TableEntry(
            "reduce_window_min_ties",
            functools.partial(_min_pool, dims=(1, 2, 2), strides=(1, 1, 1), padding="SAME"),
            unary_samples([(2, 5, 4)], _ties),
            fd=False,
        ),
    ),
)


def _selects_max(p) -> bool:
    return p["select_prim"].name == "ge"  # lax.ge_p (a max) or lax.le_p (a min)


def _select_and_scatter_add_vjp(r, g):
    """``select_and_scatter_add(source, operand)`` (``jax.grad`` of a max/min
    pool) is linear in ``source``: its gradient gathers ``g`` at the element
    each window's select-and-scatter chose (Note [Windowed max gradients]). The
    selection is piecewise constant in ``operand``, whose gradient is 0 (jax's
    JVP drops its tangent)."""
    a_src, a_op = r.in_avals
    window = _window(dict(r.params, base_dilation=(1,) * g.ndim, window_dilation=(1,) * g.ndim))
    gs = go = None
    if r.needs[0]:
        if g.size == 0 or 0 in a_src.shape:
            gs = _zeros(a_src, r.in_sharding(0))
        else:
            gs = _window_chooser_gather(g, r.ins[1], window, tuple(a_src.shape), _selects_max(r.params))
    if r.needs[1]:
        go = _zeros(a_op, r.in_sharding(1))
    return gs, go


def _select_and_gather_add_vjp(r, g):
    """``select_and_gather_add(tangents, operand)`` (``jax.jvp`` of a max/min
    pool: each window's tangent at the element it selects) is linear in
    ``tangents``: its gradient scatters ``g`` to those elements, chosen as the
    primitive chose them (from the identity, padding skipped: Note [Windowed max
    gradients]). ``operand``'s gradient is 0."""
    a_t, a_op = r.in_avals
    gt = go = None
    if r.needs[0]:
        if g.size == 0 or 0 in a_t.shape:
            gt = _zeros(a_t, r.in_sharding(0))
        else:
            window, is_max = _window(r.params), _selects_max(r.params)
            gt = _window_chooser_grad(g, r.ins[1], window, is_max, inside_only=True).astype(a_t.dtype)
    if r.needs[1]:
        go = _zeros(a_op, r.in_sharding(1))
    return gt, go


# emitted only by jax's own differentiation of a max/min pool (jax.grad, jax.jvp inside a
# lifted function: a gradient penalty, a Hessian through jax.grad); no public jax
# function emits them in a forward program, so they have no primitive-table entry and
# are tested in tests/lift/test_conv_rules.py
defrule("select_and_scatter_add", _select_and_scatter_add_vjp, saves_inputs(1))
defrule("select_and_gather_add", _select_and_gather_add_vjp, saves_inputs(1))


_MONOIDS = {"add": "sum", "max": "max", "min": "min"}


def _generic_body(step) -> str:
    """The reduction a generic ``reduce_window`` (a program step or its record)
    performs: ``sum``, ``max`` or ``min`` when its body is one ``add``/``max``/
    ``min`` of its two arguments; anything else raises (no rule can be right
    for every body)."""
    body = step.params["jaxpr"]
    body = getattr(body, "jaxpr", body)
    n = len(step.in_avals) // 2
    kind = None
    if n == 1 and not step.params["consts"] and len(body.eqns) == 1:
        eqn = body.eqns[0]
        if (
            eqn.primitive.name in _MONOIDS
            and set(map(id, eqn.invars)) == set(map(id, body.invars))
            and len(eqn.invars) == 2
            and body.outvars[0] is eqn.outvars[0]
        ):
            kind = _MONOIDS[eqn.primitive.name]
    if kind is None:
        raise AutogradError(
            "rf.lift: no backward rule for a reduce_window whose computation is not a single "
            "lax.add, lax.max or lax.min of one operand (got "
            f"{[e.primitive.name for e in body.eqns]} on {n} operand(s)); use jnp/lax reductions "
            "(lax.reduce_window with lax.add/lax.max/lax.min) or wrap it in jax.custom_vjp."
        )
    if step.needs[1]:
        raise AutogradError(
            "rf.lift: reduce_window has no gradient with respect to its init value (jax.grad has "
            "none either); pass it as a constant."
        )
    return kind


def _reduce_window_vjp(r, g):
    (g,) = g
    kind = _generic_body(r)
    aval = r.in_avals[0]
    if g.size == 0 or 0 in aval.shape:
        return _zeros(aval, r.in_sharding(0)), None
    window = _window(r.params)
    if kind == "sum":
        return _window_sum_grad(g, tuple(aval.shape), window).astype(aval.dtype), None
    return _window_chooser_grad(g, r.ins[0], window, kind == "max", init=r.ins[1]), None


_reduce_window_vjp.prepare = _generic_body  # type: ignore[attr-defined]


def _relu_pool_ref(x):
    return jnp.maximum(_max_pool(x, (2, 3), (1, 2), ((1, 0), (1, 1))), 0.0)


def _relu_pool(x):
    """max(0, window max) as a generic reduce_window (init 0, a lambda body);
    jax.grad cannot differentiate it, so the table's oracle is the equivalent
    reduce_window_max program, ``_relu_pool_ref``."""
    return lax.reduce_window(x, 0.0, lambda a, b: lax.max(a, b), (2, 3), (1, 2), ((1, 0), (1, 1)))


def _shifted_sum_pool_ref(x):
    return _sum_pool(x, (2, 2), (2, 1), ((0, 0), (1, 0))) + 1


def _shifted_sum_pool(x):
    """1 + window sum as a generic reduce_window (init 1); oracle
    ``_shifted_sum_pool_ref``."""
    return lax.reduce_window(x, 1.0, lax.add, (2, 2), (2, 1), ((0, 0), (1, 0)))


def _reduce_window_errors():
    return [
        BadProgram(
            "other body",
            lambda x: lax.reduce_window(x, 1.0, lax.mul, (2,), (1,), "VALID"),
            (np.arange(1.0, 5.0),),
            AutogradError,
            ("rf.lift", "lax.add, lax.max or lax.min"),
        ),
        BadProgram(
            "init value gradient",
            lambda x, c: lax.reduce_window(x, c, lax.max, (2,), (1,), "VALID"),
            (np.arange(1.0, 5.0), np.asarray(0.0)),
            AutogradError,
            ("rf.lift", "init value"),
            argnums=(0, 1),
        ),
    ]


defrule(
    "reduce_window",
    _reduce_window_vjp,
    lambda needs: ((0, 1), ()),
    multiple_results=True,
    doc="Backward record of a generic ``reduce_window`` whose body is ``add``, ``max`` or ``min``.",
    table=(
        TableEntry("reduce_window_generic_max", _relu_pool, unary_samples([(5, 7)], distinct), oracle=_relu_pool_ref),
        TableEntry(
            "reduce_window_generic_add", _shifted_sum_pool, unary_samples([(5, 4)]), oracle=_shifted_sum_pool_ref
        ),
    ),
    errors=_reduce_window_errors,
)


# -- cumulative reductions -----------------------------------------------------------


def _cumsum_vjp(r, g):
    return (lax.cumsum(g, axis=r.params["axis"], reverse=not r.params["reverse"]),)


defrule(
    "cumsum",
    _cumsum_vjp,
    table=(
        TableEntry(
            "cumsum",
            lambda x: jnp.cumsum(x, axis=1) + lax.cumsum(x, axis=0, reverse=True) ** 2,
            unary_samples([(3, 7), (8, 2)]),
            vmap=True,
        ),
    ),
)


def _no_pos_inf(x):
    return jnp.where(x == jnp.inf, jnp.zeros_like(x), x)


def _mul_partials(a, b, c):
    return b, a


def _balanced(x, z, y):
    """1 where ``x`` attains ``z``, 1/2 where ``y`` attains it too."""
    return jnp.where(x == z, jnp.where(y == z, 0.5, 1.0), 0.0).astype(z.dtype)


def _chooser_partials(a, b, c):
    return _balanced(a, c, b), _balanced(b, c, a)


def _logaddexp_partials(a, b, c):
    c = _no_pos_inf(c)
    return jnp.exp(_no_pos_inf(a) - c), jnp.exp(_no_pos_inf(b) - c)


def _interleave(even, odd, axis):
    """``even[0], odd[0], even[1], odd[1], ...`` along ``axis``."""
    ne, no = even.shape[axis], odd.shape[axis]
    zero = jnp.zeros((), even.dtype)
    pe = [(0, 0, 0)] * even.ndim
    po = [(0, 0, 0)] * odd.ndim
    pe[axis] = (0, 1 if ne == no else 0, 1)
    po[axis] = (1, 0 if ne == no else 1, 1)
    return lax.pad(even, zero, pe) + lax.pad(odd, zero, po)


def _spread(g, axis, start, n):
    """Transpose of ``slice_in_dim(x, start, None, stride=2)`` for ``x`` ``n`` long."""
    cfg = [(0, 0, 0)] * g.ndim
    m = g.shape[axis]
    cfg[axis] = (start, n - start - (2 * (m - 1) + 1) if m else n - start, 1)
    return lax.pad(g, jnp.zeros((), g.dtype), cfg)


def _scan_vjp(x, g, axis, combine, partials):
    """The prefix scan of ``x`` along ``axis`` (the tree of
    ``lax.associative_scan``) and its vjp applied to ``g``."""

    def scan(e):
        """(scan of e, vjp of the scan)."""
        n = e.shape[axis]
        if n < 2:
            return e, lambda t: t
        a = lax.slice_in_dim(e, 0, n - 1, stride=2, axis=axis)
        b = lax.slice_in_dim(e, 1, None, stride=2, axis=axis)
        red = combine(a, b)
        pa, pb = partials(a, b, red)
        odd, odd_vjp = scan(red)
        left = lax.slice_in_dim(odd, 0, odd.shape[axis] - 1, axis=axis) if n % 2 == 0 else odd
        right = lax.slice_in_dim(e, 2, None, stride=2, axis=axis)
        rest = combine(left, right)
        qa, qb = partials(left, right, rest)
        first = lax.slice_in_dim(e, 0, 1, axis=axis)
        out = _interleave(lax.concatenate([first, rest], axis), odd, axis)

        def vjp(t):
            t_even = lax.slice_in_dim(t, 0, None, stride=2, axis=axis)
            t_odd = lax.slice_in_dim(t, 1, None, stride=2, axis=axis)
            t_first = lax.slice_in_dim(t_even, 0, 1, axis=axis)
            t_rest = lax.slice_in_dim(t_even, 1, None, axis=axis)
            t_left, t_right = t_rest * qa, t_rest * qb
            if n % 2 == 0:
                cfg = [(0, 0, 0)] * t.ndim
                cfg[axis] = (0, 1, 0)
                t_left = lax.pad(t_left, jnp.zeros((), t.dtype), cfg)
            t_red = odd_vjp(t_odd + t_left)
            ta, tb = t_red * pa, t_red * pb
            cfg = [(0, 0, 0)] * t.ndim
            cfg[axis] = (0, n - 1, 0)
            t_e = lax.pad(t_first, jnp.zeros((), t.dtype), cfg) + _spread(t_right, axis, 2, n)
            return t_e + _spread(ta, axis, 0, n) + _spread(tb, axis, 1, n)

        return out, vjp

    return scan(x)[1](g)


def _cumulative(name, combine, partials):
    def vjp(r, g):
        axis, reverse = r.params["axis"], r.params["reverse"]
        x = r.ins[0]
        if reverse:
            x, g = lax.rev(x, (axis,)), lax.rev(g, (axis,))
        gx = _scan_vjp(x, g, axis, combine, partials)
        return (lax.rev(gx, (axis,)) if reverse else gx,)

    vjp.__name__ = f"_{name}_vjp"
    defrule(name, vjp, saves_inputs(0))


def _rev_too(op, **kw):
    """op along axis 1 forward and along axis 0 in reverse."""
    return lambda x: op(x, axis=1, **kw) + op(x, axis=0, reverse=True, **kw) ** 2


def _zero_at(x, i, j):
    return jnp.where(
        (lax.broadcasted_iota(int, x.shape, 0) == i) & (lax.broadcasted_iota(int, x.shape, 1) == j), 0.0, x
    )


def _ties_to_neg_inf(rng, *shape):
    return np.where(_ties(rng, *shape) > 0, -np.inf, _ties(rng, *shape))


_CUM_SHAPES = [(3, 7), (8, 2)]

_cumulative("cumprod", lax.mul, _mul_partials)
add_table(
    "cumprod",
    TableEntry("cumprod", _rev_too(lax.cumprod), unary_samples(_CUM_SHAPES)),
    TableEntry(
        "cumprod_zero",
        lambda x: lax.cumprod(_zero_at(x, 1, 2), axis=1) + jnp.cumprod(_zero_at(x, 4, 0), axis=0),
        unary_samples([(6, 5)]),
    ),
)
_cumulative("cummax", lax.max, _chooser_partials)
add_table(
    "cummax",
    TableEntry("cummax", _rev_too(lax.cummax), unary_samples(_CUM_SHAPES, distinct), vmap=True),
    TableEntry("cummax_ties", _rev_too(lax.cummax), unary_samples([(3, 9), (6, 4)], _ties), fd=False),
)
_cumulative("cummin", lax.min, _chooser_partials)
add_table(
    "cummin",
    TableEntry("cummin", _rev_too(lax.cummin), unary_samples(_CUM_SHAPES, distinct)),
    TableEntry("cummin_ties", _rev_too(lax.cummin), unary_samples([(3, 9), (7, 4)], _ties), fd=False),
)
_cumulative("cumlogsumexp", jnp.logaddexp, _logaddexp_partials)
add_table(
    "cumlogsumexp",
    TableEntry("cumlogsumexp", _rev_too(lax.cumlogsumexp), unary_samples(_CUM_SHAPES)),
    TableEntry("cumlogsumexp_ties", _rev_too(lax.cumlogsumexp), unary_samples([(4, 6)], _ties_to_neg_inf), fd=False),
)
