"""Activation memory to a budget: ``memory_budget=`` of ``rf.grad``,
``rf.value_and_grad`` and ``rf.Tape``.

Note [Memory budget]
~~~~~~~~~~~~~~~~~~~~
The tape knows what every record saves for backward; ``jax.grad`` does not. Given
a budget for those saved activations, a function is planned and run in two ways:

* **On rf's own records** (a function written with rf ops; Note [Memory budget on
  records] below): ``fun`` runs once on a tape inside ``jax.make_jaxpr`` and the
  arrays each record saves become variables of the traced forward. The atoms are
  the entries (a matmul's or an attention's record is a heavy atom); a segment of
  entries is recorded as one ``RecordSegmentBackward`` that keeps only the inputs
  of the *slice* of the forward computing what its records save, and rebuilds and
  walks those records at backward time.
* **Primitive by primitive** (a function whose saved bytes are mostly held by
  lifted calls, ``rf.lift``/``rf.checkpoint``, which records cannot split; and
  ``tape.run``): ``fun`` is traced to a jaxpr and flattened into rf's lifted
  program (Note [Lifting] in lift/tracing.py); each step's rule says which of
  its inputs and outputs its record keeps (``rule.saves``), ``jax.eval_shape``
  gives the extra residuals some rules compute (a scan's stacked carries). The
  atoms are each matmul, convolution or control-flow step alone and each maximal
  run of the cheap steps between them. The program is replayed with each segment
  in ``jax.checkpoint`` and recorded as one lifted entry (one ``RematBackward``
  per segment).

Either way a plan is a set of disjoint runs of atoms, *segments*, rematerialised
as ``rf.checkpoint`` does. Its estimated peak of saved bytes walks the forward
(each kept buffer once: what the records outside segments save, and each
segment's inputs) and the backward (a buffer is freed once the earliest record
keeping it is done; while a segment's backward runs, its recomputed activations
and their cotangents, ``TRANSIENT`` times its bytes, are alive). Starting from no
segment, a greedy loop takes, among the moves "make one run of atoms a segment",
"grow a segment on either side", "merge two neighbouring segments" and "make a
block (a heavy atom and the cheap atoms up to the next one) a segment", the one
that frees the most bytes per FLOP recomputed (FLOPs of ``dot_general``/``conv``;
the output size of everything else), with at most ``MAX_HEAVY`` heavy atoms per
segment, their number raised one at a time only when no move frees bytes with
fewer: cheap elementwise work (a layer norm's, a GELU's, a softmax's
intermediates) is recomputed before matmuls, as PyTorch's activation-memory
budget does. When the plan has no segment (the budget is at least the
unbudgeted bytes) ``fun`` runs on the tape exactly as without a budget. The
gradients are the unbudgeted ones (the same records and rules; recomputation
repeats the same operations).

The budget is bytes (an ``int``) or a fraction (a ``float`` in (0, 1]) of the
*base*: the bytes saved without a budget, the function's own inputs not counted
(they are alive anyway; ``memory_plan(...).base_bytes``). A budget below what the
plan can reach is not silently ignored: the best plan found runs and a
``MemoryBudgetWarning`` says the budget, the base and the estimate achieved. The
estimate is of saved activations, not of XLA's whole temporary memory (which also
holds cotangents and fusion buffers). Each segment's backward is kept apart from the
forward (``apart.recompute``: Note [Recomputation kept apart]), so that XLA:CPU does
not merge the recomputed matmuls back into the forward.
Under ``jax.jit`` all of this happens once, at trace time; eagerly each call
traces ``fun`` once more to plan (use ``jax.jit`` for speed).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..autograd.record import Record, VersionSnapshot
from ..autograd.registry import OpDecl, declare
from ..autograd.tape import Tape, current_tape, new_entry, recording, set_budget, suspend_recording
from ..autograd.walk import walk
from ..kernels.dispatch import use as kernel_mode
from ..tensor import Tensor, next_grad_id
from .apart import KEPT_APART, recompute
from .lifted_record import LiftedBackward
from .program import Program, _Const
from .tracing import is_array_leaf, weak_values

MAX_HEAVY = 8  # matmuls (convolutions, loops) one segment may recompute (Note [Memory budget])
TRANSIENT = 1  # a segment's recomputed activations and their cotangents, alive during its backward
HEAVY_IN_SLICES = True  # a segment of records may recompute the matmul its records read

__all__ = ["MemoryBudgetWarning", "MemoryPlan", "check_budget", "memory_plan", "run_budgeted"]


class MemoryBudgetWarning(RuntimeWarning):
    """A ``memory_budget`` below what rematerialisation can reach: the best plan
    found runs, and the warning says what it achieves."""


# primitives whose step is an atom of its own (expensive to recompute)
_HEAVY = frozenset(
    {"dot_general", "conv_general_dilated", "scan", "while", "cond", "remat2", "checkpoint", "compute_on", "custom_vjp_call",
     "custom_vjp_call_jaxpr", "custom_jvp_call", "fft", "triangular_solve", "cholesky", "lu", "eigh", "svd", "qr"}
)  # fmt: skip


def check_budget(memory_budget: Any) -> int | float | None:
    """``memory_budget`` validated: None, a positive ``int`` of bytes or a ``float``
    fraction in (0, 1]; ``TypeError`` for another type, ``ValueError`` for a value
    out of range."""
    if memory_budget is None:
        return None
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float, np.integer, np.floating)):
        raise TypeError(
            "memory_budget must be an int (bytes) or a float in (0, 1] (a fraction of the bytes saved "
            f"without a budget), got {type(memory_budget).__name__}"
        )
    if isinstance(memory_budget, (int, np.integer)):
        if memory_budget <= 0:
            raise ValueError(f"memory_budget must be a positive number of bytes, got {int(memory_budget)}")
        return int(memory_budget)
    value = float(memory_budget)
    if not (0.0 < value <= 1.0):  # also refuses nan
        raise ValueError(
            f"memory_budget as a float is a fraction of the saved bytes and must lie in (0, 1], got {value}; "
            "pass an int for a number of bytes"
        )
    return value


def _nbytes(aval: Any) -> int:
    return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize if hasattr(aval, "shape") else 0


def _cost(step: Any) -> float:
    """Forward cost of a step in FLOPs (roughly): matmuls and convolutions by
    their multiply-adds, control flow by its body, everything else by its
    output size."""
    name = step.prim.name
    out = sum(math.prod(a.shape) for a in step.out_avals)
    if name == "dot_general":
        (lc, _), _ = step.params["dimension_numbers"]
        k = math.prod(step.in_avals[0].shape[d] for d in lc)
        return 2.0 * out * max(k, 1)
    if name == "conv_general_dilated":
        rhs = step.in_avals[1].shape
        dn = step.params["dimension_numbers"]
        out_feature = rhs[dn.rhs_spec[0]] if dn is not None else rhs[0]
        return 2.0 * out * max(math.prod(rhs) // max(out_feature, 1), 1)
    if name in _HEAVY:
        inner = sum(math.prod(a.shape) for a in step.in_avals)
        return 16.0 * (out + inner) * max(int(step.params.get("length", 1) or 1), 1)
    return float(max(out, 1))


@dataclasses.dataclass
class MemoryPlan:
    """What ``memory_budget`` chose for one function and signature.

    ``base_bytes``: bytes saved for backward without a budget; ``budget_bytes``:
    the budget in bytes; ``planned_bytes``: the plan's estimated peak of saved
    bytes; ``segments``: ``(first step, end step)`` ranges rematerialised;
    ``recompute_flops`` / ``forward_flops``: the forward work done again at
    backward and the whole forward's; ``met``: whether the estimate fits."""

    base_bytes: int
    budget_bytes: int
    planned_bytes: int
    segments: list[tuple[int, int]]
    recompute_flops: float
    forward_flops: float
    met: bool
    steps: int
    on: str = "primitives"  # "records": planned on rf's own records (Note [Memory budget on records])

    def __str__(self) -> str:
        return (
            f"memory plan on {self.on}: {len(self.segments)} segments over {self.steps} {self.on} rematerialised; "
            f"saved bytes "
            f"{self.planned_bytes} of {self.base_bytes} without a budget (budget {self.budget_bytes}, "
            f"{'met' if self.met else 'NOT met'}); recompute {self.recompute_flops:.3g} of "
            f"{self.forward_flops:.3g} forward FLOPs"
        )


