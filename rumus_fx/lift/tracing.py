"""``rf.lift``: run any JAX function on the tape, one hand-written rule per primitive.

This module traces a call and records it; the program it builds is in
``lift/program.py`` and the tape entry in ``lift/lifted_record.py``.

Note [Lifting]
~~~~~~~~~~~~~~
``lift(fun)(*args)`` traces ``fun`` once per signature (the avals of its array
leaves, the values of its static leaves, which leaves are tracked) with
``jax.make_jaxpr`` and compiles the jaxpr into a ``Program``: a flat list of
steps (calls such as ``jit`` are inlined; a ``custom_jvp_call`` stays one step
whose rule honours the user's JVP rule, ``lift/rules_custom.py``), each with
the rule of its primitive (``lift/rules.py``) and the slots it reads and writes.
A static pass marks which slots depend on tracked inputs; a differentiable
primitive without a rule on that path raises ``AutogradError`` naming it.

The program runs as one function ``forward(inputs) -> (outputs, residuals)``
(eagerly one cached compiled call; inline under an outer trace) and appears on
the tape as one composite entry, ``LiftedBackward``, holding the residuals. Its
backward walks the steps in reverse, running each primitive record's rule
through the rule runner (Note [One rule runner] in rumus_fx/autograd/runner.py). ``print(tape)`` lists the per-primitive
records (``SinBackward``, ``DotGeneralBackward``, ...) under the entry.

Closures: arrays and Tensors that ``fun`` reads without receiving them (closure
cells, globals, defaults, ``self.<attr>``) are extra inputs of the cached program,
their current values passed on each call (Note [Closures of a lifted function] in
lift/closure.py). A tracked Tensor read some other way is found during tracing and
made an extra input too (traced per call), so its gradient is never silently lost.
"""

from __future__ import annotations

import collections
import functools
import gc
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from .. import sharding as shd
from .. import tensor as tensor_mod
from ..autograd import whole_tape
from ..autograd.record import VersionSnapshot
from ..autograd.tape import current_tape, suspend_recording
from ..errors import SHARDING_HINT, AutogradError, ShapeError, ShapeTypeError, ShardingError
from ..kernels.dispatch import use as kernel_mode
from ..storage import current_trace_state
from ..tensor import Tensor, next_grad_id
from . import closure as _closure
from . import concrete as _concrete
from . import jax_versions as _state
from .jax_versions import manual_spec, manual_type
from .lifted_record import LiftedBackward
from .program import Program

Array = jax.Array
_Tracer = jax.core.Tracer


class _Capture:
    """Finds (pass 1) and substitutes (pass 2) tracked Tensors read by a traced
    function that did not receive them as arguments."""

    def __init__(self, first_id: int, subst: dict[int, Any] | None = None):
        self.first_id = first_id
        self.found: dict[int, Tensor] = {}
        self.subst = subst or {}
        self.trace: Any = None  # the trace being recorded (set when it starts)
        self.constants: dict[int, Any] = {}  # storages of untracked tensors read
        self.bound: dict[int, Any] = {}  # Tensors of the closure: id -> the trace's input

    def value(self, t: Tensor) -> Any:
        sub = self.bound.get(id(t))
        if sub is not None:
            return sub
        gid = t.grad_id
        if gid is None:
            # an untracked tensor made before the trace: its value is baked into
            # the program, so the entry snapshots its storage (VersionMismatch
            # if it is written before backward)
            if self.trace is not None and t._storage._trace != self.trace:
                self.constants[id(t._storage)] = t._storage
            return None
        if gid < self.first_id:
            sub = self.subst.get(id(t))
            if sub is not None:
                return sub
            if self.subst:
                raise AutogradError(  # pragma: no cover - tracing is deterministic
                    "rf.lift: the function read a different set of closed-over tracked Tensors on its second trace"
                )
            self.found.setdefault(id(t), t)
        return None


