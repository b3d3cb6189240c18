"""``tape.backward(loss, create_graph=True)`` through the Tape API (Note [Create
graph] in rumus_fx/lift/higher.py): second order through every op of the op
table, each differentiable argument alone and all together, against
``jax.grad`` of ``jax.grad`` of the op's jnp oracle (float64, 1e-9); lifted calls;
third order; the version case; the records that cannot be differentiated raise."""

from __future__ import annotations

import gc

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf
import rumus_fx.numpy as rnp
from rumus_fx.autograd.record import _field_kinds

from .optable import OPS
from .test_optable import _setup

# records that keep a value their inputs cannot give back (Note [Create graph])
UNSUPPORTED = {"cross_entropy"}
JIT_DEFAULT = {"matmul", "layer_norm", "softmax", "conv2d", "scaled_dot_product_attention", "mul"}


def _subsets(info):
    sample = info.samples(np.random.default_rng(0))[0]
    positions = [i for i, a in enumerate(sample.args) if isinstance(a, np.ndarray)]
    sample_diff = tuple(positions.index(d) for d in sample.diff)
    subsets = [("all", sample_diff)]
    if len(sample_diff) > 1:
        subsets += [(f"arg{d}", (d,)) for d in sample_diff]
    return subsets


# each argument alone runs by default for the ops whose records read one
# operand's data for another's gradient; for the rest it is -m slow
ALONE_DEFAULT = {
    "mul",
    "div",
    "matmul",
    "bmm",
    "layer_norm",
    "batch_norm_2d_train",
    "conv2d",
    "scaled_dot_product_attention",
}
CASES = [
    pytest.param(
        info,
        which,
        diff,
        id=f"{info.name}-{which}",
        marks=() if which == "all" or info.name in ALONE_DEFAULT else pytest.mark.slow,
    )
    for info in OPS
    for which, diff in _subsets(info)
]
JIT_CASES = [
    pytest.param(info, id=info.name, marks=() if info.name in JIT_DEFAULT else pytest.mark.slow) for info in OPS
]


def _tape_hvp(fun_rf, arrays, diff, vs):
    """Gradient of sum(g_d * v_d) over the first-order gradients g, both
    backward passes on one tape."""
    with rf.Tape() as tape:
        args = [rf.tensor(a, requires_grad=True) if i in diff else a for i, a in enumerate(arrays)]
        loss = fun_rf(*args)
        g = tape.backward(loss, create_graph=True)
        inner = sum(rf.sum(rf.mul(g[args[d]], v)) for d, v in zip(diff, vs))
    if inner.grad_id is None:  # the first-order gradients are constants (a linear op)
        return [jnp.zeros_like(arrays[d]) for d in diff], tape
    outer = tape.backward(inner)
    return [outer[args[d]] for d in diff], tape


def _jax_hvp(fun_ref, arrays, diff, vs):
    def h(*a):
        gs = jax.grad(fun_ref, argnums=diff)(*a)
        return sum(jnp.sum(g * v) for g, v in zip(gs, vs))

    return list(rf.testing.jax_oracle_grad(h, arrays, diff))


def _check_declared(tape):
    """Every saved float array is an input/output value (provenance), a
    constant, or declared in ``derived_fields``: an undeclared derived value
    would silently lose terms."""
    for e in tape.entries:
        op = e.op
        kinds = _field_kinds(type(op))
        known = {(n, i) for n, i, _ in e.provenance}
        for name, kind in kinds.items():
            if kind != "saved" or name in type(op).derived_fields:
                continue
            value = getattr(op, name)
            items = list(enumerate(value)) if isinstance(value, tuple) else [(None, value)]
            for i, v in items:
                if hasattr(v, "dtype") and jnp.issubdtype(v.dtype, jnp.inexact):
                    assert (name, i) in known, f"{op.name}.{name}[{i}] is neither an input/output nor declared derived"


