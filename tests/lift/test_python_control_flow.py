"""Python control flow on array values inside a lifted function: ``if`` on a value,
``int()``/``.item()``, a Python ``while`` on a value. ``jax.grad`` accepts these
when called eagerly; ``rf.lift`` traces such a call with its values (Note [Concrete
tracing] in rumus_fx/lift/concrete.py). Each program against ``jax.grad`` of the
same function on every branch, each differentiable argument alone and together,
and finite differences in float64; custom rules honoured on the way; under
``jax.jit``/``jax.vmap`` jax's own error, as for ``jax.grad``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import rumus_fx as rf
from rumus_fx.lift import closure, tracing
from rumus_fx.testing import check_grads


def branchy(x, y):
    if jnp.sum(x) > 0:
        out = jnp.sum(jnp.sin(x) * y)
    else:
        out = jnp.sum(x**3 * y)
    if y[0] < 0.5:  # a branch on the other argument's value
        out = out * 2.0
    return out


def looped(x, n):
    out = x
    for _ in range(int(n)):  # the trip count is a value
        out = jnp.tanh(out) * x
    k = jnp.argmax(x).item()  # an index read as a Python int
    return jnp.sum(out) + x[k] ** 2


def halving(x):
    while jnp.max(jnp.abs(x)) > 1.0:  # a Python while on a value
        x = x / 2.0
    return jnp.sum(x**2 * jnp.arange(1.0, 4.0))


X = np.array([0.7, -0.2, 0.4])
Y = np.array([0.3, 1.5, -0.8])


def _check(f, args, nums_list, jit=False):
    for nums in nums_list:
        check_grads(rf.lift(f), args, nums, oracle=f, jit=jit, atol=1e-10, rtol=1e-10, fd_tol=1e-6)


@pytest.mark.parametrize("sx, sy", [(1, 1), (1, -1), (-1, 1), (-1, -1)], ids=["pp", "pn", "np", "nn"])
def test_if_on_values_every_branch_and_argument(x64, sx, sy):
    x, y = jnp.asarray(sx * X), jnp.asarray(sy * Y)
    _check(branchy, (x, y), [0, 1, (0, 1)])


@pytest.mark.parametrize("n", [0, 1, 3])
def test_trip_count_and_item_index_from_values(x64, n):
    _check(looped, (jnp.asarray(X), jnp.asarray(n)), [0])
    _check(looped, (jnp.asarray(-X * 3.0), jnp.asarray(n)), [0])


_BRANCHES = [lambda x, y: jnp.sum(jnp.sin(x) * y), lambda x, y: jnp.sum(x**2 * y), lambda x, y: jnp.sum(x * y**3)]


def indexed(x, y):
    """A list indexed by a traced integer (its ``__index__``), as jax's
    lax_control_flow_test ``f_ref`` writes a switch."""
    return _BRANCHES[jnp.argmax(y)](x, y)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_list_indexed_by_a_value(x64, k):
    y = np.roll(Y, k - 1)  # the largest element at position k
    _check(indexed, (jnp.asarray(X), jnp.asarray(y)), [0, 1, (0, 1)])


def test_python_while_on_a_value(x64):
    for scale in (0.5, 3.0, 40.0):  # zero, two and six halvings
        _check(halving, (jnp.asarray(X * scale),), [0])


def numpy_count(x, y):
    """A count read as a NumPy value (``np.asarray`` of a traced integer, as
    TensorFlow Probability's JAX substrate reads sizes)."""
    n = int(np.asarray(jnp.sum(y > 0)))
    return jnp.sum(jnp.sin(x[:n]) * y[:n]) + jnp.sum(x**2) * n


def shaped_by_a_value(x, y):
    """A shape built from a traced integer (``jnp.zeros((n,))``: jax's shape check
    raises a plain TypeError there, not a concretization error)."""
    n = jnp.sum(y > 0)
    pad = jnp.zeros((n,)) + jnp.sum(y)
    return jnp.sum(jnp.concatenate([x * y, pad]) ** 2)


@pytest.mark.parametrize("f", [numpy_count, shaped_by_a_value])
@pytest.mark.parametrize("sign", [1, -1])
def test_numpy_value_and_shape_from_a_value(x64, f, sign):
    """Both fail under jax.jit (jax's own error there too) and work eagerly, as
    under jax.grad: traced with the values, every argument alone and together."""
    x, y = jnp.asarray(X), jnp.asarray(sign * Y)
    with pytest.raises(TypeError):
        jax.jit(jax.grad(f))(x, y)
    _check(f, (x, y), [0, 1, (0, 1)])


def test_a_shape_wrong_whatever_the_values_stays_a_shape_error():
    f = lambda x: jnp.sum(jnp.zeros((2.5,))) + jnp.sum(x)  # noqa: E731
    with pytest.raises(rf.ShapeError, match=r"Shapes must be .*\(2\.5,\)"):
        rf.grad(rf.lift(f))(jnp.ones(2))


def test_each_call_follows_its_own_branch():
    """The program of one branch is never reused for a call taking the other one
    (the gradient would be silently wrong): alternate, compare every call."""
    lifted = rf.lift(branchy)
    g = rf.grad(lifted, argnums=(0, 1))
    before = len(tracing._PROGRAMS)
    for k in range(6):
        x = jnp.asarray(X if k % 2 == 0 else -X, jnp.float32)
        y = jnp.asarray(Y if k % 3 else -Y, jnp.float32)
        for a, b in zip(g(x, y), jax.grad(branchy, argnums=(0, 1))(x, y)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # traced with values on every call, compiled once per branch taken (four here)
    assert len(tracing._PROGRAMS) - before <= 4


def test_traced_with_values_on_every_call():
    f = lambda x: jnp.sum(x**2) if jnp.sum(x) > 0 else jnp.sum(x**3)  # noqa: E731
    g = rf.grad(rf.lift(f))
    g(jnp.asarray(X, jnp.float32))
    start = closure.traces()
    for _ in range(5):
        g(jnp.asarray(X, jnp.float32))
    assert closure.traces() - start == 5  # never from a cache: the branch may change


# -- custom rules inside a function traced with values ----------------------------


@jax.custom_jvp
def _sin10(x):
    return jnp.sin(x)


@_sin10.defjvp
def _sin10_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return jnp.sin(x), 10.0 * t  # not the primal's derivative: the rule must be used


@jax.custom_vjp
def _cos7(x):
    return jnp.cos(x)


_cos7.defvjp(lambda x: (jnp.cos(x), x), lambda r, g: (7.0 * g * r,))


def with_rules(x, y, c):
    s = jnp.sum(x * 0.0)
    if x[0] > 0:
        s = s + jnp.sum(_sin10(x))
    if jnp.sum(x * y) < 100.0:
        s = s + jnp.sum(_cos7(x) * y)

    def scaled(z):  # made inside, closing over a value of the function (c, not differentiated)
        return z * jnp.sum(c)

    scaled = jax.custom_jvp(scaled)
    scaled.defjvp(lambda p, t: (scaled(p[0]), t[0] * 3.0 * c[0]))
    return s + scaled(x[1]) + jnp.sum(jax.nn.relu(x - 0.4))


@pytest.mark.parametrize("sign", [1, -1])
def test_custom_rules_are_honoured(sign):
    x, y = jnp.asarray(sign * X, jnp.float32), jnp.asarray(Y, jnp.float32)
    c = jnp.asarray([2.0, -1.0], jnp.float32)
    for nums in (0, 1, (0, 1)):
        got = rf.grad(rf.lift(with_rules), argnums=nums)(x, y, c)
        want = jax.grad(with_rules, argnums=nums)(x, y, c)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@jax.custom_jvp
def _log_gauss(x):
    # jnp.array of a constant inside a rule's primal (TensorFlow Probability's
    # lbeta writes tf.constant(np.log(2 * np.pi), dtype=x.dtype)): jax stages it
    # into the current trace, the one that computes the primal's values here
    return -0.5 * (x**2 + jnp.array(np.log(2 * np.pi)).astype(x.dtype))


_log_gauss.defjvp(lambda p, t: (_log_gauss(p[0]), -p[0] * t[0]))


def test_a_constant_staged_inside_a_rule_traced_with_values(x64):
    f = lambda x, y: jnp.sum(_log_gauss(x) * y) if jnp.sum(y) > 0 else jnp.sum(_log_gauss(x * y))  # noqa: E731
    for sign in (1, -1):
        _check(f, (jnp.asarray(X), jnp.asarray(sign * np.abs(Y))), [0, 1, (0, 1)])


def test_second_order(x64):
    h = lambda x: jnp.sum(x**3) if x[0] > 0 else jnp.sum(jnp.sin(x) ** 2)  # noqa: E731
    for x in (jnp.asarray(X), jnp.asarray(-X)):
        got = rf.grad(lambda x: rf.grad(rf.lift(h))(x).sum())(x)
        np.testing.assert_allclose(got, jax.grad(lambda x: jnp.sum(jax.grad(h)(x)))(x), rtol=1e-12)


def test_closure_values_are_read_at_each_call(x64, monkeypatch):
    mod = __import__(__name__, fromlist=["_"])
    monkeypatch.setattr(mod, "_SCALE", jnp.asarray(2.0), raising=False)
    f = lambda x: jnp.sum(x * mod._SCALE) if jnp.sum(x) > 0 else jnp.sum(x / mod._SCALE)  # noqa: E731
    g = rf.grad(rf.lift(f))
    for s in (2.0, 5.0):
        monkeypatch.setattr(mod, "_SCALE", jnp.asarray(s))
        for x in (jnp.asarray(X), jnp.asarray(-X)):
            np.testing.assert_allclose(g(x), jax.grad(f)(x), rtol=1e-12)


def _weighted(x, w):
    return jnp.sum(jnp.sin(x) * w) if jnp.sum(x) > 0 else jnp.sum(x**2 * w)


def test_tape_with_a_closed_over_tracked_tensor():
    x = jnp.asarray(X, jnp.float32)
    for sign in (1.0, -1.0):
        with rf.Tape() as tape:
            w = rf.tensor(jnp.asarray(Y, jnp.float32), requires_grad=True)
            v = rf.tensor(sign * x, requires_grad=True)
            out = rf.lift(lambda x, w=w: _weighted(x, w.value))(v)  # w read through a default
        grads = tape.backward(out)
        want = jax.grad(_weighted, argnums=(0, 1))(sign * x, jnp.asarray(Y, jnp.float32))
        np.testing.assert_allclose(grads[v], want[0], rtol=1e-6)
        np.testing.assert_allclose(grads[w], want[1], rtol=1e-6)


# -- what jax.grad refuses stays refused ------------------------------------------


@pytest.mark.parametrize("transform", ["jit", "vmap"])
def test_under_a_transformation_the_error_is_jaxs(transform):
    x = jnp.asarray(X, jnp.float32)
    f = lambda x: jnp.sum(x**2) if jnp.sum(x) > 0 else jnp.sum(x**3)  # noqa: E731
    wrap = jax.jit if transform == "jit" else jax.vmap
    arg = x if transform == "jit" else jnp.stack([x, -x])
    with pytest.raises(jax.errors.TracerBoolConversionError):
        wrap(jax.grad(f))(arg)
    with pytest.raises(jax.errors.TracerBoolConversionError):
        wrap(rf.grad(rf.lift(f)))(arg)


def test_a_list_indexed_by_a_value_under_jit_raises_jaxs_error():
    args = (jnp.asarray(X), jnp.asarray(Y))
    with pytest.raises(jax.errors.TracerIntegerConversionError):
        jax.jit(jax.grad(indexed))(*args)
    with pytest.raises(jax.errors.TracerIntegerConversionError):
        jax.jit(rf.grad(rf.lift(indexed)))(*args)


def test_float_of_a_tracked_value_is_refused_as_by_jax_grad():
    f = lambda x: x * float(x)  # noqa: E731
    with pytest.raises(jax.errors.ConcretizationTypeError):
        jax.grad(f)(2.0)
    with pytest.raises(rf.AutogradError, match="cut it out of the gradient") as info:
        rf.grad(rf.lift(f))(jnp.asarray(2.0))
    assert isinstance(info.value.__cause__, jax.errors.ConcretizationTypeError)


def test_a_tracked_floating_value_is_never_made_a_constant(x64):
    """jnp.unique(x), x.item() and float(x) on a tracked float would cut x out of
    the gradient (jax.grad silently drops the first two): raised instead. On an
    untracked argument they are data and work."""
    x, y = jnp.array([1.0, 2.0, 2.0, 3.0]), jnp.array([0.5, 2.0])

    def uniq(x, y):
        return jnp.sum(jnp.unique(x)) * jnp.sum(y) if jnp.sum(y) > 0 else jnp.sum(x)

    def item(x, y):
        return jnp.sum(y) * x[0].item() * float(x[1])

    for f in (uniq, item):
        with pytest.raises(rf.AutogradError, match="cut it out of the gradient"):
            rf.grad(rf.lift(f))(x, y)
        _check(f, (x, y), [1])  # x is data here: its values are constants
    stopped = lambda x: jnp.sum(x) * lax.stop_gradient(x[0]).item()  # noqa: E731
    check_grads(rf.lift(stopped), (x,), 0, oracle=stopped, fd=False)  # (a constant on purpose: no FD)


def test_shard_map_inside_is_refused_by_name():
    from jax.sharding import AxisType, PartitionSpec

    mesh = jax.make_mesh((1,), ("i",), axis_types=(AxisType.Auto,))
    spec = PartitionSpec("i")
    double = jax.shard_map(lambda a: a * 2.0, mesh=mesh, in_specs=spec, out_specs=spec)
    f = lambda x: jnp.sum(double(x) ** 2) if jnp.sum(x) > 0 else jnp.sum(x)  # noqa: E731
    x = jnp.asarray(X, jnp.float32)
    assert jnp.all(jax.grad(f)(x) == 8.0 * x)  # jax.grad runs it eagerly
    with pytest.raises(rf.AutogradError, match="shard_map"):
        rf.grad(rf.lift(f))(x)


def test_a_debug_callback_runs_once_per_call():
    """A function traced with its values binds each primitive twice (to record it and
    to compute its value): a ``jax.debug.callback``/``jax.debug.print`` ran twice per
    call. It has no value to give back, so it is only recorded; the program runs it
    once, as jax.grad does."""
    calls = []

    def f(x):
        jax.debug.callback(lambda v: calls.append(float(v.sum())), x)
        if x.sum() > 0:
            return jnp.sum(jnp.sin(x))
        return jnp.sum(x**2)

    for x in (jnp.arange(3.0), -jnp.arange(3.0)):
        calls.clear()
        jax.grad(f)(x)
        want = list(calls)
        calls.clear()
        got = rf.grad(rf.lift(f))(x)
        assert calls == want == [float(x.sum())]
        np.testing.assert_allclose(got, jax.grad(f)(x), rtol=1e-6)
