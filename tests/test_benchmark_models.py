"""The benchmark's two implementations of each model agree (loss and gradients),
so its timing ratios compare like with like. No timing here."""

import time

import jax
import numpy as np
import pytest

import rumus_fx as rf
from benchmarks.compare import check_same
from benchmarks.models import cnn, mlp, tiny_gpt


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: mlp(batch=16), id="mlp"),
        pytest.param(lambda: cnn(batch=4), id="cnn", marks=pytest.mark.slow),
        pytest.param(lambda: tiny_gpt(batch=2, seq=16), id="gpt", marks=pytest.mark.slow),
    ],
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
    [
        pytest.param(lambda: mlp(batch=16), id="mlp"),
        pytest.param(lambda: cnn(batch=4), id="cnn", marks=pytest.mark.slow),
        pytest.param(lambda: tiny_gpt(batch=2, seq=16), id="gpt", marks=pytest.mark.slow),
    ],
)
def test_lifted_benchmark_models_agree(make):
    """benchmarks/lifted.py differentiates each model's jnp code through rf.lift."""
    from benchmarks.lifted import lifted

    with jax.numpy_rank_promotion("allow"):
        loss_rf, loss_jax = check_same(lifted(make()))
    assert abs(loss_rf - loss_jax) < 1e-4


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: mlp(batch=16), id="mlp"),
        # the ops behind these are each checked by tests/ops/test_optable.py
        pytest.param(lambda: cnn(batch=4), id="cnn", marks=pytest.mark.slow),
        pytest.param(lambda: tiny_gpt(batch=2, seq=16), id="gpt", marks=pytest.mark.slow),
        pytest.param(lambda: _chain(), id="chain"),
    ],
)
def test_eager_steps_bind_no_primitive_one_by_one(make):
    """An eager step's forward, seed and backward are compiled calls only: a jnp
    function applied to a concrete array outside them binds its primitive
    through JAX's Python dispatch (20-60 µs each; rumus_fx/eager.py)."""
    from tests._eager import primitives_bound_one_by_one

    model = make()
    vg = rf.value_and_grad(model.loss_rf)
    assert primitives_bound_one_by_one(lambda: vg(model.params, model.batch)) == []


def _chain():
    from benchmarks.models import Model, chain_rf

    x = jax.numpy.linspace(-1.0, 1.0, 8)
    return Model("chain", lambda x, _: chain_rf(x, 12), None, x, None, None)


_ROW = {
    "model": "tiny",
    "jit_rf_ms": 2.0,
    "jit_jax_ms": 4.0,
    "jit_opt_ms": 1.5,
    "eager_rf_ms": 6.0,
    "flops": 1e8,
    "torch_ms": None,
    "torch_ratio": None,
}


def test_speed_table_prints_the_rf_columns_without_torch():
    """The machine table (FLOPs, bound fraction, rf columns) prints whether or not torch is installed."""
    from benchmarks.compare import format_speed_table

    table = format_speed_table([_ROW], gflops=100.0)
    row = table.splitlines()[-1]
    # 0.10 GFLOP at 100 GFLOP/s is a 1.00 ms bound, half of the 2.00 ms step
    assert "| tiny | 0.10 | 1.00 | 2.00 (0.50) | 1.50 | 4.00 |" in row
    assert "n/a (torch not installed)" in row and "| 6.0 |" in row
    with_torch = format_speed_table([{**_ROW, "torch_ms": 4.0, "torch_ratio": 1.5, "torch_jit_ratio": 0.5}], 100.0)
    assert "| 4.00 | 0.50 | 6.0 | 1.50 |" in with_torch


