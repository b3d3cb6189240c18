"""What an op module needs to declare its ops (Note [Declaring an op] in
``autograd/registry.py``): the ``@op`` decorator, sample generators for the op
table and placeholders for malformed inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from ..autograd.registry import BadInput as BadInput
from ..autograd.registry import OpDecl, declare
from ..autograd.registry import Sample as Sample
from ..tensor import Tensor

Fn = TypeVar("Fn", bound=Callable[..., Any])


def op(
    *,
    records: tuple[type, ...],
    name: str | None = None,
    export: str | bool = True,
    toplevel: bool = True,
    call: Callable | None = None,
    ref: Callable | None = None,
    samples: Callable[[np.random.Generator], list[Sample]] | None = None,
    errors: Callable[[], list[BadInput]] | None = None,
    output: Callable[[Any], Any] | None = None,
    rtol32: float = 2e-5,
    atol32: float = 2e-5,
    fd_tol: float = 1e-6,
) -> Callable[[Fn], Fn]:
    """Declare the decorated forward as a fused op (see Note [Declaring an op]).

    ``name`` (default: the function's name) names the op-table entry;
    ``export`` the public name (``True``: the function's name, ``False``: not
    exported; ``toplevel=False``: only as ``rumus_fx.ops.<name>``). Decorators may be stacked to give one op several table entries
    (``batch_norm_2d_train``/``_eval``). Returns the function unchanged."""

    def deco(fn: Fn) -> Fn:
        exp = fn.__name__ if export is True else (export or None)
        declare(
            OpDecl(
                name=name or fn.__name__,
                kind="op",
                records=tuple(records),
                fn=fn,
                export=exp,
                toplevel=toplevel,
                call=call,
                ref=ref,
                samples=samples,
                errors=errors,
                output=output,
                rtol32=rtol32,
                atol32=atol32,
                fd_tol=fd_tol,
                module=fn.__module__,
            )
        )
        return fn

    return deco


# -- sample generators (numpy, float64; the tables cast) ----------------------
# Shared by the fused ops' declarations and the primitive rules' table entries
# (``defrule(table=...)`` in ``rumus_fx/lift/rules_<family>.py``). Each is a
# function of a ``np.random.Generator``: nothing is built at import.


def normal(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape)


def positive(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.uniform(0.5, 2.0, shape)


def unit(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """Inside (-1, 1), away from its ends (arcsin, arctanh, ...)."""
    return rng.uniform(-0.8, 0.8, shape)


def away_from_zero(rng: np.random.Generator, *shape: int, below: float = 0.1, to: float = 0.5) -> np.ndarray:
    """Normal values, those of magnitude under ``below`` replaced by ``to``."""
    x = rng.standard_normal(shape)
    return np.where(np.abs(x) < below, to, x)


def far_from_zero(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """``away_from_zero`` with a wider gap (the primitive table's kinks: abs, atan2, 1/x)."""
    return away_from_zero(rng, *shape, below=0.2, to=0.7)


def distinct(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """Values with no ties (max/min/sort rules are then unambiguous)."""
    n = int(np.prod(shape)) if shape else 1
    return (rng.permutation(n).reshape(shape) / n * 4 - 2 + rng.uniform(0, 0.01, shape)).astype(np.float64)


def wellcond(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """A normal matrix plus ``n I``: far from singular."""
    n = shape[-1]
    return rng.standard_normal(shape) + n * np.eye(*shape[-2:])


def spd(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """``A A^T + n I``: symmetric positive definite, well conditioned."""
    a = rng.standard_normal(shape)
    return a @ np.swapaxes(a, -1, -2) + shape[-1] * np.eye(shape[-1])


UNARY_SHAPES = ((3, 4), (2, 3, 5))
BINARY_SHAPES = (((3, 4), (3, 4)), ((2, 3), ()))


def unary_samples(shapes: Any = UNARY_SHAPES, gen: Callable = normal) -> Callable[[np.random.Generator], list[Sample]]:
    """One sample per shape: one array from ``gen``, differentiable."""
    return lambda rng: [Sample((gen(rng, *s),)) for s in shapes]


def binary_samples(
    gen0: Callable = normal, gen1: Callable = normal, shapes: Any = BINARY_SHAPES
) -> Callable[[np.random.Generator], list[Sample]]:
    """One sample per pair of shapes: two arrays (from ``gen0``, ``gen1``), both differentiable."""
    return lambda rng: [Sample((gen0(rng, *a), gen1(rng, *b)), diff=(0, 1)) for a, b in shapes]


def ranked(f: Callable) -> Callable:
    """A jnp binary oracle with explicit rank alignment (the test suite runs
    with ``jax_numpy_rank_promotion='raise'``)."""

    def g(a: Any, b: Any) -> Any:
        nd = max(jnp.ndim(a), jnp.ndim(b))
        a = jnp.reshape(a, (1,) * (nd - jnp.ndim(a)) + jnp.shape(a))
        b = jnp.reshape(b, (1,) * (nd - jnp.ndim(b)) + jnp.shape(b))
        return f(a, b)

    return g


# -- malformed-input placeholders (built when the case runs) -----------------


class Placeholder:
    """An argument of a ``BadInput`` built when the case runs."""

    def __init__(self, make: Callable[[], Any]):
        self.make = make

    def __repr__(self) -> str:
        return "Placeholder(...)"


def tracked(*shape: int) -> Placeholder:
    """A tracked float32 tensor of ``shape`` (seeded by the shape)."""

    def make() -> Tensor:
        data = np.random.default_rng(sum(shape) + len(shape)).standard_normal(shape).astype(np.float32)
        return Tensor(data, requires_grad=True)

    return Placeholder(make)


def indices(*shape: int, high: int = 3) -> Placeholder:
    """An int32 array of ``shape`` with values in ``[0, high)``."""
    return Placeholder(lambda: jnp.asarray(np.random.default_rng(0).integers(0, high, shape), jnp.int32))


def integers(*shape: int) -> Placeholder:
    """An integer array (ones) where a float one is needed."""
    return Placeholder(lambda: jnp.ones(shape, jnp.int32))


def array(value: Any, dtype: Any = None) -> Placeholder:
    """``jnp.asarray(value, dtype)``."""
    return Placeholder(lambda: jnp.asarray(value, dtype))


KEY = Placeholder(lambda: jax.random.key(0))


def materialise(x: Any) -> Any:
    """Build the placeholders inside ``x`` (lists and tuples are walked)."""
    if isinstance(x, Placeholder):
        return x.make()
    if isinstance(x, list):
        return [materialise(v) for v in x]
    if isinstance(x, tuple):
        return tuple(materialise(v) for v in x)
    if isinstance(x, dict):
        return {k: materialise(v) for k, v in x.items()}
    return x
