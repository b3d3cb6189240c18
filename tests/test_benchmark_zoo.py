"""The model zoo benchmark compares like with like: for each model rf and
jax.grad give the same loss and gradients, and its check catches a wrong
gradient. No timing here (speed lives in ``python -m benchmarks.zoo``)."""

import jax
import pytest

from benchmarks import zoo

FAST = {"haiku_mlp", "eqx_mlp"}


@pytest.mark.parametrize("key", [pytest.param(k, marks=() if k in FAST else pytest.mark.slow) for k in zoo.MODELS])
def test_zoo_model_agrees_with_jax_grad(key):
    """Each model as ``python -m benchmarks.zoo`` runs it, with jax's standard dtype
    promotion: the libraries' own code mixes dtypes (haiku's ResNet multiplies a
    float32 by an int32), which the suite's strict setting refuses."""
    with jax.numpy_dtype_promotion("standard"):
        model = zoo.MODELS[key]()
        assert zoo.check_same(model) < 1e-3


def test_check_same_catches_a_wrong_gradient(monkeypatch):
    model = zoo.haiku_mlp()
    real_steps = zoo.steps

    def wrong(m):
        vg_rf, vg_j = real_steps(m)

        def bad(*args):
            v, g = vg_rf(*args)
            leaves, tree = jax.tree_util.tree_flatten(g)
            leaves[0] = leaves[0] * 1.01  # one leaf 1 % off
            return v, jax.tree_util.tree_unflatten(tree, leaves)

        return bad, vg_j

    monkeypatch.setattr(zoo, "steps", wrong)
    with pytest.raises(AssertionError, match="differ"):
        zoo.check_same(model)


def test_table_reports_a_failing_model_as_a_row():
    model = zoo.haiku_mlp()
    run = {k: 1.0 for k in ("jit_ratio", "first_ratio", "mem_ratio", "eager_ratio", "jit_jax_ms")}
    run.update(mem_rf=2**20, mem_jax=2**20)
    table = zoo.format_table([(model, [run, dict(run, jit_ratio=1.2)]), (model, "fails: TypeError: boom")])
    assert "1.10 (1.00-1.20)" in table
    assert "fails: TypeError: boom" in table
    assert len(table.splitlines()) == 4  # header, rule, two rows