@pytest.mark.parametrize("info,which,diff", CASES)
def test_create_graph_matches_jax(info, which, diff):
    with jax.enable_x64(True):
        arrays, fun_rf, fun_ref, _, _, _ = _setup(info, 0, jnp.float64)
        rng = np.random.default_rng(5)
        vs = [jnp.asarray(rng.standard_normal(arrays[d].shape)) for d in diff]
        if info.name in UNSUPPORTED:
            with pytest.raises(rf.AutogradError, match="create_graph=True"):
                _tape_hvp(fun_rf, arrays, diff, vs)
            return
        # the first-order tape: every saved value has a known origin
        with rf.Tape() as tape:
            args = [rf.tensor(a, requires_grad=True) if i in diff else a for i, a in enumerate(arrays)]
            fun_rf(*args)
        _check_declared(tape)
        got, _ = _tape_hvp(fun_rf, arrays, diff, vs)
        chex.assert_trees_all_close(got, _jax_hvp(fun_ref, arrays, diff, vs), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("info", JIT_CASES)
def test_create_graph_under_jit(info):
    if info.name in UNSUPPORTED:
        return
    with jax.enable_x64(True):
        arrays, fun_rf, fun_ref, diff, _, _ = _setup(info, 0, jnp.float64)
        rng = np.random.default_rng(6)
        vs = [jnp.asarray(rng.standard_normal(arrays[d].shape)) for d in diff]
        got = jax.jit(lambda *a: _tape_hvp(fun_rf, list(a), diff, vs)[0])(*arrays)
        chex.assert_trees_all_close(got, _jax_hvp(fun_ref, arrays, diff, vs), rtol=1e-9, atol=1e-9)


def _mlp_rf(w1, w2, x):
    h = rnp.tanh(x @ w1)
    return rnp.sum(rnp.sin(h @ w2) ** 2) + rf.sum(rf.softmax(h, axis=-1) * h)


def _mlp_jax(w1, w2, x):
    h = jnp.tanh(x @ w1)
    return jnp.sum(jnp.sin(h @ w2) ** 2) + jnp.sum(jax.nn.softmax(h, axis=-1) * h)


def _params():
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.standard_normal(s)) for s in [(4, 5), (5, 3), (6, 4)]]


def test_gradient_penalty_with_lifted_calls():
    """A WGAN-GP style penalty: the gradient of the output with respect to the
    input, squared, differentiated with respect to the weights."""
    with jax.enable_x64(True):
        w1, w2, x0 = _params()
        lifted = rf.lift(lambda w1, w2, x: jnp.sum(jnp.cos(jnp.tanh(x @ w1) @ w2)))
        with rf.Tape() as tape:
            p1, p2 = rf.tensor(w1, requires_grad=True), rf.tensor(w2, requires_grad=True)
            x = rf.tensor(x0, requires_grad=True)
            out = lifted(p1, p2, x) + _mlp_rf(p1, p2, x)
            gx = tape.backward(out, create_graph=True)[x]
            penalty = rf.sum((rnp.sqrt(rf.sum(gx * gx, axis=1)) - 1.0) ** 2)
        got = tape.backward(penalty)

        def ref(w1, w2, x):
            f = lambda x: jnp.sum(jnp.cos(jnp.tanh(x @ w1) @ w2)) + _mlp_jax(w1, w2, x)  # noqa: E731
            gx = jax.grad(f)(x)
            return jnp.sum((jnp.sqrt(jnp.sum(gx * gx, axis=1)) - 1.0) ** 2)

        want = rf.testing.jax_oracle_grad(ref, (w1, w2, x0), (0, 1))
        chex.assert_trees_all_close((got[p1], got[p2]), want, rtol=1e-9, atol=1e-9)


