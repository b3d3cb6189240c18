"""rf.lift of functions that read arrays and Python values they were not given
(closure cells, module globals, default arguments, ``self.<attr>``, partials).

The lifted program is cached: every call must see the current values (each call
equals ``jax.grad`` of the same function at that moment, eagerly and under
``jax.jit``), and a new trace happens only when something static changes (Note
[Closures of a lifted function] in rumus_fx/lift/closure.py).
"""

from __future__ import annotations

import functools
import gc
import sys
import types
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf
from rumus_fx.lift import closure

_MOD = sys.modules[__name__]
_X = jnp.asarray(np.random.default_rng(0).standard_normal((6, 4)), jnp.float32)
_W = jnp.asarray(np.random.default_rng(1).standard_normal((4, 3)) * 0.5, jnp.float32)
_Y = jnp.zeros((6, 3), jnp.float32)
_YN = np.zeros((6, 3), np.float32)
_SCALE = 1.0
_Y8 = jnp.asarray(np.random.default_rng(8).standard_normal((6, 3)), jnp.float32)
_FLAG = 1.0


def _y(seed: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((6, 3)), jnp.float32)


def _check(fn, *rest, w=_W, jit=True):
    """rf.grad(rf.lift(fn)) equals jax.grad(fn) now (gradient in the first
    argument), eagerly and (``jit``) under a fresh jax.jit."""
    want = jax.grad(fn)(w, *rest)
    lifted = rf.lift(fn)
    np.testing.assert_allclose(rf.grad(lifted)(w, *rest), want, rtol=1e-5, atol=1e-6)
    if jit:
        np.testing.assert_allclose(jax.jit(lambda v: rf.grad(lifted)(v, *rest))(w), want, rtol=1e-5, atol=1e-6)


def loss_global(w):
    return jnp.mean((jnp.tanh(_X @ w) - _Y) ** 2) * _SCALE


def loss_numpy(w):
    return jnp.mean((jnp.tanh(_X @ w) - _YN) ** 2)


def loss_scaled(w, x):  # reads no array it is not given: only a Python float
    return jnp.sum(jnp.tanh(x @ w)) * _SCALE


def loss_branch(w, x):
    h = x @ w
    return jnp.sum(jnp.tanh(h)) if _FLAG > 0 else jnp.sum(jnp.sin(h) * _FLAG)


def test_rebound_global_and_scale_are_seen_without_retracing(monkeypatch):
    monkeypatch.setattr(_MOD, "_Y", _y(2))
    _check(loss_global)
    before = closure.traces()
    for seed in (3, 4):
        monkeypatch.setattr(_MOD, "_Y", _y(seed))
        _check(loss_global, jit=seed == 4)
    assert closure.traces() == before  # same shapes: the cached program, new values
    for s in (2.0, -0.5):  # a Python float the function multiplies by
        monkeypatch.setattr(_MOD, "_SCALE", s)
        _check(loss_global, jit=False)
        _check(loss_scaled, _X)


def test_numpy_array_written_in_place_is_seen(monkeypatch):
    yn = np.zeros((6, 3), np.float32)
    monkeypatch.setattr(_MOD, "_YN", yn)
    _check(loss_numpy, jit=False)
    before = closure.traces()
    yn[...] = np.asarray(_y(5))
    _check(loss_numpy, jit=False)
    yn *= -2.0
    _check(loss_numpy)
    assert closure.traces() == before


def test_python_value_the_function_branches_on(monkeypatch):
    for flag in (1.0, -1.0, 2.0, -3.0):
        monkeypatch.setattr(_MOD, "_FLAG", flag)
        _check(loss_branch, _X, jit=flag < -2)


class _Model:
    def __init__(self, y):
        self.y = y
        self.scale = 1.0

    def __call__(self, w):
        return jnp.mean((jnp.tanh(_X @ w) - self.y) ** 2) * self.scale

    def loss(self, w):
        return self(w) + jnp.sum(self.y[0] * w[0])


