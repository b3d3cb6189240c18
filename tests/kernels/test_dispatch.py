"""Kernel dispatch: modes, the environment variable, what ``auto`` picks on CPU,
and the ``platform_dependent`` path that ``auto`` stages with an accelerator."""

from __future__ import annotations

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
            assert rf.kernels.mode() == "pallas" and rf.kernels.backend() == "pallas"
        assert rf.kernels.mode() == "reference"
    assert rf.kernels.mode() == "interpret"
    monkeypatch.setenv("RUMUS_FX_KERNELS", "bogus")
    with pytest.raises(ValueError, match="unknown kernel mode"):
        rf.kernels.mode()
    with pytest.raises(ValueError, match="unknown kernel mode"), rf.kernels.use("gpu"):
        pass


def test_auto_picks_the_reference_on_cpu(monkeypatch, x):
    monkeypatch.delenv("RUMUS_FX_KERNELS", raising=False)
    assert jax.default_backend() == "cpu"
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


def test_pallas_mode_does_not_lower_on_cpu(x):
    with rf.kernels.use("pallas"), pytest.raises(Exception, match=r"(?i)interpret"):
        jax.block_until_ready(jax.jit(softmax.softmax_fwd)(x))


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
        chex.assert_trees_all_close(exported.call(x, jnp.ones(5)), program(x, jnp.ones(5)), rtol=1e-6)
