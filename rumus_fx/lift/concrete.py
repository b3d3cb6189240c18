"""Tracing a lifted function that needs its values: Python control flow on arrays.

Note [Concrete tracing]
~~~~~~~~~~~~~~~~~~~~~~~
``rf.lift`` traces a function with ``jax.make_jaxpr``, on abstract values. A
function that turns an array into a Python value (``if x.sum() > 0:``,
``int(n)``, ``x.item()``, ``range(k)`` over an array's value) cannot be traced
that way: jax raises ``TracerBoolConversionError`` (or another concretization
error). ``jax.grad`` accepts such a function when it is called eagerly, because its
tracers carry the primal values; rf does the same, as a fallback:

- When the abstract trace fails with a concretization error (``needs_values``:
  also ``np.asarray`` of a traced value, and a shape built from a traced integer,
  ``jnp.zeros((n,))``, for which jax raises a plain ``TypeError``) and every input of
  the call is a concrete array (no enclosing ``jax.jit``/``vmap``/...), the call is
  traced again inside ``jax.make_jaxpr`` with :class:`ConcreteTrace`. Its tracers
  hold two things: the symbolic value (the ``make_jaxpr`` tracer, the *parent*
  trace's) and the concrete value. Each primitive is bound on both: the parent
  records the equation, ``jax``'s eval trace computes the value. A conversion to
  a Python value reads the concrete one (``to_concrete_value``), exactly as
  jax's JVP tracers do for ``jax.grad``.
- The jaxpr that comes out is the program of the branch this call took: a plain
  jaxpr, run by the same rules as any other. It depends on the values, so it is
  traced again on every call (the compiled program is reused when the traced
  text and constants are the same: ``_fingerprint`` in lift/tracing.py).
- A ``custom_jvp``/``custom_vjp`` call is recorded as the call itself, so its
  rule is honoured (SPEC section 8): the parent traces its primal function to the
  call's jaxpr, and the concrete outputs come from running the primal function
  once more on the values (:class:`_ValueTrace`; the function's output stores are
  reset between the two runs, as jax's own rule thunks do). Its primal function
  is traced abstractly, so Python control flow on values *inside* a custom_jvp
  function still raises, as it does in ``jax.make_jaxpr``.
- Every value of the call is a tracer here, where under ``jax.grad`` only those
  that depend on a differentiated input are. Each tracer knows whether it depends
  on a tracked input (``tracked``). A value that does not, or that is not
  floating-point (a comparison, an index), is handed out freely: ``bool``,
  ``int``, ``.item()``, ``np.asarray``, ``tolist``. A tracked floating-point value
  never is (``to_concrete_value`` gives None, ``float``/``np.asarray`` raise
  jax's errors): as a constant it would be cut out of the gradient
  (``x.item() * y``, ``jnp.unique(x)``), which ``jax.grad`` does silently; the
  caller turns the error into an ``AutogradError`` saying so. The price:
  ``jnp.trim_zeros(x)``, which asks for the value only to check it is concrete,
  is refused for a tracked ``x`` although jax.grad's answer is right there.
- A value from outside the call that is not concrete (a tracer of an enclosing
  ``jax.jit`` read through the closure) makes the fallback give up: the original
  error is raised (:class:`NotConcrete`).
- Other primitives that call functions (``shard_map``, ``pmap``) are not handled
  by this trace: such a call raises ``AutogradError`` naming it.

``jax.debug.print`` and ``jax.debug.callback`` are only recorded, so the program
runs them once per call, as jax.grad does. A callback that returns values
(``jax.pure_callback``, ``io_callback``) runs twice on such a call: once while
tracing with values (its values are needed there), once when the program runs.

Everything here is jax's tracing machinery through its public names
(``jax.core.Trace``/``Tracer``, ``jax.extend.core.set_current_trace`` and
``take_current_trace``), the same on jax 0.10.2 and 0.11.2.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex

from ..errors import AutogradError

CONCRETIZATION_ERRORS: tuple[type[BaseException], ...] = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,  # np.asarray of a traced value
)
# jax's shape check (``jnp.zeros((n,))`` with a traced ``n``) swallows the
# TracerIntegerConversionError of the dimension and raises a plain TypeError, whose
# message shows the shape (a tracer's repr ends in "Tracer(<aval>)")
_SHAPE_OF_VALUES = "Shapes must be 1D sequences of concrete values of integer type"


def needs_values(e: BaseException) -> bool:
    """Whether ``e``, raised while tracing, is jax asking for a value: a
    concretization error, or the TypeError of a shape built from a traced integer
    (not one of a shape that is wrong whatever the values, ``(2.5,)``)."""
    if isinstance(e, CONCRETIZATION_ERRORS):
        return True
    text = str(e)
    return isinstance(e, TypeError) and text.startswith(_SHAPE_OF_VALUES) and "Tracer(" in text.splitlines()[0]


class NotConcrete(Exception):
    """A value the function reads is not concrete: the call cannot be traced with
    values (the caller raises the original concretization error)."""


class ConcreteTracer(jax.core.Tracer):
    """A value of the function traced with values: its ``make_jaxpr`` tracer
    (``sym``), its concrete array (``value``) and whether it depends on a tracked
    input (``tracked``)."""

    __slots__ = ("sym", "tracked", "value")

    def __init__(self, trace: ConcreteTrace, sym: Any, val: Any, tracked: bool):
        super().__init__(trace, jax.typeof(sym))
        self.sym = sym
        self.value = val
        self.tracked = tracked

    def to_concrete_value(self) -> Any:
        # A floating value that depends on a tracked input is never handed out
        # as a constant (jnp.unique(x), x.item() would cut it out of the gradient,
        # silently under jax.grad): jax's concretization error is raised instead.
        if self.tracked and _inexact(self.aval):
            return None
        return self.value

    # a branch or an int() on a value carries no gradient: always answered
    def __bool__(self) -> bool:
        return bool(self.value)

    def __int__(self) -> int:
        return int(self.value)

    def __index__(self) -> int:
        return operator.index(self.value)

    # a NumPy array or a list of a value: constants, so only of a value without a gradient
    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if self.tracked and _inexact(self.aval):
            return super().__array__(dtype)  # jax's error
        return np.asarray(self.value, dtype=dtype)

    def tolist(self) -> Any:
        if self.tracked and _inexact(self.aval):
            return super().tolist()
        return self.value.tolist()

    # a Python float of a value: a constant, so only of a value without a gradient
    def __float__(self) -> float:
        if self.tracked and _inexact(self.aval):
            return super().__float__()  # jax's error (jax.grad raises it too)
        return float(self.value)

    def __complex__(self) -> complex:
        if self.tracked and _inexact(self.aval):
            return super().__complex__()
        return complex(self.value)

    def full_lower(self) -> Any:
        return self

    def cur_qdd(self) -> Any:  # (a mutable array reference's state: its value's)
        return self.value.cur_qdd()


# side effects with no value to give back (jax.debug.callback, jax.debug.print): bound
# on the parent trace only, so the program runs them once per call, as jax.grad does
_CALLBACKS_WITHOUT_OUTPUTS = frozenset({"debug_callback", "debug_print"})


class ConcreteTrace(jax.core.Trace):
    """Binds every primitive on the parent trace (``make_jaxpr``'s: the equation
    is recorded) and on jax's eval trace (the value is computed)."""

    def __init__(self, parent: Any):
        super().__init__()
        self.parent = parent
        self.requires_low = False

    def pair(self, x: Any) -> tuple[Any, Any, bool]:
        """(``make_jaxpr`` tracer, value, tracked) of an operand."""
        if isinstance(x, ConcreteTracer) and x._trace is self:
            return x.sym, x.value, x.tracked
        if isinstance(x, jax.core.Tracer):
            raise NotConcrete(f"a value of another trace ({type(x).__name__}) is read")
        return x, x, False

    def stage_value(self, val: Any) -> Any:
        return ConcreteTracer(self, *self.pair(val))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("process_"):  # a call primitive this trace does not handle
            raise AutogradError(
                f"rf.lift: a function traced with its values (it turns arrays into Python values) calls a "
                f"transformation rf cannot trace with values ({name[len('process_') :]}); write the Python "
                "control flow with lax.cond/jnp.where so the function traces without values"
            )
        raise AttributeError(name)

    def _wrap(self, multiple: bool, syms: Any, vals: Any, tracked: bool) -> Any:
        if multiple:
            return [ConcreteTracer(self, s, v, tracked) for s, v in zip(syms, vals)]
        return ConcreteTracer(self, syms, vals, tracked)

    def process_primitive(self, primitive: Any, tracers: Sequence[Any], params: dict, /) -> Any:
        syms, vals, tracked = _unzip(self.pair(x) for x in tracers)
        with jex.set_current_trace(self.parent):
            out_sym = primitive.bind_with_trace(self.parent, syms, _avals(syms), params)
        if primitive.name in _CALLBACKS_WITHOUT_OUTPUTS:  # run by the compiled program only, not twice
            return []
        ev = eval_trace()
        with jex.set_current_trace(ev):
            out_val = primitive.bind_with_trace(ev, vals, _avals(vals), params)
        carries = any(tracked) and primitive.name != "stop_gradient"
        return self._wrap(primitive.multiple_results, out_sym, out_val, carries)

    def _values_of(self, fun: Any, vals: Sequence[Any]) -> list[Any]:
        """The outputs of a wrapped function (a custom rule's primal, a call's
        body) on the values; its output stores are reset first (the parent's
        trace of it filled them), as jax's own rule thunks reset them."""
        for store in fun.stores:
            if store is not None:
                store.reset()
        with jex.set_current_trace(_ValueTrace(self)):
            return list(fun.call_wrapped(*vals))

    def _custom_call(self, primitive: Any, subfuns: tuple, tracers: Sequence[Any], params: dict) -> Any:
        """A custom_jvp/custom_vjp call (``subfuns``: its primal first, then its
        rules), recorded as the call itself; its values from the primal."""
        syms, vals, tracked = _unzip(self.pair(x) for x in tracers)
        with jex.set_current_trace(self.parent):
            out_sym = primitive.bind_with_trace(self.parent, syms, _avals(syms), dict(subfuns=subfuns, **params))
        return self._wrap(True, out_sym, self._values_of(subfuns[0], vals), any(tracked))

    def process_custom_jvp_call(self, primitive: Any, fun: Any, jvp: Any, tracers: Sequence[Any], /, **params) -> Any:
        return self._custom_call(primitive, (fun, jvp), tracers, params)

    def process_custom_vjp_call(
        self, primitive: Any, fun: Any, fwd: Any, bwd: Any, tracers: Sequence[Any], /, **params
    ) -> Any:
        return self._custom_call(primitive, (fun, fwd, bwd), tracers, params)

    def process_call(self, primitive: Any, f: Any, tracers: Sequence[Any], params: dict, /) -> Any:
        syms, vals, tracked = _unzip(self.pair(x) for x in tracers)
        with jex.set_current_trace(self.parent):
            out_sym = self.parent.process_call(primitive, f, syms, params)
        return self._wrap(True, out_sym, self._values_of(f, vals), any(tracked))


