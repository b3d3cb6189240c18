"""The tape: its entries, backward, and printing. The recording context
(which tape records, ``no_grad``) lives in ``rumus_fx/recording.py`` and is
re-exported here."""

from __future__ import annotations

import contextvars
import dataclasses
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from .. import lazy
from ..eager import ones_like_value
from ..errors import AutogradError
from ..recording import current_tape as current_tape
from ..recording import enter_tape, exit_tape
from ..recording import no_grad as no_grad
from ..recording import recording as recording
from ..recording import suspend_recording as suspend_recording
from ..storage import nbytes_of
from ..tensor import Tensor, is_leaf_id
from .engine import GradientStore, check_history, gradients
from .record import Record

# ``memory_budget``: (check, run) registered by rumus_fx/lift/budget.py, which builds
# on this package (Note [Memory budget] there); ``import rumus_fx`` always sets it
BUDGET: tuple[Any, Any] | None = None


def set_budget(check: Any, run: Any) -> None:
    """Register the memory budget's validation and its budgeted run."""
    global BUDGET
    BUDGET = (check, run)


def budget_hooks() -> tuple[Any, Any]:
    if BUDGET is None:  # pragma: no cover - rumus_fx/__init__ imports rumus_fx.lift
        raise AutogradError("memory_budget needs rumus_fx.lift: import rumus_fx")
    return BUDGET


@dataclasses.dataclass(frozen=True, eq=False)
class TapeEntry:
    """One recorded op: its record, the grad ids of its inputs (None for inputs
    that are not tracked) and of its outputs, the inputs'/outputs' avals, and
    the inputs' explicit shardings (None where not sharded over Explicit mesh
    axes; see Note [Gradients keep their operand's sharding])."""

    op: Record
    inputs: tuple[int | None, ...]
    outputs: tuple[int, ...]
    input_avals: tuple[tuple[tuple[int, ...], Any] | None, ...] = ()
    output_avals: tuple[tuple[tuple[int, ...], Any], ...] = ()
    input_shardings: tuple[Any, ...] = ()
    # Note [Create graph] (rumus_fx/lift/higher.py): which saved arrays of ``op``
    # are values of its inputs/outputs (``record.provenance_of``), and for a
    # lifted call weak references to its input values, so that
    # ``backward(create_graph=True)`` can differentiate the rule through them
    provenance: tuple[tuple[str, int | None, int | None], ...] = ()
    replay: tuple[Any, ...] = ()


_ENTRY_FIELDS = tuple(f.name for f in dataclasses.fields(TapeEntry))
assert _ENTRY_FIELDS == (
    "op", "inputs", "outputs", "input_avals", "output_avals", "input_shardings", "provenance", "replay"
)  # fmt: skip
_new_object = object.__new__


def new_entry(
    op: Record,
    inputs: tuple,
    outputs: tuple,
    input_avals: tuple,
    output_avals: tuple,
    input_shardings: tuple,
    provenance: Any,
    replay: tuple,
) -> TapeEntry:
    """``TapeEntry(...)`` (all eight fields, in order) without the frozen
    dataclass's per-field ``object.__setattr__``: the entry's ``__dict__`` is
    filled directly (Note [Eager fast path] in rumus_fx/ops/_core.py)."""
    entry = _new_object(TapeEntry)
    d = entry.__dict__
    d["op"] = op
    d["inputs"] = inputs
    d["outputs"] = outputs
    d["input_avals"] = input_avals
    d["output_avals"] = output_avals
    d["input_shardings"] = input_shardings
    d["provenance"] = provenance
    d["replay"] = replay
    return entry


