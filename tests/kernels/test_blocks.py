"""Block shapes every kernel picks, checked against the GPU (Triton) and TPU
(Mosaic) tiling rules for a range of sizes.

Interpret mode enforces none of these rules, so the kernels are *traced* (not
lowered) for each target and the block specs of the resulting ``pallas_call``s,
and the tiles their bodies load and store, are inspected directly.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import pytest

import rumus_fx as rf
from rumus_fx.kernels import attention, batch_norm, blocks, cross_entropy, embedding, layer_norm, matmul, softmax
from rumus_fx.kernels._pallas import Config

from ._jaxpr import equations, footprint, pallas_calls

f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32


def sds(shape, dtype=f32):
    return jax.ShapeDtypeStruct(shape, dtype)


ROWS = [(1, 1), (3, 5), (8, 128), (37, 300), (100, 1025), (4, 5000), (2, 50257)]
CHANNELS = [(1, 1, 1, 1), (2, 3, 5, 7), (8, 64, 14, 14), (4, 13, 56, 56)]
MATMUL = [(1, 1, 1), (5, 7, 3), (128, 128, 128), (300, 1000, 70), (33, 5000, 260)]
ATTENTION = [(1, 1, 4, 4), (5, 7, 8, 8), (128, 128, 64, 64), (300, 200, 80, 96), (1000, 1000, 128, 128)]
EMBEDDING = [(1, 1, 1), (5, 7, 3), (1000, 50257, 64), (300, 40, 300)]


def _programs(target: str):
    """(name, traceable fun, abstract args) for every kernel and size."""
    cfg = Config(target, False)
    for n, c in ROWS:
        x = sds((n, c))
        yield "softmax", functools.partial(softmax.softmax_pallas, axis=-1, cfg=cfg), (x,)
        yield "softmax_bwd", functools.partial(softmax.softmax_bwd_pallas, axis=-1, cfg=cfg), (x, x)
        p, st = sds((c,)), sds((n,))
        yield "layer_norm", functools.partial(layer_norm.layer_norm_fwd_pallas, eps=1e-5, cfg=cfg), (x, p, p)
        bwd = functools.partial(layer_norm.layer_norm_bwd_pallas, has_bias=True, cfg=cfg)
        yield "layer_norm_bwd", bwd, (x, p, st, st, x)
        ce = functools.partial(cross_entropy.cross_entropy_pallas, ignore_index=None, cfg=cfg)
        yield "cross_entropy", ce, (sds((n, c), bf16), sds((n,), i32))
    for shape in CHANNELS:
        x, p = sds(shape), sds((shape[1],))
        yield "batch_norm", functools.partial(batch_norm.batch_norm_train_pallas, eps=1e-5, cfg=cfg), (x, p, p)
        bwd = functools.partial(batch_norm.batch_norm_train_bwd_pallas, has_bias=True, cfg=cfg)
        yield "batch_norm_bwd", bwd, (x, p, p, p, x)
    for m, k, n in MATMUL:
        mm = functools.partial(matmul.matmul_pallas, out_dtype=None, cfg=cfg)
        yield "matmul", mm, (sds((m, k)), sds((k, n)))
        yield "bmm", mm, (sds((3, m, k), bf16), sds((3, k, n), bf16))
    for sq, sk, d, dv in ATTENTION:
        q, k, v = sds((2, sq, d)), sds((2, sk, d)), sds((2, sk, dv))
        for causal in (False, True):
            fwd = functools.partial(attention.attention_fwd_pallas, causal=causal, scale=0.1, cfg=cfg)
            yield "attention", fwd, (q, k, v, None)
            bwd = functools.partial(attention.attention_bwd_pallas, causal=causal, scale=0.1, mask_grad=False, cfg=cfg)
            yield "attention_bwd", bwd, (q, k, v, None, sds((2, sq, dv)), sds((2, sq)), sds((2, sq, dv)))
    for n, v, d in EMBEDDING:
        emb = functools.partial(embedding.embedding_bwd_pallas, vocab_size=v, dtype=f32, cfg=cfg)
        yield "embedding_bwd", emb, (sds((n,), i32), sds((n, d)))


def _dims(block_shape) -> list[int | None]:
    """Block dims as ints, ``None`` for a squeezed dim."""
    return [getattr(b, "block_size", None) for b in block_shape]


def _check_blocks(eqn, problems: list[str], where: str, target: str) -> None:
    for bm in eqn.params["grid_mapping"].block_mappings:
        dims, full = _dims(bm.block_shape), bm.array_aval.shape
        kept = [(b, f) for b, f in zip(dims, full) if b is not None]
        for b, f in kept:
            if not (blocks.is_pow2(b) or b == f):
                problems.append(f"{where}: block dim {b} of {dims} is neither a power of two nor the array's {full}")
            if f % b:
                problems.append(f"{where}: array {full} is not padded to a multiple of block {dims}")
        if (
            target == blocks.TPU and len(kept) >= 2
        ):  # Triton asks powers of two only (the GPU float32 matmul's 64 lanes)
            (b2, f2), (b1, f1) = kept[-2], kept[-1]
            if not ((b2 % blocks.SUBLANE == 0 or b2 == f2) and (b1 % blocks.LANE == 0 or b1 == f1)):
                problems.append(f"{where}: TPU tiling rule broken by block {dims} of array {full}")


def _check_tiles(eqn, problems: list[str], where: str) -> None:
    """GPU: every loaded/stored tile has a power-of-two size; dot operands >= 16."""
    for sub in equations(eqn.params["jaxpr"], into_kernels=True):
        name = sub.primitive.name
        if name in ("get", "swap"):
            shape = sub.outvars[0].aval.shape
            if not blocks.is_pow2(math.prod(shape)):
                problems.append(f"{where}: {name} of a {shape} tile (size not a power of two)")
        if name == "dot_general":
            for v in sub.invars:
                if min(v.aval.shape) < blocks.MIN_DOT:
                    problems.append(f"{where}: dot operand {v.aval.shape} smaller than {blocks.MIN_DOT}")


@pytest.mark.parametrize("target", blocks.TARGETS)
def test_every_kernel_picks_legal_blocks(target):
    problems: list[str] = []
    seen = set()
    for name, fun, args in _programs(target):
        calls = pallas_calls(fun, *args)
        assert calls, f"{name} traced no pallas_call"
        seen.add(name)
        where = f"{target}/{name}{tuple(a.shape for a in args if a is not None)}"
        for eqn in calls:
            _check_blocks(eqn, problems, where, target)
            if target == blocks.GPU:
                _check_tiles(eqn, problems, where)
    assert not problems, "\n".join(problems[:20])
    assert len(seen) == 12


@pytest.mark.parametrize("target", blocks.TARGETS)
@pytest.mark.parametrize("rows,cols", ROWS)
def test_row_blocks_cover_the_array(target, rows, cols):
    b = blocks.row_blocks(rows, cols, target)
    assert b.rows_pad >= rows and b.rows_pad % b.block_rows == 0
    assert b.cols_pad >= cols and b.cols_pad == b.chunk * b.n_chunks
    assert blocks.is_pow2(b.block_rows) and b.block_rows >= blocks.SUBLANE
    if target == blocks.TPU:
        # several chunks only as grid steps (no dynamic lane slices on TPU), each at most one block
        assert b.cols_pad % blocks.LANE == 0 and b.chunk % blocks.LANE == 0 and b.chunk <= blocks.TPU_MAX_ROW
        assert b.on_grid == (b.n_chunks > 1) and b.on_grid == (cols > blocks.TPU_MAX_ROW)
    else:
        assert blocks.is_pow2(b.chunk) and b.chunk <= blocks.GPU_MAX_CHUNK
        assert b.block_rows * b.chunk <= max(blocks.GPU_ROW_TILE, blocks.SUBLANE * b.chunk)


def test_small_sizes_do_not_overpad():
    assert blocks.row_blocks(8, 128, blocks.GPU).cols_pad == 128
    assert blocks.matmul_blocks(128, 128, 128, blocks.GPU).m_pad == 128
    assert blocks.attention_blocks(128, 128, 64, 64, blocks.GPU).sq_pad == 128
    t = blocks.matmul_blocks(300, 1000, 70, blocks.TPU)
    assert t.n_k == 2 and t.bk == 512 and t.k_pad == 1024 and t.n_pad == 128


def test_helpers():
    assert [blocks.next_pow2(n) for n in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 4, 8, 8, 16]
    assert [blocks.prev_pow2(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 2, 4, 8, 8]
    assert blocks.round_up(5, 4) == 8 and blocks.round_up(8, 4) == 8
    with pytest.raises(ValueError, match="target"):
        blocks.row_blocks(1, 1, "cpu")


def test_the_checks_catch_illegal_blocks():
    """A (3, 5) block of a (6, 10) array breaks both rules; a 3x5 tile is not a power of two."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def fun(x):
        spec = pl.BlockSpec((3, 5), lambda i, j: (i, j))
        return pl.pallas_call(kernel, out_shape=x, grid=(2, 2), in_specs=[spec], out_specs=spec)(x)

    problems: list[str] = []
    for eqn in pallas_calls(fun, sds((6, 10))):
        _check_blocks(eqn, problems, "bad", blocks.TPU)
        _check_tiles(eqn, problems, "bad")
    assert any("power of two" in p for p in problems)
    assert any("TPU tiling" in p for p in problems)


