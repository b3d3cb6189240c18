"""Primitive rules: elementwise math, casts, select/clamp.

Each line declares a record type (``SinBackward``, ...) and its hand-written
backward formula (see Note [Primitive rules] in ``rules.py``). Binary
primitives may get a rank-0 operand next to an array (a python scalar in jnp
code), so their gradients are summed back to each operand's shape.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import jax.scipy as jsp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.shard_alike import shard_alike

from .. import sharding as shd
from ..autograd.registry import Sample, TableEntry
from ..ops import _formulas as formulas
from ..ops._declare import binary_samples, distinct, far_from_zero, normal, positive, unary_samples, unit, wellcond
from .rules import add_table, defrule, saves_inputs, saves_outputs


def as_dtype(g, dtype):
    """``g`` cast to an operand's ``dtype``. The cotangent of a real operand that met
    a complex one (a ``dot_general`` of mixed dtypes, a complex-to-real conversion) is
    its real part, jax's convention, taken before the cast: jax deprecates casting
    complex to real."""
    if g.dtype == dtype:
        return g
    if jnp.iscomplexobj(g) and not jnp.issubdtype(dtype, jnp.complexfloating):
        g = jnp.real(g)
    return g.astype(dtype)


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
    return as_dtype(shd.conform(g, sharding), aval.dtype)


def _input(r, k=0):
    """Input ``k`` of the primitive, as its rule saved it."""
    return r.ins[k]


def _output(r, k=0):
    """Output ``k`` of the primitive, as its rule saved it."""
    return r.outs[k]


def _plus_zero(v):
    """``v`` with ``-0.0`` made ``+0.0`` (a select: XLA folds ``v + 0`` away)."""
    return jnp.where(v == 0, jnp.zeros_like(v), v)


def _inverse_derivative(name, z, w=None):
    """The derivative of ``asin``, ``asinh`` or ``acosh`` at ``z`` (for ``acos``, that
    of ``asin``: the rule negates it): the real formulas for a real ``z``; for a
    complex one, Note [Derivatives on a branch cut], on the side of a cut that the
    function's value ``w`` at ``z`` lies on (computed here unless given)."""
    if not jnp.issubdtype(z.dtype, jnp.complexfloating):
        if name in ("asin", "acos"):
            return lax.rsqrt(1 - z * z)
        if name == "asinh":
            return lax.rsqrt(z * z + 1)
        return lax.rsqrt(z - 1) * lax.rsqrt(z + 1)
    x, y = lax.real(z), lax.imag(z)
    if name == "asinh":  # asin'(iz): 1/(sqrt(1-iz) sqrt(1+iz)); cuts on the imaginary axis beyond +-i
        x = _plus_zero(x)
        d = lax.rsqrt(lax.complex(1 + y, -x)) * lax.rsqrt(lax.complex(1 - y, x))
        w = lax.asinh(z) if w is None else w
        return jnp.where((x == 0) & (lax.real(w) < 0), jnp.conj(d), d)
    y = _plus_zero(y)
    if name == "acosh":  # 1/(sqrt(z-1) sqrt(z+1)); cut (-inf, 1]
        d = lax.rsqrt(lax.complex(x - 1, y)) * lax.rsqrt(lax.complex(x + 1, y))
        w = lax.acosh(z) if w is None else w
    else:  # asin: 1/(sqrt(1-z) sqrt(1+z)); cuts (-inf, -1] and [1, inf); acos = pi/2 - asin
        d = lax.rsqrt(lax.complex(1 - x, -y)) * lax.rsqrt(lax.complex(1 + x, y))
        if name == "acos":
            w = -(lax.acos(z) if w is None else w)
        else:
            w = lax.asin(z) if w is None else w
    return jnp.where((y == 0) & (lax.imag(w) < 0), jnp.conj(d), d)


