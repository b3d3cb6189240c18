"""Plumbing shared by the Pallas kernels: the static config every kernel takes,
compiler parameters per target, host-side padding, in-kernel chunk loops and
the two-pass walk of the row kernels.

One kernel body serves GPU (Pallas on Triton) and TPU (Pallas on Mosaic)
wherever the two agree; where they differ, so do the grids:

* GPU: the grid is *parallel* (programs run concurrently, so none may rely on
  another), accumulators live in loop carries, and a reduction over a long
  axis is a loop over chunks inside one program. Blocks are not staged on
  chip: a block spanning the whole axis costs nothing, each iteration loads
  one tile.
* TPU: every block is copied into VMEM, so a long axis is split into blocks
  visited as sequential ("arbitrary") grid steps, with the accumulators in
  VMEM scratch (or in the output block, which stays resident while its index
  does not change). Lane offsets are never dynamic.

``blocks.py`` picks the blocks per target and says what each program holds.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from ..errors import KernelUnavailable
from ._platform import as_tuple, native_or_interpret
from .blocks import GPU, SUBLANE, TARGETS, TPU, RowBlocks

# A finite "minus infinity" for masked scores: exp(MASK - m) is exactly 0 and,
# unlike -inf, MASK - MASK is 0 rather than NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class Config:
    """Static configuration every Pallas entry point takes (hashable, so it can
    be a ``nondiff_argnums`` / jit static argument).

    ``target`` chooses the block shapes and compiler parameters (``"gpu"``:
    Triton, ``"tpu"``: Mosaic); ``interpret`` runs the kernel with Pallas'
    interpreter (any platform, used by the CPU tests)."""

    target: str = GPU
    interpret: bool = False

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"unknown kernel target {self.target!r}; expected one of {TARGETS}")


def triton_compiler_params() -> Any:
    """``jax.experimental.pallas.triton.CompilerParams``, or ``KernelUnavailable``
    (its ``reason`` says why) where this jax has no Pallas Triton backend.

    Pallas' Triton backend: supported by jax 0.10, deprecated from 0.11 (to be
    removed), where Mosaic GPU via ``plgpu.kernel`` is the replacement.
    Importing it lazily keeps CPU-only use free of it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas import triton as pl_triton
        return pl_triton.CompilerParams
    except (ImportError, AttributeError) as err:
        raise KernelUnavailable("triton", f"Pallas' Triton backend is not in jax {jax.__version__} ({err})") from err


def _compiler_params(
    cfg: Config, *, num_warps: int, num_stages: int | None, semantics: tuple[str, ...], name: str = "kernel"
) -> Any:
    if cfg.interpret:
        return None
    if cfg.target == GPU:
        try:
            params = triton_compiler_params()
        except KernelUnavailable as err:
            raise KernelUnavailable(name, err.reason) from err
        return params(num_warps=num_warps, num_stages=num_stages)
    from jax.experimental.pallas import tpu as pl_tpu

    return pl_tpu.CompilerParams(dimension_semantics=semantics)


NATIVE_PLATFORMS = {GPU: ("cuda", "rocm"), TPU: ("tpu",)}


def pallas_call(
    kernel: Callable[..., None],
    cfg: Config,
    *,
    name: str,
    grid: tuple[int, ...],
    in_specs: Sequence[pl.BlockSpec],
    out_specs: Any,
    out_shape: Any,
    num_warps: int = 4,
    num_stages: int | None = None,
    semantics: tuple[str, ...] | None = None,
    scratch_shapes: Sequence[Any] = (),
    num_scalar_prefetch: int = 0,
) -> Callable[..., Any]:
    """``pl.pallas_call`` with the target's compiler parameters filled in.

    TPU only: ``semantics`` names each grid axis ``"parallel"`` (the default)
    or ``"arbitrary"`` (steps run in order, so an output block or a
    ``scratch_shapes`` buffer can accumulate over that axis), and the first
    ``num_scalar_prefetch`` operands are prefetched to scalar memory for the
    index maps (which then take them as trailing arguments). GPU grids are
    always parallel: Triton programs run concurrently.

    A compiled (non-interpret) kernel lowers natively for its target's
    platforms and, on any other platform, as the same kernel in Pallas'
    interpreter (see ``_platform.py``: it lets a program holding GPU and TPU
    kernels be lowered for several platforms at once)."""

    if cfg.target == GPU and (scratch_shapes or num_scalar_prefetch or "arbitrary" in (semantics or ())):
        raise ValueError(f"{name}: GPU kernels take no scratch, scalar prefetch or sequential grid axes")
    semantics = semantics or ("parallel",) * len(grid)
    if num_scalar_prefetch or scratch_shapes:
        from jax.experimental.pallas import tpu as pl_tpu

        grid_kw = dict(
            grid_spec=pl_tpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=num_scalar_prefetch,
                grid=grid,
                in_specs=list(in_specs),
                out_specs=out_specs,
                scratch_shapes=list(scratch_shapes),
            )
        )
    else:
        grid_kw = dict(grid=grid, in_specs=list(in_specs), out_specs=out_specs)

    def build(interpret: bool, params: Any) -> Callable[..., Any]:
        return pl.pallas_call(
            kernel, out_shape=out_shape, interpret=interpret, compiler_params=params, name=name, **grid_kw
        )

    if cfg.interpret:
        return build(True, None)
    native = build(
        False, _compiler_params(cfg, num_warps=num_warps, num_stages=num_stages, semantics=semantics, name=name)
    )
    fallback = build(True, None)
    leaves, tree = jax.tree.flatten(out_shape)

    def call(*args: jax.Array) -> Any:
        outs = native_or_interpret(
            as_tuple(native), as_tuple(fallback), NATIVE_PLATFORMS[cfg.target], tuple(leaves), *args
        )
        return jax.tree.unflatten(tree, outs)

    return call