# ---------------------------------------------------------------- footprints
# Every kernel, forward and backward (rf.grad of the public op, as in
# test_lowering.py), at the realistic sizes and at sizes several times larger:
# what one program holds on chip stays under the TPU's scoped VMEM and the GPU's
# shared memory and registers, and does not grow with the problem.


def _rows(n, c, params=False):
    return ((n, c), (c,), (c,)) if params else ((n, c),)


# realistic case of test_lowering.CASES: the same op at two sizes past every
# block cap (the footprint may grow up to the caps, never past them)
GROWTH = {
    "softmax_4096x1024": (_rows(64, 65536), _rows(256, 262144)),
    "layer_norm_4096x1024": (_rows(64, 65536, True), _rows(256, 262144, True)),
    "cross_entropy_4096x32000": (((1024, 128256), ((1024,), i32)), ((4096, 512000), ((4096,), i32))),
    "batch_norm_32x64x28x28": (((32, 64, 56, 56), (64,), (64,)), ((128, 256, 224, 224), (256,), (256,))),
    "matmul_1024x1024x1024": (((2048, 2048), (2048, 2048)), ((8192, 8192), (8192, 8192))),
    "bmm_4x1000x700x300": (((4, 2000, 1400), (4, 1400, 600)), ((16, 8000, 5600), (16, 5600, 2400))),
    "attention_causal_b2h8s1024d64": (((2, 8, 4096, 64),) * 3, ((2, 8, 16384, 64),) * 3),
    "attention_b2h8s1000d64": (((2, 8, 4000, 64),) * 3, ((4, 16, 16000, 64),) * 3),
    "embedding_50000x768_8192": (((50000, 768), ((8, 8192), i32)), ((200000, 768), ((32, 8192), i32))),
}
LIMITS = {"vmem": blocks.TPU_VMEM_LIMIT, "shared": blocks.GPU_SHARED_MEMORY, "registers": blocks.GPU_REGISTER_FILE}


