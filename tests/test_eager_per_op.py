"""The eager per-op path's shortcuts give what the general code gives: records
filled directly, shared metadata, the cached trace token, each record class's
own version checks and structure keys, a deferred run's shared scalars and the
compiled whole-tape walk's shared arguments (Note [Eager fast path] in
rumus_fx/ops/_core.py, Note [Per-class record code] in autograd/record.py,
Note [Scalars of a run] in lazy.py, Note [Shared arguments of the compiled
walk] in autograd/whole_tape.py)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf
from rumus_fx import eager, lazy, storage
from rumus_fx.autograd import record as record_module
from rumus_fx.autograd import whole_tape
from rumus_fx.ops import _core
from rumus_fx.ops import elementwise as ew
from rumus_fx.ops.activation import ReluBackward, TanhBackward


def _chain(h, n=12):
    for i in range(n):
        r = i % 4
        h = h * 1.01 if r == 0 else h + 0.1 if r == 1 else rf.tanh(h) if r == 2 else rf.relu(h)
    return rf.sum(h)


def _chain_jnp(h, n=12):
    for i in range(n):
        r = i % 4
        h = h * 1.01 if r == 0 else h + 0.1 if r == 1 else jnp.tanh(h) if r == 2 else jax.nn.relu(h)
    return jnp.sum(h)


@pytest.mark.parametrize(
    "cls,values",
    [
        (ew.BroadcastMulBackward, (None, None, 1.5, None, _core.same_shape_info((3,), np.dtype("float32")), None)),
        (ew.BroadcastAddBackward, (_core.same_shape_info((2, 3), np.dtype("float32")), None)),
        (ew.DivBackward, (None, None, 2, None, _core.same_shape_info((3,), np.dtype("float64")), None)),
        (TanhBackward, (jnp.ones(3), None)),
        (ReluBackward, (jnp.ones(3), None)),
    ],
)
def test_new_record_is_the_dataclass_call(cls, values):
    made, want = _core.new_record(cls, *values), cls(*values)
    assert type(made) is cls and vars(made) == vars(want)
    assert record_module.structure_key(made) == record_module.structure_key(want)
    with pytest.raises(TypeError):
        _core.new_record(cls, *values, None)


def test_same_shape_info_is_broadcast_info_and_shared():
    x = jnp.ones((2, 3), jnp.float32)
    info = _core.same_shape_info((2, 3), x.dtype)
    assert info == _core.broadcast_info(x, (2, 3)) and isinstance(info, _core.BroadcastInfo)
    assert _core.same_shape_info((2, 3), x.dtype) is info


def test_scalar_rhs_records_equal_the_general_path():
    """``t <op> scalar``, deferred or not, records what ``binary_record`` records,
    provenance included."""
    x = rf.tensor(jnp.linspace(-1.0, 1.0, 4), requires_grad=True)
    for kind, b in [("add", 0.5), ("sub", 2), ("mul", 1.5), ("div", 3.0)]:
        for deferred in (True, False):
            old = lazy.set_enabled(deferred)
            try:
                with rf.Tape() as tape:
                    getattr(x, f"__{kind if kind != 'div' else 'truediv'}__")(b)
                (entry,) = tape.entries
            finally:
                lazy.set_enabled(old)
            want = ew.binary_record(kind, x, b, x.value, b, (4,))
            assert type(entry.op) is type(want) and vars(entry.op) == vars(want), (kind, deferred)
            assert tuple(entry.provenance) == record_module.provenance_of(want, {id(b): None, id(x.value): x.grad_id})


def test_trace_token_is_cached_per_trace():
    outer = storage.current_trace_state()
    assert storage.current_trace_state() == outer
    seen = []

    def f(x):
        seen.append(storage.current_trace_state())
        seen.append(storage.current_trace_state())
        return x

    jax.jit(f)(1.0)
    jax.jit(lambda x: f(x) + 1)(1.0)
    assert seen[0] == seen[1] and seen[2] == seen[3]
    assert seen[0] != outer and seen[2] != seen[0]
    assert storage.current_trace_state() == outer


def test_a_leaked_storage_is_still_refused_under_a_new_trace():
    t = rf.tensor(jnp.ones(3))

    @jax.jit
    def f(x):
        u = rf.tensor(x)
        u.add_(1.0)  # made in this trace: allowed
        with pytest.raises(Exception, match="in-place write of a traced value"):
            t.add_(x)  # made outside: a tracer would leak into it
        return u.value

    f(jnp.zeros(3))


def _records_of_many_ops():
    x = rf.tensor(jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), requires_grad=True)
    w = rf.tensor(jnp.ones((3, 4)), requires_grad=True)
    with rf.Tape() as tape:
        h = rf.tanh(x @ w) * 2.0 + 1.0
        h = rf.relu(h - x.sum(axis=1, keepdims=True)) / 3.0
        h = rf.softmax(h, axis=-1) * rf.exp(h)
        loss = rf.sum(rf.layer_norm(h, None, None) ** 2) + rf.mean(h.T @ h)
    return tape, loss


def test_per_class_code_equals_the_generic_loops():
    tape, _ = _records_of_many_ops()
    assert len(tape.entries) > 10
    for e in tape.entries:
        assert record_module.structure_key(e.op) == record_module._structure_key_generic(e.op), e.op.name
        e.op.check_versions()


def test_per_class_version_check_raises_what_the_loop_raises():
    x = rf.tensor(jnp.ones(4), requires_grad=True)
    with rf.Tape() as tape:
        y = rf.tanh(x * 1.0)  # saves its output, y
        z = y * y  # saves y twice
        loss = rf.sum(z)
    records = [e.op for e in tape.entries]
    with rf.no_grad():
        y.add_(1.0)
    raised = 0
    for rec in records:
        errors = []
        for check in (rec.check_versions, rec._check_versions_generic):
            try:
                check()
                errors.append(None)
            except rf.VersionMismatch as e:
                errors.append(str(e))
        assert errors[0] == errors[1], rec.name
        raised += errors[0] is not None
    assert raised == 2  # tanh's and the product's records
    with pytest.raises(rf.VersionMismatch):
        tape.backward(loss)


def test_a_subclass_gets_its_own_code():
    @record_module.dataclasses.dataclass(frozen=True, eq=False)
    class Base(record_module.Record):
        a: jax.Array
        a_version: record_module.VersionSnapshot | None

    @record_module.dataclasses.dataclass(frozen=True, eq=False)
    class Sub(Base):
        b: jax.Array
        flag: int

    base, sub = Base(jnp.ones(2), None), Sub(jnp.ones(2), None, jnp.zeros(3), 7)
    for rec in (base, sub, base, sub):
        assert record_module.structure_key(rec) == record_module._structure_key_generic(rec)
        rec.check_versions()
    assert record_module.structure_key(sub)[0][1][-1] == 7


def test_scalar_operands_cache_keeps_signs_types_and_nans():
    vals = [1.5, 2, 1.5, 0.0, -0.0, float("nan"), 3]
    for _ in range(2):
        got = eager.scalar_operands(vals)
        want = [eager.scalar_operand(v) for v in vals]
        assert len(got) == len(want)
        for g, w, v in zip(got, want, vals):
            if isinstance(w, float) or isinstance(w, int):  # zeros and nan pass through
                assert type(g) is type(v) and (g == v or (g != g and v != v))
                assert math.copysign(1.0, g) == math.copysign(1.0, v) if g == g else True
            else:
                assert g is w
    assert [type(a) for a in eager.scalar_operands([1.0, -0.0])][1] is float
    assert math.copysign(1.0, eager.scalar_operands([1.0, -0.0])[1]) == -1.0
    assert math.copysign(1.0, eager.scalar_operands([1.0, 0.0])[1]) == 1.0


def _run_program_keys():
    return {k for k in lazy._PROGRAMS}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_run_shares_equal_scalars_and_keeps_the_per_op_values(dtype):
    """Equal scalars of one type share a slot of the compiled run; zeros and
    nans get their own; values equal the per-op path bit for bit."""
    x0 = jnp.asarray(np.random.default_rng(0).normal(size=(5,)), dtype)

    def f(h, s):
        return (((h * s + s) * 2 - 2.0) / s + 0.0) * -0.0 + s

    old = lazy.set_enabled(False)
    try:
        want = f(rf.tensor(x0), 1.25).value
        want2 = f(rf.tensor(x0), 0.75).value
    finally:
        lazy.set_enabled(old)
    before = _run_program_keys()
    for s, w in [(1.25, want), (1.25, want), (1.25, want), (0.75, want2)]:
        lazy.flush()
        got = f(rf.tensor(x0), s)
        np.testing.assert_array_equal(np.asarray(got.value, np.float64), np.asarray(w, np.float64))
    assert len(_run_program_keys() - before) <= 1  # a new value of s (or dtype) reuses the run's program
    names = ["mul", "add", "mul", "sub", "div", "add", "mul", "add"]
    (key,) = [k for k in lazy._PROGRAMS if [kind.name for kind, _ in k[0]] == names]
    # s, s, 2 (an int), 2.0 (a float), s, 0.0, -0.0, s: shared where equal and of one type
    assert key[2] == (0, 0, 1, 2, 0, 3, 4, 0)


def test_the_compiled_walk_takes_each_distinct_array_once(monkeypatch):
    monkeypatch.setattr(whole_tape, "KEEP_IF_FASTER", float("inf"))
    whole_tape.clear_cache()
    x = jnp.asarray(np.random.default_rng(4).normal(size=(7,)), jnp.float32)
    vg = rf.value_and_grad(_chain)
    want = jax.grad(_chain_jnp)(x)
    old = whole_tape.set_enabled(False)
    try:
        _, by_rules = vg(x)
    finally:
        whole_tape.set_enabled(old)
    for _ in range(2 + 2 * whole_tape.TIMED + 2):
        value, g = vg(x)
        np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(g, by_rules)
    (state,) = whole_tape._CACHE.values()
    assert isinstance(state, whole_tape._Compiled) and not state.rules
    (pattern,) = state.fns
    # 3 tanh outputs, each also relu's input; the one 1.01; the rest (None, 0.1-free adds) are other children
    assert len({k for k in pattern if k >= 0}) == 4
    assert sum(1 for k in pattern if k >= 0) == 3 + 3 + 3


def test_sharing_patterns_are_bounded(monkeypatch):
    """A pattern that changes every step compiles at most MAX_PATTERNS + 1 programs."""
    monkeypatch.setattr(whole_tape, "KEEP_IF_FASTER", float("inf"))
    whole_tape.clear_cache()
    a = jnp.linspace(0.5, 1.5, 3)

    def loss(x, y, z):
        return rf.sum(x * y * z)

    vg = rf.value_and_grad(loss, argnums=(0, 1, 2))
    wants = jax.grad(lambda x, y, z: jnp.sum(x * y * z), argnums=(0, 1, 2))
    # which arguments are the same array changes from step to step
    choices = [(a, a + 1, a + 2), (a, a, a + 2), (a, a + 1, a), (a + 1, a, a), (a, a, a)] * 4
    for xs in choices:
        _, gs = vg(*xs)
        for g, w in zip(gs, wants(*xs)):
            np.testing.assert_allclose(g, w, rtol=1e-6)
    compiled = [s for s in whole_tape._CACHE.values() if isinstance(s, whole_tape._Compiled)]
    assert compiled and all(len(s.fns) <= whole_tape.MAX_PATTERNS + 1 for s in compiled)


def test_trace_tokens_of_threads_under_their_own_traces():
    import threading

    outer = storage.current_trace_state()
    found = {}

    def work(name):
        def f(x):
            found[name] = [storage.current_trace_state() for _ in range(50)]
            return x

        jax.jit(f)(1.0)
        found[name + " after"] = storage.current_trace_state()

    threads = [threading.Thread(target=work, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in ("a", "b"):
        assert all(tok == found[name][0] for tok in found[name])
        assert found[name][0] != outer and found[name + " after"] == outer
    assert found["a"][0] != found["b"][0]


def test_saved_zero_scalars_keep_one_unshared_pattern(monkeypatch):
    """Saved python zeros (never cached) do not make a signature compile a
    program per zero position: past MAX_PATTERNS, one unshared program serves."""
    monkeypatch.setattr(whole_tape, "KEEP_IF_FASTER", float("inf"))
    whole_tape.clear_cache()
    w = jnp.linspace(-1.0, 1.0, 4)
    vg = rf.value_and_grad(lambda w, a, b, c: rf.sum(rf.tanh(w * a) * b + w * c))
    want = jax.grad(lambda w, a, b, c: jnp.sum(jnp.tanh(w * a) * b + w * c))
    steps = [(1.5, 2.0, 0.5)] * 8 + [(0.0, 2.0, 0.5), (1.5, -0.0, 0.5), (1.5, 2.0, 0.0), (0.0, 0.0, 0.0)] * 3
    steps += [(2.0, 2.0, 2.0), (3.0, 3.0, 1.0), (1.0, 3.0, 3.0), (7.0, 8.0, 9.0)] * 2
    for a, b, c in steps:
        _, g = vg(w, a, b, c)
        np.testing.assert_allclose(g, want(w, a, b, c), rtol=1e-6, atol=1e-7)
    (state,) = [s for s in whole_tape._CACHE.values() if isinstance(s, whole_tape._Compiled)]
    assert len(state.fns) <= whole_tape.MAX_PATTERNS + 1


def test_an_unused_argument_gets_its_zero_gradient_in_one_compiled_call():
    """Eagerly, the zeros of an argument the function does not read come from a
    cached compiled call, not ``jnp.zeros``' primitives bound one by one."""
    from tests._eager import primitives_bound_one_by_one

    x, unused = jnp.ones((4, 3)), jnp.ones((2, 5), jnp.float32)
    vg = rf.value_and_grad(lambda a, b: rf.sum(rf.tanh(a)), argnums=(0, 1))
    _, (gx, gu) = vg(x, unused)
    np.testing.assert_array_equal(gu, np.zeros((2, 5), np.float32))
    assert gu.dtype == jnp.float32
    np.testing.assert_allclose(gx, 1 - np.tanh(1.0) ** 2, rtol=1e-6)
    assert primitives_bound_one_by_one(lambda: vg(x, unused)) == []
    # under jit the zeros are traced inline
    _, (_, gj) = jax.jit(vg)(x, unused)
    np.testing.assert_array_equal(gj, np.zeros((2, 5), np.float32))
