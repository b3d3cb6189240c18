"""Every kernel lowered for CUDA (Pallas on Triton) and TPU (Pallas on Mosaic)
on this CPU-only host, at realistic shapes, forward and backward.

A CPU jaxlib runs both Pallas lowerings: ``lower(lowering_platforms=("cuda",))``
gives a ``__gpu$xla.gpu.triton`` custom call per kernel and ``("tpu",)`` a
``tpu_custom_call``, each carrying the kernel's name. Each case is ``rf.grad``
of a public op under ``rf.kernels.use("pallas")``, so one lowering holds the
forward kernels and the backward kernels that rf's records call; the test
asserts the module holds exactly the expected kernels by name, so a silent
fallback to the reference (or a kernel that stopped lowering) fails it. What
this cannot check is Triton's PTX compile and libtpu's layout passes
(``benchmarks/gpu_check.py`` compiles on a GPU).

Lowering only (nothing is compiled or allocated: the arguments are
``jax.ShapeDtypeStruct``); one trace per (case, dtype) serves both platforms.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

import rumus_fx as rf

f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32

SOFTMAX = {"softmax_fwd", "softmax_bwd"}
LAYER_NORM = {"layer_norm_fwd", "layer_norm_bwd"}
BATCH_NORM = {"batch_norm_moments", "batch_norm_apply", "batch_norm_grad_sums", "batch_norm_dx"}
ATTENTION = {"attention_fwd", "attention_bwd_dkdv", "attention_bwd_dq"}


def _softmax(x):
    return rf.sum(rf.mul(rf.softmax(x, axis=-1), x))


def _layer_norm(x, w, b):
    return rf.sum(rf.mul(rf.layer_norm(x, w, b), x))


def _batch_norm(x, w, b):
    c = x.shape[1]
    y, _, _ = rf.batch_norm_2d(x, w, b, jnp.zeros(c), jnp.ones(c), training=True)
    return rf.sum(rf.mul(y, x))


def _matmul(a, b):
    return rf.sum(rf.tanh(rf.matmul(a, b)))


def _bmm(a, b):
    return rf.sum(rf.tanh(rf.bmm(a, b)))


def _attention(causal):
    def loss(q, k, v):
        return rf.sum(rf.mul(rf.scaled_dot_product_attention(q, k, v, causal=causal), q))

    return loss


def _embedding(table, ids):
    return rf.sum(rf.tanh(rf.embedding(ids, table)))


def _cross_entropy(logits, targets):
    return rf.cross_entropy(logits, targets)


def _qkv(s):
    return lambda dt: (jax.ShapeDtypeStruct((2, 8, s, 64), dt),) * 3


def _sds(*specs):
    """Abstract arguments: ``(shape, None)`` takes the case's float dtype."""
    return lambda dt: tuple(jax.ShapeDtypeStruct(shape, dt if d is None else d) for shape, d in specs)


# name: (loss, abstract args per float dtype, kernels the module must hold)
CASES = {
    "softmax_4096x1024": (_softmax, _sds(((4096, 1024), None)), SOFTMAX),
    "softmax_1000x777": (_softmax, _sds(((1000, 777), None)), SOFTMAX),
    "layer_norm_4096x1024": (_layer_norm, _sds(((4096, 1024), None), ((1024,), None), ((1024,), None)), LAYER_NORM),
    "layer_norm_1000x777": (_layer_norm, _sds(((1000, 777), None), ((777,), None), ((777,), None)), LAYER_NORM),
    "cross_entropy_4096x32000": (_cross_entropy, _sds(((4096, 32000), None), ((4096,), i32)), {"cross_entropy"}),
    # rows wider than one TPU block: column chunks as grid steps
    "cross_entropy_1024x128256": (_cross_entropy, _sds(((1024, 128256), None), ((1024,), i32)), {"cross_entropy"}),
    "layer_norm_64x65536": (_layer_norm, _sds(((64, 65536), None), ((65536,), None), ((65536,), None)), LAYER_NORM),
    "softmax_64x65536": (_softmax, _sds(((64, 65536), None)), SOFTMAX),
    "batch_norm_32x64x28x28": (_batch_norm, _sds(((32, 64, 28, 28), None), ((64,), None), ((64,), None)), BATCH_NORM),
    "matmul_1024x1024x1024": (_matmul, _sds(((1024, 1024), None), ((1024, 1024), None)), {"matmul"}),
    "matmul_1000x700x300": (_matmul, _sds(((1000, 700), None), ((700, 300), None)), {"matmul"}),
    "bmm_4x1000x700x300": (_bmm, _sds(((4, 1000, 700), None), ((4, 700, 300), None)), {"matmul"}),
    "attention_causal_b2h8s1024d64": (_attention(True), _qkv(1024), ATTENTION),
    "attention_b2h8s1000d64": (_attention(False), _qkv(1000), ATTENTION),
    "attention_causal_b2h8s1000d64": (_attention(True), _qkv(1000), ATTENTION),
    "embedding_50000x768_8192": (_embedding, _sds(((50000, 768), None), ((8, 1024), i32)), {"embedding_bwd"}),
}

DTYPES = {"float32": f32, "bfloat16": bf16}
PLATFORMS = {
    # platform: (custom call target, attribute naming the kernel, the other platform's target)
    "cuda": (r"__gpu\$xla\.gpu\.triton", "name", "tpu_custom_call"),
    "tpu": (r"tpu_custom_call", "kernel_name", "__gpu$xla.gpu.triton"),
}


