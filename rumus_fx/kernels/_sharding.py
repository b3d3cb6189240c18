"""Multi-device execution of the Pallas kernels.

A ``pallas_call`` is opaque to XLA's SPMD partitioner, and with explicitly
sharded arrays (``jax.make_mesh`` axes default to ``Explicit``) it does not even
trace: its block specs see a sharded global shape. So every kernel entry point
runs through :func:`sharded_call` with an einsum-like *rule* naming the factor
of each array dimension (``"... d, d, d -> ... d, ..., ..."`` for layer norm)
and the factors the kernel needs whole (``replicated``: the reduced axis).
Factors that are sharded on an input and missing from an output are reduced
with ``psum`` (the weight gradients of layer norm, the embedding table).

* One device: the kernel is called directly (nothing to partition).
* Explicitly sharded inputs: ``jax.shard_map`` over the inputs' mesh, with
  the inputs resharded so the ``replicated`` factors are whole.
* Otherwise (``jit`` with ``Auto`` mesh axes, ``NamedSharding`` inputs):
  ``custom_partitioning`` with a Shardy sharding rule, so the partitioner keeps
  batch-like dimensions sharded and runs the kernel per shard.
  ``custom_partitioning`` has no batching rule, so it is wrapped in
  ``custom_vmap``: under ``vmap`` the batch becomes one more shardable factor of
  a vmapped kernel (Pallas batches ``pallas_call`` by itself).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable
from typing import Any

import jax
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

Factors = tuple[tuple[str, ...], ...]


def _parse(rule: str, arrays: tuple[Any, ...]) -> tuple[Factors, Factors]:
    """Expand ``...`` into ``b0 b1 ...`` using the rank of the first operand that has it."""
    lhs, rhs = rule.split("->")
    ops = [s.split() for s in lhs.split(",")]
    res = [s.split() for s in rhs.split(",")]
    if len(ops) != len(arrays):
        raise ValueError(f"sharding rule {rule!r} names {len(ops)} operands, got {len(arrays)}")
    n_batch = 0
    for fs, a in zip(ops, arrays):
        if "..." in fs:
            n_batch = a.ndim - (len(fs) - 1)
            break
    batch = [f"b{i}" for i in range(n_batch)]

    def expand(fs: list[str]) -> tuple[str, ...]:
        out: list[str] = []
        for f in fs:
            out.extend(batch if f == "..." else [f])
        return tuple(out)

    return tuple(map(expand, ops)), tuple(map(expand, res))


def _names(axis: Any) -> tuple[str, ...]:
    return tuple(axis) if isinstance(axis, tuple) else (axis,)


def _factor_axes(specs: list[tuple[Any, ...] | None], operands: Factors, replicated: frozenset[str]) -> dict[str, Any]:
    """Mesh axes per factor, taken from the first operand sharding it; a mesh
    axis is used by at most one factor."""
    axes: dict[str, Any] = {}
    used: set[str] = set()
    for spec, factors in zip(specs, operands):
        if spec is None:
            continue
        for f, s in zip(factors, spec):
            if s is None or f in replicated or f in axes or used & set(_names(s)):
                continue
            axes[f] = s
            used |= set(_names(s))
    return axes


def _plan(specs, operands: Factors, results: Factors, replicated: frozenset[str]):
    axes = _factor_axes(specs, operands, replicated)
    in_specs = tuple(P(*(axes.get(f) for f in fs)) for fs in operands)
    out_specs = tuple(P(*(axes.get(f) for f in fs)) for fs in results)
    psums = tuple(tuple(n for f, s in axes.items() if f not in fs for n in _names(s)) for fs in results)
    return in_specs, out_specs, psums


def _local(impl: Callable[..., tuple], cfg: Any, psums: tuple[tuple[str, ...], ...], *xs: Any) -> tuple:
    """The kernel on local shards, then the cross-shard sums its outputs need."""
    outs = impl(cfg, *xs)
    return tuple(lax.psum(o, p) if p else o for o, p in zip(outs, psums))


def _explicit_spec(a: Any) -> tuple[Any, ...] | None:
    sharding = getattr(jax.typeof(a), "sharding", None)
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if spec is None or mesh is None or getattr(mesh, "empty", True):
        return None
    spec = tuple(spec) + (None,) * (a.ndim - len(spec))
    return spec if any(s is not None for s in spec) else None


def _same(a: Any, spec: P) -> bool:
    have = _explicit_spec(a) or (None,) * a.ndim
    return have == tuple(spec) + (None,) * (a.ndim - len(spec))


def _named_spec(sharding: Any, ndim: int) -> tuple[Any, ...] | None:
    if not isinstance(sharding, NamedSharding):
        return None
    return tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))


def _shard_map_call(impl, cfg, operands: Factors, results: Factors, replicated, *arrays: Any) -> tuple:
    """``impl`` under ``shard_map`` over the inputs' (explicit) mesh."""
    specs = [_explicit_spec(a) for a in arrays]
    mesh = next(jax.typeof(a).sharding.mesh for a, s in zip(arrays, specs) if s is not None)
    in_specs, out_specs, psums = _plan(specs, operands, results, replicated)
    # NamedSharding on the inputs' (abstract) mesh: a bare PartitionSpec would need jax.set_mesh
    arrays = tuple(
        a if _same(a, s) else jax.sharding.reshard(a, NamedSharding(mesh, s)) for a, s in zip(arrays, in_specs)
    )
    body = functools.partial(_local, impl, cfg, psums)
    outs = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*arrays)
    # a factor the kernel needed whole goes back to the inputs' sharding on the way
    # out (a local slice), so results and gradients keep their operands' shardings
    natural = _factor_axes(specs, operands, frozenset())
    want = tuple(P(*(natural.get(f) for f in fs)) for fs in results)
    return tuple(
        o if w == s else jax.sharding.reshard(o, NamedSharding(mesh, w)) for o, s, w in zip(outs, out_specs, want)
    )


