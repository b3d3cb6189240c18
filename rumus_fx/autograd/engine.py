"""Backward entry points: seeds -> the tape's walk -> gradients.

``gradients`` is what ``Tape.backward``, ``grad``, ``value_and_grad`` and
``vjp`` call; ``run_backward`` chooses how the walk runs: rule by rule
(``autograd/walk.py``, Note [Backward walk]) or, eagerly, as one compiled
program when the tape's signature repeats (``autograd/whole_tape.py``, Note
[Whole-tape backward]). Control flows one way: engine -> whole_tape -> walk ->
runner -> the records' rules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from .. import lazy, sharding
from ..eager import zeros_like_value
from ..errors import AutogradError
from ..tensor import Tensor, is_leaf_id
from . import whole_tape
from .runner import anomaly_on
from .walk import Rule, walk

if TYPE_CHECKING:  # typing only: tape.py builds on this module
    from .tape import TapeEntry

# backward(create_graph=True): set by rumus_fx.lift (which builds on this
# package) to its recorded walk, Note [Create graph] in rumus_fx/lift/higher.py
CREATE_GRAPH: Callable[..., dict[int, Any]] | None = None


def run_backward(
    entries: Sequence[TapeEntry],
    seeds: dict[int, jax.Array],
    keep: set[int] | None = None,
    foreign: Callable[[int], None] | None = None,
    rule: Rule | None = None,
) -> dict[int, jax.Array]:
    """The reverse walk (``walk``); eagerly, a tape whose signature repeats runs
    as one compiled program (Note [Whole-tape backward] in autograd/whole_tape.py)."""
    if rule is not None or anomaly_on() or sharding.RESHARD_HOOK is not None:
        return walk(entries, seeds, keep, foreign, rule=rule)
    return whole_tape.run(entries, seeds, keep, foreign)


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
            elif (shd := sharding.sharding_of(like)) is not None:
                g = sharding.zeros(like.shape, like.dtype, shd)
            else:
                g = zeros_like_value(like)
        out.append(g)
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
                return zeros_like_value(key)
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
