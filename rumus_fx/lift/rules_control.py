"""Primitive rules for control flow and calls: scan, cond, while, remat
(``jax.checkpoint``) and custom_vjp_call (the user's own backward).

Note [Control flow on the tape]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A body jaxpr becomes a nested ``Program`` (``program.py``) with its own
per-primitive records. ``scan`` runs the body program inside ``lax.scan`` so that
each iteration also returns the body's residuals, stacked along the scan axis
(the record's ``extra``); its backward is a reverse ``lax.scan`` of the body's
backward walk, carrying the carry's and the constants' gradients. The body is
recorded once, whatever the length. ``cond`` runs ``lax.switch`` over branch
programs that return the residuals of every branch (zeros for the branches not
taken) and its backward switches the same way. ``remat`` saves only its inputs
and re-runs the body's forward in backward. ``custom_vjp_call`` runs the user's
``fwd`` and keeps its residuals; backward calls the user's ``bwd``.
"""

from __future__ import annotations

import importlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.extend import core as jcore

from .. import sharding as shd
from ..autograd.registry import BadProgram, Sample, TableEntry
from ..errors import AutogradError
from ..ops._declare import normal, positive, unary_samples
from .apart import barrier, kept_apart, recompute
from .concrete import needs_values
from .jax_versions import bwd_cotangents, closed, require_params, scan_counts, vary_over, varying_axes, varying_like
from .program import Program, ReachedInputs, custom_function_name, trace_custom_rule, without_identities
from .rules import defrule, is_float
from .rules_custom import closure_input


def _program(jaxpr, tracked, name):
    return Program(closed(jaxpr), tracked, name)


def _zeros_like_aval(a, sharding=None):
    return shd.zeros(a.shape, a.dtype, sharding)


def _or_zeros(gs, avals, shardings=None):
    shardings = shardings or (None,) * len(avals)
    return [(_zeros_like_aval(a, s) if g is None else g) for g, a, s in zip(gs, avals, shardings)]


def _unstacked(s):
    """The sharding of one slice of a scanned-over operand (its leading axis dropped)."""
    return None if s is None else shd.with_spec(s, tuple(s.spec)[1:])


def _float_or_none(gs, avals):
    """Gradients for non-float inputs are dropped (integer carries, indices)."""
    return [g if is_float(a) else None for g, a in zip(gs, avals)]


def _in_manual_context() -> bool:
    """Inside a ``shard_map`` body (some mesh axes manual), where values carry
    the manual axes they vary over and control flow needs equal types."""
    return bool(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))


