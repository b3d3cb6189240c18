"""Fused elementwise unary ops, declared by family.

Note [Unary op family]
~~~~~~~~~~~~~~~~~~~~~~
A fused elementwise op of one array is one call of ``unary_op`` in its family
module (``ReluBackward, relu = unary_op("relu", ...)``), which says:

* ``name``, the op's name (and its forward's);
* ``forward``: a jax function of one array, the op's value;
* ``formula``: its derivative, ``formula(g, saved) -> dx`` (``formula(g)``
  when nothing is saved; the formulas live in ``_formulas.py``);
* ``saves``: what the formula reads, ``"input"``, ``"output"`` or None;
* ``defers``: whether a call on a qualifying operand is deferred (Note
  [Deferred elementwise ops] in ``rumus_fx/lazy.py``);
* ``floats_only``: whether a non-floating input is refused (TypeError);
* the op-table entry and error cases of ``@op`` (``ref``, ``samples``,
  ``errors``; Note [Declaring an op] in ``autograd/registry.py``) and the
  docstrings.

From it follow the record ``<Name>Backward`` (a frozen dataclass whose fields
are ``input``/``input_version``, ``output``/``output_version`` or none, and
whose ``backward`` is the formula), the forward (deferred, or one
``eager_jit`` call, then recorded when an input is tracked), the deferral's
``lazy.Kind`` and the declaration the op table, the error audit and the
export check read. Both are returned, for the family module to name.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .. import lazy
from ..autograd.record import Record, VersionSnapshot
from ..autograd.registry import BadInput, Sample
from ..tensor import Tensor
from ._core import (
    array_of,
    deferrable,
    deferred_unary,
    eager_jit,
    new_output,
    reads,
    record,
    require_float,
    snapshot,
    tape_for,
)
from ._declare import op

SAVES = ("input", "output", None)


def _record_class(name: str, saves: str | None, formula: Callable, doc: str, module: str) -> type[Record]:
    """The frozen record dataclass ``name`` whose ``backward`` is ``formula``."""
    if saves == "input":

        def backward(self: Any, g: jax.Array, needs: tuple[bool, ...]) -> tuple:
            return (formula(g, self.input),)

    elif saves == "output":

        def backward(self: Any, g: jax.Array, needs: tuple[bool, ...]) -> tuple:
            return (formula(g, self.output),)

    else:

        def backward(self: Any, g: jax.Array, needs: tuple[bool, ...]) -> tuple:
            return (formula(g),)

    fields = [] if saves is None else [(saves, jax.Array), (f"{saves}_version", VersionSnapshot | None)]
    cls = dataclasses.make_dataclass(
        name, fields, bases=(Record,), namespace={"backward": backward, "__doc__": doc}, frozen=True, eq=False
    )
    cls.__module__ = module
    backward.__qualname__ = f"{name}.backward"
    backward.__module__ = module
    return cls


def unary_op(
    name: str,
    forward: Callable[[jax.Array], jax.Array],
    formula: Callable[..., jax.Array],
    saves: str | None,
    *,
    doc: str,
    record_doc: str,
    defers: bool = True,
    floats_only: bool = True,
    ref: Callable | None = None,
    samples: Callable[[np.random.Generator], list[Sample]] | None = None,
    errors: Callable[[], list[BadInput]] | None = None,
) -> tuple[type[Record], Callable[[Any], Tensor]]:
    """Declare the fused unary op ``name`` (Note [Unary op family]); returns
    its record class and its forward."""
    if saves not in SAVES:
        raise ValueError(f"unary_op({name!r}): saves must be one of {SAVES}, got {saves!r}")
    module = sys._getframe(1).f_globals["__name__"]
    camel = "".join(p[:1].upper() + p[1:] for p in name.split("_"))
    cls = _record_class(f"{camel}Backward", saves, formula, record_doc, module)
    run = eager_jit(forward)
    kind = lazy.Kind(name, forward) if defers else None

    def fn(x: Any) -> Tensor:
        if kind is not None:
            src = deferrable(x)
            if src is not None:  # Note [Deferred elementwise ops] (rumus_fx/lazy.py)
                return deferred_unary(x, src, kind, cls, saves)
        xv = array_of(x, name)
        if floats_only:
            require_float(name, xv)
        out = run(xv)
        tape = tape_for(x)
        if tape is None:
            return Tensor._wrap(out)
        if saves == "output":
            res = new_output(out, tape)
            return record(tape, cls(out, snapshot(res)), (x,), res)
        if saves == "input":
            saved, version = reads(x, True)
            return record(tape, cls(saved, version), (x,), new_output(out, tape))
        return record(tape, cls(), (x,), new_output(out, tape))

    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = module
    fn.__doc__ = doc
    op(records=(cls,), ref=ref, samples=samples, errors=errors)(fn)
    return cls, fn
