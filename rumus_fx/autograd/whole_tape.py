"""Eager backward as one compiled program per tape signature.

Note [Whole-tape backward]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Eagerly, the tape's walk runs each record's rule as its own compiled program
(``runner.run_rule``): one dispatch per record, and nothing fuses
across records, so layout-only records (reshape, transpose) and chains of
elementwise rules each materialise their gradients. A training loop records the
same tape every step, so here the whole walk is compiled once and replayed:

* The **signature** of a tape is, per entry, the record's pytree structure (its
  type and static fields: shapes, axes, dtypes, flags) and the entry's inputs
  and outputs renumbered by first appearance, plus the seeds and the kept ids
  (renumbered the same way). Equal signatures trace the same walk; array
  shapes and dtypes are left to ``jax.jit``'s own cache.
* The first time a signature is seen, the walk runs rule by rule as before
  (exact errors, version checks in walk order) and we note which entries were
  live (their output received a gradient) and which ids reached the
  ``foreign`` hook -- both are structural, fixed by the signature.
* The second time, the walk is traced once as one ``jax.jit`` program over all
  records' saved arrays and the seeds (the same engine loop, with each rule
  traced inline), and every later step with that signature is one call. The
  live records' version snapshots are checked before the call, and the noted
  foreign ids are handed to the hook after it, as the rule-by-rule walk does.
* Fusing is not always faster: XLA:CPU can fuse a cheap producer into several
  expensive consumers and recompute it in each (the CNN benchmark's backward ran
  1.5-2x slower as one program than rule by rule). So the walks are timed
  before one is kept: the second sighting walks rule by rule (its rules
  compiled by the first), timed; the third compiles the walk (not timed); from
  the fourth the compiled walk and the rule-by-rule walk take turns, timed,
  ``TIMED`` times each (``2 + 2 * TIMED`` sightings in all). Each timed walk
  first waits for the forward's pending work, which is not its own, and then
  for its results. Taking turns matters on a shared machine: timed in two runs
  of consecutive calls, a burst of load on one side decided the MLP
  benchmark's choice either way. A signature whose compiled walk (its fastest
  call) took more than ``KEEP_IF_FASTER`` times the rule-by-rule walk (its
  fastest) goes back to rule by rule for good.
* A tape of **one record** (a lifted loss: one ``LiftedBackward``) runs no race:
  its compiled walk is that record's own rule traced alone, the same program the
  rule-by-rule walk runs, called with less Python work (no record flattening, no
  per-record cache lookup). It is compiled at the second sighting and kept. Raced,
  the two walks' few timed calls of the same program were decided by noise: a
  closure benchmark's row that drew the rule-by-rule walk ran 11-12 % slower per
  call for the whole process (benchmarks/RESULTS.md, "Lifted functions that read
  values through their closure").

Tapes that need the rule-by-rule walk take it: anomaly mode (per-record finite
checks), explicit shardings (the reshard hook), records whose static fields do
not hash, and any traced value (under ``jax.jit``/``vmap`` the walk is traced
inline anyway). Nothing here calls JAX's autodiff.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax

from ..eager import PY_SCALARS, scalar_operand
from .record import _KEYS as record_keys
from .record import from_structure, structure_key
from .walk import walk

if TYPE_CHECKING:  # typing only: tape.py builds on the engine, which uses this module
    from .tape import TapeEntry

# signature -> _Seen (first sighting) or _Compiled; least recently used dropped first
_CACHE: collections.OrderedDict[Any, Any] = collections.OrderedDict()
CACHE_SIZE = 64
TIMED = 3  # timed walks of each kind before choosing
KEEP_IF_FASTER = 1.0  # keep the compiled walk when it took at most this fraction of the rule-by-rule time
_ENABLED = [True]


def set_enabled(flag: bool) -> bool:
    """Turn whole-tape compilation on or off (returns the previous setting);
    off, every eager backward runs rule by rule."""
    prev = _ENABLED[0]
    _ENABLED[0] = bool(flag)
    return prev


def clear_cache() -> None:
    _CACHE.clear()


class _Seen:
    """A signature seen once: which entries were live, which local ids went
    foreign, and how long the rule-by-rule walk took (seconds); ``rules``: the
    compiled walk lost, walk rule by rule from now on."""

    __slots__ = ("foreign", "key", "live", "rules", "seconds")

    def __init__(self, live: tuple[int, ...], foreign: tuple[int, ...], seconds: list[float], key: Any = None):
        self.live = live
        self.foreign = foreign
        self.seconds = seconds
        self.rules = False
        self.key = key  # the signature as the cache holds it (found again by identity, not compared)


class _Compiled(_Seen):
    """A signature seen three times or more: the walk as one jitted program
    per sharing pattern of its arguments (``fns``; Note [Shared arguments of
    the compiled walk]; ``timed``: its timed calls, taking turns with the
    rules' until the choice)."""

    __slots__ = ("fns", "make", "timed")

    def __init__(self, seen: _Seen, make: Callable[[tuple[int, ...]], Callable]):
        super().__init__(seen.live, seen.foreign, seen.seconds, seen.key)
        self.make = make  # sharing pattern -> its jitted walk
        self.fns: dict[tuple[int, ...], Callable] = {}
        self.timed: list[float] = []

    def fn(self, leaves_of: list[list[Any]], seed_values: list[Any]) -> dict[int, jax.Array]:
        """The compiled walk on these records' children and seeds."""
        pattern, unique, rest = _share(leaves_of)
        fns = self.fns
        fn = fns.get(pattern)
        if fn is None:
            if len(fns) >= MAX_PATTERNS:  # a pattern that keeps changing: every array its own argument
                pattern, unique, rest = _share(leaves_of, False)
                fn = fns.get(pattern)
            if fn is None:
                fn = fns[pattern] = self.make(pattern)
        return fn(unique, rest, seed_values)


# Note [Shared arguments of the compiled walk]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Each argument of a compiled call costs its dispatch about a microsecond, and
# records often save the same array: relu saves its input, the output tanh
# saved before it; every ``t * 1.01`` of a loop saves the one cached device
# array of ``1.01`` (``_share`` converts each saved python scalar once, as
# ``eager.scalar_operand``: jit would convert it afresh on every call). So the
# walk takes each distinct array once: the *pattern* says, for every child of
# every record in order, which distinct array it is (by identity) or which of
# the other children (None, tuples) it is; a saved zero or nan, which
# ``scalar_operand`` never caches, is an array of its own made for the call.
# A pattern is fixed for a training loop's steps (the same records save the
# same values), so each signature compiles one program per pattern seen, at
# most ``MAX_PATTERNS``; beyond, every array is its own argument (one more
# pattern, the same for any sharing and any scalars). The program reads the
# same values as before (a python scalar and its weakly typed array trace
# alike), so its results are unchanged.
MAX_PATTERNS = 4
_ARRAY_TYPES: set[type] = set()  # concrete jax array types met among the children
_NOT_ARRAY_TYPES: set[type] = {type(None), tuple, int, float, bool, complex}


def _share(leaves_of: list[list[Any]], share: bool = True) -> tuple[tuple[int, ...], list[Any], list[Any]]:
    """(pattern, distinct arrays, other children) of the records' children,
    a saved python scalar read as its cached device array (``scalar_operand``:
    the same weakly typed aval, so the same program): the pattern gives, per
    child in order, ``k >= 0`` for the ``k``-th distinct array and ``-1 - k``
    for the ``k``-th other child."""
    pattern: list[int] = []
    unique: list[Any] = []
    rest: list[Any] = []
    index: dict[int, int] = {}
    arrays, others = _ARRAY_TYPES, _NOT_ARRAY_TYPES
    converted: dict[tuple[type, Any], Any] = {}  # python scalar -> its operand, in this call
    for children in leaves_of:
        for c in children:
            t = type(c)
            if t in PY_SCALARS:
                if c and c == c:
                    a = converted.get((t, c))
                    if a is None:
                        a = converted[(t, c)] = scalar_operand(c)
                    c = a
                else:  # a zero or a nan (never cached): an array of its own, so the pattern does not change
                    c = _fresh_operand(c)
                t = type(c)
            if t in arrays or (t not in others and _is_array(c)):
                k = index.get(id(c)) if share else None
                if k is None:
                    k = len(unique)
                    unique.append(c)
                    if share:
                        index[id(c)] = k
                pattern.append(k)
            else:
                pattern.append(-1 - len(rest))
                rest.append(c)
    return tuple(pattern), unique, rest


def _fresh_operand(v: Any) -> Any:
    """A zero or a nan saved as a python scalar, as the weakly typed array jit
    would make of it (``jnp.asarray``, made afresh: ``scalar_operand`` caches
    neither, ``0.0 == -0.0`` and ``nan != nan``); ``v`` itself if it does not
    convert."""
    try:
        return jax.numpy.asarray(v)
    except (OverflowError, TypeError, ValueError):  # pragma: no cover - zeros and nans convert
        return v


def _is_array(c: Any) -> bool:
    """Whether a child is a concrete jax array (its type is remembered)."""
    t = type(c)
    if isinstance(c, jax.Array) and not isinstance(c, jax.core.Tracer):
        _ARRAY_TYPES.add(t)
        return True
    _NOT_ARRAY_TYPES.add(t)  # pragma: no cover - numpy arrays and other pytrees are children as they are
    return False


def _signature(
    entries: Sequence[TapeEntry], seeds: dict[int, Any], keep: set[int] | None
) -> tuple[Any, list[list[Any]], dict[int, int]] | None:
    """(hashable signature, each record's pytree children, global -> local
    ids); None when this tape must be walked rule by rule."""
    local: dict[int, int] = {}
    parts: list[Any] = []
    leaves_of: list[list[Any]] = []
    tracer = jax.core.Tracer
    number = local.setdefault  # an id's local number: the next one at its first appearance
    keys = record_keys  # record class -> its structure_key code (Note [Per-class record code])
    for e in entries:
        if e.input_shardings:
            return None
        op = e.op
        key_of = keys.get(type(op))
        found = structure_key(op) if key_of is None else key_of(op)
        if found is None:
            return None
        key, children = found
        leaves_of.append(children)
        inputs = e.inputs
        if len(inputs) == 1:  # the usual records: one or two inputs, one output
            i = inputs[0]
            ins: tuple = (None if i is None else number(i, len(local)),)
        elif len(inputs) == 2:
            i, j = inputs
            i = None if i is None else number(i, len(local))
            ins = (i, None if j is None else number(j, len(local)))
        else:
            ins = tuple([None if i is None else number(i, len(local)) for i in inputs])
        outputs = e.outputs
        if len(outputs) == 1:
            outs: tuple = (number(outputs[0], len(local)),)
        else:
            outs = tuple([number(o, len(local)) for o in outputs])
        parts.append((key, ins, outs, e.input_avals))
    seed_ids = [number(s, len(local)) for s in seeds]
    for v in seeds.values():
        if isinstance(v, tracer):
            return None
    keep_ids = None if keep is None else tuple(sorted(local[k] for k in keep if k in local))
    try:
        sig = _Key((tuple(parts), tuple(seed_ids), keep_ids))
    except TypeError:  # a record with an unhashable static field
        return None
    return sig, leaves_of, local


class _Key(tuple):
    """A signature that hashes once (a cache lookup and its insertion would
    each hash the whole tape's worth of parts again)."""

    __slots__ = ()

    def __new__(cls, sig: tuple) -> _Key:
        return tuple.__new__(cls, (hash(sig), sig))

    def __hash__(self) -> int:
        return self[0]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key) and self[0] == other[0] and self[1] == other[1]


