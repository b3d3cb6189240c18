"""Kernel dispatch: Pallas on GPU/TPU, the jax.numpy reference on CPU.

Modes: ``"auto"`` (default), ``"reference"``, ``"pallas"``, ``"interpret"``.
Choose one with ``rf.kernels.use(mode)`` or the ``RUMUS_FX_KERNELS`` variable;
``rf.kernels.backend()`` says what the next call in this process will run.

What each mode runs, and what a program exported under it holds
----------------------------------------------------------------
The mode is read when an op is *traced*; lowering (``jax.jit(f).lower``,
``jax.export.export(..., platforms=[...])``) then keeps, per platform, what the
trace staged:

* ``"pallas"`` stages ``jax.lax.platform_dependent(cpu=reference,
  cuda/rocm=Pallas-GPU (Triton), tpu=Pallas-TPU (Mosaic), default=Pallas-GPU)``
  in any process. Lowering keeps only the branch of the platform compiled for,
  so a program exported from a CPU host for ``["cpu", "cuda", "tpu"]`` holds
  the Triton kernels for ``cuda``, the Mosaic kernels for ``tpu`` and the
  reference for ``cpu`` (which is what the CPU runs, eagerly or jitted). A
  CPU-only jaxlib lowers both kernel flavours (``tests/kernels/test_lowering.py``
  does it for every kernel); the Triton custom call needs
  ``jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")`` to be
  exported, being outside ``jax.export``'s list of stable custom calls.
* ``"auto"`` with an accelerator in the process (``jax.default_backend()`` is
  ``gpu`` or ``tpu``) stages the same ``platform_dependent`` (with the
  reference as the default branch), so exports hold the kernels for
  cuda/rocm/tpu and the reference for cpu. In a CPU-only process it calls the
  reference directly, without ``platform_dependent``: staging the Pallas
  branches there is sound (checked by ``tests/kernels/test_dispatch.py``) but
  costs a trace of every kernel on every jitted op for programs that, on that
  host, can only run the reference; a program exported from a CPU-only process
  under ``"auto"`` therefore holds the reference for every platform. Use
  ``"pallas"`` to export kernels from a CPU host.
* ``"reference"``: the reference everywhere, exports included.
* ``"interpret"``: the kernels in Pallas' interpreter (plain XLA ops, so any
  platform runs and exports them); this is how the CPU tests exercise them.

The choice is the dispatch's wherever a kernel can serve (the weight gradient
of ``x @ W`` included), so what a program holds depends on the platform it is
lowered for, never on whether the tracing process has an accelerator (beyond
``auto``'s CPU-only shortcut above).

Kernels that cannot be built
----------------------------
The cuda branch runs the Triton kernel while this jax has Pallas' Triton
backend; its Mosaic GPU variant (``mosaic_gpu.py``: softmax, layer norm,
cross-entropy, batch norm) where Triton is missing, or first with
``RUMUS_FX_GPU_KERNELS=mosaic``, when the variant obeys Mosaic GPU's block
rules and lowers for cuda at the call's shapes (checked once per shape). When
no kernel can be built (``KernelUnavailable``: Triton removed and no Mosaic GPU
variant, a rule broken, a lowering failure), ``auto`` runs the reference in
that branch with one ``KernelFallbackWarning`` per kernel and reason, and
``pallas`` mode raises the ``KernelUnavailable``. A TPU kernel that raises
``KernelUnavailable`` is handled the same way.

A function already jitted keeps the kernels it was traced with (as with any
trace-time Python state), so choose the mode before the first call of a jitted
function, or jit a fresh one. Float64 inputs always take the reference (the
kernels accumulate in float32 and TPUs have no float64); so do empty arrays.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..eager import compiled, has_tracer
from ..errors import KernelFallbackWarning, KernelUnavailable
from . import mosaic_gpu
from ._pallas import Config
from .blocks import GPU, TARGETS, TPU

MODES = ("auto", "reference", "pallas", "interpret")
_MODE: contextvars.ContextVar[str | None] = contextvars.ContextVar("rumus_fx_kernel_mode", default=None)
# Which target's block shapes interpret mode uses ("gpu" by default; tests also run "tpu").
_INTERPRET_TARGET: contextvars.ContextVar[str] = contextvars.ContextVar("rumus_fx_interpret_target", default=GPU)
_KERNEL_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def _check(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown kernel mode {mode!r}; expected one of {MODES}")
    return mode


def mode() -> str:
    """The active kernel mode (context first, then $RUMUS_FX_KERNELS, then auto)."""
    m = _MODE.get()
    if m is None:
        m = os.environ.get("RUMUS_FX_KERNELS", "auto") or "auto"
    return _check(m)


@contextlib.contextmanager
def use(mode: str) -> Iterator[None]:
    """Force a kernel mode inside the block (per thread / asyncio task).

    >>> import rumus_fx as rf
    >>> with rf.kernels.use("reference"):
    ...     rf.kernels.backend()
    'reference'
    """
    token = _MODE.set(_check(mode))
    try:
        yield
    finally:
        _MODE.reset(token)


@contextlib.contextmanager
def interpret_target(target: str) -> Iterator[None]:
    """Interpret mode with another target's block shapes (``"gpu"`` or ``"tpu"``)."""
    if target not in TARGETS:
        raise ValueError(f"unknown kernel target {target!r}; expected one of {TARGETS}")
    token = _INTERPRET_TARGET.set(target)
    try:
        yield
    finally:
        _INTERPRET_TARGET.reset(token)


