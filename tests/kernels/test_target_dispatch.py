"""Dispatch decides for the platform a program is lowered for, not the process
that traces it; a kernel that cannot be built for the running jax falls back
(``auto``, one warning) or raises (``pallas``)."""

from __future__ import annotations

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as _pallas  # noqa: F401 - jax.experimental.pallas loaded

import rumus_fx as rf
from rumus_fx.kernels import dispatch

from ._backends import hide_triton
from ._jaxpr import pallas_calls

TRITON = "__gpu$xla.gpu.triton"


def _loss(x, w):
    y = rf.matmul(x, w)
    return rf.sum(rf.mul(y, y))  # needs the forward product, so no kernel is dead code


@pytest.fixture
def xw():
    rng = np.random.default_rng(0)
    return (
        jnp.asarray(rng.standard_normal((16, 32)), jnp.float32),
        jnp.asarray(rng.standard_normal((32, 8)), jnp.float32),
    )


def _export(fn, args, platforms):
    return jax.export.export(
        jax.jit(fn), platforms=platforms, disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)]
    )(*args)


@pytest.mark.parametrize("platform,marker", [("cuda", TRITON), ("tpu", "tpu_custom_call")])
def test_pallas_mode_exports_all_three_matmul_kernels_from_cpu(xw, platform, marker):
    """A 2-D matmul's gradient: the forward product, ``dx = g w^T`` and the
    weight gradient ``x^T g`` (``_contract_rows``), which used to be an XLA dot
    because the CPU process that traced it had no accelerator."""
    with rf.kernels.use("pallas"):
        text = _export(rf.grad(_loss, argnums=(0, 1)), xw, [platform]).mlir_module()
    assert text.count(marker) == 3
    assert "stablehlo.dot_general" not in text


def test_pallas_mode_weight_gradient_runs_the_reference_on_cpu(xw):
    with rf.kernels.use("reference"):
        want = rf.grad(_loss, argnums=(0, 1))(*xw)
    with rf.kernels.use("pallas"):
        got = rf.grad(_loss, argnums=(0, 1))(*xw)
        assert len(pallas_calls(rf.grad(_loss, argnums=(0, 1)), *xw)) == 6  # 3 kernels, GPU and TPU
    chex.assert_trees_all_close(got, want, rtol=1e-6)


def test_weight_gradient_kernel_in_interpret_mode_with_leading_axes():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 5, 7)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((7, 3)), jnp.float32)

    def loss(x, w):
        return rf.sum(rf.tanh(rf.matmul(x, w)))

    with rf.kernels.use("interpret"):
        calls = pallas_calls(rf.grad(loss, argnums=1), x, w)
        got = rf.grad(loss, argnums=1)(x, w)
    assert len(calls) == 2  # forward and weight gradient (dx not asked for)
    want = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.fixture
def no_triton(monkeypatch):
    """This jax without Pallas' Triton backend (as after its removal): its
    import fails. An accelerator is pretended, so ``auto`` stages the kernels."""
    hide_triton(monkeypatch)
    monkeypatch.setattr(dispatch, "_accelerator_present", lambda: True)
    monkeypatch.setattr(dispatch, "MOSAIC_GPU", {})  # no Mosaic GPU variant either
    monkeypatch.delenv("RUMUS_FX_KERNELS", raising=False)


@pytest.fixture(autouse=True)
def _fresh_traces():
    yield
    jax.clear_caches()


def test_auto_falls_back_to_the_reference_with_one_warning(no_triton, xw):
    with rf.kernels.use("reference"):
        want = rf.grad(_loss, argnums=(0, 1))(*xw)
    with pytest.warns(rf.kernels.KernelFallbackWarning, match=r"'matmul'.*Triton backend is not in jax") as record:
        got = jax.jit(rf.grad(_loss, argnums=(0, 1)))(*xw)  # traced: every branch is built
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per kernel and reason
        again = jax.jit(rf.grad(_loss, argnums=(0, 1)))(*xw)
        eager = rf.grad(_loss, argnums=(0, 1))(*xw)
    assert len([w for w in record if issubclass(w.category, rf.kernels.KernelFallbackWarning)]) == 1
    chex.assert_trees_all_close(got, want, rtol=1e-6)
    chex.assert_trees_all_close(again, want, rtol=1e-6)
    chex.assert_trees_all_close(eager, want, rtol=1e-6)
    # the cuda branch holds the reference, the tpu branch still the kernels
    calls = pallas_calls(rf.grad(_loss, argnums=(0, 1)), *xw)
    assert len(calls) == 3
    assert {type(e.params["compiler_params"]).__module__.split(".")[-2] for e in calls} == {"mosaic"}
    text = jax.export.export(jax.jit(rf.grad(_loss, argnums=(0, 1))), platforms=["cuda"])(*xw).mlir_module()
    assert TRITON not in text and "stablehlo.dot_general" in text


def test_pallas_mode_raises_a_clear_error(no_triton, xw):
    with rf.kernels.use("pallas"), pytest.raises(rf.kernels.KernelUnavailable, match="'matmul' cannot be built"):
        jax.jit(rf.grad(_loss, argnums=(0, 1)))(*xw)
    with rf.kernels.use("pallas"), pytest.raises(rf.kernels.KernelUnavailable, match="Triton"):
        jax.jit(lambda x: rf.softmax(x, axis=-1))(xw[0])


def _warns_like_jax_011(message: str):
    """A kernel body that warns as jax 0.11's Triton lowering does, once per trace."""

    def native(x):
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return [x * 2.0]

    return native


TRITON_WARNING = (
    "The Pallas Triton backend is deprecated and will be removed in a future JAX version. "
    "To keep using Pallas on GPU, please migrate to the Mosaic GPU backend."
)


@pytest.mark.parametrize("how", ["jit", "eager"])
def test_jax_deprecation_of_triton_is_silenced_while_rf_lowers_its_kernels_only(how):
    """jax 0.11 warns at each lowering of a Triton pallas_call; rf's choice of
    backend is not its user's to act on, so that one message is silenced where rf
    lowers its own kernels (under an 'error' filter a step would otherwise fail),
    and a user's own kernel or any other warning still shows."""
    from rumus_fx.kernels._platform import native_or_interpret

    x = jnp.arange(3.0)
    aval = (jax.ShapeDtypeStruct((3,), jnp.float32),)

    def run(native):
        if how == "jit":
            return jax.jit(lambda x: native_or_interpret(native, native, ("cpu",), aval, x))(x)[0]
        return native_or_interpret(native, native, ("cpu",), aval, x)[0]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(run(_warns_like_jax_011(TRITON_WARNING)), [0.0, 2.0, 4.0])
        with pytest.raises(DeprecationWarning, match="Triton backend is deprecated"):
            _warns_like_jax_011(TRITON_WARNING)(x)  # outside rf's lowering: the user sees it
        with pytest.raises(DeprecationWarning, match="something else"):
            run(_warns_like_jax_011("something else is deprecated"))