def run(
    entries: Sequence[TapeEntry],
    seeds: dict[int, jax.Array],
    keep: set[int] | None,
    foreign: Callable[[int], None] | None,
) -> dict[int, jax.Array]:
    """``walk(entries, seeds, keep, foreign)`` -- the tape's reverse walk --
    run as one cached compiled program when this tape's signature repeats
    (Note [Whole-tape backward])."""
    found = _signature(entries, seeds, keep) if _ENABLED[0] and entries else None
    if found is None:
        return walk(entries, seeds, keep, foreign)
    sig, leaves_of, local = found
    hit = _CACHE.get(sig)
    if hit is None:
        return _first_sighting(sig, entries, seeds, keep, foreign, local)
    _CACHE.move_to_end(sig if hit.key is None else hit.key)
    if hit.rules:
        return walk(entries, seeds, keep, foreign)

    def rules_walk() -> dict[int, jax.Array]:
        return walk(entries, seeds, keep, foreign)

    race = len(entries) > 1  # one record: its own program either way, no race
    if race and not isinstance(hit, _Compiled) and not hit.seconds:  # second sighting: time the rules
        return _timed(rules_walk, leaves_of, seeds, hit.seconds)
    if race and isinstance(hit, _Compiled) and len(hit.timed) == len(hit.seconds) < TIMED:
        # alternating with the compiled walk's timed calls, so both see the same machine
        return _timed(rules_walk, leaves_of, seeds, hit.seconds)
    for i in hit.live:
        entries[i].op.check_versions()
    if not isinstance(hit, _Compiled):  # third sighting (one record: second): compile the walk (not timed)
        hit = _CACHE[sig] = _compile(sig, hit, type(entries[0]), _options(entries))
        out = hit.fn(leaves_of, list(seeds.values()))
    elif race and len(hit.timed) < TIMED:
        out = _timed(lambda: hit.fn(leaves_of, list(seeds.values())), leaves_of, seeds, hit.timed)
        if len(hit.timed) == TIMED:
            hit.rules = min(hit.timed) > KEEP_IF_FASTER * min(hit.seconds)
    else:
        out = hit.fn(leaves_of, list(seeds.values()))
    back = {v: k for k, v in local.items()}
    if foreign is not None:
        for lid in hit.foreign:
            foreign(back[lid])
    return {back[lid]: g for lid, g in out.items()}