class _ProgramCache(collections.OrderedDict):
    """The lifted programs by cache key, the least recently used dropped first
    beyond ``_MAX_PROGRAMS`` (Note [A program's compiled calls] in lift/program.py)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()  # lifted calls may run in several threads
        self._puts = 0

    def get(self, key: Any, default: Any = None) -> Any:
        with self._lock:
            hit = super().get(key, default)
            if hit is not default:
                self.move_to_end(key)
            return hit

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self[key] = value
            self.move_to_end(key)
            while len(self) > _MAX_PROGRAMS:
                self.popitem(last=False)
            self._puts += 1
            check = self._puts % _CHECK_MAPPINGS_EVERY == 0
        if check:
            relieve_mapping_pressure()

    def drop_oldest(self, n: int) -> None:
        with self._lock:
            for _ in range(min(n, len(self))):
                self.popitem(last=False)


_PROGRAMS: _ProgramCache = _ProgramCache()
_MAX_PROGRAMS = 128
_MAX_KEYS = 2048  # keys remembered as retraced or not substituted (no program held)
_CHECK_MAPPINGS_EVERY = 4  # new programs between two looks at the process's memory mappings


def mapped_regions() -> int | None:
    """How many memory mappings the process holds (None where ``/proc`` does
    not say: not Linux)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return None


