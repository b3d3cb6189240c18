"""The Mosaic GPU row kernels (``rumus_fx/kernels/mosaic_gpu.py``): softmax,
layer norm, cross-entropy and batch norm, forward and backward.

Which checks are which:
* LOWERING ONLY: ``test_lowers_for_cuda_*`` lower the ``plgpu.kernel`` for
  cuda with Mosaic GPU on this CPU host at the public shapes; nothing is
  compiled to SASS or run.
* NUMERICS, on CPU, of the block algorithm: the jax.numpy emulation applies
  the kernel's own chunk steps to the same padded blocks and chunks (the
  copies, barriers and register layouts are not emulated: jax 0.10's Mosaic
  GPU interpreter has no rule for ``plgpu.load`` or swizzled shared memory).
* Dispatch: which kernel the cuda branch holds (Triton present or removed,
  ``RUMUS_FX_GPU_KERNELS=mosaic``), and the fallback when a Mosaic rule or
  the lowering fails."""

from __future__ import annotations

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as _pallas  # noqa: F401 - loaded before the Triton module is hidden

import rumus_fx as rf
from rumus_fx.kernels import batch_norm, cross_entropy, dispatch, layer_norm, mosaic_gpu, softmax

from ._backends import hide_triton

MOSAIC_CALL = "mosaic_gpu"
TRITON = "__gpu$xla.gpu.triton"


