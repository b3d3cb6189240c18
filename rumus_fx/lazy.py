"""Deferred elementwise ops: a run of small eager ops as one compiled call.

Note [Deferred elementwise ops]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Eagerly, each op is one dispatch of its own compiled program (Note [Eager
compilation] in eager.py). For a tiny array that dispatch is most of the op's
cost: about 7 µs of JAX's C++ path, and the Python around it runs about twice
as slowly as it does between no dispatches at all (RESULTS.md, "The chain").
So the cheapest elementwise ops -- ``t <op> python scalar`` for add, sub, mul
and div, and relu, tanh, sigmoid, exp, log, neg -- do not dispatch: on a floating, strongly
typed, single-device, contiguous operand their result is a ``Lazy`` node (the
op, its operand, the scalar; shape and dtype known), recorded on the tape like
any result. Anything that reads a value (``Tensor.value`` of any tensor, a
storage read or write, the backward, the tape's inspection) first *flushes*:
every pending node is computed, in creation order, as

- one dispatch per node of the op's own compiled program (exactly what the op
  did before), the first time a run of nodes of this structure is seen, or
- one compiled program for the whole run, once the same structure (ops,
  which node feeds which, which results are still referenced, which nodes
  share a scalar: Note [Scalars of a run]) is seen again.
  It returns only the nodes something still references (``sys.getrefcount``,
  minus the references the run itself holds): XLA fuses the rest away. A node
  judged unreferenced that is read after all is recomputed from its operand.

The values are those of the per-op path: the fused program applies the same
jnp functions to the same operands, scalars included (passed as the same
weakly typed arguments, ``eager.scalar_operand``); on XLA:CPU the two agree
bit for bit (tests/test_lazy.py), as jit and eager do for these ops.

What the semantics need, kept:

- shape and dtype are known without computing (a python scalar with a float
  array keeps the array's dtype), so shape errors and records are as before;
- records that save a node (tanh's output, relu's input) hold the node until
  the flush, which replaces it by its array in the record (``Queue.saved``); every
  flush does, and at most ``MAX_PENDING`` nodes wait, so nothing accumulates;
- a tensor's version counter, snapshots and in-place writes see one storage,
  as before (a write flushes first);
- the context: a run is computed under the default device, abstract mesh and
  x64 mode its nodes were created under (a node made under another one flushes
  the run first): placement, and the dtype a python scalar converts to, are the
  op's; with ``jax_debug_nans``/``jax_debug_infs`` on, nothing defers, so the
  check runs at the op;
- reading any tensor's value flushes, so a value read before an array is
  donated or handed elsewhere finds nothing pending; a pending node keeps its
  operand alive until then;
- nothing defers under a trace (``jax.jit``, ``vmap``, ``rf.lift``): a tracer
  is never an operand here.

Note [Deferred ops and threads]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each thread has its own pending run (a ``Queue``: nodes, context, the records
that saved them): one thread's flush never computes, or clears, nodes another
thread is still building, and each thread's runs -- hence its values, records
and gradients -- are exactly those of the same code run alone. A node knows
its queue, so a value read in another thread (a Tensor handed over) flushes
the run it belongs to, under that queue's lock, which every flush and every
recomputation of an unreferenced node hold; appending a node does not (a
flush takes a prefix of the queue with atomic list operations, so a node
appended meanwhile waits for the next flush).
A node made on another thread's pending node computes that node first, so a
run never reads another queue's nodes and no two locks are ever held at once.
A backward and a tape's inspection flush this thread's queue, and another
thread's only when it holds records of that tape (``flush_for``): a thread's
runs are cut where its own reads cut them, and a run structure compiles on
the thread's own second sighting, so its values are bit for bit those of
the same code run alone.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .eager import compiled, scalar_operand, scalar_operands

_Tracer = jax.core.Tracer
_SingleDevice = jax.sharding.SingleDeviceSharding
_abstract_mesh = jax.sharding.get_abstract_mesh
_config = jax.config
_FLOATS = frozenset(np.dtype(d) for d in ("float16", "bfloat16", "float32", "float64"))

MAX_PENDING = 256  # nodes waiting at most; the next one flushes them
_MAX_PROGRAMS = 512  # run structures remembered (beyond: one dispatch per node)
_COMPILE_AT = 2  # sightings of a structure before its run is one program


class Kind:
    """One deferrable op: ``fun(x)`` or ``fun(x, scalar)`` (a jnp function)."""

    __slots__ = ("binary", "fun", "jitted", "name")

    def __init__(self, name: str, fun: Callable[..., Any], binary: bool = False):
        self.name = name
        self.fun = fun
        self.binary = binary
        self.jitted = compiled(fun)  # the op's own eager program (eager.compiled's cache)

    def __repr__(self) -> str:
        return f"Kind({self.name})"


class Lazy:
    """A deferred op result: shape and dtype now, the array at the next flush."""

    # pos: >= 0 while pending, then its position in the run being computed
    # (valid with that run's token in ``run``); -1 once its run is done;
    # queue: the thread's queue it was made in
    __slots__ = ("array", "consumers", "dtype", "kind", "pos", "queue", "run", "scalar", "shape", "src")
    weak_type = False

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __repr__(self) -> str:
        state = "pending" if self.array is None else "computed"
        return f"Lazy({self.kind.name}, shape={self.shape}, dtype={self.dtype}, {state})"


class Queue:
    """One thread's pending run: its nodes, their context, the records that
    saved them, and the lock that a flush -- from this thread or from one
    reading a value of this run -- holds (Note [Deferred ops and threads])."""

    __slots__ = ("__weakref__", "context", "lock", "nodes", "saved", "seen")

    def __init__(self) -> None:
        self.nodes: list[Lazy] = []
        self.context: list[Any] = [None, None, False]  # (default device, abstract mesh, x64) of the run
        self.saved: list[tuple[Any, str, Lazy]] = []  # (record, field, node) to replace at the flush
        self.lock = threading.RLock()
        self.seen: dict[Any, int] = {}  # run structure -> sightings in this thread


_QUEUES: weakref.WeakSet[Queue] = weakref.WeakSet()  # every thread's queue (``flush_all``)
_QUEUES_LOCK = threading.Lock()


class _Local(threading.local):
    def __init__(self) -> None:
        self.q = Queue()
        with _QUEUES_LOCK:
            _QUEUES.add(self.q)


_LOCAL = _Local()  # ``_LOCAL.q``: this thread's queue
_PROGRAMS: dict[Any, Any] = {}  # run structure -> its compiled run (shared by the threads)
_ENABLED = [True]


def queue() -> Queue:
    """This thread's queue."""
    return _LOCAL.q