class _Planner:
    """The measured program and the greedy choice of segments (Note [Memory budget])."""

    def __init__(self, program: Program, extra_bytes: Sequence[int]):
        self.program = program
        steps = program.steps
        n = len(steps)
        self.n = n
        self.slot_bytes: dict[int, int] = {}
        self.defined_at: dict[int, int] = {}  # slot -> step that writes it (program inputs: -1)
        for s in program.in_slots:  # the function's inputs are alive anyway: not activations
            self.slot_bytes[s] = 0
            self.defined_at[s] = -1
        self.saves: list[frozenset[int]] = []
        self.reads: list[tuple[int, ...]] = []
        for i, st in enumerate(steps):
            for s, a in zip(st.outs, st.out_avals):
                self.slot_bytes[s] = _nbytes(a)
                self.defined_at[s] = i
            self.reads.append(tuple(x for x in st.ins if isinstance(x, int)))
            if st.rule is None:
                self.saves.append(frozenset())
                continue
            kept = {st.ins[k] for k in st.saved_in if isinstance(st.ins[k], int)}
            kept.update(st.outs[k] for k in st.saved_out)
            self.saves.append(frozenset(kept))
        # a rule's extra residuals (a scan's stacked carries) as one pseudo slot per step
        for i, e in enumerate(extra_bytes):
            if e:
                self.slot_bytes[-1 - i] = int(e)
                self.saves[i] = self.saves[i] | {-1 - i}
        self.cost = [_cost(st) for st in steps]
        # atoms: heavy steps alone, runs of cheap steps between them
        atoms: list[tuple[int, int]] = []
        start = 0
        for i, st in enumerate(steps):
            if st.prim.name in _HEAVY:
                if start < i:
                    atoms.append((start, i))
                atoms.append((i, i + 1))
                start = i + 1
        if start < n:
            atoms.append((start, n))
        self.atoms = atoms
        self.heavy_atom = [steps[lo].prim.name in _HEAVY for lo, _ in atoms]
        self._range_cache: dict[tuple[int, int], tuple[frozenset[int], frozenset[int], float]] = {}

    def _range(self, a: int, b: int) -> tuple[frozenset[int], frozenset[int], float]:
        """Atoms ``[a, b)`` as a segment: (its input slots, the slots its own
        records save while its backward runs, its forward cost)."""
        key = (a, b)
        hit = self._range_cache.get(key)
        if hit is None:
            lo, hi = self.atoms[a][0], self.atoms[b - 1][1]
            ins = {s for i in range(lo, hi) for s in self.reads[i] if self.defined_at[s] < lo}
            own: set[int] = set()
            for i in range(lo, hi):
                own |= self.saves[i]
            hit = self._range_cache[key] = (frozenset(ins), frozenset(own), sum(self.cost[lo:hi]))
        return hit

    def estimate(self, segs: Sequence[tuple[int, int]]) -> tuple[int, float]:
        """(estimated peak of saved bytes, recompute cost) of segments over atoms.

        Forward keeps, per step outside a segment, what its record saves and,
        per segment, the segment's inputs. Backward walks in reverse and frees
        a buffer once the earliest record keeping it is done; while a segment's
        backward runs, the buffers kept up to it and the segment's recomputed
        residuals are alive. The peak is the larger of the end of forward and
        the largest of those moments."""
        spans = {}
        for a, b in segs:
            start, end, ins, own, c = self._span(a, b)
            spans[start] = (end, ins, own, c)
        sb = self.slot_bytes
        kept: set[int] = set()
        total = 0
        transient_peak = 0
        cost = 0.0
        i = 0
        while i < self.n:
            span = spans.get(i)
            if span is None:
                for s in self.saves[i]:
                    if s not in kept:
                        kept.add(s)
                        total += sb[s]
                i += 1
                continue
            end, ins, own, c = span
            for s in ins:
                if s not in kept:
                    kept.add(s)
                    total += sb[s]
            transient_peak = max(transient_peak, total + TRANSIENT * sum(sb[s] for s in own if s not in kept))
            cost += c
            i = end
        return max(total, transient_peak), cost

    def _span(self, a: int, b: int) -> tuple[int, int, frozenset[int], frozenset[int], float]:
        """Segment ``(a, b)`` over atoms: its first and past-the-end steps, the
        slots it reads from before it, the slots its records save, its cost."""
        ins, own, c = self._range(a, b)
        return self.atoms[a][0], self.atoms[b - 1][1], ins, own, c

    def _moves(
        self, segs: list[tuple[int, int]], width: int, max_heavy: int | None = None
    ) -> list[list[tuple[int, int]]]:
        """Plans one move from ``segs``: a new segment of ``width`` free atoms,
        a segment grown by ``width`` free atoms on one side, and (width 1)
        two neighbouring segments merged with the gap between them."""
        m = len(self.atoms)
        covered = [False] * m
        for a, b in segs:
            for k in range(a, b):
                covered[k] = True
        free_run = [0] * (m + 1)  # free atoms from k on
        for k in range(m - 1, -1, -1):
            free_run[k] = 0 if covered[k] else free_run[k + 1] + 1
        moves: list[list[tuple[int, int]]] = []
        for k in range(m):
            if free_run[k] >= width:
                moves.append(sorted([*segs, (k, k + width)]))
        for j, (a, b) in enumerate(segs):
            rest = segs[:j] + segs[j + 1 :]
            if a - width >= 0 and free_run[a - width] >= width:
                moves.append(sorted([*rest, (a - width, b)]))
            if b + width <= m and free_run[b] >= width:
                moves.append(sorted([*rest, (a, b + width)]))
            if width == 1 and j + 1 < len(segs):
                moves.append(sorted([*segs[:j], (a, segs[j + 1][1]), *segs[j + 2 :]]))
        if width == 1 and (max_heavy is None or max_heavy >= 1):
            # a block: a heavy atom and the cheap atoms up to the next one (a layer of
            # an MLP), replacing the segments inside it
            heavy = [k for k in range(m) if self.heavy_atom[k]] + [m]
            for h, h2 in itertools.pairwise(heavy):
                if h < m:
                    keep = [(a, b) for a, b in segs if b <= h or a >= h2]
                    if all(b <= h or a >= h2 or (h <= a and b <= h2) for a, b in segs):
                        moves.append(sorted([*keep, (h, h2)]))
        if max_heavy is not None:
            moves = [mv for mv in moves if all(self._heavy(a, b) <= max_heavy for a, b in mv)]
        return moves

    def _heavy(self, a: int, b: int) -> int:
        return sum(1 for k in range(a, b) if self.heavy_atom[k])

    def plan(self, budget: int) -> tuple[list[tuple[int, int]], int, float]:
        """Greedy: the move that frees the most bytes per FLOP recomputed, the
        narrowest that frees any, until the estimate fits ``budget``."""
        segs: list[tuple[int, int]] = []
        cur, cur_cost = self.estimate(segs)
        max_heavy = 0
        while cur > budget:
            best = None
            for width in range(1, len(self.atoms) + 1):
                for mv in self._moves(segs, width, max_heavy):
                    est, c = self.estimate(mv)
                    freed = cur - est
                    if freed <= 0:
                        continue
                    score = freed / max(c - cur_cost, 1.0)
                    if best is None or score > best[0] or (score == best[0] and est < best[2]):
                        best = (score, mv, est, c)
                if best is not None:
                    break
            if best is None:
                if max_heavy >= MAX_HEAVY:
                    break
                max_heavy += 1  # recompute one more matmul per segment only when cheaper work is not enough
                continue
            _, segs, cur, cur_cost = best
        return segs, cur, cur_cost

    def step_ranges(self, segs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        return [(self.atoms[a][0], self.atoms[b - 1][1]) for a, b in segs]


# ---------------------------------------------------------------------------
# tracing, planning, replaying
# ---------------------------------------------------------------------------


def _split(args: tuple, kwargs: dict) -> tuple[list, Any, list[bool], list]:
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=lambda x: isinstance(x, Tensor))
    mask = [is_array_leaf(x) for x in leaves]
    return leaves, treedef, mask, [x for x, m in zip(leaves, mask) if m]


