"""The tape's reverse walk.

Note [Backward walk]
~~~~~~~~~~~~~~~~~~~~
Entries are appended in execution order, so every entry comes after the entries
that produced its inputs; walking the list backwards is a topological order of
the reverse graph (the same order rumus derives with Kahn's algorithm). For each
entry whose output received a gradient we (1) check the record's version
snapshots, (2) run its hand-written rule and check what it returned
(``runner.apply_rule``, Note [One rule runner]: the step a lifted program's walk
shares), and (3) accumulate the gradients by grad id. Entries whose output got
no gradient are dead branches and are skipped. After the walk, every id that
received a gradient but that no entry produced is handed to a ``foreign`` hook:
a leaf is fine, a recorded result means its history lies on another tape (a
nested one), which would silently drop the gradients behind it, so
``Tape.backward`` and the transforms raise there. Nothing here calls JAX's
autodiff: records are plain jnp/lax/Pallas.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax

from .runner import anomaly_walk, apply_rule

if TYPE_CHECKING:  # typing only: tape.py builds on this module
    from .tape import TapeEntry

# how ``backward(create_graph=True)`` runs a record's rule: rule(entry, grad_out, needs)
Rule = Callable[["TapeEntry", Any, tuple[bool, ...]], tuple]


def walk(
    entries: Sequence[TapeEntry],
    seeds: dict[int, jax.Array],
    keep: set[int] | None = None,
    foreign: Callable[[int], None] | None = None,
    live: list[int] | None = None,
    rule: Rule | None = None,
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
    ``engine.check_history``). ``live``, when given, collects the indices of the
    entries whose rule ran.

    ``rule(entry, grad_out, needs)`` replaces how a record's rule is run
    (``backward(create_graph=True)`` differentiates the rules through the
    values they saved, Note [Create graph] in rumus_fx/lift/higher.py)."""
    with anomaly_walk():
        grads = _walk(entries, seeds, keep, live, rule)
    if foreign is not None:
        produced = {o for e in entries for o in e.outputs}
        for gid in [g for g in grads if g not in produced and g not in seeds and (keep is None or g not in keep)]:
            foreign(gid)
    if keep is not None:
        grads = {g: v for g, v in grads.items() if g in keep}
    return grads


def _walk(
    entries: Sequence[TapeEntry],
    seeds: dict[int, jax.Array],
    keep: set[int] | None,
    live: list[int] | None,
    rule: Rule | None,
) -> dict[int, jax.Array]:
    grads: dict[int, jax.Array] = dict(seeds)
    for index in range(len(entries) - 1, -1, -1):
        entry = entries[index]
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
        call = None if rule is None else (lambda g, needs, entry=entry: rule(entry, g, needs))
        in_grads = apply_rule(op, grad_out, needs, entry.input_avals, entry.input_shardings, where=index, call=call)
        if keep is not None:
            for o in entry.outputs:
                if o not in keep:
                    grads.pop(o, None)
        for gid, g in zip(entry.inputs, in_grads):
            if g is not None:
                prev = grads.get(gid)
                grads[gid] = g if prev is None else prev + g
    return grads
