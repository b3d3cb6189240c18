"""Walk a traced program for the ``pallas_call`` equations it contains
(through jit, custom_jvp, custom_vmap, custom_partitioning, cond, loops, and
the per-platform wrapper of compiled kernels, whose native kernel is traced)."""

from __future__ import annotations

import math
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


_LOOPS = ("while", "scan")


def _inner_invars(eqn) -> list[tuple[Any, list[Any]]]:
    """(sub-jaxpr, the outer vars its invars stand for) for each sub-jaxpr of a
    kernel equation (loops, conds, calls)."""
    name, p = eqn.primitive.name, eqn.params
    if name == "while":
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        carry = list(eqn.invars[nc + nb :])
        return [
            (p["cond_jaxpr"].jaxpr, list(eqn.invars[:nc]) + carry),
            (p["body_jaxpr"].jaxpr, list(eqn.invars[nc : nc + nb]) + carry),
        ]
    if name == "cond":
        return [(b.jaxpr, list(eqn.invars[1:])) for b in p["branches"]]
    subs = []
    for value in p.values():
        for sub in _sub_jaxprs(value):
            subs.append((sub, list(eqn.invars)))
    return subs


def kernel_tiles(eqn) -> dict[int, tuple[int, bool]]:
    """Per operand of a ``pallas_call`` (its position among the kernel's refs):
    the largest tile its body loads or stores, in bytes, and whether a loop
    loads it."""
    kernel = eqn.params["jaxpr"]
    tiles: dict[int, tuple[int, bool]] = {}

    def walk(jaxpr, env: dict, in_loop: bool) -> None:
        for e in jaxpr.eqns:
            if e.primitive.name in ("get", "swap"):
                ref = env.get(e.invars[0])
                aval = e.outvars[0].aval
                size = math.prod(aval.shape) * aval.dtype.itemsize
                if ref is not None:
                    old_size, old_loop = tiles.get(ref, (0, False))
                    tiles[ref] = (max(old_size, size), old_loop or (in_loop and e.primitive.name == "get"))
            for sub, outer in _inner_invars(e):
                inner_env = {
                    v: env[o] for v, o in zip(sub.invars, outer) if not isinstance(o, core.Literal) and o in env
                }
                walk(sub, inner_env, in_loop or e.primitive.name in _LOOPS)

    walk(kernel, {v: i for i, v in enumerate(kernel.invars)}, False)
    return tiles


def footprint(eqn) -> tuple[str, dict[str, int]]:
    """(target, on-chip bytes) of a compiled ``pallas_call``: TPU ``vmem``
    (blocks double-buffered, scratch, live values), GPU ``shared`` and
    ``registers`` (the tiles its body loads and stores); see blocks.py."""
    from rumus_fx.kernels import blocks

    params = eqn.params["compiler_params"]
    grid = eqn.params["grid_mapping"]
    if "triton" in type(params).__module__:
        shared, registers = blocks.gpu_onchip_bytes(kernel_tiles(eqn).values(), params.num_stages)
        return blocks.GPU, {"shared": shared, "registers": registers}
    block_list = []
    for bm in grid.block_mappings:
        shape = [d.block_size for d in bm.block_shape if getattr(d, "block_size", None) is not None]
        block_list.append((shape, bm.array_aval.dtype.itemsize))
    first_scratch = grid.num_index_operands + len(grid.block_mappings)
    scratch = [(v.aval.shape, v.aval.dtype.itemsize) for v in eqn.params["jaxpr"].invars[first_scratch:]]
    return blocks.TPU, {"vmem": blocks.tpu_vmem_bytes(block_list, scratch)}