# Note [Derivatives on a branch cut]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# asin, acos, asinh and acosh of complex values have branch cuts: on a cut the function
# takes the values of one side, and its derivative must be that side's limit, or a
# gradient (even its real-direction part, a plain finite difference along the cut) has
# the wrong sign. Written as ``1/sqrt(1 - z*z)``, as jax writes asin's, the side is
# decided by the sign of a zero imaginary part that the arithmetic makes up:
# ``1 - (1.5+0j)**2`` is ``-1.25+0j``, the other side's square root. Measured (jax
# 0.10.2): the gradient of ``asin`` and ``acos`` at a complex ``1.5+0j`` (a real array
# cast to complex), of ``asinh`` at ``1.5j``, and of ``acosh`` at ``-3-0j`` or ``0.5-0j``
# had the wrong sign, jax.grad's as well.
#
# So each derivative is written as a product of square roots, ``1/(sqrt(1-z) sqrt(1+z))``
# for asin (for acosh ``1/(sqrt(z-1) sqrt(z+1))``, which off the axis is also the
# principal branch's: ``1/sqrt(z*z - 1)`` has the wrong sign where the real part is
# negative), whose operands are built part by part (``1 - z`` as ``complex(1 - x, -y)``,
# ``rsqrt`` honours the sign of a zero imaginary part) from ``z`` with its zero part made
# ``+0``: that is the limit from above the real axis (from the right of the imaginary
# axis for asinh). XLA's functions take that side for either sign of zero today, but
# the rule does not rely on it: on a cut it reads the side from the function's own
# value (the sign of its imaginary part; its real part for asinh) and, where the value
# is the other side's, takes that side's derivative, the conjugate (the four functions
# commute with conjugation, asinh with ``z -> -conj(z)``). Real operands keep the
# real formulas. Tested at every cut against the analytic derivative of the side the
# forward takes, and against finite differences along the cut
# (``tests/lift/test_complex.py``).


def _unary(name, formula, saves, doc=None, program=None, gen=normal, **options):
    """A unary rule; ``program`` (a jnp function emitting the primitive) adds its
    primitive-table entry (Note [Declaring an op] in autograd/registry.py), on
    samples from ``gen``, with the entry's ``options`` (``vmap``, ``fd``, ...)."""

    def vjp(r, g):
        return (formula(r, g),)

    vjp.__name__ = f"{name}_vjp"
    vjp.__module__ = __name__
    table = () if program is None else (TableEntry(name, program, unary_samples(gen=gen), **options),)
    defrule(name, vjp, saves, doc=doc, table=table)


def _plus_one_and_a_half(rng, *shape):
    return 1.5 + positive(rng, *shape)


# -- unary ---------------------------------------------------------------------
_unary("neg", lambda r, g: formulas.neg(g), ((), ()), program=lambda x: -x, vmap=True)
_unary("exp", lambda r, g: formulas.exp(g, _output(r)), saves_outputs(0), program=jnp.exp, vmap=True)
# (g * log 2) * 2**x, in jax's order: g * 2**x first overflowed a complex g's two parts
# to infinities, and their product by log 2 (a complex number) to nan where jax's was inf
_unary("exp2", lambda r, g: g * jnp.asarray(math.log(2.0), g.dtype) * _output(r), saves_outputs(0), program=jnp.exp2)
_unary("log", lambda r, g: formulas.log(g, _input(r)), saves_inputs(0), program=jnp.log, gen=positive)
_unary("log1p", lambda r, g: g / (_input(r) + 1), saves_inputs(0), program=jnp.log1p, gen=positive)
if hasattr(lax, "log2_p"):  # jax 0.11's own primitive (0.10's jnp.log2 divides a log by log(2))
    _unary(
        "log2",
        lambda r, g: g / (_input(r) * jnp.asarray(math.log(2.0), g.dtype)),
        saves_inputs(0),
        program=jnp.log2,
        gen=positive,
    )
if hasattr(lax, "one_minus_square_p"):  # jax 0.11's 1 - x^2 (its asin/acos/atanh/tanh JVPs use it)
    _unary(
        "one_minus_square",
        lambda r, g: g * (-2 * _input(r)),
        saves_inputs(0),
        program=lambda x: lax.one_minus_square(x),
    )
