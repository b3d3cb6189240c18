"""Block shapes for every Pallas kernel, chosen in one place.

Why one module: interpret mode (the only mode CPU tests can run) does not
enforce any backend's tiling rules, so a bad block shape would only show up on
real hardware. Keeping every choice here lets ``tests/kernels/test_blocks.py``
check them for a range of sizes without a GPU or TPU.

The rules, per target:

* ``"gpu"`` (Pallas on Triton): every tile a kernel loads or stores has a
  power-of-two number of elements, and matrix-product operands are at least
  16 x 16. Rows are reduced in column *chunks* of at most ``GPU_MAX_CHUNK``
  inside the kernel (a loop), so one block may span a whole (padded) row even
  for a large vocabulary; Triton only ever materialises the chunk.
* ``"tpu"`` (Pallas on Mosaic TPU): the last two dimensions of every block are
  divisible by 8 and 128, or equal to the (padded) array's dimensions. Every
  block is copied into VMEM (double-buffered), so no block may grow with the
  problem: a row of up to ``TPU_MAX_ROW`` columns is one block; wider rows,
  long K, long sequences and many lookups are split into blocks visited as
  sequential ("arbitrary") grid steps. Kernels never slice the lane (last)
  dimension with a dynamic offset on TPU.

All block dimensions are powers of two or equal to the full padded array
dimension; arrays are padded on the host to a multiple of their block and
sliced afterwards, and kernels mask the padded columns where it matters.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

GPU = "gpu"
TPU = "tpu"
TARGETS = (GPU, TPU)

SUBLANE = 8
LANE = 128
MIN_DOT = 16  # Triton's tl.dot needs every operand dimension >= 16
GPU_MAX_CHUNK = 1024  # widest column chunk a GPU row kernel loads at once
GPU_ROW_TILE = 8192  # elements per (rows x chunk) tile on GPU (registers)
TPU_ROW_TILE_BYTES = 1 << 19  # bytes per (rows x chunk) f32 tile on TPU (VMEM)
TPU_MAX_ROW = 32768  # widest row a TPU row kernel holds in one block (8 rows: 1 MiB in f32)
TPU_ROW_CHUNK = 8192  # column chunk of wider TPU rows (grid steps)
MAX_BLOCK_ROWS = 256
TPU_MAX_K_BLOCK = 512  # widest K step of a TPU matrix product
TPU_MAX_LANES = 2048  # widest spatial chunk of a TPU batch-norm tile


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def prev_pow2(n: int) -> int:
    """The largest power of two <= ``n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (int(n).bit_length() - 1)


def round_up(n: int, m: int) -> int:
    return -(-int(n) // m) * m


def is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def _check_target(target: str) -> str:
    if target not in TARGETS:
        raise ValueError(f"unknown kernel target {target!r}; expected one of {TARGETS}")
    return target


def _clamp_pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, prev_pow2(n)))


@dataclasses.dataclass(frozen=True)
class RowBlocks:
    """A row-wise kernel over ``[rows, cols]``: ``block_rows`` rows per program,
    the (padded) row read in ``n_chunks`` chunks of ``chunk`` columns: a loop
    inside the program, or, with ``on_grid`` (TPU rows wider than
    ``TPU_MAX_ROW``), grid steps that copy one chunk each into VMEM."""

    block_rows: int
    chunk: int
    n_chunks: int
    rows_pad: int
    cols_pad: int
    num_warps: int
    on_grid: bool = False


