"""Whole programs on the tape: lifted jnp models, JAX boundaries, control flow,
user-written backward rules, rematerialisation and higher-order gradients —
each against jax.grad of the same jnp program."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import rumus_fx as rf
import rumus_fx.numpy as rnp
from rumus_fx.testing import check_grads
from tests.ops.test_special import MERGE_CASES


def _close(a, b, tol=2e-5):
    chex.assert_trees_all_close(a, b, rtol=tol, atol=tol)


def _key(i):
    return jax.random.key(i)


# -- whole programs ---------------------------------------------------------------


def mlp_loss(params, x, y):
    h = x
    for i, (w, b) in enumerate(params):
        h = h @ w + b[None, :]
        if i < len(params) - 1:
            h = jax.nn.gelu(h)
    return -jnp.mean(jax.nn.log_softmax(h) * y)


def _mlp_params():
    ks = jax.random.split(_key(0), 3)
    return [(jax.random.normal(k, (m, n)) / m**0.5, jnp.zeros(n)) for k, (m, n) in zip(ks, ((5, 8), (8, 8), (8, 3)))]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_pure_jnp_mlp(jit):
    params = _mlp_params()
    x = jax.random.normal(_key(1), (4, 5))
    y = jax.nn.one_hot(jnp.array([0, 2, 1, 0]), 3)
    g = rf.grad(rf.lift(mlp_loss))
    if jit:
        g = jax.jit(g)
    _close(g(params, x, y), rf.testing.jax_oracle_grad(mlp_loss, (params, x, y)))


def transformer_block(p, x):
    def ln(v, g):
        mu = jnp.mean(v, -1, keepdims=True)
        return (v - mu) * lax.rsqrt(jnp.var(v, -1, keepdims=True) + 1e-5) * g[None, None, :]

    h = ln(x, p["g1"])
    q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
    s = q @ jnp.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones((x.shape[-2], x.shape[-2]), bool))
    s = jnp.where(mask[None], s, -1e9)
    x = x + jax.nn.softmax(s, axis=-1) @ v @ p["o"]
    h = ln(x, p["g2"])
    return x + jax.nn.silu(h @ p["w1"]) @ p["w2"]


def test_transformer_block_lifted():
    d = 8
    ks = jax.random.split(_key(2), 5)
    p = {
        "g1": jnp.ones(d),
        "g2": jnp.ones(d),
        "qkv": jax.random.normal(ks[0], (d, 3 * d)) * 0.3,
        "o": jax.random.normal(ks[1], (d, d)) * 0.3,
        "w1": jax.random.normal(ks[2], (d, 2 * d)) * 0.3,
        "w2": jax.random.normal(ks[3], (2 * d, d)) * 0.3,
    }
    x = jax.random.normal(ks[4], (2, 5, d))

    def loss(p, x):
        return jnp.sum(transformer_block(p, x) ** 2)

    _close(rf.grad(rf.lift(loss))(p, x), rf.testing.jax_oracle_grad(loss, (p, x)), 1e-4)
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda a: a.astype(jnp.float64), p)
        x64 = x.astype(jnp.float64)
        chex.assert_trees_all_close(
            rf.grad(rf.lift(loss))(p64, x64), rf.testing.jax_oracle_grad(loss, (p64, x64)), rtol=1e-10, atol=1e-10
        )


def test_rnp_model_records_fused_ops():
    x = jax.random.normal(_key(3), (4, 3))
    w = jax.random.normal(_key(4), (3, 5))

    def loss(w):
        return rnp.sum(rnp.tanh(rnp.matmul(x, w)) ** 2)

    with rf.Tape() as tape:
        wt = rf.tensor(w, requires_grad=True)
        loss(wt)
    names = [e.op.name for e in tape.entries]
    assert names[:2] == ["MatmulBackward", "TanhBackward"], names
    _close(rf.grad(loss)(w), jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w))


def test_tape_table_names_primitive_records():
    with rf.Tape() as tape:
        x = rf.tensor(jnp.ones((2, 3)), requires_grad=True)
        rf.lift(lambda v: jnp.sum(jnp.sin(v) * 2.0))(x)
    text = str(tape)
    assert "LiftedBackward" in text and "SinBackward" in text and "ReduceSumBackward" in text
    assert tape.saved_bytes == 2 * 3 * 4  # sin saves its input, nothing else


def test_closure_over_tracked_tensor_is_captured():
    w = jnp.array([1.0, 2.0, 3.0])
    x = jnp.array([0.5, -1.0, 2.0])

    def loss(w):
        return rf.lift(lambda v: jnp.sum(jnp.sin(v * w)))(x)  # w is closed over, tracked

    _close(rf.grad(loss)(w), jax.grad(lambda w: jnp.sum(jnp.sin(x * w)))(w))


def test_stax_models():
    from jax.example_libraries import stax

    init, apply = stax.serial(
        stax.Conv(4, (3, 3), padding="SAME"), stax.Relu, stax.Flatten, stax.Dense(8), stax.Tanh, stax.Dense(3),
        stax.LogSoftmax,
    )  # fmt: skip
    x = jax.random.normal(_key(6), (2, 6, 6, 1))
    with jax.numpy_rank_promotion("allow"):  # stax's Dense relies on rank promotion
        _, params = init(_key(5), (2, 6, 6, 1))

        def loss(p):
            return -jnp.mean(apply(p, x)[:, 0])

        _close(rf.grad(rf.lift(loss))(params), rf.testing.jax_oracle_grad(loss, (params,)), 1e-4)


def _rules():
    from rumus_fx.lift.rules import RULES

    return RULES


# -- JAX boundaries -----------------------------------------------------------------


def test_jit_vmap_eval_shape_of_a_model():
    model = rf.nn.Sequential([rf.nn.Linear(3, 4), rf.relu, rf.nn.Linear(4, 2)])
    p = model.init(_key(7))
    x = jnp.ones((5, 3))
    out = jax.jit(model)(p, x)
    assert isinstance(out, rf.Tensor) and out.shape == (5, 2)
    _close(out.value, model(p, x).value)
    shape = jax.eval_shape(model, p, x)
    assert jax.tree.leaves(shape)[0].shape == (5, 2)
    v = jax.vmap(rf.relu)(jnp.array([[-1.0, 2.0]]))
    _close(v.value, jnp.array([[0.0, 2.0]]))
    _close(jnp.sin(rf.relu(jnp.ones(2))), jnp.sin(jnp.ones(2)))


def test_mixed_precision_tree_map_keeps_gradients():
    params = {"a": jnp.array([1.0, -2.0]), "b": [jnp.array([[0.5, 3.0]])]}

    def loss(p):
        p16 = jax.tree.map(lambda w: w.astype(jnp.bfloat16), p)
        return sum((leaf.astype(jnp.float32) ** 2).sum() for leaf in jax.tree.leaves(p16))

    got = rf.grad(loss)(params)
    _close(got, jax.grad(loss)(params))
    assert float(jnp.abs(got["a"]).sum()) > 0


def test_tracked_tensor_into_raw_transformation_names_lift():
    def loss(w):
        return rf.sum(jax.jit(lambda v: v * 2)(w))

    with pytest.raises(TypeError, match=r"rf\.lift"):
        rf.grad(loss)(jnp.ones(3))

    def loss_scan(w):
        return rf.sum(lax.scan(lambda c, v: (c, v), 0.0, w)[1])

    with pytest.raises(TypeError, match=r"rf\.lift"):
        rf.grad(loss_scan)(jnp.ones(3))


def test_tensor_methods_and_operators():
    x = jax.random.normal(_key(8), (3, 4))

    def f_rf(w):
        h = x * w
        return (
            (h**2).sum()
            + abs(h).max()
            + h.var()
            + h.std()
            + h.prod()
            + h.clip(-0.5, 0.5).sum()
            + (abs(h) + 1.0).astype(jnp.float32).sqrt().sum()
            + (w @ jnp.ones(4)).sum()
            + (h.at[0, 1:].set(3.0) ** 2).sum()
            + (h * (h > 0)).sum()
            + h.swapaxes(0, 1).squeeze().sum()
        )

    def f_j(w):
        h = x * w
        return (
            (h**2).sum()
            + jnp.abs(h).max()
            + h.var()
            + h.std()
            + h.prod()
            + h.clip(-0.5, 0.5).sum()
            + jnp.sqrt(jnp.abs(h) + 1.0).sum()
            + (w @ jnp.ones(4)).sum()
            + (h.at[0, 1:].set(3.0) ** 2).sum()
            + (h * (h > 0)).sum()
            + h.swapaxes(0, 1).squeeze().sum()
        )

    w = jax.random.normal(_key(9), (3, 4))
    with jax.numpy_dtype_promotion("standard"):  # h * (h > 0): float32 * bool, as users write it
        _close(rf.grad(f_rf)(w), rf.testing.jax_oracle_grad(f_j, (w,)), 1e-4)
    t = rf.tensor([1.0, 2.0])
    assert {t: 1}[t] == 1  # hash by identity
    eq = t == t
    assert eq.dtype == jnp.bool_ and not getattr(eq, "requires_grad", False)
    with rf.Tape():
        tt = rf.tensor([1.0, 2.0], requires_grad=True)
        lt = tt < 1.5
        assert lt.dtype == jnp.bool_ and not lt.requires_grad


# -- control flow -------------------------------------------------------------------------


def _scan_loss_rf(ws, x0):
    h, _ = rf.lax.scan(lambda h, w: (rf.tanh(h @ w), None), x0, ws)
    return rf.sum(h * h)


def _scan_loss_jnp(ws, x0):
    h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x0, ws)
    return jnp.sum(h * h)


@pytest.mark.parametrize("mode", ["eager", "jit", "vmap"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
def test_scan_rf_op_body(mode, dtype):
    with jax.enable_x64(dtype == jnp.float64):
        ws = (jax.random.normal(_key(10), (4, 3, 3)) * 0.5).astype(dtype)
        x0 = jax.random.normal(_key(11), (2, 3)).astype(dtype)
        tol = 1e-10 if dtype == jnp.float64 else 2e-5
        g = rf.grad(_scan_loss_rf, argnums=(0, 1))
        want = jax.grad(_scan_loss_jnp, argnums=(0, 1))
        if mode == "jit":
            g = jax.jit(g)
        if mode == "vmap":
            xs = jnp.stack([x0, 2 * x0])
            got = jax.vmap(g, in_axes=(None, 0))(ws, xs)
            exp = jax.vmap(want, in_axes=(None, 0))(ws, xs)
        else:
            got, exp = g(ws, x0), want(ws, x0)
        chex.assert_trees_all_close(got, exp, rtol=tol, atol=tol)


def test_scan_tape_length_independent_of_length():
    lengths = []
    for n in (3, 1000):
        with rf.Tape() as tape:
            ws = rf.tensor(jnp.full((n, 2, 2), 0.1), requires_grad=True)
            _scan_loss_rf(ws, jnp.ones((1, 2)))
        lengths.append((len(tape), sum(len(e.op.records()) for e in tape.entries if hasattr(e.op, "records"))))
    assert lengths[0] == lengths[1]


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_saves_loop_invariant_and_scanned_inputs_once(reverse):
    """The body's matmul saves the constant weight and its slice of xs: the scan
    keeps each once (the weight, the whole xs), not stacked per iteration, so the
    compiled gradient needs no more temporary memory than jax.grad's."""
    w = jnp.asarray(np.random.default_rng(0).standard_normal((64, 64)) * 0.1, jnp.float32)
    xs = jnp.asarray(np.random.default_rng(1).standard_normal((100, 2, 64)), jnp.float32)

    def loss(w, xs):
        def body(h, x):
            h = jnp.tanh(h @ w + x @ w)
            return h, jnp.sum(h * x)

        h, ys = lax.scan(body, jnp.zeros((2, 64)), xs, reverse=reverse)
        return jnp.sum(h) + jnp.sum(ys)

    g_rf, g_j = rf.grad(rf.lift(loss), argnums=(0, 1)), jax.grad(loss, argnums=(0, 1))
    chex.assert_trees_all_close(jax.jit(g_rf)(w, xs), g_j(w, xs), rtol=2e-5, atol=2e-5)
    chex.assert_trees_all_close(g_rf(w, xs), g_j(w, xs), rtol=2e-5, atol=2e-5)
    mem_rf = jax.jit(g_rf).lower(w, xs).compile().memory_analysis().temp_size_in_bytes
    mem_j = jax.jit(g_j).lower(w, xs).compile().memory_analysis().temp_size_in_bytes
    stacked_w = 100 * w.nbytes  # what stacking the weight per iteration would cost
    assert mem_rf <= 1.1 * mem_j, (mem_rf, mem_j)
    assert mem_rf < stacked_w, (mem_rf, stacked_w)