def _value(x: Any) -> Any:
    if isinstance(x, Tensor):
        return x.value
    return jnp.asarray(x)


def _trace(fun: Callable, leaves: list, treedef: Any, mask: list[bool]) -> tuple[Any, list]:
    """The jaxpr of ``fun`` on the array leaves (Tensors arrive as untracked
    Tensors of the trace's values, so Tensor methods work); returns (closed
    jaxpr, [output treedef, static output leaves, output array mask])."""
    arrays = [x for x, m in zip(leaves, mask) if m]
    statics = [x for x, m in zip(leaves, mask) if not m]
    was_tensor = [isinstance(x, Tensor) for x in arrays]
    out_info: list[Any] = []

    def flat(*vals: Any) -> list:
        it_v, it_s = iter(vals), iter(statics)
        rebuilt = []
        for m in mask:
            if m:
                v = next(it_v)
                rebuilt.append(v)
            else:
                rebuilt.append(next(it_s))
        it_t = iter(was_tensor)
        rebuilt = [Tensor._wrap(x, None) if m and next(it_t) else x for x, m in zip(rebuilt, mask)]
        a, k = jax.tree_util.tree_unflatten(treedef, rebuilt)
        out = fun(*a, **k)
        out_leaves, out_tree = jax.tree_util.tree_flatten(out, is_leaf=lambda x: isinstance(x, Tensor))
        omask = [is_array_leaf(x) for x in out_leaves]
        out_info[:] = [out_tree, [x for x, m in zip(out_leaves, omask) if not m], omask]
        return [_value(x) for x, m in zip(out_leaves, omask) if m]

    avals = [
        jax.ShapeDtypeStruct(
            np.shape(v), v.dtype, weak_type=bool(getattr(getattr(v, "aval", None), "weak_type", False))
        )
        for v in (_value(x) for x in arrays)
    ]
    with suspend_recording(), kernel_mode("reference"):
        closed = jax.make_jaxpr(flat)(*avals)
    return closed, out_info