@functools.cache
def mapping_limit() -> int:
    """The kernel's limit on a process's memory mappings (``vm.max_map_count``)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


_after_relief: list[int | None] = [None]  # regions the process held just after the last relief
_warned_near_limit = [False]  # the warning that others hold nearly all mappings, given once


def relief_threshold() -> int:
    """How many memory mappings the process may hold before rf drops programs:
    half the kernel's limit, or, after a relief, a third of the way from what was
    left to the limit, at most three quarters of it (Note [A program's compiled
    calls])."""
    limit = mapping_limit()
    after = _after_relief[0]
    if after is None:
        return limit // 2
    return min(max(limit // 2, after + (limit - after) // 3), limit - limit // 4)


def relieve_mapping_pressure() -> bool:
    """Past ``relief_threshold()`` memory mappings, drop the least recently
    used half (rounded down) of the lifted programs and the whole-tape cache,
    with their compiled calls (Note [A program's compiled calls] in
    lift/program.py). If the process still holds seven eighths of the limit,
    warns once (a ``RuntimeWarning``) that XLA may crash and what frees the
    rest. Returns whether it did."""
    n = mapped_regions()
    if n is None or n < relief_threshold():
        return False
    # the older half, rounded down: the newest, which the call just made, stays
    _PROGRAMS.drop_oldest(len(_PROGRAMS) // 2)
    whole_tape.clear_cache()
    gc.collect()  # a program and its compiled calls form a reference cycle
    after = _after_relief[0] = mapped_regions()
    limit = mapping_limit()
    if after is not None and after >= limit - limit // 8 and not _warned_near_limit[0]:
        _warned_near_limit[0] = True
        warnings.warn(
            f"this process holds {after:,} memory mappings of the {limit:,} that Linux allows it "
            "(vm.max_map_count) after rf.lift dropped half of its programs; each compiled XLA "
            "program maps its code in tens to hundreds of them, and past the limit XLA crashes "
            "inside a compile. jax.clear_caches() frees jax's compiled programs; a higher "
            "vm.max_map_count raises the limit",
            RuntimeWarning,
            stacklevel=2,
        )
    return True


class _TreeKey:
    """The arguments' tree structure in a cache key. A pytree's metadata may hold
    an array (jax-md's neighbor list keeps its cutoff there); comparing two
    structures compares those arrays, which under an enclosing ``jax.jit`` traces
    the comparison and fails. They are compared by value outside that trace; a
    tracer or a multi-element array there never matches (the call is traced
    again, as ``jax.grad`` traces every call)."""

    __slots__ = ("_hash", "treedef")

    def __init__(self, treedef: Any):
        self.treedef = treedef
        self._hash = hash(treedef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _TreeKey):
            return NotImplemented
        try:
            return self.treedef == other.treedef
        except (TypeError, ValueError):
            pass
        try:
            with jax.ensure_compile_time_eval():
                return bool(self.treedef == other.treedef)
        except (TypeError, ValueError, jax.errors.JAXTypeError):
            return False


def _config_key() -> tuple:
    """The jax settings a trace depends on (``jax.enable_x64``, the promotion
    modes, the default matmul precision), read where a context manager may have
    set them: a program traced under one is not reused under another, as
    ``jax.jit`` does not reuse one either."""
    c = jax.config
    return (
        c.jax_enable_x64,
        c.jax_numpy_rank_promotion,
        c.jax_numpy_dtype_promotion,
        c.jax_default_matmul_precision,
    )


def clear_programs() -> None:
    """Forget every lifted program (a rule was registered or removed: the next
    call traces again and reads the rules anew)."""
    _PROGRAMS.clear()
    _after_relief[0] = None
    _warned_near_limit[0] = False


def is_array_leaf(x: Any) -> bool:
    return isinstance(x, (Tensor, jax.Array, np.ndarray, np.generic)) or (isinstance(x, _Tracer))


def _leaf_value(x: Any) -> Any:
    if isinstance(x, Tensor):
        return x.value
    if isinstance(x, (np.ndarray, np.generic)):
        return jnp.asarray(x)
    return x


def _trace(
    fun: Callable,
    treedef: Any,
    statics: tuple,
    is_arr: tuple[bool, ...],
    avals: list,
    name: str,
    clo: _closure.Closure | None = None,
    cavals: Sequence[Any] = (),
    values: Sequence[Any] | None = None,
    tracked: Sequence[bool] = (),
):
    """make_jaxpr of ``fun`` on the array leaves (and on the arrays ``clo`` found
    in its closure, inputs after them); returns (closed jaxpr, output treedef,
    static output leaves, output-is-array mask, captures). With ``values`` (the
    leaves' concrete arrays; ``tracked``: which are tracked), ``fun`` is traced
    with them (Note [Concrete tracing] in lift/concrete.py)."""
    _closure.count_trace()
    out_info: list[Any] = []
    n = len(avals) + len(cavals)

    def flat(*arrays_and_caps):
        if values is None:
            return flat_of(*arrays_and_caps)
        return _concrete.traced(flat_of, arrays_and_caps, values, tracked, _enter)

    def _enter():
        if tensor_mod.CAPTURE is not None:  # tensors made inside belong to the concrete trace
            tensor_mod.CAPTURE.trace = current_trace_state()

    def flat_of(*arrays_and_caps):
        if tensor_mod.CAPTURE is not None and tensor_mod.CAPTURE.trace is None:
            tensor_mod.CAPTURE.trace = current_trace_state()
        arrays = arrays_and_caps[: len(avals)]
        it_a = iter(arrays)
        it_s = iter(statics)
        leaves = [next(it_a) if a else next(it_s) for a in is_arr]
        args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        if clo is None:
            out = fun(*args, **kwargs)
        else:
            with clo.substituted(arrays_and_caps[len(avals) : n], tensor_mod.CAPTURE.bound):
                out = fun(*args, **kwargs)
        out_leaves, out_tree = jax.tree_util.tree_flatten(out, is_leaf=lambda x: isinstance(x, Tensor))
        mask = tuple(is_array_leaf(x) for x in out_leaves)
        out_info[:] = [out_tree, tuple(x for x, m in zip(out_leaves, mask) if not m), mask]
        return [jnp.asarray(_leaf_value(x)) for x, m in zip(out_leaves, mask) if m]

    prev = tensor_mod.CAPTURE
    cap = _Capture(next_grad_id())
    tensor_mod.CAPTURE = cap
    try:
        # rf ops inside a lifted function run their jnp reference: its primitives
        # have rules, a Pallas kernel call has none (the kernels run where rf ops
        # are called on the tape directly)
        with suspend_recording(), kernel_mode("reference"):
            closed = jax.make_jaxpr(flat)(*avals, *cavals)
    except Exception as e:
        _raise_sharding_error(e, name, avals)
        if isinstance(e, (TypeError, ValueError)):
            _raise_shape_error(e, name, avals)
        raise
    finally:
        tensor_mod.CAPTURE = prev
    if cap.found:  # pass 2: the captured tensors become inputs
        captured = list(cap.found.values())
        cap_avals = [_spec(t.value, weak=False) for t in captured]

        def substituted(*xs):
            subst = {id(t): b for t, b in zip(captured, xs[n:])}
            inner = tensor_mod.CAPTURE
            tensor_mod.CAPTURE = _Capture(cap.first_id, subst)
            try:
                return flat_of(*xs[:n])
            finally:
                cap.constants.update(tensor_mod.CAPTURE.constants)
                tensor_mod.CAPTURE = inner

        def flat2(*xs):
            if values is None:
                return substituted(*xs)
            vals = _concrete.concrete_values([t.value for t in captured])
            if vals is None:
                raise _concrete.NotConcrete("a Tensor it reads holds a tracer of an enclosing transformation")
            return _concrete.traced(substituted, xs, [*values, *vals], [*tracked, *(True,) * len(vals)], _enter)

        with suspend_recording(), kernel_mode("reference"):
            closed = jax.make_jaxpr(flat2)(*avals, *cavals, *cap_avals)
        return _discharged(closed), out_info, captured, list(cap.constants.values())
    return _discharged(closed), out_info, [], list(cap.constants.values())


def _discharged(closed: Any) -> Any:
    """A program that makes its own mutable array references (``jax.new_ref``,
    read and written, frozen before it returns) as the pure program it is: jax's
    state discharge threads each reference's value through the program (a program
    transformation, not differentiation), so rf's rules see plain primitives. A
    reference from outside the function (an argument, a closure) or one it
    returns is left alone: writing it is an effect the function must keep (the
    program builder refuses one passed into a checkpoint or a custom rule:
    ``_KEEPS_NO_REFS`` in lift/program.py)."""
    jaxpr = closed.jaxpr
    if not jaxpr.effects or not _state.makes_refs(jaxpr):
        return closed
    if any(_state.is_ref(getattr(v, "aval", None)) for v in (*jaxpr.invars, *jaxpr.outvars)) or any(
        _state.is_ref(jax.typeof(c)) for c in closed.consts
    ):
        return closed  # a reference from outside, or one it returns
    return _state.discharge(closed)


def _raise_sharding_error(e: Exception, name: str, avals: Sequence[Any]) -> None:
    """JAX refusing a sharding while tracing the function (plain JAX refuses the
    same code on these operands) as rf.ShardingError naming the function, the
    line of it that failed, the operands' sharded types and the fix."""
    if not shd.is_sharding_failure(e):
        return
    where = prim = called = ""
    user = False
    tb = e.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        f = frame.f_code.co_filename
        if f"{os.sep}jax{os.sep}" in f:
            name_ = frame.f_code.co_name
            if user and not name_.startswith("_") and name_ != "op":  # the jax function the user's code called
                called = f" in {name_}"
            p = frame.f_locals.get("self") if frame.f_code.co_name in ("bind", "_true_bind") else None
            if isinstance(p, jcore.Primitive):
                prim = f" in '{p.name}'"  # the primitive being bound
            user = False
        elif f"{os.sep}rumus_fx{os.sep}" not in f and f"{os.sep}contextlib" not in f:
            # the innermost frame of the user's code
            where = f" at {os.path.basename(f)}:{tb.tb_lineno} (in {frame.f_code.co_name})"
            user = True
        tb = tb.tb_next
    prim = prim or called
    shown = ", ".join(_describe_aval(a) for a in avals)
    raise ShardingError(
        f"rf.lift({name}): JAX cannot run the function on operands {shown}{where}{prim}: {shd._first_line(e)}. "
        f"Plain JAX refuses the same code on these shardings. {SHARDING_HINT}"
    ) from e


def _describe_aval(a: Any) -> str:
    s = getattr(a, "sharding", None)
    dims = [
        f"{d}@{e if isinstance(e, str) else ','.join(e)}" if e else str(d)
        for d, e in zip(a.shape, (tuple(s.spec) + (None,) * len(a.shape)) if s is not None else (None,) * len(a.shape))
    ]
    return f"{np.dtype(a.dtype).name}[{','.join(dims)}]"


def _raise_shape_error(e: Exception, name: str, avals: Sequence[Any]) -> None:
    """JAX's own shape errors, raised while tracing, as rf.ShapeError naming the
    function and the shapes (nothing is recorded then)."""
    if isinstance(e, ShapeError) or _concrete.needs_values(e) or "shape" not in str(e).lower():
        return  # (a concretization error, such as an index read from a traced value, is about values)
    shapes = ", ".join(f"{np.dtype(a.dtype).name}{list(a.shape)}" for a in avals)
    cls = ShapeTypeError if isinstance(e, TypeError) else ShapeError
    raise cls(f"{name}: operands of shapes {shapes}: {e}") from e


def lift(fun: Callable, name: str | None = None) -> Callable:
    """Run ``fun`` (written with jax.numpy / jax.nn / jax.lax / rf ops) on the tape.

    Array leaves of the arguments (Tensors, jax and numpy arrays) are traced,
    every other leaf is static. While a tape records and an input (or a Tensor
    ``fun`` closes over) is tracked, ``fun`` is traced to a jaxpr once per
    signature and every primitive is recorded with rf's own backward rule;
    otherwise ``fun`` just runs. Returns ``fun``'s output pytree with Tensors for
    array leaves (tracked where they depend on a tracked input).

    Arrays ``fun`` reads without receiving them (closure cells, globals, default
    arguments, ``functools.partial`` arguments, ``self.<attr>``; jax and NumPy
    arrays, Tensors tracked or not) are inputs of the cached program, their
    current values passed on each call; Python scalars read there are static (a
    changed one traces again). An untracked Tensor read that way is live between
    calls and snapshotted within one (Note [Closures of a lifted function] in
    lift/closure.py). While ``fun`` is traced such an array is a tracer, as an
    argument of ``jax.jit`` is: code that asks whether a value is a tracer
    (numpyro's ``not_jax_tracer``) takes its traced branch, where ``jax.grad``
    would see the concrete array.

    >>> import jax.numpy as jnp, rumus_fx as rf
    >>> rf.grad(rf.lift(lambda x: jnp.sum(jnp.sin(x) ** 2)))(jnp.ones(3)).shape
    (3,)
    """
    label = name or getattr(fun, "__name__", "lifted")

    @functools.wraps(fun)
    def lifted(*args: Any, **kwargs: Any) -> Any:
        tape = current_tape()
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=lambda x: isinstance(x, Tensor))
        if tape is None:
            return fun(
                *jax.tree_util.tree_map(_leaf_value, args, is_leaf=_is_tensor),
                **jax.tree_util.tree_map(_leaf_value, kwargs, is_leaf=_is_tensor),
            )
        return _lifted_call(fun, label, tape, leaves, treedef)

    lifted.__wrapped_lift__ = fun  # type: ignore[attr-defined]
    return lifted


def call_lifted(fun: Callable, args: tuple, label: str, tape: Any, snapshots: Sequence[VersionSnapshot]) -> Any:
    """``rf.lift(fun, name=label)(*args)`` recorded on ``tape``, whose entry also
    checks ``snapshots`` at backward time (a recorded backward walk keeps the
    snapshots of the records it read: Note [Create graph] in lift/higher.py)."""
    leaves, treedef = jax.tree_util.tree_flatten((args, {}), is_leaf=_is_tensor)
    return _lifted_call(fun, label, tape, leaves, treedef, tuple(snapshots))


def _is_tensor(x: Any) -> bool:
    return isinstance(x, Tensor)


def _lifted_call(
    fun: Callable, label: str, tape: Any, leaves: list, treedef: Any, snapshots: tuple[VersionSnapshot, ...] = ()
) -> Any:
    while isinstance(fun, functools.partial):  # its arguments are arguments
        args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        args, kwargs = (*fun.args, *args), {**fun.keywords, **kwargs}
        fun = fun.func
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_tensor)
    is_arr = tuple(is_array_leaf(x) for x in leaves)
    arrays = [x for x, a in zip(leaves, is_arr) if a]
    # rf.lax.add & co. given as a computation are jax's own functions inside
    statics = tuple(getattr(x, "__wrapped_lift__", x) for x, a in zip(leaves, is_arr) if not a)
    values = [_leaf_value(x) for x in arrays]
    tracked_in = tuple(isinstance(x, Tensor) and x.grad_id is not None for x in arrays)
    avals = [_spec(v) for v in values]
    # what fun reads through its closure (Note [Closures of a lifted function])
    clo = _closure.scan(fun, statics)
    # the walk could not see all that fun reads: traced on every call
    volatile = clo is None or clo.plan.opaque
    key, hit = _closure_key(clo, treedef, statics, is_arr, avals, tracked_in)
    if key is None and clo is not None:
        clo = None
    cavals: list[Any] = []
    if clo is None:
        key = _plain_key(fun, treedef, statics, is_arr, avals, tracked_in)
        hit = _PROGRAMS.get(key) if key is not None else None
        if hit is not None and _closes_over_tensor((fun, *statics)):
            hit = None  # a closure holds a Tensor: trace again (capture it, snapshot it)
    constants: list[Any] = []
    if hit is not None and (volatile or _retraced(key)):
        hit = None
    if hit is None:
        traced = None
        if key is not None and key in _CONCRETE and _concrete.concrete_values(values) is not None:
            # (Note [Concrete tracing] in lift/concrete.py)
            clo, cavals = None, []
            traced = _trace_with_values(fun, treedef, statics, is_arr, avals, label, values, tracked_in, None)
        if traced is None and clo is not None:
            cavals = _closure_avals(clo)
            try:
                traced = _trace(fun, treedef, statics, is_arr, avals, label, clo, cavals)
            except Exception:
                # the function needs a closed-over array's value while tracing: it
                # is traced per call with the values baked in
                if len(_NO_SUBSTITUTION) >= _MAX_KEYS:
                    _NO_SUBSTITUTION.clear()
                _NO_SUBSTITUTION[key] = True
                clo, cavals, key = None, [], None
        if traced is None:
            try:
                traced = _trace(fun, treedef, statics, is_arr, avals, label)
            except Exception as e:
                if not _concrete.needs_values(e):
                    raise
                # Python control flow on a value: traced with the values, as jax.grad runs
                traced = _trace_with_values(fun, treedef, statics, is_arr, avals, label, values, tracked_in, e)
                key = _plain_key(fun, treedef, statics, is_arr, avals, tracked_in)
                if key is not None:
                    if len(_CONCRETE) >= _MAX_KEYS:
                        _CONCRETE.clear()
                    _CONCRETE[key] = True
        closed, out_info, captured, constants = traced
        fingerprint = None
        if key is not None and (volatile or _retraced(key) or _reads_arrays(closed)):
            # (Note [Closures of a lifted function], "Reads the walk cannot see")
            if len(_VOLATILE) >= _MAX_KEYS:
                _VOLATILE.clear()
            _VOLATILE[key] = True
            fingerprint = _fingerprint(key, closed)
            hit = _PROGRAMS.get(fingerprint) if fingerprint is not None else None
        if hit is None:
            ctracked = clo.tracked if clo is not None else ()
            program = Program(closed, tracked_in + ctracked + (True,) * len(captured), label)
            hit = (program, out_info)
            if (
                key is not None
                and not captured
                and not constants
                and (clo is not None or not _closes_over_tensor((fun, *statics)))
                and (fingerprint is not None or not _retraced(key))
            ):
                _PROGRAMS.put(key if fingerprint is None else fingerprint, hit)
        else:
            hit = (hit[0], out_info)  # (this trace's static outputs)
    else:
        captured = []
    program, (out_tree, out_statics, out_mask) = hit
    # closed-over tracked tensors are inputs of the entry too
    cap_tensors = list(captured)
    cvals = clo.values if clo is not None else []
    cap_values = [t.value for t in captured]
    all_values = values + cvals + cap_values
    outputs, residuals = program.forward(all_values)
    # inputs of the entry: tracked argument tensors, the closure's arrays and captured storages
    carrays = [x if isinstance(x, Tensor) else None for x in clo.arrays] if clo is not None else []
    # untracked Tensors of the closure are snapshotted for this call (live between calls)
    constants = list(constants) + [x._storage for x in carrays if x is not None and x.grad_id is None]
    in_tensors = [x if isinstance(x, Tensor) else None for x in arrays] + carrays + cap_tensors
    in_ids = tuple(t.grad_id if (t is not None and t.grad_id is not None) else None for t in in_tensors)
    out_tensors = []
    for v, tr in zip(outputs, program.out_tracked):
        out_tensors.append(Tensor._wrap(v, next_grad_id() if tr else None))
    if any(program.out_tracked):
        versions = []
        for k, s in enumerate(program.in_slots):
            if s in program.residual_index and in_tensors[k] is not None:
                versions.append(VersionSnapshot.of(in_tensors[k].grad_id, in_tensors[k]._storage))
        for r, t in zip(program.out_refs, out_tensors):
            if isinstance(r, int) and r in program.residual_index and t.grad_id is not None:
                versions.append(VersionSnapshot.of(t.grad_id, t._storage))
        versions.extend(VersionSnapshot.of(None, s) for s in constants)
        versions.extend(snapshots)
        rec = LiftedBackward(program, residuals[0], residuals[1], tuple(versions))
        out_ids = tuple(t.grad_id for t in out_tensors)
        tape.append(
            rec,
            in_ids,
            out_ids,
            tuple(program.in_avals),
            tuple(program.out_avals),
            replay=weak_values(values) + tuple(map(_closure.Strong, cvals)) + weak_values(cap_values),
        )
    it_o = iter(out_tensors)
    it_s = iter(out_statics)
    out_leaves = [next(it_o) if m else next(it_s) for m in out_mask]
    return jax.tree_util.tree_unflatten(out_tree, out_leaves)