def test_swapped_attribute_of_a_callable_object_and_of_a_bound_method():
    m = _Model(_y(6))
    _check(m, jit=False)
    _check(m.loss, jit=False)
    before = closure.traces()
    m.y = _y(7)
    _check(m)
    _check(m.loss)
    assert closure.traces() == before
    m.scale = 3.0
    _check(m)


def test_closure_cell_default_argument_partial_and_helper():
    def make(y, k=2.0):
        return lambda w: jnp.sum((_X @ w - y) ** 2) * k

    def with_default(w, y=_Y8):
        return jnp.sum(jnp.sin(_X @ w) * y)

    def helper(w):
        return jnp.tanh(_X @ w) * _Y

    def calls_helper(w):
        return jnp.sum(helper(w) ** 2)

    _check(make(_y(9)), jit=False)
    before = closure.traces()
    _check(make(_y(10)), jit=False)  # a new function object with the same code: no new trace
    assert closure.traces() == before
    _check(make(_y(10), 3.0))  # a Python value in a cell: a new trace, its value used
    _check(with_default, jit=False)
    with_default.__defaults__ = (_y(11),)
    _check(with_default)
    _check(calls_helper)
    part = functools.partial(lambda w, y: jnp.sum(jnp.tanh(_X @ w) * y), y=_y(12))
    _check(part, jit=False)
    _check(functools.partial(part.func, y=_y(13)))


def test_function_needing_a_closed_over_value_while_tracing():
    yb = np.array(_y(14))

    def loss(w):  # the array's value decides the program: traced with it baked in
        return jnp.sum(jnp.tanh(_X @ w)) if float(yb[0, 0]) > 0 else jnp.sum(jnp.sin(_X @ w))

    for sign in (1.0, -1.0, 1.0):
        yb[0, 0] = sign
        _check(loss, jit=sign < 0)