def test_division_by_a_broadcast_divisor_needs_no_broadcast_copy():
    """Softmax divides by its row sums broadcast to the scores' shape. The divisor's
    gradient, written ``-g a / (b b)``, made XLA:CPU materialise the broadcast of the
    reciprocal (one more scores-sized buffer than jax.grad's program: 258 against 196
    KiB here, the flax transformer's 1.13x memory); written as jax's ``-(g b^-2) a`` it
    needs none. Same gradients, no more temporary memory than jax.grad."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((4, 32, 4, 16)), jnp.float32) for _ in range(3))

    def f(q, k, v):
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", p, v)
        return jnp.sum(o * o)

    for argnums in ((0,), (1,), (2,), (0, 1, 2)):
        g_rf = rf.value_and_grad(rf.lift(f), argnums=argnums)
        g_j = jax.value_and_grad(f, argnums=argnums)
        chex.assert_trees_all_close(jax.jit(g_rf)(q, k, v), jax.jit(g_j)(q, k, v), rtol=2e-5, atol=2e-5)
        mem_rf = jax.jit(g_rf).lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
        mem_j = jax.jit(g_j).lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
        assert mem_rf <= mem_j, (argnums, mem_rf, mem_j)


def test_scan_closure_nested_fori_map_rnp_body():
    w = jnp.array([[0.5, -0.3], [0.2, 0.8]])
    x = jnp.array([1.0, 2.0])

    def f_rf(w):
        def outer(c, _):
            inner, _ = rf.lax.scan(lambda d, __: (rnp.sin(d @ w), None), c, None, length=2)
            return inner, rnp.sum(inner)

        c, ys = rf.lax.scan(outer, x, None, length=3)
        z = rf.lax.fori_loop(0, 3, lambda i, v: rnp.tanh(v * w[0]), c)
        m = rf.lax.map(lambda r: rnp.sum(r * w[1]), rnp.stack([z, c]))
        return rnp.sum(ys) + rnp.sum(m)

    def f_j(w):
        def outer(c, _):
            inner, _ = lax.scan(lambda d, __: (jnp.sin(d @ w), None), c, None, length=2)
            return inner, jnp.sum(inner)

        c, ys = lax.scan(outer, x, None, length=3)
        z = lax.fori_loop(0, 3, lambda i, v: jnp.tanh(v * w[0]), c)
        m = lax.map(lambda r: jnp.sum(r * w[1]), jnp.stack([z, c]))
        return jnp.sum(ys) + jnp.sum(m)

    _close(rf.grad(f_rf)(w), jax.grad(f_j)(w))
    _close(jax.jit(rf.grad(f_rf))(w), jax.grad(f_j)(w))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_cond_and_switch(sign):
    x = sign * jnp.array([0.5, 1.5, 2.0])

    def f(x):
        a = lax.cond(jnp.sum(x) > 0, jnp.sin, lambda v: v**2, x)
        b = lax.switch((jnp.sum(x) > 0).astype(jnp.int32) + 1, [jnp.cos, jnp.exp, jnp.tanh], x)
        return jnp.sum(a * b)

    _close(rf.grad(rf.lift(f))(x), jax.grad(f)(x))
    _close(jax.jit(rf.grad(rf.lift(f)))(x), jax.grad(f)(x))

    def f_rf(x):
        return rf.sum(rf.lax.cond(rf.sum(x).value > 0, rf.tanh, rf.exp, x))

    _close(rf.grad(f_rf)(x), jax.grad(lambda x: jnp.sum(lax.cond(jnp.sum(x) > 0, jnp.tanh, jnp.exp, x)))(x))


def test_while_loop_forward_works():
    """Its reverse raises: a declared error case of the 'while' rule
    (rumus_fx/lift/rules_control.py), run by tests/test_errors_audit.py."""

    def f(x):
        return jnp.sum(lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.sin(c[1])), (0, x))[1])

    x = jnp.array([0.3, 0.7])
    _close(rf.lift(f)(x), f(x))
    out = rf.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, x))[1]
    _close(rf.testing.as_array(out), x * 8)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_tokens_pass_through(jit):
    """A program that makes tokens (``lax.create_token``, ``lax.after_all``) and
    returns one: rf.lift crashed reading a token's dtype; now the token passes
    through and the gradient equals jax.grad's."""

    def f(x):
        t = lax.after_all(lax.create_token(x), lax.create_token())
        return jnp.sum(jnp.sin(x) * 2.0), t

    x = jnp.array([0.3, 0.7, -1.2])
    vg = rf.value_and_grad(rf.lift(f), has_aux=True)
    (v, tok), g = (jax.jit(vg) if jit else vg)(x)
    (wv, _), wg = jax.value_and_grad(f, has_aux=True)(x)
    assert isinstance(tok, type(lax.create_token()))
    _close((v, g), (wv, wg))


