"""Op behaviours the op table does not express: running statistics, dropout
statistics, rumus defects not ported, index checks, mask semantics."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf

from .optable import ref_attention, ref_batch_norm, ref_im2col


def _bn_inputs(rng, shape=(4, 3, 5, 6)):
    c = shape[1]
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    w = jnp.asarray(rng.uniform(0.5, 2, c), jnp.float32)
    b = jnp.asarray(rng.standard_normal(c), jnp.float32)
    rm = jnp.asarray(rng.standard_normal(c) * 0.1, jnp.float32)
    rv = jnp.asarray(rng.uniform(0.5, 2, c), jnp.float32)
    return x, w, b, rm, rv


@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_running_statistics(rng, training):
    x, w, b, rm, rv = _bn_inputs(rng)
    y, new_mean, new_var = rf.batch_norm_2d(x, w, b, rm, rv, training=training, momentum=0.3)
    ry, r_mean, r_var = ref_batch_norm(x, w, b, rm, rv, training=training, momentum=0.3)
    np.testing.assert_allclose(np.asarray(y), ry, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(new_mean), r_mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(new_var), r_var, rtol=1e-6, atol=1e-6)
    assert not new_mean.requires_grad and not new_var.requires_grad
    if training:  # biased batch variance goes into the running variance, as rumus
        batch_var = np.var(np.asarray(x), axis=(0, 2, 3))
        np.testing.assert_allclose(np.asarray(new_var), 0.7 * np.asarray(rv) + 0.3 * batch_var, rtol=1e-5)
    else:
        np.testing.assert_array_equal(np.asarray(new_mean), np.asarray(rm))


@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_gradients_both_modes(rng, training):
    # rumus's eval-mode input and weight gradients were wrong: check them all
    x, w, b, rm, rv = _bn_inputs(rng)
    ct = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

    def f(x, w, b, rm, rv):
        y, _, _ = rf.batch_norm_2d(x, w, b, rm, rv, training=training)
        return rf.sum(y * ct.astype(y.dtype))  # (float64 in the finite-difference check)

    def f_ref(x, w, b, rm, rv):
        y = ref_batch_norm(x, w, b, rm, rv, training=training)[0]
        return jnp.sum(y * ct.astype(y.dtype))

    argnums = (0, 1, 2, 3, 4)
    rf.testing.check_grads(f, (x, w, b, rm, rv), argnums, oracle=f_ref, atol=1e-4, rtol=1e-4)


def test_dropout_mask_statistics_and_gradient():
    x = jnp.ones((200, 300), jnp.float32)
    p = 0.3
    key = jax.random.key(42)
    with rf.Tape() as tape:
        xt = rf.tensor(x, requires_grad=True)
        y = rf.dropout(xt, p, key)
        loss = rf.sum(y)
    out = np.asarray(y)
    kept = out != 0
    assert abs(kept.mean() - (1 - p)) < 0.01  # 60,000 Bernoulli draws
    np.testing.assert_allclose(out[kept], 1 / (1 - p), rtol=1e-6)  # inverted scaling
    grad = np.asarray(tape.backward(loss)[xt])
    np.testing.assert_allclose(grad, kept / (1 - p), rtol=1e-6)  # gradient == mask / (1 - p)
    # deterministic for a key, different for another
    np.testing.assert_array_equal(np.asarray(rf.dropout(x, p, key)), out)
    assert not np.array_equal(np.asarray(rf.dropout(x, p, jax.random.key(43))), out)
    # eval mode and p == 0 are the identity
    assert rf.dropout(xt, p, key, training=False) is xt
    np.testing.assert_array_equal(np.asarray(rf.dropout(x, 0.0, key)), np.asarray(x))


def test_layer_norm_rank3_gradient_keeps_shape():
    # rumus returned the input gradient flattened to [N, D] for rank >= 3
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 4)), jnp.float32)
    with rf.Tape() as tape:
        xt = rf.tensor(x, requires_grad=True)
        y = rf.layer_norm(xt)
        loss = rf.sum(y * y * jnp.arange(4.0).reshape(1, 1, 4))
    g = tape.backward(loss)[xt]
    assert g.shape == (2, 3, 4)


# every source of the lhs under jit without a mesh, and the computed lhs eagerly and under a mesh
MERGE_CASES = [
    ("computed", False, True),
    ("argument", False, True),
    ("dot output", False, True),
    ("computed", True, True),
    ("computed", False, False),
]


@pytest.mark.parametrize("lhs, under_mesh, jit", MERGE_CASES)
def test_matmul_weight_gradient_with_leading_axes(rng, monkeypatch, lhs, under_mesh, jit):
    # Note [Weight gradient as one 2-D dot]: an lhs computed inside a trace
    # (jit) by an elementwise op has its leading axes merged before the weight
    # gradient's dot, unless a mesh is set; eagerly, for an argument of the
    # jitted function or for a dot's output, they are contracted as they are.
    # Every path gives jax.grad's gradients, each argument alone and both together.
    import contextlib

    from rumus_fx.ops import linalg

    seen = []
    real = linalg._contract_rows

    def spy(a, g, *args):
        seen.append((args[-1], jax.sharding.get_abstract_mesh().empty))
        return real(a, g, *args)

    monkeypatch.setattr(linalg, "_contract_rows", spy)
    # shapes no other case compiles (the eager rules are cached compiled programs)
    lead = (3 + 3 * under_mesh + ["argument", "computed", "dot output"].index(lhs), 2, 4)
    x = jnp.asarray(rng.standard_normal((*lead, 7)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((7, 6)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((*lead, 6)), jnp.float32)
    eye = jnp.eye(7, dtype=jnp.float32)
    pre, pre_ref = {
        "argument": (lambda v: v, lambda v: v),
        "computed": (rf.tanh, jnp.tanh),
        # eye untracked: no weight gradient of its own (constants cast: the finite differences run in float64)
        "dot output": (lambda v: v @ eye.astype(v.dtype), lambda v: v @ eye.astype(v.dtype)),
    }[lhs]
    ctx = jax.set_mesh(jax.make_mesh((1,), ("data",))) if under_mesh else contextlib.nullcontext()
    with ctx:
        for argnums in (0, 1, (0, 1)):
            rf.testing.check_grads(
                lambda x, w: rf.sum((pre(x) @ w) * ct.astype(x.dtype)),
                (x, w),
                argnums,
                oracle=lambda x, w: jnp.sum((pre_ref(x) @ w) * ct.astype(x.dtype)),
                jit=jit,
                atol=1e-4,
                rtol=1e-4,  # and float64 finite differences, through the same path
            )
    assert seen
    if rf.kernels.backend() == "reference":
        # the plan is XLA:CPU's (the Pallas matmul ignores it; on a GPU the dot's output
        # comes from the kernel's call, which the plan does not name as a dot)
        assert set(seen) == {(jit and lhs == "computed", not under_mesh)}


def test_im2col_single_sample_matches_batched_and_rumus_order():
    x = np.arange(2 * 4 * 4, dtype=np.float32).reshape(2, 4, 4)
    cols = np.asarray(rf.im2col(x, 2))
    assert cols.shape == (2 * 2 * 2, 3 * 3)
    # row c*K*K + kh*K + kw, column oh*OW + ow
    for c in range(2):
        for kh in range(2):
            for kw in range(2):
                for oh in range(3):
                    for ow in range(3):
                        assert cols[c * 4 + kh * 2 + kw, oh * 3 + ow] == x[c, oh + kh, ow + kw]
    batched = np.asarray(rf.im2col(np.stack([x, x + 1]), 2))
    np.testing.assert_array_equal(batched[0], cols)
    np.testing.assert_array_equal(batched[1], cols + 1)
    np.testing.assert_array_equal(np.asarray(ref_im2col(jnp.asarray(x), 2)), cols)


def test_max_pool_overlapping_windows_accumulate():
    # a single maximum inside several overlapping windows gets all their gradients
    x = np.zeros((1, 1, 4, 4), np.float32)
    x[0, 0, 1, 1] = 5.0
    g = rf.grad(lambda x: rf.sum(rf.max_pool2d(x, 3, 1)))(jnp.asarray(x - np.arange(16).reshape(1, 1, 4, 4) * 1e-3))
    assert float(g[0, 0, 1, 1]) == 4.0  # all four 3x3 windows pick it
    assert float(jnp.sum(g)) == 4.0


def test_adaptive_pool_bins_floor_ceil():
    x = np.arange(5, dtype=np.float32).reshape(1, 1, 1, 5)
    out = np.asarray(rf.adaptive_avg_pool2d(x, (1, 3)))[0, 0, 0]
    # bins [0,2), [1,4), [3,5): floor(i*5/3) .. ceil((i+1)*5/3)
    np.testing.assert_allclose(out, [0.5, 2.0, 3.5])


def test_cross_entropy_ignore_index_and_concrete_index_errors():
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((4, 3)), jnp.float32)
    t = jnp.array([0, -1, 2, -1])
    full = rf.cross_entropy(logits[jnp.array([0, 2])], jnp.array([0, 2]))
    part = rf.cross_entropy(logits, t, ignore_index=-1)
    np.testing.assert_allclose(np.asarray(part), np.asarray(full), rtol=1e-6)
    g = rf.grad(lambda lg: rf.cross_entropy(lg, t, ignore_index=-1))(logits)
    np.testing.assert_array_equal(np.asarray(g[1]), 0.0)
    with pytest.raises(IndexError, match="cross_entropy"):
        rf.cross_entropy(logits, jnp.array([0, 3, 1, 1]))
    with pytest.raises(IndexError, match="cross_entropy"):
        rf.cross_entropy(logits, jnp.array([0, -1, 1, 1]))  # -1 is not ignored here
    with pytest.raises(TypeError, match="integer"):
        rf.cross_entropy(logits, jnp.zeros(4))


def test_embedding_index_checks_and_traced_out_of_range():
    w = jnp.arange(12.0).reshape(4, 3)
    with pytest.raises(IndexError, match="embedding"):
        rf.embedding(jnp.array([0, 4]), w)
    with pytest.raises(IndexError, match="embedding"):
        rf.embedding(jnp.array([-1]), w)
    with pytest.raises(TypeError, match="integer"):
        rf.embedding(jnp.array([0.0]), w)
    # traced indices cannot be checked: out-of-range rows are NaN (never a silent
    # clamp) and contribute no gradient
    out = jax.jit(lambda i: rf.embedding(i, w).value)(jnp.array([1, 7]))
    np.testing.assert_array_equal(np.asarray(out[0]), [3.0, 4.0, 5.0])
    assert np.isnan(np.asarray(out[1])).all()

    def f(w, i):
        return rf.sum(rf.slice_batch(rf.embedding(i, w), 0))  # row 1 (index 7) is NaN, unused

    g = jax.jit(rf.grad(f))(w, jnp.array([1, 7]))
    np.testing.assert_array_equal(np.asarray(g), [[0, 0, 0], [1, 1, 1], [0, 0, 0], [0, 0, 0]])


def test_embedding_gradient_accumulates_repeated_rows():
    w = jnp.ones((5, 2))
    idx = jnp.array([[1, 1, 3], [1, 0, 3]])
    g = rf.grad(lambda w: rf.sum(rf.embedding(idx, w)))(w)
    np.testing.assert_array_equal(np.asarray(g[:, 0]), [1, 3, 0, 2, 0])


def test_attention_causal_equals_explicit_mask_and_bool_mask():
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 5, 4)), jnp.float32) for _ in range(3))
    causal = rf.scaled_dot_product_attention(q, k, v, causal=True)
    masked = rf.scaled_dot_product_attention(q, k, v, mask=jnp.tril(jnp.ones((5, 5), bool)))
    np.testing.assert_allclose(np.asarray(causal), np.asarray(masked), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(causal), ref_attention(q, k, v, causal=True), rtol=1e-5, atol=1e-6)
    g1 = rf.grad(lambda q: rf.sum(rf.scaled_dot_product_attention(q, k, v, causal=True)))(q)
    g2 = jax.grad(lambda q: jnp.sum(ref_attention(q, k, v, causal=True)))(q)
    chex.assert_trees_all_close(g1, g2, rtol=1e-4, atol=1e-5)


def test_gelu_default_is_tanh_approximation():
    x = jnp.linspace(-3, 3, 13)
    np.testing.assert_allclose(np.asarray(rf.gelu(x)), jax.nn.gelu(x, approximate=True), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(
        np.asarray(rf.gelu(x, approximate=False)), jax.nn.gelu(x, approximate=False), rtol=1e-6, atol=1e-7
    )


def test_softmax_is_stable_for_large_inputs():
    x = jnp.array([[1000.0, 1001.0, 1002.0]])
    y = np.asarray(rf.softmax(x))
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y.sum(), 1.0, rtol=1e-6)


def test_low_precision_inputs_accumulate_in_f32():
    x = jnp.full((4096,), 0.01, jnp.bfloat16)
    s = rf.sum(x)
    assert s.dtype == jnp.bfloat16
    # naive bf16 accumulation stalls far below 40.96; f32 accumulation does not
    assert abs(float(s) - 40.96) < 0.5
    g = rf.grad(lambda x: rf.sum(rf.relu(x) * 2.0).value.astype(jnp.float32))(x)
    assert g.dtype == jnp.bfloat16


def test_stack_and_slice_batch_roundtrip_gradients():
    rng = np.random.default_rng(5)
    xs = [jnp.asarray(rng.standard_normal((2, 3)), jnp.float32) for _ in range(3)]

    def f(a, b, c):
        s = rf.stack([a, b, c], axis=1)  # [2, 3, 3]
        return rf.sum(rf.slice_batch(s, 1) * jnp.arange(9.0).reshape(3, 3))

    ga, gb, gc = rf.grad(f, argnums=(0, 1, 2))(*xs)
    w = np.arange(9.0).reshape(3, 3)
    np.testing.assert_array_equal(np.asarray(ga), np.stack([np.zeros(3), w[0]]))
    np.testing.assert_array_equal(np.asarray(gc), np.stack([np.zeros(3), w[2]]))
    with pytest.raises(IndexError, match="slice_batch"):
        rf.slice_batch(xs[0], 2)


def test_numpy_scalars_are_accepted_as_static_arguments():
    x = jnp.ones((2, 3))
    np.testing.assert_allclose(np.asarray(rf.leaky_relu(-x, np.float32(0.2))), -0.2 * np.ones((2, 3)), rtol=1e-6)
    out = rf.dropout(x, np.float64(0.5), jax.random.key(0))
    assert set(np.unique(np.asarray(out))) <= {0.0, 2.0}
    rf.layer_norm(x, eps=np.float32(1e-3))
    with pytest.raises(TypeError, match="keepdims"):
        rf.sum(x, keepdims="no")
    with pytest.raises(ValueError, match="dropout"):
        rf.dropout(x, True, jax.random.key(0))


def test_conv2d_samples_take_every_formulation():
    """conv2d picks a formulation per product (Note [Convolution plan]
    in rumus_fx/ops/_conv_plan.py); the op table checks gradients only of what its
    samples take, so between them they take every one for y, dx and dw."""
    from rumus_fx.autograd.registry import lookup
    from rumus_fx.ops._conv_plan import cols_size, conv_plan

    want = {
        False: [{"dot", "gemm", "conv"}, {"dot", "conv"}, {"dot", "bdot", "gemm", "conv"}],
        True: [{"dot", "conv"}, {"dot", "conv"}, {"dot", "bdot", "conv"}],
    }
    for cpu_eager in (False, True):  # the jit plan and the eager one (Note [Eager compiler options])
        taken = [set(), set(), set()]
        for sample in lookup("op", "conv2d").samples(np.random.default_rng(0)):
            x, w = sample.args[:2]
            stride = sample.args[3] if len(sample.args) > 3 else 1
            pad = sample.args[4] if len(sample.args) > 4 else 0
            cols = cols_size(x.shape[0], x.shape[1], x.shape[2], x.shape[3], w.shape[2], stride, pad)
            for k, plan in enumerate(conv_plan(x.shape[1], w.shape[2], stride, cpu_eager, cols)):
                taken[k].add(plan)
        assert taken == want[cpu_eager], cpu_eager


def test_conv2d_plan_takes_the_convolution_for_dw_over_a_large_im2col():
    """Over 16 MiB of im2col, at stride 1 and more than three input channels,
    a 3x3 kernel's dw is XLA's convolution (Note [Convolution plan]);
    below it, at stride 2 or with three channels or fewer it stays "bdot"."""
    from rumus_fx.ops._conv_plan import COLS_MAX, GEMM_COLS_MAX, cols_size, conv_plan

    big = cols_size(64, 16, 28, 28, 3, 1, 1)
    assert big > COLS_MAX >= cols_size(64, 16, 20, 20, 3, 1, 1) > GEMM_COLS_MAX
    assert conv_plan(16, 3, 1, cols=big) == ("conv", "conv", "conv")
    assert conv_plan(16, 3, 1, cols=cols_size(64, 16, 20, 20, 3, 1, 1))[2] == "bdot"
    assert conv_plan(16, 3, 2, cols=cols_size(64, 16, 56, 56, 3, 2, 1))[2] == "bdot"
    assert conv_plan(3, 3, 1, cols=cols_size(64, 3, 56, 56, 3, 1, 1)) == ("dot", "dot", "bdot")
    assert conv_plan(16, 1, 1, cols=cols_size(64, 16, 56, 56, 1, 1, 0))[2] == "bdot"


def test_conv2d_plan_takes_gemm_for_y_and_dw_in_its_region():
    """Under a trace, a 3x3 kernel at stride 1 with 4-64 input channels and an
    im2col of at most 8 MiB takes the channel-major "gemm" for y and dw (dx
    stays the convolution); at its edges and eagerly the plan is as before
    (Note [Convolution plan])."""
    from rumus_fx.ops._conv_plan import GEMM_COLS_MAX, cols_size, conv_plan

    cnn_layer = cols_size(64, 16, 14, 14, 3, 1, 1)  # the benchmark CNN's second layer
    assert cnn_layer <= GEMM_COLS_MAX
    for c_in in (4, 16, 64):
        assert conv_plan(c_in, 3, 1, cols=cnn_layer) == ("gemm", "conv", "gemm")
    assert conv_plan(16, 3, 1, cols=GEMM_COLS_MAX) == ("gemm", "conv", "gemm")
    assert conv_plan(16, 3, 1, cols=GEMM_COLS_MAX + 1)[0] == "conv"
    assert conv_plan(3, 3, 1, cols=cnn_layer) == ("dot", "dot", "bdot")
    assert conv_plan(65, 3, 1, cols=cnn_layer) == ("conv", "conv", "conv")
    assert conv_plan(16, 3, 2, cols=cnn_layer) == ("conv", "conv", "bdot")
    assert conv_plan(16, 5, 1, cols=cnn_layer)[0] == "conv"
    assert conv_plan(16, 3, 1, True, cnn_layer) == ("conv", "conv", "conv")


@pytest.mark.parametrize("gemm", [True, False], ids=["gemm", "gemm-off"])
def test_conv2d_record_plans_by_its_input_size(monkeypatch, rng, gemm):
    """The forward and the backward rule pass the im2col's size of the input:
    a large input takes the convolution for y and dw, a small one "gemm" (with
    "gemm" switched off: the convolution for y and "bdot" for dw), and all give
    jax.grad's gradient of the weight."""
    from rumus_fx.ops import _conv_plan as P
    from rumus_fx.ops import conv as C

    seen = []
    monkeypatch.setattr(C, "conv_conv_dw", lambda *a, _f=C.conv_conv_dw: seen.append("conv") or _f(*a))
    monkeypatch.setattr(C, "conv_gemm_dw", lambda *a, _f=C.conv_gemm_dw: seen.append("gemm") or _f(*a))
    monkeypatch.setattr(C, "conv_dot_dw", lambda *a, _f=C.conv_dot_dw, **k: seen.append("bdot") or _f(*a, **k))
    monkeypatch.setattr(C, "conv_conv_forward", lambda *a, _f=C.conv_conv_forward: seen.append("y conv") or _f(*a))
    monkeypatch.setattr(C, "conv_gemm_forward", lambda *a, _f=C.conv_gemm_forward: seen.append("y gemm") or _f(*a))
    limit = 4 * 9 * 8 * 8 * 2 - 1  # 2 samples of [4, 8, 8] are over
    monkeypatch.setattr(P, "COLS_MAX", limit)
    monkeypatch.setattr(P, "GEMM_COLS_MAX", limit)
    if not gemm:
        monkeypatch.setattr(P, "GEMM_MAX_C", 0)
    w = jnp.asarray(rng.standard_normal((5, 4, 3, 3)) / 6, jnp.float32)
    b = jnp.zeros(5, jnp.float32)
    small = ["y gemm", "gemm"] if gemm else ["y conv", "bdot"]
    for n, want in ((1, small), (2, ["y conv", "conv"])):
        x = jnp.asarray(rng.standard_normal((n, 4, 8, 8)), jnp.float32)
        seen.clear()
        got = jax.jit(rf.grad(_conv_loss, argnums=1), static_argnums=3)(x, w, b, 1)
        assert seen == want
        np.testing.assert_allclose(got, jax.grad(_conv_loss_jax, argnums=1)(x, w, b, 1), rtol=1e-4, atol=1e-4)


