"""Primitive-table entries for convolutions, windowed reductions and cumulative
reductions (conv_general_dilated, reduce_window_*, reduce_window, cum*)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .ptable_base import PInfo, PSample, distinct, normal


def _pair(*shapes):
    """Samples of (input, kernel), both differentiable."""
    return lambda rng: [PSample((normal(rng, *a), normal(rng, *b)), (0, 1)) for a, b in shapes]


def _one(gen, *shapes):
    return lambda rng: [PSample((gen(rng, *s),)) for s in shapes]


def _ties(rng, *shape):
    """Small integers: many equal values in every window."""
    return np.round(rng.standard_normal(shape) * 1.5)


conv = lax.conv_general_dilated
NHWC = ("NHWC", "HWIO", "NHWC")


# -- conv_general_dilated ------------------------------------------------------------
CONV: list[PInfo] = [
    PInfo(
        "conv2d_nchw",
        lambda x, w: conv(x, w, (1, 1), "VALID"),
        _pair(((2, 3, 6, 5), (4, 3, 3, 2))),
        ("conv_general_dilated",),
        vmap=True,
    ),
    PInfo(
        "conv2d_nhwc_strided_padded",
        lambda x, w: conv(x, w, (2, 2), ((1, 2), (0, 1)), dimension_numbers=NHWC),
        _pair(((2, 7, 6, 3), (3, 3, 3, 4)), ((1, 6, 5, 2), (3, 2, 2, 3))),
        ("conv_general_dilated",),
    ),
    PInfo(
        "conv2d_same_stride2",
        lambda x, w: conv(x, w, (2, 2), "SAME"),
        _pair(((2, 2, 7, 6), (3, 2, 3, 3))),
        ("conv_general_dilated",),
    ),
    PInfo(
        "conv1d_rhs_dilation",
        lambda x, w: conv(x, w, (2,), ((2, 1),), rhs_dilation=(2,), dimension_numbers=("NWC", "WIO", "NWC")),
        _pair(((2, 11, 3), (3, 3, 2))),
        ("conv_general_dilated",),
    ),
    PInfo(
        "conv_jnp_convolve",
        lambda x, w: jnp.convolve(x, w, mode="same") + jnp.correlate(x, w, mode="full").sum(),
        _pair(((9,), (4,))),
        ("conv_general_dilated",),
    ),
    PInfo(
        "conv3d",
        lambda x, w: conv(x, w, (1, 2, 1), ((1, 0), (0, 1), (1, 1))),
        _pair(((1, 2, 4, 5, 4), (3, 2, 2, 3, 2))),
        ("conv_general_dilated",),
    ),
    PInfo(
        "conv2d_lhs_dilation",
        lambda x, w: conv(x, w, (1, 1), ((1, 1), (2, 1)), lhs_dilation=(2, 2)),
        _pair(((1, 2, 4, 3), (3, 2, 3, 3))),
        ("conv_general_dilated",),
    ),
    PInfo(
        "conv_transpose",
        lambda x, w: lax.conv_transpose(x, w, (2, 2), "SAME", dimension_numbers=NHWC),
        _pair(((2, 3, 4, 2), (3, 3, 2, 3))),
        ("conv_general_dilated",),
    ),
    PInfo(
        "conv2d_rhs_dilation_strided",
        lambda x, w: conv(x, w, (1, 2), ((0, 1), (1, 0)), rhs_dilation=(2, 1), lhs_dilation=(1, 2)),
        _pair(((2, 2, 7, 5), (3, 2, 2, 3))),
        ("conv_general_dilated",),
    ),
    PInfo(
        "conv2d_feature_groups",
        lambda x, w: conv(x, w, (1, 2), ((1, 0), (0, 0)), feature_group_count=2),
        _pair(((2, 4, 5, 5), (6, 2, 3, 3))),
        ("conv_general_dilated",),
        vmap=True,
    ),
    PInfo(
        "conv2d_depthwise",
        lambda x, w: conv(x, w, (1, 1), "SAME", feature_group_count=3, dimension_numbers=NHWC),
        _pair(((2, 5, 4, 3), (3, 3, 1, 6))),
        ("conv_general_dilated",),
    ),
    PInfo(
        "conv2d_batch_groups",
        lambda x, w: conv(x, w, (2, 1), ((0, 1), (1, 1)), batch_group_count=2),
        _pair(((4, 3, 5, 4), (6, 3, 3, 2))),
        ("conv_general_dilated",),
    ),
    PInfo(
        "conv2d_batch_groups_mixed_layout",
        lambda x, w: conv(
            x, w, (1, 1), ((1, 0), (0, 2)), rhs_dilation=(1, 2), batch_group_count=3,
            dimension_numbers=("NHWC", "OHWI", "CNHW"),
        ),
        _pair(((6, 5, 4, 2), (6, 2, 2, 2))),
        ("conv_general_dilated",),
    ),
    PInfo(
        "conv2d_feature_groups_mixed_layout",
        lambda x, w: conv(
            x, w, (2, 1), ((1, 1), (0, 0)), lhs_dilation=(1, 2), feature_group_count=2,
            dimension_numbers=("NWHC", "IHOW", "HCNW"),
        ),
        _pair(((2, 5, 4, 4), (2, 3, 4, 2))),
        ("conv_general_dilated",),
    ),
    PInfo(
        "conv2d_preferred_element_type",
        lambda x, w: conv(
            x.astype(jnp.float16), w.astype(jnp.float16), (1, 1), "SAME",
            preferred_element_type=jnp.float32,
        ).astype(x.dtype),
        _pair(((2, 2, 4, 4), (3, 2, 3, 3))),
        ("conv_general_dilated",),
        fd=False,
    ),
]  # fmt: skip


# -- reduce_window_* -------------------------------------------------------------------
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


def _relu_pool_ref(x):
    return jnp.maximum(_max_pool(x, (2, 3), (1, 2), ((1, 0), (1, 1))), 0.0)


@jax.custom_jvp
def _relu_pool(x):
    """max(0, window max) as a generic reduce_window (init 0, a lambda body);
    jax.grad goes through the equivalent reduce_window_max program instead."""
    return lax.reduce_window(x, 0.0, lambda a, b: lax.max(a, b), (2, 3), (1, 2), ((1, 0), (1, 1)))


_relu_pool.defjvp(lambda p, t: jax.jvp(_relu_pool_ref, p, t))


@jax.custom_jvp
def _shifted_sum_pool(x):
    """1 + window sum as a generic reduce_window (init 1)."""
    return lax.reduce_window(x, 1.0, lax.add, (2, 2), (2, 1), ((0, 0), (1, 0)))


_shifted_sum_pool.defjvp(lambda p, t: jax.jvp(lambda x: _sum_pool(x, (2, 2), (2, 1), ((0, 0), (1, 0))) + 1, p, t))


WINDOW: list[PInfo] = [
    PInfo(
        "reduce_window_max_pool",
        functools.partial(_max_pool, dims=(1, 1, 2, 2), strides=(1, 1, 2, 2), padding="VALID"),
        _one(distinct, (2, 3, 6, 6)),
        ("reduce_window_max",),
        vmap=True,
    ),
    PInfo(
        "reduce_window_max_same_strided",
        functools.partial(_max_pool, dims=(1, 3, 3, 1), strides=(1, 2, 2, 1), padding="SAME"),
        _one(distinct, (2, 7, 6, 3)),
        ("reduce_window_max",),
    ),
    PInfo(
        "reduce_window_max_padded_base_dilation",
        functools.partial(_max_pool, dims=(3, 2), strides=(2, 1), padding=((1, 0), (1, 1)), base=(2, 1)),
        _one(distinct, (5, 6)),
        ("reduce_window_max",),
    ),
    PInfo(
        "reduce_window_max_ties",
        functools.partial(_max_pool, dims=(3, 3), strides=(1, 2), padding=((1, 1), (2, 1)), base=(1, 2)),
        _one(_ties, (6, 5), (4, 4)),
        ("reduce_window_max",),
        fd=False,
    ),
    PInfo(
        "reduce_window_min",
        functools.partial(_min_pool, dims=(2, 3), strides=(1, 2), padding=((0, 1), (1, 0))),
        _one(distinct, (5, 7)),
        ("reduce_window_min",),
    ),
    PInfo(
        "reduce_window_min_ties",
        functools.partial(_min_pool, dims=(1, 2, 2), strides=(1, 1, 1), padding="SAME"),
        _one(_ties, (2, 5, 4)),
        ("reduce_window_min",),
        fd=False,
    ),
    PInfo(
        "reduce_window_sum",
        functools.partial(_sum_pool, dims=(2, 2), strides=(2, 1), padding=((1, 0), (0, 2))),
        _one(normal, (5, 6)),
        ("reduce_window_sum",),
        vmap=True,
    ),
    PInfo(
        "reduce_window_sum_dilations",
        functools.partial(_sum_pool, dims=(3, 2), strides=(1, 2), padding=((2, 1), (0, 1)), base=(2, 1), wdil=(1, 2)),
        _one(normal, (4, 7)),
        ("reduce_window_sum",),
    ),
    PInfo("reduce_window_avg_pool", _avg_pool, _one(normal, (2, 5, 5, 3)), ("reduce_window_sum",)),
    PInfo("reduce_window_generic_max", _relu_pool, _one(distinct, (5, 7)), ("reduce_window",)),
    PInfo("reduce_window_generic_add", _shifted_sum_pool, _one(normal, (5, 4)), ("reduce_window",)),
]


# -- cumulative reductions -------------------------------------------------------------
def _rev_too(op, **kw):
    """op along axis 1 forward and along axis 0 in reverse."""
    return lambda x: op(x, axis=1, **kw) + op(x, axis=0, reverse=True, **kw) ** 2


def _cum(gen):
    return _one(gen, (3, 7), (8, 2))


def _zero_at(x, i, j):
    return jnp.where(
        (lax.broadcasted_iota(int, x.shape, 0) == i) & (lax.broadcasted_iota(int, x.shape, 1) == j), 0.0, x
    )


CUMULATIVE: list[PInfo] = [
    PInfo(
        "cumsum",
        lambda x: jnp.cumsum(x, axis=1) + lax.cumsum(x, axis=0, reverse=True) ** 2,
        _cum(normal),
        ("cumsum",),
        vmap=True,
    ),
    PInfo("cumprod", _rev_too(lax.cumprod), _cum(normal), ("cumprod",)),
    PInfo(
        "cumprod_zero",
        lambda x: lax.cumprod(_zero_at(x, 1, 2), axis=1) + jnp.cumprod(_zero_at(x, 4, 0), axis=0),
        _one(normal, (6, 5)),
        ("cumprod",),
    ),
    PInfo("cummax", _rev_too(lax.cummax), _cum(distinct), ("cummax",), vmap=True),
    PInfo("cummax_ties", _rev_too(lax.cummax), _one(_ties, (3, 9), (6, 4)), ("cummax",), fd=False),
    PInfo("cummin", _rev_too(lax.cummin), _cum(distinct), ("cummin",)),
    PInfo("cummin_ties", _rev_too(lax.cummin), _one(_ties, (3, 9), (7, 4)), ("cummin",), fd=False),
    PInfo("cumlogsumexp", _rev_too(lax.cumlogsumexp), _cum(normal), ("cumlogsumexp",)),
    PInfo(
        "cumlogsumexp_ties",
        _rev_too(lax.cumlogsumexp),
        _one(lambda r, *s: np.where(_ties(r, *s) > 0, -np.inf, _ties(r, *s)), (4, 6)),
        ("cumlogsumexp",),
        fd=False,
    ),
]

ENTRIES: list[PInfo] = CONV + WINDOW + CUMULATIVE