# -- user-written backward ------------------------------------------------------------


@jax.custom_vjp
def doubled(x):
    return jnp.sin(x)


doubled.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda cos_x, g: (2.0 * g * cos_x,))  # twice the truth


def test_custom_vjp_bwd_is_obeyed_exactly():
    x = jnp.array([0.1, 0.5, 1.0])
    got = rf.grad(rf.lift(lambda v: jnp.sum(doubled(v))))(x)
    _close(got, 2.0 * jnp.cos(x), 1e-6)
    # as an rf op on Tensors, next to rf ops
    got2 = rf.grad(lambda v: rf.sum(rf.lift(doubled)(rf.tanh(v))))(x)
    _close(got2, 2.0 * jnp.cos(jnp.tanh(x)) * (1 - jnp.tanh(x) ** 2), 1e-6)
    with rf.Tape() as tape:
        t = rf.tensor(x, requires_grad=True)
        rf.lift(doubled)(t)
    assert "CustomVjpCallBackward" in str(tape)


def test_custom_jvp_rule_is_honoured():
    @jax.custom_jvp
    def f(x):
        return x**3

    f.defjvp(lambda p, t: (f(p[0]), 100.0 * t[0]))  # the rule, not the primal, defines the gradient
    x = jnp.array([1.0, 2.0])
    loss = lambda v: jnp.sum(f(v))  # noqa: E731
    _close(rf.grad(rf.lift(loss))(x), jax.grad(loss)(x))
    _close(rf.grad(rf.lift(loss))(x), jnp.full(2, 100.0))
    with rf.Tape() as tape:
        rf.lift(loss)(rf.tensor(x, requires_grad=True))
    assert "CustomJvpCallBackward" in str(tape)


