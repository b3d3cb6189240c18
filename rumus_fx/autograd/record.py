"""Backward records: the base class, version snapshots, and saved-data accounting.

Every differentiable op appends one record to the tape. A record is a frozen
dataclass named ``<Op>Backward`` that holds only what its backward rule reads:
static metadata (shapes, axes, dtypes), the immutable arrays it needs, and one
``VersionSnapshot`` per storage whose *current* contents it would read. No
closures: ``dataclasses.fields(record)`` shows everything it keeps.

Note [Record fields]
~~~~~~~~~~~~~~~~~~~~
Each field is one of three kinds, read from the field itself, never from the
text of its annotation:

* ``saved``: data backward reads (arrays, python scalars such as the ``lr`` of
  ``w * lr``, tuples of arrays, None). Pytree children, counted by
  ``saved_bytes``.
* ``snapshot``: a ``VersionSnapshot`` (or a tuple of them), checked before the
  rule runs; dropped when the record is flattened.
* ``static``: metadata (shapes, axes, dtypes, flags): pytree aux data.

A field says its kind explicitly with ``saved()``, ``snapshot()`` or
``static()`` (dataclass field metadata); otherwise its *resolved* type decides:
a type that contains ``jax.Array`` is saved, one that contains
``VersionSnapshot`` is a snapshot, anything else is static. As a last line of
defence, a static field that holds an array at run time (say one annotated
``Any``) is treated as saved data for that record, so it is never baked into
a compiled rule as a constant nor missing from ``saved_bytes``.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import numpy as np

from ..errors import VersionMismatch
from ..storage import StorageHandle, WeakStorageHandle, nbytes_of


class Aval(NamedTuple):
    """Shape and dtype of an operand: what a gradient must be cast back to."""

    shape: tuple[int, ...]
    dtype: np.dtype


@dataclasses.dataclass(frozen=True, eq=False)
class VersionSnapshot:
    """The version of a storage at record time.

    ``check()`` raises ``VersionMismatch`` when the storage was written since.
    It holds a weak handle, so recording never keeps a storage alive; the
    version cell inside the weak handle survives the storage, so a storage
    written and then dropped is still caught (see ``storage.py``).
    """

    grad_id: int | None
    weak_storage: WeakStorageHandle
    recorded_version: int

    @classmethod
    def of(cls, grad_id: int | None, storage: StorageHandle) -> VersionSnapshot:
        """``cls(grad_id, storage.downgrade(), storage's version)``, filling the
        frozen instance's ``__dict__`` directly (one per recorded read; Note
        [Eager fast path] in rumus_fx/ops/_core.py)."""
        snap = _new_object(cls)
        d = snap.__dict__
        d["grad_id"] = grad_id
        d["weak_storage"] = storage.downgrade()
        d["recorded_version"] = storage._cell.value
        return snap

    def check(self, op: str | None = None) -> None:
        found = self.weak_storage._cell.value  # ``.version``, read directly (once per read, every backward)
        if found != self.recorded_version:
            raise VersionMismatch(self.grad_id, self.recorded_version, found, op)


assert tuple(f.name for f in dataclasses.fields(VersionSnapshot)) == ("grad_id", "weak_storage", "recorded_version")
_new_object = object.__new__
_RECORD_TYPES: list[type[Record]] = []

_KIND = "rumus_fx_kind"  # the dataclass field-metadata key naming a field's kind
SAVED, SNAPSHOT, STATIC = "saved", "snapshot", "static"


def saved(**kwargs: Any) -> Any:
    """A record field holding data backward reads (``dataclasses.field`` kwargs
    such as ``default=`` pass through)."""
    return dataclasses.field(metadata={_KIND: SAVED}, **kwargs)


def snapshot(**kwargs: Any) -> Any:
    """A record field holding a ``VersionSnapshot`` (or a tuple of them)."""
    return dataclasses.field(metadata={_KIND: SNAPSHOT}, **kwargs)


def static(**kwargs: Any) -> Any:
    """A record field holding static metadata (hashable: shapes, dtypes, flags)."""
    return dataclasses.field(metadata={_KIND: STATIC}, **kwargs)


def _mentions(tp: Any, target: type) -> bool:
    """Whether the resolved type ``tp`` is, or is built from, ``target``
    (``Array | None``, ``tuple[Array, ...]``, ``Optional[VersionSnapshot]`` ...)."""
    if tp is target:
        return True
    if isinstance(tp, type):
        try:
            return issubclass(tp, target)
        except TypeError:  # pragma: no cover - exotic metaclasses
            return False
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _mentions(typing.get_args(tp)[0], target)
    if origin is not None or isinstance(tp, types.UnionType):
        return any(_mentions(a, target) for a in typing.get_args(tp) if a is not Ellipsis)
    return False


def _field_kinds(cls: type) -> dict[str, str]:
    """The kind of every field of the record class ``cls`` (see Note [Record fields])."""
    try:  # each class of the MRO resolves its annotations in its own module
        hints = typing.get_type_hints(cls, include_extras=True)
    except Exception as err:  # an annotation that cannot be resolved
        hints = None
        hint_error = err
    kinds = {}
    for f in dataclasses.fields(cls):
        kind = f.metadata.get(_KIND)
        if kind is None:
            if hints is None:
                raise TypeError(
                    f"{cls.__name__}: cannot resolve the annotation of field {f.name!r} ({hint_error}); "
                    "declare its kind with rumus_fx.autograd.record.saved() / snapshot() / static()"
                )
            tp = hints.get(f.name, Any)
            if _mentions(tp, VersionSnapshot):
                kind = SNAPSHOT
            elif _mentions(tp, jax.Array):
                kind = SAVED
            else:
                kind = STATIC
        elif kind not in (SAVED, SNAPSHOT, STATIC):
            raise TypeError(f"{cls.__name__}.{f.name}: unknown field kind {kind!r}")
        kinds[f.name] = kind
    return kinds


_PLAIN = frozenset({int, float, bool, str, type(None), np.dtype})


# types whose values are never arrays (extended as they are met: for anything
# but a tracer, which ``isinstance(v, jax.Array)`` also answers per value, being
# an array is a property of the type); tuples and lists are looked into instead
_NEVER_ARRAY: set[type] = set(_PLAIN) | {Aval}  # an Aval: a shape of ints and a dtype


def metadata_type(tp: type) -> type:
    """Declare that values of ``tp`` (a NamedTuple of shapes, dtypes and axes,
    such as ``Aval``) never hold an array, so a static record field holding
    one is aux data without looking inside (Note [Record fields])."""
    _NEVER_ARRAY.add(tp)
    return tp


def _holds_array(value: Any) -> bool:
    """An array (jax, numpy or a tracer), or a tuple/list holding one."""
    tp = type(value)
    if tp in _NEVER_ARRAY:
        return False
    if isinstance(value, (tuple, list)):
        for v in value:
            if type(v) not in _NEVER_ARRAY and _holds_array(v):
                return True
        return False
    if isinstance(value, (jax.Array, np.ndarray, jax.core.Tracer)):
        return True
    _NEVER_ARRAY.add(tp)
    return False


@dataclasses.dataclass(frozen=True, eq=False)
class Record:
    """Base of all backward records.

    Subclasses implement ``backward(grad_out, needs)``: given the gradient of the
    op's output and, per input, whether it needs a gradient, return one gradient
    (or ``None`` for "no gradient") per input, each of the input's shape and dtype.
    """

    # records of ops with several outputs get a tuple of gradients (None where
    # an output got none) instead of one gradient
    multi_output: ClassVar[bool] = False
    # saved fields computed in the forward pass rather than inputs/outputs of the
    # op: ``backward(create_graph=True)`` rebuilds them with ``derive(entry)``,
    # or raises where a record defines none (Note [Create graph])
    derived_fields: ClassVar[tuple[str, ...]] = ()
    # inputs ``derive`` reads as tracers of the walk although the record does not
    # save them (their gradients depend only on the saved values)
    derive_inputs: ClassVar[tuple[int, ...]] = ()
    # XLA options for the program that runs this record's rule eagerly on its
    # own (and for a whole-tape walk holding it): Note [Eager compiler options]
    # in rumus_fx/eager.py. A record may make it a property of its fields.
    compiler_options: ClassVar[Mapping[str, str] | None] = None
    # a lifted program's row: the equation it runs, set per instance by
    # ``lift.program.Program.records`` (the rules of control flow and custom_jvp
    # read their sub-programs there). It is not pytree data, so such a record
    # runs inline, never as a compiled call of its flattened fields
    # (``runner._run``).
    _step: ClassVar[Any] = None
    # a record whose static data owns the compiled call of its eager backward (a
    # lifted program: Note [A program's compiled calls] in rumus_fx/lift/program.py)
    # runs it with ``compiled_backward`` instead of the runner's shared call
    owns_compiled_backward: ClassVar[bool] = False
    _snapshot_fields: ClassVar[tuple[str, ...] | None] = None
    _array_fields: ClassVar[tuple[str, ...] | None] = None
    _static_fields: ClassVar[tuple[str, ...] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__name__.endswith("Backward"):
            _RECORD_TYPES.append(cls)
        # every record class, whatever its name, is a pytree (saved data as
        # children, metadata as static aux data) so that eager backward can run
        # each rule as one cached, compiled jax.jit call (see runner.run_rule)
        jax.tree_util.register_pytree_node(cls, _flatten_record, functools.partial(_unflatten_record, cls))

    @property
    def name(self) -> str:
        return type(self).__name__

    def backward(self, grad_out: jax.Array, needs: tuple[bool, ...]) -> tuple[jax.Array | None, ...]:
        raise NotImplementedError(f"{self.name}.backward")

    def compiled_backward(
        self, grad_out: Any, needs: tuple[bool, ...], options: Mapping[str, str] | None
    ) -> tuple[jax.Array | None, ...]:
        raise NotImplementedError(f"{self.name}.compiled_backward")

    @classmethod
    def _classify_fields(cls) -> None:
        kinds = _field_kinds(cls)
        cls._snapshot_fields = tuple(n for n, k in kinds.items() if k == SNAPSHOT)
        cls._array_fields = tuple(n for n, k in kinds.items() if k == SAVED)
        cls._static_fields = tuple(n for n, k in kinds.items() if k == STATIC)

    @classmethod
    def field_kinds(cls) -> dict[str, str]:
        """``{field name: "saved" | "snapshot" | "static"}`` (Note [Record fields])."""
        return _field_kinds(cls)

    def snapshots(self) -> tuple[VersionSnapshot, ...]:
        """Every version snapshot this record holds."""
        cls = type(self)
        if cls.__dict__.get("_snapshot_fields") is None:
            cls._classify_fields()
        out: list[VersionSnapshot] = []
        for name in cls._snapshot_fields:
            value = getattr(self, name)
            if isinstance(value, VersionSnapshot):
                out.append(value)
            elif isinstance(value, tuple):
                out.extend(v for v in value if isinstance(v, VersionSnapshot))
        return tuple(out)

    def check_versions(self) -> None:
        """``VersionMismatch`` when a storage this record reads was written
        since (each snapshot in field order, as ``snapshots()``)."""
        cls = type(self)
        fn = _CHECKS.get(cls)
        if fn is None:
            fn = _CHECKS[cls] = _compile_check(cls)
        fn(self)

    def _check_versions_generic(self) -> None:
        """``check_versions`` field by field (what ``_compile_check`` emits)."""
        cls = type(self)
        if cls.__dict__.get("_snapshot_fields") is None:
            cls._classify_fields()
        for name in cls._snapshot_fields:
            value = getattr(self, name)
            if isinstance(value, VersionSnapshot):
                value.check(self.name)
            elif isinstance(value, tuple):
                for v in value:
                    if isinstance(v, VersionSnapshot):
                        v.check(self.name)

    def saved_arrays(self) -> dict[str, Any]:
        """The arrays this record keeps for backward, by field name."""
        cls = type(self)
        if cls.__dict__.get("_array_fields") is None:
            cls._classify_fields()
        out = {}
        for name in cls._array_fields:
            value = getattr(self, name)
            if value is not None and not isinstance(value, (int, float, bool)):
                out[name] = value
        for name in cls._static_fields:  # undeclared arrays (Note [Record fields])
            value = getattr(self, name)
            if _holds_array(value):
                out[name] = value
        return out

    @property
    def saved_bytes(self) -> int:
        """Bytes of array data this record keeps alive for backward."""
        total = 0
        for value in self.saved_arrays().values():
            if isinstance(value, tuple):
                total += sum(nbytes_of(v) for v in value)
            else:
                total += nbytes_of(value)
        return total


_CHILD = object()  # marks a field stored among the pytree children


def _flatten_plan(cls: type) -> tuple[tuple[str, str], ...]:
    """(field name, kind) of every field of the record class, in order (cached per class)."""
    plan = cls.__dict__.get("_flatten_plan_cache")
    if plan is None:
        if cls.__dict__.get("_array_fields") is None:
            cls._classify_fields()
        kinds = {**dict.fromkeys(cls._static_fields, STATIC), **dict.fromkeys(cls._snapshot_fields, SNAPSHOT)}
        kinds.update(dict.fromkeys(cls._array_fields, SAVED))
        plan = tuple((f.name, kinds[f.name]) for f in dataclasses.fields(cls))
        cls._flatten_plan_cache = plan
    return plan


def _flatten_record(rec: Record) -> tuple[list[Any], tuple]:
    """Saved fields (whatever they hold: arrays, python scalars such as the
    ``lr`` of ``w * lr``, None) are children, so a new value never recompiles;
    version snapshots are dropped (checked before the rule runs); static fields
    are aux data, unless one holds an array (Note [Record fields])."""
    children: list[Any] = []
    aux: list[Any] = []
    for name, kind in _flatten_plan(type(rec)):
        if kind is SAVED:
            children.append(getattr(rec, name))
            aux.append(_CHILD)
        elif kind is SNAPSHOT:
            aux.append(None)
        else:
            value = getattr(rec, name)
            if _holds_array(value):
                children.append(value)
                aux.append(_CHILD)
            else:
                aux.append(value)
    return children, tuple(aux)


_LEAF = 0  # structure_key of an array or python scalar child


def _child_key(c: Any) -> Any:
    """The pytree structure of a record's child, cheaply for the usual ones (an
    array: ``_LEAF``, None, tuples of those); ``_TRACED`` for a traced value."""
    if c is None:
        return None
    if type(c) is tuple:
        return tuple(_child_key(v) for v in c)
    if isinstance(c, jax.core.Tracer):
        return _TRACED
    if type(c) in _LEAF_TYPES:
        return _LEAF
    if isinstance(c, jax.Array) or type(c) in (float, int, bool, complex):
        _LEAF_TYPES.add(type(c))
        return _LEAF
    leaves, treedef = jax.tree_util.tree_flatten(c)
    if any(isinstance(v, jax.core.Tracer) for v in leaves):
        return _TRACED
    return treedef


_TRACED = object()
_LEAF_TYPES: set[type] = set()


# Note [Per-class record code]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``check_versions`` and ``structure_key`` run once per record of every eager
# backward (the version checks before the rules, the whole-tape signature), so
# each record class gets both as straight-line code of its own, emitted from
# its fields on first use (``_compile_check``, ``_compile_key``): one attribute
# read per field in field order and the same tests, in the same order, as the
# generic loops (``Record._check_versions_generic``, ``_structure_key_generic``)
# run, so their results and errors are those of the loops (tests/test_record_codegen.py).
# A class's code is kept by the class itself (a subclass gets its own).
_CHECKS: dict[type, Any] = {}
_KEYS: dict[type, Any] = {}


def _valid_names(cls: type) -> bool:
    return all(f.name.isidentifier() and not f.name.startswith("__") for f in dataclasses.fields(cls))


def _compile_check(cls: type) -> Any:
    """``cls``'s ``check_versions`` as straight-line code (Note [Per-class record code])."""
    if cls.__dict__.get("_snapshot_fields") is None:
        cls._classify_fields()
    if not _valid_names(cls):  # pragma: no cover - dataclass fields are identifiers
        return Record._check_versions_generic
    lines = ["def check(self):"]
    for name in cls._snapshot_fields:
        lines += [
            f"    v = self.{name}",
            "    if type(v) is VS:",
            "        if v.weak_storage._cell.value != v.recorded_version:",
            "            v.check(self.name)",
            "    elif v is None:",
            "        pass",
            "    elif isinstance(v, VS):",
            "        v.check(self.name)",
            "    elif isinstance(v, tuple):",
            "        for x in v:",
            "            if isinstance(x, VS):",
            "                x.check(self.name)",
        ]
    lines.append("    return None")
    scope: dict[str, Any] = {"VS": VersionSnapshot}
    exec("\n".join(lines), scope)
    return scope["check"]


