"""The backward engine: a reverse walk over tape entries.

Note [Backward walk]
~~~~~~~~~~~~~~~~~~~~
Entries are appended in execution order, so every entry comes after the entries
that produced its inputs; walking the list backwards is a topological order of
the reverse graph (the same order rumus derives with Kahn's algorithm). For each
entry whose output received a gradient we (1) check the record's version
snapshots, (2) call its hand-written backward rule (eagerly as one cached
compiled call, see ``record.run_backward_rule``), (3) check that it returned
one gradient per input with that input's shape and dtype, and (4) accumulate the
gradients by grad id. Entries whose output got no gradient are dead branches and
are skipped. After the walk, every id that received a gradient but that no entry
produced is handed to a ``foreign`` hook: a leaf is fine, a recorded result means
its history lies on another tape (a nested one), which would silently drop the
gradients behind it, so ``Tape.backward`` and the transforms raise there. Nothing
here calls JAX's autodiff: records are plain jnp/lax/Pallas.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import lazy, sharding
from ..errors import AutogradError
from ..tensor import Tensor, is_leaf_id
from . import whole_tape
from .record import run_backward_rule as _run_rule

if TYPE_CHECKING:  # typing only: tape.py builds on this module
    from .tape import TapeEntry

# A check run on each record's input gradients during a walk:
# check(entry, index, grad_out, in_grads, state) -> state (Note [Anomaly mode]).
AnomalyCheck = Callable[[Any, int, Any, Sequence[Any], Any], Any]


def _anomaly_off() -> AnomalyCheck | None:
    return None


_anomaly_hook: Callable[[], AnomalyCheck | None] = _anomaly_off
# in anomaly mode, while a record's rule runs: [its tape index, the walk's
# anomaly state], which a lifted call's rule reads and updates (rumus_fx/debug.py)
ANOMALY_WALK: contextvars.ContextVar[list | None] = contextvars.ContextVar("rumus_fx_anomaly_walk", default=None)


def set_anomaly_hook(hook: Callable[[], AnomalyCheck | None] | None) -> None:
    """Install the engine's anomaly hook (``rumus_fx.debug`` does, when it is
    imported; None removes it). The hook is called once per backward walk and
    returns None (anomaly mode is off) or the check to run after each record's
    backward rule; see Note [Anomaly mode] in rumus_fx/debug.py."""
    global _anomaly_hook
    _anomaly_hook = _anomaly_off if hook is None else hook

# backward(create_graph=True): set by rumus_fx.lift (which builds on this
# package) to its recorded walk, Note [Create graph] in rumus_fx/lift/higher.py
CREATE_GRAPH: Callable[..., dict[int, Any]] | None = None


def run_backward(
    entries: Sequence[TapeEntry],
    seeds: dict[int, jax.Array],
    keep: set[int] | None = None,
    foreign: Callable[[int], None] | None = None,
    rule: Callable[[TapeEntry, Any, tuple[bool, ...]], tuple] | None = None,
) -> dict[int, jax.Array]:
    """The reverse walk (``walk``); eagerly, a tape whose signature repeats runs
    as one compiled program (Note [Whole-tape backward] in autograd/whole_tape.py)."""
    if rule is not None or _anomaly_hook() is not None or sharding.RESHARD_HOOK is not None:
        return walk(entries, seeds, keep, foreign, rule=rule)
    return whole_tape.run(entries, seeds, keep, foreign, walk)


def walk(
    entries: Sequence[TapeEntry],
    seeds: dict[int, jax.Array],
    keep: set[int] | None = None,
    foreign: Callable[[int], None] | None = None,
    live: list[int] | None = None,
    rule: Callable[[TapeEntry, Any, tuple[bool, ...]], tuple] | None = None,
) -> dict[int, jax.Array]:
    """Walk ``entries`` in reverse from the seed gradients; gradients by grad id.

    With ``keep``, only those ids' gradients are returned and every other
    gradient is dropped as soon as its producing record has used it (its
    consumers all come later on the tape, so it is final by then): eager
    backward then holds at most the gradients still in flight, not one per
    intermediate tensor.

    ``foreign(grad_id)`` is called, after the walk, for every id outside
    ``keep`` that received a gradient although no entry here produced it and it
    is no seed: a leaf, or a tensor whose history lies on another tape (see
    ``check_history``). ``live``, when given, collects the indices of the
    entries whose rule ran.

    ``rule(entry, grad_out, needs)`` replaces how a record's rule is run
    (``backward(create_graph=True)`` differentiates the rules through the
    values they saved, Note [Create graph] in rumus_fx/lift/higher.py)."""
    grads: dict[int, jax.Array] = dict(seeds)
    produced: set[int] = set()
    anomaly = _anomaly_hook()  # None unless anomaly mode is on
    anomaly_state = None  # traced "an earlier record failed" flag (see rumus_fx.debug)
    for index in range(len(entries) - 1, -1, -1):
        entry = entries[index]
        produced.update(entry.outputs)
        op = entry.op
        if op.multi_output:  # one gradient (or None) per output
            grad_out = tuple(grads.get(o) for o in entry.outputs)
            if all(g is None for g in grad_out):
                continue
        else:
            grad_out = grads.get(entry.outputs[0])
            if grad_out is None:
                continue  # dead branch: nothing downstream needs this op
        op.check_versions()
        if live is not None:
            live.append(index)
        needs = tuple(i is not None for i in entry.inputs)
        if anomaly is None:
            in_grads = run_backward_rule(op, grad_out, needs) if rule is None else rule(entry, grad_out, needs)
        else:  # a lifted call checks its primitives' rules inside (Note [Anomaly mode] in rumus_fx/debug.py)
            walk = [index, anomaly_state]
            token = ANOMALY_WALK.set(walk)
            try:
                in_grads = run_backward_rule(op, grad_out, needs) if rule is None else rule(entry, grad_out, needs)
            finally:
                ANOMALY_WALK.reset(token)
            anomaly_state = walk[1]
        if keep is not None:
            for o in entry.outputs:
                if o not in keep:
                    grads.pop(o, None)
        if len(in_grads) != len(entry.inputs):
            raise AutogradError(f"{op.name} returned {len(in_grads)} gradients for {len(entry.inputs)} inputs")
        for k, (gid, g) in enumerate(zip(entry.inputs, in_grads)):
            if gid is None or g is None:
                continue
            _validate(op.name, k, g, entry.input_avals[k] if entry.input_avals else None)
            if entry.input_shardings:
                g = _conform(op.name, k, g, entry.input_shardings[k])
            prev = grads.get(gid)
            grads[gid] = g if prev is None else prev + g
        if anomaly is not None:  # Note [Anomaly mode] in rumus_fx/debug.py
            anomaly_state = anomaly(entry, index, grad_out, in_grads, anomaly_state)
    if foreign is not None:
        for gid in [g for g in grads if g not in produced and g not in seeds and (keep is None or g not in keep)]:
            foreign(gid)
    if keep is not None:
        grads = {g: v for g, v in grads.items() if g in keep}
    return grads


def gradients(
    entries: Sequence[TapeEntry],
    seeds: Sequence[tuple[int | None, Any]],
    wrt: Sequence[tuple[Any, Any]] | None = None,
    foreign: Callable[[int], None] | None = None,
    create_graph_on: Any = None,
) -> Any:
    """The one backward entry point of ``Tape.backward``, ``grad``,
    ``value_and_grad`` and ``vjp``: seeds -> walk -> gradients.

    ``seeds`` pairs an output's grad id (None: untracked, skipped) with its
    cotangent; several cotangents for one id add up. Without ``wrt`` the result
    is every gradient by grad id; with ``wrt`` (pairs of a tracked leaf Tensor,
    or None for an undifferentiated one, and an array like it) one gradient per
    pair: zeros (keeping the leaf's sharding) where none arrived, ``float0``
    zeros for None. ``create_graph_on``: the tape the walk is recorded on
    (``backward(create_graph=True)``, Note [Create graph] in
    rumus_fx/lift/higher.py); the gradients are then Tensors."""
    lazy.flush_for(e.op for e in entries)  # deferred forward values, and the records that saved them (rumus_fx/lazy.py)
    by_id: dict[int, Any] = {}
    for gid, ct in seeds:
        if gid is not None:
            by_id[gid] = ct if gid not in by_id else by_id[gid] + ct
    keep = None if wrt is None else {t.grad_id for t, _ in wrt if t is not None}
    if not by_id:
        grads: dict[int, Any] = {}
    elif create_graph_on is not None:
        if CREATE_GRAPH is None:  # pragma: no cover - rumus_fx imports rumus_fx.lift
            raise AutogradError("backward(create_graph=True) needs rumus_fx.lift")
        grads = CREATE_GRAPH(entries, by_id, create_graph_on, foreign)
    else:
        grads = run_backward(entries, by_id, keep, foreign)
    if wrt is None:
        return grads
    out = []
    for t, like in wrt:
        g = grads.get(t.grad_id) if t is not None else None
        if g is None:
            if t is None:
                g = np.zeros(like.shape, jax.dtypes.float0)
            else:
                g = sharding.zeros(like.shape, like.dtype, sharding.sharding_of(like))
        out.append(g)
    return out


def run_backward_rule(op: Any, grad_out: Any, needs: tuple[bool, ...]) -> tuple:
    """The record's rule; JAX refusing a sharding in it becomes an
    ``rf.ShardingError`` naming the record (rumus_fx/sharding.py)."""
    try:
        return _run_rule(op, grad_out, needs)
    except Exception as e:
        err = sharding.backward_error(e, op.name, grad_out)
        if err is None:
            raise
        raise err from e


def _conform(name: str, k: int, g: Any, wanted: Any) -> Any:
    """``g`` with its input's explicit sharding (Note [Gradients keep their
    operand's sharding] in rumus_fx/sharding.py)."""
    out = sharding.conform(g, wanted)
    if out is not g and sharding.RESHARD_HOOK is not None:
        sharding.RESHARD_HOOK(name, k, jax.typeof(g).sharding, wanted)
    return out


CROSS_TAPE_MESSAGE = (
    "backward reached a tensor (grad_id={gid}) that is the result of an op recorded on "
    "another tape (a nested rf.Tape, or a tape of rf.grad/vjp): this tape does not "
    "hold its history, so the gradients behind it would silently be zero. Record the "
    "whole computation on one tape (nested tapes record into the innermost only), or "
    "call backward on the tape that recorded it."
)


def check_history(gid: int) -> None:
    """``foreign`` hook of ``Tape.backward``: a gradient may stop at a leaf,
    never at a recorded result that another tape holds."""
    if not is_leaf_id(gid):
        raise AutogradError(CROSS_TAPE_MESSAGE.format(gid=gid))


def _validate(name: str, k: int, g: Any, aval: Any) -> None:
    if aval is None:
        return
    shape, dtype = aval
    if tuple(g.shape) != tuple(shape) or np.dtype(g.dtype) != np.dtype(dtype):
        raise AutogradError(
            f"{name} returned a gradient of {np.dtype(g.dtype).name}{list(g.shape)} for its "
            f"input {k}, which is {np.dtype(dtype).name}{list(shape)} (a bug in {name})"
        )


class GradientStore(Mapping):
    """Gradients by grad id, returned by ``Tape.backward``.

    ``grads[tensor]`` gives the gradient of a tracked tensor (zeros of its shape
    when it received none, as ``jax.grad`` gives for unused inputs);
    ``grads.get(grad_id)`` gives it by id, or None when there is no gradient.
    """

    def __init__(self, grads: dict[int, jax.Array]):
        self._grads = grads

    def __getitem__(self, key: Any) -> jax.Array:
        if isinstance(key, Tensor):
            if key.grad_id is None:
                raise KeyError("this Tensor is not tracked (requires_grad=False), so it has no gradient")
            g = self._grads.get(key.grad_id)
            if g is None:
                return jnp.zeros(key.shape, key.dtype)
            return g
        return self._grads[key]

    def get(self, key: Any, default: Any = None) -> Any:
        if isinstance(key, Tensor):
            key = key.grad_id
        return self._grads.get(key, default)

    def __contains__(self, key: Any) -> bool:
        if isinstance(key, Tensor):
            key = key.grad_id
        return key in self._grads

    def __iter__(self) -> Iterator[int]:
        return iter(self._grads)

    def __len__(self) -> int:
        return len(self._grads)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}: {np.dtype(v.dtype).name}{list(v.shape)}" for k, v in self._grads.items())
        return f"GradientStore({{{inner}}})"