def _extra_bytes(program: Program, avals: Sequence[Any]) -> list[int]:
    """Bytes of the extra residuals each step's rule computes (a scan's stacked
    carries), from ``jax.eval_shape`` of the program: nothing runs."""
    extra = [0] * len(program.steps)
    with_forward = [i for i, st in enumerate(program.steps) if st.rule is not None and st.rule.forward is not None]
    if not with_forward:
        return extra
    _, (_, extras) = jax.eval_shape(program.run, list(avals))
    for i, e in zip(with_forward, extras):
        extra[i] = sum(_nbytes(x) for x in jax.tree_util.tree_leaves(e))
    return extra


def _plan_with(planner: _Planner, budget: int | float, on: str) -> MemoryPlan:
    base, _ = planner.estimate([])
    target = int(budget * base) if isinstance(budget, float) else int(budget)
    forward_flops = sum(getattr(planner, "step_cost", planner.cost))  # every step of the forward
    if base <= target:
        return MemoryPlan(base, target, base, [], 0.0, forward_flops, True, planner.n, on)
    segs, est, cost = planner.plan(target)
    return MemoryPlan(base, target, est, planner.step_ranges(segs), cost, forward_flops, est <= target, planner.n, on)


def _lifted_share(planner: RecordPlanner) -> float:
    """The share of the saved bytes held by lifted calls (``LiftedBackward``:
    ``rf.lift``, ``rf.checkpoint``), which planning on records cannot split."""
    total = sum(planner.slot_bytes[s] for s in set().union(*planner.saves)) if planner.saves else 0
    lifted = set()
    for e, saves in zip(planner.entries, planner.saves):
        if e.name in ("LiftedBackward", "RematBackward", "CheckpointBackward"):
            lifted |= saves
    return sum(planner.slot_bytes[s] for s in lifted) / max(total, 1)


def _analyse(
    fun: Callable, args: tuple, kwargs: dict, budget: int | float, label: str, records: bool = True
) -> tuple[MemoryPlan, Callable]:
    """The plan for ``fun`` on these arguments and a function that records it on
    a tape: on rf's records (Note [Memory budget on records]) unless lifted
    calls hold most of the saved bytes or ``records`` is False, then on
    primitives (Note [Memory budget])."""
    leaves, treedef, mask, arrays = _split(args, kwargs)
    values = [_value(x) for x in arrays]
    program, entries, out, nout = trace_records(fun, leaves, treedef, mask, label)
    rplanner = RecordPlanner(program, entries)
    if records and _lifted_share(rplanner) <= 0.5:
        plan = _plan_with(rplanner, budget, "records")

        def run_records(tape: Any) -> Any:
            return run_on_records(tape, program, entries, out, nout, rplanner, plan.segments, values)

        return plan, run_records
    closed, out_info = _trace(fun, leaves, treedef, mask)
    tracked_in = tuple(isinstance(x, Tensor) and x.grad_id is not None for x in arrays)
    pprogram = Program(closed, tracked_in, label)
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in pprogram.in_avals]
    planner = _Planner(pprogram, _extra_bytes(pprogram, avals))
    plan = _plan_with(planner, budget, "primitives")

    def run_primitives(tape: Any) -> Any:
        return _run_primitives(tape, pprogram, plan, out_info, arrays, tracked_in, label)

    return plan, run_primitives