def enabled() -> bool:
    """Whether elementwise ops defer (``set_enabled``)."""
    return _ENABLED[0]


def set_enabled(on: bool) -> bool:
    """Turn deferral on or off (flushing what waits, in every thread); returns the old setting."""
    flush_all()
    old = _ENABLED[0]
    _ENABLED[0] = bool(on)
    return old


def pending() -> int:
    """Nodes of this thread waiting for its next flush."""
    return len(_LOCAL.q.nodes)


def operand(storage: Any) -> Any:
    """The buffer of ``storage`` as the operand of a deferred op -- a ``Lazy``
    or a concrete array -- or None when the op must run now (deferral off, a
    tracer, 0-d, a non-float or weakly typed dtype, several devices, a deleted
    array)."""
    if not _ENABLED[0] or _config.jax_debug_nans or _config.jax_debug_infs:  # NaN/inf checks run at the op
        return None
    b = storage._buffer
    if type(b) is Lazy:
        a = b.array
        if a is None:
            return b
        storage._buffer = b = a
    if isinstance(b, _Tracer) or not isinstance(b, jax.Array):
        return None
    if b.weak_type or not b.shape or b.dtype not in _FLOATS or type(b.sharding) is not _SingleDevice:
        return None
    if b.is_deleted():
        return None
    return b