class Tape:
    """Records one ``TapeEntry`` per differentiable op run inside ``with Tape():``.

    >>> import jax.numpy as jnp, rumus_fx as rf
    >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 2))
    >>> with rf.Tape() as tape:
    ...     w = rf.tensor(jnp.full((3, 2), 0.5), requires_grad=True)
    ...     loss = rf.mse_loss(x @ w, y)
    >>> grads = tape.backward(loss)
    >>> grads[w]
    Array([[1.5, 1.5],
           [1.5, 1.5],
           [1.5, 1.5]], dtype=float32)
    """

    def __init__(self, *, memory_budget: int | float | None = None) -> None:
        self._entries: list[TapeEntry] = []
        self._tokens: list[contextvars.Token] = []
        self._consumed = False
        self._budget: int | float | None = None
        self._budget_runs = 0
        if memory_budget is not None:
            self._budget = budget_hooks()[0](memory_budget)

    @property
    def memory_budget(self) -> int | float | None:
        """The budget for saved activations given to ``Tape(memory_budget=...)``
        (bytes, or a fraction of the unbudgeted saved bytes), or None."""
        return self._budget

    def run(self, fun: Any, *args: Any, **kwargs: Any) -> Any:
        """``fun(*args, **kwargs)`` recorded on this tape (which must be the
        recording one: inside ``with tape:``). On a tape made with
        ``memory_budget=`` the activations ``fun`` saves for backward are
        planned to that budget: segments of ``fun`` are rematerialised as
        ``rf.checkpoint`` does (Note [Memory budget] in rumus_fx/lift/budget.py).
        Ops recorded directly inside ``with tape:`` are not planned."""
        if current_tape() is not self:
            raise AutogradError("tape.run must be called inside `with tape:` (this tape is not the recording one)")
        if self._budget is None:
            return fun(*args, **kwargs)
        self._budget_runs += 1
        return budget_hooks()[1](fun, args, kwargs, self._budget, getattr(fun, "__name__", "fun"), records=False)

    # -- recording -----------------------------------------------------------
    def __enter__(self) -> Tape:
        self._tokens.append(enter_tape(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        exit_tape(self._tokens.pop())

    def append(
        self,
        op: Record,
        inputs: tuple[int | None, ...],
        outputs: tuple[int, ...],
        input_avals: tuple = (),
        output_avals: tuple = (),
        input_shardings: tuple = (),
        provenance: tuple = (),
        replay: tuple = (),
    ) -> None:
        """Append one entry; ``input_shardings`` (``rumus_fx.sharding.sharding_of``
        of each input, or ()) lets the engine check that the record's gradients
        keep their inputs' explicit shardings; ``provenance``/``replay``: see
        ``TapeEntry``."""
        self._entries.append(
            new_entry(op, inputs, outputs, input_avals, output_avals, input_shardings, provenance, replay)
        )

    # -- inspection ----------------------------------------------------------
    @property
    def entries(self) -> tuple[TapeEntry, ...]:
        lazy.flush_for(e.op for e in self._entries)  # records show arrays, not deferred values (rumus_fx/lazy.py)
        return tuple(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[TapeEntry]:
        return iter(self.entries)

    @property
    def consumed(self) -> bool:
        return self._consumed

    @property
    def saved_bytes(self) -> int:
        """Total bytes of array data held by all records on this tape.

        A buffer that several records keep (a tensor read by three ops, or both
        operands of ``x * x``) is held once, so it is counted once here; each
        record's own ``saved_bytes`` (and ``saved_bytes_by_record``) counts
        everything that record keeps.
        """
        seen: dict[int, int] = {}
        for e in self.entries:
            for value in e.op.saved_arrays().values():
                for v in value if isinstance(value, tuple) else (value,):
                    seen.setdefault(id(v), nbytes_of(v))
        return sum(seen.values())

    def saved_bytes_by_record(self) -> dict[str, int]:
        """Saved bytes summed per record type, largest first (a buffer shared
        by several records counts for each of them)."""
        totals: dict[str, int] = {}
        for e in self.entries:
            totals[e.op.name] = totals.get(e.op.name, 0) + e.op.saved_bytes
        return dict(sorted(totals.items(), key=lambda kv: -kv[1]))

    def __str__(self) -> str:
        return format_tape(self)

    def __repr__(self) -> str:
        state = "consumed" if self._consumed else f"{len(self._entries)} entries"
        return f"<rumus_fx.Tape {state}, saved {self.saved_bytes} bytes>"

    def to_dot(self) -> str:
        """The recorded graph as Graphviz ``dot`` text (render with ``dot -Tpng``)."""
        return tape_to_dot(self)

    # -- backward ------------------------------------------------------------
    def backward(self, loss: Any, retain: bool = False, create_graph: bool = False, grad: Any = None) -> GradientStore:
        """Reverse-walk the tape from ``loss`` and return a ``GradientStore``.

        ``loss`` is a tracked scalar tensor (or pass ``grad=`` of its shape for a
        non-scalar output). Unless ``retain=True`` the tape is consumed: its
        records are released and a second ``backward`` raises ``AutogradError``.
        ``create_graph=True`` records the backward walk on the enclosing tape
        (this tape when no other one is active; Note [Create graph] in
        rumus_fx/lift/higher.py): the gradients are then tracked Tensors that
        can be differentiated again, and the tape is retained (as PyTorch's
        ``retain_graph`` defaults to ``create_graph``).
        """
        if self._budget is not None and not self._budget_runs:
            warnings.warn(
                f"backward of a Tape(memory_budget={self._budget}) on which nothing ran through tape.run: "
                "the budget applies to functions run with tape.run(fun, *args), not to ops recorded "
                "directly, so it had no effect here",
                RuntimeWarning,
                stacklevel=2,
            )
        if self._consumed:
            raise AutogradError(
                "backward called on a consumed tape: its records were released by the "
                "first backward. Pass retain=True to the first call to run backward "
                "more than once."
            )
        if not isinstance(loss, Tensor) or loss.grad_id is None:
            raise AutogradError(
                "backward needs a tracked Tensor (one computed from a tensor with "
                f"requires_grad=True inside this tape); got {_describe(loss)}"
            )
        if grad is None:
            if loss.size != 1:
                raise TypeError(
                    "backward of a non-scalar output needs grad= (a cotangent of its "
                    f"shape); a scalar loss was expected, got shape {loss.shape}"
                )
            seed = ones_like_value(loss.value)
        else:
            # a tracked cotangent stays tracked when the walk is recorded
            tracked_grad = create_graph and isinstance(grad, Tensor) and grad.grad_id is not None
            seed = grad if tracked_grad and grad.dtype == loss.dtype else jnp.asarray(grad, dtype=loss.dtype)
            if tuple(seed.shape) != tuple(loss.shape):
                raise TypeError(
                    f"backward: grad has shape {tuple(seed.shape)} but the output has shape {tuple(loss.shape)}"
                )
        if not (is_leaf_id(loss.grad_id) or self._recorded(loss.grad_id)):
            raise AutogradError(FOREIGN_LOSS_MESSAGE.format(gid=loss.grad_id))
        target = None
        if create_graph:
            # ``is None``, not truth: an enclosing tape with no entries yet (len 0) is still the target
            active = current_tape()
            target = self if active is None else active
            if target is not self:
                target._adopt(self._entries)
        grads = gradients(self._entries, [(loss.grad_id, seed)], foreign=check_history, create_graph_on=target)
        if create_graph:
            return GradientStore(grads)
        if not retain:
            self._entries = []
            self._consumed = True
        return GradientStore(grads)

    def _adopt(self, entries: Sequence[TapeEntry]) -> None:
        """Append the ``entries`` of an inner tape this tape does not hold yet:
        the walk that ``backward(create_graph=True)`` records here reads their
        outputs, so this tape's backward must reach through them."""
        have = {id(e) for e in self._entries}
        self._entries.extend(e for e in entries if id(e) not in have)

    def _recorded(self, grad_id: int) -> bool:
        """Whether an entry of this tape produced ``grad_id`` (the loss is
        usually the last one, so search from the end)."""
        return any(grad_id in e.outputs for e in reversed(self._entries))


FOREIGN_LOSS_MESSAGE = (
    "backward: the loss (grad_id={gid}) was not recorded on this tape (it is the result "
    "of an op recorded on another tape, or of one recorded before this tape's entries "
    "were released). Call backward on the tape that recorded the loss."
)


def _describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"an untracked Tensor of shape {x.shape}"
    return type(x).__name__


def _fmt_aval(aval: Any) -> str:
    if aval is None:
        return "scalar"
    shape, dtype = aval
    return f"{np.dtype(dtype).name}{list(shape)}"


def format_tape(tape: Tape) -> str:
    """One row per entry: index, record, input ids -> output ids, shapes, saved bytes."""
    header = ("#", "record", "inputs -> outputs", "shapes", "saved")
    rows = []
    for i, e in enumerate(tape.entries):
        ids = ", ".join("-" if x is None else str(x) for x in e.inputs)
        outs = ", ".join(str(x) for x in e.outputs)
        shapes_in = ", ".join(_fmt_aval(a) for a in e.input_avals)
        shapes_out = ", ".join(_fmt_aval(a) for a in e.output_avals)
        label = getattr(e.op, "label", e.op.name)
        rows.append(
            (str(i), label, f"({ids}) -> ({outs})", f"{shapes_in} -> {shapes_out}", _fmt_bytes(e.op.saved_bytes))
        )
        inner = getattr(e.op, "records", None)
        if inner is not None:  # a composite entry (rf.lift): one row per primitive record
            for j, rec in enumerate(inner()):
                s_in = ", ".join(_fmt_aval(a) for a in rec.in_avals)
                s_out = ", ".join(_fmt_aval(a) for a in rec.out_avals)
                rows.append((f"{i}.{j}", f"  {rec.name}", "", f"{s_in} -> {s_out}", _fmt_bytes(rec.saved_bytes)))
    widths = [max(len(h), *(len(r[k]) for r in rows)) if rows else len(h) for k, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    state = " (consumed)" if tape._consumed else ""
    lines.append(f"{len(tape._entries)} entries, {_fmt_bytes(tape.saved_bytes)} saved for backward{state}")
    return "\n".join(lines)


def _fmt_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    if n < 1024**2:
        return f"{n / 1024:.1f} KiB"
    return f"{n / 1024**2:.1f} MiB"


def tape_to_dot(tape: Tape) -> str:
    lines = ["digraph tape {", "  rankdir=LR;", '  node [fontname="monospace"];']
    seen: set[int] = set()
    for i, e in enumerate(tape.entries):
        label = f"{i}: {e.op.name}\\nsaves {_fmt_bytes(e.op.saved_bytes)}"
        lines.append(f'  op{i} [shape=box, label="{label}"];')
        for gid, aval in zip(e.inputs, e.input_avals or (None,) * len(e.inputs)):
            if gid is None:
                continue
            if gid not in seen:
                seen.add(gid)
                lines.append(f'  t{gid} [shape=ellipse, label="{gid}\\n{_fmt_aval(aval)}"];')
            lines.append(f"  t{gid} -> op{i};")
        for gid, aval in zip(e.outputs, e.output_avals or (None,) * len(e.outputs)):
            if gid not in seen:
                seen.add(gid)
                lines.append(f'  t{gid} [shape=ellipse, label="{gid}\\n{_fmt_aval(aval)}"];')
            lines.append(f"  op{i} -> t{gid};")
    lines.append("}")
    return "\n".join(lines)
