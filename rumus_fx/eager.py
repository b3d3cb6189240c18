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

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .compiler import CPU_COMPILER_OPTIONS

_Tracer = jax.core.Tracer
_TRACER_OR_CONTAINER = (_Tracer, tuple, list, dict)

# (function, static argnums, static argnames, compiler options) -> its jax.jit
_COMPILED: dict[tuple[Any, tuple[int, ...], tuple[str, ...], Any], Callable[..., Any]] = {}


def compiled(
    fun: Callable[..., Any],
    static_argnums: Sequence[int] = (),
    static_argnames: Sequence[str] = (),
    compiler_options: Mapping[str, str] | None = None,
) -> Any:
    """The cached ``jax.jit`` of ``fun`` with these static arguments (and, when
    given, these XLA compiler options for this one program: Note [Eager
    compiler options])."""
    opts = None if compiler_options is None else tuple(sorted(compiler_options.items()))
    key = (fun, tuple(static_argnums), tuple(static_argnames), opts)
    jitted = _COMPILED.get(key)
    if jitted is None:
        options = None if opts is None else dict(opts)
        jitted = _COMPILED[key] = jax.jit(fun, static_argnums=key[1], static_argnames=key[2], compiler_options=options)
    return jitted


# Note [Eager compiler options]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A program that an op runs eagerly is compiled for that op alone, so it can
# carry XLA options chosen for it without touching anything else: the library
# sets no process-wide flag, and a user's ``jax.jit`` of a whole step compiles
# with the options the user gives. The convolutions use this on a single CPU
# device (``cpu_options``): ``compiler.CPU_COMPILER_OPTIONS`` runs their
# convolutions through XLA:CPU's own (Eigen) kernels rather than YNNPACK's,
# which in the benchmark CNN's shapes compute ``dw`` faster than YNNPACK's
# convolution and than the per-sample dots (benchmarks/RESULTS.md, "Thresholds in the code").


def cpu_options(*arrays: Any) -> Mapping[str, str] | None:
    """``CPU_COMPILER_OPTIONS`` when every array (None skipped) lives on one and
    the same CPU device, so the program that reads them compiles for XLA:CPU;
    None otherwise (another platform, several devices, a tracer)."""
    device = None
    for a in arrays:
        if a is None:
            continue
        if isinstance(a, _Tracer):
            return None
        devices = getattr(a, "sharding", None)
        devices = None if devices is None else devices.device_set
        if devices is None or len(devices) != 1:
            return None
        (d,) = devices
        if device is None:
            if d.platform != "cpu":
                return None
            device = d
        elif d != device:
            return None
    return CPU_COMPILER_OPTIONS if device is not None else None


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
    jitted = None  # the shared cached jax.jit, looked up on the first eager call

    def call(*args: Any) -> Any:
        # Note [Eager fast path] (rumus_fx/ops/_core.py): flat arguments are
        # checked one by one (one isinstance each for the usual arrays and
        # scalars), the jitted function is bound once, so an eager call is one
        # C++ jit dispatch
        nonlocal jitted
        dynamic = [a for i, a in enumerate(args) if i not in nums] if nums else args
        for a in dynamic:
            if isinstance(a, _TRACER_OR_CONTAINER):
                if isinstance(a, _Tracer) or has_tracer(dynamic):
                    return fun(*args)
                break
        if jitted is None:
            jitted = compiled(fun, nums)
        return jitted(*args)

    call.__wrapped__ = fun  # type: ignore[attr-defined]
    call.__name__ = getattr(fun, "__name__", "eager")
    call.__doc__ = getattr(fun, "__doc__", None)
    return call


# Layout-only steps that ops take outside their own compiled forward (a bias
# given leading unit axes, a view materialised, a reshape) and the backward's
# seed: eagerly, ``jnp.reshape``/``jnp.transpose``/``jnp.ones`` each bind a
# primitive through JAX's Python dispatch; these are one cached compiled call
# each, several times cheaper (benchmarks/RESULTS.md, "Thresholds in the code"). Under a
# trace they are the jnp functions.
reshape = eager_jit(jnp.reshape, static_argnums=(1,))  # (x, shape: a tuple of ints)
transpose = eager_jit(jnp.transpose, static_argnums=(1,))  # (x, axes: a tuple of ints)
_ones = jax.jit(jnp.ones, static_argnums=(0, 1))
_zeros = jax.jit(jnp.zeros, static_argnums=(0, 1))


def _relayout(x: Any, before: tuple[int, ...], axes: tuple[int, ...], after: tuple[int, ...]) -> Any:
    return jnp.reshape(jnp.transpose(jnp.reshape(x, before), axes), after)


# a permuted view materialised (``storage.read_layout``): reshape, transpose and
# reshape as one compiled call, one pass over the data -- as three calls, each
# reshape was a copy of its own (XLA gives a program's output its own buffer)
relayout = eager_jit(_relayout, static_argnums=(1, 2, 3))  # (x, before, axes, after)