def test_inconsistent_custom_jvp_rule_holds_at_every_order(x64):
    """A rule that is not its primal's derivative (the identity with derivative 2,
    as a straight-through estimator is) is applied at every order: the second
    derivative of ``sum(f(x)^2)`` is ``2 * 2 * 2``. jax.grad gives that when the
    rule computes its primal output through ``f`` itself (as here); a rule that
    returns ``p[0]`` instead gets ``2 * 2`` from jax (its outer level
    differentiates the identity), and rf's 8 then differs by design."""

    @jax.custom_jvp
    def f(x):
        return x

    f.defjvp(lambda p, t: (f(p[0]), 2.0 * t[0]))
    x, v = jnp.array([0.3, -1.2, 2.0]), jnp.array([1.0, 0.5, -2.0])
    loss = lambda u: jnp.sum(f(u) ** 2)  # noqa: E731
    fr = jax.jvp(rf.grad(rf.lift(loss)), (x,), (v,))[1]
    rr = rf.grad(lambda u: rnp.sum(rf.grad(rf.lift(loss))(u) * v))(x)
    want = jax.jvp(jax.grad(loss), (x,), (v,))[1]
    chex.assert_trees_all_close(want, 8.0 * v)
    chex.assert_trees_all_close(fr, want, rtol=1e-12, atol=1e-12)
    chex.assert_trees_all_close(rr, want, rtol=1e-12, atol=1e-12)