def _same_types(a: Any, b: Any) -> bool:
    return all(varying_axes(x) == varying_axes(y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _typed_carry(body, init, xs, length):
    """A backward scan's initial carry (zeros for the cotangents, which vary
    nowhere) made to vary over the manual axes the body's carry output varies
    over (``lax.scan`` requires equal types; only inside a ``shard_map`` body do
    they differ): the body is run abstractly until the types stop growing."""
    if not length or not _in_manual_context():
        return init
    for _ in range(len(jax.sharding.get_abstract_mesh().axis_names) + 1):
        out = jax.eval_shape(lambda c, xs: body(c, jax.tree.map(lambda a: a[0], xs))[0], init, xs)
        typed = jax.tree.map(varying_like, init, out)
        if _same_types(typed, init):
            break
        init = typed
    return init


def _typed_branches(branches, *operands):
    """``lax.switch`` branches whose outputs vary over the same manual axes
    (inside a ``shard_map`` body a gradient one branch leaves as zeros varies
    nowhere, another branch's may vary)."""
    if not _in_manual_context():
        return branches
    outs = [jax.eval_shape(b, *operands) for b in branches]
    union = [
        frozenset().union(*(varying_axes(o) for o in leaves)) for leaves in zip(*(jax.tree.leaves(o) for o in outs))
    ]

    def typed(b):
        def run(*ops):
            out = b(*ops)
            leaves, tree = jax.tree.flatten(out)
            return jax.tree.unflatten(tree, [vary_over(x, u) for x, u in zip(leaves, union)])

        return run

    return [typed(b) for b in branches]


# -- scan -------------------------------------------------------------------------


def _loop_body(body, needs, nc: int, nk: int, name: str) -> Program:
    """A loop body's program, its inputs ``nc`` constants, ``nk`` carries (its
    first ``nk`` outputs) and the rest, with each carry tracked at the fixed point:
    if its initial value is or the body makes it so."""
    tracked = [bool(n) for n in needs]
    for _ in range(nk + 1):
        prog = _program(body, tracked, name)
        carry = [a or b for a, b in zip(tracked[nc : nc + nk], prog.out_tracked[:nk])]
        if carry == tracked[nc : nc + nk]:
            break
        tracked[nc : nc + nk] = carry
    return prog


def _carries_tracked(prog: Program, nc: int, nk: int) -> list[bool]:
    """Which of a loop body's carries (inputs ``nc`` to ``nc + nk``) are tracked."""
    return [bool(prog.tracked[s]) for s in prog.in_slots[nc : nc + nk]]


def _scan_prepare(step):
    nc, nk = scan_counts(step.params)
    return _loop_body(step.params["jaxpr"], step.needs, nc, nk, "scan body")


def _forwarded(prog, nc, nk):
    """Positions of the body's residuals that are its own inputs, which the scan
    need not stack: ``{residual position: (kind, input index)}`` with kind
    ``"const"`` (loop-invariant: saved once, not once per iteration) or ``"x"``
    (the iteration's slice of a scanned-over input: read back from that input)."""
    where = {}
    for j, slot in enumerate(prog.residual_slots):
        if slot in prog.in_slots:
            i = prog.in_slots.index(slot)
            if i < nc:
                where[j] = ("const", i)
            elif i >= nc + nk:
                where[j] = ("x", i - nc - nk)
    return where


def _scan_forward(step, vals):
    p = step.params
    nc, nk = scan_counts(p)
    prog = step.sub
    consts, init, xs = vals[:nc], vals[nc : nc + nk], vals[nc + nk :]
    forwarded = _forwarded(prog, nc, nk)

    def body(carry, x):
        outs, (values, extras) = prog.run([*consts, *carry, *x])
        values = tuple(None if j in forwarded else v for j, v in enumerate(values))
        return outs[:nk], (outs[nk:], (values, extras))

    carry, (ys, res) = lax.scan(
        body, list(init), list(xs), length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
    )
    # the forwarded residuals' sources, each kept once: the constants themselves and
    # the whole scanned-over inputs (the body reads its slice of them in backward)
    kept_consts = {i: consts[i] for kind, i in forwarded.values() if kind == "const"}
    kept_xs = {i: xs[i] for kind, i in forwarded.values() if kind == "x"}
    return [*carry, *ys], (res, kept_consts, kept_xs)


def _scan_vjp(r, g):
    p = r.params
    nc, nk = scan_counts(p)
    prog = r._step.sub
    g = list(g)
    ct_carry, ct_ys = g[:nk], g[nk:]
    avals = r.in_avals
    const_avals = avals[:nc]
    carry_avals = avals[nc : nc + nk]
    x_avals = avals[nc + nk :]
    shs = r.in_shardings or (None,) * len(avals)
    const_sh, carry_sh = shs[:nc], shs[nc : nc + nk]
    x_sh = [_unstacked(s) for s in shs[nc + nk :]]

    stacked, kept_consts, kept_xs = r.extra
    forwarded = _forwarded(prog, nc, nk)
    # the dead carries: no cotangent reaches them, neither the final carry's nor, in
    # any iteration, a live output's through the body (Note [An unused output adds
    # nothing] in program.py); they enter the body as missing
    dead = [c is None for c in ct_carry]
    reached = ReachedInputs(len(avals))

    def body(acc, inp):
        ct_c, ct_consts = acc
        (values, extras), x_slices, ct_y = inp
        values = tuple(
            v
            if j not in forwarded
            else (kept_consts[forwarded[j][1]] if forwarded[j][0] == "const" else x_slices[forwarded[j][1]])
            for j, v in enumerate(values)
        )
        grads = prog.backward((values, extras), [*(None if d else c for c, d in zip(ct_c, dead)), *ct_y])
        reached.note(grads)
        g_consts = grads[:nc]
        g_carry = _or_zeros(grads[nc : nc + nk], carry_avals, carry_sh)
        g_xs = _or_zeros(grads[nc + nk :], x_avals_unstacked, x_sh)
        ct_consts = [a + b if b is not None else a for a, b in zip(ct_consts, g_consts)]
        return (g_carry, ct_consts), g_xs

    x_avals_unstacked = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in x_avals]
    init = (_or_zeros(ct_carry, carry_avals, carry_sh), [_zeros_like_aval(a, s) for a, s in zip(const_avals, const_sh)])
    xs = (stacked, kept_xs, ct_ys)
    if p["length"]:
        # the least fixed point: a dead carry the body's walk reaches becomes live (an
        # abstract run of one iteration per step, only while some carry is missing)
        while any(dead):
            jax.eval_shape(lambda c, xs: body(c, jax.tree.map(lambda a: a[0], xs)), init, xs)
            grown = [d and reached.hit[nc + k] for k, d in enumerate(dead)]
            if not any(grown):
                break
            dead = [d and not gr for d, gr in zip(dead, grown)]
    init = _typed_carry(body, init, xs, p["length"])
    (g_init, g_consts), g_xs = lax.scan(body, init, xs, length=p["length"], reverse=not p["reverse"])
    # a constant or scanned-over input the body never reached, and a dead carry's
    # initial value, get no gradient (None, not zeros); a live carry keeps its zeros
    g_consts = reached.keep(g_consts)
    g_xs = reached.keep(g_xs, nc + nk)
    g_init = [None if d else gi for gi, d in zip(g_init, dead)]
    out = [*g_consts, *g_init, *g_xs]
    return tuple(g if n else None for g, n in zip(_float_or_none(out, avals), r.needs))


def _scan_program(w, x):
    def body(h, xi):
        h = jnp.tanh(h * w + xi)
        return h, h * 2.0

    h, ys = lax.scan(body, x[0], x)
    return jnp.sum(ys) + h


def _scan_out_tracked(step):
    """The carries tracked at the body's fixed point (their initial values or the body
    make them so), the stacked outputs as the body's (Note [Tracked outputs] in program.py)."""
    nc, nk = scan_counts(step.params)
    return _carries_tracked(step.sub, nc, nk) + list(step.sub.out_tracked[nk:])


def _scan_runs_on_zero(step):
    """jax's scan transpose runs its body on zero cotangents when a carry is
    differentiated (it makes the carries' zero cotangents zeros): Note [A user's bwd
    on zero cotangents] in program.py."""
    nk = scan_counts(step.params)[1]
    return any(step.program.tracked[s] for s in step.outs[:nk])


_scan_vjp.prepare = _scan_prepare
_scan_vjp.out_tracked = _scan_out_tracked
_scan_vjp.runs_on_zero = _scan_runs_on_zero
# a missing cotangent comes as None (Note [An unused output adds nothing] in program.py);
# a marked one (Note [A user's bwd on zero cotangents]) as zeros for a carry, as None
# for a stacked output, which jax's transpose drops
_scan_vjp.unused_as_none = True
_scan_vjp.reached_as_zeros = lambda step: range(scan_counts(step.params)[1])
defrule(
    "scan",
    _scan_vjp,
    forward=_scan_forward,
    multiple_results=True,
    table=(
        TableEntry(
            "scan",
            _scan_program,
            lambda r: [Sample((normal(r, 4) * 0.5, normal(r, 5, 4)), diff=(0, 1))],
            vmap=True,
        ),
    ),
)


# -- cond -------------------------------------------------------------------------


def _cond_prepare(step):
    needs = list(step.needs[1:])
    progs = [_program(b, needs, f"cond branch {i}") for i, b in enumerate(step.params["branches"])]
    return progs


def _branch_residual_avals(step, ops):
    return [jax.eval_shape(lambda *o, prog=prog: prog.run(list(o))[1], *ops) for prog in step.sub]


def _cond_forward(step, vals):
    index, ops = vals[0], vals[1:]
    progs = step.sub
    res_avals = _branch_residual_avals(step, ops)  # the operands' own types (sharding, varying axes)

    def branch(k):
        def run(*o):
            outs, res = progs[k].run(list(o))
            all_res = [
                res
                if j == k
                else jax.tree.map(
                    lambda a: varying_like(shd.zeros(a.shape, a.dtype, shd.explicit(a.sharding)), a), res_avals[j]
                )
                for j in range(len(progs))
            ]
            return outs, all_res

        return run

    outs, res = lax.switch(index, [branch(k) for k in range(len(progs))], *ops)
    return list(outs), (index, res)


def _cond_vjp(r, g):
    index, res = r.extra
    progs = r._step.sub
    op_avals = r.in_avals[1:]
    op_sh = (r.in_shardings or (None,) * len(r.in_avals))[1:]

    reached = ReachedInputs(len(op_avals))

    def branch(k):
        def run(res_all, gs):
            grads = progs[k].backward(res_all[k], list(gs))
            reached.note(grads)
            return _or_zeros(grads, op_avals, op_sh)

        return run

    branches = _typed_branches([branch(k) for k in range(len(progs))], res, list(g))
    grads = lax.switch(index, branches, res, list(g))
    # an operand no branch reaches gets None (jax's dead-code elimination of a cond
    # keeps the operands some branch uses; the others' branches give zeros)
    grads = _float_or_none(reached.keep(grads), op_avals)
    return (None, *(gr if n else None for gr, n in zip(grads, r.needs[1:])))


def _cond_samples(r):
    return [
        Sample((positive(r, 3), normal(r, 3)), diff=(0, 1)),
        Sample((-positive(r, 3), normal(r, 3)), diff=(0, 1)),
    ]


def _cond_out_tracked(step):
    """An output is tracked if some branch makes it so (Note [Tracked outputs] in program.py)."""
    return [any(prog.out_tracked[k] for prog in step.sub) for k in range(len(step.outs))]


_cond_vjp.prepare = _cond_prepare
_cond_vjp.out_tracked = _cond_out_tracked
_cond_vjp.unused_as_none = True  # Note [An unused output adds nothing] in program.py
defrule(
    "cond",
    _cond_vjp,
    forward=_cond_forward,
    multiple_results=True,
    table=(
        TableEntry(
            "cond",
            lambda x, y: lax.cond(jnp.sum(x) > 0, lambda a, b: jnp.sin(a) * b, lambda a, b: a * b**2, x, y),
            _cond_samples,
        ),
    ),
)


# -- while ------------------------------------------------------------------------


def _while_vjp(r, g):
    raise AutogradError(
        "Reverse-mode differentiation does not work for lax.while_loop (its trip count is only "
        "known at run time), in rf as in jax.grad. Use lax.scan or lax.fori_loop with static "
        "bounds (rf.lax.scan / rf.lax.fori_loop), which record their body once."
    )


def _while_out_tracked(step):
    """The carries tracked at the body's fixed point (Note [Tracked outputs] in
    program.py): a value read only by the loop's condition decides the trip count
    and makes no carry tracked. None (every float carry tracked, as before this
    analysis) where the body cannot be marked: then a gradient reaching the loop is
    refused by ``_while_vjp`` as always."""
    p = step.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    nk = len(step.needs) - nc - nb
    try:
        prog = _loop_body(p["body_jaxpr"], step.needs[nc:], nb, nk, "while body")
    except Exception:  # e.g. a primitive without a rule on a tracked path in the body
        return None
    return _carries_tracked(prog, nb, nk)


_while_vjp.out_tracked = _while_out_tracked


def _while_errors():
    def f(x):
        return jnp.sum(lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.sin(c[1])), (0, x))[1])

    return [BadProgram("reverse", f, (np.array([0.3, 0.7]),), AutogradError, ("while_loop", "lax.scan"))]


