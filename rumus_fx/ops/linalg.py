"""Matrix products: matmul ``[..., M, K] @ [K, N]`` and bmm ``[..., M, K] @ [..., K, N]``."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from .. import sharding as shd
from ..autograd.record import Record, VersionSnapshot
from ..errors import ShapeError
from ..kernels import dispatch as kdispatch
from ..kernels import matmul as kmm
from ..kernels.precision import is_low_precision
from ..tensor import Tensor
from ._core import (
    is_tracked,
    new_output,
    reads,
    record,
    require_float,
    shape_of,
    tape_for,
    value_of,
)
from ._declare import BadInput, Sample, integers, normal, op, tracked

Array = jax.Array
frozen = dataclasses.dataclass(frozen=True, eq=False)


def _contract_rows(a: Array, g: Array, out_dtype: Any, out_sharding: Any = None, merge_rows: bool = False) -> Array:
    """``a[..., K]^T g[..., N]`` summed over all leading rows -> ``[K, N]`` (the
    weight gradient of ``x @ W`` for any number of leading axes).

    ``out_sharding`` (the weight's, on Explicit mesh axes): the rows are the
    contraction here, and with data parallelism they are sharded, so the kernel
    (which needs its contraction whole) would all-gather ``a`` and ``g``; XLA's
    dot_general with ``out_sharding`` multiplies each device's rows and sums
    the partial products instead (an all-reduce, or a reduce-scatter into an
    FSDP-sharded weight). Only with whole rows does the kernel run per shard.

    ``merge_rows``: ``a`` was computed inside a traced program (a user's
    jit); see Note [Weight gradient as one 2-D dot]."""
    if out_sharding is not None:
        k, n = a.shape[-1], g.shape[-1]
        a2, g2 = shd.reshape(a, (-1, k)), shd.reshape(g, (-1, n))
        if kmm.kernel_carries(a2.T, g2, out_sharding):
            return kmm.matmul(a2.T, g2, out_dtype=out_dtype)
    # sharded rows, or the jnp reference anyway: one dot_general over the rows,
    # with no explicit transpose (XLA:CPU may copy one out when it feeds a
    # matrix-vector dot, as in a second-order step). It contracts the leading
    # axes as they are (no reshape that merges a sharded axis: XLA's partitioner
    # then keeps the weight gradient sharded like the weight on Auto mesh axes
    # too) unless ``merge_rows`` and no mesh is set (Note [Weight gradient as
    # one 2-D dot]): then they are merged first, a free reshape.
    if out_sharding is not None:
        return _contract_rows_reference(a, g, out_dtype=out_dtype, merge_rows=merge_rows, out_sharding=out_sharding)
    # the choice is the dispatch's, made for the platform lowered for (a program
    # exported from a CPU host for cuda/tpu in pallas mode holds the kernel)
    return kdispatch.call(
        _contract_rows_reference, _contract_rows_pallas, a, g, out_dtype=out_dtype, merge_rows=merge_rows
    )


def _contract_rows_reference(
    a: Array, g: Array, *, out_dtype: Any, merge_rows: bool, out_sharding: Any = None
) -> Array:
    pref = jnp.float32 if is_low_precision(out_dtype) else None
    if merge_rows and out_sharding is None and a.ndim > 2 and off_mesh(a, g):
        a, g = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
    lead = tuple(range(a.ndim - 1))
    dims = ((lead, lead), ((), ()))
    return lax.dot_general(a, g, dims, preferred_element_type=pref, out_sharding=out_sharding).astype(out_dtype)


def _contract_rows_pallas(a: Array, g: Array, *, out_dtype: Any, merge_rows: bool, cfg: Any) -> Array:
    del merge_rows
    k, n = a.shape[-1], g.shape[-1]
    return kmm.matmul_pallas(a.reshape(-1, k).T, g.reshape(-1, n), out_dtype=out_dtype, cfg=cfg)


def off_mesh(*xs: Any) -> bool:
    """No mesh is set and none of ``xs`` is traced on one: Auto mesh axes
    without ``jax.set_mesh`` are seen only in the values' types (Note [Weight
    gradient as one 2-D dot])."""
    return jax.sharding.get_abstract_mesh().empty and not any(shd.on_mesh(x) for x in xs)


# Note [Weight gradient as one 2-D dot]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``dW = x^T g`` for ``x:[B, T, K]``, ``g:[B, T, N]`` contracts two axes of
# each operand. XLA:CPU's dot canonicalisation turns a dot_general over (0, 1)
# into a transpose of ``x`` to ``[K, B*T]`` (a copy) feeding a YNNPACK dot.
# Merged to ``[B*T, K]`` and ``[B*T, N]`` first (a bitcast in row-major
# layout), the dot contracts dimension 0 of both operands, which XLA:CPU's
# Eigen dot reads in place (a transpose flag, no copy). Which is faster
# depends on where ``x`` comes from (the timings: benchmarks/RESULTS.md, "Thresholds in the code"):
#
# * ``x`` a materialised array (eager: a rule's own program, or the whole-tape
#   walk, whose saved arrays are its arguments): the transpose is a plain copy
#   and YNNPACK's dot beats Eigen's, so the merged form is slower.
# * ``x`` computed in the same traced program (a user's jit): XLA fuses its
#   elementwise producer into the transposing copy and recomputes it there, in
#   the copy's strided order (TinyGPT's GELU output, transposed for fc2's
#   weight gradient). The merged form has no copy, and is faster.
# * ``x`` an argument of the traced program (a jitted function's input fed
#   straight to ``x @ W``), or the output of a dot or a layout op (reshape,
#   transpose) in it: a plain transpose again, and merging is slower.
#
# So ``matmul`` notes whether it saved an ``x`` with an elementwise producer in
# the trace (``merge_rows``, from the tracer's producing equation), and only
# then are the rows merged. Under a mesh the leading axes are kept (see
# ``_contract_rows``): a mesh set with ``jax.set_mesh``, or one the operands
# are traced on (Auto axes without ``set_mesh``: there the merged dot made
# XLA's partitioner replicate a transformer block's qkv weight gradient,
# which jax.grad and the unmerged dot leave sharded like the weight).
# ``rf.lift``'s ``dot_general`` rule does the same for a lifted ``x @ W``
# (``lift/rules_structural._weight_gradient_2d``).


@frozen
class _ProductRecord(Record):
    """``C = A @ B``: ``dA = dC @ B^T``, ``dB = A^T @ dC``. Saves B only if A
    needs a gradient, A only if B does. One body for both records: they differ
    in how ``dB`` treats A's leading axes (``batched``). On Explicit mesh axes
    each gradient gets its operand's sharding: the Pallas kernel runs per shard
    where that gives it, XLA's dot with ``out_sharding`` where the product
    contracts a sharded axis (dB under data parallelism; see
    ``kernels.matmul.matmul`` for why)."""

    batched: ClassVar[bool] = False

    lhs: Array | None
    lhs_version: VersionSnapshot | None
    rhs: Array | None
    rhs_version: VersionSnapshot | None
    lhs_dtype: Any
    rhs_dtype: Any
    lhs_sharding: Any = None  # set for operands sharded over Explicit mesh axes
    rhs_sharding: Any = None

    def backward(self, g, needs):
        ga = kmm.matmul(g, jnp.swapaxes(self.rhs, -1, -2), self.lhs_dtype, self.lhs_sharding) if needs[0] else None
        gb = None
        if needs[1] and self.batched:  # per batch
            gb = kmm.matmul(jnp.swapaxes(self.lhs, -1, -2), g, self.rhs_dtype, self.rhs_sharding)
        elif needs[1]:  # A's leading axes are contracted too
            gb = _contract_rows(self.lhs, g, self.rhs_dtype, self.rhs_sharding, self.merge_rows)
        return ga, gb


@frozen
class MatmulBackward(_ProductRecord):
    """``C = A @ B`` for ``A:[..., M, K]``, ``B:[K, N]``: ``dA = dC @ B^T``,
    ``dB = A^T @ dC`` with A's leading axes contracted."""

    merge_rows: bool = False  # A computed inside a trace (Note [Weight gradient as one 2-D dot])