def _plain_key(fun: Callable, treedef: Any, statics: tuple, is_arr: tuple, avals: list, tracked_in: tuple) -> Any:
    """The cache key of a call whose closure is not taken apart (None when a
    static leaf cannot be hashed)."""
    try:
        signature = tuple((a.shape, a.dtype, a.weak_type, a.sharding) for a in avals)
        key = (fun, _TreeKey(treedef), statics, is_arr, signature, tracked_in, _config_key())
        hash(key)
    except TypeError:
        return None
    return key


def _trace_with_values(
    fun: Callable,
    treedef: Any,
    statics: tuple,
    is_arr: tuple,
    avals: list,
    label: str,
    values: list,
    tracked: tuple[bool, ...],
    error: BaseException | None,
) -> Any:
    """``_trace`` of a function that needs its values (Note [Concrete tracing] in
    lift/concrete.py). ``error`` is the abstract trace's concretization error,
    raised again when the call cannot be traced with values (an input is an
    enclosing transformation's tracer); None when that is already known."""
    try:
        concrete = _concrete.concrete_values(values)
        if concrete is None:
            raise _concrete.NotConcrete("an input is a tracer of an enclosing transformation")
        return _trace(fun, treedef, statics, is_arr, avals, label, values=concrete, tracked=tracked)
    except _concrete.NotConcrete as e:
        if error is None:
            error = AutogradError(
                f"rf.lift({label}): the function reads a Python value of an array (an `if` on it, int(), "
                f".item()), which needs the array's value, but {e}: under jax.jit, vmap or another "
                "transformation the value is not known, as for jax.grad; use lax.cond/jnp.where instead"
            )
        raise error from None
    except Exception as e:
        if not _concrete.needs_values(e):
            raise
        raise AutogradError(
            f"rf.lift({label}): traced with its values (it turns arrays into Python values), the function "
            "still asks for a value rf does not give: a floating-point value that depends on a tracked "
            "input, as a constant (x.item(), float(x), jnp.unique(x), ...), which would cut it out of the "
            "gradient (jax.grad drops such terms silently; apply lax.stop_gradient first if that is meant), "
            "or a value inside a jax.custom_jvp/custom_vjp or jax.jit function, which are traced without "
            f"values. JAX's error: {str(e).splitlines()[0]}"
        ) from e


