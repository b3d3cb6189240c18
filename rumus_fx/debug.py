"""Debugging helpers: live storage count and anomaly detection.

Note [Anomaly mode]
~~~~~~~~~~~~~~~~~~~
Inside ``detect_anomaly()`` every record's input gradients go to
``check_finite`` right after the record's backward rule ran, in the tape's walk
and in a lifted call's walk alike (the rule runner calls the hook this module
registers with ``runner.set_anomaly_hook``, Note [One rule runner] in
rumus_fx/autograd/runner.py: the state, ``ANOMALY``, and the check both live
here; the runner only calls the hook). A row of a lifted call is named as the
primitive record, the lifted function and its row, ``SqrtBackward in
rf.lift(jax.numpy.sqrt) (tape index 1.0)``. The first record,
in backward order, whose gradient holds a NaN or an Inf is the one reported:
later records only propagate it. Eagerly the check is a plain ``bool`` and
raises ``AnomalyError`` (an ``rf.AutogradError``) on the spot. Under a trace
(``jax.jit``, ``jax.vmap``, ...) the values are unknown at trace time, so the
check is staged into the program:

* ``mode="callback"`` (the default): a ``jax.debug.callback`` reports the
  origin on the host when the compiled program runs. With one device in the
  process it raises ``AnomalyError`` there; JAX reports an exception raised in
  a callback as ``jax.errors.JaxRuntimeError``, and ``detect_anomaly`` turns it
  back into the ``AnomalyError`` when it leaves the ``with`` block. With
  several devices a raising callback would abort one device's program while
  the others wait in a collective (a hang), so the callback only records the
  error, and the block raises it on exit (after ``jax.effects_barrier()``), as
  does ``check_anomalies()`` whenever it is called. Callbacks are unordered
  (ordered effects do not work on more than one device), so each check also
  receives a flag "an earlier record in backward order already failed",
  threaded through the program as data: exactly one callback, the origin's,
  reports.
* ``mode="checkify"``: a ``jax.experimental.checkify.check``; functionalize the
  call with ``checkify.checkify`` and call ``err.throw()`` (no host callback, so
  it also works where callbacks do not, e.g. in exported programs).

The mode is also entered into a ``jax.make_user_context``, which is part of
``jax.jit``'s cache key: a jitted function traced outside the block is traced
again, with the checks, inside it (and vice versa).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import itertools
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from .autograd import runner
from .errors import AutogradError
from .storage import live_storage_count

_MODES = ("callback", "checkify")
# anomaly mode's state: None when off, else the mode ("callback" or "checkify")
ANOMALY: contextvars.ContextVar[str | None] = contextvars.ContextVar("rumus_fx_anomaly", default=None)
# part of jax.jit's cache key: the anomaly checks are traced into the program
_JIT_KEY = jax.make_user_context(None)


def live_storages() -> int:
    """Number of storages alive right now (use it to check for leaks)."""
    return live_storage_count()


class AnomalyError(AutogradError):
    """A backward record produced a NaN or an Inf (raised in anomaly mode).

    Attributes:
      op: the record's name, e.g. ``"LogBackward"``.
      index: its position on the tape.
      input_shapes: the forward op's input avals (``"float32[3, 4]"``, ...).
      inputs: the forward inputs whose gradients are not finite.
      kind: ``"nan"``, ``"inf"`` or ``"nan/inf"``.
      cause: whether the record made the NaN/Inf (``CAUSE_RULE``), received it
        with its incoming gradient (``CAUSE_SEED``) or found it in the forward
        values it saved (``CAUSE_FORWARD``).
    """

    def __init__(
        self,
        op: str,
        index: int,
        input_shapes: Sequence[str],
        inputs: Sequence[int],
        kind: str,
        cause: str,
    ):
        self.op = op
        self.index = index
        self.input_shapes = tuple(input_shapes)
        self.inputs = tuple(inputs)
        self.kind = kind
        self.cause = cause
        which = ", ".join(str(k) for k in self.inputs)
        super().__init__(
            f"rumus_fx anomaly: {op} (tape index {index}) produced a non-finite gradient "
            f"({kind}) for input {which} of its forward op; the forward op's inputs had shapes "
            f"{', '.join(self.input_shapes)}. {cause}"
        )

    def __reduce__(self):
        return (type(self), (self.op, self.index, self.input_shapes, self.inputs, self.kind, self.cause))


CAUSE_SEED = (
    "The gradient flowing into it was already non-finite (a NaN/Inf seed passed as "
    "backward(grad=...), or finite gradients that overflowed when accumulated)."
)
CAUSE_FORWARD = (
    "The forward values it saved already contain NaN/Inf: the forward pass produced "
    "them before this op (look at the ops that feed it); its backward rule only propagates them."
)
CAUSE_RULE = (
    "Its saved values and incoming gradient were finite, so its backward rule "
    "created the NaN/Inf (e.g. log or division at 0, an overflowing exp)."
)
_CHECKIFY_CAUSE = "(checkify mode: run eagerly, or with mode='callback', to learn which input and why.)"


@contextlib.contextmanager
def detect_anomaly(mode: str = "callback") -> Iterator[None]:
    """Raise ``rf.AutogradError`` naming the record when backward produces NaN/Inf.

    Eagerly the error (``rf.debug.AnomalyError``, a subclass of
    ``rf.AutogradError``) is raised by ``tape.backward`` / ``rf.grad`` as soon
    as a record's backward rule returns a non-finite gradient. It names the
    record (e.g. ``LogBackward``), its tape index and the forward op's input
    shapes, and says whether the record created the NaN/Inf or received it.

    Under ``jax.jit`` (and ``vmap``) the check runs inside the compiled program:

    * ``mode="callback"`` (default) uses ``jax.debug.callback``::

          with rf.debug.detect_anomaly():
              g = jax.jit(rf.grad(loss))(w)
          # -> AnomalyError: rumus_fx anomaly: LogBackward (tape index 1) ...

      With one device the call itself fails (inside the block with JAX's
      ``JaxRuntimeError``, which carries the message; the block re-raises it as
      the ``AnomalyError``). With several devices (a mesh), raising inside the
      program could hang its collectives, so the error is raised when the block
      exits, or earlier by ``rf.debug.check_anomalies()`` (e.g. after each
      step).
    * ``mode="checkify"`` uses ``jax.experimental.checkify`` (no host callback;
      any number of devices): functionalize the call, then throw::

          with rf.debug.detect_anomaly(mode="checkify"):
              err, g = checkify.checkify(jax.jit(rf.grad(loss)))(w)
              err.throw()                     # AnomalyError: LogBackward ...

    The mode is part of ``jax.jit``'s cache key, so a function jitted (and
    traced) outside the block is retraced with the checks inside it. NaNs
    made by the forward pass alone are not reported (``jax_debug_nans`` is
    the tool for those); when one reaches a record's saved values, the error
    says so.
    """
    if mode not in _MODES:
        raise ValueError(f"detect_anomaly: mode must be one of {_MODES}, got {mode!r}")
    token = ANOMALY.set(mode)
    start = _report_count()
    try:
        with _JIT_KEY(mode):
            yield
        check_anomalies(since=start)
    except Exception as e:
        found = _from_runtime_error(e)
        if found is None:
            raise
        raise found from e
    finally:
        ANOMALY.reset(token)


def check_anomalies(since: int | None = None) -> None:
    """Raise the first anomaly that a compiled program reported without raising
    it (programs on several devices, see ``detect_anomaly``) and that nobody
    raised yet; waits for pending callbacks first. Call it after a step to
    stop at the first bad one::

        with rf.debug.detect_anomaly():
            for batch in data:
                params = train_step(params, batch)   # jitted, on a mesh
                rf.debug.check_anomalies()

    ``since`` (internal) limits it to reports newer than a count."""
    jax.effects_barrier()
    with _LOCK:
        pending = [(k, err) for k, err in _REPORTS if (since is None or k >= since) and k not in _TAKEN]
        _TAKEN.update(k for k, _ in pending)
    if pending:
        raise AnomalyError(*pending[0][1].__reduce__()[1])


# ---------------------------------------------------------------------------
# the check (called by the rule runner, rumus_fx/autograd/runner.py, through
# the hook registered below)
# ---------------------------------------------------------------------------


def anomaly_check() -> runner.AnomalyCheck | None:
    """The rule runner's anomaly hook: None when anomaly mode is off, else
    ``check_finite`` in the current mode."""
    mode = ANOMALY.get()
    if mode is None:
        return None
    return functools.partial(check_finite, mode=mode)


runner.set_anomaly_hook(anomaly_check)


def check_finite(
    site: runner.Site, index: Any, grad_out: Any, in_grads: Sequence[Any], state: Any = None, mode: str = "callback"
) -> Any:
    """Check the gradients the record at ``site`` (at tape ``index``, or
    ``"<index>.<row>"`` in a lifted call) returned; None for an input that
    needs no gradient.

    ``state`` is ``None`` or a traced flag "an earlier record in this backward
    walk already failed"; the updated flag is returned for the next record.
    """
    checked = [(k, g) for k, (need, g) in enumerate(zip(site.needs, in_grads)) if need and g is not None]
    if not checked:
        return state
    traced = isinstance(state, jax.core.Tracer) or any(isinstance(g, jax.core.Tracer) for _, g in checked)
    if not traced:
        if all(bool(jnp.all(jnp.isfinite(g))) for _, g in checked):
            return state
        nan = [bool(jnp.any(jnp.isnan(g))) for _, g in checked]
        bad = [not bool(jnp.all(jnp.isfinite(g))) for _, g in checked]
        raise _make_error(
            site, index, [k for k, _ in checked], np.array(bad), np.array(nan), _finite(grad_out), _saved_finite(site)
        )
    bad = jnp.stack([jnp.logical_not(jnp.all(jnp.isfinite(g))) for _, g in checked])
    nan = jnp.stack([jnp.any(jnp.isnan(g)) for _, g in checked])
    earlier = jnp.asarray(False) if state is None else state
    ks = tuple(k for k, _ in checked)
    if mode == "checkify":
        for j, k in enumerate(ks):  # one check per input: the message names it
            err = AnomalyError(site.name, index, _describe(site), (k,), "nan/inf", _CHECKIFY_CAUSE)
            _register(str(err), err)
            checkify.check(jnp.logical_not(jnp.logical_and(bad[j], jnp.logical_not(earlier))), _escape(str(err)))
    else:
        origin = jnp.logical_and(jnp.any(bad), jnp.logical_not(earlier))
        static = _Static(site, index, ks)
        jax.debug.callback(static.report, origin, bad, nan, _finite(grad_out), _saved_finite(site))
    return jnp.logical_or(earlier, jnp.any(bad))


class _Static:
    """What the callback needs that is known at trace time (no arrays kept)."""

    __slots__ = ("index", "inputs", "may_raise", "op", "shapes")

    def __init__(self, site: runner.Site, index: Any, inputs: Sequence[int]):
        self.op = site.name
        self.index = index
        self.inputs = tuple(inputs)
        self.shapes = _describe(site)
        # one device: raising aborts the program cleanly; with several, the
        # other devices could wait forever in a collective (see the note)
        self.may_raise = jax.device_count() == 1

    def report(self, origin: Any, bad: Any, nan: Any, grad_out_finite: Any, saved_finite: Any) -> None:
        if not bool(origin):
            return
        err = _error(self.op, self.index, self.shapes, self.inputs, bad, nan, grad_out_finite, saved_finite)
        _remember(err, raised=self.may_raise)
        if self.may_raise:
            raise err


def _make_error(site, index, inputs, bad, nan, grad_out_finite, saved_finite) -> AnomalyError:
    return _error(site.name, index, _describe(site), inputs, bad, nan, grad_out_finite, saved_finite)


def _error(op, index, shapes, inputs, bad, nan, grad_out_finite, saved_finite) -> AnomalyError:
    bad = np.asarray(bad, bool).reshape(-1)
    nan = np.asarray(nan, bool).reshape(-1)
    failing = [k for k, b in zip(inputs, bad) if b]
    kind = "nan" if bool((nan & bad).any()) else "inf"
    if not bool(grad_out_finite):
        cause = CAUSE_SEED
    elif not bool(saved_finite):
        cause = CAUSE_FORWARD
    else:
        cause = CAUSE_RULE
    return AnomalyError(op, index, shapes, failing, kind, cause)


def _finite(x: Any) -> Any:
    if x is None:
        return True
    if isinstance(x, tuple):  # a record with several outputs
        flags = [jnp.all(jnp.isfinite(g)) for g in x if g is not None]
        return jnp.all(jnp.stack(flags)) if flags else True
    return jnp.all(jnp.isfinite(x))


def _saved_finite(site: runner.Site) -> Any:
    flags = []
    for value in site.saved_arrays().values():
        for v in value if isinstance(value, tuple) else (value,):
            dtype = getattr(v, "dtype", None)
            if dtype is not None and jnp.issubdtype(dtype, jnp.inexact):
                flags.append(jnp.all(jnp.isfinite(v)))
    if not flags:
        return True
    if not any(isinstance(f, jax.core.Tracer) for f in flags):
        return all(bool(f) for f in flags)
    return jnp.all(jnp.stack(flags))


def _describe(site: runner.Site) -> list[str]:
    out = []
    for a in site.avals:
        if a is None:
            out.append("scalar")
        else:
            shape, dtype = a
            out.append(f"{np.dtype(dtype).name}{list(shape)}")
    return out


def _escape(msg: str) -> str:
    return msg.replace("{", "{{").replace("}", "}}")


# ---------------------------------------------------------------------------
# turning JAX's runtime errors back into AnomalyError inside detect_anomaly
# ---------------------------------------------------------------------------

_LOCK = threading.Lock()
_COUNT = itertools.count()
_REPORTS: collections.deque[tuple[int, AnomalyError]] = collections.deque(maxlen=64)  # by callbacks
_TAKEN: set[int] = set()  # reports already raised
_CHECKIFY: collections.OrderedDict[str, AnomalyError] = collections.OrderedDict()  # by message


def _report_count() -> int:
    with _LOCK:
        return _REPORTS[-1][0] + 1 if _REPORTS else 0


def _remember(err: AnomalyError, raised: bool) -> None:
    with _LOCK:
        k = next(_COUNT)
        _REPORTS.append((k, err))
        _TAKEN.intersection_update({j for j, _ in _REPORTS})
        if raised:  # raised by the callback itself: nothing left pending
            _TAKEN.add(k)


def _register(msg: str, err: AnomalyError) -> None:
    with _LOCK:
        _CHECKIFY[msg] = err
        _CHECKIFY.move_to_end(msg)
        while len(_CHECKIFY) > 256:
            _CHECKIFY.popitem(last=False)


def _from_runtime_error(exc: BaseException) -> AnomalyError | None:
    """The AnomalyError behind a JAX runtime error (a raising callback or a
    thrown checkify error), as a fresh exception; None for anything else."""
    if isinstance(exc, AnomalyError):
        return None  # raised directly (eager): let it propagate as is
    text = str(exc)
    if "rumus_fx anomaly:" not in text:
        return None
    with _LOCK:
        for k, err in reversed(_REPORTS):
            if str(err) in text:
                _TAKEN.add(k)
                return AnomalyError(*err.__reduce__()[1])
        for msg, err in reversed(_CHECKIFY.items()):
            if msg in text:
                return AnomalyError(*err.__reduce__()[1])
    return None


class _DropOwnCallbackErrors(logging.Filter):
    """JAX logs every exception raised in a debug callback with its traceback;
    ours are re-raised with a clear message, so skip that log record."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, AnomalyError)


# the logger of the module that runs debug callbacks (and logs their exceptions)
logging.getLogger(jax.debug.callback.__module__).addFilter(_DropOwnCallbackErrors())
