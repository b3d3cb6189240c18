"""Shardings in backward rules (mesh axes of type ``Explicit``).

Note [Gradients keep their operand's sharding]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With Explicit mesh axes (``jax.make_mesh``'s default) a sharding is part of an
array's type, and JAX refuses an op whose result sharding it cannot infer
without communication (a gather from a sharded table, a scatter into a sharded
array, a reshape that moves a sharded axis, a contraction over a sharded axis).
Backward rules therefore follow one invariant, as JAX's own transpose rules do:

* the gradient a record receives has the sharding of the record's output, and
* the gradient it returns for an input has that input's sharding.

``record`` (ops/_core.py) keeps each input's explicit sharding on the tape entry;
rules use :func:`sharding_of` / :func:`out_sharding` at record time and pass the
result as ``out_sharding=`` (``jnp.reshape``, ``lax.dot_general``,
``lax.conv_general_dilated``, ``x.at[i].add/get``, ``jnp.zeros``,
``jnp.broadcast_to``); :func:`reshape` infers a reshape's output sharding. The
engine checks each returned gradient with :func:`conform`, which reshards a
gradient whose sharding differs from its input's (and reports it through
``RESHARD_HOOK``, so tests can assert that no rule relies on that).

``rf.lift`` follows the same invariant per primitive: a lifted function is
traced with its inputs' sharded types, each primitive record carries its
operands' shardings (``in_sharding(k)``/``out_sharding(k)``, see
``lift/rules.py``), and the interpreter conforms every gradient a rule returns
(reporting through ``RESHARD_HOOK`` as the engine does).

With Auto mesh axes (or no mesh) every helper here is the identity: XLA's
partitioner propagates shardings through the program.
"""

from __future__ import annotations

import math
import os
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from . import eager
from .errors import SHARDING_HINT, ShardingError

# Called as RESHARD_HOOK(record_name, input_index, found, wanted) whenever the
# engine had to reshard a gradient (a rule returned a gradient whose sharding
# differs from its input's). None: reshard silently.
RESHARD_HOOK: Callable[[str, int, Any, Any], None] | None = None

_SingleDevice = jax.sharding.SingleDeviceSharding
_ArrayImpl: list[type] = []  # the concrete array class, found on first use: making an
# array at import would start the XLA backend before jax.distributed.initialize()


def sharding_of(x: Any) -> NamedSharding | None:
    """The sharding of ``x`` when it is sharded over *Explicit* mesh axes (the
    sharding is in its type), else None (Auto axes, no mesh, python scalars)."""
    return explicit(_type_sharding(x))


def on_mesh(x: Any) -> bool:
    """Whether ``x`` lives (or is traced) on a mesh of more than one device,
    with Explicit or Auto axes. Under Auto axes the spec is not in the type, but
    the mesh is, on every value computed from the arguments."""
    mesh = getattr(_type_sharding(x), "mesh", None)
    return mesh is not None and not getattr(mesh, "empty", True) and mesh.size > 1


def _type_sharding(x: Any) -> Any:
    """The sharding in the type of ``x`` (an array, a tracer or an rf.Tensor's
    value): ``jax.typeof(x).sharding``; None for python scalars, non-arrays and
    the common eager case of a single-device array, answered first."""
    if _ArrayImpl and type(x) is _ArrayImpl[0] and type(x.sharding) is _SingleDevice:
        return None
    if x is None or isinstance(x, (int, float, complex, bool)):
        return None
    value = x if isinstance(x, jax.Array) else getattr(x, "value", x)  # an rf.Tensor: its array
    if not _ArrayImpl and isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
        _ArrayImpl.append(type(value))
    if _ArrayImpl and type(value) is _ArrayImpl[0] and type(value.sharding) is _SingleDevice:
        return None
    try:
        return jax.typeof(value).sharding
    except (AttributeError, TypeError):
        return None


def explicit(sharding: Any) -> NamedSharding | None:
    """``sharding`` (an aval's, say a jaxpr variable's ``aval.sharding``) when it
    is a ``NamedSharding`` over a mesh with Explicit axes, else None."""
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True) or not isinstance(sharding, NamedSharding):
        return None
    if not any(t == AxisType.Explicit for t in mesh.axis_types):
        return None
    return sharding