def _accelerator_present() -> bool:
    return jax.default_backend() in ("gpu", "tpu")


def backend() -> str:
    """What the next kernel call in this process will run: ``"pallas"`` or
    ``"reference"``. ``"pallas"`` mode runs the reference on a CPU (its
    programs hold the kernels for GPU/TPU exports)."""
    m = mode()
    if m == "interpret":
        return "pallas"
    if m == "reference":
        return "reference"
    return "pallas" if _accelerator_present() else "reference"


def _kernel_ok(args: tuple[Any, ...]) -> bool:
    """True when every floating array argument has a dtype the kernels support
    and no array is empty (an empty grid has nothing to run)."""
    for leaf in jax.tree.leaves(args):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:
            continue
        if getattr(leaf, "size", 1) == 0:
            return False
        if jnp.issubdtype(dtype, jnp.inexact) and dtype not in _KERNEL_FLOATS:
            return False
    return True


def run_reference(reference: Callable[..., Any], args: tuple[Any, ...], static: dict[str, Any]) -> Any:
    """``reference(*args, **static)``. Called eagerly (no tracer among the
    arguments) it runs as one cached compiled call (Note [Eager compilation] in
    rumus_fx/eager.py), so a reference of many primitives costs one dispatch and
    its elementwise work is fused; under a trace it is traced inline."""
    if has_tracer(args):
        return reference(*args, **static)
    return compiled(reference, static_argnames=tuple(sorted(static)))(*args, **static)


# (kernel, reason) pairs already warned about: ``auto`` warns once for each.
_WARNED: set[tuple[str, str]] = set()
# pallas entry point -> its Mosaic GPU variant (``mosaic_gpu.py`` registers them)
MOSAIC_GPU: dict[Callable[..., Any], Callable[..., Any]] = {}


def kernel_name(pallas: Callable[..., Any]) -> str:
    name = getattr(pallas, "__name__", repr(pallas))
    return name.removesuffix("_pallas")


