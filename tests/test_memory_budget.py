"""``memory_budget=`` of rf.grad / rf.value_and_grad / rf.Tape: segments are
rematerialised so the saved activations fit the budget, the gradients stay
those of jax.grad (and of the unbudgeted rf.grad), and the compiled program's
temporary memory falls as the budget falls."""

import itertools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf
from rumus_fx.lift import budget
from rumus_fx.lift.budget import MemoryBudgetWarning, memory_plan

BUDGETS = (1.0, 0.5, 0.25)
DEPTH, WIDTH, BATCH = 6, 16, 8


def _params(dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), DEPTH + 1)
    ws = [(jax.random.normal(k, (WIDTH, WIDTH)) * 0.3).astype(dtype) for k in keys[:DEPTH]]
    x = jax.random.normal(keys[DEPTH], (BATCH, WIDTH)).astype(dtype)
    return ws, x


def mlp_rf(ws, x):
    h = x
    for w in ws:
        z = h @ w
        h = rf.tanh(z) * 0.5 + rf.sigmoid(z) * rf.exp(z * -0.5)
    return rf.mean(h * h)


def mlp_jax(ws, x):
    h = x
    for w in ws:
        z = h @ w
        h = jnp.tanh(z) * 0.5 + jax.nn.sigmoid(z) * jnp.exp(z * -0.5)
    return jnp.mean(h * h)


def _close(a, b, rtol=2e-5, atol=1e-6):
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol)


def _quiet(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemoryBudgetWarning)
        return fn(*args)


@pytest.mark.parametrize("argnums", [0, 1, (0, 1)])
@pytest.mark.parametrize("budget", BUDGETS)
def test_gradients_equal_unbudgeted_and_jax_grad(budget, argnums):
    ws, x = _params()
    expected = jax.grad(mlp_jax, argnums)(ws, x)
    plain = rf.grad(mlp_rf, argnums)(ws, x)
    got = _quiet(rf.grad(mlp_rf, argnums, memory_budget=budget), ws, x)
    _close(got, expected)
    _close(got, plain)


@pytest.mark.parametrize("budget", [0.5, 0.25])
def test_under_jit_gradients_equal(budget):
    ws, x = _params()
    got = _quiet(jax.jit(rf.grad(mlp_rf, (0, 1), memory_budget=budget)), ws, x)
    _close(got, jax.grad(mlp_jax, (0, 1))(ws, x))


def test_float64_finite_differences(x64):
    ws, x = _params(jnp.float64)
    g = _quiet(rf.grad(mlp_rf, 1, memory_budget=0.25), ws, x)
    assert g.dtype == jnp.float64
    d = jax.random.normal(jax.random.key(3), x.shape, jnp.float64)
    eps = 1e-6
    fd = (mlp_jax(ws, x + eps * d) - mlp_jax(ws, x - eps * d)) / (2 * eps)
    np.testing.assert_allclose(float(jnp.vdot(g, d)), float(fd), rtol=1e-6)


def _temp(budget):
    ws, x = _params()
    f = jax.jit(rf.grad(mlp_rf, (0, 1), memory_budget=budget))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemoryBudgetWarning)
        return f.lower(ws, x).compile().memory_analysis().temp_size_in_bytes


def test_compiled_temp_memory_falls_with_the_budget():
    temps = [_temp(b) for b in BUDGETS]
    assert temps[0] == _temp(None)  # 100 %: the unbudgeted program
    assert all(b <= a for a, b in itertools.pairwise(temps)), temps
    assert temps[-1] < temps[0], temps


def test_plan_fits_the_budget():
    ws, x = _params()
    plan = memory_plan(mlp_rf, 0.5, argnums=(0, 1))(ws, x)
    assert plan.on == "records"  # written with rf ops: planned on rf's own records
    assert plan.met and plan.planned_bytes <= plan.budget_bytes < plan.base_bytes
    assert plan.segments and 0 < plan.recompute_flops < plan.forward_flops
    full = memory_plan(mlp_rf, 1.0, argnums=(0, 1))(ws, x)
    assert not full.segments and full.planned_bytes == full.base_bytes
    assert "segments" in str(plan)