def vmem(shape: tuple[int, ...], dtype: Any = jnp.float32) -> Any:
    """A TPU VMEM scratch buffer for ``pallas_call(scratch_shapes=...)``."""
    from jax.experimental.pallas import tpu as pl_tpu

    return pl_tpu.VMEM(shape, dtype)


def pad_to(x: jax.Array, shape: Sequence[int], value: Any = 0) -> jax.Array:
    """Pad ``x`` at the end of each axis up to ``shape`` (no copy when equal)."""
    widths = [(0, int(s) - d) for d, s in zip(x.shape, shape)]
    if any(w < 0 for _, w in widths):
        raise ValueError(f"pad_to: cannot pad {x.shape} to the smaller {tuple(shape)}")
    if not any(w for _, w in widths):
        return x
    return jnp.pad(x, widths, constant_values=value)


def unpad(x: jax.Array, shape: Sequence[int]) -> jax.Array:
    """The leading ``shape`` corner of a padded result (no copy when equal)."""
    if tuple(x.shape) == tuple(shape):
        return x
    return x[tuple(slice(0, int(s)) for s in shape)]


def ds(i: Any, size: int) -> Any:
    """The ``i``-th chunk of ``size`` elements along one axis of a ref."""
    if isinstance(i, int):
        return pl.ds(i * size, size)
    return pl.ds(pl.multiple_of(i * size, size), size)


def chunk_loop(n: int, body: Callable[[Any, Any], Any], init: Any) -> Any:
    """``fori_loop(0, n, body, init)``, unrolled when there is one chunk (the
    common case, and the only one on TPU) so the kernel has no loop at all."""
    if n == 1:
        return body(0, init)
    return lax.fori_loop(0, n, body, init)


def iota(shape: tuple[int, ...], dim: int, offset: Any = 0) -> jax.Array:
    """int32 positions along ``dim`` of a tile, shifted by ``offset``."""
    return lax.broadcasted_iota(jnp.int32, shape, dim) + offset


def f32(x: jax.Array) -> jax.Array:
    return x if x.dtype == jnp.float32 else x.astype(jnp.float32)


def dot(a: jax.Array, b: jax.Array, contract: tuple[int, int] = (1, 0)) -> jax.Array:
    """2-D matrix product with a float32 accumulator; ``contract`` names the
    contracted axis of each operand (``(1, 1)`` is ``a @ b.T``, ``(0, 0)`` is
    ``a.T @ b``)."""
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), preferred_element_type=jnp.float32)


def chunk_reader(n_chunks: int, chunk: int) -> Callable[[Any, Any], jax.Array]:
    """``read(ref, i)``: chunk ``i`` of a ``[rows, cols]`` ref as float32.

    With a single chunk every pass of a kernel reads the same tile, so it is
    loaded once and reused (Triton does not merge repeated loads)."""
    cache: dict[int, jax.Array] = {}

    def read(ref: Any, i: Any) -> jax.Array:
        if n_chunks != 1:
            return f32(ref[:, ds(i, chunk)])
        if id(ref) not in cache:
            cache[id(ref)] = f32(ref[:, ds(0, chunk)])
        return cache[id(ref)]

    return read


def first_row(v: jax.Array, rows: int) -> jax.Array:
    """A ``[1, n]`` row placed in row 0 of a ``[rows, n]`` zero tile (partial
    sums are written in sublane-aligned tiles of 8 rows for TPU)."""
    return jnp.where(iota((rows, v.shape[1]), 0) == 0, v, 0.0)


def merge_moments(state: tuple, count: Any, total: jax.Array, centred_sq: jax.Array) -> tuple:
    """Fold one chunk's ``count`` values (their sum and centred sum of squares)
    into running ``(n, mean, m2)`` with Chan et al.'s parallel update, so a
    chunked pass gives the mean and variance in one read of the data."""
    n, mean, m2 = state
    n_new = n + count
    chunk_mean = total / count
    delta = chunk_mean - mean
    mean = mean + delta * (count / n_new)
    m2 = m2 + centred_sq + delta * delta * (n * count / n_new)
    return n_new, mean, m2