defrule("while", _while_vjp, multiple_results=True, errors=_while_errors)


# -- remat (jax.checkpoint) ------------------------------------------------------------


def _remat_prepare(step):
    return _program(step.params["jaxpr"], list(step.needs), "checkpoint body")


def _remat_forward(step, vals):
    outs, _ = step.sub.run(list(vals))  # residuals dropped: recomputed in backward
    return outs, ()


def _cse_flags(prevent_cse: Any, n: int) -> list[bool]:
    """Which of a checkpoint's ``n`` inputs ``prevent_cse`` pins: a bool for all of
    them, or (jax 0.11) a tuple with one bool per input of the equation."""
    if isinstance(prevent_cse, (tuple, list)) and len(prevent_cse) == n:
        return [bool(f) for f in prevent_cse]
    return [bool(prevent_cse)] * n


def _pinned(prevent_cse: Any, ins: list, g: list) -> tuple[list, list]:
    """The inputs and cotangents of a user's ``jax.checkpoint`` backward behind the
    optimisation barrier jax.grad's program has: ``remat_transpose`` (jax's
    ad_checkpoint.py, 0.10 and 0.11) pins the inputs ``prevent_cse`` selects *and*
    the cotangents whenever any is pinned, in one barrier. The cotangents matter: on
    XLA:CPU with jax 0.11 a barrier over the inputs alone lets the recomputation be
    scheduled in the forward (no memory saved), one that also holds the cotangents
    cannot run before them. (Inside a ``shard_map`` body, values that vary over
    different manual axes go behind separate barriers: ``barrier`` in apart.py.)"""
    flags = _cse_flags(prevent_cse, len(ins))
    if not any(flags):
        return ins, g
    kept, g = barrier(([x for x, f in zip(ins, flags) if f], g))
    kept = iter(kept)
    return [next(kept) if f else x for x, f in zip(ins, flags)], list(g)


