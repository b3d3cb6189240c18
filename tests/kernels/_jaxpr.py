"""Walk a traced program for the ``pallas_call`` equations it contains
(through jit, custom_jvp, custom_vmap, custom_partitioning, cond, loops, and
the per-platform wrapper of compiled kernels, whose native kernel is traced)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
from jax.extend import core


def _sub_jaxprs(value: Any) -> Iterator[core.Jaxpr]:
    if isinstance(value, core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def equations(jaxpr: core.Jaxpr, *, into_kernels: bool = False) -> Iterator[Any]:
    """Every equation of ``jaxpr`` and of the jaxprs nested in its params;
    kernel bodies only with ``into_kernels``."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name == "pallas_call" and not into_kernels:
            continue
        if eqn.primitive.name == "rumus_fx_native_or_interpret":
            native = jax.make_jaxpr(eqn.params["native"])(*(v.aval for v in eqn.invars))
            yield from equations(native.jaxpr, into_kernels=into_kernels)
            continue
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                yield from equations(sub, into_kernels=into_kernels)


def pallas_calls(fun, *args, **kwargs) -> list[Any]:
    """The ``pallas_call`` equations of ``fun(*args, **kwargs)``'s program.

    A fresh wrapper is traced each time: ``make_jaxpr`` caches traces per
    function, and the kernel mode (a context variable) is not in the key."""
    closed = jax.make_jaxpr(lambda *a, **k: fun(*a, **k))(*args, **kwargs)
    return [e for e in equations(closed.jaxpr) if e.primitive.name == "pallas_call"]


def has_pallas(fun, *args, **kwargs) -> bool:
    return bool(pallas_calls(fun, *args, **kwargs))
