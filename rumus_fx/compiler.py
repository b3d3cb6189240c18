"""Compile options that rumus_fx offers, and sets only on programs of its own.

``CPU_COMPILER_OPTIONS`` is a value to pass to ``jax.jit(f, compiler_options=...)``
or ``jax.jit(f).lower(...).compile(compiler_options=...)`` for a program compiled
for XLA:CPU. It restricts XLA:CPU's YNNPACK fusions (on by default in jax 0.10) to
single dots and reductions, so convolutions run through XLA's own (Eigen) kernels,
which were 2-3x faster than YNNPACK's for the few-channel convolutions of small
CNNs before conv2d ran those as dots; the benchmark CNN's step is now slower with
it (14.5 against 11.3 ms), and dense models (MLP, transformer) compile to the same
program either way.
The library sets no process-wide XLA flag: this is opt-in, per compiled function.
The one place rumus_fx passes it itself is the programs that conv2d's forward
and backward compile for their own eager calls on a CPU device (Note [Eager
compiler options] in rumus_fx/eager.py); a jitted step is compiled as the user
asks.
Measurements with and without it are in ``benchmarks/RESULTS.md``.

``same_branches`` shapes a traced program for XLA:CPU (used by the library under
``jax.jit`` only, where ``JitTracer`` says a value is being traced by it).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from jax import lax

try:  # a value traced by jax.jit (not vmap, jvp ...)
    from jax.interpreters.partial_eval import DynamicJaxprTracer as JitTracer
except ImportError:  # pragma: no cover - a jax without it: callers keep their plain form
    JitTracer = ()

CPU_COMPILER_OPTIONS: types.MappingProxyType[str, str] = types.MappingProxyType(
    {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE"}
)


def same_branches(fn: Callable[..., Any], witness: Any, *operands: Any) -> Any:
    """``fn(*operands)`` as both branches of a ``lax.cond`` whose predicate XLA
    cannot evaluate: the first element of ``witness`` (an array with at least one
    element) equals itself, false only for a NaN; both branches are ``fn``, so the
    result does not depend on it. XLA:CPU compiles a branch as a computation of
    its own: it materialises the operands and merges nothing across the boundary
    (Note [Max pool under jit] in rumus_fx/ops/conv.py, Note [Recomputation kept
    apart] in rumus_fx/lift/apart.py)."""
    first = lax.slice(witness, (0,) * witness.ndim, (1,) * witness.ndim).reshape(())
    return lax.cond(first == first, fn, fn, *operands)
