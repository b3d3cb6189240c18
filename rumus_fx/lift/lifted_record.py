"""``LiftedBackward``: the one tape entry of a lifted call (its program and
residuals), and its declaration in the op registry."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..autograd.record import Record, VersionSnapshot
from ..autograd.registry import BadProgram, OpDecl, declare
from ..errors import AutogradError
from ..ops._declare import Placeholder
from .program import Program
from .rules import PrimitiveRecord

Array = jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class LiftedBackward(Record):
    """One lifted call: the program (static) and its residuals (saved arrays).

    ``records()`` gives the per-primitive records it holds; its backward walks
    them in reverse. ``versions`` snapshots the storages of tracked inputs whose
    values are saved (a later in-place write to one is a ``VersionMismatch``).
    """

    multi_output = True
    program: Program
    residuals: tuple[Array, ...]
    extras: tuple[Array, ...]
    versions: tuple[VersionSnapshot, ...]

    owns_compiled_backward = True

    def backward(self, g, needs):
        return tuple(self.program.backward((self.residuals, self.extras), g, rows_checked=True))

    def compiled_backward(self, g, needs, options):
        return self.program.compiled_backward(options)((self.residuals, self.extras), g)

    def records(self) -> list[PrimitiveRecord]:
        return self.program.records((self.residuals, self.extras))

    @property
    def label(self) -> str:
        return f"LiftedBackward({self.program.name})"


def _no_rule_errors() -> list[BadProgram]:
    """Differentiable primitives without a rule: the gradient raises, naming the
    primitive (``jax_too``: where jax.grad has no gradient either)."""

    def mat(*shape: int) -> Placeholder:
        return Placeholder(lambda: np.random.default_rng(0).standard_normal(shape) + shape[-1] * np.eye(*shape[-2:]))

    def case(prim: str, fun: Callable, args: tuple, **kw: Any) -> BadProgram:
        also = (f"no backward rule for the primitive '{prim}'",)
        return BadProgram(f"no rule for {prim}", fun, args, AutogradError, also, names=("rf.lift", prim), **kw)

    return [
        case(
            "householder_product",
            lambda a: lax.linalg.householder_product(a, jnp.ones(3)),
            (mat(4, 3),),
            x64=True,
            jax_too=True,
        ),
        case(
            "igamma_grad_a",
            lax.igamma_grad_a,
            (np.array([1.5, 2.0]), np.array([0.5, 3.0])),
            argnums=1,
            x64=True,
            jax_too=True,
        ),
    ]


declare(OpDecl(name="lift", kind="composite", records=(LiftedBackward,), errors=_no_rule_errors, module=__name__))
