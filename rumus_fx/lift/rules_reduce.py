"""Primitive rule: the variadic ``reduce`` with a generic computation
(``lax.reduce`` over several operands, or with a function that is not one of
the monoids that become ``reduce_sum``/``reduce_max``/...).

Note [Generic reductions]
~~~~~~~~~~~~~~~~~~~~~~~~~
XLA may combine the elements of a generic reduction in any order, so its
derivative is that of a fixed order: the one ``jax.grad`` uses, a balanced tree
that halves the reduced axis (flattened, moved to the front) until one element
is left, padding an odd half with the initial values. The rule saves the
operands and the initial values; its backward rebuilds that tree as a program
of the computation (``jax.vmap`` of its jaxpr: the pairwise combination of two
halves), runs it forward and walks it back with rf's own rules, one record per
primitive of the computation. So a pair reduction that selects a winner (an
argmax carrying an index or a value along) sends the gradient to the selected
element, a sum- or max-like computation gives what its rules give, and a
computation with a primitive rf cannot differentiate raises an
``AutogradError`` naming it and ``reduce``. For an associative and commutative
computation (what XLA asks of it) the tree computes the forward's value; for
any other, rf's gradient is still ``jax.grad``'s.

The initial values cannot carry a gradient (XLA may use them any number of
times): a tracked initial value is refused, as ``jax.grad`` refuses it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from ..autograd.registry import BadProgram, Sample, TableEntry
from ..errors import AutogradError
from ..ops._declare import distinct, normal
from .program import Program
from .rules import COMPLEX_OK, defrule


def _tree_reduction(closed, dims, in_shape, n):
    """The balanced-tree evaluation of a ``reduce`` with computation ``closed``
    over axes ``dims`` of ``n`` operands of shape ``in_shape``."""
    reducer = jcore.jaxpr_as_fun(closed)
    axes = tuple(dims)
    non_axes = tuple(d for d in range(len(in_shape)) if d not in axes)
    size = int(np.prod([in_shape[d] for d in axes], dtype=np.int64))
    out_shape = tuple(in_shape[d] for d in non_axes)
    perm = axes + non_axes
    for _ in range(len(non_axes) + 1):
        reducer = jax.vmap(reducer)

    def tree(*args):
        xs, inits = list(args[:n]), args[n:]
        xs = [jnp.transpose(x, perm).reshape((size, *out_shape)) for x in xs]
        if size == 0:
            return tuple(jnp.broadcast_to(i, out_shape) for i in inits)
        while xs[0].shape[0] > 1:
            m = xs[0].shape[0]
            m1 = (m + 1) // 2
            first = [x[:m1] for x in xs]
            second = [x[m1:] for x in xs]
            if m1 != m - m1:
                second = [
                    jnp.concatenate([x, jnp.broadcast_to(i, (1, *out_shape)).astype(x.dtype)])
                    for x, i in zip(second, inits)
                ]
            xs = list(reducer(*first, *second))
        return tuple(x[0] for x in xs)

    return tree


def _reduce_prepare(step):
    n = len(step.in_avals) // 2
    if any(step.needs[n:]):
        raise AutogradError(
            "rf.lift: the initial values of a generic 'reduce' (lax.reduce with a custom computation) "
            "depend on a tracked Tensor; the reduction may use them any number of times, so they have "
            "no gradient (jax.grad refuses them too). Pass constants as initial values."
        )
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in step.in_avals]
    tree = _tree_reduction(step.params["jaxpr"], step.params["dimensions"], tuple(step.in_avals[0].shape), n)
    closed = jax.make_jaxpr(tree)(*avals)
    try:
        return Program(closed, list(step.needs[:n]) + [False] * n, "reduce computation")
    except AutogradError as e:
        name = getattr(step.params.get("computation"), "__name__", "the computation")
        raise AutogradError(
            f"rf.lift: cannot differentiate the generic 'reduce' primitive (lax.reduce with {name}): {e}"
        ) from e


def _reduce_vjp(r, g):
    n = len(r.in_avals) // 2
    prog = r._step.sub
    _, res = prog.run(list(r.ins))
    grads = prog.backward(res, list(g))
    out = [gr if need else None for gr, need in zip(grads[:n], r.needs[:n])]
    return (*out, *(None,) * n)


_reduce_vjp.prepare = _reduce_prepare
_reduce_vjp.unused_as_none = True  # Note [An unused output adds nothing] in program.py


def _argmax_pairs(x, y):
    """The largest ``x`` along axis 0 and the ``y`` that goes with it: the pair
    reduction of an argmax that carries a value along."""

    def pick(a, b):
        take_a = a[0] >= b[0]
        return jnp.where(take_a, a[0], b[0]), jnp.where(take_a, a[1], b[1])

    v, w = lax.reduce((x, y), (jnp.array(-jnp.inf, x.dtype), jnp.array(0, y.dtype)), pick, (0,))
    return v * w + v


def _sum_and_product(x, y):
    """Two running results in one reduction: a sum and a product."""
    s, p = lax.reduce((x, y), (jnp.array(0, x.dtype), jnp.array(1, y.dtype)), _sum_prod, (1,))
    return s * p


def _sum_prod(a, b):
    return a[0] + b[0], a[1] * b[1]


def _logaddexp(a, b):
    m = jnp.maximum(a, b)
    return m + jnp.log(jnp.exp(a - m) + jnp.exp(b - m))


def _reduce_errors():
    return [
        BadProgram(
            "traced initial value",
            lambda x, c: lax.reduce((x, x), (c, c), _sum_prod, (0,))[0],
            (np.ones(3), np.array(0.5)),
            AutogradError,
            ("initial values",),
            argnums=(0, 1),
            names=("rf.lift", "reduce"),
            jax_too=True,
        ),
        BadProgram(
            "computation without a rule",
            lambda x: lax.reduce((x, x), (0.0, 0.0), lambda a, b: (lax.igamma_grad_a(a[0], b[0]), a[1]), (0,))[1],
            (np.ones(3) + 1.0,),
            AutogradError,
            ("igamma_grad_a",),
            names=("rf.lift", "reduce"),
            x64=True,
            jax_too=True,
        ),
    ]


defrule(
    "reduce",
    _reduce_vjp,
    lambda needs: (tuple(range(len(needs))), ()),
    multiple_results=True,
    table=(
        # (one differentiable argument feeding every operand: jax.grad of a generic
        # reduce fails when an operand's tangent is a symbolic zero; the operands one
        # at a time are in tests/lift/test_reduce.py)
        TableEntry(
            "reduce_argmax_pairs",
            lambda x: _argmax_pairs(x, jnp.cos(x) * 2.0),
            lambda r: [Sample((distinct(r, 5, 3),))],
        ),
        TableEntry(
            "reduce_sum_and_product",
            lambda x: _sum_and_product(x, jnp.sin(x) + 1.5),
            lambda r: [Sample((normal(r, 3, 5),))],
        ),
        TableEntry(
            "reduce_logaddexp",  # one operand, a computation that is no monoid jax knows
            lambda x: lax.reduce(x, jnp.array(-jnp.inf, x.dtype), _logaddexp, (0, 2)),
            lambda r: [Sample((normal(r, 3, 2, 5),))],
        ),
    ),
    errors=_reduce_errors,
)
COMPLEX_OK.add("reduce")  # its computation's rules are checked one by one