def is_64_bit(x: Any) -> bool:
    """Whether ``x`` (a value or its type) has a dtype that needs 64-bit types on:
    float64, int64, uint64, complex128 (not complex64, two float32s)."""
    return isinstance(dt := getattr(x, "dtype", None), np.dtype) and dt.itemsize == (16 if dt.kind == "c" else 8)


def x64_as_made(values: Sequence[Any]) -> Any:
    """A context in which ``values`` can be made and computed with: 64-bit types
    turned on where one of them is 64-bit while they are off. Such a value was made
    inside a ``jax.enable_x64()`` block of the user's function; rf runs a lifted
    program's rules, a custom rule's trace and the backward's seed after that block
    has ended (jax.grad runs them at the call), where ``jnp`` would make them 32-bit."""
    if any(is_64_bit(v) for v in values) and not jax.config.jax_enable_x64:
        return jax.enable_x64(True)
    return contextlib.nullcontext()


def ones_like_value(x: Any) -> Any:
    """``jnp.ones(x.shape, x.dtype)``, a new array every call (the seed of a
    backward pass: a gradient can be the seed itself and reach the user, who may
    donate it); one cached compiled call when ``x`` is concrete."""
    with x64_as_made((x,)):
        if isinstance(x, _Tracer):
            return jnp.ones(x.shape, x.dtype)
        return _ones(tuple(x.shape), x.dtype)


def zeros_like_value(x: Any) -> Any:
    """``jnp.zeros(x.shape, x.dtype)`` (the gradient of an argument the function
    did not use); one cached compiled call when ``x`` is concrete."""
    if isinstance(x, _Tracer):
        return jnp.zeros(x.shape, x.dtype)
    return _zeros(tuple(x.shape), x.dtype)


PY_SCALARS = (int, float)  # python scalars, tested by exact type (not bool, not numpy scalars)

# python scalar operand -> the weakly typed device array jit makes of it (see
# ``scalar_operand``), per (type, value, x64, default device, abstract mesh)
_SCALAR_ARRAYS: dict[tuple[Any, ...], jax.Array] = {}
_SCALAR_ARRAYS_MAX = 256  # distinct scalars kept (a changing scalar, say a
# scheduled learning rate, then goes back to a conversion per call)


def scalar_operand(v: int | float) -> Any:
    """The python scalar ``v`` (exactly an int or a float) as the array a jitted
    call would convert it to on every dispatch -- ``jnp.asarray(v)``: weakly
    typed, of the x64 mode's dtype, uncommitted on the default device (under
    the current abstract mesh) -- made once and cached on all of those, so an
    eager ``t * 2.0``, or a whole-tape backward over records that saved python
    scalars, pays no host-to-device transfer per scalar (Note [Eager fast path]
    in rumus_fx/ops/_core.py).
    Only for concrete calls: under a trace the scalar stays a literal. Zeros
    and nan are passed through (``0.0 == -0.0`` and ``nan != nan`` as keys),
    as is anything the conversion refuses (jit then raises its own error)."""
    if not v or v != v:
        return v
    config = jax.config
    key = (type(v), v, config.jax_enable_x64, config.jax_default_device, _abstract_mesh())
    arr = _SCALAR_ARRAYS.get(key)
    if arr is None:
        if len(_SCALAR_ARRAYS) >= _SCALAR_ARRAYS_MAX:
            return v
        try:
            arr = jnp.asarray(v)
        except (OverflowError, TypeError, ValueError):
            return v
        _SCALAR_ARRAYS[key] = arr
    return arr


# (x64, default device, abstract mesh, the scalars, their types) -> their
# ``scalar_operand``s, for runs of deferred ops (``scalar_operands``)
_SCALAR_LISTS: dict[tuple[Any, ...], list[Any]] = {}
_SCALAR_LISTS_MAX = 64


def scalar_operands(values: list[Any]) -> list[Any]:
    """``[scalar_operand(v) for v in values]`` (python ints and floats), one
    cached list per (context, values, their types) when no value is a zero or
    a nan: a deferred run passes the same scalars at every step (rumus_fx/lazy.py).
    Keys never hold a zero or a nan, so ``-0.0`` never meets a cached ``0.0``
    (they compare equal) and a nan never matches."""
    config = jax.config
    key = (config.jax_enable_x64, config.jax_default_device, _abstract_mesh(), tuple(values), tuple(map(type, values)))
    out = _SCALAR_LISTS.get(key)
    if out is None:
        out = [scalar_operand(v) for v in values]
        if len(_SCALAR_LISTS) < _SCALAR_LISTS_MAX and all(v and v == v for v in values):
            _SCALAR_LISTS[key] = out
    return list(out)


_abstract_mesh = jax.sharding.get_abstract_mesh