class _ValueTrace(jax.core.Trace):
    """Evaluates a wrapped function on concrete values; values of ``of`` (the
    concrete trace) it closes over are read as their values."""

    def __init__(self, of: ConcreteTrace):
        super().__init__()
        self.of = of

    def _value(self, x: Any) -> Any:
        return self.of.pair(x)[1]

    def stage_value(self, val: Any) -> Any:
        # jnp.array of a constant inside the function: staged as a value
        ev = eval_trace()
        with jex.set_current_trace(ev):
            return ev.stage_value(self._value(val))

    def process_primitive(self, primitive: Any, tracers: Sequence[Any], params: dict, /) -> Any:
        vals = [self._value(x) for x in tracers]
        ev = eval_trace()
        with jex.set_current_trace(ev):
            return primitive.bind_with_trace(ev, vals, _avals(vals), params)

    def process_custom_jvp_call(self, primitive: Any, fun: Any, jvp: Any, tracers: Sequence[Any], /, **_) -> Any:
        return fun.call_wrapped(*[self._value(x) for x in tracers])

    def process_custom_vjp_call(
        self, primitive: Any, fun: Any, fwd: Any, bwd: Any, tracers: Sequence[Any], /, **_
    ) -> Any:
        return fun.call_wrapped(*[self._value(x) for x in tracers])

    def process_call(self, primitive: Any, f: Any, tracers: Sequence[Any], params: dict, /) -> Any:
        return f.call_wrapped(*[self._value(x) for x in tracers])