def _remat_vjp(r, g):
    prog = r._step.sub

    def backward(ins, g):
        _, res = prog.run(ins)
        return list(prog.backward(res, g))

    prevent_cse = r.params.get("prevent_cse", True)
    if kept_apart(r.params.get("policy")) and any(_cse_flags(prevent_cse, len(r.ins))):
        # rf's own segment (rf.checkpoint, memory_budget=): Note [Recomputation kept apart]
        grads = recompute(backward, list(r.ins), list(g))
    else:  # a user's jax.checkpoint: the barrier jax.grad's program has
        grads = backward(*_pinned(prevent_cse, list(r.ins), list(g)))
    return tuple(gr if n else None for gr, n in zip(grads, r.needs))


_remat_vjp.prepare = _remat_prepare
_remat_vjp.out_tracked = lambda step: list(step.sub.out_tracked)  # as its body's (Note [Tracked outputs])
_remat_vjp.unused_as_none = True  # Note [An unused output adds nothing] in program.py
defrule(
    "remat2",
    _remat_vjp,
    lambda needs: (tuple(range(len(needs))), ()),
    forward=_remat_forward,
    multiple_results=True,
    record_name="RematBackward",
    table=(
        TableEntry(
            "remat2",
            lambda x, y: jax.checkpoint(lambda a, b: jnp.sin(a @ b) * a)(x, y),
            lambda r: [Sample((normal(r, 3, 3), normal(r, 3, 3)), diff=(0, 1))],
        ),
    ),
)
defrule(
    "checkpoint",
    _remat_vjp,
    lambda needs: (tuple(range(len(needs))), ()),
    forward=_remat_forward,
    multiple_results=True,
    record_name="CheckpointBackward",
)