_unary("expm1", lambda r, g: g * (_output(r) + 1), saves_outputs(0), program=jnp.expm1)
_unary("tanh", lambda r, g: formulas.tanh(g, _output(r)), saves_outputs(0), program=jnp.tanh, vmap=True)
_unary("logistic", lambda r, g: formulas.sigmoid(g, _output(r)), saves_outputs(0), program=jax.nn.sigmoid)
_unary("sin", lambda r, g: g * lax.cos(_input(r)), saves_inputs(0), program=jnp.sin, vmap=True)
_unary("cos", lambda r, g: -g * lax.sin(_input(r)), saves_inputs(0), program=jnp.cos)
_unary("tan", lambda r, g: g * (1 + _output(r) * _output(r)), saves_outputs(0), program=jnp.tan, gen=unit)
_unary("asin", lambda r, g: g * _inverse_derivative("asin", _input(r)), saves_inputs(0), program=jnp.arcsin, gen=unit)
_unary("acos", lambda r, g: -g * _inverse_derivative("acos", _input(r)), saves_inputs(0), program=jnp.arccos, gen=unit)
_unary("atan", lambda r, g: g / (1 + _input(r) * _input(r)), saves_inputs(0), program=jnp.arctan)
_unary("sinh", lambda r, g: g * lax.cosh(_input(r)), saves_inputs(0), program=jnp.sinh)
_unary("cosh", lambda r, g: g * lax.sinh(_input(r)), saves_inputs(0), program=jnp.cosh)
_unary("asinh", lambda r, g: g * _inverse_derivative("asinh", _input(r)), saves_inputs(0), program=jnp.arcsinh)
_unary(
    "acosh",
    lambda r, g: g * _inverse_derivative("acosh", _input(r)),
    saves_inputs(0),
    program=jnp.arccosh,
    gen=_plus_one_and_a_half,
)
_unary("atanh", lambda r, g: g / (1 - _input(r) * _input(r)), saves_inputs(0), program=jnp.arctanh, gen=unit)
_unary("sqrt", lambda r, g: g * 0.5 / _output(r), saves_outputs(0), program=jnp.sqrt, gen=positive)
add_table(
    "sqrt",
    TableEntry(
        "norm_fro",
        lambda a: jnp.linalg.norm(a, "fro") + jnp.linalg.norm(a[0]),
        unary_samples([(3, 4)]),
    ),
)
_unary("rsqrt", lambda r, g: g * -0.5 * _output(r) / _input(r), ((0,), (0,)), program=lax.rsqrt, gen=positive)
_unary("cbrt", lambda r, g: g / (3 * _output(r) * _output(r)), saves_outputs(0), program=jnp.cbrt, gen=positive)
_unary("square", lambda r, g: g * 2 * _input(r), saves_inputs(0), program=jnp.square)
_unary(
    "erf",
    lambda r, g: g * (2 / math.sqrt(math.pi)) * lax.exp(-_input(r) * _input(r)),
    saves_inputs(0),
    program=jsp.special.erf,
)
_unary(
    "erfc",
    lambda r, g: g * (-2 / math.sqrt(math.pi)) * lax.exp(-_input(r) * _input(r)),
    saves_inputs(0),
    program=jsp.special.erfc,
)
_unary(
    "erf_inv",
    lambda r, g: g * (math.sqrt(math.pi) / 2) * lax.exp(_output(r) * _output(r)),
    saves_outputs(0),
    program=jsp.special.erfinv,
    gen=unit,
)
_unary("lgamma", lambda r, g: g * lax.digamma(_input(r)), saves_inputs(0), program=jsp.special.gammaln, gen=positive)
_unary(
    "digamma",
    lambda r, g: g * lax.polygamma(jnp.ones((), _input(r).dtype), _input(r)),
    saves_inputs(0),
    program=jsp.special.digamma,
    gen=positive,
)
_unary(
    "reduce_precision",
    lambda r, g: lax.reduce_precision(
        g, exponent_bits=r.params["exponent_bits"], mantissa_bits=r.params["mantissa_bits"]
    ),
    ((), ()),
    program=lambda x: lax.reduce_precision(x, 8, 23) * x,
    fd=False,
)
_unary("copy", lambda r, g: g, ((), ()))
_unary("copy_p", lambda r, g: g, ((), ()))
# jax.ad_checkpoint.checkpoint_name: the identity, naming a value for jax.checkpoint's
# policies (rf's checkpoint rule recomputes a user's checkpointed body whatever it names)
_unary(
    "name",
    lambda r, g: g,
    ((), ()),
    program=lambda x: checkpoint_name(jnp.sin(x), "rf_named") * x,
    vmap=True,
)


def _integer_pow(r, g):
    n = r.params["y"]
    x = _input(r)
    if n == 0:  # a constant: no term (zeros would make 0 * inf upstream, e.g. sqrt(x) ** 0 at 0)
        return None
    dx = n * (x if n == 2 else lax.integer_pow(x, n - 1))
    return g * dx


_unary("integer_pow", _integer_pow, saves_inputs(0), program=lambda x: x**3 + x**2 - 1 / x**2, gen=far_from_zero)