def _compile_key(cls: type) -> Any:
    """``structure_key`` for records of exactly ``cls``, as straight-line code
    (Note [Per-class record code])."""
    plan = cls.__dict__.get("_flatten_plan_cache") or _flatten_plan(cls)
    if not _valid_names(cls):  # pragma: no cover - dataclass fields are identifiers
        return _structure_key_generic
    lines = ["def key(rec):", "    children = []", "    kinds = []"]
    child = [
        "        children.append(v)",
        "        if type(v) in LEAF_TYPES:",
        "            kinds.append(LEAF)",
        "        else:",
        "            k = child_key(v)",
        "            if k is TRACED or (type(k) is tuple and traced_in(k)):",
        "                return None",
        "            kinds.append(k)",
    ]
    aux = []
    for i, (name, kind) in enumerate(plan):
        if kind is SNAPSHOT:
            aux.append("None")
            continue
        lines.append(f"    v = rec.{name}")
        if kind is SAVED:
            lines.append("    if True:")
            lines += child
            aux.append("CHILD")
        else:
            lines.append("    if type(v) in NEVER or not holds_array(v):")
            lines.append(f"        a{i} = v")
            lines.append("    else:")
            lines.append(f"        a{i} = CHILD")
            lines += child
            aux.append(f"a{i}")
    lines.append(f"    return (CLS, ({', '.join(aux)}{',' if len(aux) == 1 else ''}), tuple(kinds)), children")
    scope: dict[str, Any] = {
        "CLS": cls,
        "CHILD": _CHILD,
        "LEAF": _LEAF,
        "LEAF_TYPES": _LEAF_TYPES,
        "NEVER": _NEVER_ARRAY,
        "TRACED": _TRACED,
        "child_key": _child_key,
        "holds_array": _holds_array,
        "traced_in": _traced_in,
    }
    exec("\n".join(lines), scope)
    return scope["key"]