def _abstract(shapes, dtype):
    return tuple(sds(s, dtype) if isinstance(s[0], int) else sds(s[0], s[1]) for s in shapes)


def _footprints(loss, args) -> dict[tuple[str, str], dict[str, int]]:
    """{(kernel name, target): worst footprint} of rf.grad(loss) under "pallas"
    (whose program holds the GPU and the TPU kernels)."""
    argnums = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))
    with rf.kernels.use("pallas"):
        calls = pallas_calls(rf.grad(loss, argnums=argnums), *args)
    out: dict[tuple[str, str], dict[str, int]] = {}
    for eqn in calls:
        target, sizes = footprint(eqn)
        key = (eqn.params["name"], target)
        out[key] = {k: max(v, out.get(key, {}).get(k, 0)) for k, v in sizes.items()}
    return out


@pytest.mark.parametrize("dtype", [f32, bf16], ids=["float32", "bfloat16"])
def test_footprints_fit_on_chip_and_do_not_grow(dtype):
    from . import test_lowering

    problems: list[str] = []
    seen: set[str] = set()

    def check(where: str, found: dict) -> None:
        for (name, target), sizes in found.items():
            seen.add(name)
            for metric, size in sizes.items():
                if size >= LIMITS[metric]:
                    limit = LIMITS[metric] >> 10
                    problems.append(f"{where} {name} {target}: {metric} {size >> 10} KiB >= {limit} KiB")

    for case, (loss, args, _) in test_lowering.CASES.items():
        check(case, _footprints(loss, args(dtype)))
        if case in GROWTH:
            larger, much_larger = (_footprints(loss, _abstract(shapes, dtype)) for shapes in GROWTH[case])
            check(f"{case} x4", larger)
            check(f"{case} x16", much_larger)
            assert much_larger.keys() == larger.keys(), case
            for key, sizes in much_larger.items():
                for metric, size in sizes.items():
                    if size > larger[key][metric]:
                        problems.append(f"{case} {key}: {metric} grows to {size} from {larger[key][metric]} bytes")
    assert not problems, "\n".join(problems)
    assert len(seen) == 14  # every kernel


def test_the_footprint_check_sees_a_block_that_holds_the_whole_problem():
    """A kernel whose block is the whole array (as the embedding backward's
    lookups were) grows with the problem and soon exceeds VMEM."""
    from jax.experimental import pallas as pl

    from rumus_fx.kernels._pallas import pallas_call

    def copy(x):
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...]

        spec = pl.BlockSpec(x.shape, lambda i: (0, 0))
        return pallas_call(
            kernel, Config(blocks.TPU), name="whole", grid=(1,), in_specs=[spec], out_specs=spec, out_shape=x
        )(x)

    small, big = (footprint(e)[1]["vmem"] for n in (256, 4096) for e in pallas_calls(copy, sds((n, 1024))))
    assert big == 16 * small
    assert big >= blocks.TPU_VMEM_LIMIT


def test_footprint_formulas():
    assert blocks.tpu_buffer_bytes((8, 128), 4) == 4096
    assert blocks.tpu_buffer_bytes((1, 1), 4) == 4096  # one (8, 128) tile
    assert blocks.tpu_buffer_bytes((8, 128), 2) == 4096  # bfloat16 packs 16 sublanes
    assert blocks.tpu_buffer_bytes((3, 8, 200), 4) == 3 * 8 * 256 * 4
    two = [((8, 128), 4), ((16, 256), 2)]
    assert blocks.tpu_vmem_bytes(two, [((8, 1), 4)]) == 2 * (4096 + 8192) + 4096 + 4 * 16384
    assert blocks.gpu_onchip_bytes([(1000, True), (10, False)], 2) == (2000, 1010)
    assert blocks.gpu_onchip_bytes([(1000, True)], None) == (3000, 1000)
