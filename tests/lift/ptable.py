"""The primitive table: jax.numpy / lax programs that exercise each primitive
rule of ``rf.lift`` (PyTorch OpInfo / jax LAX_GRAD_OPS style).

Each entry: a plain jax function of arrays (the oracle is ``jax.grad`` of that
same function: rf only ever sees it through ``rf.lift``), a sample generator,
the differentiable argument positions, and the primitives it must exercise.
Adding a rule = one entry here or in a ``ptable_<family>.py`` module (the
coverage test fails otherwise).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from rumus_fx.autograd.registry import declarations

from . import ptable_conv, ptable_indexing, ptable_linalg
from .ptable_base import PInfo, PSample, away, binary, distinct, normal, positive, u, unary, unit

_MESH1 = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
_MESH1_AUTO = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])

CORE: list[PInfo] = [
    # -- elementwise unary ------------------------------------------------------
    u("neg", lambda x: -x, vmap=True),
    u("exp", jnp.exp, vmap=True),
    u("log", jnp.log, positive),
    u("tanh", jnp.tanh, vmap=True),
    u("logistic", jax.nn.sigmoid, prims=("logistic",)),
    u("sin", jnp.sin, vmap=True),
    u("cos", jnp.cos),
    u("tan", jnp.tan, unit),
    u("asin", jnp.arcsin, unit),
    u("acos", jnp.arccos, unit),
    u("atan", jnp.arctan),
    u("sinh", jnp.sinh),
    u("cosh", jnp.cosh),
    u("asinh", jnp.arcsinh),
    u("acosh", jnp.arccosh, lambda r, *s: 1.5 + positive(r, *s)),
    u("atanh", jnp.arctanh, unit),
    u("sqrt", jnp.sqrt, positive),
    u("rsqrt", lax.rsqrt, positive),
    u("abs", jnp.abs, away),
    u("integer_pow", lambda x: x**3 + x**2 - 1 / x**2, away),
    u("erf", jax.scipy.special.erf),
    u("erfc", jax.scipy.special.erfc),
    u("erf_inv", jax.scipy.special.erfinv, unit),
    u("lgamma", jax.scipy.special.gammaln, positive),
    u("digamma", jax.scipy.special.digamma, positive),
    u("reduce_precision", lambda x: lax.reduce_precision(x, 8, 23) * x, fd=False),
    u("convert_element_type", lambda x: jnp.sin(x.astype(jnp.bfloat16).astype(x.dtype)) * x, fd=False),
    # -- binary ------------------------------------------------------------------
    PInfo("add", lambda x, y: x + y, binary(), ("add",), vmap=True),
    PInfo("sub", lambda x, y: x - y, binary(), ("sub",)),
    PInfo("mul", lambda x, y: x * y, binary(), ("mul",), vmap=True),
    PInfo("div", lambda x, y: x / y, binary(normal, positive), ("div",)),
    PInfo("max", jnp.maximum, binary(distinct, distinct), ("max",)),
    PInfo("min", jnp.minimum, binary(distinct, distinct), ("min",)),
    PInfo("atan2", jnp.arctan2, binary(away, away), ("atan2",)),
    PInfo("rem", lambda x, y: lax.rem(x, y), binary(positive, lambda r, *s: 0.3 + 0 * positive(r, *s)), ("rem",)),
    PInfo("pow", lambda x, y: lax.pow(x, y), binary(positive, normal), ("pow",)),
    PInfo(
        "select_n",
        lambda x, y: jnp.where(x > 0, x * 2, y),
        binary(away, normal, shapes=(((3, 4), (3, 4)),)),
        ("select_n",),
    ),
    PInfo(
        "clamp",
        lambda lo, x, hi: lax.clamp(lo, x, hi),
        lambda r: [
            PSample(
                (-1 + 0.1 * distinct(r, 3, 4), distinct(r, 3, 4), 1 + 0.1 * distinct(r, 3, 4)),
                diff=(0, 1, 2),
            )
        ],
        ("clamp",),
    ),
    u("optimization_barrier", lambda x: lax.optimization_barrier((x, x * 2))[1] * x),
    # -- sharding annotations (one-device meshes here; tests/_sharded_cases.py runs them on 8)
    u("reshard", lambda x: jnp.sin(jax.sharding.reshard(x, NamedSharding(_MESH1, P()))) * x),
    u(
        "sharding_constraint",
        lambda x: jnp.sin(lax.with_sharding_constraint(x, NamedSharding(_MESH1_AUTO, P()))) * x,
    ),
    # -- reductions -------------------------------------------------------------------
    PInfo(
        "reduce_sum",
        lambda x: jnp.sum(x, axis=(0, 2)) * jnp.sum(x),
        unary(shapes=((2, 3, 4),)),
        ("reduce_sum",),
        vmap=True,
    ),
    PInfo("reduce_max", lambda x: jnp.max(x, axis=1), unary(distinct), ("reduce_max",)),
    PInfo("reduce_max_ties", lambda x: jnp.max(jnp.round(x), axis=0), unary(normal, ((6, 3),)), ("reduce_max",)),
    PInfo("reduce_min", lambda x: jnp.min(x, axis=(0, 1)), unary(distinct, ((3, 4), (2, 3, 5))), ("reduce_min",)),
    PInfo("reduce_prod", lambda x: jnp.prod(x, axis=1), unary(normal, ((3, 4), (2, 3, 5))), ("reduce_prod",)),
    PInfo(
        "reduce_prod_zero",
        lambda x: jnp.prod(x.at[0, 1].set(0.0), axis=1) + jnp.prod(x),
        unary(normal, ((3, 4),)),
        ("reduce_prod",),
    ),
    # -- dot_general ----------------------------------------------------------------
    PInfo(
        "dot_general",
        lambda a, b: a @ b,
        lambda r: [
            PSample((normal(r, 3, 4), normal(r, 4, 5)), (0, 1)),
            PSample((normal(r, 4), normal(r, 4, 5)), (0, 1)),
            PSample((normal(r, 3, 4), normal(r, 4)), (0, 1)),
            PSample((normal(r, 2, 3, 4), normal(r, 2, 4, 5)), (0, 1)),
        ],
        ("dot_general",),
        vmap=True,
    ),
    PInfo(
        "dot_general_einsum",
        lambda a, b: jnp.einsum("bik,jbk->bji", a, b),
        lambda r: [PSample((normal(r, 2, 3, 4), normal(r, 5, 2, 4)), (0, 1))],
        ("dot_general",),
    ),
    PInfo(
        "dot_general_contract2",
        lambda a, b: lax.dot_general(a, b, (((2, 0), (0, 1)), ((), ()))),
        lambda r: [PSample((normal(r, 3, 4, 2), normal(r, 2, 3, 5)), (0, 1))],
        ("dot_general",),
    ),
    # -- shape ops ---------------------------------------------------------------------
    PInfo(
        "broadcast_in_dim",
        lambda x: jnp.broadcast_to(x, (2, 3, 4)) * jnp.arange(24.0).reshape(2, 3, 4),
        unary(shapes=((3, 1), (4,))),
        ("broadcast_in_dim",),
    ),
    PInfo(
        "reshape_transpose",
        lambda x: jnp.transpose(x.reshape(4, 3), (1, 0)) * jnp.arange(12.0).reshape(3, 4),
        unary(shapes=((3, 4),)),
        ("reshape", "transpose"),
    ),
    PInfo(
        "reshape_dimensions",  # jnp.column_stack of a 2-D array: reshape with a transpose
        lambda x: jnp.column_stack(x) * jnp.arange(12.0).reshape(4, 3),
        unary(shapes=((3, 4),)),
        ("reshape", "transpose"),
    ),
    PInfo(
        "squeeze_expand",
        lambda x: jnp.squeeze(jnp.expand_dims(x, 0), 0)[None] * 2.0,
        unary(shapes=((3, 4),)),
        ("squeeze",),
    ),
    PInfo(
        "concatenate",
        lambda x, y: jnp.concatenate([x, y, x], axis=1) ** 2,
        lambda r: [PSample((normal(r, 3, 2), normal(r, 3, 4)), (0, 1))],
        ("concatenate",),
    ),
    PInfo(
        "pad",
        # (x + 0 * v: jax.grad itself cannot transpose pad w.r.t. the padding
        # value alone when the operand is a constant)
        lambda x, v: lax.pad(x + 0.0 * v, v, ((1, 2, 1), (-1, 1, 0))) ** 2,
        lambda r: [PSample((normal(r, 3, 4), normal(r)), (0, 1))],
        ("pad",),
    ),
    PInfo(
        "slice",
        lambda x: x[1:3, ::2] ** 2 + lax.slice(x, (0, 1), (3, 4), (2, 2)).sum(),
        unary(shapes=((4, 5),)),
        ("slice",),
    ),
    PInfo("rev", lambda x: jnp.flip(x, (0, 1)) * jnp.arange(12.0).reshape(3, 4), unary(shapes=((3, 4),)), ("rev",)),
    PInfo("split", lambda x: jnp.split(x, [1, 3], axis=1)[1] ** 2, unary(shapes=((3, 5),)), ("split",)),
    PInfo(
        "stack",
        lambda x, y: jnp.stack([x, y * 2.0, x], axis=1) ** 2,
        lambda r: [PSample((normal(r, 3, 4), normal(r, 3, 4)), (0, 1))],
        ("stack",),
    ),
    PInfo(
        "dynamic_slice",
        lambda x, i: lax.dynamic_slice(x, (i[0], i[1]), (2, 3)) ** 2,
        lambda r: [PSample((normal(r, 4, 5), np.array([1, 1], np.int32)))],
        ("dynamic_slice",),
    ),
    PInfo(
        "dynamic_update_slice",
        lambda x, u, i: lax.dynamic_update_slice(x, u * 3.0, (i[0], i[1])) ** 2,
        lambda r: [PSample((normal(r, 4, 5), normal(r, 2, 3), np.array([2, 1], np.int32)), (0, 1))],
        ("dynamic_update_slice",),
    ),
]

@jax.custom_vjp
def _sin_cvjp(x):
    return jnp.sin(x)


_sin_cvjp.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (g * c,))


def _scan_program(w, x):
    def body(h, xi):
        h = jnp.tanh(h * w + xi)
        return h, h * 2.0

    h, ys = lax.scan(body, x[0], x)
    return jnp.sum(ys) + h


CONTROL: list[PInfo] = [
    PInfo(
        "scan",
        _scan_program,
        lambda r: [PSample((normal(r, 4) * 0.5, normal(r, 5, 4)), (0, 1))],
        ("scan",),
        vmap=True,
    ),
    PInfo(
        "cond",
        lambda x, y: lax.cond(jnp.sum(x) > 0, lambda a, b: jnp.sin(a) * b, lambda a, b: a * b**2, x, y),
        lambda r: [PSample((positive(r, 3), normal(r, 3)), (0, 1)), PSample((-positive(r, 3), normal(r, 3)), (0, 1))],
        ("cond",),
    ),
    PInfo("custom_vjp_call", lambda x: _sin_cvjp(x) * x, unary(), ("custom_vjp_call",)),
    PInfo(
        "remat2",
        lambda x, y: jax.checkpoint(lambda a, b: jnp.sin(a @ b) * a)(x, y),
        lambda r: [PSample((normal(r, 3, 3), normal(r, 3, 3)), (0, 1))],
        ("remat2",),
    ),
]

def declared() -> list[PInfo]:
    """The entries declared with the rules themselves (``defrule(..., table=...)``,
    Note [Declaring an op] in rumus_fx/autograd/registry.py)."""
    out = []
    for d in declarations("primitive"):
        for e in d.extra.get("table", ()):
            prims = e.prims or (d.name,)
            out.append(PInfo(e.name, e.fun, e.samples, prims, e.rtol32, e.atol32, e.fd_tol, e.vmap, e.fd))
    return out


ENTRIES: list[PInfo] = (
    CORE + CONTROL + ptable_conv.ENTRIES + ptable_indexing.ENTRIES + ptable_linalg.ENTRIES + declared()
)