# -- rematerialisation ------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_checkpoint_names_and_policies(jit):
    """``checkpoint_name`` (the ``name`` primitive, refused before) alone and inside
    ``jax.checkpoint`` with the policies that read it: each argument alone and both,
    against jax.grad and float64 finite differences."""
    from jax.ad_checkpoint import checkpoint_name

    def block(w, h):
        a = checkpoint_name(jnp.sin(h @ w), "a")
        return checkpoint_name(jnp.tanh(a @ w.T) * a, "b")

    policies = [None, jax.checkpoint_policies.save_only_these_names("a"), jax.checkpoint_policies.everything_saveable]
    with jax.enable_x64(True):
        w = jax.random.normal(_key(3), (4, 4), jnp.float64) * 0.5
        h = jax.random.normal(_key(4), (3, 4), jnp.float64)
        for policy in [*policies, "none"]:
            body = block if policy == "none" else jax.checkpoint(block, policy=policy)
            f = lambda w, h, body=body: jnp.sum(body(w, body(w, h)) ** 2)  # noqa: E731
            for nums in (0, 1, (0, 1)):
                rf.testing.check_grads(rf.lift(f), (w, h), nums, oracle=f, jit=jit, atol=1e-10, rtol=1e-10)


def test_checkpoint_equal_gradients_and_less_saved():
    ws = [jax.random.normal(jax.random.key(20 + i), (16, 16)) * 0.3 for i in range(6)]
    x = jax.random.normal(_key(30), (64, 16))

    def layer(w, h):
        return rf.tanh(rf.tanh(h @ w) @ w)

    def loss(ws, ckpt):
        h = x
        for w in ws:
            h = rf.checkpoint(layer)(w, h) if ckpt else layer(w, h)
        return rf.sum(h * h)

    _close(rf.grad(lambda w: loss(w, True))(ws), rf.grad(lambda w: loss(w, False))(ws))
    saved = []
    for ckpt in (False, True):
        with rf.Tape() as tape:
            loss([rf.tensor(w, requires_grad=True) for w in ws], ckpt)
        saved.append(tape.saved_bytes)
    assert saved[1] < saved[0] / 1.5, saved


# -- higher order ---------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_grad_of_grad_rf_ops_and_lifted(jit, x64):
    x = jnp.array([0.3, -1.2, 2.0])

    def inner(x):
        return rf.sum(rf.tanh(x) * rf.exp(x * 0.3)) + rf.lift(lambda v: jnp.sum(jnp.sin(v) * v**2))(x)

    def inner_j(x):
        return jnp.sum(jnp.tanh(x) * jnp.exp(x * 0.3)) + jnp.sum(jnp.sin(x) * x**2)

    g = rf.grad(lambda x: rf.sum(rf.grad(inner)(x) ** 2))
    if jit:
        g = jax.jit(g)
    want = jax.grad(lambda x: jnp.sum(jax.grad(inner_j)(x) ** 2))(x)
    chex.assert_trees_all_close(g(x), want, rtol=1e-9, atol=1e-9)


_SOLVES = {
    "solve_a": (lambda a, b: jnp.sum(jnp.linalg.solve(a, b) ** 2), 0),
    "solve_b": (lambda a, b: jnp.sum(jnp.linalg.solve(a, b) ** 2), 1),
    "solve_both": (lambda a, b: jnp.sum(jnp.linalg.solve(a, b) ** 2), (0, 1)),
    "inv": (lambda a, b: jnp.sum(jnp.linalg.inv(a) ** 2 * b[:, :1]), 0),
    "slogdet": (lambda a, b: jnp.linalg.slogdet(a)[1], 0),
    "expm": (lambda a, b: jnp.sum(jax.scipy.linalg.expm(0.3 * a) * b[:, :1]), 0),
}