def structure_key(rec: Record) -> tuple[Any, list[Any]] | None:
    """``(key, children)`` of a record (``_structure_key_generic``), by the
    record class's own code (Note [Per-class record code])."""
    cls = type(rec)
    fn = _KEYS.get(cls)
    if fn is None:
        fn = _KEYS[cls] = _compile_key(cls)
    return fn(rec)


def _structure_key_generic(rec: Record) -> tuple[Any, list[Any]] | None:
    """``(key, children)`` of a record: ``children`` its pytree children
    (``_flatten_record``) and ``key`` as much as its treedef says -- the record
    type, the static aux data and the structure of each child -- so that equal
    keys mean equal treedefs; None when a child is traced. What the whole-tape
    signature is built of (autograd/whole_tape.py), rebuilt by
    ``from_structure``. One pass over the fields, as ``_flatten_record`` walks
    them (once per entry of every repeated tape)."""
    cls = type(rec)
    plan = cls.__dict__.get("_flatten_plan_cache") or _flatten_plan(cls)
    children: list[Any] = []
    aux: list[Any] = []
    kinds: list[Any] = []
    for name, kind in plan:
        if kind is SNAPSHOT:
            aux.append(None)
            continue
        value = getattr(rec, name)
        if kind is not SAVED and not _holds_array(value):  # static metadata
            aux.append(value)
            continue
        children.append(value)
        aux.append(_CHILD)
        if type(value) in _LEAF_TYPES:  # an array: the usual child
            kinds.append(_LEAF)
            continue
        k = _child_key(value)
        if k is _TRACED or (type(k) is tuple and _traced_in(k)):
            return None
        kinds.append(k)
    return (cls, tuple(aux), tuple(kinds)), children