def memory_plan(fun: Callable, memory_budget: int | float, argnums: int | Sequence[int] = 0) -> Callable:
    """``plan(*args, **kwargs) -> MemoryPlan``: what ``rf.grad(fun, argnums,
    memory_budget=memory_budget)`` would rematerialise for these arguments,
    without running anything (abstract tracing only).

    >>> import jax.numpy as jnp, rumus_fx as rf
    >>> from rumus_fx.lift.budget import memory_plan
    >>> def mlp(ws, x):
    ...     for w in ws:
    ...         z = x @ w
    ...         x = rf.tanh(z) * rf.sigmoid(z)
    ...     return rf.mean(x * x)
    >>> p = memory_plan(mlp, 0.75)([jnp.eye(16)] * 4, jnp.ones((8, 16)))
    >>> p.met, p.planned_bytes <= p.budget_bytes < p.base_bytes, len(p.segments) > 0
    (True, True, True)
    """
    budget = check_budget(memory_budget)
    if budget is None:
        raise TypeError("memory_plan needs a memory_budget (int bytes or float fraction)")

    def plan(*args: Any, **kwargs: Any) -> MemoryPlan:
        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        new_args = list(args)
        for i in nums:
            new_args[i] = jax.tree_util.tree_map(
                lambda x: Tensor._wrap(_value(x), next_grad_id()), args[i], is_leaf=lambda x: isinstance(x, Tensor)
            )
        return _analyse(fun, tuple(new_args), kwargs, budget, getattr(fun, "__name__", "fun"))[0]

    return plan


def _replay(program: Program, ranges: Sequence[tuple[int, int]]) -> Callable:
    """A plain JAX function of the program's inputs that evaluates its steps,
    each range of ``ranges`` inside one ``jax.checkpoint``."""
    steps = program.steps
    n = len(steps)
    seg_at = {lo: hi for lo, hi in ranges}
    last_use: dict[int, int] = {}
    for i, st in enumerate(steps):
        for x in st.ins:
            if isinstance(x, int):
                last_use[x] = i
    for r in program.out_refs:
        if isinstance(r, int):
            last_use[r] = n

    def segment(lo: int, hi: int) -> tuple[list[int], list[int], Callable]:
        written = {s for i in range(lo, hi) for s in steps[i].outs}
        ins = sorted({x for i in range(lo, hi) for x in steps[i].ins if isinstance(x, int) and x not in written})
        outs = sorted(s for s in written if last_use.get(s, -1) >= hi)

        def run(*vals: Any) -> list:
            env = dict(zip(ins, vals))
            for i in range(lo, hi):
                _bind(steps[i], env)
            return [env[s] for s in outs]

        return ins, outs, run

    def replay(*inputs: Any) -> list:
        env: dict[int, Any] = dict(zip(program.in_slots, inputs))
        i = 0
        while i < n:
            hi = seg_at.get(i)
            if hi is None:
                _bind(steps[i], env)
                i += 1
                continue
            ins, outs, run = segment(i, hi)
            results = jax.checkpoint(run, prevent_cse=True, policy=KEPT_APART)(*[env[s] for s in ins])
            env.update(zip(outs, results))
            i = hi
        return [r.value if isinstance(r, _Const) else env[r] for r in program.out_refs]

    return replay


def run_budgeted(
    fun: Callable, args: tuple, kwargs: dict, memory_budget: int | float, name: str = "fun", records: bool = True
) -> Any:
    """``fun(*args, **kwargs)`` recorded on the current tape with its saved
    activations planned to ``memory_budget`` (Note [Memory budget]); returns
    ``fun``'s output (array leaves as Tensors, tracked where they depend on a
    tracked input).

    ``records=False`` plans primitive by primitive even for rf ops: the records
    rebuilt by the plan on records carry no version snapshots, which is sound
    for the transforms (their inputs are fresh leaves, differentiated at once)
    but not for ``tape.run``, whose inputs the caller may write in place before
    ``backward`` (the lifted entry snapshots them, as ``rf.lift`` does)."""
    tape = current_tape()
    if tape is None:
        return fun(*args, **kwargs)
    plan, run = _analyse(fun, args, kwargs, memory_budget, name, records)
    if not plan.met:
        warnings.warn(
            f"memory_budget of {name}: the budget of {plan.budget_bytes} bytes cannot be met; the best plan found "
            f"keeps about {plan.planned_bytes} bytes of the {plan.base_bytes} saved without a budget "
            f"({plan.planned_bytes / max(plan.base_bytes, 1):.0%}), which is what runs. Every segment's inputs "
            "stay saved and one segment's activations are alive at a time.",
            MemoryBudgetWarning,
            stacklevel=3,
        )
    if not plan.segments:
        return fun(*args, **kwargs)  # nothing to recompute: exactly the unbudgeted recording
    return run(tape)


