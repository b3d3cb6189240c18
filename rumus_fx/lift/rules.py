"""The declaration of primitive rules: one record type and one hand-written
backward formula per JAX primitive (the table that ``rf.lift`` reads).

Note [Primitive rules]
~~~~~~~~~~~~~~~~~~~~~~
A rule is declared with ``defrule(name, vjp, saves=..., table=..., errors=...)``:
``name`` is the primitive's name as it appears in a jaxpr (``"sin"``, ``"dot_general"``,
``"scatter-add"``), ``vjp(r, g)`` is the backward formula written with
``jax.numpy``/``lax`` — ``r`` is the record (saved values, params, avals, which
inputs need a gradient) and ``g`` the output gradient (a tuple for primitives with
several outputs) — and it returns one gradient (or ``None``) per input.
``saves(needs)`` (or ``saves(needs, params)`` when it depends on the primitive's
parameters, as ``sort``'s keys do on ``num_keys``) says which inputs and outputs of
the primitive the formula reads; a rule saves nothing else (a value it needs but the primitive does not return,
such as the permutation of a ``sort``, is recomputed from what it saved). That
keeps ``saved_bytes`` honest and makes every saved value an ordinary value of the
program, which higher-order gradients need.

The declaration also carries what tests it (Note [Declaring an op] in
``autograd/registry.py``): ``table=`` its primitive-table entries
(``TableEntry``: a jax program emitting the primitive, samples from the
generators of ``rumus_fx/ops/_declare.py``, tolerances, the vmap and
finite-difference flags) and ``errors=`` the programs it must refuse
(``BadProgram``: the exception and what its message names, e.g. ``while``'s
reverse or ``svd(full_matrices=True)`` of a non-square matrix), which the
primitive table and the error audit read from the registry. A rule declared by
a family helper gets them through the helper or ``add_table`` right after it;
either way they sit in the rule's own ``rules_<family>.py``. Adding a rule is
one declaration there.

Each declaration makes a record class named after the primitive in CamelCase
(``sin`` -> ``SinBackward``, ``reduce_sum`` -> ``ReduceSumBackward``), a frozen
dataclass with the same fields for every primitive: ``params`` (the primitive's
parameters), ``in_avals``/``out_avals``, ``needs``, and ``ins``/``outs`` (the saved
values, ``None`` where not saved). Control-flow primitives add ``forward`` (a
forward that also returns residuals) and keep those in ``extra``.

Nothing here calls JAX's JVP or transpose rules: ``jax.extend.core`` and
``jax.make_jaxpr`` are the only JAX internals ``rf.lift`` uses.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from ..autograd.record import Aval, Record
from ..autograd.registry import BadProgram, OpDecl, TableEntry, declare, lookup

Array = jax.Array
frozen = dataclasses.dataclass(frozen=True, eq=False)


class Params(Mapping):
    """A primitive's parameters as a hashable, read-only mapping."""

    __slots__ = ("_d", "_h")

    def __init__(self, params: Mapping[str, Any]):
        self._d = dict(params)
        try:
            self._h = hash(tuple(sorted(self._d.items())))
        except TypeError:  # an unhashable parameter: identity is the only key
            self._h = None

    def __getitem__(self, key: str) -> Any:
        return self._d[key]

    def __iter__(self):
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __hash__(self) -> int:
        return id(self) if self._h is None else self._h

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Params) or self._h is None or other._h is None:
            return False
        return self._h == other._h and self._d == other._d

    def __repr__(self) -> str:
        return f"Params({', '.join(f'{k}={v!r}' for k, v in self._d.items() if not k.endswith('jaxpr'))})"


