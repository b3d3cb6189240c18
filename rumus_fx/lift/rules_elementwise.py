"""Primitive rules: elementwise math, casts, select/clamp.

Each line declares a record type (``SinBackward``, ...) and its hand-written
backward formula (see Note [Primitive rules] in ``rules.py``). Binary
primitives may get a rank-0 operand next to an array (a python scalar in jnp
code), so their gradients are summed back to each operand's shape.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from .. import sharding as shd
from ..autograd.registry import TableEntry
from ..ops._declare import normal, positive, unary_samples
from .rules import defrule, in_, out_


def unbroadcast(g, aval, sharding=None):
    """Sum ``g`` down to ``aval``'s shape (rank-0 or size-1 operands) and cast;
    with an explicit ``sharding`` (the operand's) the result has it, as in JAX's
    own transpose rules (a gradient of an operand that was replicated against a
    sharded one is summed, or resharded, to the operand's type)."""
    shape = tuple(aval.shape)
    if tuple(g.shape) != shape:
        if not shape:
            g = jnp.sum(g)
        else:
            lead = g.ndim - len(shape)
            axes = tuple(range(lead)) + tuple(
                lead + i for i, s in enumerate(shape) if s == 1 and g.shape[lead + i] != 1
            )
            g = shd.reshape(jnp.sum(g, axis=axes), shape, out_sharding=sharding)
    g = shd.conform(g, sharding)
    if g.dtype != aval.dtype:
        g = g.astype(aval.dtype)
    return g


def _x(r, k=0):
    return r.ins[k]


def _y(r, k=0):
    return r.outs[k]


_SHAPES = [(3, 4), (2, 3, 5)]


def _unary(name, formula, saves, doc=None, program=None, gen=normal):
    """A unary rule; ``program`` (a jnp function emitting the primitive) adds its
    primitive-table entry (Note [Declaring an op] in autograd/registry.py)."""

    def vjp(r, g):
        return (formula(r, g),)

    vjp.__name__ = f"{name}_vjp"
    vjp.__module__ = __name__
    table = () if program is None else (TableEntry(name, program, unary_samples(_SHAPES, gen)),)
    defrule(name, vjp, saves, doc=doc, table=table)


# -- unary ---------------------------------------------------------------------
_unary("neg", lambda r, g: -g, ((), ()))
_unary("exp", lambda r, g: g * _y(r), out_(0))
_unary("exp2", lambda r, g: g * _y(r) * jnp.asarray(math.log(2.0), g.dtype), out_(0), program=jnp.exp2)
_unary("log", lambda r, g: g / _x(r), in_(0))
_unary("log1p", lambda r, g: g / (_x(r) + 1), in_(0), program=jnp.log1p, gen=positive)
_unary("expm1", lambda r, g: g * (_y(r) + 1), out_(0), program=jnp.expm1)
_unary("tanh", lambda r, g: g * (1 - _y(r) * _y(r)), out_(0))
_unary("logistic", lambda r, g: g * _y(r) * (1 - _y(r)), out_(0))
_unary("sin", lambda r, g: g * lax.cos(_x(r)), in_(0))
_unary("cos", lambda r, g: -g * lax.sin(_x(r)), in_(0))
_unary("tan", lambda r, g: g * (1 + _y(r) * _y(r)), out_(0))
_unary("asin", lambda r, g: g * lax.rsqrt(1 - _x(r) * _x(r)), in_(0))
_unary("acos", lambda r, g: -g * lax.rsqrt(1 - _x(r) * _x(r)), in_(0))
_unary("atan", lambda r, g: g / (1 + _x(r) * _x(r)), in_(0))
_unary("sinh", lambda r, g: g * lax.cosh(_x(r)), in_(0))
_unary("cosh", lambda r, g: g * lax.sinh(_x(r)), in_(0))
_unary("asinh", lambda r, g: g * lax.rsqrt(_x(r) * _x(r) + 1), in_(0))
_unary("acosh", lambda r, g: g * lax.rsqrt((_x(r) - 1) * (_x(r) + 1)), in_(0))
_unary("atanh", lambda r, g: g / (1 - _x(r) * _x(r)), in_(0))
_unary("sqrt", lambda r, g: g * 0.5 / _y(r), out_(0))
_unary("rsqrt", lambda r, g: g * -0.5 * _y(r) / _x(r), ((0,), (0,)))
_unary("cbrt", lambda r, g: g / (3 * _y(r) * _y(r)), out_(0), program=jnp.cbrt, gen=positive)
_unary("abs", lambda r, g: g * jnp.sign(_x(r)), in_(0))
_unary("square", lambda r, g: g * 2 * _x(r), in_(0), program=jnp.square)
_unary("erf", lambda r, g: g * (2 / math.sqrt(math.pi)) * lax.exp(-_x(r) * _x(r)), in_(0))
_unary("erfc", lambda r, g: g * (-2 / math.sqrt(math.pi)) * lax.exp(-_x(r) * _x(r)), in_(0))
_unary("erf_inv", lambda r, g: g * (math.sqrt(math.pi) / 2) * lax.exp(_y(r) * _y(r)), out_(0))
_unary("lgamma", lambda r, g: g * lax.digamma(_x(r)), in_(0))
_unary("digamma", lambda r, g: g * lax.polygamma(jnp.ones((), _x(r).dtype), _x(r)), in_(0))
_unary(
    "reduce_precision",
    lambda r, g: lax.reduce_precision(g, exponent_bits=r.p["exponent_bits"], mantissa_bits=r.p["mantissa_bits"]),
    ((), ()),
)
_unary("copy", lambda r, g: g, ((), ()))
_unary("copy_p", lambda r, g: g, ((), ()))
_unary("real", lambda r, g: g, ((), ()))


def _integer_pow(r, g):
    n = r.p["y"]
    x = _x(r)
    if n == 0:
        return jnp.zeros_like(g)
    dx = n * (x if n == 2 else lax.integer_pow(x, n - 1))
    return g * dx


_unary("integer_pow", _integer_pow, in_(0))


def _convert(r, g):
    return g.astype(r.in_avals[0].dtype)


_unary("convert_element_type", _convert, ((), ()))


# -- binary --------------------------------------------------------------------
def _binary(name, lhs, rhs, saves, doc=None):
    def vjp(r, g):
        a, b = r.in_avals
        return (
            unbroadcast(lhs(r, g), a, r.in_sharding(0)) if r.needs[0] else None,
            unbroadcast(rhs(r, g), b, r.in_sharding(1)) if r.needs[1] else None,
        )

    vjp.__name__ = f"{name}_vjp"
    vjp.__module__ = __name__
    defrule(name, vjp, saves, doc=doc)


def _mul_saves(needs):
    return tuple(k for k, n in ((1, needs[0]), (0, needs[1])) if n), ()


def _div_saves(needs):
    return ((1,) if not needs[1] else (0, 1)), ()


def _bcast(g, x):
    """``x`` broadcast against the output gradient ``g`` (with ``g``'s sharding)."""
    if jnp.ndim(x) == g.ndim and tuple(jnp.shape(x)) == tuple(g.shape):
        return x
    return shd.broadcast_to(x, g.shape, shd.sharding_of(g))


_binary("add", lambda r, g: g, lambda r, g: g, ((), ()))
_binary("add_any", lambda r, g: g, lambda r, g: g, ((), ()))
_binary("sub", lambda r, g: g, lambda r, g: -g, ((), ()))
_binary("mul", lambda r, g: g * _x(r, 1), lambda r, g: g * _x(r, 0), _mul_saves)
_binary("div", lambda r, g: g / _x(r, 1), lambda r, g: -g * _x(r, 0) / (_x(r, 1) * _x(r, 1)), _div_saves)


def _balanced(x, z, y):
    """1 where ``x`` is the chosen value, 1/2 where ``x`` and ``y`` tie."""
    return jnp.where(x == z, jnp.where(y == z, 0.5, 1.0), 0.0).astype(z.dtype)


_binary(
    "max",
    lambda r, g: g * _balanced(_bcast(g, _x(r, 0)), _y(r), _bcast(g, _x(r, 1))),
    lambda r, g: g * _balanced(_bcast(g, _x(r, 1)), _y(r), _bcast(g, _x(r, 0))),
    ((0, 1), (0,)),
)
_binary(
    "min",
    lambda r, g: g * _balanced(_bcast(g, _x(r, 0)), _y(r), _bcast(g, _x(r, 1))),
    lambda r, g: g * _balanced(_bcast(g, _x(r, 1)), _y(r), _bcast(g, _x(r, 0))),
    ((0, 1), (0,)),
)


def _atan2_den(r):
    x, y = _x(r, 0), _x(r, 1)
    return x * x + y * y


_binary(
    "atan2",
    lambda r, g: g * _x(r, 1) / _atan2_den(r),
    lambda r, g: -g * _x(r, 0) / _atan2_den(r),
    ((0, 1), ()),
)


def _rem_rhs(r, g):
    q = _x(r, 0) / _x(r, 1)
    return -g * jnp.sign(q) * jnp.floor(jnp.abs(q))


_binary("rem", lambda r, g: g, _rem_rhs, ((0, 1), ()))


def _pow_lhs(r, g):
    x, y = _bcast(g, _x(r, 0)), _bcast(g, _x(r, 1))
    jac = jnp.where(y == 0, jnp.zeros_like(g), y * lax.pow(x, y - jnp.ones((), y.dtype)))
    return g * jac


def _pow_rhs(r, g):
    x = _bcast(g, _x(r, 0))
    safe = jnp.where(x == 0, jnp.ones_like(x), x)
    return g * lax.log(safe) * _y(r)


_binary("pow", _pow_lhs, _pow_rhs, ((0, 1), (0,)))


# -- select / clamp ------------------------------------------------------------
def _select_n_vjp(r, g):
    which = r.ins[0]
    n = len(r.in_avals) - 1
    zeros = jnp.zeros_like(g)
    out = [None]
    for k in range(n):
        if not r.needs[k + 1]:
            out.append(None)
            continue
        cases = [zeros] * n
        cases[k] = g
        out.append(unbroadcast(lax.select_n(which, *cases), r.in_avals[k + 1], r.in_sharding(k + 1)))
    return tuple(out)


defrule("select_n", _select_n_vjp, in_(0))


def _clamp_vjp(r, g):
    lo, x, hi = (_bcast(g, v) for v in r.ins)
    zeros = jnp.zeros_like(g)
    a_lo, a_x, a_hi = r.in_avals
    return (
        unbroadcast(jnp.where((lo > x) & (lo < hi), g, zeros), a_lo, r.in_sharding(0)) if r.needs[0] else None,
        unbroadcast(jnp.where((x > lo) & (x < hi), g, zeros), a_x, r.in_sharding(1)) if r.needs[1] else None,
        unbroadcast(jnp.where(hi < x, g, zeros), a_hi, r.in_sharding(2)) if r.needs[2] else None,
    )


defrule("clamp", _clamp_vjp, in_(0, 1, 2))


def _barrier_vjp(r, g):
    return tuple(g)


defrule("optimization_barrier", _barrier_vjp, ((), ()), multiple_results=True)