def _convert(r, g):
    return as_dtype(g, r.in_avals[0].dtype)  # complex -> real keeps the real part, as jax's


_unary(
    "convert_element_type",
    _convert,
    ((), ()),
    program=lambda x: jnp.sin(x.astype(jnp.bfloat16).astype(x.dtype)) * x,
    fd=False,
)


# -- binary --------------------------------------------------------------------
def _binary(name, lhs, rhs, saves, doc=None, program=None, samples=None, **options):
    """A binary rule; ``program`` adds its primitive-table entry (on ``samples``,
    default: two normal operands, the second possibly rank 0)."""

    def vjp(r, g):
        a, b = r.in_avals
        return (
            unbroadcast(lhs(r, g), a, r.in_sharding(0)) if r.needs[0] else None,
            unbroadcast(rhs(r, g), b, r.in_sharding(1)) if r.needs[1] else None,
        )

    vjp.__name__ = f"{name}_vjp"
    vjp.__module__ = __name__
    table = () if program is None else (TableEntry(name, program, samples or binary_samples(), **options),)
    defrule(name, vjp, saves, doc=doc, table=table)


def _mul_saves(needs):
    return tuple(k for k, n in ((1, needs[0]), (0, needs[1])) if n), ()


def _div_saves(needs):
    return ((1,) if not needs[1] else (0, 1)), ()


def _bcast(g, x):
    """``x`` broadcast against the output gradient ``g`` (with ``g``'s sharding)."""
    if jnp.ndim(x) == g.ndim and tuple(jnp.shape(x)) == tuple(g.shape):
        return x
    return shd.broadcast_to(x, g.shape, shd.sharding_of(g))


_binary("add", lambda r, g: g, lambda r, g: g, ((), ()), program=lambda x, y: x + y, vmap=True)
_binary("add_any", lambda r, g: g, lambda r, g: g, ((), ()))
_binary("sub", lambda r, g: g, lambda r, g: -g, ((), ()), program=lambda x, y: x - y)
_binary(
    "mul",
    lambda r, g: g * _input(r, 1),
    lambda r, g: g * _input(r, 0),
    _mul_saves,
    program=lambda x, y: x * y,
    vmap=True,
)
add_table(
    "mul",  # jnp.linalg.det of a 2x2 or 3x3 matrix: products of its entries
    TableEntry("det_small", jnp.linalg.det, unary_samples([(2, 2), (3, 3), (2, 3, 3)], wellcond), prims=("mul",)),
)
_binary(
    "div",
    lambda r, g: g / _input(r, 1),
    # jax's own form, -(g b^-2) a: the reciprocal square of the (often broadcast) divisor
    # is computed at its own size, so XLA need not materialise a broadcast of it
    lambda r, g: -((g * lax.integer_pow(_input(r, 1), -2)) * _input(r, 0)),
    _div_saves,
    program=lambda x, y: x / y,
    samples=binary_samples(normal, positive),
)


def _balanced(x, z, y):
    """1 where ``x`` is the chosen value, 1/2 where ``x`` and ``y`` tie."""
    return jnp.where(x == z, jnp.where(y == z, 0.5, 1.0), 0.0).astype(z.dtype)


def _chosen(pick, k):
    """The rule of input ``k`` of ``max``/``min`` (``pick``: ``lax.max``/``lax.min``).
    The chosen value is picked again from the saved inputs, not read from the saved
    output: a compiled forward may round an input's saved copy and the copy it
    compared differently, and then neither input equalled the output and both got a
    zero gradient (as for ``reduce_max``: ``_chooser_vjp`` in rules_structural.py;
    ``tests/lift/test_ties.py``)."""

    def rule(r, g):
        a, b = _bcast(g, _input(r, k)), _bcast(g, _input(r, 1 - k))
        return g * _balanced(a, pick(a, b), b)

    return rule


_binary(
    "max",
    _chosen(lax.max, 0),
    _chosen(lax.max, 1),
    ((0, 1), ()),
    program=jnp.maximum,
    samples=binary_samples(distinct, distinct),
)
_binary(
    "min",
    _chosen(lax.min, 0),
    _chosen(lax.min, 1),
    ((0, 1), ()),
    program=jnp.minimum,
    samples=binary_samples(distinct, distinct),
)


def _atan2_den(r):
    x, y = _input(r, 0), _input(r, 1)
    return x * x + y * y