def test_conv2d_gemm_composes_with_vmap_and_jvp(rng):
    """The "gemm" formulation (a traced 3x3, stride-1 conv with 4-64 input
    channels) under jax.vmap per-example gradients and jax.jvp of the gradient
    (a Hessian-vector product), each argument, against jax's."""
    from rumus_fx.ops._conv_plan import cols_size, conv_plan

    x = jnp.asarray(rng.standard_normal((3, 2, 4, 6, 6)), jnp.float32)  # 3 examples of [2, 4, 6, 6]
    w = jnp.asarray(rng.standard_normal((5, 4, 3, 3)) / 6, jnp.float32)
    b = jnp.asarray(rng.standard_normal(5), jnp.float32)
    assert conv_plan(4, 3, 1, cols=cols_size(2, 4, 6, 6, 3, 1, 1)) == ("gemm", "conv", "gemm")
    for argnum in range(3):
        in_axes = tuple(0 if i == 0 else None for i in range(3)) + (None,)
        got = jax.jit(jax.vmap(rf.grad(_conv_loss, argnums=argnum), in_axes), static_argnums=3)(x, w, b, 1)
        want = jax.vmap(jax.grad(_conv_loss_jax, argnums=argnum), in_axes)(x, w, b, 1)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    args = (x[0], w, b)
    for argnum in range(3):
        t = jnp.asarray(rng.standard_normal(args[argnum].shape), jnp.float32)

        def hvp(grad_fn, argnum=argnum, t=t):
            def g(a):
                return grad_fn(*(a if i == argnum else args[i] for i in range(3)), 1)

            return jax.jvp(g, (args[argnum],), (t,))[1]

        got = jax.jit(lambda a=argnum: hvp(rf.grad(_conv_loss, argnums=a)))()
        want = hvp(jax.grad(_conv_loss_jax, argnums=argnum))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _conv_loss(x, w, b, stride):
    return rf.sum(rf.tanh(rf.conv2d(x, w, b, stride, 1)))