@dataclasses.dataclass(frozen=True)
class _Vmapped:
    """``impl`` vmapped over the leading axis of the batched operands (hashable,
    so the partitioned wrapper below is built once per configuration)."""

    impl: Callable[..., tuple]
    in_batched: tuple[bool, ...]

    def __call__(self, cfg: Any, *xs: Any) -> tuple:
        in_axes = tuple(0 if b else None for b in self.in_batched)
        return jax.vmap(functools.partial(self.impl, cfg), in_axes=in_axes)(*xs)


def _custom_partitioning(impl, cfg, operands: Factors, results: Factors, replicated: frozenset[str]):
    """``impl`` as a ``custom_partitioning`` op with a Shardy rule; the
    partitioner keeps shardable factors sharded and runs ``impl`` per shard."""

    def body(*xs):
        return impl(cfg, *xs)

    kernel = custom_partitioning(body)

    def partition(mesh, arg_shapes, result_shape):
        specs = [_named_spec(a.sharding, len(a.shape)) for a in arg_shapes]
        in_specs, out_specs, psums = _plan(specs, operands, results, replicated)
        arg_shardings = tuple(NamedSharding(mesh, s) for s in in_specs)
        out_shardings = tuple(NamedSharding(mesh, s) for s in out_specs)
        if not isinstance(result_shape, (tuple, list)):
            out_shardings = out_shardings[0]
        return mesh, functools.partial(_local, impl, cfg, psums), out_shardings, arg_shardings

    rule = ", ".join(" ".join(fs) for fs in operands) + " -> " + ", ".join(" ".join(fs) for fs in results)
    order = list(dict.fromkeys(f for fs in operands + results for f in fs))  # Shardy wants rule order
    kernel.def_partition(
        partition=partition,
        sharding_rule=rule,
        need_replication_factors=tuple(f for f in order if f in replicated),
    )
    return lambda *xs: tuple(kernel(*xs))


@functools.cache
def _wrapped(impl, cfg, operands: Factors, results: Factors, replicated: frozenset[str], explicit: bool):
    """The sharded kernel (``shard_map`` for explicit shardings, else
    ``custom_partitioning``) under a ``custom_vmap`` whose rule makes the vmapped
    axis one more shardable factor (neither wrapper batches well by itself:
    ``custom_partitioning`` has no batching rule, and a vmapped ``shard_map``
    leaves an explicitly sharded batch axis non-manual inside the kernel)."""
    if explicit:
        inner = functools.partial(_shard_map_call, impl, cfg, operands, results, replicated)
    else:
        inner = _custom_partitioning(impl, cfg, operands, results, replicated)

    @custom_vmap
    def call(*xs):
        return inner(*xs)

    @call.def_vmap
    def _batched(axis_size, in_batched, *xs):
        del axis_size
        flags = tuple(bool(b) for b in in_batched)
        present = {f for fs in operands + results for f in fs}
        tag = next(f"v{i}" for i in itertools.count() if f"v{i}" not in present)
        new_ops = tuple(((tag,) + fs) if b else fs for fs, b in zip(operands, flags))
        new_res = tuple((tag,) + fs for fs in results)
        out = _dispatch(_Vmapped(impl, flags), cfg, new_ops, new_res, replicated, tuple(xs))
        return out, (True,) * len(out)

    return call


def _dispatch(impl, cfg, operands: Factors, results: Factors, replicated: frozenset[str], arrays: tuple) -> tuple:
    explicit = any(_explicit_spec(a) is not None for a in arrays)
    if not explicit and jax.device_count() == 1:
        return impl(cfg, *arrays)
    return _wrapped(impl, cfg, operands, results, replicated, explicit)(*arrays)


def sharded_call(impl: Callable[..., tuple], cfg: Any, rule: str, *arrays: Any, replicated: str = "") -> tuple:
    """Run ``impl(cfg, *arrays)`` (a kernel returning a tuple of arrays) on
    sharded or unsharded inputs; ``rule`` names each dimension's factor and
    ``replicated`` (space-separated) the factors the kernel must see whole."""
    operands, results = _parse(rule, arrays)
    return _dispatch(impl, cfg, operands, results, frozenset(replicated.split()), tuple(arrays))


def carries(rule: str, wanted: tuple[Any, ...], *arrays: Any, replicated: str = "") -> bool:
    """Whether :func:`sharded_call` with this ``rule`` on these explicitly
    sharded ``arrays`` needs no input resharded (every ``replicated`` factor is
    already whole and no factor is sharded two ways, so nothing is gathered) and
    returns results with the shardings ``wanted`` (one ``NamedSharding`` per
    result, None where any will do). Backward rules use it to run a kernel
    per shard where that gives their gradient's sharding, and XLA's op with
    ``out_sharding`` otherwise."""
    operands, results = _parse(rule, arrays)
    specs = [_explicit_spec(a) for a in arrays]
    in_specs, _, _ = _plan(specs, operands, results, frozenset(replicated.split()))
    if not all(_same(a, s) for a, s in zip(arrays, in_specs)):
        return False
    natural = _factor_axes(specs, operands, frozenset())
    for fs, w in zip(results, wanted):
        if w is None:
            continue
        want = tuple(w.spec) + (None,) * (len(fs) - len(w.spec))
        if tuple(natural.get(f) for f in fs) != want:
            return False
    return True
