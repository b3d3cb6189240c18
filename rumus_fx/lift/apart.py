"""Rematerialisation that XLA:CPU cannot undo: Note [Recomputation kept apart].

Note [Recomputation kept apart]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A rematerialised segment's backward runs its forward again from the segment's
inputs. ``lax.optimization_barrier`` on those inputs is what stops XLA from
reusing the forward's values instead (``jax.checkpoint``'s ``prevent_cse``). XLA:CPU
expands the barriers early in its pipeline, before common-subexpression
elimination, so the recomputed matmuls are merged back into the forward's and
their outputs are kept alive until backward: the rematerialisation is undone for
every matmul, and only cheap elementwise work is recomputed. Measured (jax 0.10.2,
XLA:CPU): eight ``[1024,512] x [512,512]`` tanh layers need 32.0 MiB of temporary
memory under ``jax.grad``, 32.0 MiB with ``jax.checkpoint`` around every layer (the
dots merged back, only the tanh recomputed), 18.0 MiB with the backward of each
layer inside a ``lax.cond``.

So on XLA:CPU, under ``jax.jit``, the whole backward of one of rf's own
rematerialised segments (the recomputation and the walk of its records) runs as
both branches of a ``lax.cond`` whose predicate XLA cannot evaluate (the first
element of a floating operand equals itself: false only for NaN, and both
branches are the same computation, so the result does not depend on it). XLA
compiles a branch as a computation of its own and merges nothing across it, so
the recomputation stays. This applies to rf's rematerialisation only: segments
chosen for ``memory_budget=`` and ``rf.checkpoint`` (marked with ``KEPT_APART``,
their ``jax.checkpoint`` policy); a ``jax.checkpoint`` inside a lifted user
function keeps the program ``jax.grad`` gets, so its speed and memory stay
comparable with ``jax.grad``'s. Elsewhere the barrier alone is used, as by
``jax.checkpoint``: on GPU and TPU (not measured here; a conditional there reads its
predicate on the host), under ``vmap`` (a batched predicate becomes a select of the
two branches, which XLA merges back), on a mesh (a conditional would constrain the
partitioner) and eagerly outside a trace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import sharding as shd
from ..compiler import JitTracer, same_branches
from .jax_versions import varying_axes


class KeptApart:
    """A ``jax.checkpoint`` policy that marks one of rf's own rematerialised
    segments (Note [Recomputation kept apart]); it wraps the user's policy (none:
    nothing saved) for JAX's own use of the jaxpr."""

    def __init__(self, policy: Callable | None = None):
        self.policy = policy

    def __call__(self, *args: Any, **kwargs: Any) -> bool:
        return False if self.policy is None else bool(self.policy(*args, **kwargs))

    def __repr__(self) -> str:
        return "KeptApart()" if self.policy is None else f"KeptApart({self.policy!r})"


KEPT_APART = KeptApart()


def kept_apart(policy: Any) -> bool:
    """Whether a ``remat2`` step's policy marks it as rf's own segment."""
    return isinstance(policy, KeptApart)


def _witness(leaves: list) -> Any:
    """The first non-empty floating (or complex) operand, or None."""
    for x in leaves:
        dtype = getattr(x, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.inexact) or 0 in jnp.shape(x):
            continue
        return x
    return None


def barrier(tree: Any) -> Any:
    """``lax.optimization_barrier(tree)`` that keeps each leaf's type inside a
    ``shard_map`` body. jax's barrier makes every operand vary over the union of
    the manual axes its operands vary over (it inserts ``pvary``), and a backward
    that re-runs a body on such an input binds that body's own ``pvary`` on a value
    already varying, which jax refuses. So the leaves go behind one barrier per set
    of varying axes; outside ``shard_map`` (every set empty) that is one barrier."""
    leaves, tree_def = jax.tree_util.tree_flatten(tree)
    groups: dict[frozenset, list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault(varying_axes(x), []).append(i)
    out = list(leaves)
    for idx in groups.values():
        for i, y in zip(idx, lax.optimization_barrier([leaves[i] for i in idx])):
            out[i] = y
    return jax.tree_util.tree_unflatten(tree_def, out)


def recompute(fn: Callable[..., Any], *operands: Any) -> Any:
    """``fn(*operands)``, the backward of a rematerialised segment: its operands
    behind an optimisation barrier and, on XLA:CPU under ``jax.jit``, both branches
    of a ``lax.cond`` (Note [Recomputation kept apart]). ``operands`` are pytrees
    of arrays (``None`` leaves allowed); ``fn`` returns one."""
    operands = barrier(operands)
    leaves = jax.tree_util.tree_leaves(operands)
    if (
        jax.default_backend() != "cpu"
        or not leaves
        or not all(isinstance(x, JitTracer) for x in leaves)
        or any(shd.on_mesh(x) for x in leaves)
    ):
        return fn(*operands)
    witness = _witness(leaves)
    if witness is None:
        return fn(*operands)
    return same_branches(fn, witness, *operands)