@frozen
class BmmBackward(_ProductRecord):
    """``C = A @ B`` batched: ``dA = dC @ B^T``, ``dB = A^T @ dC`` per batch."""

    batched: ClassVar[bool] = True


def _product_sharding(op: str, av: Array, bv: Array) -> Any:
    """The result's sharding when the contracted axis K is sharded over
    Explicit mesh axes (JAX cannot choose it then: the partial products are
    summed over those axes): lhs's rows/batch axes and rhs's N axis. None
    otherwise (JAX infers it)."""
    sa, sb = shd.spec_of(av), shd.spec_of(bv)
    if (sa is None or sa[-1] is None) and (sb is None or sb[-2] is None):
        return None
    lead = sa[:-1] if sa is not None else (None,) * (av.ndim - 1)
    n = sb[-1] if sb is not None else None
    if op == "bmm" and sb is not None:
        lead = tuple(a if a is not None else b for a, b in zip(lead[:-1], sb[:-2])) + lead[-1:]
    used = {name for e in lead if e is not None for name in (e if isinstance(e, tuple) else (e,))}
    if n is not None and used & set(n if isinstance(n, tuple) else (n,)):
        n = None
    return shd.with_spec(shd.sharding_of(av) or shd.sharding_of(bv), (*lead, n))


# producers whose output XLA:CPU transposes as a plain copy (or folds into the copy's layout)
_PLAIN_PRODUCERS = frozenset(
    {
        "dot_general",
        "reshape",
        "transpose",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "convert_element_type",
        "copy",
    }
)


def computed_in_trace(x: Any) -> bool:
    """Whether ``x`` is a tracer computed inside the current trace by an
    elementwise producer that XLA may fuse into a transposing copy: not a
    concrete array, not one of a jitted function's arguments (whose jaxpr
    tracers have no producing equation, ``parent``), and not the output of a
    dot or a layout op (Note [Weight gradient as one 2-D dot])."""
    if not isinstance(x, jax.core.Tracer):
        return False
    parent = getattr(x, "parent", True)
    if parent is None:
        return False
    return getattr(getattr(parent, "primitive", None), "name", None) not in _PLAIN_PRODUCERS


