"""The one eager compile cache.

Note [Eager compilation]
~~~~~~~~~~~~~~~~~~~~~~~~
Called eagerly (every array argument concrete), a function of many jnp
primitives pays one Python dispatch per primitive and nothing fuses. Each place
that runs such a function eagerly -- an op's forward, a kernel's jnp reference
(``kernels.dispatch``), a record's backward rule (``autograd.record``) -- runs it
through ``eager_jit`` instead: one cached ``jax.jit`` per function (and static
arguments), so the call is one dispatch of a fused program. Under a trace
(``jax.jit``, ``vmap``, ``rf.lift``) the function is traced inline, leaving the
enclosing program exactly as written. The whole-tape backward
(``autograd/whole_tape.py``) compiles one program per tape signature on top of
these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

_Tracer = jax.core.Tracer

# (function, static argnums, static argnames) -> its jax.jit
_COMPILED: dict[tuple[Any, tuple[int, ...], tuple[str, ...]], Callable[..., Any]] = {}


def compiled(fun: Callable[..., Any], static_argnums: Sequence[int] = (), static_argnames: Sequence[str] = ()) -> Any:
    """The cached ``jax.jit`` of ``fun`` with these static arguments."""
    key = (fun, tuple(static_argnums), tuple(static_argnames))
    jitted = _COMPILED.get(key)
    if jitted is None:
        jitted = _COMPILED[key] = jax.jit(fun, static_argnums=key[1], static_argnames=key[2])
    return jitted


def has_tracer(args: Any) -> bool:
    """Whether any leaf of ``args`` is a tracer (the call is being traced)."""
    if isinstance(args, _Tracer):
        return True
    if isinstance(args, (tuple, list)) and all(not isinstance(a, (tuple, list, dict)) for a in args):
        return any(isinstance(a, _Tracer) for a in args)
    return any(isinstance(leaf, _Tracer) for leaf in jax.tree_util.tree_leaves(args))


def eager_jit(fun: Callable[..., Any] | None = None, *, static_argnums: Sequence[int] = ()) -> Any:
    """``fun`` as one cached compiled call when called eagerly; traced inline
    under a trace (Note [Eager compilation]). Usable as ``@eager_jit`` or
    ``@eager_jit(static_argnums=(1,))``."""
    if fun is None:
        return lambda f: eager_jit(f, static_argnums=static_argnums)
    nums = tuple(static_argnums)
    jitted: list[Any] = []  # the shared cached jax.jit, looked up on the first eager call

    def call(*args: Any) -> Any:
        # Note [Eager fast path] (rumus_fx/ops/_core.py): flat arguments are
        # checked one by one, the jitted function is bound once, so an eager
        # call is one C++ jit dispatch
        dynamic = [a for i, a in enumerate(args) if i not in nums] if nums else args
        for a in dynamic:
            if isinstance(a, _Tracer):
                return fun(*args)
            if isinstance(a, (tuple, list, dict)):
                if has_tracer(dynamic):
                    return fun(*args)
                break
        if not jitted:
            jitted.append(compiled(fun, nums))
        return jitted[0](*args)

    call.__wrapped__ = fun  # type: ignore[attr-defined]
    call.__name__ = getattr(fun, "__name__", "eager")
    call.__doc__ = getattr(fun, "__doc__", None)
    return call
