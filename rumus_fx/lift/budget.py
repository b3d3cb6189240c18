"""Activation memory to a budget: ``memory_budget=`` of ``rf.grad``,
``rf.value_and_grad`` and ``rf.Tape``.

Note [Memory budget]
~~~~~~~~~~~~~~~~~~~~
The tape knows what every record saves for backward; ``jax.grad`` does not. Given
a budget for those saved activations, a function is run in three steps:

1. **Measure.** ``fun`` is traced once to a jaxpr (``jax.make_jaxpr``, abstract: no
   array is computed) and flattened into rf's lifted program (Note [Lifting] in
   lift/interpreter.py). Each step's rule says which of its inputs and outputs
   its record keeps (``rule.saves``); ``jax.eval_shape`` of the program gives the
   extra residuals some rules compute (a scan's stacked carries). So every step's
   saved bytes are known before anything runs, and so is its forward cost (FLOPs
   of ``dot_general``/``conv``; the output size of everything else).
2. **Plan.** The steps are grouped into atoms: each matmul, convolution or
   control-flow step alone, and each maximal run of the cheap steps between them
   (elementwise, reductions, reshapes). A plan is a set of disjoint contiguous
   runs of atoms, *segments*, each rematerialised as ``rf.checkpoint`` does: its
   record keeps only the segment's inputs and its backward re-runs the segment's
   forward. The estimated peak of saved bytes of a plan is the bytes kept by the
   steps outside segments and by the segments' inputs (each buffer once), plus
   the largest segment's own residuals (alive while that segment's backward
   runs). Starting from no segment, a greedy loop takes, among the moves "make
   one atom a segment", "grow a segment by the next atom on either side" and
   "merge two neighbouring segments", the one that frees the most bytes per
   FLOP recomputed, until the estimate fits the budget. Cheap elementwise runs
   (a layer norm's, a GELU's, a softmax's intermediates) are therefore
   recomputed first and matmuls only when the budget asks for it, as PyTorch's
   activation-memory budget does.
3. **Run.** When the plan has no segment (the budget is at least the unbudgeted
   bytes) ``fun`` runs on the tape exactly as without a budget. Otherwise the
   program is replayed with each segment wrapped in ``jax.checkpoint`` and
   recorded as one lifted entry (one ``RematBackward`` per segment). The
   gradients are the unbudgeted ones (the same primitive rules; recomputation
   repeats the same operations).

The budget is bytes (an ``int``) or a fraction (a ``float`` in (0, 1]) of the
*base*: the bytes the records of ``fun``'s primitives would keep without a budget
(``memory_plan(...).base_bytes``). A budget below what the plan can reach (every
input a segment needs is kept, and one segment's residuals are alive at a time)
is not silently ignored: the best plan found runs and a ``MemoryBudgetWarning``
says the budget, the base and the estimate achieved.
Under ``jax.jit`` all of this happens once, at trace time; eagerly each call
traces ``fun`` once more to plan (use ``jax.jit`` for speed).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..autograd.record import VersionSnapshot
from ..autograd.tape import current_tape, set_budget, suspend_recording
from ..kernels.dispatch import use as kernel_mode
from ..tensor import Tensor, next_grad_id
from .interpreter import LiftedBackward, Program, _Const, is_array_leaf, weak_values

MAX_HEAVY = 1  # matmuls (convolutions, loops) one segment may recompute
TRANSIENT = 2  # a segment's recomputed activations and their cotangents, alive during its backward

__all__ = ["MemoryBudgetWarning", "MemoryPlan", "check_budget", "memory_plan", "run_budgeted"]


class MemoryBudgetWarning(RuntimeWarning):
    """A ``memory_budget`` below what rematerialisation can reach: the best plan
    found runs, and the warning says what it achieves."""


# primitives whose step is an atom of its own (expensive to recompute)
_HEAVY = frozenset(
    {"dot_general", "conv_general_dilated", "scan", "while", "cond", "remat2", "checkpoint", "custom_vjp_call",
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

    def __str__(self) -> str:
        return (
            f"memory plan: {len(self.segments)} segments over {self.steps} steps rematerialised; saved bytes "
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
        starts = {self.atoms[a][0]: (a, b) for a, b in segs}
        sb = self.slot_bytes
        kept: set[int] = set()
        total = 0
        transient_peak = 0
        cost = 0.0
        i = 0
        while i < self.n:
            seg = starts.get(i)
            if seg is None:
                for s in self.saves[i]:
                    if s not in kept:
                        kept.add(s)
                        total += sb[s]
                i += 1
                continue
            ins, own, c = self._range(*seg)
            for s in ins:
                if s not in kept:
                    kept.add(s)
                    total += sb[s]
            transient_peak = max(transient_peak, total + TRANSIENT * sum(sb[s] for s in own if s not in kept))
            cost += c
            i = self.atoms[seg[1] - 1][1]
        return max(total, transient_peak), cost

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


def _analyse(fun: Callable, args: tuple, kwargs: dict, budget: int | float, label: str) -> tuple:
    leaves, treedef, mask, arrays = _split(args, kwargs)
    closed, out_info = _trace(fun, leaves, treedef, mask)
    tracked_in = tuple(isinstance(x, Tensor) and x.grad_id is not None for x in arrays)
    program = Program(closed, tracked_in, label)
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in program.in_avals]
    planner = _Planner(program, _extra_bytes(program, avals))
    base, _ = planner.estimate([])
    target = int(budget * base) if isinstance(budget, float) else int(budget)
    forward_flops = sum(planner.cost)
    if base <= target:
        plan = MemoryPlan(base, target, base, [], 0.0, forward_flops, True, planner.n)
        return plan, planner, closed, out_info, arrays, tracked_in
    segs, est, cost = planner.plan(target)
    plan = MemoryPlan(base, target, est, planner.step_ranges(segs), cost, forward_flops, est <= target, planner.n)
    return plan, planner, closed, out_info, arrays, tracked_in


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

    def bind(st: Any, env: dict[int, Any]) -> None:
        vals = [x.value if isinstance(x, _Const) else env[x] for x in st.ins]
        outs = st.prim.bind(*vals, **st.prim.get_bind_params(st.params))
        if not st.prim.multiple_results:
            outs = (outs,)
        for s, o in zip(st.outs, outs):
            env[s] = o

    def segment(lo: int, hi: int) -> tuple[list[int], list[int], Callable]:
        written = {s for i in range(lo, hi) for s in steps[i].outs}
        ins = sorted({x for i in range(lo, hi) for x in steps[i].ins if isinstance(x, int) and x not in written})
        outs = sorted(s for s in written if last_use.get(s, -1) >= hi)

        def run(*vals: Any) -> list:
            env = dict(zip(ins, vals))
            for i in range(lo, hi):
                bind(steps[i], env)
            return [env[s] for s in outs]

        return ins, outs, run

    def replay(*inputs: Any) -> list:
        env: dict[int, Any] = dict(zip(program.in_slots, inputs))
        i = 0
        while i < n:
            hi = seg_at.get(i)
            if hi is None:
                bind(steps[i], env)
                i += 1
                continue
            ins, outs, run = segment(i, hi)
            results = jax.checkpoint(run, prevent_cse=True)(*[env[s] for s in ins])
            env.update(zip(outs, results))
            i = hi
        return [r.value if isinstance(r, _Const) else env[r] for r in program.out_refs]

    return replay


def run_budgeted(fun: Callable, args: tuple, kwargs: dict, memory_budget: int | float, name: str = "fun") -> Any:
    """``fun(*args, **kwargs)`` recorded on the current tape with its saved
    activations planned to ``memory_budget`` (Note [Memory budget]); returns
    ``fun``'s output (array leaves as Tensors, tracked where they depend on a
    tracked input)."""
    tape = current_tape()
    if tape is None:
        return fun(*args, **kwargs)
    plan, planner, closed, out_info, arrays, tracked_in = _analyse(fun, args, kwargs, memory_budget, name)
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
    program = planner.program
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
            if t is not None and t.grad_id is not None and s in budgeted.residual_index
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


set_budget(check_budget, run_budgeted)  # memory_budget= of rf.grad / value_and_grad / Tape