def _lower_text(fn, *avals):
    return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("shape", [(4096, 1024), (1000, 777), (64, 65536), (2, 3, 5)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_lowers_for_cuda_forward_and_backward(shape, dtype):
    x = jax.ShapeDtypeStruct(shape, dtype)
    fwd = _lower_text(lambda x: mosaic_gpu.softmax_mgpu(x, axis=-1), x)
    bwd = _lower_text(lambda y, g: mosaic_gpu.softmax_bwd_mgpu(y, g, axis=-1), x, x)
    for text, name in ((fwd, "softmax_fwd_mgpu"), (bwd, "softmax_bwd_mgpu")):
        assert text.count(f"custom_call @{MOSAIC_CALL}") == 1 and name in text
        assert TRITON not in text


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


f32 = jnp.float32
# (name, function, abstract args builder(dtype), static, kernel names in the module)
PUBLIC = {
    "layer_norm_4096x1024": ((4096, 1024),),
    "layer_norm_1000x777": ((1000, 777),),
    "cross_entropy_4096x32000": ((4096, 32000),),
    "cross_entropy_1000x777": ((1000, 777),),
    "batch_norm_64x128x56x56": ((64, 128, 56, 56),),
    "batch_norm_6x37x13x11": ((6, 37, 13, 11),),
}


def _lower_case(name, dtype):
    (shape,) = PUBLIC[name]
    x, row = _sds(shape, dtype), _sds(shape[:1], f32)
    if name.startswith("layer_norm"):
        w = _sds(shape[-1:], dtype)
        fwd = _lower_text(lambda x, w, b: mosaic_gpu.layer_norm_fwd_mgpu(x, w, b, eps=1e-5), x, w, w)
        bwd = _lower_text(
            lambda x, w, m, r, g: mosaic_gpu.layer_norm_bwd_mgpu(x, w, m, r, g, has_bias=True), x, w, row, row, x
        )
        return {"layer_norm_fwd_mgpu": fwd, "layer_norm_bwd_mgpu": bwd}
    if name.startswith("cross_entropy"):
        t = _sds(shape[:1], jnp.int32)
        text = _lower_text(lambda lg, t: mosaic_gpu.cross_entropy_mgpu(lg, t, ignore_index=-100), x, t)
        return {"cross_entropy_mgpu": text}
    c, stat = _sds(shape[1:2], dtype), _sds(shape[1:2], f32)
    fwd = _lower_text(lambda x, w, b: mosaic_gpu.batch_norm_train_mgpu(x, w, b, eps=1e-5), x, c, c)
    bwd = _lower_text(
        lambda x, w, m, r, g: mosaic_gpu.batch_norm_train_bwd_mgpu(x, w, m, r, g, has_bias=True), x, c, stat, stat, x
    )
    return {"batch_norm_moments_mgpu|batch_norm_apply_mgpu": fwd, "batch_norm_grad_sums_mgpu|batch_norm_dx_mgpu": bwd}


@pytest.mark.parametrize("name", list(PUBLIC))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_cuda_norms_and_cross_entropy(name, dtype):
    """LOWERING ONLY, at the shapes tests/kernels/test_lowering.py lowers Triton at."""
    for names, text in _lower_case(name, dtype).items():
        kernels = names.split("|")
        assert text.count(f"custom_call @{MOSAIC_CALL}") == len(kernels), names
        assert all(k in text for k in kernels) and TRITON not in text


def test_block_rules():
    for dt in (jnp.float32, jnp.bfloat16, jnp.float16):
        assert mosaic_gpu.check_rules(dt, buffers=3) is None
        assert mosaic_gpu.smem_bytes(dt, 3) <= mosaic_gpu.SMEM_LIMIT


def _rand(shape, seed, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


@pytest.mark.parametrize(
    "shape,axis",
    [((3, 5), -1), ((64, 128), -1), ((70, 300), -1), ((2, 130, 7), 1), ((1, 1), -1)],
)
def test_block_algorithm_matches_the_reference(shape, axis):
    """Several row blocks, several chunks, padded rows and columns, another axis."""
    x, g = _rand(shape, 0) * 4.0, _rand(shape, 1)
    y = mosaic_gpu.softmax_mgpu(x, axis=axis)
    chex.assert_trees_all_close(y, softmax.softmax_reference(x, axis=axis), rtol=1e-6, atol=1e-7)
    dx = mosaic_gpu.softmax_bwd_mgpu(y, g, axis=axis)
    chex.assert_trees_all_close(dx, softmax.softmax_bwd_reference(y, g, axis=axis), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_block_algorithm_low_precision(dtype):
    x = _rand((65, 200), 2, dtype)
    want = softmax.softmax_reference(x.astype(jnp.float32), axis=-1)
    got = mosaic_gpu.softmax_mgpu(x, axis=-1)
    assert got.dtype == dtype
    chex.assert_trees_all_close(got.astype(jnp.float32), want, rtol=2e-2, atol=1e-3)


def test_gradients_through_the_custom_jvp():
    x, w = _rand((5, 140), 3), _rand((5, 140), 4)

    def loss(x):
        return jnp.sum(mosaic_gpu.softmax_mgpu(x, axis=-1) * w)

    def oracle(x):
        return jnp.sum(jax.nn.softmax(x, axis=-1) * w)

    chex.assert_trees_all_close(jax.grad(loss)(x), jax.grad(oracle)(x), rtol=1e-5, atol=1e-7)
    _, jvp = jax.jvp(loss, (x,), (w,))
    _, want = jax.jvp(oracle, (x,), (w,))
    chex.assert_trees_all_close(jvp, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(3, 5), (70, 300), pytest.param((130, 128), marks=pytest.mark.slow)])
@pytest.mark.parametrize("affine", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_layer_norm_block_algorithm(shape, affine):
    x, g = _rand(shape, 6) * 3.0 + 2.0, _rand(shape, 7)
    w, b = (_rand(shape[-1:], 8), _rand(shape[-1:], 9)) if affine else (None, None)
    got = mosaic_gpu.layer_norm_fwd_mgpu(x, w, b, eps=1e-5)
    want = layer_norm.layer_norm_fwd_reference(x, w, b, eps=1e-5)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
    got = mosaic_gpu.layer_norm_bwd_mgpu(x, w, want[1], want[2], g, has_bias=affine)
    want = layer_norm.layer_norm_bwd_reference(x, w, want[1], want[2], g, has_bias=affine)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(3, 5), pytest.param((70, 300), marks=pytest.mark.slow)])
@pytest.mark.parametrize("ignore_index", [None, 0])
def test_cross_entropy_block_algorithm(shape, ignore_index):
    logits = _rand(shape, 10) * 3.0
    targets = jnp.asarray(np.random.default_rng(11).integers(0, shape[1], shape[0]), jnp.int32).at[::2].set(0)
    got = mosaic_gpu.cross_entropy_mgpu(logits, targets, ignore_index=ignore_index)
    want = cross_entropy.cross_entropy_reference(logits, targets, ignore_index=ignore_index)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("shape", [pytest.param((2, 8, 4, 4), marks=pytest.mark.slow), (3, 5, 7, 11)])
def test_batch_norm_block_algorithm(shape):
    x, g = _rand(shape, 12) * 1.5 - 0.7, _rand(shape, 13)
    w, b = _rand(shape[1:2], 14), _rand(shape[1:2], 15)
    got = mosaic_gpu.batch_norm_train_mgpu(x, w, b, eps=1e-5)
    want = batch_norm.batch_norm_train_reference(x, w, b, eps=1e-5)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    got = mosaic_gpu.batch_norm_train_bwd_mgpu(x, w, want[1], want[3], g, has_bias=True)
    want = batch_norm.batch_norm_train_bwd_reference(x, w, want[1], want[3], g, has_bias=True)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the forward and backward values are checked by default above
def test_norm_and_cross_entropy_gradients_through_the_custom_jvps():
    x, w, b = _rand((6, 140), 16), _rand((140,), 17), _rand((140,), 18)
    xb, wb = _rand((2, 3, 4, 5), 19), _rand((3,), 20)
    t = jnp.asarray(np.random.default_rng(21).integers(0, 140, 6), jnp.int32)

    def ln(x, w, b):
        y, _, _ = mosaic_gpu.layer_norm_fwd_mgpu(x, w, b, eps=1e-5)
        return jnp.sum(jnp.sin(y))

    def ln_oracle(x, w, b):
        y, _, _ = layer_norm.layer_norm_fwd_reference(x, w, b, eps=1e-5)
        return jnp.sum(jnp.sin(y))

    def bn(x, w):
        return jnp.sum(jnp.sin(mosaic_gpu.batch_norm_train_mgpu(x, w, None, eps=1e-5)[0]))

    def bn_oracle(x, w):
        return jnp.sum(jnp.sin(batch_norm.batch_norm_train_reference(x, w, None, eps=1e-5)[0]))

    def ce(x):
        return mosaic_gpu.cross_entropy_mgpu(x, t, ignore_index=None)[0]

    def ce_oracle(x):
        return cross_entropy.cross_entropy_reference(x, t, ignore_index=None)[0]

    for f, o, args in ((ln, ln_oracle, (x, w, b)), (bn, bn_oracle, (xb, wb)), (ce, ce_oracle, (x,))):
        argnums = tuple(range(len(args)))
        chex.assert_trees_all_close(jax.grad(f, argnums)(*args), jax.grad(o, argnums)(*args), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- dispatch


def _loss(x):
    return rf.sum(rf.mul(rf.softmax(x, axis=-1), x))


def _cuda_export(x):
    return jax.export.export(
        jax.jit(rf.grad(_loss)),
        platforms=["cuda"],
        disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call(TRITON),
            jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2"),
        ],
    )(x).mlir_module()


@pytest.fixture
def no_triton(monkeypatch):
    hide_triton(monkeypatch)
    yield
    jax.clear_caches()


@pytest.fixture
def x():
    return _rand((8, 300), 5)


def test_triton_kept_while_present(x, monkeypatch):
    monkeypatch.delenv("RUMUS_FX_GPU_KERNELS", raising=False)
    with rf.kernels.use("pallas"):
        text = _cuda_export(x)
    assert text.count(TRITON) == 2 and f"@{MOSAIC_CALL}" not in text


def test_preferred_mosaic_in_the_cuda_branch(x, monkeypatch):
    monkeypatch.setenv("RUMUS_FX_GPU_KERNELS", "mosaic")
    with rf.kernels.use("pallas"):
        text = _cuda_export(x)
    assert text.count(f"custom_call @{MOSAIC_CALL}") == 2 and TRITON not in text


def test_mosaic_replaces_a_removed_triton(no_triton, x):
    with rf.kernels.use("reference"):
        want = rf.grad(_loss)(x)
    with rf.kernels.use("pallas"), warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback: the Mosaic GPU variant serves
        text = _cuda_export(x)
        got = jax.jit(rf.grad(_loss))(x)  # the CPU runs the reference branch
    assert text.count(f"custom_call @{MOSAIC_CALL}") == 2 and TRITON not in text
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-8)


def test_a_broken_mosaic_rule_falls_back_or_raises(no_triton, x, monkeypatch):
    monkeypatch.setattr(mosaic_gpu, "CHUNK", 512)  # async copies take at most 256 per dimension
    monkeypatch.setattr(dispatch, "_accelerator_present", lambda: True)
    monkeypatch.delenv("RUMUS_FX_KERNELS", raising=False)
    with pytest.warns(
        rf.kernels.KernelFallbackWarning, match=r"'softmax_(fwd|bwd)'.*Triton.*256 elements per dimension"
    ):
        jax.jit(rf.grad(_loss))(x)
    with rf.kernels.use("pallas"), pytest.raises(rf.kernels.KernelUnavailable, match="256 elements"):
        jax.jit(rf.grad(_loss))(x)


def test_a_failed_mosaic_lowering_falls_back(no_triton, x, monkeypatch):
    def broken(*a, **k):
        raise NotImplementedError("no lowering rule")

    monkeypatch.setattr(mosaic_gpu, "_row_kernel", broken)
    mosaic_gpu._lowers_cached.cache_clear()
    monkeypatch.setattr(dispatch, "_accelerator_present", lambda: True)
    monkeypatch.delenv("RUMUS_FX_KERNELS", raising=False)
    try:
        with pytest.warns(rf.kernels.KernelFallbackWarning, match="NotImplementedError: no lowering rule"):
            got = jax.jit(rf.grad(_loss))(x)
    finally:
        mosaic_gpu._lowers_cached.cache_clear()
    with rf.kernels.use("reference"):
        chex.assert_trees_all_close(got, rf.grad(_loss)(x), rtol=1e-6, atol=1e-8)


def _ln_loss(x, w, b):
    return rf.sum(rf.mul(rf.layer_norm(x, w, b), x))


def _ce_loss(x, t):
    return rf.cross_entropy(x, t)


def _bn_loss(x, w, b):
    c = x.shape[1]
    y, _, _ = rf.batch_norm_2d(x, w, b, jnp.zeros(c), jnp.ones(c), training=True)
    return rf.sum(rf.mul(y, x))


@pytest.mark.parametrize(
    "loss,args,argnums,n_kernels",
    [
        (_ln_loss, ((6, 300), (300,), (300,)), (0, 1, 2), 2),
        (_ce_loss, ((6, 300), None), (0,), 1),
        (_bn_loss, ((2, 3, 5, 7), (3,), (3,)), (0, 1, 2), 4),
    ],
    ids=["layer_norm", "cross_entropy", "batch_norm"],
)
def test_public_ops_export_mosaic_kernels_for_cuda(monkeypatch, loss, args, argnums, n_kernels):
    """rf.grad of each public op, pallas mode, Mosaic GPU preferred: the cuda
    program holds the Mosaic GPU kernels (forward and backward) and no Triton."""
    monkeypatch.setenv("RUMUS_FX_GPU_KERNELS", "mosaic")
    vals = tuple(jnp.zeros((6,), jnp.int32) if shape is None else _rand(shape, i) for i, shape in enumerate(args))
    with rf.kernels.use("pallas"):
        text = jax.export.export(
            jax.jit(rf.grad(loss, argnums=argnums)),
            platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")],
        )(*vals).mlir_module()
    assert text.count(f"custom_call @{MOSAIC_CALL}") == n_kernels and TRITON not in text