def _conv_loss_jax(x, w, b, stride):
    y = jax.lax.conv_general_dilated(x, w, (stride, stride), [(1, 1), (1, 1)]) + b.reshape(1, -1, 1, 1)
    return jnp.sum(jnp.tanh(y))


@pytest.mark.parametrize("c_in, stride", [(1, 1), (16, 1), (16, 2), (64, 2)])
def test_conv2d_eager_takes_the_cpu_plan_and_options(rng, c_in, stride):
    """Eagerly on a CPU device conv2d's programs compile with
    CPU_COMPILER_OPTIONS and its record takes the eager plan (dw as XLA's
    convolution); traced (jax.jit) neither: the record says which, and both
    give jax.grad's gradients, each argument alone."""
    from rumus_fx.ops._conv_plan import conv_plan

    with jax.default_device(jax.devices("cpu")[0]):  # a GPU host's CPU device too
        _conv2d_cpu_plan_and_options(rng, c_in, stride, conv_plan)


def _conv2d_cpu_plan_and_options(rng, c_in, stride, conv_plan):
    x = jnp.asarray(rng.standard_normal((3, c_in, 9, 9)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, c_in, 3, 3)) / np.sqrt(9 * c_in), jnp.float32)
    b = jnp.asarray(rng.standard_normal(4), jnp.float32)
    seen = []

    def loss(x, w, b):
        with rf.Tape() as tape:
            xs, ws, bs = (rf.tensor(a, requires_grad=True) for a in (x, w, b))
            out = _conv_loss(xs, ws, bs, stride)
        (entry,) = [e for e in tape.entries if type(e.op).__name__ == "Conv2dBackward"]
        seen.append((entry.op.cpu_eager, entry.op.compiler_options))
        return out.value

    loss(x, w, b)
    jax.jit(loss)(x, w, b)
    assert seen == [(True, rf.CPU_COMPILER_OPTIONS), (False, None)]
    assert conv_plan(c_in, 3, stride, True)[2] == "conv"
    for argnum in range(3):
        want = jax.grad(_conv_loss_jax, argnums=argnum)(x, w, b, stride)
        for fn in (rf.grad(_conv_loss, argnums=argnum), jax.jit(rf.grad(_conv_loss, argnums=argnum), static_argnums=3)):
            np.testing.assert_allclose(fn(x, w, b, stride), want, rtol=1e-4, atol=1e-4)