def spec_of(x: Any) -> tuple[Any, ...] | None:
    """The explicit ``PartitionSpec`` of ``x`` padded to its rank (None when
    :func:`sharding_of` is None)."""
    s = sharding_of(x)
    if s is None:
        return None
    return tuple(s.spec) + (None,) * (len(x.shape) - len(s.spec))


def with_spec(like: NamedSharding | None, spec: Sequence[Any]) -> NamedSharding | None:
    """A sharding on ``like``'s mesh with ``spec`` (None when ``like`` is None)."""
    if like is None:
        return None
    return NamedSharding(like.mesh, P(*spec))


def _axis_size(mesh: Any, entry: Any) -> int:
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[n] for n in names)


def reshape_spec(in_shape: Sequence[int], spec: Sequence[Any], out_shape: Sequence[int], mesh: Any) -> tuple:
    """The spec of ``reshape(x, out_shape)`` that needs no communication where
    possible: a sharded input axis ``i`` stays sharded on the output axis ``j``
    that starts at the same place in row-major order (equal products of the
    axes before them) when ``out_shape[j]`` divides evenly over the mesh axes;
    a sharded axis without such a partner is gathered (None)."""
    out: list[Any] = [None] * len(out_shape)
    for i, entry in enumerate(spec):
        if entry is None:
            continue
        before = math.prod(in_shape[:i])
        for j in range(len(out_shape)):
            if math.prod(out_shape[:j]) == before and out[j] is None and out_shape[j] % _axis_size(mesh, entry) == 0:
                if out_shape[j] == 1 and in_shape[i] != 1:
                    continue
                out[j] = entry
                break
    return tuple(out)