_binary(
    "atan2",
    lambda r, g: g * _input(r, 1) / _atan2_den(r),
    lambda r, g: -g * _input(r, 0) / _atan2_den(r),
    ((0, 1), ()),
    program=jnp.arctan2,
    samples=binary_samples(far_from_zero, far_from_zero),
)


def _rem_rhs(r, g):
    q = _input(r, 0) / _input(r, 1)
    return -g * jnp.sign(q) * jnp.floor(jnp.abs(q))


def _point_three(rng, *shape):
    return 0.3 + 0 * positive(rng, *shape)


_binary(
    "rem",
    lambda r, g: g,
    _rem_rhs,
    ((0, 1), ()),
    program=lambda x, y: lax.rem(x, y),
    samples=binary_samples(positive, _point_three),
)


def _pow_lhs(r, g):
    """``y x^(y-1)``, and 0 where ``y == 0`` for any dtype of ``y`` (the partial
    derivative of ``x^0 == 1``, PyTorch's value; jax.grad gives nan at ``0^0``
    for a floating ``y``). An integer ``y`` stays integer in the power and is
    converted for the product, as jax's rule does."""
    x, y = _bcast(g, _input(r, 0)), _bcast(g, _input(r, 1))
    power = lax.pow(x, y - jnp.ones((), y.dtype))
    jac = jnp.where(y == 0, jnp.zeros_like(power), lax.convert_element_type(y, power.dtype) * power)
    return g * jac


def _pow_rhs(r, g):
    x = _bcast(g, _input(r, 0))
    safe = jnp.where(x == 0, jnp.ones_like(x), x)
    return g * lax.log(safe) * _output(r)


_binary(
    "pow",
    _pow_lhs,
    _pow_rhs,
    ((0, 1), (0,)),
    program=lambda x, y: lax.pow(x, y),
    samples=binary_samples(positive, normal),
)


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


defrule(
    "select_n",
    _select_n_vjp,
    saves_inputs(0),
    table=(
        TableEntry(
            "select_n",
            lambda x, y: jnp.where(x > 0, x * 2, y),
            binary_samples(far_from_zero, normal, shapes=(((3, 4), (3, 4)),)),
        ),
    ),
)


def _clamp_vjp(r, g):
    lo, x, hi = (_bcast(g, v) for v in r.ins)
    zeros = jnp.zeros_like(g)
    a_lo, a_x, a_hi = r.in_avals
    return (
        unbroadcast(jnp.where((lo > x) & (lo < hi), g, zeros), a_lo, r.in_sharding(0)) if r.needs[0] else None,
        unbroadcast(jnp.where((x > lo) & (x < hi), g, zeros), a_x, r.in_sharding(1)) if r.needs[1] else None,
        unbroadcast(jnp.where(hi < x, g, zeros), a_hi, r.in_sharding(2)) if r.needs[2] else None,
    )


def _clamp_samples(r):
    return [
        Sample((-1 + 0.1 * distinct(r, 3, 4), distinct(r, 3, 4), 1 + 0.1 * distinct(r, 3, 4)), diff=(0, 1, 2)),
    ]


defrule(
    "clamp",
    _clamp_vjp,
    saves_inputs(0, 1, 2),
    table=(TableEntry("clamp", lambda lo, x, hi: lax.clamp(lo, x, hi), _clamp_samples),),
)


def _barrier_vjp(r, g):
    return tuple(g)


defrule(
    "optimization_barrier",
    _barrier_vjp,
    ((), ()),
    multiple_results=True,
    table=(
        TableEntry(
            "optimization_barrier",
            lambda x: lax.optimization_barrier((x, x * 2))[1] * x,
            unary_samples(),
        ),
    ),
)


def _shard_alike_vjp(r, g):
    if any(ct is None for ct in g):  # an unused output: each operand gets its own
        return tuple(g)
    return tuple(shard_alike(*g))  # the cotangents placed alike, as jax's transpose does


_shard_alike_vjp.takes_none = True


defrule(
    "shard_alike",
    _shard_alike_vjp,
    ((), ()),
    multiple_results=True,
    table=(
        TableEntry(
            "shard_alike",
            lambda x, y: shard_alike(x * y, jnp.sin(y))[0] * shard_alike(x, y)[1],
            binary_samples(shapes=(((3, 4), (3, 4)),)),
        ),
    ),
)