def concrete_values(values: Sequence[Any]) -> list[Any] | None:
    """The concrete arrays of a call's inputs (a concrete tracer's value: a
    lifted call nested in one traced with values), or None when one is a tracer
    of another transformation, whose value is unknown."""
    out = []
    for v in values:
        if isinstance(v, ConcreteTracer):
            v = v.value
        if isinstance(v, jax.core.Tracer):
            return None
        out.append(v)
    return out


def _inexact(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


_EVAL: list[Any] = []


def eval_trace() -> Any:
    """jax's eval trace (the one that computes values), which has no public name:
    the trace ``take_current_trace`` makes current while it hands out another."""
    if not _EVAL:
        with jex.take_current_trace(), jex.take_current_trace() as ev:
            _EVAL.append(ev)
    return _EVAL[0]


def _avals(xs: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(jax.typeof(x) for x in xs)


def _unzip(triples: Any) -> tuple[list[Any], list[Any], list[bool]]:
    a: list[Any] = []
    b: list[Any] = []
    c: list[bool] = []
    for x, y, z in triples:
        a.append(x)
        b.append(y)
        c.append(z)
    return a, b, c


def traced(
    body: Callable[..., Sequence[Any]],
    syms: Sequence[Any],
    vals: Sequence[Any],
    tracked: Sequence[bool],
    enter: Callable[[], None],
) -> list[Any]:
    """``body(*inputs)`` inside ``make_jaxpr`` with each input a concrete tracer
    (its ``make_jaxpr`` tracer from ``syms``, its value from ``vals``, whether it
    is tracked from ``tracked``); returns
    ``body``'s output list with each concrete tracer replaced by its
    ``make_jaxpr`` tracer. ``enter`` runs once the concrete trace is current."""
    with jex.take_current_trace() as parent:
        trace = ConcreteTrace(parent)
        inputs = [ConcreteTracer(trace, s, v, t) for s, v, t in zip(syms, vals, tracked)]
        with jex.set_current_trace(trace):
            enter()
            out = body(*inputs)
        # (the trace stays valid, as make_jaxpr's does: a custom rule traced later
        # may close over its tracers, read as their make_jaxpr tracers: symbolic())
        return [trace.pair(x)[0] for x in out]


def symbolic(x: Any) -> Any:
    """A concrete tracer's ``make_jaxpr`` tracer; any other value as it is."""
    return x.sym if isinstance(x, ConcreteTracer) else x