_NO_SUBSTITUTION: dict[Any, bool] = {}
# keys of functions traced with their values (Python control flow on an array):
# traced so on every call, their programs cached under ``_fingerprint``
_CONCRETE: dict[Any, bool] = {}
# keys of functions that read what the walk does not see: traced on every call,
# their programs cached under ``_fingerprint``
_VOLATILE: dict[Any, bool] = {}


def _retraced(key: Any) -> bool:
    """Whether calls under ``key`` are traced on every call (their program is
    never kept under ``key`` itself, only under its fingerprint)."""
    return key in _VOLATILE or key in _CONCRETE


def _reads_arrays(closed: Any) -> bool:
    """Whether the traced program holds a device array it was not given: the
    function read it from a place the walk did not reach."""
    return any(isinstance(c, jax.Array) for c in closed.consts)


def _fingerprint(key: Any, closed: Any) -> Any:
    """The program's identity for a volatile function: its text (Python values
    it read are literals there) and its constants (device arrays by identity,
    NumPy ones by value); None when a constant is too large to compare or is
    an enclosing trace's tracer (then the program is not kept)."""
    parts = []
    for c in closed.consts:
        if isinstance(c, _Tracer):  # an enclosing trace's value: valid only there, never cached
            return None
        if isinstance(c, jax.Array):
            parts.append(_closure._Ident(c))
        elif isinstance(c, np.ndarray) and c.nbytes <= 1 << 16:
            parts.append((c.dtype.str, c.shape, c.tobytes()))
        else:
            return None
    return ("volatile", key, str(closed.jaxpr), tuple(parts))


