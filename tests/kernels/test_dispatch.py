"""Kernel dispatch: modes, the environment variable, what ``auto`` picks on CPU,
and the ``platform_dependent`` path that ``auto`` stages with an accelerator."""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf
from rumus_fx.kernels import dispatch, layer_norm, softmax

from ._jaxpr import has_pallas, pallas_calls


@pytest.fixture
def x():
    return jnp.asarray(np.random.default_rng(0).standard_normal((3, 5)), jnp.float32)


def test_modes_context_and_environment(monkeypatch):
    assert rf.kernels.MODES == ("auto", "reference", "pallas", "interpret")
    monkeypatch.delenv("RUMUS_FX_KERNELS", raising=False)
    assert rf.kernels.mode() == "auto"
    monkeypatch.setenv("RUMUS_FX_KERNELS", "interpret")
    assert rf.kernels.mode() == "interpret" and rf.kernels.backend() == "pallas"
    with rf.kernels.use("reference"):
        assert rf.kernels.backend() == "reference"
        with rf.kernels.use("pallas"):
            # on a CPU "pallas" runs the reference (its programs hold the kernels for GPU/TPU)
            on_cpu = jax.default_backend() == "cpu"
            assert rf.kernels.mode() == "pallas" and rf.kernels.backend() == ("reference" if on_cpu else "pallas")
        assert rf.kernels.mode() == "reference"
    assert rf.kernels.mode() == "interpret"
    monkeypatch.setenv("RUMUS_FX_KERNELS", "bogus")
    with pytest.raises(ValueError, match="unknown kernel mode"):
        rf.kernels.mode()
    with pytest.raises(ValueError, match="unknown kernel mode"), rf.kernels.use("gpu"):
        pass


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="auto's choice on a CPU host; a GPU host picks the kernels")
def test_auto_picks_the_reference_on_cpu(monkeypatch, x):
    monkeypatch.delenv("RUMUS_FX_KERNELS", raising=False)
    assert rf.kernels.backend() == "reference"
    assert not has_pallas(softmax.softmax_fwd, x)
    with rf.kernels.use("reference"):
        assert not has_pallas(softmax.softmax_fwd, x)
    with rf.kernels.use("interpret"):
        assert has_pallas(softmax.softmax_fwd, x)


def test_float64_and_empty_inputs_take_the_reference(x64):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5)))
    assert x.dtype == jnp.float64
    with rf.kernels.use("interpret"):
        assert not has_pallas(softmax.softmax_fwd, x)
        assert not has_pallas(softmax.softmax_fwd, jnp.zeros((0, 5), jnp.float32))
        assert has_pallas(softmax.softmax_fwd, x.astype(jnp.float32))
        chex.assert_trees_all_close(softmax.softmax_fwd(x), jax.nn.softmax(x), rtol=1e-12)


def _loss(x, w):
    y = rf.layer_norm(x, w, None)
    return rf.sum(rf.mul(rf.softmax(y, axis=-1), jnp.arange(5.0)))


def _kernel_names(module_text: str) -> set[str]:
    return set(re.findall(r'(?:kernel_name|\bname) = "([a-z_]+)"', module_text))


def test_pallas_mode_runs_the_reference_on_cpu(x):
    w = jnp.linspace(0.5, 1.5, 5)
    with rf.kernels.use("reference"):
        want = rf.grad(_loss, argnums=(0, 1))(x, w)
    with rf.kernels.use("pallas"):
        program = rf.grad(_loss, argnums=(0, 1))
        assert len(pallas_calls(program, x, w)) == 8  # layer norm and softmax, fwd and bwd, GPU and TPU
        for got in (program(x, w), jax.jit(program)(x, w)):
            chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)