def kernel_names(module_text: str, platform: str) -> list[str]:
    """The kernel name of every Pallas custom call for ``platform`` in a module."""
    target, attr, _ = PLATFORMS[platform]
    names = []
    for line in module_text.splitlines():
        if re.search(rf"custom_call @{target}\(", line):
            line = re.sub(r'\bir = "[^"]*"', "", line)  # Triton's serialised kernel
            found = re.search(rf'\b{attr} = "(\w+)"', line)
            names.append(found.group(1) if found else "?")
    return names


@functools.cache
def _traced(case: str, dtype: str, mode: str = "pallas"):
    loss, args, _ = CASES[case]
    args = args(DTYPES[dtype])
    argnums = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))
    with rf.kernels.use(mode):
        return jax.jit(rf.grad(loss, argnums=argnums)).trace(*args)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_kernels_lower_for_gpu_and_tpu(case, dtype, platform):
    text = _traced(case, dtype).lower(lowering_platforms=(platform,)).as_text()
    names = kernel_names(text, platform)
    assert set(names) == CASES[case][2], f"{case} {dtype} for {platform}: kernels {sorted(set(names))}"
    assert "?" not in names
    assert PLATFORMS[platform][2] not in text  # only this platform's kernels are kept


@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_check_sees_a_fallback_to_the_reference(platform):
    """Under ``"reference"`` the same program lowers with no Pallas kernel, so
    the assertion above would fail if dispatch silently took the reference."""
    text = _traced("softmax_1000x777", "float32", "reference").lower(lowering_platforms=(platform,)).as_text()
    assert kernel_names(text, platform) == []
    pallas = _traced("softmax_1000x777", "float32").lower(lowering_platforms=(platform,)).as_text()
    assert sorted(kernel_names(pallas, platform)) == ["softmax_bwd", "softmax_fwd"]


def _every_op(x, w, img, c, a, b, q, qt, table, logits):
    ids = jnp.arange(12, dtype=jnp.int32).reshape(3, 4) % table.shape[0]
    targets = jnp.arange(logits.shape[0], dtype=jnp.int32) % logits.shape[1]
    return (
        _softmax(x)
        + _layer_norm(x, w, w)
        + _batch_norm(img, c, c)
        + _matmul(a, b)
        + _bmm(q, qt)
        + _attention(True)(q, q, q)
        + _attention(False)(q, q, q)
        + _embedding(table, ids)
        + _cross_entropy(logits, targets)
    )


def test_one_export_for_cpu_cuda_and_tpu_holds_every_kernel_and_runs_the_reference_on_cpu():
    import chex
    import numpy as np

    r = np.random.default_rng(0)
    shapes = [(5, 7), (7,), (2, 3, 4, 5), (3,), (6, 9), (9, 4), (2, 6, 8), (2, 8, 6), (11, 5), (4, 13)]
    args = [jnp.asarray(r.standard_normal(s), f32) for s in shapes]
    argnums = tuple(range(len(args)))
    with rf.kernels.use("pallas"):
        exported = jax.export.export(
            jax.jit(rf.grad(_every_op, argnums=argnums)),
            platforms=["cpu", "cuda", "tpu"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(*args)
    text = exported.mlir_module()
    every = SOFTMAX | LAYER_NORM | BATCH_NORM | ATTENTION | {"matmul", "embedding_bwd", "cross_entropy"}
    for platform in PLATFORMS:
        assert set(kernel_names(text, platform)) == every, platform
    with rf.kernels.use("reference"):
        want = rf.grad(_every_op, argnums=argnums)(*args)
    chex.assert_trees_all_close(exported.call(*args), want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------ cuda from a host without a GPU


def _gpu_info_module():
    """jax 0.11's ``gpu_info`` (what its Triton lowering asks for the GPU), or
    None on a jax whose lowering does not ask (0.10 assumes compute capability 9.0)."""
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:
        return None
    return gpu_info


def test_rfs_gpu_kernels_lower_under_an_abstract_gpu_when_the_process_has_none():
    """jax 0.11 raises "No supported GPU devices found" when a Triton kernel is
    lowered for cuda with no GPU in the process and no ``AbstractDevice`` named;
    rf's lowering rule names an abstract H100 (compute capability 9.0, jax 0.10's
    assumption) around its own native GPU kernels only."""
    from rumus_fx.kernels import _platform

    seen = {}

    def native(x):
        seen["native"] = jax.sharding.get_abstract_mesh().abstract_device
        return [x + 1]

    def interpret(x):
        seen["interpret"] = jax.sharding.get_abstract_mesh().abstract_device
        return [x + 1]

    def f(x):
        return _platform.native_or_interpret(native, interpret, ("cuda", "rocm"), (x,), x)[0]

    x = jax.ShapeDtypeStruct((3,), f32)
    jax.jit(f).trace(x).lower(lowering_platforms=("cuda",))
    jax.jit(f).trace(x).lower(lowering_platforms=("cpu",))
    if jax.default_backend() == "gpu":
        assert seen["native"] is None
    else:
        assert (seen["native"].platform, seen["native"].device_kind) == ("gpu", "NVIDIA H100")
    assert seen["interpret"] is None  # the interpreter asks for no GPU; the mesh is left alone
    with _platform.gpu_target():
        info = _gpu_info_module()
        if info is not None and jax.default_backend() != "gpu":
            assert info.get_gpu_info().compute_capability == 90


def test_an_abstract_gpu_the_user_names_is_kept():
    from rumus_fx.kernels import _platform

    mine = jax.sharding.AbstractDevice(device_kind="NVIDIA B200", num_cores=148, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=mine)):
        with _platform.gpu_target():
            assert jax.sharding.get_abstract_mesh().abstract_device is mine