# expm (a Padé solve inside a scaling-and-squaring loop, 30 s) with -m slow; the plain
# solves, the inverse and the log-determinant by default
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow if n == "expm" else ()) for n in _SOLVES])
def test_second_order_through_linear_solves(name, x64):
    """``jnp.linalg.solve`` factors ``stop_gradient(A)`` and differentiates
    through ``custom_linear_solve``'s matvec: its gradient, differentiated again,
    must reach A through the transposed solve (it once evaluated
    ``transpose_solve`` on the stopped factors alone: the Hessians of solve and
    inv lost terms and slogdet's was 0, with no error). jax.jvp over rf.grad and
    rf.grad over rf.grad (the backward recorded on the outer tape), eager and
    jit, each argument alone and both."""
    f, argnums = _SOLVES[name]
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((3, 3)) + 3 * np.eye(3))
    b = jnp.asarray(rng.standard_normal((3, 2)))
    nums = argnums if isinstance(argnums, tuple) else (argnums,)
    ts = tuple(jnp.asarray(rng.standard_normal(x.shape)) for x in (a, b))
    args = (a, b)

    def hvp(grad, f):
        def g(*xs):
            full = list(args)
            for k, x in zip(nums, xs):
                full[k] = x
            return grad(f, argnums=nums)(*full)

        return jax.jvp(g, tuple(args[k] for k in nums), tuple(ts[k] for k in nums))[1]

    want = hvp(jax.grad, f)
    chex.assert_trees_all_close(hvp(rf.grad, rf.lift(f)), want, rtol=1e-9, atol=1e-9)
    chex.assert_trees_all_close(jax.jit(lambda: hvp(rf.grad, rf.lift(f)))(), want, rtol=1e-9, atol=1e-9)

    def rr(*xs):
        full = list(args)
        for k, x in zip(nums, xs):
            full[k] = x
        gs = rf.grad(rf.lift(f), argnums=nums)(*full)
        return sum(rnp.sum(g * ts[k]) for g, k in zip(gs, nums))

    for jit in (False, True):
        g2 = rf.grad(rr, argnums=tuple(range(len(nums))))
        got = (jax.jit(g2) if jit else g2)(*(args[k] for k in nums))
        chex.assert_trees_all_close(tuple(got), tuple(want), rtol=1e-9, atol=1e-9)


def test_third_order(x64):
    x = jnp.array([0.3, -1.2, 2.0])
    s = lambda x: rf.sum(rf.sigmoid(x) * x)  # noqa: E731
    got = rf.grad(lambda x: rf.sum(rf.grad(lambda y: rf.sum(rf.grad(s)(y)))(x)))(x)
    sj = lambda x: jnp.sum(jax.nn.sigmoid(x) * x)  # noqa: E731
    want = jax.grad(lambda x: jnp.sum(jax.grad(lambda y: jnp.sum(jax.grad(sj)(y)))(x)))(x)
    chex.assert_trees_all_close(got, want, rtol=1e-9, atol=1e-9)


def test_reverse_over_reverse_hvp_equals_forward_over_reverse(x64):
    x = jnp.array([0.3, -1.2, 2.0])
    v = jnp.array([1.0, 0.5, -2.0])
    f = lambda x: rf.sum(rf.tanh(x) ** 2 * rf.exp(x))  # noqa: E731
    rr = rf.grad(lambda x: rf.sum(rf.grad(f)(x) * v))(x)
    fr = jax.jvp(rf.grad(f), (x,), (v,))[1]
    chex.assert_trees_all_close(rr, fr, rtol=1e-9, atol=1e-9)


def test_gradient_penalty_and_maml_step(x64):
    w = jax.random.normal(_key(40), (3, 4)).astype(jnp.float64)
    xb = jax.random.normal(_key(41), (5, 3)).astype(jnp.float64)

    def gp(w):
        gx = rf.grad(lambda x: rf.sum(rf.tanh(x @ w)))(xb)
        n = rf.sum(gx * gx, axis=1)
        return rf.sum((n - 1.0) * (n - 1.0))

    def gp_j(w):
        gx = jax.grad(lambda x: jnp.sum(jnp.tanh(x @ w)))(xb)
        return jnp.sum((jnp.sum(gx * gx, axis=1) - 1.0) ** 2)

    chex.assert_trees_all_close(rf.grad(gp)(w), jax.grad(gp_j)(w), rtol=1e-9, atol=1e-9)

    def maml(w):
        inner = lambda w: rf.sum((rf.tanh(xb @ w) - 0.5) ** 2)  # noqa: E731
        w2 = w - 0.1 * rf.grad(inner)(w)
        return rf.sum(rf.tanh(xb @ w2) ** 2)

    def maml_j(w):
        inner = lambda w: jnp.sum((jnp.tanh(xb @ w) - 0.5) ** 2)  # noqa: E731
        w2 = w - 0.1 * jax.grad(inner)(w)
        return jnp.sum(jnp.tanh(xb @ w2) ** 2)

    chex.assert_trees_all_close(rf.grad(maml)(w), jax.grad(maml_j)(w), rtol=1e-9, atol=1e-9)
    chex.assert_trees_all_close(jax.jit(rf.grad(maml))(w), jax.grad(maml_j)(w), rtol=1e-9, atol=1e-9)


def test_vjp_inside_a_loss(x64):
    x = jnp.array([0.3, -1.2])

    def loss(x):
        out, pull = rf.vjp(lambda v: rf.tanh(v) * v, x)
        (g,) = pull(jnp.ones(2))
        return rf.sum(g * g) + rf.sum(out)

    def loss_j(x):
        out, pull = jax.vjp(lambda v: jnp.tanh(v) * v, x)
        (g,) = pull(jnp.ones(2))
        return jnp.sum(g * g) + jnp.sum(out)

    chex.assert_trees_all_close(rf.grad(loss)(x), jax.grad(loss_j)(x), rtol=1e-9, atol=1e-9)