def defer(kind: Kind, src: Any, scalar: Any = None) -> Lazy:
    """A pending ``kind.fun(src[, scalar])`` with ``src``'s shape and dtype."""
    device, mesh, x64 = _config.jax_default_device, _abstract_mesh(), _config.jax_enable_x64
    q = _LOCAL.q
    if type(src) is Lazy and src.queue is not q:  # another thread's node: computed there first
        src = value(src)
    node = Lazy.__new__(Lazy)
    node.kind = kind
    node.src = src
    node.scalar = scalar
    node.shape = src.shape
    node.dtype = src.dtype
    node.array = None
    node.consumers = 0
    node.pos = 0
    node.run = None
    node.queue = q
    # no lock: a flush from another thread takes a prefix of ``nodes`` with
    # atomic list operations, so a node appended meanwhile waits for the next
    nodes = q.nodes
    context = q.context
    if nodes and (device is not context[0] or mesh is not context[1] or x64 is not context[2]):
        flush(q)
    if not nodes:
        context[:] = device, mesh, x64
    if type(src) is Lazy:
        src.consumers += 1
    nodes.append(node)
    if len(nodes) >= MAX_PENDING:
        flush(q)
    return node


def saves(rec: Any, field: str, node: Any) -> None:
    """``rec.field`` holds ``node``: replace it by the array at the flush."""
    if type(node) is Lazy:
        q = _LOCAL.q
        if node.queue is not q or node.pos < 0:  # computed already, or another thread's
            object.__setattr__(rec, field, value(node))
        else:  # (computed meanwhile by another thread: replaced at this thread's next flush)
            q.saved.append((rec, field, node))


def value(node: Lazy) -> jax.Array:
    """The array of ``node`` (flushing its run, or recomputing an unreferenced
    node; either in whichever thread made it)."""
    a = node.array
    if a is None:
        q = node.queue
        if node.pos >= 0:
            flush(q)
        a = node.array
        if a is None:
            with q.lock:
                a = _recompute(node)
    return a


def concrete(x: Any) -> Any:
    """``x`` itself, or the array of a ``Lazy``."""
    return value(x) if type(x) is Lazy else x


def _apply(kind: Kind, x: Any, scalar: Any) -> Any:
    if kind.binary:
        return kind.jitted(x, scalar_operand(scalar))
    return kind.jitted(x)


def _recompute(node: Lazy) -> jax.Array:
    chain = []  # the unreferenced nodes back to one with an array
    n: Any = node
    while type(n) is Lazy and n.array is None:
        chain.append(n)
        n = n.src
    x = n.array if type(n) is Lazy else n
    for m in reversed(chain):
        x = m.array = _apply(m.kind, x, m.scalar)
        m.src = m.scalar = None
    return x


def flush(q: Queue | None = None) -> None:
    """Compute every pending node of this thread (or of the queue ``q``), and
    put the arrays into the records that saved them (Note [Deferred
    elementwise ops])."""
    if q is None:
        q = _LOCAL.q
    if q.nodes or q.saved:
        with q.lock:
            _flush(q)


def flush_all() -> None:
    """``flush`` every thread's queue."""
    with _QUEUES_LOCK:
        queues = [q for q in _QUEUES if q.nodes or q.saved]
    for q in queues:
        flush(q)


def flush_for(records: Any) -> None:
    """``flush`` this thread's queue, and any other thread's whose pending
    records include one of ``records`` (a backward or an inspection of a tape
    made in another thread); other threads' runs are left as they are."""
    flush()
    q = _LOCAL.q
    with _QUEUES_LOCK:
        others = [o for o in _QUEUES if o is not q and o.saved]
    if others:
        ids = {id(r) for r in records}
        for o in others:
            if any(id(rec) in ids for rec, _, _ in o.saved[:]):
                flush(o)


def _flush(q: Queue) -> None:
    """``flush(q)`` with ``q.lock`` held."""
    pending = q.nodes
    if pending:
        device, mesh, x64 = q.context  # first: the owner sets it only on an empty queue
        n = len(pending)
        nodes = pending[:n]
        del pending[:n]  # not clear(): a node the owner appended meanwhile waits on
        try:
            if _config.jax_default_device is device and _abstract_mesh() is mesh and _config.jax_enable_x64 is x64:
                _run(nodes)
            else:
                with jax.default_device(device), jax.sharding.use_abstract_mesh(mesh), jax.enable_x64(x64):
                    _run(nodes)
        finally:
            for n in nodes:
                n.pos, n.run = -1, None
            del nodes
    if q.saved:
        n = len(q.saved)
        saved = q.saved[:n]
        del q.saved[:n]
        for rec, field, node in saved:
            object.__setattr__(rec, field, value(node))