def _closure_key(
    clo: _closure.Closure | None, treedef: Any, statics: tuple, is_arr: tuple, avals: list, tracked_in: tuple
) -> tuple[Any, Any]:
    """The cache key of a call whose closure was taken apart (None when it
    cannot be) and the cached program (None on a miss)."""
    if clo is None or clo.key is None:
        return None, None
    try:
        signature = (*((a.shape, a.dtype, a.weak_type, a.sharding) for a in avals), *clo.signature(_type_of))
        key = (
            "closure",
            clo.key,
            _TreeKey(treedef),
            statics,
            is_arr,
            signature,
            tracked_in + clo.tracked,
            _config_key(),
        )
        hash(key)
    except TypeError:
        return None, None
    if _NO_SUBSTITUTION and key in _NO_SUBSTITUTION:
        return None, None
    return key, _PROGRAMS.get(key)


def _type_of(v: Any) -> tuple:
    return (v.shape, v.dtype, _weak(v), shd.sharding_of(v), _manual_type(v))


def _closure_avals(clo: _closure.Closure) -> list[Any]:
    """The avals the trace gives the closure's arrays."""
    return [_spec(v) for v in clo.values]


def weak_values(values: Sequence[Any]) -> tuple[Any, ...]:
    """Weak references to a lifted call's input values, for
    ``backward(create_graph=True)`` (Note [Create graph] in lift/higher.py);
    python scalars, which cannot be weakly referenced, are kept."""
    out: list[Any] = []
    for v in values:
        try:
            out.append(weakref.ref(v))
        except TypeError:
            out.append(_closure.Strong(v))
    return tuple(out)