def _timed(
    run_walk: Callable[[], dict[int, jax.Array]], leaves_of, seeds, seconds: list[float]
) -> dict[int, jax.Array]:
    """``run_walk()`` (either walk), its time appended to ``seconds``: first
    waits for the forward's pending work (on the saved arrays and seeds), which
    is not the walk's, then for the walk's results."""
    jax.block_until_ready((leaves_of, seeds))
    t0 = time.perf_counter()
    grads = jax.block_until_ready(run_walk())
    seconds.append(time.perf_counter() - t0)
    return grads


def _first_sighting(sig, entries, seeds, keep, foreign, local) -> dict[int, jax.Array]:
    """Walk rule by rule, noting the live entries and the foreign ids."""
    live: list[int] = []
    went_foreign: list[int] = []

    def note_foreign(gid: int) -> None:
        went_foreign.append(local[gid])
        if foreign is not None:
            foreign(gid)

    grads = walk(entries, seeds, keep, note_foreign, live=live)
    _CACHE[sig] = _Seen(tuple(live), tuple(went_foreign), [], sig)
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)
    return grads


def _options(entries: Sequence[TapeEntry]) -> Any:
    """The XLA options the records ask for their programs (Note [Eager compiler
    options] in rumus_fx/eager.py), when they agree; None otherwise. A static
    field decides a record's options, so they are fixed by the signature."""
    found = None
    for e in entries:
        opts = e.op.compiler_options
        if opts is not None:
            if found is not None and opts != found:
                return None
            found = opts
    return found


def _compile(sig: Any, seen: _Seen, entry_type: type, options: Any = None) -> _Compiled:
    parts, seed_ids, keep_ids = sig[1]
    keep = None if keep_ids is None else set(keep_ids)

    counts = [len(key[2]) for key, _, _, _ in parts]  # children per record (their kinds)

    def program(
        pattern: tuple[int, ...], unique: list[Any], rest: list[Any], seed_values: list[jax.Array]
    ) -> dict[int, jax.Array]:
        it = iter(pattern)
        traced = []
        for n, (key, ins, outs, avals) in zip(counts, parts):
            children = []
            for _ in range(n):
                k = next(it)
                children.append(unique[k] if k >= 0 else rest[-1 - k])
            traced.append(entry_type(from_structure(key, children), ins, outs, avals))
        return walk(traced, dict(zip(seed_ids, seed_values)), keep, None)

    opts = None if options is None else dict(options)

    def make(pattern: tuple[int, ...]) -> Callable:
        return jax.jit(functools.partial(program, pattern), compiler_options=opts)

    return _Compiled(seen, make)