def test_one_trace_for_a_hundred_calls(monkeypatch):
    lifted = rf.grad(rf.lift(loss_global))
    lifted(_W)
    before = closure.traces()
    for seed in range(100):
        monkeypatch.setattr(_MOD, "_Y", jnp.full((6, 3), seed / 100.0, jnp.float32))
        g = lifted(_W)
    assert closure.traces() == before
    np.testing.assert_allclose(g, jax.grad(loss_global)(_W), rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(_MOD, "_Y", jnp.ones((1, 3), jnp.float32))  # a new shape: one new trace
    np.testing.assert_allclose(lifted(_W), jax.grad(loss_global)(_W), rtol=1e-5, atol=1e-6)
    assert closure.traces() == before + 1


def test_tracked_tensor_in_a_closure_gets_its_gradient_on_every_call():
    y = _y(15)

    def outer(w, v):
        return rf.lift(lambda x: jnp.sum(jnp.tanh(x @ w) * v))(_X)  # w and v closed over

    def plain(w, v):
        return jnp.sum(jnp.tanh(_X @ w) * v)

    g = rf.grad(outer, argnums=(0, 1))
    for w in (_W, _W * 2.0, -_W):
        got = g(w, y)
        want = jax.grad(plain, argnums=(0, 1))(w, y)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_untracked_tensor_in_a_closure_is_live_between_calls_and_snapshotted_within_one():
    c = rf.tensor(_y(16))

    def loss(w):
        return jnp.sum(jnp.tanh(_X @ w) * c)

    lifted = rf.lift(loss)
    for _ in range(2):
        want = jax.grad(lambda w: jnp.sum(jnp.tanh(_X @ w) * c.value))(_W)
        np.testing.assert_allclose(rf.grad(lifted)(_W), want, rtol=1e-5, atol=1e-6)
        c.add_(1.0)  # written in place between calls: the next call reads the new value
    with rf.Tape() as tape:
        w = rf.tensor(_W, requires_grad=True)
        out = lifted(w)
    c.add_(1.0)  # written between this call and its backward
    with pytest.raises(rf.VersionMismatch):
        tape.backward(out)


def test_rebound_global_finite_differences(x64, monkeypatch):
    w = jnp.asarray(_W, jnp.float64)
    for seed in (17, 18):
        monkeypatch.setattr(_MOD, "_Y", jnp.asarray(_y(seed), jnp.float64))
        monkeypatch.setattr(_MOD, "_X", jnp.asarray(_X, jnp.float64))
        got = rf.grad(rf.lift(loss_global))(w)
        v = jnp.asarray(np.random.default_rng(seed).standard_normal(w.shape))
        eps = 1e-6
        fd = (loss_global(w + eps * v) - loss_global(w - eps * v)) / (2 * eps)
        np.testing.assert_allclose(jnp.vdot(got, v), fd, rtol=1e-6, atol=1e-9)


_PL = [jnp.ones(4), jnp.ones(4) * 2.0]
_PD = {"a": jnp.ones(4) * 3.0}
_PT = (jnp.ones(4) * 4.0, 5.0)


def loss_containers(w):
    return jnp.sum(w * _PL[0] * _PL[1] + _PD["a"] * jnp.sin(w) * _PT[0] * _PT[1])


def test_arrays_in_lists_dicts_and_tuples(monkeypatch):
    x = jnp.linspace(-1.0, 1.0, 4)
    _check(loss_containers, w=x, jit=False)
    before = closure.traces()
    _PL[0] = _PL[0] + 1.0  # a list and a dict written in place, a tuple rebound
    _PD["a"] = _PD["a"] * -2.0
    monkeypatch.setattr(_MOD, "_PT", (_PT[0] - 3.0, 5.0))
    _check(loss_containers, w=x)
    assert closure.traces() == before
    monkeypatch.setattr(_MOD, "_PT", (_PT[0], 6.0))  # a Python value in the tuple: a new trace
    _check(loss_containers, w=x, jit=False)
    assert isinstance(_PL[0], jax.Array) and not isinstance(_PL[0], jax.core.Tracer)  # put back


def test_closure_over_an_outer_jit_value_and_second_order(monkeypatch):
    x = jnp.linspace(-1.0, 1.0, 4)

    @jax.jit
    def outer(w, y):  # the lifted function closes over a value of the enclosing trace
        return rf.grad(rf.lift(lambda v: jnp.sum(jnp.sin(v) * y)))(w)

    np.testing.assert_allclose(outer(x, x * 2.0), jnp.cos(x) * x * 2.0, rtol=1e-6)

    def f(w):
        return jnp.sum(jnp.sin(w) ** 2 * _Y[:4, 0])

    g2 = rf.grad(lambda w: rf.sum(rf.grad(rf.lift(f))(w) ** 2))
    for seed in (19, 20):
        monkeypatch.setattr(_MOD, "_Y", _y(seed))
        want = jax.grad(lambda w: jnp.sum(jax.grad(f)(w) ** 2))(x)
        np.testing.assert_allclose(g2(x), want, rtol=1e-5, atol=1e-6)


def test_numpy_array_read_inside_an_enclosing_jit_is_not_cached_across_traces():
    """A small NumPy array read through the closure is turned into a device array;
    inside an enclosing trace that array is a tracer of that trace and must not be
    reused by the next trace (it leaked: UnexpectedTracerError)."""
    idx = np.array([2, 0, 1])

    def loss(a):
        return jnp.sum(a[idx] ** 2)

    a = jnp.arange(1.0, 4.0)
    want = jax.grad(loss)(a)
    for shape_change in (False, True):  # a second, separate trace of the enclosing jit
        x = jnp.concatenate([a, jnp.zeros(1)]) if shape_change else a
        got = jax.jit(rf.grad(rf.lift(loss)))(x)
        np.testing.assert_allclose(got[:3], want)


# -- the kept plan: a repeated call reads again only the places the last walk read


def _grad_now(lifted, fn, w=_W):
    """``lifted`` (an ``rf.grad(rf.lift(fn))``) equals ``jax.grad(fn)`` now."""
    np.testing.assert_allclose(lifted(w), jax.grad(fn)(w), rtol=1e-5, atol=1e-6)


def _counts():
    return closure.walks(), closure.traces()


def test_kept_plan_sees_a_cell_rebound_to_another_array_and_a_python_value_changed():
    y, k = _y(21), 2.0

    def loss(w):
        return jnp.mean((jnp.tanh(_X @ w) - y) ** 2) * k

    lifted = rf.grad(rf.lift(loss))
    _grad_now(lifted, loss)
    walks, traces = _counts()
    for seed in (22, 23, 24):
        y = _y(seed)  # the cell rebound to another array of the same shape
        _grad_now(lifted, loss)
    assert _counts() == (walks, traces)  # the plan's reads held: no walk, no trace
    y = jnp.ones((1, 3), jnp.float32)  # another shape: the same plan, a new trace
    _grad_now(lifted, loss)
    assert _counts() == (walks, traces + 1)
    k = -3.0  # a Python value in a cell: walked again, traced again
    _grad_now(lifted, loss)
    assert _counts() == (walks + 1, traces + 2)


def test_kept_plan_sees_a_numpy_array_written_in_place_with_the_plan_warm():
    yn = np.array(_y(25))

    def loss(w):
        return jnp.mean((jnp.tanh(_X @ w) - yn) ** 2)

    lifted = rf.grad(rf.lift(loss))
    _grad_now(lifted, loss)
    walks, traces = _counts()
    for k in range(4):
        if k == 2:
            yn[...] = yn.copy()  # written with the same bytes: the last device copy serves
        else:
            yn[k, :] += 1.5  # one row written in place
        _grad_now(lifted, loss)
        np.testing.assert_array_equal(closure._current(yn), yn)
    assert _counts() == (walks, traces)


def test_numpy_zero_written_as_negative_zero_is_seen():
    """0.0 and -0.0 compare equal but are different values (arctan2 tells them
    apart): the NumPy array's bytes are compared, not its values."""
    z = np.zeros(3, np.float32)

    def loss(w):
        return jnp.sum(w * jnp.arctan2(z, -1.0))

    lifted = rf.grad(rf.lift(loss))
    w = jnp.ones(3)
    _grad_now(lifted, loss, w=w)
    z[1] = -0.0
    got = lifted(w)
    assert float(got[1]) < 0 < float(got[0])
    _grad_now(lifted, loss, w=w)


_PDG = {"y": _y(26)}


def loss_dict(w):
    return jnp.mean((jnp.tanh(_X @ w) - _PDG["y"]) ** 2) * _PDG.get("scale", 1.0)


def test_kept_plan_sees_a_dict_global_written_and_its_keys_changed(monkeypatch):
    lifted = rf.grad(rf.lift(loss_dict))
    _grad_now(lifted, loss_dict)
    walks, traces = _counts()
    monkeypatch.setitem(_PDG, "y", _y(27))  # an array written into the dict
    _grad_now(lifted, loss_dict)
    _check(loss_dict)  # (under jit too: the same program, inline)
    assert _counts() == (walks, traces)
    monkeypatch.setitem(_PDG, "scale", 3.0)  # a key added: walked, traced
    _grad_now(lifted, loss_dict)
    assert _counts() == (walks + 1, traces + 1)
    del _PDG["scale"]  # back to the first keys: walked, the first program again
    _grad_now(lifted, loss_dict)
    assert _counts() == (walks + 2, traces + 1)


def test_kept_plan_sees_attributes_added_a_method_patched_and_the_class_swapped(monkeypatch):
    class Model:
        def __init__(self, y):
            self.y = y

        def __call__(self, w):
            b = self.bias if "bias" in self.__dict__ else 0.0
            return jnp.mean((jnp.tanh(_X @ w) - self.y) ** 2) + jnp.sum(w * b)

    m = Model(_y(28))
    lifted = rf.grad(rf.lift(m))
    _grad_now(lifted, m)
    walks, traces = _counts()
    m.y = _y(29)  # an array attribute rebound: no walk, no trace
    _grad_now(lifted, m)
    assert _counts() == (walks, traces)
    m.bias = 0.5  # an attribute the code names, added: walked, traced
    _grad_now(lifted, m)
    m.bias = jnp.full((4, 3), 0.25, jnp.float32)  # now an array: walked, traced
    _grad_now(lifted, m)
    assert _counts() == (walks + 2, traces + 2)
    m.bias = jnp.full((4, 3), -1.0, jnp.float32)  # another array: no walk, no trace
    _grad_now(lifted, m)
    assert _counts() == (walks + 2, traces + 2)
    m.scale = 2.0
    monkeypatch.setattr(Model, "__call__", lambda self, w: jnp.sum(jnp.sin(_X @ w) * self.y) * self.scale)
    _grad_now(lifted, m)  # the class's method replaced: walked, traced
    monkeypatch.setattr(Model, "scale", property(lambda self: -4.0), raising=False)
    _grad_now(lifted, m)  # a property the code reads, new on the class (it hides m.scale): walked, traced

    class Other(Model):
        def __call__(self, w):
            return jnp.sum(jnp.cos(_X @ w) * self.y)

    m.__class__ = Other  # the object's class swapped: walked, traced
    _grad_now(lifted, m)
    assert _counts() == (walks + 5, traces + 5)


def test_kept_plan_sees_code_and_keyword_defaults_replaced():
    def loss(w, *, y=_Y8):
        return jnp.sum(jnp.sin(_X @ w) * y)

    def other(w, *, y=_Y8):
        return jnp.sum(jnp.cos(_X @ w) * y)

    lifted = rf.grad(rf.lift(loss))
    _grad_now(lifted, loss)
    walks, traces = _counts()
    loss.__kwdefaults__["y"] = _y(30)  # written into the keyword defaults: no walk, no trace
    _grad_now(lifted, loss)
    assert _counts() == (walks, traces)
    loss.__code__ = other.__code__  # the code replaced: walked, traced
    _grad_now(lifted, loss)
    assert _counts() == (walks + 1, traces + 1)


_PLG = [jnp.ones((6, 3), jnp.float32)]


def loss_list(w):
    return sum(jnp.sum(jnp.tanh(_X @ w) * a) for a in _PLG) * abs(-2.0)


def test_kept_plan_sees_a_list_grown_and_a_global_that_shadows_a_builtin(monkeypatch):
    lifted = rf.grad(rf.lift(loss_list))
    _grad_now(lifted, loss_list)
    walks, traces = _counts()
    first = _PLG[0]
    try:
        _PLG[0] = _y(31)  # an item rebound: no walk, no trace
        _grad_now(lifted, loss_list)
        assert _counts() == (walks, traces)
        _PLG.append(_y(32))  # the list grown: walked, traced
        _grad_now(lifted, loss_list)
        assert _counts() == (walks + 1, traces + 1)
    finally:
        _PLG[:] = [first]
    before = lifted(_W)
    monkeypatch.setattr(_MOD, "abs", lambda v: 3.0 * v, raising=False)  # read instead of the builtin
    _grad_now(lifted, loss_list)
    np.testing.assert_allclose(lifted(_W), before * -3.0, rtol=1e-5, atol=1e-6)


def test_bound_method_keeps_its_plan_while_its_object_changes():
    m = _Model(_y(33))
    method = m.loss
    lifted = rf.grad(rf.lift(method))
    _grad_now(lifted, method)
    walks, traces = _counts()
    m.y = _y(34)
    _grad_now(lifted, method)
    assert _counts() == (walks, traces)


def test_a_lifted_lambda_made_at_each_step_is_not_kept_alive():
    """The kept plan holds a lifted function weakly: a lambda made at each step,
    and the arrays it closes over, go when the step is done."""

    def step(w):
        y = jnp.arange(1.0, 4.0)
        f = lambda v: jnp.sum(jnp.sin(v) * y)  # noqa: E731
        rf.grad(rf.lift(f))(w)
        return weakref.ref(f), weakref.ref(y)

    refs = [step(jnp.ones(3)) for _ in range(3)]
    gc.collect()
    assert all(r() is None for pair in refs for r in pair)


class _Scaled:
    scale = 2.0  # class-level values the method reads as self.<name>
    y = _y(35)

    def __call__(self, w):
        return jnp.sum(jnp.sin(_X @ w) * self.y) * self.scale


def test_class_level_values_read_through_self_are_seen(monkeypatch):
    """A class-level array or Python value read as ``self.y`` is an input or part
    of the key like an attribute of the object (it was baked into the first
    program: later values were not seen)."""
    m = _Scaled()
    lifted = rf.grad(rf.lift(m))
    _grad_now(lifted, m)
    walks, traces = _counts()
    monkeypatch.setattr(_Scaled, "y", _y(36))  # a class-level array rebound: walked, not traced
    _grad_now(lifted, m)
    assert _counts() == (walks + 1, traces)
    monkeypatch.setattr(_Scaled, "scale", -3.0)  # a class-level Python value: walked, traced
    _grad_now(lifted, m)
    assert _counts() == (walks + 2, traces + 1)
    m.scale = 0.5  # the object's own attribute hides the class's
    _check(m)
    assert isinstance(_Scaled.__dict__["y"], jax.Array) and not isinstance(_Scaled.__dict__["y"], jax.core.Tracer)


# -- reads the walk cannot see: traced on every call ------------------------------


class _Holder:
    pass


class _Slotted:
    __slots__ = ("v",)


class _Config:  # a user's class whose attributes the loss reads as ``_Config.v``
    v = 1.0


class _Lazy:
    def __init__(self):
        self.store = {}

    def __getattr__(self, name):
        return self.store[name]


def _chain(depth):
    """A loss reaching ``_DEEP["v"]`` through ``depth`` helper calls (beyond the walk's ``DEPTH``)."""

    def leaf(w):
        return w * _DEEP["v"]

    f = leaf
    for _ in range(depth):
        f = functools.partial(lambda g, w: g(w), f)  # (a partial of a function: followed)
        f = (lambda g: lambda w: g(w))(f)
    return f


class _Computed:  # a descriptor: what it returns is computed on access
    def __get__(self, obj, objtype=None):
        return _STATE["v"]


class _Described:
    v = _Computed()


class _Helpers:
    @staticmethod
    def scaled(h):
        return h * _STATE["v"]

    @classmethod
    def scaled_by_class(cls, h):
        return h * _STATE["v"]


_STATE = {"v": 1.0}
_DESCRIBED = _Described()
_LAZY_MODULE = types.ModuleType("lazy_module")  # a module computing its attributes (PEP 562)
_LAZY_MODULE.__getattr__ = lambda name: _STATE[name]
_DEEP = {"v": 1.0}
_HOLDER = _Holder()
_SLOTTED = _Slotted()
_LAZY = _Lazy()
_NAMED = 1.0


def _jitted_helper(h):
    return h * _NAMED


_JITTED = jax.jit(_jitted_helper)

# (loss reading v, set v): v is an array [6, 3] or a Python float
_HIDDEN = {
    "getattr": (lambda h: h * getattr(_HOLDER, "v"), lambda v: setattr(_HOLDER, "v", v)),  # noqa: B009
    "vars": (lambda h: h * vars(_HOLDER)["v"], lambda v: setattr(_HOLDER, "v", v)),
    "globals": (lambda h: h * globals()["_NAMED"], lambda v: setattr(_MOD, "_NAMED", v)),
    "eval": (lambda h: h * eval("_NAMED"), lambda v: setattr(_MOD, "_NAMED", v)),
    "import": (
        lambda h: h * __import__("tests.lift.test_closures", fromlist=["_"])._NAMED,
        lambda v: setattr(_MOD, "_NAMED", v),
    ),
    "class attribute": (lambda h: h * _Config.v, lambda v: setattr(_Config, "v", v)),
    "slots": (lambda h: h * _SLOTTED.v, lambda v: setattr(_SLOTTED, "v", v)),
    "__getattr__": (lambda h: h * _LAZY.v, lambda v: _LAZY.store.__setitem__("v", v)),
    "jax.jit helper": (lambda h: _JITTED(h), lambda v: setattr(_MOD, "_NAMED", v)),
    "beyond the walk's depth": (_chain(closure.DEPTH + 2), lambda v: _DEEP.__setitem__("v", v)),
    "descriptor": (lambda h: h * _DESCRIBED.v, lambda v: _STATE.__setitem__("v", v)),
    "module __getattr__": (lambda h: h * _LAZY_MODULE.v, lambda v: _STATE.__setitem__("v", v)),
    "staticmethod of a class": (lambda h: _Helpers.scaled(h), lambda v: _STATE.__setitem__("v", v)),
    "classmethod of a class": (lambda h: _Helpers.scaled_by_class(h), lambda v: _STATE.__setitem__("v", v)),
}


@pytest.mark.parametrize("how", list(_HIDDEN))
def test_values_read_where_the_walk_cannot_see_are_read_at_every_call(how):
    # a loss reading a value through getattr/vars/globals()/eval/an import/a
    # class attribute/__slots__/__getattr__/a descriptor/a jitted helper/a long
    # call chain: each eager call equals jax.grad at that moment (a cached program
    # would keep the value of its trace: a wrong gradient with no error). Python
    # floats first (a literal of the trace), then arrays (a constant of it): the
    # program's cache key is the same for both, and an array read this way marks it
    read, write = _HIDDEN[how]

    def loss(w):
        return jnp.sum(read(jnp.tanh(_X @ w)))

    try:
        for values in ([1.0, -2.5, 0.5], [_y(40 + i) for i in range(3)]):
            write(values[0])
            lifted = rf.grad(rf.lift(loss))
            for v in values:
                write(v)
                np.testing.assert_allclose(lifted(_W), jax.grad(loss)(_W), rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(lifted(_W), jax.grad(loss)(_W), rtol=1e-5, atol=1e-6)
    finally:
        write(1.0)


def test_a_function_read_behind_the_walk_is_traced_each_call_and_compiled_once():
    # traced on every call; its program is kept while what it read is the same
    from rumus_fx.lift import tracing

    _HOLDER.v = 2.0
    lifted = rf.grad(rf.lift(lambda w: jnp.sum(jnp.tanh(_X @ w)) * getattr(_HOLDER, "v")))  # noqa: B009
    lifted(_W)
    traces, programs = closure.traces(), set(map(id, tracing._PROGRAMS.values()))
    for _ in range(3):
        lifted(_W)
    assert closure.traces() == traces + 3
    assert set(map(id, tracing._PROGRAMS.values())) == programs


def test_a_traced_value_read_behind_the_walk_inside_jit_is_right_and_not_kept():
    from rumus_fx.lift import tracing

    def step(w, y):
        _HOLDER.v = y  # an enclosing jit's tracer, read by getattr: a constant of the lifted trace
        return rf.grad(rf.lift(lambda v: jnp.sum(jnp.tanh(_X @ v)) * getattr(_HOLDER, "v")))(w)  # noqa: B009

    kept = len(tracing._PROGRAMS)
    for scale in (1.0, -2.0):
        got = jax.jit(step)(_W, jnp.float32(scale))
        want = jax.grad(lambda v, s=scale: jnp.sum(jnp.tanh(_X @ v)) * s)(_W)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert len(tracing._PROGRAMS) == kept  # no program holds the tracer
    _HOLDER.v = 1.0


_WRAPPED_SCALE = 1.0
# jax's wrappers hold the user's function in a closure cell, which the walk does not follow
_VMAPPED = jax.vmap(lambda r: r * _WRAPPED_SCALE)
_GRADDED = jax.grad(lambda r: jnp.sum(r**2) * _WRAPPED_SCALE)


@pytest.mark.parametrize("wrapper", ["vmap", "grad"])
def test_a_global_read_inside_a_jax_transformation_of_a_helper_is_read_at_every_call(wrapper):
    helper = _VMAPPED if wrapper == "vmap" else _GRADDED

    def loss(w):
        return jnp.sum(helper(jnp.tanh(_X @ w)))

    lifted = rf.grad(rf.lift(loss))
    try:
        for scale in (1.0, -2.5, 0.5):
            _MOD._WRAPPED_SCALE = scale
            np.testing.assert_allclose(lifted(_W), jax.grad(loss)(_W), rtol=1e-5, atol=1e-6)
    finally:
        _MOD._WRAPPED_SCALE = 1.0


def _to_default_float(w):
    return jnp.sum(jnp.tanh(w.astype(float)) * 1.5)


def _rank_promoting(w):
    return jnp.sum(w * jnp.ones((2, 1, 1), w.dtype))


def test_a_program_traced_under_one_jax_setting_is_not_reused_under_another():
    """``jax.enable_x64`` and the promotion modes change what a trace makes;
    a cached lifted program is keyed by them, as ``jax.jit``'s cache is."""
    w = jnp.asarray(_W)  # float32
    lifted = rf.lift(_to_default_float)
    with jax.enable_x64(True):
        got = rf.grad(lifted)(w)
        assert got.dtype == jax.grad(_to_default_float)(w).dtype == jnp.float32
        np.testing.assert_allclose(got, jax.grad(_to_default_float)(w), rtol=1e-6)
        assert rf.lift(_to_default_float)(w).dtype == jnp.float64
    # traced again without x64: a float32 program (the float64 one raised here before)
    np.testing.assert_allclose(rf.grad(lifted)(w), jax.grad(_to_default_float)(w), rtol=1e-6)
    assert rf.lift(_to_default_float)(w).dtype == jnp.float32
    # a program traced where rank promotion is allowed does not skip a "raise" later
    with jax.numpy_rank_promotion("allow"):
        np.testing.assert_allclose(rf.grad(rf.lift(_rank_promoting))(w), jax.grad(_rank_promoting)(w))
    with jax.numpy_rank_promotion("raise"):
        with pytest.raises(ValueError, match="rank_promotion='raise'"):
            jax.grad(_rank_promoting)(w)
        with pytest.raises(rf.ShapeError, match="rank_promotion='raise'"):
            rf.grad(rf.lift(_rank_promoting))(w)


@jax.tree_util.register_pytree_node_class
class _Neighbors:
    """Indices as a leaf and the cutoff, an array, as metadata: jax-md's neighbor
    list keeps its cutoff there."""

    def __init__(self, idx, cutoff):
        self.idx, self.cutoff = idx, cutoff

    def tree_flatten(self):
        return [self.idx], self.cutoff

    @classmethod
    def tree_unflatten(cls, cutoff, children):
        return cls(children[0], cutoff)


def _pair_energy(r, nbrs):
    d = r[nbrs.idx] - r
    return jnp.sum(jnp.where(jnp.abs(d) < nbrs.cutoff, jnp.sin(d) ** 2, 0.0))


@pytest.mark.parametrize("where", ["eager", "jit around rf.grad", "jit around the call"])
def test_array_metadata_of_an_argument_is_compared_by_value(where):
    """A second call whose argument's metadata holds another array of the same
    shape: its structure is compared with the cached one's, by value, also under
    an enclosing jax.jit (that comparison raised jax's "metadata fields" ValueError
    there); each cutoff gets its own gradient."""
    r, idx = jnp.array([0.1, 0.5, 0.9, 1.4]), jnp.array([1, 2, 3, 0])
    g = rf.grad(rf.lift(_pair_energy))
    call = {
        "eager": g,
        "jit around rf.grad": jax.jit(g),
        "jit around the call": lambda r, n: jax.jit(lambda v: g(v, n))(r),
    }[where]
    grads = []
    for cutoff in (0.6, 0.45, 0.6):
        nbrs = _Neighbors(idx, jnp.float32(cutoff))
        got = call(r, nbrs)
        np.testing.assert_allclose(got, jax.grad(_pair_energy)(r, nbrs), rtol=1e-6, atol=1e-7)
        grads.append(got)
    assert not np.allclose(grads[0], grads[1])  # the cutoff changes the gradient