def _traced_in(key: tuple) -> bool:
    return any(k is _TRACED or (type(k) is tuple and _traced_in(k)) for k in key)


def from_structure(key: Any, children: list[Any]) -> Record:
    """The record of ``structure_key``'s ``key`` with these children."""
    return _unflatten_record(key[0], key[1], children)


def _unflatten_record(cls: type, aux: tuple, children: list[Any]) -> Record:
    rec = object.__new__(cls)
    it = iter(children)
    for (name, _), a in zip(_flatten_plan(cls), aux):
        object.__setattr__(rec, name, next(it) if a is _CHILD else a)
    return rec


def provenance_of(rec: Record, known: dict[int, int | None]) -> tuple[tuple[str, int | None, int | None], ...]:
    """Where the saved data of ``rec`` came from (Note [Create graph] in
    rumus_fx/lift/higher.py): one ``(field, index in a tuple field or None,
    grad id)`` per saved array that *is* (by identity) the value of one of the
    op's inputs or outputs, given as ``known = {id(value): grad id or None}``
    (None: an untracked input, a constant). Saved arrays not listed were
    computed in the forward pass (derived residuals)."""
    cls = type(rec)
    if cls.__dict__.get("_array_fields") is None:
        cls._classify_fields()
    out: list[tuple[str, int | None, int | None]] = []
    for name in cls._array_fields:
        value = getattr(rec, name)
        if isinstance(value, tuple):
            for k, v in enumerate(value):
                if id(v) in known:
                    out.append((name, k, known[id(v)]))
        elif value is not None and id(value) in known:
            out.append((name, None, known[id(value)]))
    return tuple(out)