def test_pallas_mode_exports_kernels_for_cuda_and_tpu_and_the_reference_for_cpu(x):
    """One program exported from this CPU host for three platforms: the Triton
    kernels for cuda, the Mosaic kernels for tpu, and the reference for cpu
    (called here, it equals the reference)."""
    w = jnp.linspace(0.5, 1.5, 5)
    with rf.kernels.use("pallas"):
        exported = jax.export.export(
            jax.jit(rf.grad(_loss, argnums=(0, 1))),
            platforms=["cpu", "cuda", "tpu"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(x, w)
    text = exported.mlir_module()
    assert exported.platforms == ("cpu", "cuda", "tpu")
    assert "__gpu$xla.gpu.triton" in text and "tpu_custom_call" in text
    assert _kernel_names(text) == {"layer_norm_fwd", "layer_norm_bwd", "softmax_fwd", "softmax_bwd"}
    with rf.kernels.use("reference"):
        want = rf.grad(_loss, argnums=(0, 1))(x, w)
    chex.assert_trees_all_close(exported.call(x, w), want, rtol=1e-6, atol=1e-7)
    # the other modes, exported from this CPU-only process (on a GPU host "auto" is "pallas")
    plain = dict(platforms=["cpu", "cuda", "tpu"])
    for mode in ("auto", "reference") if jax.default_backend() == "cpu" else ("reference",):
        with rf.kernels.use(mode):
            text = jax.export.export(jax.jit(rf.grad(_loss)), **plain)(x, w).mlir_module()
        assert "custom_call" not in text and not _kernel_names(text), mode
    with rf.kernels.use("interpret"):
        exported = jax.export.export(jax.jit(rf.grad(_loss)), **plain)(x, w)
    assert "custom_call" not in exported.mlir_module()  # the interpreter is plain XLA ops
    chex.assert_trees_all_close(exported.call(x, w), want[0], rtol=1e-5, atol=1e-6)


def test_interpret_target_switches_block_shapes(x):
    from rumus_fx.kernels import blocks

    def block_shapes():
        (eqn,) = pallas_calls(softmax.softmax_fwd, jnp.zeros((3, 1100)))
        return [
            tuple(getattr(b, "block_size", None) for b in m.block_shape)
            for m in eqn.params["grid_mapping"].block_mappings
        ]

    with rf.kernels.use("interpret"):
        gpu = block_shapes()
        with dispatch.interpret_target(blocks.TPU):
            tpu = block_shapes()
    assert gpu[0] == (8, 2048) and tpu[0] == (8, 1152)
    with pytest.raises(ValueError, match="target"), dispatch.interpret_target("cpu"):
        pass


class TestStagedAutoOnCpu:
    """``auto`` with an accelerator in the process stages
    ``platform_dependent(cpu=reference, cuda/rocm/tpu=Pallas)``. Pretending an
    accelerator exists checks on CPU that the staged program traces, keeps the
    Pallas branches, and still lowers and runs here (lowering prunes them)."""

    @pytest.fixture(autouse=True)
    def staged(self, monkeypatch):
        monkeypatch.delenv("RUMUS_FX_KERNELS", raising=False)
        monkeypatch.setattr(dispatch, "_accelerator_present", lambda: True)

    def loss(self, x, w):
        y = rf.layer_norm(x, w, None)
        return rf.sum(rf.mul(rf.softmax(y, axis=-1), jnp.arange(5.0)))

    def test_program_holds_both_branches(self, x):
        program = rf.grad(self.loss, argnums=(0, 1))
        jaxpr = jax.make_jaxpr(program)(x, jnp.ones(5))
        calls = pallas_calls(program, x, jnp.ones(5))
        assert "platform_index" in str(jaxpr)
        # forward and backward kernels of layer norm and softmax, for GPU and for TPU
        assert len(calls) == 8
        params = {type(e.params["compiler_params"]).__module__.split(".")[-2] for e in calls}
        assert params == {"triton", "mosaic"}

    def test_runs_on_cpu_eager_jit_grad_vmap(self, x):
        w = jnp.linspace(0.5, 1.5, 5)
        with rf.kernels.use("reference"):
            want = rf.grad(self.loss, argnums=(0, 1))(x, w)
        for got in (
            rf.grad(self.loss, argnums=(0, 1))(x, w),
            jax.jit(rf.grad(self.loss, argnums=(0, 1)))(x, w),
        ):
            chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
        per_row = jax.vmap(rf.grad(self.loss), in_axes=(0, None))(x[:, None], w)
        assert per_row.shape == (3, 1, 5)

        def kernels(x, w):
            return jnp.sum(softmax.softmax_fwd(layer_norm.layer_norm_fwd(x, w, None)[0]) * jnp.arange(5.0)[None, :])

        def reference(x, w):
            y = layer_norm.layer_norm_fwd_reference(x, w, None, eps=1e-5)[0]
            return jnp.sum(jax.nn.softmax(y) * jnp.arange(5.0)[None, :])

        chex.assert_trees_all_close(jax.grad(jax.jit(kernels))(x, w), jax.grad(reference)(x, w), atol=1e-6)

    def test_exports_for_cpu(self, x):
        program = rf.grad(self.loss)
        exported = jax.export.export(jax.jit(program), platforms=("cpu",))(x, jnp.ones(5))
        assert "pallas" not in exported.mlir_module()
        cpu = jax.devices("cpu")[0]  # a GPU host's CPU device too
        with jax.default_device(cpu):
            xc, w = jax.device_put(x, cpu), jnp.ones(5)
            chex.assert_trees_all_close(exported.call(xc, w), program(xc, w), rtol=1e-6)


@pytest.mark.parametrize("op", ["softmax", "matmul", "layer_norm"])
def test_eager_kernel_dispatch_is_one_compiled_call(op):
    """Eagerly, with the kernels chosen (``pallas``; ``auto`` on a GPU), an op's
    choice of platform is inside its compiled call: a bare
    ``lax.platform_dependent`` bound its platform index one primitive at a time
    and read it back to the host on every call (seen on an H200 as
    ``platform_index`` in rf's eager-dispatch test)."""
    from tests._eager import primitives_bound_one_by_one

    rng = np.random.default_rng(0)
    x, w, g, b = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in ((8, 16), (16, 16), (16,), (16,)))
    fun, args = {
        "softmax": (lambda x: rf.sum(rf.softmax(x, axis=-1) * x), (x,)),
        "matmul": (lambda x, w: rf.sum(rf.matmul(x, w)), (x, w)),
        "layer_norm": (lambda x, g, b: rf.sum(rf.layer_norm(x, g, b) * x), (x, g, b)),
    }[op]
    vg = rf.value_and_grad(fun, argnums=tuple(range(len(args))))
    with rf.kernels.use("pallas"):
        assert primitives_bound_one_by_one(lambda: vg(*args)) == []
        got = vg(*args)
    want = vg(*args)  # the reference (this CPU's auto)
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)
