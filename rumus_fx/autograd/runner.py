"""Running one record's backward rule: the step both reverse walks share.

Note [One rule runner]
~~~~~~~~~~~~~~~~~~~~~~
Two walks run backward rules: the tape's (``autograd/walk.py``, over tape
entries) and a lifted program's (``Program.backward`` in
``lift/program.py``, over the primitive records of one lifted call). They
keep their gradients differently (by grad id; by program slot), but every
record goes through ``apply_rule`` here, so a gradient is checked the same way
wherever it comes from:

1. ``run_rule`` runs the rule: eagerly as one cached compiled call per
   (record type, static fields, shapes), which fuses the rule's elementwise
   work and pays one dispatch; under a trace (``jax.jit``, ``vmap``, ``jvp``,
   an enclosing rule) the rule is traced inline (Note [Eager compilation] in
   rumus_fx/eager.py). JAX refusing a sharding inside the rule becomes an
   ``rf.ShardingError`` naming the record.
2. The rule returned one gradient per input, else ``AutogradError``.
3. Each gradient of an input that needs one has that input's shape and dtype,
   else ``AutogradError`` naming the record ("a bug in ..."): a gradient is never
   silently reshaped or cast.
4. A gradient takes its input's explicit sharding (Note [Gradients keep their
   operand's sharding] in rumus_fx/sharding.py); a rule that left it otherwise
   is reported through ``sharding.RESHARD_HOOK``.
5. In anomaly mode, the gradients go to the one anomaly check (installed by
   rumus_fx/debug.py with ``set_anomaly_hook``), labelled with the record's tape
   index, or ``"<tape index>.<row>"`` for a row of a lifted call.

The tape's walk enters anomaly mode once per walk (``anomaly_walk``); the check's
state (a traced flag "an earlier record already failed") is threaded from record
to record. A rule run as its own compiled call starts a fresh state inside that
call and leaves the walk's as it was: a traced flag must not leak out of the
program it was traced in. Nothing here calls JAX's autodiff.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from .. import sharding
from ..eager import compiled
from ..errors import AutogradError

# The anomaly check: check(site, where, grad_out, in_grads, state) -> state, where
# ``site`` has ``name``, ``needs``, ``avals`` and ``saved_arrays()`` (Note [Anomaly
# mode] in rumus_fx/debug.py).
AnomalyCheck = Callable[[Any, Any, Any, Sequence[Any], Any], Any]


def _anomaly_off() -> AnomalyCheck | None:
    return None


_anomaly_hook: Callable[[], AnomalyCheck | None] = _anomaly_off


class AnomalyWalk:
    """Anomaly mode during one walk: the check, the walk's state, and the tape
    index of the record whose rule is running (a lifted call labels its rows
    under it)."""

    __slots__ = ("check", "index", "state")

    def __init__(self, check: AnomalyCheck):
        self.check = check
        self.index: Any = None
        self.state: Any = None


_ANOMALY_WALK: contextvars.ContextVar[AnomalyWalk | None] = contextvars.ContextVar(
    "rumus_fx_anomaly_walk", default=None
)


def set_anomaly_hook(hook: Callable[[], AnomalyCheck | None] | None) -> None:
    """Install the anomaly hook (``rumus_fx.debug`` does, when it is imported;
    None removes it). The hook is called once per backward walk and returns
    None (anomaly mode is off) or the check to run after each record's rule."""
    global _anomaly_hook
    _anomaly_hook = _anomaly_off if hook is None else hook


def anomaly_on() -> bool:
    """Whether anomaly mode is on (a walk then runs record by record)."""
    return _anomaly_hook() is not None


@contextlib.contextmanager
def anomaly_walk() -> Iterator[AnomalyWalk | None]:
    """Anomaly mode for one tape walk: its state, or None when the mode is off."""
    check = _anomaly_hook()
    if check is None:
        yield None
        return
    walk = AnomalyWalk(check)
    token = _ANOMALY_WALK.set(walk)
    try:
        yield walk
    finally:
        _ANOMALY_WALK.reset(token)


class Site:
    """A record as the anomaly check and the error messages see it."""

    __slots__ = ("avals", "name", "needs", "op")

    def __init__(self, op: Any, name: str, needs: tuple[bool, ...], avals: Sequence[Any]):
        self.op = op
        self.name = name
        self.needs = needs
        self.avals = avals

    def saved_arrays(self) -> dict[str, Any]:
        return self.op.saved_arrays()


def run_rule(op: Any, grad_out: Any, needs: tuple[bool, ...], describe: Callable[[], str] | None = None) -> tuple:
    """``op.backward(grad_out, needs)``: eagerly as one compiled call per (record
    type, static fields, shapes); under a trace inline. ``describe()``: how a
    ``ShardingError`` names the record (default: its name)."""
    try:
        return _run(op, grad_out, needs)
    except jax.errors.UnexpectedTracerError as e:
        # a user's rule (a custom_vjp bwd) read a value of a traced function that is over
        raise AutogradError(
            f"rf: the backward of {op.name if describe is None else describe()} read a traced value that "
            "leaked out of the function that made it: most often a jax.custom_vjp bwd that closes over a "
            "value computed in the lifted function (return that value from the fwd as a residual). "
            f"JAX's error: {str(e).splitlines()[0]}"
        ) from e
    except Exception as e:
        err = sharding.backward_error(e, op.name if describe is None else describe(), grad_out)
        if err is None:
            raise
        raise err from e