def row_blocks(rows: int, cols: int, target: str) -> RowBlocks:
    """Blocks for softmax, layer norm and cross-entropy (reductions over the last axis)."""
    _check_target(target)
    rows, cols = max(int(rows), 1), max(int(cols), 1)
    if target == GPU:
        chunk = min(next_pow2(max(cols, MIN_DOT)), GPU_MAX_CHUNK)
        cols_pad = round_up(cols, chunk)
        block_rows = _clamp_pow2(GPU_ROW_TILE // chunk, SUBLANE, MAX_BLOCK_ROWS)
    else:
        cols_pad = round_up(cols, LANE)
        if cols_pad > TPU_MAX_ROW:  # several chunks, visited as grid steps
            cols_pad = round_up(cols, TPU_ROW_CHUNK)
        chunk = min(cols_pad, TPU_ROW_CHUNK) if cols_pad > TPU_MAX_ROW else cols_pad
        block_rows = _clamp_pow2(TPU_ROW_TILE_BYTES // (4 * chunk), SUBLANE, MAX_BLOCK_ROWS)
    block_rows = max(SUBLANE, min(block_rows, next_pow2(rows)))
    num_warps = 4 if block_rows * chunk <= 4096 else 8
    n_chunks = cols_pad // chunk
    return RowBlocks(
        block_rows, chunk, n_chunks, round_up(rows, block_rows), cols_pad, num_warps, target == TPU and n_chunks > 1
    )


@dataclasses.dataclass(frozen=True)
class ChannelBlocks:
    """Batch norm over ``[B, C, HW]``: tiles of ``block_channels`` channels by
    ``chunk`` spatial positions; the statistics kernels also take
    ``batch_block`` samples per program (a divisor of ``B``, so no sample is
    padding)."""

    block_channels: int
    batch_block: int
    chunk: int
    n_chunks: int
    channels_pad: int
    hw_pad: int
    num_warps: int


def channel_blocks(batch: int, channels: int, hw: int, target: str) -> ChannelBlocks:
    """Blocks for batch norm: per-channel statistics over the batch and spatial axes."""
    _check_target(target)
    batch, channels, hw = max(int(batch), 1), max(int(channels), 1), max(int(hw), 1)
    block_channels = SUBLANE
    batch_block = next(b for b in (4, 2, 1) if batch % b == 0)
    if target == GPU:
        chunk = min(next_pow2(max(hw, MIN_DOT)), GPU_MAX_CHUNK)
    else:
        chunk = min(round_up(hw, LANE), TPU_MAX_LANES)
    hw_pad = round_up(hw, chunk)
    num_warps = 4 if block_channels * chunk <= 4096 else 8
    return ChannelBlocks(
        block_channels, batch_block, chunk, hw_pad // chunk, round_up(channels, block_channels), hw_pad, num_warps
    )


@dataclasses.dataclass(frozen=True)
class MatmulBlocks:
    """``[M, K] @ [K, N]`` tiled ``bm x bn`` per program, K reduced in ``n_k``
    steps of ``bk`` into a float32 accumulator: a loop in the kernel (GPU) or
    sequential grid steps (TPU, at most ``TPU_MAX_K_BLOCK`` of K per step)."""

    bm: int
    bk: int
    bn: int
    n_k: int
    m_pad: int
    k_pad: int
    n_pad: int
    num_warps: int
    num_stages: int


def _lane_block(n: int, cap: int) -> tuple[int, int]:
    """TPU block along a lane axis: the whole (padded) axis when small, else ``cap``."""
    if n <= LANE:
        full = next_pow2(max(n, SUBLANE))
        return full, full
    return cap, round_up(n, cap)


def matmul_blocks(m: int, k: int, n: int, target: str, itemsize: int = 4) -> MatmulBlocks:
    """Blocks for the tiled matrix product of ``itemsize``-byte operands.

    GPU, from an H200 run (jax 0.11.2, ``benchmarks/gpu_matmul_blocks.py``,
    RESULTS.md 2026-12-04): 16-bit operands take ``128 x 128`` tiles, 8 warps, 3
    stages (1.02-1.14x XLA's time); float32 ones (TF32) ``128 x 64``, 4 warps, 4
    stages, which beat those tiles at every shape measured (256x784x512: 0.10 ms
    against 0.38; 4096^3: 2.1 against 2.4) though still 1.4-2.4x XLA's."""
    _check_target(target)
    m, k, n = max(int(m), 1), max(int(k), 1), max(int(n), 1)
    if target == GPU:
        wide = itemsize < 4
        bm = min(128, next_pow2(max(m, MIN_DOT)))
        bn = min(128 if wide else 64, next_pow2(max(n, MIN_DOT)))
        bk = min(64, next_pow2(max(k, MIN_DOT)))
        num_warps = 8 if wide and bm * bn >= 128 * 128 else 4
        stages = 3 if wide else 4  # shared memory: 3 x 32 KiB (16-bit) or 4 x 48 KiB (float32) per program
        return MatmulBlocks(
            bm, bk, bn, round_up(k, bk) // bk, round_up(m, bm), round_up(k, bk), round_up(n, bn), num_warps, stages
        )
    bm = min(256, next_pow2(max(m, SUBLANE)))
    bn, n_pad = _lane_block(n, 256)
    if k <= TPU_MAX_K_BLOCK:  # one step: the whole (padded) K
        bk, k_pad = _lane_block(k, round_up(k, LANE))
    else:  # K on the grid in steps of 512 or 256, whichever pads less
        bk = min((TPU_MAX_K_BLOCK, TPU_MAX_K_BLOCK // 2), key=lambda c: (round_up(k, c), -c))
        k_pad = round_up(k, bk)
    return MatmulBlocks(bm, bk, bn, k_pad // bk, round_up(m, bm), k_pad, n_pad, 4, 1)


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
    """Flash attention: ``bq`` query rows per program, keys visited in blocks
    of ``bk`` (a loop on GPU, grid steps on TPU); head dims padded to
    ``d_pad`` / ``dv_pad``."""

    bq: int
    bk: int
    sq_pad: int
    sk_pad: int
    d_pad: int
    dv_pad: int
    num_warps: int
    num_stages: int


def _head_dim(d: int, target: str) -> int:
    if target == GPU:
        return next_pow2(max(d, MIN_DOT))
    return next_pow2(max(d, SUBLANE)) if d <= LANE else round_up(d, LANE)


def attention_blocks(sq: int, sk: int, d: int, dv: int, target: str) -> AttentionBlocks:
    """Blocks for the flash-attention forward and backward kernels."""
    _check_target(target)
    sq, sk = max(int(sq), 1), max(int(sk), 1)
    d_pad, dv_pad = _head_dim(d, target), _head_dim(dv, target)
    if target == GPU:
        cap = 64 if max(d_pad, dv_pad) >= 128 else 128
        bq = min(cap, next_pow2(max(sq, MIN_DOT)))
        bk = min(64, next_pow2(max(sk, MIN_DOT)))
        num_warps = 4 if max(d_pad, dv_pad) <= 64 else 8
        return AttentionBlocks(bq, bk, round_up(sq, bq), round_up(sk, bk), d_pad, dv_pad, num_warps, 2)
    bq = min(128, next_pow2(max(sq, SUBLANE)))
    bk = min(128, next_pow2(max(sk, SUBLANE)))
    return AttentionBlocks(bq, bk, round_up(sq, bq), round_up(sk, bk), d_pad, dv_pad, 4, 1)


@dataclasses.dataclass(frozen=True)
class EmbeddingBlocks:
    """Embedding backward: a ``bv x bd`` tile of the table per program (GPU) or
    per run of grid steps (TPU); the sorted lookups are visited in chunks of
    ``bn``, one chunk on chip at a time."""

    bv: int
    bd: int
    bn: int
    n_chunks: int
    n_pad: int
    v_pad: int
    d_pad: int
    num_warps: int


def embedding_blocks(n: int, vocab: int, d: int, target: str) -> EmbeddingBlocks:
    """Blocks for the scatter-add (one-hot matmul over sorted lookups)."""
    _check_target(target)
    n, vocab, d = max(int(n), 1), max(int(vocab), 1), max(int(d), 1)
    if target == GPU:
        bv = min(64, next_pow2(max(vocab, MIN_DOT)))
        bd = min(128, next_pow2(max(d, MIN_DOT)))
        d_pad = round_up(d, bd)
    else:
        bv = min(128, next_pow2(max(vocab, SUBLANE)))
        bd, d_pad = _lane_block(d, 256)
    bn = min(64, next_pow2(max(n, MIN_DOT)))
    n_pad = round_up(n, bn)
    return EmbeddingBlocks(bv, bd, bn, n_pad // bn, n_pad, round_up(vocab, bv), d_pad, 4)


# ---------------------------------------------------------------- footprints
# What one program holds on chip, from its blocks: tests/kernels/test_blocks.py
# computes it for every kernel from the blocks and tiles of its traced
# pallas_call, checks it against these limits at realistic sizes, and checks
# that it does not grow with the problem.

TPU_VMEM_LIMIT = 16 << 20  # default scoped VMEM of a TPU kernel (v5e; v6e allows 32 MiB)
TPU_LIVE_TILES = 4  # in-kernel float32 values live in VMEM too: this many of the largest block
GPU_SHARED_MEMORY = 227 << 10  # shared memory one H100/H200 thread block may use
GPU_REGISTER_FILE = 256 << 10  # registers of one SM (64K x 32 bit)
GPU_DEFAULT_STAGES = 3  # Triton's software-pipelining depth when a kernel names none


def tpu_buffer_bytes(shape: Sequence[int], itemsize: int) -> int:
    """VMEM bytes of one buffer: the last two dimensions padded to the TPU tile
    (8 sublanes x 128 lanes of 32 bits; 16-bit types pack 16 sublanes)."""
    dims = [1, 1, *(int(d) for d in shape)]
    sublanes = SUBLANE * max(1, 4 // itemsize)
    return math.prod(dims[:-2]) * round_up(dims[-2], sublanes) * round_up(dims[-1], LANE) * itemsize


def tpu_vmem_bytes(
    blocks: Iterable[tuple[Sequence[int], int]], scratch: Iterable[tuple[Sequence[int], int]] = ()
) -> int:
    """Per-program VMEM of a TPU ``pallas_call``: every input and output block
    (``(shape, itemsize)``) double-buffered by the pipeline, the scratch, and
    ``TPU_LIVE_TILES`` float32 copies of the largest block for in-kernel values."""
    blocks = list(blocks)
    pipeline = 2 * sum(tpu_buffer_bytes(shape, size) for shape, size in blocks)
    largest = max((tpu_buffer_bytes(shape, 4) for shape, _ in blocks), default=0)
    return pipeline + sum(tpu_buffer_bytes(shape, size) for shape, size in scratch) + TPU_LIVE_TILES * largest


def gpu_onchip_bytes(tiles: Iterable[tuple[int, bool]], num_stages: int | None) -> tuple[int, int]:
    """``(shared memory, registers)`` of a Triton program, from the largest tile
    it loads or stores per operand (``(bytes, loaded in a loop)``): Triton's
    pipeline keeps ``num_stages`` copies of each tile a loop loads in shared
    memory; every tile, and the accumulators shaped like them, sit in registers."""
    tiles = list(tiles)
    stages = num_stages or GPU_DEFAULT_STAGES
    return stages * sum(b for b, in_loop in tiles if in_loop), sum(b for b, _ in tiles)