def reshape(x: jax.Array, shape: Sequence[int], out_sharding: NamedSharding | None = None) -> jax.Array:
    """``jnp.reshape`` that keeps sharded axes sharded (see :func:`reshape_spec`);
    ``out_sharding`` overrides the inferred sharding."""
    shape = tuple(int(d) for d in shape)
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        shape = tuple(math.prod(x.shape) // max(known, 1) if d == -1 else d for d in shape)
    if tuple(x.shape) == shape and out_sharding is None:
        return x
    if out_sharding is None:
        s = sharding_of(x)
        if s is None:
            return eager.reshape(x, shape)
        out_sharding = with_spec(s, reshape_spec(x.shape, spec_of(x), shape, s.mesh))
    return jnp.reshape(x, shape, out_sharding=out_sharding)


def conform(g: jax.Array, sharding: NamedSharding | None) -> jax.Array:
    """``g`` resharded to ``sharding`` when that is an explicit sharding that
    ``g`` does not already have (identity otherwise)."""
    if sharding is None:
        return g
    have = spec_of(g)
    want = tuple(sharding.spec) + (None,) * (g.ndim - len(sharding.spec))
    if have == want or (have is None and all(w is None for w in want)):
        return g
    return jax.sharding.reshard(g, sharding)


# Note [Broadcasting a meshless value]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# jax 0.11 made ``broadcast_in_dim`` a standard primitive, whose sharding
# inference (``call_sharding_rule`` in jax/_src/lax/utils.py) skips the
# primitive's rule -- and with it the ``out_sharding=`` it was given -- when
# neither the context mesh (``jax.set_mesh``) nor the operand's type has
# Explicit axes: under ``jax.jit`` without ``set_mesh``, broadcasting a meshless
# value (the seed of a backward pass, a constant, an iota) to an explicit
# sharding gives a replicated result, which the engine then has to reshard.
# ``jnp.zeros(out_sharding=)`` and ``jnp.full_like`` broadcast a scalar the same
# way. jax 0.10 honoured ``out_sharding=`` there. :func:`onto_mesh` first puts
# such an operand on the sharding's mesh, replicated (no data moves: it is the
# same on every device), so that the broadcast's rule runs on both versions.


def onto_mesh(x: Any, sharding: NamedSharding | None) -> Any:
    """``x`` replicated on ``sharding``'s mesh when ``sharding`` is explicit, no
    mesh is set and ``x`` (traced, or a constant in a traced program) has no mesh
    in its type (Note [Broadcasting a meshless value]); else ``x``."""
    if sharding is None or not jax.sharding.get_abstract_mesh().empty:
        return x
    have = _type_sharding(x)
    if not getattr(getattr(have, "mesh", None), "empty", True):
        return x
    if not isinstance(x, jax.core.Tracer) and not _staging():
        return x  # eagerly, Explicit axes need jax.set_mesh, which sets the context mesh
    return jax.sharding.reshard(x, NamedSharding(sharding.mesh, P()))


def _staging() -> bool:
    """Whether jax is tracing a program (not running op by op)."""
    return type(jcore.find_top_trace(())).__name__ != "EvalTrace"


def zeros(shape: Sequence[int], dtype: Any, sharding: NamedSharding | None) -> jax.Array:
    """``jnp.zeros`` with ``sharding`` (when explicit)."""
    if sharding is None:
        return jnp.zeros(shape, dtype)
    if jax.sharding.get_abstract_mesh().empty and _staging():
        # jnp.zeros broadcasts a meshless scalar (Note [Broadcasting a meshless value])
        return broadcast_to(jnp.zeros((), dtype), shape, sharding)
    return jnp.zeros(shape, dtype, out_sharding=sharding)


def broadcast_to(g: Any, shape: Sequence[int], sharding: NamedSharding | None) -> jax.Array:
    """``jnp.broadcast_to`` producing ``sharding`` (when explicit): the gradient
    of a reduction, broadcast back to its input's sharded shape."""
    if sharding is None:
        return jnp.broadcast_to(g, shape)
    return jnp.broadcast_to(onto_mesh(g, sharding), shape, out_sharding=sharding)


def broadcast_in_dim(g: Any, shape: Sequence[int], dims: Sequence[int], sharding: NamedSharding | None) -> jax.Array:
    """``lax.broadcast_in_dim`` producing ``sharding`` (when explicit)."""
    return lax.broadcast_in_dim(onto_mesh(g, sharding), tuple(shape), tuple(dims), out_sharding=sharding)


def describe(x: Any) -> str:
    """``float32[16@data,5]``-style text for error messages."""
    value = x if isinstance(x, jax.Array) else getattr(x, "value", x)  # an rf.Tensor: its array
    try:
        return str(jax.typeof(value))
    except TypeError:
        return type(x).__name__


_OPS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ops") + os.sep


def is_sharding_failure(e: BaseException) -> bool:
    """JAX refusing a sharding: ``ShardingTypeError`` on Explicit mesh axes, or a
    bare ``PartitionSpec`` used without ``jax.set_mesh``."""
    if isinstance(e, ShardingError):
        return False
    return type(e).__name__ == "ShardingTypeError" or (
        isinstance(e, ValueError) and "not under a mesh context" in str(e)
    )


def forward_error(e: BaseException) -> ShardingError | None:
    """The ``ShardingError`` for a sharding failure raised inside an rf op's
    forward (named after the outermost ``rumus_fx/ops`` frame, with its array
    arguments' sharded types), or None when ``e`` is not one."""
    if not is_sharding_failure(e):
        return None
    tb: types.TracebackType | None = e.__traceback__
    frame = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(_OPS_DIR):
            frame = tb.tb_frame
            break
        tb = tb.tb_next
    if frame is None:
        return None
    code = frame.f_code
    shown = []
    for name in code.co_varnames[: code.co_argcount]:
        v = frame.f_locals.get(name)
        if v is not None and hasattr(v, "shape") and hasattr(v, "dtype"):
            shown.append(f"{name}: {describe(v)}")
    return ShardingError(
        f"{code.co_name}: cannot combine operands sharded as {', '.join(shown) or '(no array operands)'} "
        f"on Explicit mesh axes: {_first_line(e)}. {SHARDING_HINT}"
    )


def backward_error(e: BaseException, record: str, g: Any) -> ShardingError | None:
    """The ``ShardingError`` for a sharding failure raised by a backward rule."""
    if not is_sharding_failure(e):
        return None
    shown = ", ".join(describe(x) for x in g) if isinstance(g, tuple) else describe(g)
    return ShardingError(
        f"{record}: its backward rule cannot give its inputs their shardings from the output "
        f"gradient {shown}: {_first_line(e)}. This is a gap in rumus_fx's sharding support; "
        f"until it is closed: {SHARDING_HINT}"
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