def test_lifted_function_recomputes_cheap_work_first():
    ws, x = _params()
    lifted = rf.lift(mlp_jax)
    plan = memory_plan(lifted, 0.75, argnums=(0, 1))(ws, x)
    assert plan.on == "primitives"  # one lifted call: planned primitive by primitive
    assert plan.met and plan.segments
    # a quarter of the activations is freed by recomputing elementwise work
    # alone: no matmul (2 * BATCH * WIDTH**2 FLOPs each) is recomputed
    assert plan.recompute_flops < 2 * BATCH * WIDTH * WIDTH
    got = rf.grad(lifted, (0, 1), memory_budget=0.75)(ws, x)
    _close(got, jax.grad(mlp_jax, (0, 1))(ws, x))
    temps = [
        jax.jit(rf.grad(lifted, (0, 1), memory_budget=b)).lower(ws, x).compile().memory_analysis().temp_size_in_bytes
        for b in (None, 0.75)
    ]
    assert temps[1] < temps[0], temps


def test_bytes_budget_and_fraction_agree():
    ws, x = _params()
    base = memory_plan(mlp_rf, 1.0)(ws, x).base_bytes
    by_bytes = memory_plan(mlp_rf, base // 2)(ws, x)
    by_fraction = memory_plan(mlp_rf, 0.5)(ws, x)
    assert by_bytes.segments == by_fraction.segments
    _close(rf.grad(mlp_rf, memory_budget=base // 2)(ws, x), jax.grad(mlp_jax)(ws, x))


def test_unmet_budget_warns_with_what_it_achieves():
    ws, x = _params()
    with pytest.warns(MemoryBudgetWarning, match="cannot be met.*keeps about"):
        g = rf.grad(mlp_rf, memory_budget=1)(ws, x)
    _close(g, jax.grad(mlp_jax)(ws, x))


def test_has_aux_and_value():
    ws, x = _params()

    def f(ws, x):
        loss = mlp_rf(ws, x)
        return loss, {"twice": loss * 2.0, "n": 3}

    (v, aux), g = rf.value_and_grad(f, (0, 1), has_aux=True, memory_budget=0.5)(ws, x)
    np.testing.assert_allclose(float(v), float(mlp_jax(ws, x)), rtol=1e-6)
    np.testing.assert_allclose(float(aux["twice"]), 2 * float(v), rtol=1e-6)
    assert aux["n"] == 3
    _close(g, jax.grad(mlp_jax, (0, 1))(ws, x))
    g2, aux2 = rf.grad(f, has_aux=True, memory_budget=0.5)(ws, x)
    _close(g2, jax.grad(mlp_jax)(ws, x))
    assert aux2["n"] == 3


def test_tape_api():
    ws, x = _params()
    with rf.Tape(memory_budget=0.5) as tape:
        ts = [rf.tensor(w, requires_grad=True) for w in ws]
        xt = rf.tensor(x, requires_grad=True)
        loss = tape.run(mlp_rf, ts, xt)
    assert tape.memory_budget == 0.5
    assert "RematBackward" in str(tape)
    grads = tape.backward(loss)
    expected = jax.grad(mlp_jax, (0, 1))(ws, x)
    _close([grads[t] for t in ts], expected[0])
    _close(grads[xt], expected[1])


def test_tape_without_run_warns_that_the_budget_did_nothing():
    with rf.Tape(memory_budget=0.5) as tape:
        w = rf.tensor(jnp.ones(3), requires_grad=True)
        loss = rf.sum(rf.tanh(w))
    with pytest.warns(RuntimeWarning, match="tape.run"):
        tape.backward(loss)


def test_tape_run_outside_the_tape_raises():
    tape = rf.Tape(memory_budget=0.5)
    with pytest.raises(rf.AutogradError, match="inside"):
        tape.run(mlp_rf, *_params())


@pytest.mark.parametrize("bad", [-1, 0, 0.0, -0.5, 1.5, float("nan")])
def test_bad_budget_values_raise_value_error(bad):
    with pytest.raises(ValueError, match="memory_budget"):
        rf.grad(mlp_rf, memory_budget=bad)
    with pytest.raises(ValueError, match="memory_budget"):
        rf.Tape(memory_budget=bad)


@pytest.mark.parametrize("bad", ["50%", True, [0.5]])
def test_bad_budget_types_raise_type_error(bad):
    with pytest.raises(TypeError, match="memory_budget"):
        rf.value_and_grad(mlp_rf, memory_budget=bad)
    with pytest.raises(TypeError, match="memory_budget"):
        rf.Tape(memory_budget=bad)


def test_tape_run_input_written_in_place_before_backward_raises():
    """tape.run keeps version snapshots of its inputs: an in-place write between
    the call and backward is caught, never a silently wrong gradient."""
    ws, x = _params()
    with rf.Tape(memory_budget=0.5) as tape:
        ts = [rf.tensor(w, requires_grad=True) for w in ws]
        xt = rf.tensor(x)
        loss = tape.run(mlp_rf, ts, xt)
    xt.add_(1.0)
    with pytest.raises(rf.VersionMismatch):
        tape.backward(loss)


def test_segment_records_rebuilt_from_the_recomputed_forward():
    """A function written with rf ops is planned on its own records: the tape of
    a budgeted value_and_grad holds segments of rf records, not primitives."""
    ws, x = _params()
    seen = []
    real = budget.run_on_records

    def spy(tape, *a, **k):
        out = real(tape, *a, **k)
        seen.extend(e.op for e in tape._entries)
        return out

    budget.run_on_records = spy
    try:
        rf.grad(mlp_rf, memory_budget=0.5)(ws, x)
    finally:
        budget.run_on_records = real
    names = {type(r).__name__ for r in seen}
    assert "RecordSegmentBackward" in names and "MatmulBackward" in names
    seg = next(r for r in seen if type(r).__name__ == "RecordSegmentBackward")
    assert "TanhBackward" in seg.label


@pytest.mark.slow  # about 20 s on 2 shared cores (three programs compiled)
def test_gpt_written_with_rf_ops_planned_on_its_records():
    """Layer norm, attention, embedding and cross-entropy records rebuilt from
    the recomputed forward give jax.grad's gradients, and the compiled program
    needs less temporary memory than without a budget."""
    from benchmarks.models import tiny_gpt

    m = tiny_gpt(batch=2, seq=16, d=32, heads=2, blocks=3)
    plan = memory_plan(m.loss_rf, 0.5)(m.params, m.batch)
    assert plan.on == "records" and plan.segments
    f = jax.jit(rf.grad(m.loss_rf, memory_budget=0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemoryBudgetWarning)
        got = f(m.params, m.batch)
        temp = f.lower(m.params, m.batch).compile().memory_analysis().temp_size_in_bytes
    with jax.numpy_rank_promotion("allow"):
        expected = jax.grad(m.loss_jax)(m.params, m.batch)
    _close(got, expected, rtol=1e-4, atol=1e-6)
    plain = jax.jit(rf.grad(m.loss_rf)).lower(m.params, m.batch).compile().memory_analysis().temp_size_in_bytes
    assert temp < plain, (temp, plain)


def test_in_place_write_inside_the_function_is_differentiated_as_traced():
    """Under a budget the function runs as its traced program: an in-place write
    to a saved value inside it is computed with the value the op saw (jax.grad
    of the same code), where the unbudgeted tape refuses it (VersionMismatch)."""

    def f(x):
        h = rf.tanh(x * 2.0)
        z = rf.tanh(rf.exp(h) * 1.5)
        h.add_(1.0)  # after tanh and exp saved h
        return rf.sum(z * h)

    def oracle(x):
        h = jnp.tanh(x * 2.0)
        return jnp.sum(jnp.tanh(jnp.exp(h) * 1.5) * (h + 1.0))

    x = jnp.linspace(-1.0, 1.0, 8)
    with pytest.raises(rf.VersionMismatch):
        rf.grad(f)(x)
    for fraction in (0.5, 0.25):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MemoryBudgetWarning)
            got = rf.grad(f, memory_budget=fraction)(x)
        np.testing.assert_allclose(got, jax.grad(oracle)(x), rtol=1e-5, atol=1e-6)


# -- Note [Recomputation kept apart]: XLA:CPU must not merge the recomputation back ----------


def _chain_params(depth=6, width=128, batch=256):
    keys = jax.random.split(jax.random.key(3), depth + 1)
    ws = [jax.random.normal(k, (width, width)) * (0.5 / width**0.5) for k in keys[:depth]]
    return ws, jax.random.normal(keys[depth], (batch, width))


def _chain_layer_jnp(w, h):
    return jnp.tanh(jnp.tanh(h @ w) * 1.5 + 0.1)


def _chain(layer, total=jnp.sum):
    def loss(ws, x):
        h = x
        for w in ws:
            h = layer(w, h)
        return total(h * h)

    return loss


def _compiled_temp(g, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemoryBudgetWarning)
        return jax.jit(g).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("argnums", [0, 1, (0, 1)])
def test_rf_checkpoint_recomputes_its_matmuls_under_jit(argnums):
    """rf.checkpoint around each layer: under jit the compiled program needs far less
    temporary memory than without it (XLA:CPU merged the recomputed matmuls back into
    the forward when only a barrier separated them: 1.00x), and the gradients are
    jax.grad's, for each argument alone and both."""
    ws, x = _chain_params()
    plain = _chain(_chain_layer_jnp)
    ckpt = _chain(rf.checkpoint(_chain_layer_jnp), rf.sum)
    want = jax.grad(plain, argnums=argnums)(ws, x)
    _close(jax.jit(rf.grad(ckpt, argnums=argnums))(ws, x), want, rtol=1e-4, atol=1e-5)
    _close(rf.grad(ckpt, argnums=argnums)(ws, x), want, rtol=1e-4, atol=1e-5)
    kept = _compiled_temp(rf.grad(ckpt, argnums=argnums), ws, x)
    full = _compiled_temp(rf.grad(rf.lift(plain), argnums=argnums), ws, x)
    assert kept < 0.75 * full, (kept, full)


def test_users_jax_checkpoint_keeps_jax_grads_program():
    """A jax.checkpoint written in the user's function is differentiated as jax.grad
    differentiates it (the barrier alone): the same compiled temporary memory."""
    ws, x = _chain_params()
    loss = _chain(jax.checkpoint(_chain_layer_jnp))
    _close(rf.grad(rf.lift(loss))(ws, x), jax.grad(loss)(ws, x), rtol=1e-4, atol=1e-5)
    assert _compiled_temp(rf.grad(rf.lift(loss)), ws, x) == _compiled_temp(jax.grad(loss), ws, x)


def _barriers(g, *args):
    text = jax.jit(g).lower(*args).as_text()
    return sorted(re.findall(r"stablehlo\.optimization_barrier (.*?) :", text))


@pytest.mark.parametrize("prevent_cse", [True, False])
def test_users_jax_checkpoint_has_jax_grads_barriers(prevent_cse):
    """The cause behind the test above, visible on any XLA: rf's backward of a user's
    jax.checkpoint holds jax.grad's optimisation barriers, operand for operand:
    the inputs and the cotangents (jax's remat_transpose pins both; with only the
    inputs pinned, XLA:CPU of jax 0.11 scheduled the recomputation in the forward),
    and none with prevent_cse=False."""
    ws, x = _chain_params(depth=2)
    loss = _chain(jax.checkpoint(_chain_layer_jnp, prevent_cse=prevent_cse))
    want = _barriers(jax.grad(loss), ws, x)
    assert len(want) == (2 if prevent_cse else 0)
    assert [b.count("%") for b in _barriers(rf.grad(rf.lift(loss)), ws, x)] == [b.count("%") for b in want]


def test_budget_lowers_compiled_memory_well_below_unbudgeted():
    """With the recomputation kept apart, the budget's plan shows in the compiled
    program: at 50 % and 25 % of the saved bytes the temporary memory falls well
    below the unbudgeted program's (before: 0.85-0.89x on a GPT), never rising as
    the budget falls."""
    ws, x = _chain_params()

    def loss_rf(ws, x):
        h = x
        for w in ws:
            h = rf.tanh(rf.tanh(h @ w) * 1.5 + 0.1)
        return rf.sum(h * h)

    temps = [_compiled_temp(rf.grad(loss_rf, memory_budget=b), ws, x) for b in BUDGETS]
    lifted = [_compiled_temp(rf.grad(rf.lift(_chain(_chain_layer_jnp)), memory_budget=b), ws, x) for b in BUDGETS]
    for t in (temps, lifted):
        assert all(b <= a for a, b in itertools.pairwise(t)), t
        assert t[1] < 0.75 * t[0], t


@pytest.mark.parametrize("how", ["vmap", "jvp", "grad_of_grad"])
def test_kept_apart_recomputation_composes(how, x64):
    """The conditional that keeps a recomputation apart composes: per-example
    gradients under vmap (a batched predicate: both branches, the same values), a
    Hessian-vector product with jax.jvp, and a second rf.grad, all under jit and
    against jax of the plain function."""
    ws, x = _chain_params(depth=3, width=8, batch=4)
    ws = [w.astype(jnp.float64) for w in ws]
    x = x.astype(jnp.float64)
    plain = _chain(_chain_layer_jnp)
    ckpt = _chain(rf.checkpoint(_chain_layer_jnp), rf.sum)
    if how == "vmap":
        got = jax.jit(jax.vmap(rf.grad(ckpt), in_axes=(None, 0)))(ws, x[:, None, :])
        want = jax.vmap(jax.grad(plain), in_axes=(None, 0))(ws, x[:, None, :])
    elif how == "jvp":
        t = [jnp.ones_like(w) for w in ws]
        got = jax.jit(lambda ws: jax.jvp(lambda v: rf.grad(ckpt)(v, x), (ws,), (t,))[1])(ws)
        want = jax.jvp(lambda v: jax.grad(plain)(v, x), (ws,), (t,))[1]
    else:
        got = jax.jit(rf.grad(lambda x: rf.sum(rf.grad(ckpt, argnums=1)(ws, x) ** 2)))(x)
        want = jax.grad(lambda x: jnp.sum(jax.grad(plain, argnums=1)(ws, x) ** 2))(x)
    _close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.slow  # about 20 s on 2 shared cores (six programs compiled)
def test_gpt_quarter_budget_is_met_and_compiles_small():
    """The 4-block GPT at 25 % of its saved bytes, written with rf ops and as lifted
    plain JAX: the plan fits the budget (it floored at 33-36 % while XLA:CPU merged the
    recomputation back and the estimate charged twice a walked segment's bytes), and
    the compiled program needs under 0.4x the unbudgeted one's temporary memory
    (0.28-0.29x here), with jax.grad's gradients."""
    from benchmarks.models import gpt_loss_jax, tiny_gpt

    m = tiny_gpt(batch=4, seq=32, d=64, heads=2, blocks=4)
    args = (m.params, m.batch)
    with jax.numpy_rank_promotion("allow"):
        expected = jax.grad(m.loss_jax)(*args)
        for loss in (m.loss_rf, rf.lift(gpt_loss_jax(2))):
            plan = memory_plan(loss, 0.25)(*args)
            assert plan.met and plan.segments, plan
            g = jax.jit(rf.grad(loss, memory_budget=0.25))
            _close(g(*args), expected, rtol=1e-4, atol=1e-6)
            temp = g.lower(*args).compile().memory_analysis().temp_size_in_bytes
            plain = jax.jit(rf.grad(loss)).lower(*args).compile().memory_analysis().temp_size_in_bytes
            assert temp < 0.4 * plain, (temp, plain)