def _run(op: Any, grad_out: Any, needs: tuple[bool, ...]) -> tuple:
    tracer = jax.core.Tracer
    g_leaves = grad_out if isinstance(grad_out, tuple) else (grad_out,)
    if any(isinstance(g, tracer) for g in g_leaves):
        return op.backward(grad_out, needs)
    leaves, treedef = jax.tree_util.tree_flatten(op)
    if op._step is not None or any(isinstance(c, tracer) for c in leaves):
        # a lifted program's row with concrete values (its parts that a jax.vmap
        # or jax.jvp around rf.grad leaves unbatched): its step is not pytree data
        return op.backward(grad_out, needs)
    opts = op.compiler_options
    walk = _ANOMALY_WALK.get()
    outer = None if walk is None else walk.state
    if walk is not None:
        walk.state = None  # the compiled call's own (Note [One rule runner])
    try:
        if op.owns_compiled_backward:
            return op.compiled_backward(grad_out, needs, opts)
        try:
            hash(treedef)
        except TypeError:  # a static field that does not hash: jit flattens the record itself
            return compiled(_call_backward, (2,), compiler_options=opts)(op, grad_out, needs)
        return compiled(_call_flat, (0, 3), compiler_options=opts)(treedef, leaves, grad_out, needs)
    finally:
        if walk is not None:
            walk.state = outer


def _call_backward(op: Any, g: Any, needs: tuple[bool, ...]) -> tuple:
    return op.backward(g, needs)


def _call_flat(treedef: Any, leaves: list[Any], g: Any, needs: tuple[bool, ...]) -> tuple:
    return treedef.unflatten(leaves).backward(g, needs)


def apply_rule(
    op: Any,
    grad_out: Any,
    needs: tuple[bool, ...],
    avals: Sequence[Any] | None,
    shardings: Sequence[Any] | None = None,
    *,
    name: str | None = None,
    where: int | None = None,
    row: int | None = None,
    call: Callable[[Any, tuple[bool, ...]], tuple] | None = None,
    describe: Callable[[], str] | None = None,
) -> list[Any]:
    """Run ``op``'s rule and check what it returned (Note [One rule runner]):
    one gradient per input, None where the input needs none or the rule gave
    none.

    ``avals``: per input, its (shape, dtype) (None or empty: not checked);
    ``shardings``: per input, its explicit sharding or None; ``name``: the
    record in messages (default ``op.name``); ``where``: the record's tape
    index (anomaly mode labels its check with it); ``row``: instead, the row of
    a lifted call, labelled ``"<tape index>.<row>"`` under the entry running
    that call (neither: no anomaly check); ``call(grad_out, needs)``
    replaces how the rule runs (``backward(create_graph=True)``)."""
    name = op.name if name is None else name
    walk = _ANOMALY_WALK.get() if where is not None or row is not None else None
    if walk is not None and where is not None:
        walk.index = where  # the rows of a lifted call are labelled under it
    in_grads = run_rule(op, grad_out, needs, describe) if call is None else call(grad_out, needs)
    if len(in_grads) != len(needs):
        raise AutogradError(f"{name} returned {len(in_grads)} gradients for {len(needs)} inputs")
    out: list[Any] = []
    for k, (need, g) in enumerate(zip(needs, in_grads)):
        if not need or g is None:
            out.append(None)
            continue
        if avals:
            _validate(name, k, g, avals[k])
        if shardings:
            g = conform(name, k, g, shardings[k])
        out.append(g)
    if walk is not None:
        label = where if row is None else f"{walk.index}.{row}"
        walk.state = walk.check(Site(op, name, needs, avals or ()), label, grad_out, out, walk.state)
    return out


def _validate(name: str, k: int, g: Any, aval: Any) -> None:
    if aval is None:
        return
    shape, dtype = aval
    if tuple(g.shape) != tuple(shape) or np.dtype(g.dtype) != np.dtype(dtype):
        raise AutogradError(
            f"{name} returned a gradient of {np.dtype(g.dtype).name}{list(g.shape)} for its "
            f"input {k}, which is {np.dtype(dtype).name}{list(shape)} (a bug in {name})"
        )


def conform(name: str, k: int, g: Any, wanted: Any) -> Any:
    """``g`` with its input's explicit sharding; a rule that left it otherwise
    is reported through ``RESHARD_HOOK``."""
    out = sharding.conform(g, wanted)
    if out is not g and sharding.RESHARD_HOOK is not None:
        sharding.RESHARD_HOOK(name, k, jax.typeof(g).sharding, wanted)
    return out
