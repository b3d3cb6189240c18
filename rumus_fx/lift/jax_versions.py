"""What the rules read from jax's own data structures, on every jax rf supports.

rf reads jaxprs and primitive parameters, which jax does not keep stable between
releases. Three changes in jax 0.11 broke ``rf.lift`` on a GPU machine running
jax 0.11.2 while every test passed on 0.10.2 (both versions are supported,
``jax>=0.10.2``). Each is read here through one function that works on both, by
looking at the data itself, not at a version number:

- **One class for jaxprs.** From 0.11 ``ClosedJaxpr`` is ``Jaxpr``: a jaxpr
  carries its constants, and an *open* one (constvars with no values attached,
  as a rule's tracing returns it) reads its constvars as leading invars until
  its constants are attached. :func:`closed` attaches them, and leaves a jaxpr
  that already carries its constants alone (re-wrapping it with ``()`` would
  turn its constants into inputs).
- **scan's parameters.** ``num_consts``/``num_carry`` became ``ft_in``/``ft_out``
  (flat trees of the constants, the carry and the scanned-over inputs):
  :func:`scan_counts`.
- **A custom_vjp bwd's result.** The flattened bwd returns ``(cotangents, logs)``
  from 0.11 (``defvjp_with_logs``), the cotangents alone before:
  :func:`bwd_cotangents`.

Reads of jax's types that are the same on both also live here: which manual axes
a value varies over inside ``shard_map`` (its type's ``mat.varying``),
:func:`varying_axes`, :func:`vary_over` and :func:`varying_like`; and mutable
array references (``jax.new_ref``): :func:`is_ref`, :func:`makes_refs`,
:func:`discharge` (jax's state discharge, which has no public name).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax import lax
from jax.extend import core as jcore

from ..errors import AutogradError

# jax's state discharge (a program transformation, not differentiation) has no public
# name; rf uses it for the mutable array references a lifted function makes itself
from jax._src.state import discharge as _discharge  # isort: skip

# jax >= 0.11: ClosedJaxpr is Jaxpr (a jaxpr carries its constants)
ONE_JAXPR_CLASS = jcore.ClosedJaxpr is jcore.Jaxpr


def closed(jaxpr: Any, consts: Sequence[Any] = ()) -> Any:
    """``jaxpr`` as a closed jaxpr whose constvars are bound to ``consts``.

    A jaxpr that is already closed (jax 0.10: a ``ClosedJaxpr``; jax 0.11: one
    with constants attached) is returned as it is when ``consts`` is empty."""
    if ONE_JAXPR_CLASS:
        if jaxpr.consts and not consts:
            return jaxpr
    elif isinstance(jaxpr, jcore.ClosedJaxpr):
        if consts:
            raise ValueError("constants given for a jaxpr that already has its own")
        return jaxpr
    return jcore.ClosedJaxpr(jaxpr, list(consts))


def scan_counts(params: Mapping[str, Any]) -> tuple[int, int]:
    """``(number of constants, number of carries)`` of a scan equation; the
    scanned-over inputs follow them."""
    if "num_consts" in params:  # jax 0.10
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()  # jax 0.11: flat trees
    return len(consts), len(carry)


def bwd_cotangents(out: Any) -> list[Any]:
    """The input cotangents a custom_vjp's flattened bwd returned.

    jax 0.11's returns ``(cotangents, logs)``; 0.10's the cotangents alone,
    each an array or a zero marker, never a list, so a pair whose first element
    is a list is the new form."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], (list, tuple)):
        if out[1] is None or isinstance(out[1], dict):
            return list(out[0])
    return list(out)


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes along which ``x`` varies inside a ``shard_map`` body
    with ``check_vma=True`` (empty elsewhere, and for a non-array leaf); ``x`` a
    value or its type (an aval, a ``ShapeDtypeStruct`` from ``jax.eval_shape``)."""
    mat = getattr(x, "manual_axis_type", None)
    if mat is None:
        try:
            mat = jax.typeof(x).mat
        except (TypeError, AttributeError):
            return frozenset()
    return frozenset(getattr(mat, "varying", ()))


def manual_type(aval: Any) -> Any:
    """The manual-axis type of ``aval`` when it is not empty (see :func:`manual_spec`),
    else None."""
    mat = getattr(aval, "manual_axis_type", None)
    return None if mat is None or getattr(mat, "empty", True) else mat


def manual_spec(aval: Any, weak_type: bool) -> Any:
    """``aval`` as a ``jax.ShapeDtypeStruct`` that keeps its manual-axis type (inside a
    ``shard_map`` body with ``check_vma=True``: the manual axes it varies over, its
    reduced or unreduced ones) and the sharding that goes with it; None for a type
    without one (every value outside a ``shard_map`` body). Traced with the struct, a
    function's constants are made to vary where they meet the value, as in jax's own
    trace."""
    mat = manual_type(aval)
    if mat is None:
        return None
    return jax.ShapeDtypeStruct(
        aval.shape, aval.dtype, weak_type=weak_type, sharding=aval.sharding, manual_axis_type=mat
    )


def vary_over(z: Any, axes: Any) -> Any:
    """``z`` (a value rf made, such as zeros) made to vary over the manual axes
    ``axes`` where it does not already: inside a ``shard_map`` body a primitive
    bound on values of different types is refused."""
    missing = tuple(sorted(frozenset(axes) - varying_axes(z)))
    return lax.pcast(z, missing, to="varying") if missing else z


def varying_like(z: Any, like: Any) -> Any:
    """``z`` made to vary over the manual axes ``like`` varies over (see
    :func:`vary_over`)."""
    return vary_over(z, varying_axes(like))


# -- mutable array references (jax.new_ref) --------------------------------------
_MAKES_REF = frozenset({"new_ref", "empty_ref"})


def is_ref(aval: Any) -> bool:
    """Whether ``aval`` is a mutable array reference's type."""
    return isinstance(aval, jax.ref.AbstractRef)


def makes_refs(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` (or a jaxpr in its equations' parameters) makes a
    mutable array reference."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _MAKES_REF:
            return True
        for sub in jcore.jaxprs_in_params(eqn.params):
            if makes_refs(getattr(sub, "jaxpr", sub)):
                return True
    return False


def discharge(closed_jaxpr: Any) -> Any:
    """``closed_jaxpr`` with the references it makes and frees itself turned into
    values threaded through it (jax's state discharge: a pure program)."""
    return _discharge.discharge_state(closed_jaxpr)


# -- primitives whose parameters rf reads by name ---------------------------------------


def require_params(step: Any, names: Sequence[str], what: str) -> None:
    """Refuse by name a step of ``what`` whose parameters are not the ones rf's
    rule was written for (checked with jax 0.10.2: a later jax may rename them),
    rather than crash inside the rule."""
    missing = [n for n in names if n not in step.params]
    if missing:
        raise AutogradError(
            f"rf.lift: {what} (the primitive '{step.prim.name}') has no parameter {', '.join(map(repr, missing))} "
            f"in jax {jax.__version__}: rf's rule for it was written for jax 0.10.2's parameters, so rf "
            "does not differentiate it here."
        )