def _run_primitives(
    tape: Any, program: Program, plan: MemoryPlan, out_info: list, arrays: list, tracked_in: tuple, name: str
) -> Any:
    """The program replayed with ``plan``'s step ranges in ``jax.checkpoint``,
    recorded as one lifted entry."""
    values = [_value(x) for x in arrays]
    replay = _replay(program, plan.segments)
    rclosed = jax.make_jaxpr(replay)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in program.in_avals])
    budgeted = Program(rclosed, tracked_in, f"{name} (memory budget)")
    outputs, residuals = budgeted.forward(values)
    out_tensors = [Tensor._wrap(v, next_grad_id() if tr else None) for v, tr in zip(outputs, budgeted.out_tracked)]
    if any(budgeted.out_tracked):
        in_tensors = [x if isinstance(x, Tensor) else None for x in arrays]
        versions = [
            VersionSnapshot.of(t.grad_id, t._storage)
            for s, t in zip(budgeted.in_slots, in_tensors)
            if t is not None and s in budgeted.residual_index  # tracked or not: its value is saved
        ]
        rec = LiftedBackward(budgeted, residuals[0], residuals[1], tuple(versions))
        tape.append(
            rec,
            tuple(t.grad_id if t is not None else None for t in in_tensors),
            tuple(t.grad_id for t in out_tensors),
            tuple(budgeted.in_avals),
            tuple(budgeted.out_avals),
            replay=weak_values(values),
        )
    out_tree, out_statics, omask = out_info
    it_o, it_s = iter(out_tensors), iter(out_statics)
    return jax.tree_util.tree_unflatten(out_tree, [next(it_o) if m else next(it_s) for m in omask])


# ---------------------------------------------------------------------------
# Note [Memory budget on records]
# ---------------------------------------------------------------------------
# The memory budget over rf's own records (Note [Memory budget on records]).
#
# Note [Memory budget on records]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A function written with rf ops records rf's own records (``LayerNormBackward``,
# ``ScaledDotProductAttentionBackward``, ...), which keep less than the primitives
# they are made of. Planning such a function primitive by primitive (Note [Memory
# budget] in lift/budget.py) would trade those records for the primitives' and can
# end above the unbudgeted memory. So it is planned on its records instead:
#
# 1. ``fun`` runs once on a tape inside ``jax.make_jaxpr`` (abstract): each entry's
#    record is flattened (``jax.tree_util``; records are pytrees) and its saved
#    arrays are returned as outputs of the traced function, so every saved array is
#    a variable of the jaxpr, and the jaxpr holds the forward that computes it.
# 2. The atoms of the plan are the entries (a matmul's, an attention's record alone
#    is a heavy atom). A segment of entries is rematerialised from a *slice* of the
#    forward: the steps that compute the arrays its records save, back to arrays
#    kept anyway (saved by an entry outside the segment) or to the function's
#    inputs; those are the segment's inputs.
# 3. The forward runs as the jaxpr (plain JAX); each entry outside a segment is
#    appended to the tape with its record rebuilt from the computed arrays; each
#    segment is appended as one ``RecordSegmentBackward`` that keeps the slice's
#    inputs and whose backward re-runs the slice (after a barrier over its inputs and
#    the incoming cotangents), rebuilds the segment's records and walks them.
#
# The gradients are those of the unbudgeted recording: the same records and rules.

# record names (substrings) whose entry is an atom of its own: expensive to recompute
_HEAVY_RECORDS = (
    "Matmul", "Linear", "Conv", "Attention", "Dot", "Einsum", "Bmm", "Lifted", "Scan", "Remat", "Checkpoint",
    "Cond", "Switch", "Fft", "Solve", "Cholesky", "Svd", "Eig", "Qr", "Lu",
)  # fmt: skip


@dataclasses.dataclass
class _Entry:
    """One traced entry: how to rebuild its record and where it sits on the tape."""

    treedef: Any
    refs: list[Any]  # per record leaf: a slot / _Const of the program, or ("static", value)
    inputs: tuple
    outputs: tuple
    input_avals: tuple
    output_avals: tuple
    name: str
    input_refs: tuple[int, ...] = ()  # positions in ``refs`` of saved values of the op's inputs