def _closes_over_tensor(objs: Sequence[Any], depth: int = 3) -> bool:
    """Whether a function among ``objs`` reads a Tensor or an array through a
    closure cell or a global it names (looked at ``depth`` calls deep). Its
    program is then traced per call and not cached: a tracked Tensor is captured,
    an untracked one snapshotted, and an array rebound since the last call is read
    at its current value (a cached program would hold the old one)."""
    seen: set[int] = set()
    todo = [(o, depth) for o in objs]
    while todo:
        o, d = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, functools.partial):
            todo.extend((x, d) for x in (o.func, *o.args, *o.keywords.values()))
            continue
        code = getattr(o, "__code__", None)
        if code is None or (getattr(o, "__module__", "") or "").startswith(("jax.", "numpy")):
            continue
        values = [c.cell_contents for c in (o.__closure__ or ()) if _cell_ok(c)]
        glob = getattr(o, "__globals__", {})
        values += [glob[n] for n in code.co_names if n in glob]
        for v in values:
            if isinstance(v, (Tensor, jax.Array, np.ndarray)):
                return True  # its current value is what the program must read
            elif isinstance(v, (list, tuple, dict)):
                leaves = jax.tree_util.tree_leaves(v, is_leaf=_is_tensor)
                if any(isinstance(x, (Tensor, jax.Array, np.ndarray)) for x in leaves):
                    return True
            elif d > 0 and callable(v) and not isinstance(v, type):
                mod = getattr(v, "__module__", "") or ""
                if not mod.startswith(("jax", "numpy", "rumus_fx")):
                    todo.append((v, d - 1))
    return False


def _cell_ok(c: Any) -> bool:
    try:
        _ = c.cell_contents
    except ValueError:
        return False
    return True


def _weak(v: Any) -> bool:
    return bool(getattr(getattr(v, "aval", None), "weak_type", False))


def _spec(v: Any, weak: bool | None = None) -> jax.ShapeDtypeStruct:
    """The type a lifted call traces the value ``v`` with: its shape, dtype and weak
    type; over Explicit mesh axes its sharding; and inside a ``shard_map`` body with
    ``check_vma=True`` the manual axes it varies over (traced without them, a
    constant of the function would not be made to vary where jax's own trace makes
    it: ``x - 1.0`` on a varying ``x`` is refused by jax's type check)."""
    weak = _weak(v) if weak is None else weak
    if isinstance(v, jax.core.Tracer):  # (only a traced value can have manual axes)
        manual = manual_spec(v.aval, weak)
        if manual is not None:
            return manual
    return jax.ShapeDtypeStruct(np.shape(v), v.dtype, weak_type=weak, sharding=shd.sharding_of(v))


def _manual_type(v: Any) -> Any:
    """The manual-axis type of the value ``v`` (only a traced value can have one), else None."""
    return manual_type(v.aval) if isinstance(v, jax.core.Tracer) else None
