"""Primitive rules for equinox's internal primitives (so equinox and diffrax
programs differentiate on the tape).

Declared with the public ``rf.defrule`` (Note [Rules of other libraries] in
``lift/library.py``), each for equinox's own ``Primitive`` object; this module
is imported the first time a lifted program holds one of them
(``LIBRARY_RULES`` in ``lift/rules.py``), so ``import rumus_fx`` never imports
equinox. equinox's ``unvmap_any``/``unvmap_all``/``unvmap_max`` have boolean or
integer outputs and pass through without a rule.

* ``maybe_set(pred, xs, x, *i)``: ``xs.at[i].set(x)`` (with
  ``makes_false_steps``, ``xs.at[i].set(where(pred, x, xs[i]))``) into a
  buffer that equinox writes at most once per position: the gradient of ``x``
  is the output's gradient read at ``i`` (where ``pred``, with false steps or
  under a ``jax.vmap`` that batches ``pred``, also one around the gradient),
  that of ``xs`` the output's gradient whole, as equinox's own transpose gives
  it (the value at ``i`` before the write is never read, so ``jax.grad`` and rf
  agree with finite differences exactly when the buffer is used as equinox
  documents).
* ``vprim``: equinox's batched form of such a primitive (``maybe_set`` under
  ``jax.vmap``, with a batched predicate): the inner primitive's rule, vmapped
  over the batch axes (an unbatched input's gradient summed over the batch).
  Under ``vmap`` equinox's ``select_if_vmap`` is a real select, so the inner
  ``maybe_set`` rule, vmapped with a batched predicate, masks its false steps.
* ``select_if_vmap(pred, x, y)``: ``x`` outside ``vmap`` (its forward); the
  gradient goes to ``x``.
* ``nondifferentiable_backward(x)``: the identity whose reverse refuses a
  gradient: with ``symbolic=True`` any gradient reaching it raises
  ``AutogradError`` with equinox's message; with ``symbolic=False`` a nonzero
  one fails at run time through ``equinox.error_if``, as under ``jax.grad``.

``maybe_set`` and ``select_if_vmap`` are linear maps (a write, a select): their
rules hold for complex values as written, transposed and not conjugated
(``COMPLEX_OK``; checked by ``tests/lift/test_complex.py``, group "equinox": a
complex state written into a bounded or checkpointed loop's buffers, as diffrax
and dynamiqs do). ``vprim`` runs its inner primitive's rule and
``nondifferentiable_backward`` refuses any gradient, so neither is listed there:
a complex value reaching them is refused by name.

equinox's ``nontraceable`` (which must not be differentiated), ``nonbatchable``
(which ``jax.grad`` refuses too) and ``noinline`` have no rule: a program whose gradient goes through one raises, naming it.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from equinox.internal._loop import common as _eqx_loop
from equinox.internal._primitive import _vprim_p

from ..autograd.record import Aval
from ..autograd.registry import BadProgram, Sample, TableEntry
from ..errors import AutogradError
from ..ops._declare import normal
from .library import defrule
from .rules import COMPLEX_OK, Params, rule_for

# -- maybe_set -------------------------------------------------------------------


def _index(r: Any) -> Any:
    """The index ``i`` of a ``maybe_set``, from its static part and its saved dynamic leaves."""
    p = r.params
    static = _eqx_loop._to_raw_slice(p["i_static"])
    dynamic = jtu.tree_unflatten(p["i_treedef"], list(r.ins[3:]))
    return eqx.combine(static, dynamic)


def _maybe_set_saves(needs: tuple[bool, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (0, *range(3, len(needs))), ()


def _maybe_set_vjp(r: Any, g: Any) -> tuple:
    (ct,) = g
    i = _index(r)
    kwargs = dict(r.params["kwargs"])
    false_steps = r.params["makes_false_steps"]
    pred = r.ins[0]
    out: list[Any] = [None] * len(r.in_avals)
    if r.needs[1]:
        out[1] = ct  # write-once buffers: position i held no value that is read (equinox's own rule)
    if r.needs[2]:
        # where(pred) with false steps; without, equinox's select_if_vmap: all of it outside
        # vmap, where(pred) under a vmap that batches pred (one around the whole gradient
        # too, which this trace does not see)
        ct_x = ct.at[i].get(**kwargs)
        out[2] = _eqx_loop._select_if_vmap(pred, ct_x, jnp.zeros_like(ct_x), makes_false_steps=false_steps)
    return tuple(out)


def _maybe_set_program(false_steps: bool) -> Any:
    def f(xs: jax.Array, x: jax.Array) -> jax.Array:
        xs = xs.at[jnp.array([1, 3])].set(0.0)  # a buffer: the positions written hold no value before
        pred = jnp.sum(x) > -100.0  # True (a traced predicate)
        i = jnp.array(1)
        ys = _eqx_loop._maybe_set(pred, xs, x, i, kwargs={}, makes_false_steps=false_steps)
        pred2 = jnp.sum(xs) > 100.0  # False: with false steps, nothing is written
        ys = _eqx_loop._maybe_set(pred2, ys, 2 * x, jnp.array(3), kwargs={}, makes_false_steps=false_steps)
        return jnp.sin(ys) * ys

    return f


def _buffer_samples(rng: np.random.Generator) -> list[Sample]:
    return [Sample((normal(rng, 5, 3), normal(rng, 3)), diff=(0, 1))]


defrule(
    eqxi.maybe_set_p,
    _maybe_set_vjp,
    saves=_maybe_set_saves,
    doc="Backward record of equinox's ``maybe_set`` primitive (a write into a loop's buffer).",
    table=(
        # equinox's primitives batch by rules of their own: each entry is checked under vmap by default
        TableEntry("eqx_maybe_set", _maybe_set_program(False), _buffer_samples, vmap=True),
        TableEntry("eqx_maybe_set_false_steps", _maybe_set_program(True), _buffer_samples, vmap=True),
    ),
)

# -- select_if_vmap ------------------------------------------------------------------


def _select_if_vmap_vjp(r: Any, g: Any) -> tuple:
    """The primitive again on the cotangent (its transpose, as equinox's own):
    outside vmap the first branch takes all of it; under a vmap that batches
    the predicate (where the forward was ``lax.select``) each example's
    cotangent goes to the branch its predicate chose."""
    pred = r.ins[0]
    zero = jnp.zeros_like(g)
    gx = eqxi.select_if_vmap_p.bind(pred, g, zero) if r.needs[1] else None
    gy = eqxi.select_if_vmap_p.bind(pred, zero, g) if r.needs[2] else None
    return (None, gx, gy)


def _select_if_vmap_program(x: jax.Array, y: jax.Array) -> jax.Array:
    out = _eqx_loop._select_if_vmap(jnp.sum(x) > 0, x, y, makes_false_steps=False)
    return jnp.cos(out) * y


defrule(
    eqxi.select_if_vmap_p,
    _select_if_vmap_vjp,
    saves=((0,), ()),
    doc="Backward record of equinox's ``select_if_vmap`` primitive (its first branch outside vmap).",
    table=(
        TableEntry(
            "eqx_select_if_vmap",
            _select_if_vmap_program,
            lambda rng: [Sample((normal(rng, 4), normal(rng, 4)), diff=(0, 1))],
            vmap=True,  # the predicate batched: a select per example, the gradient split the same way
        ),
    ),
)

COMPLEX_OK.update({"maybe_set", "select_if_vmap"})  # linear maps (the module's docstring)

# -- identities: nondifferentiable_backward, nonbatchable ----------------------------


def _nondifferentiable_backward_vjp(r: Any, g: Any) -> tuple:
    msg = r.params["msg"]
    if r.params["symbolic"]:
        raise AutogradError(f"equinox.internal.nondifferentiable_backward: {msg}")
    return (eqx.error_if(g, jnp.any(g != 0), msg),)


def _nondiff_errors() -> list[BadProgram]:
    def f(x: jax.Array) -> jax.Array:
        return jnp.sin(eqxi.nondifferentiable_backward(x, name="the thing"))

    return [
        BadProgram(
            "a gradient reaching nondifferentiable_backward",
            f,
            (np.ones(3),),
            AutogradError,
            ("the thing cannot be reverse-mode autodifferentiated",),
            names=("nondifferentiable_backward",),
        )
    ]


defrule(
    eqxi.nondifferentiable_backward_p,
    _nondifferentiable_backward_vjp,
    saves=((), ()),
    doc="Backward record of equinox's ``nondifferentiable_backward`` primitive (refuses a gradient).",
    table=(
        TableEntry(
            "eqx_nondifferentiable_backward_zero",
            lambda x: jnp.sin(eqxi.nondifferentiable_backward(x, symbolic=False)) * 0.0 + jnp.cos(x),
            lambda rng: [Sample((normal(rng, 3),))],
            prims=("nondifferentiable_backward",),
            vmap=True,
        ),
    ),
    errors=_nondiff_errors,
)


# -- vprim: a primitive batched by equinox's vmap rule ---------------------------------


def _unbatched(aval: Aval, axis: int | None) -> Aval:
    if axis is None:
        return aval
    return Aval(tuple(d for k, d in enumerate(aval.shape) if k != axis), aval.dtype)


def _vprim_prepare(step: Any) -> None:
    """At lift time: the batched primitive must have a rule (named in the error)."""
    inner = step.params["prim"]
    if rule_for(inner) is None:
        where = f", emitted {step.where}" if step.where else ""
        raise AutogradError(
            f"rf.lift: no backward rule for the primitive '{inner.name}' (batched by equinox's vprim{where}); "
            "register one with rf.defrule"
        )


def _vprim_vjp(r: Any, g: Any) -> tuple:
    inner_prim = r.params["prim"]
    inner = rule_for(inner_prim)
    axes = tuple(r.params["__batch_axes"])
    size = r.params["__axis_size"]
    params = dict(r.params["params"])
    in_avals = tuple(_unbatched(a, b) for a, b in zip(r.in_avals, axes))
    out_avals = tuple(_unbatched(a, 0) for a in r.out_avals)
    inner_params = Params(params)

    def one(ins: tuple, outs: tuple, g: tuple) -> tuple:
        rec = inner.record(inner_params, in_avals, out_avals, r.needs, ins, outs, (), (), ())
        grads = inner.vjp(rec, g if inner.multiple_results or inner_prim.multiple_results else g[0])
        return tuple(None if (gr is None or not need) else gr for gr, need in zip(grads, r.needs))

    outs = tuple(r.outs)
    grads = jax.vmap(one, in_axes=(axes, 0, 0), out_axes=0, axis_size=size)(tuple(r.ins), outs, tuple(g))
    result: list[Any] = []
    for gr, b in zip(grads, axes):
        if gr is None:
            result.append(None)
        elif b is None:
            result.append(jnp.sum(gr, axis=0))  # an unbatched input: its gradient is summed over the batch
        else:
            result.append(jnp.moveaxis(gr, 0, b))
    return tuple(result)


_vprim_vjp.prepare = _vprim_prepare  # type: ignore[attr-defined]


def _vmapped_buffer_program(xs: jax.Array, x: jax.Array) -> jax.Array:
    """``maybe_set`` under ``jax.vmap`` with a batched predicate (a ``vprim``):
    each row of ``x`` written into its buffer for half the batch, and a shared
    (unbatched) index."""
    xs = xs.at[:, jnp.array([1, 3])].set(0.0)

    def one(buf: jax.Array, xrow: jax.Array, k: jax.Array) -> jax.Array:
        pred = k % 2 == 0
        return _eqx_loop._maybe_set(pred, buf, xrow, jnp.array(1), kwargs={}, makes_false_steps=False)

    ys = jax.vmap(one)(xs, x, jnp.arange(x.shape[0]))
    return jnp.sin(ys) * ys


defrule(
    _vprim_p,
    _vprim_vjp,
    doc="Backward record of equinox's ``vprim`` primitive (a primitive batched by jax.vmap).",
    table=(
        TableEntry(
            "eqx_vprim_maybe_set",
            _vmapped_buffer_program,
            lambda rng: [Sample((normal(rng, 4, 5, 3), normal(rng, 4, 3)), diff=(0, 1))],
            prims=("vprim",),
            vmap=True,
        ),
    ),
)