# the references a node of the run has inside ``_outputs``: the run's list, the
# loop variable and getrefcount's argument (checked by tests/test_lazy.py)
_OWN_REFS = 3


def _outputs(nodes: list[Lazy]) -> tuple[int, ...]:
    """Positions of the nodes that something besides the run references."""
    refcount = sys.getrefcount
    out = []
    i = 0
    for n in nodes:  # a plain loop: enumerate's tuple would hold one more reference
        if refcount(n) > _OWN_REFS + n.consumers:
            out.append(i)
        i += 1
    return tuple(out)


def _run(nodes: list[Lazy]) -> None:
    if len(nodes) == 1:
        n = nodes[0]
        n.array = _apply(n.kind, concrete(n.src), n.scalar)
        n.src = n.scalar = None
        return
    structure = []
    external: list[Any] = []
    scalars: list[Any] = []  # the run's distinct scalars (Note [Scalars of a run])
    slots: list[int] = []  # per binary node, its scalar's index in ``scalars``
    slot_of: dict[tuple[type, Any], int] = {}
    token = object()  # this run: a node's ``pos`` counts only with it (threads)
    i = 0
    for n in nodes:
        n.pos, n.run = i, token
        i += 1
        s = n.src
        if type(s) is Lazy and s.run is token and s.array is None:
            ref = s.pos  # an earlier node of this run (nodes come in creation order)
        else:
            external.append(concrete(s))
            ref = -len(external)
        if n.kind.binary:
            v = n.scalar
            if v and v == v:  # a zero or a nan gets a slot of its own (0.0 == -0.0, nan != nan)
                k = (type(v), v)
                slot = slot_of.get(k)
                if slot is None:
                    slot = slot_of[k] = len(scalars)
                    scalars.append(v)
            else:
                slot = len(scalars)
                scalars.append(v)
            slots.append(slot)
        structure.append((n.kind, ref))
    del s, n
    outputs = _outputs(nodes)
    key = (tuple(structure), outputs, tuple(slots))
    program = _PROGRAMS.get(key)
    if program is None:
        seen = nodes[0].queue.seen  # sightings count per thread: its runs are those it would make alone
        if key in seen or len(seen) < _MAX_PROGRAMS:
            count = seen[key] = seen.get(key, 0) + 1
            if count >= _COMPILE_AT and len(_PROGRAMS) < _MAX_PROGRAMS:
                program = _PROGRAMS[key] = jax.jit(functools.partial(_replay, key[0], outputs, key[2]))
    elif key not in nodes[0].queue.seen:  # compiled by another thread: used from this thread's own second sighting
        seen = nodes[0].queue.seen
        if len(seen) < _MAX_PROGRAMS:
            seen[key] = 1
        program = None
    if program is not None:
        arrays = program(external, scalar_operands(scalars))
        for i, a in zip(outputs, arrays):
            nodes[i].array = a
        for m in nodes:
            if m.array is not None:
                m.src = m.scalar = None
        return
    # one dispatch per node, in order: what the ops did before deferring
    for m in nodes:
        s = m.src
        m.array = _apply(m.kind, value(s) if type(s) is Lazy else s, m.scalar)
        m.src = m.scalar = None


# Note [Scalars of a run]
# ~~~~~~~~~~~~~~~~~~~~~~~
# Each argument of a compiled call costs its dispatch about a microsecond, so a
# run passes each distinct python scalar once (``t * 1.01`` fifty times in a
# run: one argument): equal scalars of one type share a slot, and the slots,
# part of the run's structure, say which node reads which. A zero or a nan
# always gets a slot of its own (``0.0 == -0.0``, ``nan != nan``). Each node
# still reads the same weakly typed argument (``eager.scalar_operand``) as
# its own program does, so the values are unchanged.


def _replay(
    structure: tuple, outputs: tuple[int, ...], slots: tuple[int, ...], external: list[Any], scalars: list[Any]
) -> list[Any]:
    values: list[Any] = []
    it = iter(slots)
    for kind, ref in structure:
        x = values[ref] if ref >= 0 else external[-1 - ref]
        values.append(kind.fun(x, scalars[next(it)]) if kind.binary else kind.fun(x))
    return [values[i] for i in outputs]