def test_speed_table_reads_the_block_timed_steps():
    """The speed table's rf steps are the block-timed ones (the eager ms beside
    PyTorch's ratio, the jit step and its bound fraction)."""
    from benchmarks.compare import format_speed_table, format_table

    row = {**_ROW, "torch_ms": 4.0, "torch_ratio": 1.25, "torch_jit_ratio": 0.5, "eager_rf_block_ms": 5.0}
    assert "| 4.00 | 0.50 | 5.0 | 1.25 |" in format_speed_table([row], 100.0)
    # the bound fraction of the block-timed jit step, where there is one
    assert "| 1.00 | 1.25 (0.80) | 1.50 |" in format_speed_table([{**row, "jit_rf_block_ms": 1.25}], 100.0)
    full = {**row, "jit_ratio": 0.5, "compile_ratio": 1.0, "eager_ratio": 1.0, "eager_jax_ms": 6.0}
    full.update(mem_ratio=1.0, mem_rf=2**20, mem_jax=2**20)
    assert "| 1.25 (5.0 / 4.0 ms) |" in format_table([full])


def test_blocks_take_turns_and_settle():
    """Each fn runs in blocks of its own (one untimed call, then the timed
    ones), the blocks taking turns, each settle after its fn's block."""
    from benchmarks.compare import _blocks

    log = []
    fns = [lambda: log.append("a"), lambda: log.append("b")]
    times = _blocks(fns, 2, 3, settle=[None, lambda: log.append("s")], warm_s=0.0)
    assert "".join(log) == "aaaabbbbsaaaabbbbs"
    assert [len(t) for t in times] == [6, 6] and all(x >= 0 for t in times for x in t)
    # With a warm-up time, untimed calls fill it before the timed ones: the
    # first timed call starts only once warm_s has passed since the block began
    # (checked on the calls' own clock, since a loaded machine can sleep longer
    # than asked and so fit fewer calls in the warm-up).
    starts = []
    t_begin = time.perf_counter()
    _blocks([lambda: starts.append(time.perf_counter()) or time.sleep(0.01)], 1, 2, warm_s=0.05)
    assert len(starts) >= 1 + 2
    assert starts[-2] >= t_begin + 0.05


def test_cost_analysis_counts_flops():
    from benchmarks.compare import cost_flops

    a = jax.numpy.ones((32, 16))
    compiled = jax.jit(lambda a: a @ a.T).lower(a).compile()
    assert cost_flops(compiled) == pytest.approx(2 * 32 * 32 * 16, rel=0.1)


def test_chain_per_op_reports_rf_forward_and_backward():
    from benchmarks.compare import chain_per_op, format_chain

    c = chain_per_op(repeats=1, n=9, with_torch=False)
    assert c["rf_fwd"] > 0 and c["rf_fwd_bwd"] > 0 and "torch_fwd" not in c
    assert "PyTorch n/a (torch not installed)" in format_chain(c)


def test_chain_per_op_with_torch():
    """The PyTorch columns, where torch is installed (skipped only when it is absent)."""
    pytest.importorskip("torch")
    from benchmarks.compare import chain_per_op, format_chain

    c = chain_per_op(repeats=1, n=9, with_torch=True)
    assert c["torch_fwd"] > 0 and c["torch_fwd_bwd"] > 0
    assert "rf / PyTorch" in format_chain(c)


def test_conv_grid_gemm_step_compares_the_plan_with_gemm_off():
    """``python -m benchmarks.conv_grid --gemm``: both steps give the same
    gradients (asserted inside), and the switch is put back."""
    from benchmarks.conv_grid import gemm_step_ratio
    from rumus_fx.ops import _conv_plan as P

    before = P.GEMM_MAX_C
    assert P.conv_plan(4, 3, 1, cols=P.cols_size(2, 4, 6, 6, 3, 1, 1))[0] == "gemm"
    t_plan, t_off = gemm_step_ratio(2, 4, 4, 6, 1, rounds=1)
    assert t_plan > 0 and t_off > 0 and P.GEMM_MAX_C == before


def test_chain_only_prints_the_chain_line_alone(monkeypatch, capsys):
    from benchmarks import compare

    monkeypatch.setattr(compare, "chain_per_op", lambda with_torch=None: {"n": 9, "rf_fwd": 1.0, "rf_fwd_bwd": 2.0})
    monkeypatch.setattr(compare, "matmul_gflops", lambda: pytest.fail("the models are not measured"))
    compare.main(["--chain-only"])
    out = capsys.readouterr().out
    assert "9-op chain, µs per op: rf forward 1.0, forward+backward 2.0" in out
