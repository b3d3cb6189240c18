"""The rule of ``custom_jvp_call``: rf honours a ``jax.custom_jvp`` function's own
JVP rule, in reverse mode, with its own rules.

Note [Reverse mode from a custom JVP rule]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A ``custom_jvp_call`` equation carries the primal (``call_jaxpr``) and a function
that traces the user's JVP rule (``jvp_jaxpr_fun``), given which input tangents
are symbolic zeros. The traced rule maps (primals, tangents) to (primal outputs,
tangent outputs) and is linear in the tangents: ``t -> J t``. rf traces it once
per signature (when the lifted program is built), makes it a nested ``Program``
whose tracked inputs are the tangents, and in backward runs that program's own
reverse walk seeded with the outputs' cotangents ``u``: the walk returns
``J^T u`` exactly, at any tangent point (rf takes 0). Every step of it is one of
rf's hand-written rules; nothing calls JAX's transpose rules or ``jax.vjp``.

The primal runs forward as written (the equation is bound as jax binds it, so a
``custom_jvp`` nested in the primal is evaluated, not differentiated). The record
saves the call's inputs; the backward recomputes the rule's primal-side values
from them. Since the backward walk is made of ordinary primitives (a nested
``custom_jvp_call`` among them), recording it on an enclosing tape
differentiates it again: second order works as for any other rule.

A ``custom_jvp`` function the rule itself calls on the tangents (a rule written
with its own function, ``dR + transform(dbox, R)``) is differentiated there by its
primal, as jax's linearisation does: by its rule, the rule would unfold inside
itself without end, and on the tangents the primal is the linear map the rule
means. Its calls on the primals keep their rules (second order through them).

``symbolic_zeros=True`` rules receive JAX's ``SymbolicZero`` markers for the
tangents of the inputs that carry no gradient (jax.grad gives the same); other
rules receive zeros, as jax instantiates them. A tangent output the rule returns
as a symbolic zero takes no cotangent.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from .. import sharding as shd
from ..autograd.record import Aval
from ..autograd.registry import BadProgram, Sample, TableEntry
from ..errors import AutogradError
from ..ops._declare import normal, unary_samples
from .concrete import symbolic
from .jax_versions import closed, manual_spec, require_params, scan_counts, varying_like
from .program import IN_JVP_RULE, Program, custom_function_name, trace_custom_rule
from .rules import defrule, is_float

_Tracer = jax.core.Tracer


class _Linear:
    """A custom JVP rule traced as a program of (consts, primals, tangents)."""

    __slots__ = ("const_refs", "n", "n_out", "nc", "nz", "out_nz", "program", "tangent_avals")

    def __init__(self, program, const_refs, nc, n, nz, n_out, out_nz, tangent_avals):
        self.program = program
        self.const_refs = const_refs  # per rule constant: ("in", k) an input of the call, ("value", c)
        self.nc = nc
        self.n = n
        self.nz = nz  # the inputs (0..n-1, without the call's constants) whose tangent the rule takes
        self.n_out = n_out
        self.out_nz = out_nz  # the outputs whose tangent the rule returns (not a symbolic zero)
        self.tangent_avals = tangent_avals


def _tracer_var(c: Any) -> Any:
    """The jaxpr variable of a tracer of the (finished) trace that recorded the
    call: a JVP rule that closes over a traced value holds that tracer (a
    concrete tracer, Note [Concrete tracing] in lift/concrete.py, holds one)."""
    return getattr(symbolic(c), "val", None)


def _same_ref(x: Any, ref: Any) -> bool:
    return x is ref or (isinstance(x, int) and isinstance(ref, int) and x == ref)


def _body_input(step, k: int) -> int | None:
    """Which input of a body program input ``k`` of ``step`` (a scan, cond or
    checkpoint) becomes, when it is the same value in every run of the body."""
    name = step.prim.name
    if name == "scan":
        return k if k < scan_counts(step.params)[0] else None
    if name == "cond":
        return k - 1 if k >= 1 else None
    if name in ("checkpoint", "remat2"):
        return k
    return None


def _computed_from(program, step, ref: int) -> bool:
    """Whether slot ``ref`` of ``program`` is an output of ``step`` or of a step after it."""
    i = next(k for k, st in enumerate(program.steps) if st is step)
    return any(ref in st.outs for st in program.steps[i:])


def _find_ref(program, var: Any) -> Any:
    """The ref of jaxpr variable ``var`` in ``program``: one of its own
    variables, or a value of an enclosing program that enters this body as a
    constant input of the enclosing step."""
    if program is None or var is None:
        return None
    ref = program.var_refs.get(var)
    if ref is not None or program.enclosing is None:
        return ref
    outer, ostep = program.enclosing
    oref = _find_ref(outer, var)
    if oref is None:
        return None
    if not isinstance(oref, int):  # a constant
        return oref
    for k, x in enumerate(ostep.ins):
        j = _body_input(ostep, k) if _same_ref(x, oref) else None
        if j is not None and j < len(program.in_slots):
            return program.in_slots[j]
    return None


def closure_input(step, c: Any, name: str, kind: str = "custom_jvp") -> tuple[str, int]:
    """A value a custom rule (``kind`` ``custom_jvp``: its JVP rule; ``custom_vjp``:
    its fwd) closes over, as an input of the step: found among the variables of the program (the
    lifted function, the calls inlined in it, and the constants a
    scan/cond/checkpoint body receives) and added to the step's inputs if it is not
    one already. It carries no gradient through the rule (jax.grad cannot
    differentiate a rule that closes over a differentiated value either)."""
    program = step.program
    what = f"the {'JVP rule' if kind == 'custom_jvp' else 'fwd'} of the jax.{kind} function"
    ref = _find_ref(program, _tracer_var(c))
    if ref is None:
        raise AutogradError(
            f"rf.lift: {what} '{name}' closes over a traced value "
            "that does not reach the body that calls it (only the rule uses it); pass the value to the "
            f"{kind} function as an argument."
        )
    if isinstance(ref, int) and _computed_from(program, step, ref):
        # the rule is traced after the function's trace (trace_custom_rule), and Python
        # state it reads changed after the call: jax.grad run eagerly traces the rule
        # during the call and reads the old value, rf would read one the call does not
        # have yet
        raise AutogradError(
            f"rf.lift: {what} '{name}' closes over a value the lifted function computes at or after the call "
            "itself: rf traces the rule after the function has run, and the Python state the rule reads was "
            "changed after the call (flax nnx's custom_vjp with graph updates does this; jax.grad of jax.jit "
            "of the function fails on it too). Pass the value to the function as an argument, or leave the "
            "state as the call found it."
        )
    if isinstance(ref, int) and program.tracked[ref]:
        raise AutogradError(
            f"rf.lift: {what} '{name}' closes over a tracked value; "
            "its rule only takes the tangents of its arguments (jax.grad cannot differentiate it "
            "either). Pass the value as an argument."
        )
    for k, x in enumerate(step.ins):
        if _same_ref(x, ref):
            return ("in", k)
    step.ins = (*step.ins, ref)
    step.in_avals = (*step.in_avals, Aval(tuple(c.aval.shape), np.dtype(c.aval.dtype)))
    if step.in_shardings:
        step.in_shardings = (*step.in_shardings, None)
    step.needs = (*step.needs, False)
    return ("in", len(step.ins) - 1)


def _custom_jvp_prepare(step) -> _Linear | Program:
    p = step.params
    if IN_JVP_RULE.get():
        # a call on the tangents of an enclosing rule: its primal, as in jax's linearisation
        return Program(closed(p["call_jaxpr"]), step.needs, "the primal of a custom_jvp function its rule calls")
    nc = p["num_consts"]
    n = len(step.ins) - nc
    name = custom_function_name(p)
    if any(step.needs[:nc]):
        raise AutogradError(
            f"rf.lift: the jax.custom_jvp function '{name}' closes over a tracked value; "
            "its JVP rule only takes the tangents of its arguments (jax.grad cannot differentiate it "
            "either). Pass the value as an argument."
        )
    needs = step.needs[nc:]
    in_zeros = [not nd for nd in needs] if p["symbolic_zeros"] else [False] * n
    jaxpr, consts, out_zeros = trace_custom_rule(p["jvp_jaxpr_fun"], in_zeros, f"JVP rule of jax.custom_jvp '{name}'")
    const_refs = [closure_input(step, c, name) if isinstance(c, _Tracer) else ("value", c) for c in consts]
    nz = tuple(k for k in range(n) if not in_zeros[k])
    # the rule's inputs past its constants (jax 0.11 reads an open jaxpr's constvars as invars)
    invars = closed(jaxpr, consts).jaxpr.invars
    tangent_avals = tuple(v.aval for v in invars[n:])
    const_avals = [jax.ShapeDtypeStruct(np.shape(c), c.dtype) for c in consts]

    def linear(cs, primals, tangents):
        return jcore.jaxpr_as_fun(closed(jaxpr, list(cs)))(*primals, *tangents)

    def spec(a):
        # inside a shard_map body the rule's values keep the manual axes they vary over,
        # and over Explicit mesh axes their shardings (the rule was traced with them)
        weak = getattr(a, "weak_type", False)
        manual = manual_spec(a, weak)
        if manual is not None:
            return manual
        kw = {"sharding": a.sharding} if shd.explicit(getattr(a, "sharding", None)) is not None else {}
        return jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=weak, **kw)

    linear_jaxpr = jax.make_jaxpr(linear)(
        const_avals, [spec(v.aval) for v in invars[:n]], [spec(a) for a in tangent_avals]
    )
    tracked = [False] * (len(consts) + n) + [bool(needs[k]) and is_float(step.in_avals[nc + k]) for k in nz]
    token = IN_JVP_RULE.set(True)
    try:
        program = Program(linear_jaxpr, tracked, f"the JVP rule of custom_jvp {name}")
    except AutogradError as e:
        raise AutogradError(f"{e} (rf.lift differentiates the JVP rule of jax.custom_jvp '{name}')") from e
    finally:
        IN_JVP_RULE.reset(token)
    n_out = len(out_zeros)
    offset = _output_offset(step, name, [v.aval for v in linear_jaxpr.jaxpr.outvars[:n_out]])
    out_nz = tuple(k + offset for k in range(n_out) if not out_zeros[k])  # the call's outputs
    _check_tangent_shapes(step, name, [v.aval for v in linear_jaxpr.jaxpr.outvars[n_out:]], out_nz)
    return _Linear(program, tuple(const_refs), nc, n, nz, n_out, out_nz, tangent_avals)


def _output_offset(step, name: str, rule_avals: list) -> int:
    """Where the rule's outputs sit among the call's. They are the same outputs,
    except where a transformation gave the function outputs its rule does not
    have: ``checkify`` puts its error flag and code (a bool and an integer) first
    and leaves the rule as written. Anything else is refused: pairing a cotangent
    with the wrong output would be a wrong gradient."""
    call = [(tuple(a.shape), np.dtype(a.dtype)) for a in step.out_avals]
    rule = [(tuple(a.shape), np.dtype(a.dtype)) for a in rule_avals]
    extra = len(call) - len(rule)
    if extra == 0 or (extra > 0 and call[extra:] == rule and not any(is_float(a) for a in step.out_avals[:extra])):
        return extra
    raise AutogradError(
        f"rf.lift: the JVP rule of the jax.custom_jvp function '{name}' returns {len(rule)} outputs where the "
        f"call has {len(call)} ({call} against the rule's {rule}): a transformation changed the function "
        "and not its rule, and rf cannot tell which output each tangent is for."
    )


def _check_tangent_shapes(step, name: str, tangent_avals: list, out_nz: tuple) -> None:
    """A rule's tangent must have its output's shape. Under ``jax.vmap`` a
    ``custom_jvp`` function whose output does not depend on the batched input
    keeps that output unbatched while its rule's tangent is batched: the
    cotangent of the unbatched output cannot say what each example's tangent
    gets, so rf refuses it (jax.grad accepts the program)."""
    for k, a in zip(out_nz, tangent_avals):
        want = tuple(step.out_avals[k].shape)
        if tuple(a.shape) != want:
            raise AutogradError(
                f"rf.lift: the JVP rule of the jax.custom_jvp function '{name}' returns a tangent of shape "
                f"{tuple(a.shape)} for its output {k}, whose value has shape {want} (under jax.vmap, a "
                "custom_jvp function whose output does not depend on the batched input has an unbatched "
                "output and a batched tangent); make the output depend on the input, or vmap the gradient."
            )


def _zero_tangent(a: Any) -> Any:
    if a.dtype == jax.dtypes.float0:
        return np.zeros(a.shape, dtype=jax.dtypes.float0)
    # inside a shard_map body: a's type; over Explicit mesh axes: a's sharding
    return varying_like(shd.zeros(a.shape, a.dtype, shd.explicit(getattr(a, "sharding", None))), a)


def _custom_jvp_vjp(r, g):
    lin: _Linear | Program = r._step.sub
    if isinstance(lin, Program):  # the primal, recomputed from the saved inputs
        _, res = lin.run(list(r.ins))
        return tuple(gr if n else None for gr, n in zip(lin.backward(res, list(g)), r.needs))
    nc = lin.nc
    vals = r.ins
    cs = [vals[ref] if kind == "in" else ref for kind, ref in lin.const_refs]
    primals = list(vals[nc : nc + lin.n])  # (values the rule closes over follow them: closure_input)
    tangents = [_zero_tangent(a) for a in lin.tangent_avals]
    prog = lin.program
    _, residuals = prog.forward([*cs, *primals, *tangents])
    seeds: list[Any] = [None] * len(prog.out_refs)
    for j, k in enumerate(lin.out_nz):
        gk = g[k]
        if gk is not None and is_float(r.out_avals[k]):
            seeds[lin.n_out + j] = gk
    grads = prog.backward(residuals, seeds)
    t_grads = grads[len(cs) + lin.n :]
    out: list[Any] = [None] * len(vals)  # no gradient for the values the rule closes over
    for k, gt in zip(lin.nz, t_grads):
        if r.needs[nc + k] and gt is not None:
            out[nc + k] = gt
    return tuple(out)


def _custom_jvp_out_tracked(step) -> list[bool]:
    """The outputs whose tangent the rule returns and makes depend on a tracked
    tangent (Note [Tracked outputs] in program.py): one with a symbolic zero
    tangent, or a tangent from untracked ones, is untracked, as under jax.grad."""
    lin = step.sub
    if isinstance(lin, Program):
        return list(lin.out_tracked)
    tracked = [False] * len(step.outs)
    for j, k in enumerate(lin.out_nz):
        tracked[k] = bool(lin.program.out_tracked[lin.n_out + j])
    return tracked


_custom_jvp_vjp.prepare = _custom_jvp_prepare
_custom_jvp_vjp.out_tracked = _custom_jvp_out_tracked
_custom_jvp_vjp.unused_as_none = True  # Note [An unused output adds nothing] in program.py


def _custom_jvp_forward(step, vals):
    """The primal, as jax binds the equation (inputs a closure added are not its own)."""
    if isinstance(step.sub, Program):
        return step.sub.run(list(vals))[0], ()
    nc = step.params["num_consts"]
    n = step.sub.n
    return step.prim.bind(*vals[: nc + n], **step.prim.get_bind_params(step.params)), ()


# -- the table's programs: rules that differ from their primal ---------------------------


@jax.custom_jvp
def _clipped_id(x):
    """The identity whose rule says the derivative is 2 (differs from the primal's 1)."""
    return x


_clipped_id.defjvp(lambda p, t: (p[0], 2.0 * t[0]))


@jax.custom_jvp
def _pair(x, y):
    return jnp.sin(x) * y, x + y


@_pair.defjvp
def _pair_jvp(p, t):
    x, y = p
    dx, dy = t
    return _pair(x, y), (jnp.cos(x) * y * dx + jnp.sin(x) * dy, dx + dy)


def _closes_over_tracked(x, w):
    """A custom_jvp function (and its rule) closing over ``w``, a tracked input."""

    @jax.custom_jvp
    def f(v):
        return jnp.sin(v) * w

    f.defjvp(lambda p, t: (f(p[0]), jnp.cos(p[0]) * w * t[0]))
    return f(x)


def _rule_closes_over_outside_scan(x, w):
    """Only the rule (not the primal) closes over ``w``, from outside the scan
    body that calls it: ``w`` does not reach the body."""

    @jax.custom_jvp
    def f(v):
        return jnp.tanh(v)

    f.defjvp(lambda p, t: (f(p[0]), w * t[0]))
    return lax.scan(lambda c, _: (f(c), None), x, None, length=2)[0]


@jax.custom_jvp
def _constant_with_rule(x):
    """A constant whose rule passes the tangent through."""
    return jnp.zeros((), x.dtype)


_constant_with_rule.defjvp(lambda p, t: (_constant_with_rule(p[0]), t[0]))


def _closes_over_vmapped(z):
    """A custom_jvp function made inside ``jax.vmap`` closing over the batched value."""

    def per_example(x):
        @jax.custom_jvp
        def scaled(y):
            return x * y

        scaled.defjvp(lambda p, t: (scaled(p[0]), x * t[0]))
        return scaled(z)

    return jax.vmap(per_example)(jnp.arange(3.0, dtype=z.dtype))


def _custom_jvp_errors():
    ones = np.ones(3)
    names = ("rf.lift", "jax.custom_jvp")
    return [
        BadProgram(
            "closes over a value of a jax.vmap inside the function",
            _closes_over_vmapped,
            (np.ones(()),),
            AutogradError,
            ("'scaled'", "jax.vmap", "closure_convert"),
            names=names,
        ),
        BadProgram(
            "vmap keeps a custom_jvp output unbatched while its rule's tangent is batched",
            lambda x: jax.vmap(_constant_with_rule)(x),
            (ones,),
            AutogradError,
            ("_constant_with_rule", "returns a tangent of shape (3,)", "jax.vmap"),
            names=names,
        ),
        BadProgram(
            "closes over a tracked value",
            _closes_over_tracked,
            (ones, ones),
            AutogradError,
            ("closes over a tracked value",),
            argnums=1,
            names=names,
            jax_too=True,
        ),
        BadProgram(
            "only the rule closes over a value from outside a scan body",
            _rule_closes_over_outside_scan,
            (ones, ones),
            AutogradError,
            ("pass the value to the custom_jvp function as an argument",),
            names=names,
        ),
    ]


def _binary_samples(r):
    return [Sample((normal(r, 3), normal(r, 3)), diff=(0, 1))]


defrule(
    "custom_jvp_call",
    _custom_jvp_vjp,
    lambda needs: (tuple(range(len(needs))), ()),
    forward=_custom_jvp_forward,
    multiple_results=True,
    errors=_custom_jvp_errors,
    table=(
        # (the rule, not the primal, defines the derivative: no finite differences)
        TableEntry("custom_jvp_call", lambda x: _clipped_id(jnp.sin(x)) * x, unary_samples(), fd=False),
        TableEntry("custom_jvp_call_pair", lambda x, y: sum(_pair(x, y)), _binary_samples),
    ),
)


# -- linear_call (jax.custom_derivatives.linear_call) -----------------------------------
#
# ``linear_call(fun, fun_transpose, residual_args, linear_args)`` is linear in its linear
# arguments, and ``fun_transpose`` is its transpose there: the gradient of the linear
# arguments is ``fun_transpose(residual_args, cotangents)``, bound as a ``linear_call``
# itself with ``fun`` as its transpose (jax's transpose rule does the same, so a second
# derivative pairs the two again). The residual arguments get no gradient: jax's JVP
# rule asserts their tangents are zero, and rf refuses a tracked one by name.


def _linear_call_prepare(step):
    what = "jax.custom_derivatives.linear_call"
    require_params(step, ("callee", "transpose_thunk", "num_callee_consts", "num_res"), what)
    p = step.params
    n = p["num_callee_consts"] + p["num_res"]
    if any(step.needs[:n]):
        raise AutogradError(
            f"rf.lift: a residual argument of {what} depends on a tracked value; the call is linear in its "
            "linear arguments only and defines no derivative in its residual arguments (jax.grad fails on it "
            "too, with an AssertionError). Pass the value as a linear argument, or stop its gradient "
            "(lax.stop_gradient) if none should flow."
        )
    try:
        return p["transpose_thunk"]()  # (the transpose's closed jaxpr, its constants)
    except jax.errors.UnexpectedTracerError as e:
        raise AutogradError(
            f"rf.lift: the transpose function of {what} closes over a value the lifted function computed, "
            "which is gone when rf traces it; pass the value as a residual argument."
        ) from e


def _linear_call_vjp(r, g):
    p = r.params
    nc, nr = p["num_callee_consts"], p["num_res"]
    transpose, t_consts = r._step.sub
    f_consts, res = r.ins[:nc], r.ins[nc : nc + nr]
    callee = p["callee"]
    cts = r._step.prim.bind(
        *t_consts,
        *res,
        *g,
        callee=transpose,
        transpose_thunk=lambda: (callee, f_consts),
        num_callee_consts=len(t_consts),
        num_res=nr,
    )
    return (None,) * (nc + nr) + tuple(ct if n else None for ct, n in zip(cts, r.needs[nc + nr :]))


_linear_call_vjp.prepare = _linear_call_prepare


def _divided(r, a):
    return a / r * 2.0


def _linear_call_program(x, d):
    """``sin(x) / (cos(d) + 2) * 2 * x`` with the division a linear call in
    ``sin(x)`` (``d``, a residual, is data)."""
    from jax.custom_derivatives import linear_call

    return linear_call(_divided, _divided, jnp.cos(d) + 2.0, jnp.sin(x)) * x


def _linear_call_errors():
    ones = np.ones(3)
    return [
        BadProgram(
            "a tracked residual argument",
            _linear_call_program,
            (ones, ones),
            AutogradError,
            ("residual argument of jax.custom_derivatives.linear_call",),
            argnums=1,  # (jax.grad fails with a bare AssertionError in its JVP rule)
        )
    ]


defrule(
    "linear_call",
    _linear_call_vjp,
    lambda needs, params: (tuple(range(params["num_callee_consts"] + params["num_res"])), ()),
    multiple_results=True,
    errors=_linear_call_errors,
    table=(
        TableEntry(
            "linear_call",
            _linear_call_program,
            lambda r: [Sample((normal(r, 3), normal(r, 3)), diff=(0,))],
        ),
    ),
)
