"""Shared pieces of the primitive table: jax.numpy / lax programs that exercise each primitive
rule of ``rf.lift`` (PyTorch OpInfo / jax LAX_GRAD_OPS style).

Each entry: a plain jax function of arrays (the oracle is ``jax.grad`` of that
same function: rf only ever sees it through ``rf.lift``), a sample generator,
the differentiable argument positions, and the primitives it must exercise.
Adding a rule = one entry here (the coverage test fails otherwise).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class PSample:
    args: tuple
    diff: tuple[int, ...] = (0,)


@dataclasses.dataclass(frozen=True)
class PInfo:
    name: str
    fun: Callable
    samples: Callable[[np.random.Generator], list[PSample]]
    prims: tuple[str, ...]
    rtol32: float = 2e-5
    atol32: float = 2e-5
    fd_tol: float = 1e-6
    vmap: bool = False  # also checked under jax.vmap(rf.grad(...))
    fd: bool = True  # float64 finite differences (off for casts to lower precision)

    def __str__(self) -> str:
        return self.name


def normal(rng, *shape):
    return rng.standard_normal(shape)


def positive(rng, *shape):
    return rng.uniform(0.5, 2.0, shape)


def unit(rng, *shape):
    return rng.uniform(-0.8, 0.8, shape)


def away(rng, *shape):
    x = rng.standard_normal(shape)
    return np.where(np.abs(x) < 0.2, 0.7, x)


def distinct(rng, *shape):
    """Values with no ties (max/min/sort rules are then unambiguous)."""
    n = int(np.prod(shape)) if shape else 1
    return (rng.permutation(n).reshape(shape) / n * 4 - 2 + rng.uniform(0, 0.01, shape)).astype(np.float64)


def unary(gen=normal, shapes=((3, 4), (2, 3, 5))):
    return lambda rng: [PSample((gen(rng, *s),)) for s in shapes]


def binary(gen0=normal, gen1=normal, shapes=(((3, 4), (3, 4)), ((2, 3), ()))):
    return lambda rng: [PSample((gen0(rng, *a), gen1(rng, *b)), diff=(0, 1)) for a, b in shapes]


def u(name, f, gen=normal, prims=None, **kw):
    return PInfo(name, f, unary(gen), prims or (name,), **kw)


def _scalar_rhs(f):
    """f(x, y) with y possibly rank 0 (a python-scalar-like operand)."""
    return lambda x, y: f(x, y)