@dataclasses.dataclass(frozen=True)
class RowPasses:
    """How a row kernel (softmax, layer norm, cross-entropy) walks the column
    chunks of its block of rows: a statistics pass, then a pass that writes.

    In the program (GPU, and TPU rows of one chunk) the block spans the padded
    row and each pass is a loop over its chunks. On the grid (``on_grid``: TPU
    rows wider than one VMEM block) the block is one chunk, grid axis 1 is the
    pass and axis 2 the chunk, both run in order, and the statistics live in
    VMEM scratch between steps. Outputs written by the second pass keep the
    block of chunk 0 during the first (so it is never written back early)."""

    chunk: int
    n_chunks: int
    on_grid: bool

    @classmethod
    def of(cls, b: RowBlocks) -> RowPasses:
        return cls(b.chunk, b.n_chunks, b.on_grid)

    # ---- in the kernel

    def reader(self) -> Callable[[Any, Any], jax.Array]:
        """``read(ref, i)``: chunk ``i`` of a ``[rows, cols]`` ref as float32."""
        if self.on_grid:
            return lambda ref, i: f32(ref[...])
        return chunk_reader(self.n_chunks, self.chunk)

    def store(self, ref: Any, i: Any, value: jax.Array) -> None:
        """Write chunk ``i`` of a ``[rows, cols]`` output."""
        if self.on_grid:
            ref[...] = value.astype(ref.dtype)
        else:
            ref[:, ds(i, self.chunk)] = value.astype(ref.dtype)

    def run(
        self,
        scratch: Sequence[Any],
        init: Any,
        stats: Callable[[Any, Any], Any],
        write: Callable[[Any, Any], None],
        done: Callable[[Any], None] | None = None,
    ) -> None:
        """``carry = stats(i, carry)`` over the chunks from ``init``, then
        ``done(carry)`` once and ``write(i, carry)`` for each chunk. ``carry``
        is a tuple of ``[rows, 1]`` float32 columns (scalars broadcast);
        ``scratch`` holds one VMEM ref per carry leaf when ``on_grid``."""
        if not self.on_grid:
            carry = chunk_loop(self.n_chunks, stats, init)
            if done is not None:
                done(carry)

            def each(i: Any, token: Any) -> Any:
                write(i, carry)
                return token

            chunk_loop(self.n_chunks, each, 0)
            return
        tree = jax.tree.structure(init)
        p, c = pl.program_id(1), pl.program_id(2)

        def load() -> Any:
            return jax.tree.unflatten(tree, [ref[...] for ref in scratch])

        def save(carry: Any) -> None:
            for ref, v in zip(scratch, jax.tree.leaves(carry)):
                ref[...] = jnp.broadcast_to(v, ref.shape).astype(ref.dtype)

        @pl.when((p == 0) & (c == 0))
        def _():
            save(init)

        @pl.when(p == 0)
        def _():
            save(stats(c, load()))

        @pl.when(p == 1)
        def _():
            carry = load()
            if done is not None:
                pl.when(c == 0)(lambda: done(carry))
            write(c, carry)

    # ---- on the host

    def grid(self, row_blocks: int) -> tuple[int, ...]:
        return (row_blocks, 2, self.n_chunks) if self.on_grid else (row_blocks,)

    def params(self, b: RowBlocks, n_carry: int) -> dict[str, Any]:
        """``pallas_call`` keywords: grid semantics and the carry's scratch."""
        if not self.on_grid:
            return dict(num_warps=b.num_warps)
        return dict(
            semantics=("parallel", "arbitrary", "arbitrary"),
            scratch_shapes=[vmem((b.block_rows, 1)) for _ in range(n_carry)],
        )

    def row_spec(self, b: RowBlocks, *, written: bool = False) -> pl.BlockSpec:
        """A ``[rows_pad, cols_pad]`` operand (``written``: an output of the second pass)."""
        if not self.on_grid:
            return pl.BlockSpec((b.block_rows, b.cols_pad), lambda i: (i, 0))
        if written:
            return pl.BlockSpec((b.block_rows, self.chunk), lambda i, p, c: (i, c * p))
        return pl.BlockSpec((b.block_rows, self.chunk), lambda i, p, c: (i, c))

    def param_spec(self, b: RowBlocks) -> pl.BlockSpec:
        """A ``[1, cols_pad]`` per-column parameter."""
        if not self.on_grid:
            return pl.BlockSpec((1, b.cols_pad), lambda i: (0, 0))
        return pl.BlockSpec((1, self.chunk), lambda i, p, c: (0, c))

    def stat_spec(self, b: RowBlocks) -> pl.BlockSpec:
        """A ``[rows_pad, 1]`` per-row value."""
        return pl.BlockSpec((b.block_rows, 1), lambda i, *_: (i, 0))

    def partial_spec(self, b: RowBlocks) -> pl.BlockSpec:
        """A ``[row blocks * 8, cols_pad]`` output of the *first* pass (per-block
        column sums): it keeps the last chunk's block during the second pass."""
        if not self.on_grid:
            return pl.BlockSpec((SUBLANE, b.cols_pad), lambda i: (i, 0))
        last = self.n_chunks - 1
        return pl.BlockSpec((SUBLANE, self.chunk), lambda i, p, c: (i, c * (1 - p) + last * p))