class Provenance(Sequence):
    """``provenance_of(rec, known)`` computed on first use: ``record()`` (in
    rumus_fx/ops/_core.py) keeps only the ``(id(value), grad id)`` pairs of the
    op's inputs and output, flat, since only ``backward(create_graph=True)``
    reads a provenance (Note [Eager fast path] in rumus_fx/ops/_core.py).

    Computing it later gives the same answer: the record (built before
    ``record()`` ran) keeps its saved arrays alive, so an id among the pairs --
    taken while those values were alive too -- matches a saved array exactly
    when that array *is* the value it was taken of."""

    __slots__ = ("_done", "_pairs", "_rec")

    def __init__(self, rec: Record, pairs: tuple[Any, ...]):
        self._rec: Record | None = rec
        self._pairs = pairs
        self._done: tuple[tuple[str, int | None, int | None], ...] | None = None

    def _items(self) -> tuple[tuple[str, int | None, int | None], ...]:
        done = self._done
        if done is None:
            known: dict[int, int | None] = {}
            pairs = self._pairs
            for k in range(0, len(pairs), 2):
                known.setdefault(pairs[k], pairs[k + 1])
            assert self._rec is not None
            done = self._done = provenance_of(self._rec, known)
            self._rec = None
            self._pairs = ()
        return done

    def __getitem__(self, i: Any) -> Any:
        return self._items()[i]

    def __len__(self) -> int:
        return len(self._items())

    def __iter__(self) -> Iterator[tuple[str, int | None, int | None]]:
        return iter(self._items())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Provenance):
            other = other._items()
        return self._items() == other

    def __hash__(self) -> int:
        return hash(self._items())

    def __repr__(self) -> str:
        return repr(self._items())


def exact_value(saved: Any, recomputed: Any) -> Any:
    """``saved`` in value, with the derivatives of ``recomputed`` (which equals
    it up to rounding): ``saved + (r - stop_gradient(r))``. How a record rebuilds
    a value its forward computed as a function of its substituted inputs
    (``derive``, Note [Create graph] in rumus_fx/lift/higher.py)."""
    if saved is None or not np.issubdtype(np.dtype(saved.dtype), np.inexact):
        return saved
    r = recomputed.astype(saved.dtype)
    return saved + (r - jax.lax.stop_gradient(r))


def record_types() -> tuple[type[Record], ...]:
    """All record classes defined so far (imported op modules)."""
    return tuple(_RECORD_TYPES)
