"""The benchmark's two implementations of each model agree (loss and gradients),
so its timing ratios compare like with like. No timing here."""

import jax
import numpy as np
import pytest

import rumus_fx as rf
from benchmarks.compare import check_same
from benchmarks.models import cnn, mlp, tiny_gpt


@pytest.mark.parametrize(
    "make",
    [lambda: mlp(batch=16), lambda: cnn(batch=4), lambda: tiny_gpt(batch=2, seq=16)],
    ids=["mlp", "cnn", "gpt"],
)
def test_rf_and_jax_models_agree(make):
    model = make()
    # the jax.grad side is idiomatic jnp code, which relies on rank promotion
    with jax.numpy_rank_promotion("allow"):
        loss_rf, loss_jax = check_same(model)
    assert np.isfinite(loss_rf) and abs(loss_rf - loss_jax) < 1e-4
    # eager rf gives the same gradients as its jitted step
    v_eager, g_eager = rf.value_and_grad(model.loss_rf)(model.params, model.batch)
    v_jit, g_jit = jax.jit(rf.value_and_grad(model.loss_rf))(model.params, model.batch)
    np.testing.assert_allclose(v_eager, v_jit, rtol=1e-5)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g_eager, g_jit)


@pytest.mark.parametrize(
    "make",
    [lambda: mlp(batch=16), lambda: cnn(batch=4), lambda: tiny_gpt(batch=2, seq=16)],
    ids=["mlp", "cnn", "gpt"],
)
def test_lifted_benchmark_models_agree(make):
    """benchmarks/lifted.py differentiates each model's jnp code through rf.lift."""
    from benchmarks.lifted import lifted

    with jax.numpy_rank_promotion("allow"):
        loss_rf, loss_jax = check_same(lifted(make()))
    assert abs(loss_rf - loss_jax) < 1e-4