def trace_records(fun: Callable, leaves: list, treedef: Any, mask: list[bool], label: str) -> tuple:
    """``fun`` recorded on a tape inside ``jax.make_jaxpr``: (program, entries,
    output info, number of function outputs)."""
    arrays = [x for x, m in zip(leaves, mask) if m]
    statics = [x for x, m in zip(leaves, mask) if not m]
    ids = [x.grad_id if isinstance(x, Tensor) else None for x in arrays]
    was_tensor = [isinstance(x, Tensor) for x in arrays]
    info: dict[str, Any] = {}

    def flat(*vals: Any) -> list:
        it_v, it_s = iter(vals), iter(statics)
        it_k = iter(zip(ids, was_tensor))
        rebuilt = []
        for m in mask:
            if not m:
                rebuilt.append(next(it_s))
                continue
            v = next(it_v)
            gid, is_t = next(it_k)
            if gid is not None:  # a tracked leaf keeps its id: the entries name it
                t = Tensor._wrap(v, gid)
                t._leaf = True
                rebuilt.append(t)
            else:
                rebuilt.append(Tensor._wrap(v, None) if is_t else v)
        a, k = jax.tree_util.tree_unflatten(treedef, rebuilt)
        tape = Tape()
        with recording(tape), kernel_mode("reference"):
            out = fun(*a, **k)
        out_leaves, out_tree = jax.tree_util.tree_flatten(out, is_leaf=lambda x: isinstance(x, Tensor))
        omask = [is_array_leaf(x) for x in out_leaves]
        out_ids = [x.grad_id if isinstance(x, Tensor) else None for x, m in zip(out_leaves, omask) if m]
        info["out"] = (out_tree, [x for x, m in zip(out_leaves, omask) if not m], omask, out_ids)
        outs = [_value(x) for x, m in zip(out_leaves, omask) if m]
        saved: list[Any] = []
        entries = []
        for e in tape.entries:
            rec_leaves, rec_tree = jax.tree_util.tree_flatten(e.op)
            of_inputs = _input_values(e)
            input_refs = tuple(j for j, leaf in enumerate(rec_leaves) if id(leaf) in of_inputs)
            refs: list[Any] = []
            for leaf in rec_leaves:
                if isinstance(leaf, (jax.Array, jax.core.Tracer)):
                    refs.append(len(saved))
                    saved.append(leaf)
                else:
                    refs.append(("static", leaf))
            entries.append(
                _Entry(rec_tree, refs, e.inputs, e.outputs, e.input_avals, e.output_avals, e.op.name, input_refs)
            )
        info["entries"] = entries
        info["nout"] = len(outs)
        return outs + saved

    avals = [
        jax.ShapeDtypeStruct(v.shape, v.dtype, weak_type=bool(getattr(getattr(v, "aval", None), "weak_type", False)))
        for v in (_value(x) for x in arrays)
    ]
    closed = jax.make_jaxpr(flat)(*avals)
    program = Program(closed, [False] * len(arrays), label)
    nout = info["nout"]
    for e in info["entries"]:  # leaf positions -> the program's slots
        e.refs = [r if isinstance(r, tuple) else program.out_refs[nout + r] for r in e.refs]
    return program, info["entries"], info["out"], nout


def _input_values(e: Any) -> set[int]:
    """``id``s of the arrays entry ``e``'s record saves that are values of the
    op's inputs (from its provenance, Note [Create graph] in lift/higher.py)."""
    out: set[int] = set()
    try:
        for field, index, gid in e.provenance:
            if gid in e.outputs and gid is not None:
                continue
            v = getattr(e.op, field)
            out.add(id(v[index] if index is not None else v))
    except (AttributeError, IndexError, TypeError):  # no provenance: the plan is only coarser
        return out
    return out