def test_version_check_across_orders():
    def loss(w):
        x = rf.tensor(jnp.array([1.0, 2.0]))
        g = rf.grad(lambda v: rf.sum(rf.tanh(v * x)))(w)  # the inner backward reads x
        x.add_(1.0)  # written before the outer backward
        return rf.sum(g)

    with pytest.raises(rf.VersionMismatch):
        rf.grad(loss)(jnp.array([0.5, 0.1]))


def test_create_graph_on_tape_api_second_derivative():
    """The Tape API records its backward walk (tests/ops/test_create_graph.py
    covers every op): d/dw sum((2w)^2) = 8w."""
    with rf.Tape() as tape:
        w = rf.tensor([1.0, 2.0], requires_grad=True)
        loss = rf.sum(w * w)
        gw = tape.backward(loss, create_graph=True)[w]
        inner = rf.sum(gw * gw)
    np.testing.assert_allclose(np.asarray(tape.backward(inner)[w]), [8.0, 16.0])


@pytest.mark.parametrize("lhs, under_mesh, jit", MERGE_CASES)  # the cases of rf.matmul's test
def test_lifted_weight_gradient_merges_rows_only_for_a_computed_lhs(monkeypatch, lhs, under_mesh, jit):
    """Note [Weight gradient as one 2-D dot] (rumus_fx/ops/linalg.py), for
    ``dot_general`` under rf.lift: the weight gradient of ``x:[B, T, K] @ W``
    is one 2-D dot over the merged rows only under jit, for an ``x`` with an
    elementwise producer in the trace and no mesh set; every path gives
    jax.grad's gradients, each argument alone and both together."""
    import contextlib

    from rumus_fx.lift import rules_structural

    merged = []
    real = rules_structural._weight_gradient_2d

    def spy(*args):
        out = real(*args)
        merged.append(out is not None)
        return out

    monkeypatch.setattr(rules_structural, "_weight_gradient_2d", spy)
    rng = np.random.default_rng(3)
    lead = (4 + 3 * under_mesh + ["argument", "computed", "dot output"].index(lhs), 3)
    x = jnp.asarray(rng.standard_normal((*lead, 5)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((5, 6)), jnp.float32)
    eye = jnp.eye(5, dtype=jnp.float32)
    pre = {"argument": lambda v: v, "computed": jnp.tanh, "dot output": lambda v: v @ eye.astype(v.dtype)}[lhs]

    def loss(x, w):
        return jnp.sum(jnp.sin(pre(x) @ w))

    ctx = jax.set_mesh(jax.make_mesh((1,), ("data",))) if under_mesh else contextlib.nullcontext()
    with ctx:
        for argnums in (0, 1, (0, 1)):
            # against jax.grad, and float64 finite differences through the same path
            rf.testing.check_grads(rf.lift(loss), (x, w), argnums, oracle=loss, jit=jit, atol=1e-4, rtol=1e-4)
    assert any(merged) == (jit and lhs == "computed" and not under_mesh)


# -- parts of a program that a transformation around rf.grad leaves unbatched ----------

# each program adds a term of y alone (a custom_jvp, a cond, a scan, a while-free
# fori loop, a custom_vjp) to a term of x: under jax.vmap over x (per-example
# gradients with shared parameters) or jax.jvp along x, that term's rows get
# concrete cotangents and residuals and run eagerly inside the transformation.
# Their rules read their sub-programs from the row's step, which a compiled call
# of the flattened record dropped (AttributeError: '...Backward' object has no
# attribute '_step').
_UNBATCHED_TERMS = {
    "custom_jvp": lambda y: jnp.sum(jax.nn.relu(y) + jax.nn.softplus(y)),
    "cond": lambda y: jnp.sum(lax.cond(jnp.sum(y) > 0, jnp.sin, jnp.cos, y)),
    "scan": lambda y: jnp.sum(lax.scan(lambda c, v: (c * v + 1.0, c), 1.0, y)[1]),
    "fori": lambda y: jnp.sum(lax.fori_loop(0, 3, lambda i, v: jnp.sin(v) * 1.5, y)),
    "switch": lambda y: jnp.sum(lax.switch(1, [jnp.sin, jnp.tanh], y)),
    "checkpoint": lambda y: jnp.sum(jax.checkpoint(lambda v: jnp.exp(jnp.tanh(v)) * v)(y)),
}


@pytest.mark.parametrize("argnums", [(0,), (1,), (0, 1)], ids=["x", "y", "xy"])
@pytest.mark.parametrize("term", list(_UNBATCHED_TERMS))
def test_unbatched_rows_under_vmap_and_jvp(term, argnums):
    t = _UNBATCHED_TERMS[term]

    def f(x, y):
        return jnp.sum(jnp.tanh(x) * x) + t(y) * 0.5

    with jax.enable_x64(True):
        xs = jnp.asarray(np.random.default_rng(0).standard_normal((3, 4)))
        y = jnp.asarray([-1.5, -0.2, 0.4, 1.3])
        g_rf = rf.grad(rf.lift(f), argnums=argnums)
        g_jax = jax.grad(f, argnums=argnums)
        got = jax.vmap(lambda x: g_rf(x, y))(xs)
        want = jax.vmap(lambda x: g_jax(x, y))(xs)
        _close(got, want, 1e-10)
        got = jax.jvp(lambda x: g_rf(x, y), (xs[0],), (xs[1],))
        want = jax.jvp(lambda x: g_jax(x, y), (xs[0],), (xs[1],))
        _close(got, want, 1e-10)


def _body_of_a_call(x, y):
    return [jnp.sin(x) * y, x * 2.0]


def _through_jax_call_primitive(x, y):
    """``call_p`` (jax.extend.core.primitives), the untyped call primitive that
    ``core.call`` binds: it was refused ("no backward rule for the primitive 'call'",
    30 of jax's core_test gradients); rf now runs its body with its own rules."""
    from jax.extend import linear_util as lu
    from jax.extend.core import primitives

    debug = jax.api_util.debug_info("call", _body_of_a_call, (x, y), {})
    a, b = primitives.call_p.bind(x, y, subfuns=(lu.wrap_init(_body_of_a_call, debug_info=debug),))
    return jnp.sum(a * b)


@pytest.mark.parametrize("argnums", [0, 1, (0, 1)], ids=["x", "y", "both"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_jax_call_primitive_is_run_through(argnums, jit):
    assert "call[" in str(jax.make_jaxpr(_through_jax_call_primitive)(jnp.ones(3), jnp.ones(3)))
    with jax.enable_x64(True):
        x, y = jnp.linspace(-1.0, 2.0, 4), jnp.array([0.5, -1.5, 2.0, 1.0])
        check_grads(
            rf.lift(_through_jax_call_primitive),
            (x, y),
            argnums,
            oracle=lambda x, y: jnp.sum(jnp.sin(x) * y * x * 2.0),
            jit=jit,
            atol=1e-12,
            rtol=1e-12,
        )


@pytest.mark.parametrize("argnums", [0, 1, (0, 1)], ids=["x", "y", "both"])
def test_shard_alike_has_a_rule(argnums):
    """jax.experimental.shard_alike (refused before: 'no backward rule for the primitive
    shard_alike'): its cotangents are placed alike too, as jax's transpose does."""
    from jax.experimental.shard_alike import shard_alike

    def f(x, y):
        a, b = shard_alike(x * y, jnp.cos(y))
        return jnp.sum(a * b + x)

    with jax.enable_x64(True):
        x, y = jnp.linspace(-1.0, 2.0, 6).reshape(2, 3), jnp.linspace(0.5, 1.5, 6).reshape(2, 3)
        check_grads(
            rf.lift(f), (x, y), argnums, oracle=lambda x, y: jnp.sum(x * y * jnp.cos(y) + x), atol=1e-12, rtol=1e-12
        )


# a Python scalar written into the program is a literal of its jaxpr (jax's TypedFloat,
# without ndim or shape); rules read it as a 0-d array of its dtype. dot_general's rule
# read ``.ndim`` and crashed (PennyLane's Hamiltonian expectations contract with one).
_LITERAL_PROGRAMS = {
    "dot_general_rhs": lambda y: lax.dot_general(y, 2.0, (((), ()), ((), ()))),
    "dot_general_lhs": lambda y: lax.dot_general(-1.5, y, (((), ()), ((), ()))),
    "dot_general_rhs_3d": lambda y: lax.dot_general(
        jnp.sin(y).reshape(2, 1, 3) * y.reshape(2, 1, 3), 2.0, (((), ()), ((), ()))
    ),
    "dot_general_lhs_3d": lambda y: lax.dot_general(
        0.5, jnp.sin(y).reshape(2, 3, 1) * y[:, None], (((), ()), ((), ()))
    ),
    "mul": lambda y: lax.mul(3.0, y) * lax.mul(y, -0.5),
    "pow": lambda y: lax.pow(jnp.abs(y) + 0.5, 2.5) + lax.pow(1.7, y),
    "atan2": lambda y: lax.atan2(y, 0.8) + lax.atan2(0.3, y),
    "clamp": lambda y: lax.clamp(-0.5, y, 0.5) * y,
    "rem": lambda y: lax.rem(y, 0.7) + lax.rem(2.5, jnp.abs(y) + 1.0),
    "max_min": lambda y: lax.max(y, 0.1) + lax.min(-0.2, y),
    "select_n": lambda y: lax.select_n(y > 0.0, y * y, lax.mul(y, 0.0) + 1.5),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(_LITERAL_PROGRAMS))
def test_a_python_scalar_operand_of_a_primitive(name, jit):
    f = lambda y: jnp.sum(jnp.tanh(_LITERAL_PROGRAMS[name](y)))  # noqa: E731
    y = jnp.array([[0.3, -0.65, 1.1], [0.9, -0.3, 0.45]])  # away from the kinks and jumps
    check_grads(rf.lift(f), (y,), oracle=f, jit=jit, fd=True)
