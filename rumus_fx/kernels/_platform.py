"""A compiled Pallas kernel that lowers for every platform.

Why: ``jax.lax.platform_dependent`` (how dispatch picks Triton, Mosaic or the
reference) prunes the branches of other platforms only *after* lowering them,
and in a multi-platform lowering (``jax.export`` for ``["cpu", "cuda", "tpu"]``)
every kept branch is lowered for every platform (jax 0.10 and 0.11). A Triton
``pallas_call`` in the CUDA branch would then be lowered for CPU (Pallas
refuses) and for TPU (Mosaic rejects Triton parameters), so no such program
could be exported.

:func:`native_or_interpret` binds a primitive with one lowering rule per
platform: the compiled kernel on the platforms it was written for, and the same
kernel in Pallas' interpreter (plain XLA ops, correct on any platform) on the
others. In a dispatch branch the interpreter copy is dead code (the branch is
never selected on those platforms) and exists only so that the branch lowers;
a single-platform lowering (``jax.jit`` on a GPU) never builds it.

jax 0.11 deprecates Pallas' Triton backend and warns (a ``DeprecationWarning``)
each time a Triton ``pallas_call`` is lowered. Which backend runs rf's kernels is
rf's choice, not its user's, and a user can do nothing about it (a test suite
that turns warnings into errors would fail on every compiled step), so
:func:`own_kernels` silences that one message while rf lowers its own kernels,
and nowhere else: a user's own Triton kernels still warn. If jax removes the
backend, ``"auto"`` falls back to the reference with a ``KernelFallbackWarning``
(SPEC section 6).

Lowering the GPU kernels for cuda from a process without a GPU (``jax.export``
for ``["cpu", "cuda", "tpu"]`` on a CPU host): jax 0.10's Triton lowering
assumed compute capability 9.0 when it found no GPU; jax 0.11's asks
``gpu_info.get_gpu_info()`` for the GPU, which reads the abstract mesh's
``AbstractDevice``, else the default device, and raises "No supported GPU
devices found" when neither is a GPU. :func:`gpu_target` supplies an abstract
H100 (compute capability 9.0, jax 0.10's assumption) around rf's own GPU
kernels in that case only: a GPU in the process, or an ``AbstractDevice`` the
user set with ``jax.sharding.use_abstract_mesh``, decides instead.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
_BACKEND_PLATFORMS = {"cpu": ("cpu",), "gpu": ("cuda", "rocm"), "tpu": ("tpu",)}

native_or_interpret_p = jex_core.Primitive("rumus_fx_native_or_interpret")
native_or_interpret_p.multiple_results = True


TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"


@contextlib.contextmanager
def own_kernels() -> Iterator[None]:
    """While rf lowers its own kernels: jax's deprecation of the Triton backend
    is not shown (only that message, only as a ``DeprecationWarning``). Python's
    ``catch_warnings`` is process-wide: two threads lowering at once can leave
    this filter installed after both return, or undo a filter that another
    thread set in the meantime."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)
        yield


# What a cuda lowering without a GPU targets: jax 0.10's fallback (compute
# capability 9.0); jax 0.11 maps this kind to 9.0 (pallas/triton/gpu_info.py).
ABSTRACT_GPU = dict(device_kind="NVIDIA H100", num_cores=132, platform="gpu")


def _needs_abstract_gpu() -> bool:
    """No GPU for a Pallas GPU lowering to read: neither the abstract mesh's
    device (a mesh of CPU devices names a CPU one) nor the default backend is a
    GPU (jax's own order of lookups)."""
    if not hasattr(jax.sharding, "AbstractDevice"):  # a jax without abstract devices
        return False
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is not None and device.platform in ("gpu", *_BACKEND_PLATFORMS["gpu"]):
        return False
    return jax.default_backend() != "gpu"


@contextlib.contextmanager
def gpu_target() -> Iterator[None]:
    """While rf lowers its own GPU kernels: the abstract mesh names an abstract
    GPU (:data:`ABSTRACT_GPU`) when the process has none (see the module doc).
    The mesh has no axes: a kernel's program uses none, and the current mesh
    with another device would fail jax's check that an array's mesh is the
    context's inside ``shard_map``. jax 0.10 never reads the device (the
    lowered module is the same with or without it)."""
    if not _needs_abstract_gpu():
        yield
        return
    device = jax.sharding.AbstractDevice(**ABSTRACT_GPU)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        yield


def native_or_interpret(
    native: Callable[..., Sequence[jax.Array]],
    interpret: Callable[..., Sequence[jax.Array]],
    platforms: tuple[str, ...],
    out_avals: tuple[jax.ShapeDtypeStruct, ...],
    *args: jax.Array,
) -> list[jax.Array]:
    """``native(*args)`` when lowered for one of ``platforms``, else
    ``interpret(*args)``; both return arrays shaped like ``out_avals``."""
    avals = tuple(jax.ShapeDtypeStruct(tuple(a.shape), jnp.dtype(a.dtype)) for a in out_avals)
    return native_or_interpret_p.bind(*args, native=native, interpret=interpret, platforms=platforms, out_avals=avals)


def _abstract_eval(*args, native, interpret, platforms, out_avals):
    del args, native, interpret, platforms
    return [jax.core.ShapedArray(a.shape, a.dtype) for a in out_avals]


def _impl(*args, native, interpret, platforms, out_avals):
    del out_avals
    here = _BACKEND_PLATFORMS.get(jax.default_backend(), ())
    fn = native if any(p in platforms for p in here) else interpret
    with own_kernels():
        return list(jax.jit(fn)(*args))


def _lowering(platform: str):
    def rule(ctx, *args, native, interpret, platforms, out_avals):
        del out_avals
        fn = native if platform in platforms else interpret
        target = gpu_target() if fn is native and platform in _BACKEND_PLATFORMS["gpu"] else contextlib.nullcontext()
        with own_kernels(), target:
            return mlir.lower_fun(lambda *xs: list(fn(*xs)), multiple_results=True)(ctx, *args)

    return rule


def _vmapped(fn: Callable, in_axes: tuple[int | None, ...]) -> Callable:
    return jax.vmap(lambda *xs: tuple(fn(*xs)), in_axes=in_axes)


def _batch(args, dims, *, native, interpret, platforms, out_avals):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    in_axes = tuple(None if d is None else 0 for d in dims)
    args = tuple(a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims))
    avals = tuple(jax.ShapeDtypeStruct((size, *a.shape), a.dtype) for a in out_avals)
    outs = native_or_interpret(_vmapped(native, in_axes), _vmapped(interpret, in_axes), platforms, avals, *args)
    return outs, [0] * len(outs)


native_or_interpret_p.def_abstract_eval(_abstract_eval)
native_or_interpret_p.def_impl(_impl)
batching.primitive_batchers[native_or_interpret_p] = _batch
for _platform in PLATFORMS:
    mlir.register_lowering(native_or_interpret_p, _lowering(_platform), platform=_platform)


def as_tuple(fn: Callable[..., Any]) -> Callable[..., tuple[jax.Array, ...]]:
    """``fn`` returning a tuple of arrays even when it returns one array."""

    @functools.wraps(fn)
    def wrapped(*args: Any) -> tuple[jax.Array, ...]:
        out = fn(*args)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    return wrapped