# -- calls that run their body somewhere or somehow (compute_on, xla_metadata_call) ----
#
# ``jax.experimental.compute_on.compute_on2`` runs its body on the host
# (``device_host``); ``jax.experimental.scheduling_groups.xla_metadata_call`` (and
# ``scheduling_group``) attaches XLA metadata to it. Each is a call of one jaxpr. rf runs
# the body's program inside the same call (``wrap``: jax's own function for it,
# retracing ``run``), and its backward inside another, as jax's transpose does; the
# residuals leave the call as outputs (in device memory).


def _wrapped_call_rule(name: str, wrap, params_read: tuple[str, ...], what: str, **options: Any) -> None:
    """Declare the rule of the call primitive ``name``: ``wrap(params, fun, spaces)``
    is ``fun`` run as the primitive with these parameters runs its body (``spaces``:
    the memory spaces of its outputs, a prefix of their tree), with jax's function
    ``what`` (``module.function``)."""

    def prepare(step):
        require_params(step, ("jaxpr", *params_read), what)
        module, _, function = what.rpartition(".")
        if not hasattr(importlib.import_module(module), function):
            raise AutogradError(
                f"rf.lift: jax {jax.__version__} has no {what}, which rf's rule for '{name}' runs the body and "
                "its backward with; rf does not differentiate it here."
            )
        return _program(step.params["jaxpr"], list(step.needs), f"{name} body")

    def forward(step, vals):
        prog = step.sub

        def run(*ins):
            outs, res = prog.run(list(ins))
            return tuple(outs), res

        spaces = (tuple(step.params.get("out_memory_spaces", ())), jax.memory.Space.Device)
        outs, res = wrap(step.params, run, spaces)(*vals)
        return list(outs), res

    def vjp(r, g):
        prog = r._step.sub

        def backward(res, gs):
            grads = prog.backward(res, list(gs))
            return [gr if n else None for gr, n in zip(grads, r.needs)]

        # each gradient in its operand's memory space (jax's transpose of compute_on does the same)
        spaces = [getattr(a, "memory_space", jax.memory.Space.Device) for a in r.in_avals]
        return tuple(wrap(r.params, backward, spaces)(r.extra, tuple(g)))

    vjp.__name__ = f"_{name}_vjp"
    vjp.prepare = prepare
    vjp.out_tracked = lambda step: list(step.sub.out_tracked)  # as its body's (Note [Tracked outputs])
    vjp.unused_as_none = True  # Note [An unused output adds nothing] in program.py
    defrule(name, vjp, ((), ()), forward=forward, multiple_results=True, **options)


