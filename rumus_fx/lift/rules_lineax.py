"""The rule for lineax's ``linear_solve`` primitive, so ``lineax.linear_solve`` and
what is built on it (optimistix's root finds and their implicit gradients,
diffrax's events and implicit solvers) differentiate on the tape.

Declared with the public ``rf.defrule`` for lineax's own ``Primitive`` object and
imported the first time a program holds it (``LIBRARY_RULES`` in
``lift/rules.py``), so ``import rumus_fx`` never imports lineax.

``linear_solve(operator, state, vector, options, solver, throw)`` returns
``x = A^+ b`` (with the solve's result code and statistics, which carry no
gradient). lineax stops the gradient of ``state`` (the solver's factorisation)
and refuses one for ``options`` and ``solver``, so only the operator's arrays and
the vector's take one:

* ``vector``: ``A^{-T} g``, one more solve with the transposed operator and the
  solver's transposed state (lineax's own transpose rule);
* the operator's arrays: ``-(d/dA [A x])^T (A^{-T} g)``, the reverse of the
  operator's ``mv`` at the solution, taken on the tape (the operator's ``mv`` is
  traced into a program of its arrays and run backward by rf's rules). This is
  the derivative of ``A^{-1} b`` for a square operator the solver assumes full
  rank (LU, QR, Cholesky, CG, ...). A full-rank non-square operator (QR's least
  squares, as in optimistix's Gauss-Newton and Levenberg-Marquardt steps) adds the
  pseudo-inverse's further term (``_least_squares_pair``); for a rank-deficient
  solve (``SVD``, ``assume_full_rank() == False``) the pseudo-inverse has more
  terms still, and a gradient for the operator there is refused by name (the
  vector's is still taken).
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import lineax as lx
import numpy as np
from equinox.internal._primitive import _missing_dynamic
from lineax._solve import linear_solve_p

from ..autograd.registry import Sample, TableEntry
from ..errors import AutogradError
from ..ops._declare import normal
from .jax_versions import closed
from .library import defrule
from .program import Program

_ARGS = ("operator", "state", "vector", "options", "solver", "throw")


def _arguments(r: Any) -> tuple[list[Any], list[int]]:
    """The call's six arguments rebuilt from the saved inputs, and for each input
    of the equation the argument (index into ``_ARGS``) it is a leaf of."""
    p = r.params
    treedef, static = p["treedef"], p["static"]
    ins = iter(r.ins)
    flat = [next(ins) if s is _missing_dynamic else s for s in static]
    args = list(jtu.tree_unflatten(treedef, flat))
    owner, at = [], 0
    for k, child in enumerate(treedef.children()):
        n = child.num_leaves
        owner += [k for s in static[at : at + n] if s is _missing_dynamic]
        at += n
    return args, owner


def _operator_gradient(operator: Any, pairs: list[tuple[Any, Any]]) -> list[Any]:
    """``-sum (d/dA [A v])^T c`` over the ``(v, c)`` pairs, for the operator's arrays,
    in their order (None for one the ``mv`` does not read): the operator's ``mv`` at
    every ``v``, traced once as one program of those arrays, run backward on the tape."""
    dynamic, static = eqx.partition(operator, eqx.is_array)
    leaves, tree = jtu.tree_flatten(dynamic)

    def mv(*arrays: Any) -> list[Any]:
        op = eqx.combine(jtu.tree_unflatten(tree, list(arrays)), static)
        return [out for v, _ in pairs for out in jtu.tree_leaves(op.mv(v))]

    prog = Program(closed(jax.make_jaxpr(mv)(*leaves)), [True] * len(leaves), "the lineax operator's mv")
    _, residuals = prog.run(list(leaves))
    grads = prog.backward(residuals, [-c for _, ct in pairs for c in jtu.tree_leaves(ct)])
    return list(grads)  # None for an array the mv does not read: no term (as jax's symbolic zero)


def _bind_solve(operator: Any, state: Any, vector: Any, options: Any, solver: Any) -> Any:
    """The solution of one more ``linear_solve`` with the factorisation ``state``."""
    return eqxi.filter_primitive_bind(linear_solve_p, operator, state, vector, options, solver, True)[0]


def _linear_solve_vjp(r: Any, g: tuple) -> tuple:
    args, owner = _arguments(r)
    operator, state, _, options, solver, _ = args
    needs_op = any(n for n, k in zip(r.needs, owner) if k == 0)
    needs_b = any(n for n, k in zip(r.needs, owner) if k == 2)
    out: list[Any] = [None] * len(r.ins)
    if not (needs_op or needs_b):
        return tuple(out)
    leaves, tree = jtu.tree_flatten(operator.in_structure())
    ct_x = jtu.tree_unflatten(tree, list(g[: len(leaves)]))  # the solution comes first among the outputs
    state_t, options_t = solver.transpose(state, options)
    ct_b = _bind_solve(operator.transpose(), state_t, ct_x, options_t, solver)
    if needs_b:
        _place(out, r.needs, owner, 2, jtu.tree_leaves(ct_b))
    if needs_op:
        if not solver.assume_full_rank():
            raise AutogradError(
                f"rf.lift: lineax.linear_solve with the solver {type(solver).__name__}: the gradient of the "
                "operator is taken for an operator the solver assumes full rank (LU, QR, Cholesky, CG, ...); "
                "for a rank-deficient solve the pseudo-inverse's derivative has more terms, which rf does not "
                "write. Differentiate the vector only, or use such a solver."
            )
        x = jtu.tree_unflatten(tree, list(r.outs[: len(leaves)]))
        pairs = [(x, ct_b)]
        if operator.in_size() != operator.out_size():
            pairs.append(
                _least_squares_pair(operator, state, state_t, options, options_t, solver, args[2], x, ct_x, ct_b)
            )
        _place(out, r.needs, owner, 0, _operator_gradient(operator, pairs))
    return tuple(out)


def _least_squares_pair(
    operator: Any, state: Any, state_t: Any, options: Any, options_t: Any, solver: Any, b: Any, x: Any, g: Any, lam: Any
) -> tuple[Any, Any]:
    """The pseudo-inverse's further term for a full-rank non-square operator
    (Golub and Pereyra's derivative of ``A^+``), beside ``-lam x^T`` (``lam = A^{+T} g``),
    as a ``(v, c)`` pair of ``_operator_gradient`` (whose term is ``-c v^T``):
    ``r mu^T`` for an overdetermined operator (``r = b - A x``, the residual, and
    ``mu = A^+ lam = (A^T A)^{-1} g``) and ``y (g - A^+ A g)^T`` for an
    underdetermined one (``y = A^{+T} x = (A A^T)^{-1} b``; ``A x = b`` there, and
    ``A^+ A = I`` in the overdetermined case, so each case has one term)."""

    def sub(u: Any, v: Any) -> Any:
        return jtu.tree_map(lambda p, q: p - q, u, v)

    if operator.out_size() > operator.in_size():
        mu = _bind_solve(operator, state, lam, options, solver)
        return mu, sub(operator.mv(x), b)
    y = _bind_solve(operator.transpose(), state_t, x, options_t, solver)
    g_null = sub(g, _bind_solve(operator, state, operator.mv(g), options, solver))
    return g_null, jtu.tree_map(lambda p: -p, y)


def _place(out: list[Any], needs: tuple[bool, ...], owner: list[int], arg: int, grads: list[Any]) -> None:
    """Put argument ``arg``'s leaf gradients, in order, at its inputs that need one."""
    it = iter(grads)
    for j, k in enumerate(owner):
        if k == arg:
            gr = next(it)
            out[j] = gr if needs[j] else None


def _solve(solver: Any, make: Any) -> Any:
    def f(a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.sum(jnp.sin(lx.linear_solve(make(a), b, solver=solver).value))

    return f


def _square(rng: np.random.Generator) -> list[Sample]:
    a = normal(rng, 3, 3) + 3.0 * np.eye(3)
    return [Sample((a, normal(rng, 3)), diff=(0, 1))]


def _tall(rng: np.random.Generator) -> list[Sample]:
    return [Sample((normal(rng, 5, 3), normal(rng, 5)), diff=(0, 1))]


def _function_operator(a: jax.Array) -> Any:
    """A matrix-free operator: ``v -> a @ v + 0.5 * tanh(a) @ v`` as a function of ``a``."""
    return lx.FunctionLinearOperator(lambda v: a @ v + 0.5 * jnp.tanh(a) @ v, jax.ShapeDtypeStruct((3,), a.dtype))


defrule(
    linear_solve_p,
    _linear_solve_vjp,
    doc="Backward record of lineax's ``linear_solve`` primitive.",
    table=(
        TableEntry("lineax_lu", _solve(lx.LU(), lx.MatrixLinearOperator), _square, vmap=True),
        TableEntry("lineax_qr", _solve(lx.QR(), lx.MatrixLinearOperator), _square),
        TableEntry("lineax_qr_least_squares", _solve(lx.QR(), lx.MatrixLinearOperator), _tall),
        TableEntry(
            "lineax_cholesky",
            # symmetric by construction: Cholesky reads one triangle, so a perturbation of a
            # symmetric matrix that is not symmetric would not be what finite differences see
            _solve(lx.Cholesky(), lambda a: lx.MatrixLinearOperator(a @ a.T, lx.positive_semidefinite_tag)),
            _square,
        ),
        TableEntry("lineax_function_operator", _solve(lx.LU(), _function_operator), _square),
    ),
)