def test_third_order_through_the_tape():
    with jax.enable_x64(True):
        x0 = jnp.linspace(-1.0, 1.0, 5)
        with rf.Tape() as tape:
            x = rf.tensor(x0, requires_grad=True)
            y = rf.sum(rnp.sin(x) * rf.exp(x))
            g1 = tape.backward(y, create_graph=True)[x]
            g2 = tape.backward(rf.sum(g1 * g1), create_graph=True)[x]
            z = rf.sum(g2 * x)
        got = tape.backward(z)[x]

        f = lambda x: jnp.sum(jnp.sin(x) * jnp.exp(x))  # noqa: E731
        f2 = lambda x: jnp.sum(jax.grad(f)(x) ** 2)  # noqa: E731
        want = rf.testing.jax_oracle_grad(lambda x: jnp.sum(jax.grad(f2)(x) * x), (x0,))
        chex.assert_trees_all_close(got, want, rtol=1e-9, atol=1e-9)


def test_maml_step_on_an_outer_tape():
    """The inner gradient step recorded on an enclosing tape; its gradients
    are tracked Tensors of that tape."""
    with jax.enable_x64(True):
        w1, w2, x0 = _params()
        y0 = jnp.ones((6, 3))
        with rf.Tape() as outer:
            p1, p2 = rf.tensor(w1, requires_grad=True), rf.tensor(w2, requires_grad=True)
            loss = rf.mse_loss(rf.tanh(x0 @ p1) @ p2, y0)
            g = outer.backward(loss, create_graph=True)
            q1, q2 = p1 - 0.1 * g[p1], p2 - 0.1 * g[p2]
            meta = rf.mse_loss(rf.tanh(x0 @ q1) @ q2, 2 * y0)
        got = outer.backward(meta)

        def inner(w1, w2, y):
            return jnp.mean((jnp.tanh(x0 @ w1) @ w2 - y) ** 2)

        def ref(w1, w2):
            g1, g2 = jax.grad(inner, (0, 1))(w1, w2, y0)
            return inner(w1 - 0.1 * g1, w2 - 0.1 * g2, 2 * y0)

        chex.assert_trees_all_close(
            (got[p1], got[p2]), rf.testing.jax_oracle_grad(ref, (w1, w2), (0, 1)), rtol=1e-9, atol=1e-9
        )


def test_gradients_are_arrays_without_create_graph_and_tensors_with():
    with rf.Tape() as tape:
        x = rf.tensor(jnp.ones(3), requires_grad=True)
        y = rf.sum(rf.exp(x))
        g = tape.backward(y, create_graph=True)
    assert isinstance(g[x], rf.Tensor) and g[x].grad_id is not None
    assert not tape.consumed  # create_graph retains the tape
    np.testing.assert_allclose(rf.testing.as_array(g[x]), np.exp(np.ones(3)), rtol=1e-6)


def test_write_between_the_two_backward_passes_is_a_version_mismatch():
    with rf.Tape() as tape:
        x = rf.tensor(jnp.linspace(0.1, 1.0, 4), requires_grad=True)
        h = rf.mul(x, 2.0)
        y = rf.sum(rf.log(h))  # LogBackward saves h
        gx = tape.backward(y, create_graph=True)[x]
        z = rf.sum(gx * gx)
        with rf.no_grad():
            h.mul_(3.0)  # the data the first backward read
    with pytest.raises(rf.VersionMismatch):
        tape.backward(z)


def test_records_that_keep_no_inputs_raise():
    with rf.Tape() as tape:
        logits = rf.tensor(jnp.ones((2, 3)), requires_grad=True)
        loss = rf.cross_entropy(logits, jnp.array([0, 2]))
        with pytest.raises(rf.AutogradError, match="CrossEntropyBackward"):
            tape.backward(loss, create_graph=True)


def test_a_released_lifted_input_raises():
    lifted = rf.lift(lambda a: jnp.sum(jnp.sin(jnp.tanh(a))))
    with rf.Tape() as tape:
        x = rf.tensor(jnp.ones(3), requires_grad=True)
        loss = lifted(x * 2.0)  # nothing keeps x * 2 (the call keeps tanh's output only)
        gc.collect()
        with pytest.raises(rf.AutogradError, match="released"):
            tape.backward(loss, create_graph=True)