def _fallback(name: str, err: KernelUnavailable, m: str, reference: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """``auto``: warn once per kernel and reason, then run the reference;
    ``pallas``: raise (the user asked for the kernel)."""
    if m == "pallas":
        raise err
    name = err.kernel if err.kernel != "kernel" else name
    key = (name, err.reason)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(
            f"rumus_fx kernel {name!r} is unavailable ({err.reason}); using the jax.numpy reference instead",
            KernelFallbackWarning,
            stacklevel=4,
        )
    return reference(*args)


def _gpu_branch(name: str, pallas: Callable[..., Any], reference: Callable[..., Any], m: str, static: dict) -> Callable:
    """The cuda/rocm branch: the Triton kernel; where this jax cannot build it
    (or with ``RUMUS_FX_GPU_KERNELS=mosaic``, first) the Mosaic GPU variant
    where there is one and it lowers at these shapes (``mosaic_gpu.py``);
    else (``auto``) the reference with one warning, or (``pallas``) the error."""
    triton = functools.partial(pallas, cfg=Config(GPU, False), **static)
    mosaic = MOSAIC_GPU.get(pallas)

    def try_mosaic(xs: tuple[Any, ...]) -> tuple[bool, Any, str]:
        if mosaic is None:
            return False, None, "no Mosaic GPU variant"
        reason = mosaic_gpu.why_not(mosaic, xs, static)
        if reason is not None:
            return False, None, f"Mosaic GPU variant: {reason}"
        return True, mosaic(*xs, **static), ""

    def branch(*xs: Any) -> Any:
        if mosaic is not None and mosaic_gpu.preferred():
            done, out, _ = try_mosaic(xs)
            if done:
                return out
        try:
            return triton(*xs)
        except KernelUnavailable as err:
            done, out, why = try_mosaic(xs)
            if done:
                return out
            err = KernelUnavailable(err.kernel, f"{err.reason}; {why}")
            return _fallback(name, err, m, reference, xs)

    return branch


def _guarded(name: str, kernel: Callable[..., Any], reference: Callable[..., Any], m: str) -> Callable:
    def branch(*xs: Any) -> Any:
        try:
            return kernel(*xs)
        except KernelUnavailable as err:
            return _fallback(name, err, m, reference, xs)

    return branch


def call(reference: Callable[..., Any], pallas: Callable[..., Any] | None, *args: Any, **static: Any) -> Any:
    """Run ``reference(*args, **static)`` or ``pallas(*args, cfg=Config(...), **static)``
    according to the mode (see the module docstring).

    A kernel that cannot be built for the running jax (``KernelUnavailable``,
    e.g. Pallas' Triton backend missing) makes ``auto`` run the reference in
    that platform's branch, with one ``KernelFallbackWarning`` naming the
    kernel and the reason; ``pallas`` mode raises the error."""
    m = mode()
    if pallas is None or m == "reference" or not _kernel_ok(args):
        return run_reference(reference, args, static)
    if m == "interpret":
        return pallas(*args, cfg=Config(_INTERPRET_TARGET.get(), True), **static)
    if m == "auto" and not _accelerator_present():
        return run_reference(reference, args, static)
    if not has_tracer(args):
        # eagerly, the choice of platform is one cached compiled call too (Note
        # [Eager compilation]): a bare lax.platform_dependent would bind its
        # platform index on its own and read it back to the host, every call
        fixed = ("reference", "pallas", "m", *sorted(static))
        return compiled(_by_platform, static_argnames=fixed)(*args, reference=reference, pallas=pallas, m=m, **static)
    return _by_platform(*args, reference=reference, pallas=pallas, m=m, **static)


def _by_platform(*args: Any, reference: Callable[..., Any], pallas: Callable[..., Any], m: str, **static: Any) -> Any:
    """The kernel on the platforms it was written for, the reference elsewhere,
    chosen when the program is lowered (SPEC section 6)."""
    name = kernel_name(pallas)
    ref = functools.partial(reference, **static)
    gpu = _gpu_branch(name, pallas, ref, m, static)
    tpu = _guarded(name, functools.partial(pallas, cfg=Config(TPU, False), **static), ref, m)
    # each branch traced once: platform_dependent traces ``default`` apart from the named ones
    if m == "pallas":
        return lax.platform_dependent(*args, cpu=ref, tpu=tpu, default=gpu)
    return lax.platform_dependent(*args, cuda=gpu, rocm=gpu, tpu=tpu, default=ref)