@frozen
class PrimitiveRecord(Record):
    """The record of one primitive application inside a lifted function."""

    rule: ClassVar[Rule]
    params: Params
    in_avals: tuple[Aval, ...]
    out_avals: tuple[Aval, ...]
    needs: tuple[bool, ...]
    ins: tuple[Array | None, ...]
    outs: tuple[Array | None, ...]
    extra: tuple[Array, ...] = ()
    in_shardings: tuple[Any, ...] = ()  # per input: its explicit sharding or None
    out_shardings: tuple[Any, ...] = ()

    def in_sharding(self, k: int = 0) -> Any:
        """Input ``k``'s sharding when it is over Explicit mesh axes, else None
        (see Note [Gradients keep their operand's sharding]: the gradient a rule
        returns for input ``k`` must have it)."""
        return self.in_shardings[k] if self.in_shardings else None

    def out_sharding(self, k: int = 0) -> Any:
        """Output ``k``'s explicit sharding (that of the gradient the rule gets), else None."""
        return self.out_shardings[k] if self.out_shardings else None

    def backward(self, g, needs):
        return self.rule.vjp(self, g)


@dataclasses.dataclass(frozen=True)
class Rule:
    """A primitive's backward rule and its record type."""

    name: str
    record: type[PrimitiveRecord]
    vjp: Callable[[PrimitiveRecord, Any], tuple]
    saves: Callable[[tuple[bool, ...], Params], tuple[tuple[int, ...], tuple[int, ...]]]
    forward: Callable | None = None
    multiple_results: bool = False
    primitive: Any = None  # the Primitive object the rule is for (None: any of that name)


RULES: dict[str, Rule] = {}

# libraries whose primitives rf ships rules for, loaded the first time a
# program holds one of their primitives: (module rf reads the library from,
# the primitives' names, the rf module declaring their rules)
LIBRARY_RULES: list[tuple[str, frozenset[str], str]] = [
    (
        "equinox",
        frozenset({"maybe_set", "select_if_vmap", "nondifferentiable_backward", "vprim"}),
        "rumus_fx.lift.rules_equinox",
    ),
    ("lineax", frozenset({"linear_solve"}), "rumus_fx.lift.rules_lineax"),
    ("kfac_jax", frozenset({"layer_tag", "loss_tag"}), "rumus_fx.lift.rules_kfac"),
    (  # jax's own, but importing it imports scipy.sparse: half a second on every import of rf
        "jax.experimental.sparse",
        frozenset({
            "bcoo_todense", "bcoo_extract", "bcoo_fromdense", "bcoo_transpose", "bcoo_dot_general",
            "bcoo_dot_general_sampled", "coo_todense", "coo_fromdense", "coo_matvec", "coo_matmat",
            "csr_todense", "csr_fromdense", "csr_matvec", "csr_matmat", "spsolve",
            "bcsr_todense", "bcsr_extract", "bcsr_fromdense", "bcsr_dot_general", "bcoo_sort_indices",
        }),
        "rumus_fx.lift.rules_sparse",
    ),
]  # fmt: skip


def load_library_rules() -> list[str]:
    """Declare now the rules of every library of ``LIBRARY_RULES`` that is
    installed (importing it); returns the libraries loaded. (Programs load them
    by themselves when they hold one of the primitives: this is for listings
    such as the primitive table.)"""
    loaded = []
    for lib, _, module in LIBRARY_RULES:
        if importlib.util.find_spec(lib) is not None:
            importlib.import_module(module)
            loaded.append(lib)
    return loaded


def rule_for(prim: Any) -> Rule | None:
    """The rule of primitive ``prim`` (a ``jax.extend.core.Primitive``), or None.

    A rule declared for a primitive object (``rf.defrule(equinox_p, ...)``)
    serves that object only, never another primitive of the same name. The
    rules of a library's primitives (``LIBRARY_RULES``) are declared the first
    time one of its primitives is met, when the library is loaded."""
    name = prim.name
    rule = RULES.get(name)
    if rule is None:
        for lib, names, module in LIBRARY_RULES:
            if name in names and lib in sys.modules:
                importlib.import_module(module)
                rule = RULES.get(name)
    if rule is not None and rule.primitive is not None and rule.primitive is not prim:
        return None
    return rule