def _product(op: str, a: Any, b: Any) -> Tensor:
    """``matmul`` (2-D rhs) or ``bmm`` (equal batch axes): validate, multiply,
    record the saved operands each needed gradient reads."""
    av = value_of(a, op, "lhs")
    bv = value_of(b, op, "rhs")
    sa, sb = shape_of(av), shape_of(bv)
    if op == "matmul":
        if len(sa) < 2 or len(sb) != 2 or sa[-1] != sb[0]:
            raise ShapeError(f"matmul: expects [M, K] @ [K, N] (lhs may have leading axes), got {sa} @ {sb}")
    elif len(sa) < 3 or len(sa) != len(sb) or sa[:-2] != sb[:-2] or sa[-1] != sb[-2]:
        raise ShapeError(f"bmm: expects [..., M, K] @ [..., K, N] with equal batch axes (rank >= 3), got {sa} @ {sb}")
    require_float(op, av, "lhs")
    require_float(op, bv, "rhs")
    out_sharding = _product_sharding(op, av, bv)
    out = kmm.matmul(av, bv, None, out_sharding)
    tape = tape_for(a, b)
    if tape is None:
        return Tensor._wrap(out)
    lhs, lhs_v = reads(a, is_tracked(b))
    rhs, rhs_v = reads(b, is_tracked(a))
    saved = (lhs, lhs_v, rhs, rhs_v)
    shardings = (shd.sharding_of(av), shd.sharding_of(bv))
    dtypes = (av.dtype, bv.dtype)
    if op == "matmul":
        rec = MatmulBackward(*saved, *dtypes, *shardings, computed_in_trace(lhs))
    else:
        rec = BmmBackward(*saved, *dtypes, *shardings)
    return record(tape, rec, (a, b), new_output(out, tape))


@op(
    records=(MatmulBackward,),
    ref=jnp.matmul,
    samples=lambda r: [
        Sample((normal(r, 3, 5), normal(r, 5, 7)), diff=(0, 1)),
        Sample((normal(r, 1, 4), normal(r, 4, 1)), diff=(0, 1)),
        Sample((normal(r, 2, 3, 5), normal(r, 5, 6)), diff=(0, 1)),
        Sample((normal(r, 2, 2, 3, 4), normal(r, 4, 3)), diff=(0, 1)),
    ],
    errors=lambda: [
        BadInput("rank-1 lhs", (tracked(3), tracked(3, 4)), ShapeError, ("(3,)",)),
        BadInput("inner sizes differ", (tracked(2, 3), tracked(4, 5)), ShapeError, ("(2, 3)", "(4, 5)")),
        BadInput("rank-3 rhs", (tracked(2, 3), tracked(2, 3, 4)), ShapeError),
        BadInput("integer lhs", (integers(2, 3), tracked(3, 4)), TypeError, ("int32",)),
    ],
)
def matmul(a: Any, b: Any) -> Tensor:
    """``a @ b`` for ``a:[M, K]`` (or ``[..., M, K]``) and ``b:[K, N]`` (records MatmulBackward)."""
    return _product("matmul", a, b)


@op(
    records=(BmmBackward,),
    ref=jnp.matmul,
    samples=lambda r: [
        Sample((normal(r, 3, 4, 5), normal(r, 3, 5, 2)), diff=(0, 1)),
        Sample((normal(r, 2, 3, 4, 5), normal(r, 2, 3, 5, 7)), diff=(0, 1)),
    ],
    errors=lambda: [
        BadInput("rank-2 operands", (tracked(3, 4), tracked(4, 5)), ShapeError, ("(3, 4)",)),
        BadInput("batch sizes differ", (tracked(2, 3, 4), tracked(3, 4, 5)), ShapeError),
        BadInput("inner sizes differ", (tracked(2, 3, 4), tracked(2, 5, 5)), ShapeError),
        BadInput("ranks differ", (tracked(2, 2, 3, 4), tracked(2, 4, 5)), ShapeError),
        BadInput("integer operand", (integers(2, 3, 4), tracked(2, 4, 5)), TypeError),
    ],
)
def bmm(a: Any, b: Any) -> Tensor:
    """Batched ``a @ b``: ``[B, M, K] @ [B, K, N]``; any equal leading batch axes
    (records BmmBackward)."""
    return _product("bmm", a, b)


@op(records=(MatmulBackward, BmmBackward), toplevel=False)  # the @ operator: no table entry of its own
def matmul_or_bmm(a: Any, b: Any) -> Tensor:
    """The ``@`` operator: ``matmul`` when ``b`` is 2-D, ``bmm`` when both have
    the same rank >= 3."""
    na, nb = len(shape_of(a)), len(shape_of(b))
    if nb == 2:
        return matmul(a, b)
    if na == nb and na >= 3:
        return bmm(a, b)
    raise ShapeError(
        f"@: supports [..., M, K] @ [K, N] (matmul) and [..., M, K] @ [..., K, N] (bmm), "
        f"got shapes {shape_of(a)} @ {shape_of(b)}"
    )
