"""A lifted function's program: its jaxpr flattened into steps, each with its
primitive's rule, run forward (values and residuals) and backward (the rows'
rules in reverse, through the rule runner). Note [Lifting] in
``lift/tracing.py`` tells how a call becomes one."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from .. import sharding as shd
from ..autograd.record import Aval
from ..autograd.runner import apply_rule, conform
from ..eager import is_64_bit, x64_as_made
from ..errors import AutogradError
from .concrete import ConcreteTracer
from .jax_versions import is_ref
from .rules import COMPLEX_OK, NON_DIFFERENTIABLE, Params, PrimitiveRecord, Rule, is_complex, is_float, rule_for

_Tracer = jax.core.Tracer

# the (program, step) whose rule is building nested programs (a scan's body, ...)
ENCLOSING: contextvars.ContextVar[Any] = contextvars.ContextVar("rf_lift_enclosing", default=None)

# call primitives inlined into the program (their body is run with rf's rules)
INLINE_CALLS = {"jit", "pjit", "closed_call", "core_call", "call", "remat_opt"}
# (``remat_opt``: the fwd of a ``custom_vjp`` defined with ``optimize_remat=True``, as
# jax's own derivative of the function runs it. The fwd is an ordinary function, and
# its derivative is the one jax's JVP rule takes; jax has no transpose for it, so rf's
# reverse mode of jax.grad's program goes where jax.grad of it cannot.)

# the identity on values, dropped from rf's programs (Note [Layout constraints dropped])
IDENTITIES = {"layout_constraint"}

# primitives with no rule whose refusal says more than "no backward rule"
NO_RULE_BECAUSE = {
    "custom_lin": (
        "it is what jax.jvp or jax.linearize of a jax.custom_vjp function emits, which jax cannot "
        'run either ("can\'t apply forward-mode autodiff (jvp) to a custom_vjp function"). Give the '
        "function a jax.custom_jvp rule, or take its derivative with jax.vjp or rf.grad instead."
    ),
}

# True while the program of a custom JVP rule is built (and the bodies nested in it):
# a custom_jvp function the rule calls on the tangents is differentiated by its primal
# (Note [Reverse mode from a custom JVP rule] in rules_custom.py)
IN_JVP_RULE: contextvars.ContextVar[bool] = contextvars.ContextVar("rf_lift_in_jvp_rule", default=False)


def without_identities(jaxpr: jcore.Jaxpr) -> jcore.Jaxpr:
    """``jaxpr`` without its own ``IDENTITIES`` equations, each output read as its
    input, for a jaxpr rf evaluates as it is (a custom_vjp's fwd): a layout
    constraint on one of its outputs would give the compiled forward's residual a
    layout of its own (Note [Layout constraints dropped])."""
    if not any(e.primitive.name in IDENTITIES for e in jaxpr.eqns):
        return jaxpr
    sub: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return sub.get(v, v) if isinstance(v, jcore.Var) else v

    eqns = []
    for e in jaxpr.eqns:
        if e.primitive.name in IDENTITIES:
            sub.update(zip(e.outvars, (read(v) for v in e.invars), strict=True))
        else:
            eqns.append(e.replace(invars=[read(v) for v in e.invars]))
    return jaxpr.replace(eqns=eqns, outvars=[read(v) for v in jaxpr.outvars])


def custom_function_name(params: Any) -> str:
    """A custom_jvp/custom_vjp call's function name: its ``name`` parameter where
    the equation has one, else its primal's debug info."""
    info = getattr(getattr(params.get("call_jaxpr"), "jaxpr", None), "debug_info", None)
    return params.get("name") or getattr(info, "func_name", None) or "?"


def trace_custom_rule(thunk: Any, flags: Sequence[bool], what: str) -> Any:
    """Trace a custom_jvp/custom_vjp function's rule (``jvp_jaxpr_fun``,
    ``fwd_jaxpr_thunk``) for the given flags (in the 64-bit mode of the call: the
    program's, see ``Program.avals_64``). rf traces it after the lifted
    function's trace is over, so a rule that closes over a value of a
    ``jax.vmap`` (or other transformation) inside the function finds it gone
    (jax.grad, tracing both at once, accepts such a program; jax's newer custom_vjp
    refuses it): a clear error naming the function, not JAX's leaked-tracer one."""
    try:
        return thunk.call_wrapped(*flags)
    except jax.errors.UnexpectedTracerError as e:
        raise AutogradError(
            f"rf.lift: the {what} closes over a value of a jax.vmap (or another transformation) inside the "
            "lifted function, which is gone when rf traces the rule; pass the value to the function as an "
            "argument (jax.closure_convert does it)."
        ) from e


class _Const:
    """A literal or a closed-over constant of the jaxpr."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


# the calls a mutable array reference from outside the function may not enter: rf
# would save or return it (jax refuses a reference as a compiled program's output).
# Elsewhere one is only read or written (a value written into it never carries a
# gradient: `swap` has no rule, so a tracked write is refused by name)
_KEEPS_NO_REFS = frozenset({"custom_vjp_call", "custom_vjp_call_jaxpr", "custom_jvp_call", "remat2", "checkpoint"})


class _Alias:
    """A constant of the jaxpr that is another of its variables: a value of a
    function traced with its values, which a custom_jvp/custom_vjp function
    closes over (Note [Concrete tracing] in lift/concrete.py)."""

    __slots__ = ("var",)

    def __init__(self, var: Any):
        self.var = var


def _constant(c: Any) -> _Const | _Alias:
    if isinstance(c, ConcreteTracer):
        sym = c.sym
        return _Alias(sym.val) if isinstance(sym, _Tracer) else _Const(sym)
    return _Const(c)


@dataclasses.dataclass(eq=False)
class Step:
    """One primitive application: reads slots (or constants), writes slots."""

    prim: Any
    params: Params
    ins: tuple[Any, ...]  # int slot or _Const
    outs: tuple[int, ...]
    in_avals: tuple[Aval, ...]
    out_avals: tuple[Aval, ...]
    in_shardings: tuple[Any, ...] = ()  # explicit shardings (None: not explicitly sharded)
    out_shardings: tuple[Any, ...] = ()
    rule: Rule | None = None
    needs: tuple[bool, ...] = ()
    saved_in: tuple[int, ...] = ()
    saved_out: tuple[int, ...] = ()
    sub: Any = None  # control flow: nested programs
    where: str = ""  # the library call and the user's line that emitted it (for errors)
    program: Any = None  # the Program it belongs to (a custom rule finds the values it closes over there)
    refusal: str = ""  # the error a gradient reaching this step raises (complex values its rule is not checked for)
    mesh: Any = None  # the abstract mesh it was traced under, where not the program's (Note [A step's mesh])
    in_types: tuple[Any, ...] = ()  # its inputs' and outputs' traced shardings
    out_types: tuple[Any, ...] = ()
    effects: bool = False  # it has effects (a write to a reference, a callback): never dead code

    def bind(self, vals: Sequence[Any]) -> tuple[Any, ...]:
        """The primitive applied to ``vals``: its outputs, as a tuple (a call
        primitive binds its jaxpr as a function, as jax's eval_jaxpr does)."""
        if self.prim.name == "broadcast_in_dim" and (sh := shd.explicit(self.params.get("sharding"))) is not None:
            # jax 0.11 drops the traced sharding for a meshless operand when no mesh
            # is set (Note [Broadcasting a meshless value] in rumus_fx/sharding.py)
            vals = (shd.onto_mesh(vals[0], sh), *vals[1:])
        outs = self.prim.bind(*vals, **self.prim.get_bind_params(self.params))
        return outs if self.prim.multiple_results else (outs,)


def _aval(v: Any) -> Aval:
    a = v.aval
    if isinstance(a, jcore.AbstractToken):
        # a token (lax.create_token, lax.after_all) carries no value and is never
        # differentiated: a boolean scalar stands for it where an aval is read
        return Aval((), np.dtype(bool))
    dtype = getattr(a, "dtype", None)
    if dtype is None or not hasattr(a, "shape"):
        # jax's high-level types (hijax boxes, quantized arrays: jax-internal) are not
        # arrays; rf's rules take arrays
        raise AutogradError(
            f"rf.lift: the function holds a value of type {type(a).__name__}, one of jax's high-level "
            "(hijax) types, which rf.lift does not take apart: its rules take arrays. Pass and return "
            "the arrays such a value holds."
        )
    if not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):  # PRNG keys keep their jax dtype
        dtype = np.dtype(dtype)
    return Aval(tuple(a.shape), dtype)


def _sharding(v: Any) -> Any:
    """A jaxpr variable's sharding when it is over Explicit mesh axes (the
    program was traced with its inputs' sharded types), else None."""
    if isinstance(v, jcore.Literal):
        return None
    return shd.explicit(getattr(v.aval, "sharding", None))


def _reduced(sharding: Any) -> bool:
    """A sharding whose spec has reduced or unreduced mesh axes."""
    spec = getattr(sharding, "spec", None)
    return bool(getattr(spec, "reduced", None) or getattr(spec, "unreduced", None))


def _reduced_refusal(what: str) -> AutogradError:
    """rf.lift's refusal of a differentiated value with reduced or unreduced mesh axes."""
    return AutogradError(
        f"rf.lift: {what} with reduced or unreduced mesh axes (a PartitionSpec with reduced=/unreduced=, "
        "jax's explicit-sharding sums), which rf's rules do not follow; differentiate it without them, or "
        "with jax.grad."
    )


class Program:
    """A jaxpr flattened into steps, with which slots are tracked."""

    def __init__(self, closed: jcore.ClosedJaxpr, tracked_in: Sequence[bool], name: str = "lifted"):
        self.name = name
        self.steps: list[Step] = []
        self.nslots = 0
        jaxpr = closed.jaxpr
        self.in_slots = [self._new() for _ in jaxpr.invars]
        self.in_avals = tuple(_aval(v) for v in jaxpr.invars)
        self.in_shardings = tuple(_sharding(v) for v in jaxpr.invars)
        self.var_refs: dict[Any, Any] = {}  # every jaxpr variable flattened (inlined calls included) -> ref
        self.calls: list[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = []  # inlined: steps, ins, outs
        self.enclosing = ENCLOSING.get()  # (program, step) when this is the body of a step's primitive
        # the mesh it runs under (Note [A step's mesh]): a body's, its step's
        if self.enclosing is None:
            self.mesh = jax.sharding.get_abstract_mesh()
        else:
            parent, step = self.enclosing
            self.mesh = parent.mesh if step.mesh is None else step.mesh
        env: dict[Any, Any] = {}
        for v, s in zip(jaxpr.invars, self.in_slots):
            env[v] = s
        for v, c in zip(jaxpr.constvars, closed.consts):
            env[v] = _constant(c)
        self._flatten(jaxpr, env)
        self.out_refs = [self._read(env, v) for v in jaxpr.outvars]
        self.out_avals = tuple(_aval(v) for v in jaxpr.outvars)
        self.out_shardings = tuple(_sharding(v) for v in jaxpr.outvars)
        self.meshes = any(st.mesh is not None for st in self.steps)  # Note [A step's mesh]
        # a 64-bit value, if any: the program is built (its rules prepared, custom rules traced),
        # run and differentiated with 64-bit types on (a jax.enable_x64() block in it)
        self.avals_64 = tuple(a for st in self.steps for a in st.in_avals + st.out_avals if is_64_bit(a))[:1]
        with x64_as_made(self.avals_64):
            self._mark(tracked_in)
        self._refuse_reduced_ends()
        self._jit_forward: Callable | None = None
        self._jit_backward: dict[Any, Callable] = {}

    def _refuse_reduced_ends(self) -> None:
        """A tracked input or output with reduced or unreduced mesh axes is refused
        as such a step is (``_mark``): an identity function has no step to refuse,
        and its cotangent crashed inside rf (jax's "Using *pspec is dangerous")."""
        ends = (("input", self.in_slots, self.in_shardings), ("output", self.out_refs, self.out_shardings))
        for kind, refs, shardings in ends:
            for k, (r, sh) in enumerate(zip(refs, shardings)):
                if isinstance(r, int) and self.tracked[r] and _reduced(sh):
                    raise _reduced_refusal(f"{kind} {k} of {self.name} is a value")

    # -- building -------------------------------------------------------------
    def _new(self) -> int:
        self.nslots += 1
        return self.nslots - 1

    @staticmethod
    def _read(env: dict, v: Any) -> Any:
        if isinstance(v, jcore.Literal):
            return _Const(v.val)
        r = env[v]
        return env[r.var] if type(r) is _Alias else r

    def _flatten(self, jaxpr: jcore.Jaxpr, env: dict, within: str = "") -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            ins = [self._read(env, v) for v in eqn.invars]
            if name in INLINE_CALLS:
                inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr", eqn.params.get("fwd_jaxpr")))
                if isinstance(inner, jcore.ClosedJaxpr):
                    inner_jaxpr, consts = inner.jaxpr, inner.consts
                else:
                    inner_jaxpr, consts = inner, ()
                sub_env: dict[Any, Any] = {}
                for v, c in zip(inner_jaxpr.constvars, consts):
                    sub_env[v] = _Const(c)
                for v, x in zip(inner_jaxpr.invars, ins):
                    sub_env[v] = x
                call = eqn.params.get("name") or getattr(eqn.params.get("call_jaxpr"), "__name__", None) or name
                start = len(self.steps)
                self._flatten(inner_jaxpr, sub_env, _where(eqn, f"inside {name} {call!r}") or within)
                refs = [self._read(sub_env, w) for w in inner_jaxpr.outvars]
                for v, r in zip(eqn.outvars, refs):
                    if not isinstance(v, jcore.DropVar):
                        env[v] = r
                # the call's steps, input and output slots (Note [A user's bwd on zero cotangents])
                call_ins = tuple(x for x in ins if isinstance(x, int))
                call_outs = tuple(r for r in refs if isinstance(r, int))
                self.calls.append((start, len(self.steps), call_ins, call_outs))
                continue
            if name in IDENTITIES:  # Note [Layout constraints dropped]
                for v, x in zip(eqn.outvars, ins, strict=True):
                    if not isinstance(v, jcore.DropVar):
                        env[v] = x
                continue
            if name in _KEEPS_NO_REFS and any(is_ref(getattr(v, "aval", None)) for v in eqn.invars):
                raise AutogradError(
                    f"rf.lift: the function passes a mutable array reference from outside it into '{name}' "
                    f"(in {self.name}{', emitted ' + w if (w := _where(eqn, within=within)) else ''}): a "
                    "jax.checkpoint or a custom rule, which rf does not follow such a reference into (reading "
                    "and writing it with r[...] in the function, in a jax.jit, scan or cond it calls, works; "
                    "references the function makes itself are followed everywhere)."
                )
            outs = []
            for v in eqn.outvars:
                s = self._new()
                outs.append(s)
                if not isinstance(v, jcore.DropVar):
                    env[v] = s
            mesh = getattr(getattr(eqn, "ctx", None), "cur_abstract_mesh", None)
            self.steps.append(
                Step(
                    eqn.primitive,
                    Params(eqn.params),
                    tuple(ins),
                    tuple(outs),
                    tuple(_aval(v) for v in eqn.invars),
                    tuple(_aval(v) for v in eqn.outvars),
                    tuple(_sharding(v) for v in eqn.invars),
                    tuple(_sharding(v) for v in eqn.outvars),
                    where=_where(eqn, within=within),
                    program=self,
                    mesh=None if mesh is None or mesh == self.mesh or getattr(mesh, "manual_axes", ()) else mesh,
                    in_types=_types(eqn.invars),
                    out_types=_types(eqn.outvars),
                    effects=bool(eqn.effects),
                )
            )
        self.var_refs.update(env)

    # Note [Tracked outputs]
    # ~~~~~~~~~~~~~~~~~~~~~~~
    # A step with a tracked input tracks every floating-point output, except where
    # its rule says which outputs depend on a tracked input (``vjp.out_tracked(step)``,
    # run after ``prepare``): control flow, whose bodies are programs of their own. A
    # ``cond`` output is tracked if some branch makes it so; a ``scan``'s carry if its
    # initial value is or the body makes it so, its stacked outputs as the body's; a
    # ``while_loop``'s carries as its body's fixed point (so one whose float carries
    # do not depend on the tracked value, which only decides the trip count, is
    # differentiated as jax.grad does; its rule refuses only a gradient that reaches
    # it); a ``jax.checkpoint``'s as its body's; a ``custom_jvp`` output if its
    # rule's tangent depends on a tracked input's tangent (not a symbolic zero, not a
    # value computed from the primals alone). An untracked output gets no gradient,
    # and what reads only untracked values is not recorded: a non-differentiable rule
    # there (a JVP rule that raises) is never traced, as jax.grad never traces it for
    # a value that carries no tangent.
    def _mark(self, tracked_in: Sequence[bool]) -> None:
        tracked = self.tracked = [False] * self.nslots
        for s, t in zip(self.in_slots, tracked_in, strict=True):
            tracked[s] = bool(t) and is_float(self.in_avals[self.in_slots.index(s)])
        live: set[int] | None = None  # computed at the first refusal (Note [A refusal no gradient reaches])

        def reachable(step: Step) -> bool:
            nonlocal live
            if live is None:
                live = self._live_slots()
            return any(s in live for s in step.outs)

        for step in self.steps:
            needs = tuple(isinstance(x, int) and tracked[x] for x in step.ins)
            if not any(needs):
                continue
            name = step.prim.name
            if name in NON_DIFFERENTIABLE or not any(is_float(a) for a in step.out_avals):
                continue
            rule = rule_for(step.prim)
            where = f", emitted {step.where}" if step.where else ""
            if rule is None:  # refused when the function is lifted, dead or not (SPEC section 8)
                raise AutogradError(
                    f"rf.lift: no backward rule for the primitive '{name}' (in {self.name}{where}); "
                    + NO_RULE_BECAUSE.get(
                        name,
                        "its inputs depend on a tracked Tensor, so its gradient cannot be taken. "
                        "Write the computation with primitives rf.lift supports, wrap it in "
                        "jax.custom_vjp with a hand-written backward, or register a rule with rf.defrule.",
                    )
                )
            if any(_reduced(sh) for sh in (*step.in_shardings, *step.out_shardings)):
                refusal = _reduced_refusal(f"'{name}' (in {self.name}{where}) reads or makes a value")
                if reachable(step):  # else it refuses only if a gradient reaches it
                    raise refusal
                rule = _refusing(step, rule, str(refusal))
            if name not in COMPLEX_OK and any(is_complex(a) for a in (*step.in_avals, *step.out_avals)):
                rule = _refusing_complex(step, rule, self.name)
            step.rule = rule
            step.needs = needs
            prepare = None if step.refusal else getattr(rule.vjp, "prepare", None)
            # which outputs depend on a tracked input (Note [Tracked outputs]); None: every float one
            out_tracked = None if step.refusal else getattr(rule.vjp, "out_tracked", None)
            outs_tracked = None
            if prepare is not None or out_tracked is not None:  # control flow: nested programs for the bodies
                token = ENCLOSING.set((self, step))
                try:
                    if prepare is not None:
                        step.sub = prepare(step)
                    if out_tracked is not None:
                        outs_tracked = out_tracked(step)
                except AutogradError as e:
                    if reachable(step):  # else it refuses only if a gradient reaches it
                        raise
                    step.sub, outs_tracked = None, None
                    rule = step.rule = _refusing(step, rule, str(e))
                finally:
                    ENCLOSING.reset(token)
            si, so = rule.saves(step.needs, step.params)  # (prepare may have added inputs)
            step.saved_in = tuple(si)
            step.saved_out = tuple(range(len(step.outs))) if so is None else tuple(so)  # None: every output
            for k, s in enumerate(step.outs):
                tracked[s] = is_float(step.out_avals[k]) and (outs_tracked is None or bool(outs_tracked[k]))
        self.tracked = tracked
        self.tracked_steps = [i for i, st in enumerate(self.steps) if st.rule is not None]
        self.out_tracked = [isinstance(r, int) and tracked[r] for r in self.out_refs]
        # residual layout: each saved slot once
        res: dict[int, int] = {}
        for i in self.tracked_steps:
            st = self.steps[i]
            for k in st.saved_in:
                if isinstance(st.ins[k], int):
                    res.setdefault(st.ins[k], len(res))
            for k in st.saved_out:
                res.setdefault(st.outs[k], len(res))
        self.residual_slots = list(res)
        self.residual_index = res

    def _live_slots(self) -> set[int]:
        """The slots a gradient can reach from the program's float outputs: the steps
        that read them, back to the inputs, except through a step that carries no
        gradient (``stop_gradient``, a comparison, integer outputs). A step whose
        outputs are all outside this set is dead code for the gradient, unless it has
        effects (a write to a reference from outside, a callback): those are live."""
        live = {r for r, a in zip(self.out_refs, self.out_avals) if isinstance(r, int) and is_float(a)}
        for st in reversed(self.steps):
            if st.effects:
                live.update(st.outs)
                live.update(x for x in st.ins if isinstance(x, int))
                continue
            if st.prim.name in NON_DIFFERENTIABLE:
                continue
            if any(s in live and is_float(a) for s, a in zip(st.outs, st.out_avals)):
                live.update(x for x in st.ins if isinstance(x, int))
        return live

    # -- running ----------------------------------------------------------------
    def run(self, inputs: Sequence[Any]) -> tuple[list[Any], tuple[Any, ...]]:
        """Evaluate the program: (outputs, residuals)."""
        with x64_as_made(self.avals_64):
            return self._run(inputs)

    def _run(self, inputs: Sequence[Any]) -> tuple[list[Any], tuple[Any, ...]]:
        env: list[Any] = [None] * self.nslots
        for s, x in zip(self.in_slots, inputs, strict=True):
            env[s] = x
        extras: list[Any] = []
        for step in self.steps:
            vals = [x.value if isinstance(x, _Const) else env[x] for x in step.ins]
            with _in_mesh(step):
                if step.rule is not None and step.rule.forward is not None:
                    outs, extra = step.rule.forward(step, vals)
                    extras.append(extra)
                else:
                    outs = step.bind(vals)
            for s, o in zip(step.outs, outs):
                env[s] = o
        outputs = [r.value if isinstance(r, _Const) else env[r] for r in self.out_refs]
        residuals = tuple(env[s] for s in self.residual_slots)
        return outputs, (residuals, tuple(extras))

    def forward(self, inputs: Sequence[Any]) -> tuple[list[Any], Any]:
        if any(isinstance(x, _Tracer) for x in inputs):
            return self.run(inputs)
        if self._jit_forward is None:
            self._jit_forward = jax.jit(self.run)
        return self._jit_forward(list(inputs))

    def compiled_backward(self, options: Mapping[str, str] | None) -> Callable:
        """``backward`` as one compiled call owned by this program, for an eager
        backward (Note [A program's compiled calls])."""
        key = None if options is None else tuple(sorted(options.items()))
        fn = self._jit_backward.get(key)
        if fn is None:
            fn = self._jit_backward[key] = jax.jit(self._backward_call, compiler_options=options)
        return fn

    def _backward_call(self, residuals: Any, out_grads: Sequence[Any]) -> tuple[Any, ...]:
        return tuple(self.backward(residuals, out_grads, rows_checked=True))

    def records(self, residuals: Any) -> list[PrimitiveRecord]:
        """The per-primitive records, in forward order, built from residuals."""
        values, extras = residuals
        out = []
        e = 0
        for i in self.tracked_steps:
            st = self.steps[i]
            extra = ()
            if st.rule.forward is not None:
                extra = extras[e]
                e += 1
            ins = tuple(self._saved(values, st.ins[k]) if k in st.saved_in else None for k in range(len(st.ins)))
            outs = tuple(self._saved(values, st.outs[k]) if k in st.saved_out else None for k in range(len(st.outs)))
            if self.meshes:  # the values with their traced types (Note [A step's mesh])
                mesh = self.mesh if st.mesh is None else st.mesh
                ins = tuple(_onto_type(x, t, mesh) for x, t in zip(ins, st.in_types))
                outs = tuple(_onto_type(x, t, mesh) for x, t in zip(outs, st.out_types))
            rec = st.rule.record(
                st.params, st.in_avals, st.out_avals, st.needs, ins, outs, extra, st.in_shardings, st.out_shardings
            )
            object.__setattr__(rec, "_step", st)
            out.append(rec)
        return out

    def _saved(self, values: Sequence[Any], ref: Any) -> Any:
        if isinstance(ref, _Const):
            v = ref.value
            # a literal of the jaxpr is a Python scalar (jax's TypedFloat), without the
            # array attributes (ndim, shape) rules read: a 0-d array of its dtype
            return v if hasattr(v, "ndim") else np.asarray(v, dtype=getattr(v, "dtype", None))
        return values[self.residual_index[ref]]

    def backward(self, residuals: Any, out_grads: Sequence[Any], rows_checked: bool = False) -> list[Any]:
        """Gradients of the inputs (None where none) from the outputs' gradients.
        Each row's rule runs through the rule runner (Note [One rule runner] in
        rumus_fx/autograd/runner.py); ``rows_checked``: anomaly mode checks each
        row (a lifted call's own program, not the bodies of its control flow)."""
        with x64_as_made(self.avals_64):
            return self._backward(residuals, out_grads, rows_checked)

    def _backward(self, residuals: Any, out_grads: Sequence[Any], rows_checked: bool) -> list[Any]:
        grads: dict[int, Any] = {}
        for k, (r, g, sh) in enumerate(zip(self.out_refs, out_grads, self.out_shardings)):
            if g is not None and isinstance(r, int) and self.tracked[r]:
                g = conform(f"{self.name} output", k, g, sh)
                grads[r] = g if r not in grads else grads[r] + g
        recs = self.records(residuals)
        first_bwd = self.first_user_bwd
        for row in range(len(recs) - 1, -1, -1):
            rec = recs[row]
            st = rec._step
            bwd_here = first_bwd is not None and first_bwd <= row  # Note [A user's bwd on zero cotangents]
            if bwd_here:
                self._leave_unreached_calls(row, grads)
            gs = [grads.pop(s, None) for s in st.outs]
            if all(g is None or g is _REACHED for g in gs):
                # no cotangent, or zero ones that reach a user's bwd at or before this row
                if not bwd_here or not any(g is _REACHED for g in gs):
                    continue
                if not runs_on_zero(st):
                    for x, n in zip(st.ins, st.needs):
                        if n and isinstance(x, int):
                            grads.setdefault(x, _REACHED)
                    continue
            holds = bwd_here and holds_user_bwd(st)
            # the marked outputs passed as zeros: a scan's carries (jax keeps a live carry's
            # zero cotangent, Note [An unused output adds nothing]); every one where a body's
            # bwd runs on a zero cotangent, not on a missing one
            if (zeros_for := getattr(st.rule.vjp, "reached_as_zeros", None)) is not None:
                marked = zeros_for(st)
            elif holds and not getattr(st.rule.vjp, "takes_none", False):
                marked = range(len(gs))
            else:
                marked = ()
            if marked:
                gs = [
                    shd.zeros(a.shape, a.dtype, sh) if g is _REACHED and k in marked else g
                    for k, (g, a, sh) in enumerate(zip(gs, st.out_avals, st.out_shardings or (None,) * len(gs)))
                ]
            gs = [None if g is _REACHED else g for g in gs]
            if st.refusal:
                raise AutogradError(st.refusal)
            if self.meshes:
                gs = [_onto_type(g, t, self.mesh if st.mesh is None else st.mesh) for g, t in zip(gs, st.out_types)]
            with _in_mesh(st):
                if getattr(st.rule.vjp, "takes_none", False) or getattr(st.rule.vjp, "unused_as_none", False):
                    # the rule tells missing cotangents apart (Note [An unused output adds nothing])
                    g_out = tuple(gs)
                elif st.rule.multiple_results or st.prim.multiple_results:
                    g_out = tuple(
                        shd.zeros(a.shape, a.dtype, sh) if g is None else g
                        for g, a, sh in zip(gs, st.out_avals, st.out_shardings)
                    )
                else:
                    g_out = gs[0]
                in_grads = apply_rule(
                    rec,
                    g_out,
                    st.needs,
                    st.in_avals,
                    st.in_shardings,
                    name=f"{rec.name} in rf.lift({self.name})",
                    row=row if rows_checked else None,
                    describe=functools.partial(_describe, rec),
                )
            if self.meshes:  # (they add up with the others under the program's mesh)
                in_grads = [_onto_type(g, t, self.mesh) for g, t in zip(in_grads, st.in_types)]
            user = bwd_here and getattr(st.rule.vjp, "runs_user_bwd", False)
            for x, g, n in zip(st.ins, in_grads, st.needs):
                if g is not None:
                    grads[x] = g if grads.get(x, _REACHED) is _REACHED else grads[x] + g
                elif user and n and isinstance(x, int):  # the bwd returned a zero: x is reached
                    grads.setdefault(x, _REACHED)
        return [
            shd.zeros(a.shape, a.dtype, sh) if (g := grads.get(s)) is _REACHED else g
            for s, a, sh in zip(self.in_slots, self.in_avals, self.in_shardings)
        ]

    @functools.cached_property
    def first_user_bwd(self) -> int | None:
        """The first row (of ``records``) whose step holds a user's bwd, or None."""
        return next((row for row, i in enumerate(self.tracked_steps) if holds_user_bwd(self.steps[i])), None)

    @functools.cached_property
    def _call_entries(self) -> dict[int, list[tuple[tuple[int, ...], tuple[int, ...], frozenset]]]:
        """Per row, the inlined calls (``jax.jit``) whose last recorded step it is,
        outermost first: (their tracked inputs, their outputs, the slots their steps write)."""
        row_of = {i: row for row, i in enumerate(self.tracked_steps)}
        entries: dict[int, list] = {}
        for start, end, ins, outs in sorted(self.calls, key=lambda c: c[0] - c[1]):
            rows = [row_of[i] for i in range(start, end) if i in row_of]
            if rows:
                written = frozenset(x for st in self.steps[start:end] for x in st.outs)
                tracked_ins = tuple(x for x in ins if self.tracked[x])
                entries.setdefault(max(rows), []).append((tracked_ins, outs, written))
        return entries

    def _leave_unreached_calls(self, row: int, grads: dict[int, Any]) -> None:
        """At the last row of an inlined call whose outputs got no cotangent but zero
        ones: skip its body, as jax's transpose of the call does; its inputs are
        reached (Note [A user's bwd on zero cotangents])."""
        for ins, outs, written in self._call_entries.get(row, ()):
            got = [grads.get(x) for x in outs]
            if any(g is not None and g is not _REACHED for g in got):
                continue
            dropped = [x for x, g in zip(outs, got) if g is _REACHED and x in written]
            for x in dropped:
                del grads[x]
            if dropped:
                for x in ins:
                    grads.setdefault(x, _REACHED)


# Note [Layout constraints dropped]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``jax.experimental.layout.with_layout_constraint`` (the primitive
# ``layout_constraint``) is the identity on values: it asks the compiler for a
# memory layout (column-major, say), and jax.grad's transpose puts the same
# constraint on the cotangent. rf drops it from the programs it builds, forward and
# backward: the lifted function's values and gradients are the same, in the
# default row-major layout. Keeping it is not safe with jax 0.10.2 on CPU: an
# array that leaves a compiled call with a layout of its own is read by the next
# compiled call (a jitted function, an eager jnp op) as if it were row-major, its
# elements permuted, with no error. jax.grad never meets this (eagerly it runs
# primitive by primitive; under jit it is one program), but an eager lifted call
# hands its residuals from its compiled forward to its compiled backward, and with
# the constraint kept, the gradient of ``sin(with_layout_constraint(x,
# column_major)) * x`` came out permuted (constraining the values that leave the
# program back to row-major did not help: XLA merged the two constraints on the
# same value). A layout is a performance hint; dropping it costs at most a copy
# the compiler would have placed differently.
#
# jax gives a compiled call's output a layout of its own only where the output is
# made by a constraint at the top level of the call's program. rf's programs hold
# none now; a custom_vjp's fwd, which rf evaluates as it is inside the compiled
# forward, is stripped of its own (``without_identities``: nested calls keep
# theirs, which do not reach the outputs). One case is left as jax has it: a bwd
# that constrains the cotangent it returns gives the gradient that layout, under
# rf as under ``jax.jit(jax.grad(f))``, and a later compiled call reads it
# permuted; that is jax's to fix. (``tests/lift/test_layouts.py``.)


# Note [A program's compiled calls]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An eager lifted call runs two compiled calls that the program owns: its forward
# (``_jit_forward``) and its backward (``compiled_backward``, one per set of XLA
# options). Owned, they go when the program goes. A program lives while a tape
# entry holds it, in ``tracing._PROGRAMS`` (a cache of at most ``_MAX_PROGRAMS``,
# the least recently used dropped first) and in the whole-tape cache (at most
# ``whole_tape.CACHE_SIZE`` tape signatures).
#
# The bound matters because a compiled XLA:CPU program maps its code into memory in
# many regions: about 30 for a few ops, 176 for a flax transformer block's forward
# and backward. Linux allows a process 65,530 (``vm.max_map_count``); past that,
# XLA crashes inside a compile with a segmentation fault. The backward used to run
# as the runner's shared compiled call with the record's static data, the program
# included, as its static argument. jax's cache of that call (8,192 entries) then
# held every program ever run, with both its compiled calls, even after the
# program left ``_PROGRAMS``, which itself emptied only at 2,048 entries. Take a
# loop whose lifted function, six tanh layers and a scan over 8 rows, closes over a
# Python float that changes every call, so each call makes a new program. The
# process gained about 133 regions a call and crashed after about 480 calls. Now
# it levels off at 18,000-24,000 regions
# (``tests/test_resources.py::test_lifted_programs_are_bounded_and_released_with_their_compiled_calls``).
# jax.jit frees a function's compiled programs when the function goes.
#
# A count alone does not bound the regions: 128 programs of a transformer block's
# size hold about 22,500, and a deeper model's programs hold more. So every
# ``_CHECK_MAPPINGS_EVERY`` new programs rf reads how many regions the process
# holds (``/proc/self/maps``: 3-8 ms at 4,000 regions, 50 at 30,000). Past half
# the limit, ``relieve_mapping_pressure`` drops the least recently used half of
# ``_PROGRAMS`` (rounded down: the newest, the one the call has just made, always
# stays; rounded up, a relief with one program held dropped it and the next
# call traced it again) and the whole-tape cache, then runs the garbage
# collector (a program and its compiled calls form a reference cycle). A
# dropped program is traced again when next called. The regions that jax's own
# caches hold stay, so the next relief waits until the process has grown by a
# third of the headroom that the last one left (``relief_threshold``), at most
# to three quarters of the limit (the rest is headroom for what jax itself
# compiles between two looks). With a fixed
# half, a process whose jax.jit caches held more than half the limit dropped rf's
# programs every fourth new one, and a working set of 24 small lifted functions
# was traced again every round: 8 s a round instead of 0.02
# (``test_regions_held_outside_rf_do_not_make_it_drop_its_working_set``). If a
# relief leaves the process at seven eighths of the limit, what holds the regions is
# not rf's, and rf warns once: the warning names the limit and ``jax.clear_caches()``,
# where the first sign used to be a segmentation fault.


# Note [An unused output adds nothing]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An output of control flow (``cond``/``switch``, ``checkpoint``, ``scan``'s stacked
# outputs and dead carries), of a ``shard_map`` body, of a ``jax.custom_jvp`` call or
# of a multi-output primitive (``sort``, ``device_put``, ``shard_alike``, a variadic
# ``reduce``) that the program does not use adds no term to the gradient: jax.grad
# removes it from the linear program (dead-code elimination) before it transposes,
# so its part of the body never runs. Zeros in its place are not the same: a term
# ``0 * inf`` is nan, and a derivative is infinite at ordinary points (``sqrt`` at 0,
# the eigenvectors at a repeated eigenvalue). So ``sqrt(x)``, an unused output of a
# cond branch at ``x = 0``, made the gradient of the other output nan where
# jax.grad's is finite. The rules of these calls say ``unused_as_none`` (a
# primitive's ``takes_none``): the walk passes them ``None`` for an output with no
# cotangent, which their bodies' programs skip (``Program.backward`` takes ``None``).
# The same holds for an input: one that only unused outputs read (an operand no
# branch of a switch reaches, a scan's constant or scanned-over input that only a
# dead carry reads) gets ``None`` from the rule, not the zeros its body returned
# (``ReachedInputs``, below, records which gradients a body's walk gave).
# A marked output (``_REACHED``, below) is still passed as zeros where a body holds
# a user's bwd, and a scan's marked carries always (``reached_as_zeros``): jax keeps
# a carry whose final value is used, and makes its zero cotangent zeros. The scan's
# dead carries are the least fixed point of the body's own walk: a carry starts
# dead when its final value has no cotangent and becomes live when the body's
# backward, run abstractly with the live ones, gives its input a gradient; so a
# carry read only through a comparison, ``stop_gradient`` or a dead part of a
# nested call stays dead, as under jax's dead-code elimination of the linear program.
# Tests: tests/lift/test_unused_outputs.py.


class ReachedInputs:
    """Which of a body's input gradients came back as arrays (not None) in any
    trace of the body's backward: the rule gives None for the rest, as jax's
    dead-code elimination leaves them symbolic zeros (Note [An unused output adds
    nothing]). A body is traced with one pattern of missing cotangents, so every
    trace of it gives the same answer. (Not ``_Reached``, below: that marks a
    zero cotangent a user's bwd must see.)"""

    def __init__(self, n: int) -> None:
        self.hit = [False] * n

    def note(self, grads: Sequence[Any]) -> None:
        for k, gr in enumerate(grads):
            if gr is not None:
                self.hit[k] = True

    def keep(self, grads: Sequence[Any], start: int = 0) -> list[Any]:
        """``grads`` (the gradients from position ``start`` on), None where unreached."""
        return [gr if h else None for gr, h in zip(grads, self.hit[start:])]


# Note [A user's bwd on zero cotangents]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A row whose outputs get no cotangent is skipped: its rule is linear in the
# cotangents, so it would give zeros. A ``jax.custom_vjp``'s ``bwd`` need not be:
# flax's fp8 layers return the new scale and amax history as the "gradient" of the
# old ones whatever the cotangent (the overwrite-with-gradient collection). jax.grad
# transposes every linear equation of a jaxpr that its outputs need, and a
# custom_vjp's transpose calls the ``bwd`` with zero cotangents where they are zero
# (a ``bwd`` downstream returned ``None``): there the ``bwd`` runs. It does not where
# the call's outputs are unused or pass through ``stop_gradient``, ``sign``, ``floor``
# (the equation is pruned), nor inside a ``jax.jit``, ``cond`` or ``checkpoint``
# whose outputs' cotangents are all zero (their transpose skips the body); a
# ``scan`` with a differentiated carry runs its body on zero carry cotangents.
# rf does the same, at no cost in programs without a ``custom_vjp`` (the marks below
# are made only at or after the first row that holds one, ``first_user_bwd``):
# - a ``bwd`` that returns ``None`` (or a symbolic zero) for an input that carries a
#   gradient marks that input ``_REACHED``; a row whose outputs got only marks passes
#   the mark on to its tracked inputs without running;
# - a custom_vjp row, or a scan whose body holds one and whose carry is
#   differentiated (``runs_on_zero``), runs on marks alone: the custom_vjp rule
#   gives its ``bwd`` zeros (symbolic zeros where it asks for them), the scan zero
#   cotangents;
# - a row whose bodies hold a ``bwd`` (``holds_user_bwd``) that runs anyway gets
#   zeros for its marked outputs and ``None`` for the others (its rule takes them:
#   ``unused_as_none``): a body's ``bwd`` runs on a zero cotangent, not on a missing
#   one. A scan's marked carries get zeros, its marked stacked outputs are passed as
#   missing (``reached_as_zeros``): jax's scan transpose makes its carries' zero
#   cotangents zeros and drops its stacked outputs' zero cotangents;
# - at the last row of an inlined ``jax.jit`` whose outputs got only marks, the
#   marks its body would read are dropped and its tracked inputs marked;
# - a program's input left marked gets zeros: the enclosing program or the tape sees
#   it reached.
class _Reached:
    """A value whose cotangent is zero but which the differentiated computation
    uses (Note [A user's bwd on zero cotangents])."""

    __slots__ = ()


_REACHED = _Reached()


def holds_user_bwd(step: Step) -> bool:
    """Whether ``step`` runs a user's ``bwd``: a ``jax.custom_vjp`` call, or control
    flow with one in a body (Note [A user's bwd on zero cotangents])."""
    if step.rule is None or not any(step.needs):
        return False
    if getattr(step.rule.vjp, "runs_user_bwd", False):
        return True
    return any(p.first_user_bwd is not None for p in _programs(step.sub))


def runs_on_zero(step: Step) -> bool:
    """Whether jax runs ``step``'s transpose when every cotangent of its outputs is
    zero: a custom_vjp's (it calls the ``bwd``), or control flow holding one whose
    rule says so (``vjp.runs_on_zero(step)``: a scan with a differentiated carry;
    Note [A user's bwd on zero cotangents])."""
    if getattr(step.rule.vjp, "runs_user_bwd", False):
        return True
    check = getattr(step.rule.vjp, "runs_on_zero", None)
    return check is not None and holds_user_bwd(step) and check(step)


def _programs(sub: Any) -> list[Program]:
    """The programs a step's ``sub`` holds (a body, the branches, a custom_jvp rule's)."""
    if isinstance(sub, Program):
        return [sub]
    if isinstance(sub, (list, tuple)):
        return [p for x in sub for p in _programs(x)]
    inner = getattr(sub, "program", None)
    return [inner] if isinstance(inner, Program) else []


# Note [A step's mesh]
# ~~~~~~~~~~~~~~~~~~~~~
# jax records with each equation the abstract mesh it was traced under
# (``eqn.ctx.cur_abstract_mesh``) and evaluates it under that mesh, as
# ``jax.sharding.auto_axes`` / ``explicit_axes`` need: their body is traced under
# the mesh with the axes' types changed, and its primitives check that their
# operands' mesh is the context's. A step traced under another mesh than the
# program's (``Step.mesh``; a body's program runs under its step's mesh) runs,
# forward and backward, under it again; the others run under whatever mesh the
# program runs under, as before. A ``shard_map`` body's steps (Manual axes) are
# not marked: rf runs that body inside jax's shard_map, under their mesh already.
# Its inputs' gradients, computed there with that mesh's types, take their inputs'
# traced types again (``reshard``, as auto_axes' exit does; a meshless input's
# gradient replicated over the program's mesh), so that they add up with the other
# gradients of those inputs.
def _in_mesh(step: Step) -> Any:
    return contextlib.nullcontext() if step.mesh is None else jax.sharding.use_abstract_mesh(step.mesh)


def _types(vs: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(getattr(getattr(v, "aval", None), "sharding", None) for v in vs)


def _onto_type(x: Any, sharding: Any, mesh: Any) -> Any:
    """``x`` with the traced ``sharding`` (a meshless one: replicated over ``mesh``,
    the mesh the value is used under)."""
    if x is None or sharding is None or not hasattr(x, "shape"):
        return x
    if sharding.mesh.empty:
        if mesh.empty:
            return x
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    if jax.typeof(x).sharding.mesh == sharding.mesh:
        return x
    return jax.sharding.reshard(x, sharding)


# Note [A refusal no gradient reaches]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A step whose rule refuses its parameters in ``prepare`` (a ragged dot with a ragged
# contracting axis) or whose values have reduced mesh axes stops the program when it
# is built, naming the primitive, where a gradient can reach it from an output of the
# program. Where none can (dead code: a value the function computes and drops, or
# reads only through ``stop_gradient`` or an integer result; jax.jvp of jax.grad of a
# ragged dot computes such a dot as a primal output nobody reads), jax.grad succeeds,
# since it transposes only the linear equations the outputs need: so the step refuses
# only if a gradient reaches it, as a complex step outside ``COMPLEX_OK`` does. Its
# float outputs stay tracked, so a custom rule closing over one still refuses, and a
# gradient that reached it would raise in ``Program.backward``: never a silent zero.
# A primitive with no rule at all is refused when the function is lifted, dead or not
# (SPEC section 8; jax.grad, which needs a JVP rule for every equation, fails on it
# too). Steps with effects (a write to a reference, a callback) are never dead.
# Test: tests/lift/test_unused_outputs.py.


def _refused_vjp(r: Any, g: Any) -> tuple:  # pragma: no cover - Program.backward raises first
    raise AutogradError(r._step.refusal)


def _refusing(step: Step, rule: Rule, message: str, vjp: Callable = _refused_vjp) -> Rule:
    """``rule`` for a step that refuses when a gradient reaches it (``step.refusal``):
    it keeps its record type, saves nothing, runs the primitive itself forward, and
    its backward (by default one that never runs: no prepared bodies) is ``vjp``
    (Note [A refusal no gradient reaches])."""
    step.refusal = message
    return dataclasses.replace(rule, vjp=vjp, saves=lambda needs, params: ((), ()), forward=None)


def _refusing_complex(step: Step, rule: Rule, program: str) -> Rule:
    """``rule`` for a step with complex values that its formula is not checked for
    (``COMPLEX_OK``): it saves nothing, and ``Program.backward`` raises if a gradient
    reaches the step (``step.refusal``). A step no gradient reaches (its output only
    under ``stop_gradient``, as the maximum ``jax.nn.softmax`` subtracts) does not
    stop the program, as it does not in jax.grad."""
    message = (
        f"rf.lift: the backward rule of the primitive '{step.prim.name}' (in {program}) is not "
        "defined for complex values, and the gradient of a complex value reaches it; "
        "compute it on the real and imaginary parts (jnp.real, jnp.imag)."
    )
    return _refusing(step, rule, message, rule.vjp)


def _is_internal(path: str) -> bool:
    return any(f"{os.sep}{d}{os.sep}" in path for d in ("jax", "jaxlib", "rumus_fx", "contextlib"))


def _where(eqn: Any, call: str = "", within: str = "") -> str:
    """Where an equation came from, for error messages: the library call that
    emitted it (the innermost frame outside jax and rumus_fx: a function of
    equinox, diffrax, ... or of the user), the user's outermost line, and the
    equation's name stack (``vmap(...)``, ``jit(...)``, module names)."""
    try:
        frames = [f for f in eqn.source_info.traceback.frames if not _is_internal(f.file_name)]
        stack = str(eqn.source_info.name_stack)
    except Exception:  # pragma: no cover - source info is best effort
        return within
    if not frames:
        return within
    parts = [call] if call else []
    if frames:
        inner, outer = frames[0], frames[-1]
        parts.append(f"by {_fn(inner)} at {_short(inner.file_name)}:{inner.line_num}")
        if outer is not inner:
            parts.append(f"called from {_fn(outer)} at {_short(outer.file_name)}:{outer.line_num}")
    if stack:
        parts.append(f"name stack {stack}")
    return ", ".join(parts)


def _fn(frame: Any) -> str:
    """A frame's function: ``f.<locals>.g`` -> ``g``, ``Model.__call__`` kept."""
    return frame.function_name.split("<locals>.")[-1]


def _short(path: str) -> str:
    """``.../site-packages/diffrax/_integrate.py`` -> ``diffrax/_integrate.py``."""
    for marker in ("site-packages", "dist-packages"):
        if marker in path:
            return path.split(marker + os.sep, 1)[1]
    return os.path.basename(path)


def _dtype_name(dtype: Any) -> str:
    """A dtype's name, jax's extended dtypes (a key, a library's tangent dtype) included."""
    return getattr(dtype, "name", None) or str(dtype)


def _describe(rec: PrimitiveRecord) -> str:
    """A primitive record, its primitive and operands, for a sharding error."""
    shown = ", ".join(
        f"{_dtype_name(a.dtype)}{list(a.shape)}" + (f" sharded {s.spec}" if s is not None else "")
        for a, s in zip(rec.in_avals, rec.in_shardings)
    )
    return f"{rec.name} (rf.lift's rule for '{rec._step.prim.name}', operands {shown})"