# primitives whose outputs carry no gradient: comparisons, integer and bit
# arithmetic, random bits and keys, tokens, rounding (float outputs whose
# derivative is zero almost everywhere, as jax.grad has it) and stop_gradient.
# Any primitive with only integer/bool outputs passes through too. Never here: a
# primitive with a float output that can depend on a float input with a nonzero
# derivative (nextafter, rng_uniform, a float-to-float bitcast_convert_type):
# those have a rule or are refused (tests/lift/test_primitive_audit.py checks it).
NON_DIFFERENTIABLE: set[str] = {
    "stop_gradient", "floor", "ceil", "round", "sign", "is_finite",
    "eq", "ne", "lt", "le", "gt", "ge", "eq_to", "le_to", "lt_to", "and", "or", "not", "xor", "iota",
    "argmax", "argmin", "random_bits", "random_seed", "random_wrap", "random_unwrap",
    "random_fold_in", "random_split", "threefry2x32", "threefry4x32", "philox2x32", "philox4x32",
    "iota_2x32_shape", "rng_bit_generator", "mulhi",
    "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count", "clz",
    "reduce_and", "reduce_or", "reduce_xor", "lu_pivots_to_permutation",
    "debug_callback", "debug_print", "random_clone", "device_put_p_nondiff",
    "axis_index", "platform_index", "create_token", "after_all",
}  # fmt: skip


# rules whose formulas give jax.grad's values on complex operands (Note [Complex
# gradients] in rules_complex.py); a complex value reaching any other rule is refused
COMPLEX_OK: set[str] = set()


def is_complex(aval: Any) -> bool:
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
        return False
    return bool(jnp.issubdtype(aval.dtype, jnp.complexfloating))


def camel(name: str) -> str:
    """``reduce_sum`` -> ``ReduceSum``; ``scatter-add`` -> ``ScatterAdd``."""
    parts = name.replace("-", "_").split("_")
    return "".join(p[:1].upper() + p[1:] for p in parts if p)


def _saves_fixed(ins: tuple[int, ...], outs: tuple[int, ...]) -> Callable:
    return lambda needs, params: (ins, outs)


def _saves_of(saves: Callable) -> Callable:
    """``saves`` as a function of ``(needs, params)``."""
    if len(inspect.signature(saves).parameters) >= 2:
        return saves
    return lambda needs, params: saves(needs)


def defrule(
    name: str,
    vjp: Callable,
    saves: Callable | tuple[tuple[int, ...], tuple[int, ...]] = ((), ()),
    forward: Callable | None = None,
    multiple_results: bool = False,
    record_name: str | None = None,
    doc: str | None = None,
    table: tuple[TableEntry, ...] = (),
    errors: Callable[[], list[BadProgram]] | None = None,
    primitive: Any = None,
    module: str | None = None,
) -> Rule:
    """Declare the backward rule of primitive ``name`` (see Note [Primitive rules]);
    it joins the op registry (Note [Declaring an op] in ``autograd/registry.py``)
    as a ``"primitive"`` declaration, with ``table`` entries for the primitive
    table and ``errors``, the programs it must refuse (for the error audit)."""
    cls_name = record_name or f"{camel(name)}Backward"
    cls = type(cls_name, (PrimitiveRecord,), {"__doc__": doc or f"Backward record of the ``{name}`` primitive."})
    cls = frozen(cls)
    module = module or vjp.__module__
    cls.__module__ = module
    saves_fn = _saves_of(saves) if callable(saves) else _saves_fixed(*saves)
    rule = Rule(name, cls, vjp, saves_fn, forward, multiple_results, primitive)
    cls.rule = rule
    declare(
        OpDecl(
            name=name,
            kind="primitive",
            records=(cls,),
            errors=errors,
            module=module,
            extra={"rule": rule, "saves": saves_fn, "backward": vjp, "table": tuple(table)},
        )
    )
    RULES[name] = rule
    return rule


def add_table(name: str, *entries: TableEntry) -> None:
    """Attach more primitive-table entries to the rule of ``name``, declared
    earlier in the calling module (for rules declared by a helper or a loop)."""
    decl = lookup("primitive", name)
    decl.extra["table"] = decl.extra["table"] + entries


def saves_inputs(*ks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``saves`` value: these inputs, no outputs."""
    return (ks, ())


def saves_outputs(*ks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``saves`` value: these outputs, no inputs."""
    return ((), ks)


def is_float(aval: Any) -> bool:
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):  # PRNG keys
        return False
    return bool(jnp.issubdtype(aval.dtype, jnp.inexact))
