"""``rf.defrule`` / ``rf.undefrule``: rules for primitives rf does not ship.

Note [Rules of other libraries]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A library built on JAX may define primitives of its own (equinox's
``maybe_set``, ``nondifferentiable_backward``, ...). ``rf.lift`` refuses a
program whose gradient goes through a primitive without a rule, naming it and
the call that emitted it; ``rf.defrule`` is how a library (or a user) gives it
one. The rule is declared exactly like rf's own (Note [Primitive rules] in
``lift/rules.py``): a hand-written backward formula, what it saves, and its
test programs (``table=``: ``TableEntry`` programs that emit the primitive,
checked against ``jax.grad`` by the primitive table; ``errors=``: programs it
must refuse). A rule given the ``Primitive`` object serves that object only —
another library's primitive of the same name still raises.

rf's rules for widely used libraries are declared with this same function
(``lift/rules_equinox.py``), in the module ``LIBRARY_RULES`` of
``lift/rules.py`` names; that module is imported the first time a program
holds one of the library's primitives, so ``import rumus_fx`` never imports
the library.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from jax.extend import core as jcore

from ..autograd.registry import BadProgram, TableEntry, lookup, undeclare
from . import program, tracing
from .rules import NON_DIFFERENTIABLE, RULES, Rule
from .rules import defrule as _declare_rule

# the call primitives rf runs through (their bodies are recorded), and the
# calls inlined into a program and control flow with built-in rules: no rule of their own
RESERVED = program.INLINE_CALLS | {
    "scan",
    "cond",
    "while",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "remat",
    "checkpoint",
}


def defrule(
    primitive: jcore.Primitive | str,
    vjp: Callable[[Any, Any], tuple],
    *,
    saves: tuple[tuple[int, ...], tuple[int, ...]] | Callable | None = None,
    table: tuple[TableEntry, ...] = (),
    errors: Callable[[], list[BadProgram]] | None = None,
    doc: str | None = None,
    replace: bool = False,
) -> type:
    """Register a hand-written backward rule for ``primitive``; returns its record type.

    ``primitive`` is a ``jax.extend.core.Primitive`` (the rule then serves that
    object only) or a primitive's name. ``vjp(r, g)`` is the backward formula,
    written with ``jax.numpy``/``jax.lax`` (never ``jax.vjp``/``jax.grad``): ``r``
    is the record — ``r.params`` (the equation's parameters), ``r.in_avals`` and
    ``r.out_avals`` (shapes and dtypes), ``r.needs`` (which inputs need a
    gradient), ``r.ins``/``r.outs`` (the saved inputs and outputs, ``None`` where
    not saved) — and ``g`` the gradient of the output (a tuple of one per output
    for a primitive with ``multiple_results``; an output that got no gradient
    gets zeros). It returns a sequence with one gradient (or ``None``) per
    input, each of its input's shape and dtype (a gradient of another shape or
    dtype raises ``AutogradError`` naming the rule; it is never cast). The rule may be run under ``jax.jit`` and,
    for a gradient of a gradient, recorded on a tape: write it as a pure
    function of ``r`` and ``g``. Real floating operands only: a complex value
    that carries a gradient into the primitive is refused when the program is
    lifted.

    ``saves`` says which inputs and outputs the formula reads: ``(ins, outs)``,
    tuples of positions, or a function ``saves(needs)`` / ``saves(needs, params)``
    returning them. Default: every input and every output. What is not saved is
    ``None`` in the record (and does not count in ``saved_bytes``).

    ``table``: the rule's test programs, ``rf.autograd.registry.TableEntry``
    values (a jax program that emits the primitive, its samples, tolerances),
    which the primitive table compares with ``jax.grad``; ``errors``: a function
    returning the ``BadProgram`` cases it must refuse, for the error audit.
    ``doc``: the record type's docstring.

    The record type is named after the primitive in CamelCase
    (``maybe_set`` -> ``MaybeSetBackward``). A primitive that already has a rule
    raises ``ValueError`` unless ``replace=True`` (then the new rule replaces one
    registered with ``defrule``; rf's built-in rules cannot be replaced), as do
    the primitives rf treats as having no derivative and the calls and control
    flow rf runs through itself. Programs lifted before keep the rule they were
    built with until traced again: ``defrule`` and ``undefrule`` clear the cache
    of lifted programs.

    >>> import jax.numpy as jnp, rumus_fx as rf
    >>> from jax.extend.core import Primitive
    >>> from jax.interpreters import mlir
    >>> twice_p = Primitive("twice_doc")  # a library's primitive: x -> 2 x
    >>> _ = twice_p.def_impl(lambda x: 2 * x), twice_p.def_abstract_eval(lambda x: x)
    >>> mlir.register_lowering(twice_p, mlir.lower_fun(lambda x: 2 * x, multiple_results=False))
    >>> _ = rf.defrule(twice_p, lambda r, g: (2 * g,), saves=((), ()))
    >>> rf.grad(rf.lift(lambda x: jnp.sum(twice_p.bind(x) ** 2)))(jnp.ones(2)).tolist()
    [8.0, 8.0]
    >>> rf.undefrule(twice_p)
    """
    name, prim = _name_of(primitive, "defrule")
    if not callable(vjp):
        raise TypeError(f"rf.defrule({name!r}): vjp must be a function vjp(record, g), got {type(vjp).__name__}")
    try:
        n_params = len(inspect.signature(vjp).parameters)
    except (TypeError, ValueError):  # a builtin: trust it
        n_params = 2
    if n_params < 2 and not _has_varargs(vjp):
        raise TypeError(f"rf.defrule({name!r}): vjp must take (record, g), it takes {n_params} argument(s)")
    if name in RESERVED:
        raise ValueError(
            f"rf.defrule({name!r}): '{name}' is a call or control-flow primitive that rf.lift runs through itself"
        )
    if name in NON_DIFFERENTIABLE:
        raise ValueError(
            f"rf.defrule({name!r}): rf.lift treats '{name}' as having no derivative (it passes through); "
            "it cannot take a rule"
        )
    old = RULES.get(name)
    if old is not None:
        if not _registered_here(old):
            raise ValueError(f"rf.defrule({name!r}): '{name}' has rf's built-in rule ({old.record.__name__})")
        if not replace:
            raise ValueError(
                f"rf.defrule({name!r}): '{name}' already has a rule ({old.record.__name__}, declared in "
                f"{old.record.__module__}); pass replace=True to replace it"
            )
        _remove(name)
    saves_value = _check_saves(name, saves)
    table = tuple(table)
    for e in table:
        if not isinstance(e, TableEntry):
            raise TypeError(f"rf.defrule({name!r}): table entries must be TableEntry values, got {type(e).__name__}")
    if errors is not None and not callable(errors):
        raise TypeError(f"rf.defrule({name!r}): errors must be a function returning BadProgram cases")
    module = getattr(vjp, "__module__", None) or __name__
    rule = _declare_rule(
        name,
        vjp,
        saves_value,
        multiple_results=bool(getattr(prim, "multiple_results", False)),
        doc=doc,
        table=table,
        errors=errors,
        primitive=prim,
        module=module,
    )
    _PUBLIC.add(name)
    tracing.clear_programs()
    return rule.record


def undefrule(primitive: jcore.Primitive | str) -> None:
    """Remove the rule ``rf.defrule`` registered for ``primitive`` (an object
    or a name); a program through it raises again. rf's built-in rules cannot
    be removed (``ValueError``), nor a rule that was never registered
    (``KeyError``)."""
    name, prim = _name_of(primitive, "undefrule")
    old = RULES.get(name)
    if old is None or (prim is not None and old.primitive is not None and old.primitive is not prim):
        raise KeyError(f"rf.undefrule({name!r}): no rule is registered for this primitive")
    if not _registered_here(old):
        raise ValueError(f"rf.undefrule({name!r}): '{name}' has rf's built-in rule; it cannot be removed")
    _remove(name)
    tracing.clear_programs()


_PUBLIC: set[str] = set()


def _registered_here(rule: Rule) -> bool:
    return rule.name in _PUBLIC


def _remove(name: str) -> None:
    lookup("primitive", name)
    RULES.pop(name, None)
    undeclare("primitive", name)
    _PUBLIC.discard(name)


def _name_of(primitive: Any, fn: str) -> tuple[str, Any]:
    if isinstance(primitive, jcore.Primitive):
        return primitive.name, primitive
    if isinstance(primitive, str) and primitive:
        return primitive, None
    raise TypeError(f"rf.{fn}: primitive must be a jax.extend.core.Primitive or a primitive's name, got {primitive!r}")


def _has_varargs(f: Callable) -> bool:
    try:
        return any(p.kind == p.VAR_POSITIONAL for p in inspect.signature(f).parameters.values())
    except (TypeError, ValueError):  # pragma: no cover
        return True


def _check_saves(name: str, saves: Any) -> Any:
    if saves is None:
        return _save_everything
    if callable(saves):
        return saves
    ok = (
        isinstance(saves, tuple)
        and len(saves) == 2
        and all(isinstance(s, tuple) and all(isinstance(k, int) and k >= 0 for k in s) for s in saves)
    )
    if not ok:
        raise TypeError(
            f"rf.defrule({name!r}): saves must be (inputs, outputs), two tuples of positions, "
            f"or a function of needs; got {saves!r}"
        )
    return saves


def _save_everything(needs: tuple[bool, ...], params: Any) -> tuple[tuple[int, ...], None]:
    """The default ``saves``: every input, and every output (``None``)."""
    return tuple(range(len(needs))), None