def _compute_on(params, fun, spaces):
    import json

    from jax.experimental.compute_on import compute_on2

    options = params.get("compiler_options_json")
    return compute_on2(
        fun,
        compute_type=params["compute_type"],
        out_memory_spaces=spaces,
        compiler_options=None if options is None else json.loads(options),
    )


def _xla_metadata_call(params, fun, spaces):
    from jax.experimental.scheduling_groups import xla_metadata_call

    return xla_metadata_call(fun, **{k: v for k, v in params.items() if k != "jaxpr"})


def _two_outputs(a, b):
    return jnp.sin(a @ b) * a, jnp.exp(b)


def _compute_on_program(x, y):
    from jax.experimental.compute_on import compute_on2

    device = jax.memory.Space.Device
    u, v = compute_on2(_two_outputs, compute_type="device_host", out_memory_spaces=(device, device))(x, y)
    return u * v


def _scheduling_group_program(x, y):
    from jax.experimental.scheduling_groups import scheduling_group

    u, v = scheduling_group("rf_table")(_two_outputs)(x, y)
    return u * v


def _square_samples(r):
    return [Sample((normal(r, 3, 3), normal(r, 3, 3)), diff=(0, 1))]


_wrapped_call_rule(
    "compute_on",
    _compute_on,
    ("compute_type", "out_memory_spaces"),
    "jax.experimental.compute_on.compute_on2",
    record_name="ComputeOnBackward",
    table=(TableEntry("compute_on", _compute_on_program, _square_samples, vmap=True),),
)
_wrapped_call_rule(
    "xla_metadata_call",
    _xla_metadata_call,
    (),
    "jax.experimental.scheduling_groups.xla_metadata_call",
    record_name="XlaMetadataCallBackward",
    table=(TableEntry("xla_metadata_call", _scheduling_group_program, _square_samples, vmap=True),),
)


# -- custom_vjp_call --------------------------------------------------------------------


def _custom_vjp_prepare(step):
    p = step.params
    nc = p["num_consts"]
    if any(step.needs[:nc]):
        raise AutogradError(
            "rf.lift: a jax.custom_vjp function closes over a tracked value; its bwd cannot "
            "give that value a gradient. Pass it as an argument (jax.closure_convert)."
        )
    # the fwd is told which inputs are perturbed: exactly those that carry a gradient
    # (a symbolic_zeros=True fwd, e.g. equinox.filter_custom_vjp's, branches on it)
    perturbed = [bool(n) for n in step.needs[nc:]]
    name = custom_function_name(p)
    fwd_jaxpr, fwd_consts = trace_custom_rule(p["fwd_jaxpr_thunk"], perturbed, f"fwd of jax.custom_vjp '{name}'")
    fwd_jaxpr = without_identities(fwd_jaxpr)  # Note [Layout constraints dropped] in program.py
    out_tree, res_tree, input_fwds = p["out_trees"]()
    if out_tree.num_leaves != len(step.out_avals):
        raise AutogradError(
            f"rf.lift: the fwd of jax.custom_vjp '{name}' returns {out_tree.num_leaves} outputs where the call has "
            f"{len(step.out_avals)}: a transformation (jax.experimental.checkify) changed the function and not "
            "its fwd and bwd (jax.grad of the function under jax.jit fails on it too)."
        )
    n_args = len(step.ins) - nc
    # a value of the lifted function the fwd closes over becomes an input of the step
    # (as for a custom_jvp's rule), read at each run: the fwd's constants are bound then
    const_refs = tuple(
        closure_input(step, c, name, "custom_vjp") if isinstance(c, jax.core.Tracer) else ("value", c)
        for c in fwd_consts
    )
    fwd = closed(fwd_jaxpr, fwd_consts)
    # residuals that are constants of the fwd (a Python bool or int the fwd returns)
    # stay static values: the bwd may branch on them in Python
    n_res = sum(k is None for k in input_fwds)
    static = {j: v.val for j, v in enumerate(fwd.jaxpr.outvars[:n_res]) if isinstance(v, jcore.Literal)}
    return {
        "fwd": fwd,
        "fwd_open": fwd_jaxpr if any(kind == "in" for kind, _ in const_refs) else None,
        "const_refs": const_refs,
        "n_args": n_args,
        "input_fwds": tuple(input_fwds),
        "n_out": out_tree.num_leaves,
        "nc": nc,
        "static": static,
        "symbolic_zeros": bool(p["symbolic_zeros"]),
        "name": name,
    }