def test_cpu_options_only_for_concrete_arrays_on_one_cpu_device():
    from rumus_fx.eager import cpu_options

    with jax.default_device(jax.devices("cpu")[0]):  # a GPU host's CPU device too
        _cpu_options_cases(cpu_options)


def _cpu_options_cases(cpu_options):
    x = jnp.ones(3)
    assert cpu_options(x, None, jnp.zeros(2)) is rf.CPU_COMPILER_OPTIONS
    assert cpu_options() is None and cpu_options(None) is None
    seen = []
    jax.jit(lambda a: seen.append(cpu_options(a, x)) or a)(x)
    assert seen == [None]
    if len(jax.devices("cpu")) > 1:  # committed to two different devices
        a, b = (jax.device_put(x, d) for d in jax.devices("cpu")[:2])
        assert cpu_options(a, b) is None


@pytest.mark.parametrize("jit", [False, True])
def test_batch_norm_running_update_eager_and_jit(rng, jit):
    """The running-statistics update runs as one program eagerly and inline
    under jax.jit; both give the oracle's values, for any momentum."""
    x, w, b, rm, rv = _bn_inputs(rng)
    for momentum in (0.0, 0.3, 1.0):

        def stats(x, rm, rv, momentum=momentum):
            _, m, v = rf.batch_norm_2d(x, w, b, rm, rv, training=True, momentum=momentum)
            return m.value, v.value

        got = (jax.jit(stats) if jit else stats)(x, rm, rv)
        want = ref_batch_norm(x, w, b, rm, rv, training=True, momentum=momentum)[1:]
        for g_, w_ in zip(got, want):
            np.testing.assert_allclose(np.asarray(g_), np.asarray(w_), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("k, stride, padding", [(2, 2, 0), (3, 2, 1), (3, 1, 1), (2, 3, 0), (3, 3, 1)])
def test_max_pool_eager_form_equals_the_reduction(rng, k, stride, padding):
    """max_pool2d's eager (elementwise) forward gives the traced reduction's
    max and first argmax exactly: ties (relu zeros, repeated integers), NaN
    (it wins, the first one), -inf and signed zeros included."""
    from rumus_fx.ops.conv import _max_pool_elementwise, _max_pool_materialised, _max_pool_reduce, _out_size

    x = np.maximum(np.round(rng.standard_normal((2, 3, 9, 8)) * 2), 0)
    x[0, 0, 1, 1] = x[0, 0, 2, 2] = np.nan
    x[0, 1, :3, :3] = -np.inf
    x[1, 2, 4:, :] = -0.0
    x = jnp.asarray(x, jnp.float32)
    oh, ow = (_out_size("t", n, k, stride, padding, "") for n in x.shape[2:])
    want = jax.jit(_max_pool_reduce, static_argnums=(1, 2, 3, 4, 5))(x, k, stride, padding, oh, ow)
    got = jax.jit(_max_pool_elementwise, static_argnums=(1, 2, 3, 4, 5))(x, k, stride, padding, oh, ow)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    assert got[1].dtype == want[1].dtype and got[0].dtype == want[0].dtype
    # under jax.jit: the elementwise form behind a lax.cond (Note [Max pool under jit]),
    # whichever branch the predicate picks (the first element NaN or not)
    for first in (1.0, np.nan):
        xf = x.at[0, 0, 0, 0].set(first)
        want_f = jax.jit(_max_pool_reduce, static_argnums=(1, 2, 3, 4, 5))(xf, k, stride, padding, oh, ow)
        got_f = jax.jit(_max_pool_materialised, static_argnums=(1, 2, 3, 4, 5))(xf, k, stride, padding, oh, ow)
        for g_, w_ in zip(got_f, want_f):
            np.testing.assert_array_equal(np.asarray(g_), np.asarray(w_))
            assert g_.dtype == w_.dtype
    # eagerly max_pool2d takes the elementwise form, traced the reduction; same gradients
    g_eager = rf.grad(lambda x: rf.sum(rf.max_pool2d(x, k, stride, padding) * 1.5))(x)
    g_jit = jax.jit(rf.grad(lambda x: rf.sum(rf.max_pool2d(x, k, stride, padding) * 1.5)))(x)
    np.testing.assert_array_equal(np.asarray(g_eager), np.asarray(g_jit))
    # vmap keeps the reduction (a batched predicate would fold the cond away)
    g_vmap = jax.vmap(rf.grad(lambda x: rf.sum(rf.max_pool2d(x, k, stride, padding) * 1.5)))(x)
    np.testing.assert_array_equal(np.asarray(g_eager), np.asarray(g_vmap))
