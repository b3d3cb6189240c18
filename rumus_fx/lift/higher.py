"""``tape.backward(loss, create_graph=True)``: the backward walk recorded on a tape.

Note [Create graph]
~~~~~~~~~~~~~~~~~~~
A record's rule is a jnp/lax function of the arrays it saved and of its output's
gradient. To differentiate the backward pass, those arrays must be seen as
functions of the tracked tensors they came from. Each ``TapeEntry`` knows where
its record's saved arrays came from (``provenance``: which ones *are* the value
of one of the op's inputs or outputs, by identity, filled in when the entry is
appended; any other saved array of an untracked input is a constant), so the
whole walk is one pure function of those tensors' values and of the seeds:

    walk(values by grad id, seeds) -> gradients by grad id

which runs the same engine walk (``engine.run_backward``) with each record's
saved arrays replaced by the walk's inputs. ``rf.lift`` records it on the
enclosing tape (the tape's own when no other one is active): every primitive of
every rule becomes a primitive record there, so the gradients it returns are
tracked Tensors, differentiable again to any order. No second set of rules.

Three kinds of record need more than substitution:

* Records that save values *computed* in the forward pass (a class lists them in
  ``derived_fields``: layer/batch norm statistics, attention's log-sum-exp)
  rebuild them from their substituted inputs with ``derive(entry)``. The rebuilt
  value is ``saved + (f(x) - stop_gradient(f(x)))``: exactly the saved value,
  with the derivatives of ``f``.
* A lifted call (``LiftedBackward``) keeps intermediate values of its program.
  The walk runs the program's forward again on the call's inputs (from its
  residuals, or from the weak references its entry keeps) and takes the
  residuals from there, with the same exact-value form.
* A record whose derived values cannot be rebuilt (``CrossEntropyBackward``
  keeps ``softmax - onehot``, not the logits), or a lifted call whose inputs were
  released, raises ``AutogradError`` when the walk reaches it: never a gradient
  with silently missing terms. Nested transforms (``rf.grad(rf.grad(f))``),
  which trace the forward again, work for every op.

Version snapshots: the walk checks every record's snapshots as the first-order
walk does, and the recorded entry keeps them, so an in-place write between the
two backward passes to data the first one read is a ``VersionMismatch``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..autograd import engine
from ..autograd.record import exact_value
from ..autograd.tape import Tape, TapeEntry, recording
from ..errors import AutogradError
from ..tensor import Tensor
from .lifted_record import LiftedBackward
from .tracing import call_lifted


def _field(op: Any, name: str, index: int | None) -> Any:
    v = getattr(op, name)
    return v if index is None else v[index]


def _lifted_inputs(entry: TapeEntry) -> list[Any]:
    """The concrete input values of a lifted call, None where released."""
    op = entry.op
    program = op.program
    out: list[Any] = []
    for k, slot in enumerate(program.in_slots):
        r = program.residual_index.get(slot)
        if r is not None:
            out.append(op.residuals[r])
        elif k < len(entry.replay):
            out.append(entry.replay[k]())
        else:
            out.append(None)
    return out


def recorded_backward(
    entries: Sequence[TapeEntry],
    seeds: dict[int, Any],
    target: Tape,
    foreign: Callable[[int], None] | None = None,
) -> dict[int, Tensor]:
    """The walk of ``engine.run_backward`` recorded on ``target`` (Note [Create
    graph]); gradients by grad id, as tracked Tensors where they depend on a
    tracked value."""
    entries = list(entries)
    values: dict[int, Any] = {}
    placeholders: list[tuple[TapeEntry, int]] = []
    for e in entries:
        if isinstance(e.op, LiftedBackward):
            for gid, v in zip(e.inputs, _lifted_inputs(e)):
                if gid is not None and v is not None:
                    values.setdefault(gid, v)
        else:
            for name, index, gid in e.provenance:
                if gid is not None:
                    values.setdefault(gid, _field(e.op, name, index))
            placeholders.extend((e, k) for k in type(e.op).derive_inputs if k < len(e.inputs))
    for e, k in placeholders:
        # an input ``derive`` differentiates through without reading its value
        gid = e.inputs[k]
        if gid is not None and gid not in values:
            shape, dtype = e.input_avals[k]
            values[gid] = jnp.zeros(shape, dtype)
    snapshots = tuple(s for e in entries for s in e.op.snapshots())

    def walk(env: dict[int, Any], seed_values: dict[int, Any]) -> dict[int, Any]:
        def rule(entry: TapeEntry, g: Any, needs: tuple[bool, ...]) -> tuple:
            return _substituted(entry, env).backward(g, needs)

        return engine.run_backward(entries, dict(seed_values), foreign=foreign, rule=rule)

    inputs = {gid: Tensor._wrap(v, gid) for gid, v in values.items()}
    # tracked seeds are inputs of the recorded walk; the others are constants of it
    tracked_seeds = {g: s for g, s in seeds.items() if isinstance(s, Tensor) and s.grad_id is not None}
    constant_seeds = {g: s.value if isinstance(s, Tensor) else s for g, s in seeds.items() if g not in tracked_seeds}

    def walk_with_constants(env: dict[int, Any], seed_values: dict[int, Any]) -> dict[int, Any]:
        return walk(env, {**constant_seeds, **seed_values})

    with recording(target):  # the entry keeps the first walk's snapshots (Note [Create graph])
        return call_lifted(
            walk_with_constants, (inputs, tracked_seeds), "tape.backward(create_graph=True)", target, snapshots
        )


def _substituted(entry: TapeEntry, env: dict[int, Any]) -> Any:
    """``entry.op`` with its saved arrays as functions of the walk's inputs."""
    op = entry.op
    if isinstance(op, LiftedBackward):
        return _replayed(entry, env)
    fields: dict[str, Any] = {}
    for name, index, gid in entry.provenance:
        if gid is None or gid not in env:
            continue
        if index is None:
            fields[name] = env[gid]
        else:
            items = list(fields.get(name, getattr(op, name)))
            items[index] = env[gid]
            fields[name] = tuple(items)
    rec = dataclasses.replace(op, **fields) if fields else op
    if getattr(type(op), "derived_fields", ()):
        derive = getattr(rec, "derive", None)
        if derive is None:
            raise AutogradError(
                f"tape.backward(create_graph=True): {op.name} saves values computed in its forward "
                f"pass ({', '.join(type(op).derived_fields)}) from which the inputs it depends on "
                "cannot be recovered, so its backward cannot be differentiated. Take the inner "
                "gradient with rf.grad / rf.vjp inside the outer function instead: nested "
                "transforms trace the forward again and differentiate every op to any order."
            )
        rec = derive(entry, env)
    return rec


def _replayed(entry: TapeEntry, env: dict[int, Any]) -> Any:
    """A lifted call's record with its residuals recomputed from its inputs."""
    op = entry.op
    program = op.program
    concrete = _lifted_inputs(entry)
    inputs = []
    for k, (gid, v) in enumerate(zip(entry.inputs, concrete)):
        if gid is not None and gid in env:
            inputs.append(env[gid])
        elif v is not None:
            inputs.append(v)
        else:
            raise AutogradError(
                f"tape.backward(create_graph=True): input {k} of {op.label} was released before "
                "backward, and the lifted call did not keep it (its backward reads only values "
                "computed from it): keep a reference to it until backward, or take the inner "
                "gradient with rf.grad / rf.vjp inside the outer function instead."
            )
    _, (residuals, extras) = program.run(inputs)
    residuals = tuple(exact_value(s, r) for s, r in zip(op.residuals, residuals))
    extras = jax.tree_util.tree_map(exact_value, op.extras, extras)
    return dataclasses.replace(op, residuals=residuals, extras=extras)