def _custom_vjp_forward(step, vals):
    info = step.sub
    nc = info["nc"]
    args = vals[nc : nc + info["n_args"]]  # (values the fwd closes over follow them)
    fwd = info["fwd"]
    if info["fwd_open"] is not None:
        fwd = closed(info["fwd_open"], [vals[ref] if kind == "in" else ref for kind, ref in info["const_refs"]])
    try:
        outs = jcore.jaxpr_as_fun(fwd)(*args)
    except jax.errors.UnexpectedTracerError as e:
        # a custom_vjp/custom_jvp call inside the fwd whose own Python rule (fwd, JVP rule)
        # closes over a value of the lifted function: a transformation around rf (jax.grad,
        # jax.jvp of a function that calls rf) makes JAX trace that rule again, and the
        # value's trace is over
        raise AutogradError(
            f"rf.lift: the fwd of jax.custom_vjp '{info['name']}' calls a jax.custom_vjp/custom_jvp function "
            "whose rule (its fwd or JVP rule) closes over a value the lifted function computed; under a JAX "
            "transformation around rf (jax.grad or jax.jvp of a function that calls rf.grad) JAX traces that "
            "rule again and finds the value gone (jax.grad of jax.jit of the function fails on it too). Pass "
            "the value to the function as an argument (jax.closure_convert). JAX's error: "
            f"{str(e).splitlines()[0]}"
        ) from e
    # the fwd jaxpr returns the residuals that are not inputs, then the outputs
    n_res = sum(k is None for k in info["input_fwds"])
    rest, primal = list(outs[:n_res]), list(outs[n_res:])
    static = info["static"]
    it = iter(x for j, x in enumerate(rest) if j not in static)
    # (static residuals are not saved: the backward puts their values back)
    res = []
    j = 0
    for k in info["input_fwds"]:
        if k is not None:  # an input the fwd returns as a residual: counted with the constants
            res.append(vals[k])
        else:
            if j not in static:
                res.append(next(it))
            j += 1
    return primal, tuple(res)


def _is_zero_ct(x) -> bool:
    """A zero cotangent as a bwd returns it: ``None``, or JAX's (symbolic) zero
    marker, which is not an array."""
    if x is None:
        return True
    if isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex, jax.core.Tracer)):
        return False
    return hasattr(x, "aval")


def _custom_vjp_residuals(info, extra):
    static = info["static"]
    it = iter(extra)
    res = []
    j = 0
    for k in info["input_fwds"]:
        if k is not None:  # an input the fwd returns: a jax array, as jax gives it to the bwd
            v = next(it)
            res.append(jnp.asarray(v) if isinstance(v, (np.ndarray, np.generic)) else v)
        else:
            res.append(static[j] if j in static else next(it))
            j += 1
    return res


