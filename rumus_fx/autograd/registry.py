"""The op registry: one declaration per differentiable op, fused or primitive.

Note [Declaring an op]
~~~~~~~~~~~~~~~~~~~~~~
Every op is declared once, in the module that implements it, and everything
that lists ops reads that declaration instead of keeping its own list (the
idea of PyTorch's ``derivatives.yaml`` + OpInfo, in one place):

* a fused op of SPEC section 5 (``rumus_fx/ops/<family>.py``) decorates its
  forward with ``@op(records=..., ref=..., samples=..., errors=...)``
  (``rumus_fx.ops._declare.op``); a fused elementwise op of one array is one
  ``unary_op(...)`` call, which makes its record and forward and declares
  them (Note [Unary op family] in ``rumus_fx/ops/_unary.py``);
* a primitive rule of ``rf.lift`` (``rumus_fx/lift/rules_<family>.py``) is
  declared by ``defrule(name, vjp, saves, table=..., errors=...)``, which makes
  its record type and registers it here. A rule declared by a family helper
  (``_unary``, ``_binary``, ``_cumulative``) gets its entries through the
  helper or ``add_table(name, ...)`` right after it, in the same module.

A declaration (``OpDecl``) holds:

* ``name``, ``kind`` (``"op"``, ``"primitive"`` or ``"composite"``: ``rf.lift``
  itself) and ``fn`` (the forward; for a primitive, ``None``:
  ``primitive.bind`` is the forward);
* ``records``: the record types it may append. Each is a frozen dataclass whose
  fields say what it saves (Note [Record fields] in ``record.py``: ``saved``
  data, ``snapshot`` versions, ``static`` metadata) and whose ``backward`` is
  the formula (for a primitive, ``extra["saves"]`` and ``extra["backward"]``:
  Note [Primitive rules] in ``lift/rules.py``);
* for the op table: ``ref`` (an independent ``jax.numpy`` oracle),
  ``samples(rng)`` (a list of ``Sample``), ``call`` (how the table calls the op
  when not as ``fn``), ``output`` (picks the differentiable output),
  tolerances. A primitive has instead ``extra["table"]``, its ``TableEntry``
  values: a jax program that emits it (the oracle is ``jax.grad`` of the same
  program), ``samples(rng)``, the primitives it must emit, tolerances and the
  vmap / finite-difference flags;
* ``errors()``: for a fused op, malformed inputs (``BadInput``) and the
  exception each raises; for a primitive rule (and for ``rf.lift``, whose
  cases are the differentiable primitives without a rule), the programs it
  refuses (``BadProgram``), the exception and what its message names.

The sample generators (``normal``, ``positive``, ``unit``, ``away_from_zero``, ``far_from_zero``,
``distinct``, ``wellcond``, ``spd``, ``unary_samples``, ``binary_samples``) and
the placeholders of malformed inputs live in ``rumus_fx/ops/_declare.py``, for
both kinds; they are functions of an rng (nothing is built at import).

Checked against the registry: the exports of ``rumus_fx.ops`` and ``rumus_fx``,
one explicit ``from .<family> import <op> as <op>`` line per op in their
``__init__.py`` (``tests/test_imports.py`` compares them with ``exports()``).
Derived from the registry: ``rf.autograd.BackwardOp`` (``declared_records()``), the op
table ``tests/ops/optable.py``, the primitive table ``tests/lift/ptable.py``
(every ``TableEntry``; ``tests/lift/test_ptable.py`` also checks that every rule
is exercised by one), the error audit ``tests/test_errors_audit.py`` (``errors``
of every kind), and the docs check that the "Ops and their records" table of
``docs/tape.md`` names every op and record. Adding a fused op touches its family
module, its export lines and one row of that table; adding a primitive rule touches
its ``rules_<family>.py`` module only. ``tests/ops/test_registry.py`` checks that an op and a rule
declared in a test module reach all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

KINDS = ("op", "primitive", "composite")


@dataclasses.dataclass(frozen=True)
class Sample:
    """One sample call of an op: positional ``args`` (arrays and static values),
    ``kwargs``, and the positions of the differentiable array arguments."""

    args: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)
    diff: tuple[int, ...] = (0,)


@dataclasses.dataclass(frozen=True)
class BadInput:
    """A malformed call: ``args``/``kwargs`` (placeholders such as ``tracked(3, 4)``
    are built when the case runs, see ``rumus_fx.ops._declare``), the exception
    type(s) it must raise and substrings its message must contain (besides the
    op's name)."""

    what: str
    args: tuple
    exc: type[BaseException] | tuple[type[BaseException], ...]
    also: tuple[str, ...] = ()
    kwargs: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class BadProgram:
    """A jax program a primitive rule (or ``rf.lift`` itself) must refuse:
    ``rf.grad(lambda *a: rf.sum(rf.lift(fun)(*a)), argnums)(*args)`` raises
    ``exc`` with a message naming ``names`` (default: the declared primitive)
    and containing the substrings ``also``. ``args`` are numpy arrays (cast to
    float32, or float64 with ``x64``) or placeholders built when the case runs;
    ``jax_too``: ``jax.grad`` of the same program raises as well (rf refuses
    where JAX does, never a wrong gradient)."""

    what: str
    fun: Callable
    args: tuple
    exc: type[BaseException] | tuple[type[BaseException], ...]
    also: tuple[str, ...] = ()
    argnums: int | tuple[int, ...] = 0
    names: tuple[str, ...] | None = None
    x64: bool = False
    jax_too: bool = False


@dataclasses.dataclass(frozen=True)
class TableEntry:
    """One entry of the primitive table (``tests/lift/ptable.py``), declared with
    its rule (``defrule(table=...)``): a jax program ``fun`` of arrays that emits
    the primitive(s) ``prims`` (default: the rule's own), its samples, and which
    checks apply (``vmap``: also under ``jax.vmap``; ``fd``: float64 finite
    differences). ``rf.grad(rf.lift(fun))`` is compared with ``jax.grad(fun)``, or
    with ``jax.grad(oracle)`` where ``fun`` is a program jax.grad cannot
    differentiate (a generic ``reduce_window``) and ``oracle`` the same function
    written so that it can."""

    name: str
    fun: Callable
    samples: Callable[[Any], list[Sample]]
    prims: tuple[str, ...] | None = None
    rtol32: float = 2e-5
    atol32: float = 2e-5
    fd_tol: float = 1e-6
    vmap: bool = False
    fd: bool = True
    oracle: Callable | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class OpDecl:
    """The declaration of one op (see Note [Declaring an op])."""

    name: str
    kind: str
    records: tuple[type, ...]
    fn: Callable | None = None
    export: str | None = None
    toplevel: bool = True  # exported as rumus_fx.<export> too (else only rumus_fx.ops.<export>)
    call: Callable | None = None
    ref: Callable | None = None
    samples: Callable[[Any], list[Sample]] | None = None
    errors: Callable[[], list[BadInput]] | Callable[[], list[BadProgram]] | None = None
    output: Callable[[Any], Any] | None = None
    rtol32: float = 2e-5
    atol32: float = 2e-5
    fd_tol: float = 1e-6
    module: str = ""
    extra: dict = dataclasses.field(default_factory=dict)  # table options of other kinds (vmap, fd, prims)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"declare: kind must be one of {KINDS}, got {self.kind!r}")
        for r in self.records:
            if not r.__name__.endswith("Backward"):
                raise TypeError(f"declare({self.name!r}): record type {r.__name__} must be named <Op>Backward")

    @property
    def op(self) -> Callable | None:
        """What the op table calls: ``call`` if given, else the forward."""
        return self.call if self.call is not None else self.fn

    @property
    def record_names(self) -> tuple[str, ...]:
        return tuple(r.__name__ for r in self.records)

    def __str__(self) -> str:
        return self.name


_DECLS: dict[tuple[str, str], OpDecl] = {}


def declare(decl: OpDecl) -> OpDecl:
    """Register ``decl``. Declaring a (kind, name) again from the same module
    (a reload) replaces it; from another module it is an error."""
    key = (decl.kind, decl.name)
    old = _DECLS.get(key)
    if old is not None and old.module != decl.module:
        raise ValueError(f"declare: {decl.kind} {decl.name!r} is already declared in {old.module}")
    _DECLS[key] = decl
    return decl


def undeclare(kind: str, name: str) -> None:
    """Remove a declaration (tests that declare a throwaway op)."""
    _DECLS.pop((kind, name), None)


def declarations(kind: str | None = None) -> tuple[OpDecl, ...]:
    """Every declaration (of ``kind``), in declaration order."""
    return tuple(d for d in _DECLS.values() if kind is None or d.kind == kind)


def lookup(kind: str, name: str) -> OpDecl:
    return _DECLS[(kind, name)]


def exports(toplevel: bool = False) -> dict[str, Callable]:
    """``{public name: forward}`` of every exported fused op: what
    ``rumus_fx.ops`` re-exports, or with ``toplevel`` what ``rumus_fx`` does."""
    out: dict[str, Callable] = {}
    for d in declarations("op"):
        if d.export is not None and d.fn is not None and (d.toplevel or not toplevel):
            if d.export in out and out[d.export] is not d.fn:
                raise ValueError(f"exports: two ops export the name {d.export!r}")
            out[d.export] = d.fn
    return out


def declared_records() -> tuple[type, ...]:
    """Every record type some declaration may append (``BackwardOp``'s members)."""
    seen: dict[type, None] = {}
    for d in declarations():
        for r in d.records:
            seen.setdefault(r, None)
    return tuple(seen)