class RecordPlanner(_Planner):
    """The greedy of ``_Planner`` over entries (Note [Memory budget on records])."""

    def __init__(self, program: Program, entries: list[_Entry]):
        self.program = program
        self.entries = entries
        steps = program.steps
        self.n = len(entries)
        self.slot_bytes: dict[int, int] = {s: 0 for s in program.in_slots}
        self.defined_at: dict[int, int] = dict.fromkeys(program.in_slots, -1)
        for i, st in enumerate(steps):
            for s, a in zip(st.outs, st.out_avals):
                self.slot_bytes[s] = _nbytes(a)
                self.defined_at[s] = i
        self.step_cost = [_cost(st) for st in steps]
        self.saves = [frozenset(r for r in e.refs if isinstance(r, int)) for e in entries]
        self.savers: dict[int, set[int]] = {}
        for k, s in enumerate(self.saves):
            for slot in s:
                self.savers.setdefault(slot, set()).add(k)
        self.atoms = [(k, k + 1) for k in range(self.n)]
        self.heavy_atom = [any(h in e.name for h in _HEAVY_RECORDS) for e in entries]
        # where the forward of entry k begins, at the latest: after every step that
        # computes what an earlier entry saves (a segment's slice stops there)
        self.start = []
        last = -1
        for e, saves in zip(entries, self.saves):
            inputs = [e.refs[j] for j in e.input_refs if isinstance(e.refs[j], int)]
            self.start.append(max([last, *(self.defined_at[x] for x in inputs)]) + 1)
            last = max([last, *(self.defined_at[x] for x in saves)])
        self._range_cache: dict = {}
        self.cost = [self._slice(k, k + 1)[2] for k in range(self.n)]  # forward FLOPs of each entry

    def _slice(self, a: int, b: int) -> tuple[frozenset[int], list[int], float, frozenset[int]]:
        """Entries ``[a, b)`` as a segment: (its input slots, the steps that
        recompute what its records save, their cost, the slots recomputed)."""
        hit = self._range_cache.get((a, b))
        if hit is not None:
            return hit
        inside = set(range(a, b))
        # a matmul (convolution, loop) is recomputed only by a segment holding a heavy
        # record; otherwise its result is kept as an input of the segment
        heavy_ok = HEAVY_IN_SLICES or any(self.heavy_atom[k] for k in range(a, b))

        start = self.start[a]

        def kept_outside(slot: int) -> bool:
            i = self.defined_at[slot]
            if i < start or (not heavy_ok and self.program.steps[i].prim.name in _HEAVY):
                return True
            return any(k not in inside for k in self.savers.get(slot, ()))

        steps = self.program.steps
        frontier: set[int] = set()
        chosen: set[int] = set()
        recomputed: set[int] = set()
        todo = [s for k in range(a, b) for s in self.saves[k]]
        seen: set[int] = set()
        while todo:
            s = todo.pop()
            if s in seen:
                continue
            seen.add(s)
            if kept_outside(s):
                frontier.add(s)
                continue
            i = self.defined_at[s]
            recomputed.add(s)
            if i in chosen:
                continue
            chosen.add(i)
            todo.extend(x for x in steps[i].ins if isinstance(x, int))
        order = sorted(chosen)
        hit = (frozenset(frontier), order, sum(self.step_cost[i] for i in order), frozenset(recomputed))
        self._range_cache[(a, b)] = hit
        return hit

    def _span(self, a: int, b: int) -> tuple[int, int, frozenset[int], frozenset[int], float]:
        """As ``_Planner._span``, over entries: a segment keeps its slice's
        inputs, and its records' saved arrays are alive while it runs backward."""
        ins, _, c, _ = self._slice(a, b)
        return a, b, ins, frozenset(s for j in range(a, b) for s in self.saves[j]), c

    def step_ranges(self, segs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        return list(segs)


class _Segment:
    """A rematerialised run of entries: its slice of the forward and its records
    (static: hashed by identity)."""

    def __init__(self, program: Program, entries: list[_Entry], slots: list[int], order: list[int]):
        self.program = program
        self.entries = entries
        self.slots = slots  # the slice's input slots, in the record's order
        self.order = order  # the steps recomputed, in program order
        produced = {o for e in entries for o in e.outputs}
        ins: list[int] = []
        avals: dict[int, Any] = {}
        for e in entries:
            for gid, av in zip(e.inputs, e.input_avals or (None,) * len(e.inputs)):
                if gid is not None and gid not in produced and gid not in ins:
                    ins.append(gid)
                    avals[gid] = av
            for gid, av in zip(e.outputs, e.output_avals or (None,) * len(e.outputs)):
                avals[gid] = av
        self.in_ids = tuple(ins)
        self.out_ids = tuple(o for e in entries for o in e.outputs)
        self.avals = avals


def _bind(step: Any, env: dict[int, Any]) -> None:
    vals = [x.value if isinstance(x, _Const) else env[x] for x in step.ins]
    env.update(zip(step.outs, step.bind(vals)))


def _record(e: _Entry, env: dict[int, Any]) -> Record:
    leaves = []
    for r in e.refs:
        if isinstance(r, tuple):
            leaves.append(r[1])
        elif isinstance(r, _Const):
            leaves.append(r.value)
        else:
            leaves.append(env[r])
    return jax.tree_util.tree_unflatten(e.treedef, leaves)


@dataclasses.dataclass(frozen=True, eq=False)
class RecordSegmentBackward(Record):
    """A run of rf records rematerialised to fit a memory budget: keeps only
    its slice's inputs; backward re-runs the slice and walks the records."""

    multi_output = True
    inputs: tuple[jax.Array, ...]
    segment: _Segment

    def backward(self, g, needs):
        seg = self.segment

        def run(ins, g):
            env = dict(zip(seg.slots, ins))
            for i in seg.order:
                _bind(seg.program.steps[i], env)
            entries = [
                new_entry(_record(e, env), e.inputs, e.outputs, e.input_avals, e.output_avals, (), (), ())
                for e in seg.entries
            ]
            seeds = {o: x for o, x in zip(seg.out_ids, g) if x is not None}
            grads = walk(entries, seeds, keep=set(seg.in_ids), foreign=lambda gid: None)
            return [grads.get(i) if n else None for i, n in zip(seg.in_ids, needs)]

        # Note [Memory budget]: neither reuse the forward's values nor run ahead of the
        # walk (the barrier over the inputs and the cotangents), nor let XLA:CPU merge
        # the recomputation back (Note [Recomputation kept apart])
        return tuple(recompute(run, list(self.inputs), list(g)))

    @property
    def label(self) -> str:
        names = ", ".join(e.name for e in self.segment.entries)
        return f"RecordSegmentBackward({names})"


def run_on_records(
    tape: Any, program: Program, entries: list[_Entry], out: tuple, nout: int, planner: RecordPlanner,
    segs: Sequence[tuple[int, int]], values: Sequence[Any],
) -> Any:  # fmt: skip
    """The forward with ``segs`` (entry ranges) rematerialised, recorded on ``tape``."""
    env: dict[int, Any] = dict(zip(program.in_slots, values))
    for st in program.steps:
        _bind(st, env)
    starts = {a: b for a, b in segs}
    k = 0
    while k < len(entries):
        b = starts.get(k)
        if b is None:
            e = entries[k]
            tape.append(_record(e, env), e.inputs, e.outputs, e.input_avals, e.output_avals)
            k += 1
            continue
        frontier, order, _, _ = planner._slice(k, b)
        slots = sorted(frontier)
        seg = _Segment(program, entries[k:b], slots, order)
        rec = RecordSegmentBackward(tuple(env[s] for s in slots), seg)
        tape.append(
            rec,
            seg.in_ids,
            seg.out_ids,
            tuple(seg.avals[i] for i in seg.in_ids),
            tuple(seg.avals[o] for o in seg.out_ids),
        )
        k = b
    out_tree, out_statics, omask, out_ids = out
    results = [r.value if isinstance(r, _Const) else env[r] for r in program.out_refs[:nout]]
    tensors = [Tensor._wrap(v, gid) for v, gid in zip(results, out_ids)]
    it_o, it_s = iter(tensors), iter(out_statics)
    return jax.tree_util.tree_unflatten(out_tree, [next(it_o) if m else next(it_s) for m in omask])


set_budget(check_budget, run_budgeted)  # memory_budget= of rf.grad / value_and_grad / Tape

declare(OpDecl(name="memory_budget", kind="composite", records=(RecordSegmentBackward,), module=__name__))