def _custom_vjp_vjp(r, g):
    info = r._step.sub
    nc = info["nc"]
    cts = []
    for k, (gk, a) in enumerate(zip(g, r.out_avals)):
        if gk is None:
            if info["symbolic_zeros"]:  # jax gives a symbolic_zeros bwd a marker for a zero cotangent
                gk = SymbolicZero(jax.core.ShapedArray(a.shape, a.dtype).to_tangent_aval())
            elif is_float(a):
                gk = _zeros_like_aval(a, r.out_sharding(k))
            else:  # an integer or boolean output's cotangent, as jax instantiates it
                gk = np.zeros(a.shape, jax.dtypes.float0)
        cts.append(gk)
    try:
        grads = bwd_cotangents(r.params["bwd"].call_wrapped(*_custom_vjp_residuals(info, r.extra), *cts))
    except Exception as e:
        if not needs_values(e):
            raise
        raise AutogradError(
            f"rf.lift: the custom_vjp bwd of {custom_function_name(r.params)} needs the values of its residuals "
            "or cotangents (it turns an array into a Python value or a shape), but rf runs a backward pass as a "
            "compiled program, where they are traced: as under jax.jit(jax.grad(f)), which fails the same way "
            "(only jax.grad run eagerly runs a bwd on values). Build such shapes and Python values from static "
            f"data (array shapes, nondiff_argnums). JAX's error: {str(e).splitlines()[0]}"
        ) from e
    out = [None] * nc
    for gr, a, n in zip(grads, r.in_avals[nc:], r.needs[nc:]):
        if jnp.issubdtype(getattr(gr, "dtype", np.float32), jax.dtypes.extended) and not _is_zero_ct(gr):
            raise AutogradError(
                f"rf.lift: the custom_vjp bwd of {custom_function_name(r.params)} returned a cotangent of the "
                f"extended dtype {gr.dtype} for an input of dtype {a.dtype}: rf's tape keeps each gradient in its "
                "input's dtype, so custom tangent dtypes have no rule in rf.lift"
            )
        if not n or _is_zero_ct(gr) or not is_float(a) or getattr(gr, "dtype", None) == jax.dtypes.float0:
            out.append(None)
        else:
            out.append(jnp.asarray(gr).astype(a.dtype).reshape(a.shape))
    out += [None] * (len(r.in_avals) - len(out))  # values the fwd closes over: no gradient
    return tuple(out)


_custom_vjp_vjp.takes_none = True  # zero cotangents arrive as None (symbolic zeros for the bwd)
# its bwd runs on zero cotangents too (Note [A user's bwd on zero cotangents] in program.py)
_custom_vjp_vjp.runs_user_bwd = True
_custom_vjp_vjp.prepare = _custom_vjp_prepare


@jax.custom_vjp
def _sin_cvjp(x):
    return jnp.sin(x)


_sin_cvjp.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (g * c,))


def _closes_over(x, w):
    """A custom_vjp function that closes over ``w`` (a tracked input)."""

    @jax.custom_vjp
    def f(v):
        return jnp.sin(v) * w

    f.defvjp(lambda v: (f(v), jnp.cos(v) * w), lambda c, g: (g * c,))
    return f(x)


def _closes_over_vmapped(z):
    """A custom_vjp function made inside ``jax.vmap`` closing over the batched value."""

    def per_example(x):
        @jax.custom_vjp
        def scaled(y):
            return x * y

        scaled.defvjp(lambda y: (x * y, x), lambda c, g: (c * g,))
        return scaled(z)

    return jax.vmap(per_example)(jnp.arange(3.0, dtype=z.dtype))


def _fwd_closes_over_a_tracked_value(a, y):
    """A custom_vjp function whose fwd (not its primal) closes over a value
    computed from ``y``, which is tracked."""
    w = jnp.sin(y)

    @jax.custom_vjp
    def scaled(v):
        return v * 2.0

    scaled.defvjp(lambda v: (v * 2.0, v * w), lambda res, g: (2.0 * g,))
    return scaled(a)


def _custom_vjp_errors():
    ones = np.ones(3)
    return [
        BadProgram(
            "its fwd closes over a tracked value",
            _fwd_closes_over_a_tracked_value,
            (ones, ones),
            AutogradError,
            ("'scaled'", "fwd", "tracked value"),
            argnums=(0, 1),
            names=("rf.lift", "jax.custom_vjp"),
        ),
        BadProgram(
            "closes over a value of a jax.vmap inside the function",
            _closes_over_vmapped,
            (np.ones(()),),
            AutogradError,
            ("'scaled'", "jax.vmap", "closure_convert"),
            names=("rf.lift", "jax.custom_vjp"),
        ),
        BadProgram(
            "closes over a tracked value",
            _closes_over,
            (ones, ones),
            AutogradError,
            ("closure_convert",),
            argnums=1,
            names=("rf.lift", "jax.custom_vjp"),
        ),
    ]


defrule(
    "custom_vjp_call",
    _custom_vjp_vjp,
    forward=_custom_vjp_forward,
    multiple_results=True,
    table=(TableEntry("custom_vjp_call", lambda x: _sin_cvjp(x) * x, unary_samples()),),
    errors=_custom_vjp_errors,
)
defrule("custom_vjp_call_jaxpr", _custom_vjp_vjp, forward=_custom_vjp_forward, multiple_results=True)
