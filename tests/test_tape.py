"""The tape: entries, table, saved bytes, consumption, isolation, leaks."""

import asyncio
import dataclasses
import gc
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf


def _mlp_tape():
    with rf.Tape() as tape:
        w = rf.tensor(np.ones((3, 4), np.float32), requires_grad=True)
        x = rf.tensor(np.ones((2, 3), np.float32))
        h = rf.relu(x @ w)
        loss = rf.mean(h)
    return tape, w, x, h, loss


def test_entries_and_record_names():
    tape, w, x, h, loss = _mlp_tape()
    assert len(tape) == 3
    names = [e.op.name for e in tape.entries]
    assert names == ["MatmulBackward", "ReluBackward", "MeanBackward"]
    first = tape.entries[0]
    assert isinstance(first, rf.TapeEntry)
    assert first.inputs == (None, w.grad_id)  # x @ w: x untracked
    assert tape.entries[1].outputs == (h.grad_id,)
    assert tape.entries[2].outputs == (loss.grad_id,)
    for e in tape.entries:  # records are frozen dataclasses without closures
        assert dataclasses.is_dataclass(e.op)
        with pytest.raises(dataclasses.FrozenInstanceError):
            e.op.x = 1
        for f in dataclasses.fields(e.op):
            assert not callable(getattr(e.op, f.name)) or isinstance(getattr(e.op, f.name), jax.Array)


def test_str_table_and_saved_bytes():
    tape, *_ = _mlp_tape()
    # MatmulBackward keeps x (2x3 f32, for w's gradient), ReluBackward its 2x4 input
    assert tape.entries[0].op.saved_bytes == 2 * 3 * 4
    assert tape.entries[1].op.saved_bytes == 2 * 4 * 4
    assert tape.entries[2].op.saved_bytes == 0
    assert tape.saved_bytes == 24 + 32
    text = str(tape)
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["#", "record"]
    assert "MatmulBackward" in lines[1] and "float32[2, 3]" in lines[1] and "24 B" in lines[1]
    assert "ReluBackward" in lines[2] and "32 B" in lines[2]
    assert "3 entries" in lines[-1] and "56 B" in lines[-1]
    assert tape.saved_bytes_by_record() == {"ReluBackward": 32, "MatmulBackward": 24, "MeanBackward": 0}


def test_backward_consumes_unless_retained():
    tape, w, x, h, loss = _mlp_tape()
    g1 = tape.backward(loss, retain=True)
    g2 = tape.backward(loss)
    np.testing.assert_array_equal(g1[w], g2[w])
    assert tape.consumed and len(tape) == 0
    with pytest.raises(rf.AutogradError, match="consumed"):
        tape.backward(loss)


def test_gradient_store_access():
    tape, w, x, h, loss = _mlp_tape()
    grads = tape.backward(loss)
    np.testing.assert_allclose(grads[w], np.full((3, 4), 2 / 8))
    np.testing.assert_array_equal(grads.get(w.grad_id), grads[w])
    assert grads.get(12345678) is None
    assert w in grads and h.grad_id in grads
    with pytest.raises(KeyError):
        grads[x]  # untracked


def test_backward_errors():
    with rf.Tape() as tape:
        w = rf.tensor(np.ones(3, np.float32), requires_grad=True)
        y = w * 2.0
    with pytest.raises(TypeError, match="scalar"):
        tape.backward(y, retain=True)
    with pytest.raises(rf.AutogradError, match="tracked"):
        tape.backward(rf.tensor(1.0), retain=True)
    grads = tape.backward(y, grad=jnp.array([1.0, 2.0, 3.0]))
    np.testing.assert_allclose(grads[w], [2.0, 4.0, 6.0])


def test_accumulation_of_reused_tensor():
    with rf.Tape() as tape:
        x = rf.tensor(np.array([1.0, 2.0], np.float32), requires_grad=True)
        y = x * x + x  # x used three times
        loss = rf.sum(y)
    np.testing.assert_allclose(tape.backward(loss)[x], [3.0, 5.0])


def test_dead_branch_is_skipped():
    with rf.Tape() as tape:
        w = rf.tensor(np.array([1.0, 2.0], np.float32), requires_grad=True)
        d = rf.tensor(np.array([3.0, 4.0], np.float32))
        dead = w * d  # MulBackward saves d, never reaches the loss
        loss = rf.sum(w * 2.0)
    d.add_(1.0)  # would raise VersionMismatch if the dead entry were visited
    grads = tape.backward(loss)
    np.testing.assert_allclose(grads[w], [2.0, 2.0])
    assert grads.get(dead.grad_id) is None


def test_unused_leaf_gets_zeros_from_store():
    with rf.Tape() as tape:
        w = rf.tensor(np.ones(2, np.float32), requires_grad=True)
        u = rf.tensor(np.ones((3, 2), np.float32), requires_grad=True)
        loss = rf.sum(w)
    grads = tape.backward(loss)
    np.testing.assert_array_equal(grads[u], np.zeros((3, 2)))
    assert grads.get(u.grad_id) is None


def test_nested_tapes_record_into_innermost():
    with rf.Tape() as outer:
        w = rf.tensor(np.ones(2, np.float32), requires_grad=True)
        a = w * 2.0
        with rf.Tape() as inner:
            b = w * 3.0
        c = a + b
    assert [e.op.name for e in outer.entries] == ["BroadcastMulBackward", "AddBackward"]
    assert [e.op.name for e in inner.entries] == ["BroadcastMulBackward"]
    del c


def test_threads_record_independently():
    n_threads = 4
    barrier = threading.Barrier(n_threads)
    results = {}

    def work(k):
        with rf.Tape() as tape:
            barrier.wait()
            w = rf.tensor(np.full(3, float(k), np.float32), requires_grad=True)
            y = w
            for _ in range(k + 1):
                barrier_free = y * 2.0
                y = barrier_free
            loss = rf.sum(y)
        results[k] = (len(tape), tape.backward(loss)[w])

    threads = [threading.Thread(target=work, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(n_threads):
        n, g = results[k]
        assert n == k + 2
        np.testing.assert_allclose(g, np.full(3, 2.0 ** (k + 1)))


def test_threads_do_not_see_the_main_tape():
    seen = []
    with rf.Tape() as tape:
        w = rf.tensor(np.ones(2, np.float32), requires_grad=True)
        th = threading.Thread(target=lambda: seen.append((w * 2.0).requires_grad))
        th.start()
        th.join()
    assert seen == [False] and len(tape) == 0


def test_asyncio_tasks_record_independently():
    async def task(k):
        with rf.Tape() as tape:
            w = rf.tensor(np.ones(2, np.float32), requires_grad=True)
            y = w
            for _ in range(k):
                await asyncio.sleep(0)
                y = y * 2.0
            loss = rf.sum(y)
        return len(tape), tape.backward(loss)[w]

    async def main():
        return await asyncio.gather(*(task(k) for k in (1, 2, 3)))

    for k, (n, g) in zip((1, 2, 3), asyncio.run(main())):
        assert n == k + 1
        np.testing.assert_allclose(g, np.full(2, 2.0**k))


def test_no_storage_leak_after_many_grad_calls():
    def f(w, x):
        return rf.mean(rf.relu(x @ w) * 2.0)

    w = jnp.ones((4, 3))
    x = jnp.ones((5, 4))
    g = rf.grad(f)
    g(w, x)
    gc.collect()
    before = rf.debug.live_storages()
    for _ in range(1000):
        g(w, x)
    gc.collect()
    assert rf.debug.live_storages() == before


def test_dropped_tape_frees_its_records():
    gc.collect()
    with rf.Tape() as tape:
        w = rf.tensor(np.ones(4, np.float32), requires_grad=True)
        y = rf.exp(w)
        loss = rf.sum(y)
    import weakref

    rec_ref = weakref.ref(tape.entries[0].op)
    del tape, loss, y
    gc.collect()
    assert rec_ref() is None


def test_to_dot_lists_every_entry():
    tape, *_ = _mlp_tape()
    dot = tape.to_dot()
    assert dot.startswith("digraph tape {") and dot.rstrip().endswith("}")
    for i, e in enumerate(tape.entries):
        assert f"op{i}" in dot and e.op.name in dot


def test_backward_with_keep_drops_intermediate_gradients():
    from rumus_fx.autograd.engine import run_backward

    with rf.Tape() as tape:
        w = rf.tensor(np.ones(3, np.float32), requires_grad=True)
        h = rf.exp(w)
        loss = rf.sum(h * h)
    seeds = {loss.grad_id: jnp.ones((), jnp.float32)}
    full = run_backward(tape.entries, dict(seeds))
    kept = run_backward(tape.entries, dict(seeds), keep={w.grad_id})
    assert h.grad_id in full and set(kept) == {w.grad_id}
    np.testing.assert_array_equal(kept[w.grad_id], full[w.grad_id])


def _fields(rec):
    return {f.name: getattr(rec, f.name) for f in dataclasses.fields(rec)}


@pytest.mark.parametrize("kind", ["add", "sub", "mul", "div"])
@pytest.mark.parametrize("scalar", [2.0, 3])
def test_scalar_fast_path_records_what_the_general_path_does(kind, scalar):
    """Note [Eager fast path]: ``t <op> python scalar`` skips broadcasting; its
    record, entry and provenance are those of the general path (a numpy scalar
    operand takes the general path)."""
    from rumus_fx.autograd.record import provenance_of
    from rumus_fx.ops import elementwise

    op = getattr(rf, kind)
    for shape in [(3, 2), ()]:
        with rf.Tape() as tape:
            x = rf.tensor(np.full(shape, 1.5, np.float32), requires_grad=True)
            fast = op(x, scalar)
            slow = op(x, np.float32(scalar))
        e_fast, e_slow = tape.entries
        av, bv = x.value, scalar
        general = elementwise.binary_record(kind, x, scalar, av, bv, tuple(np.shape(np.empty(shape))))
        assert type(e_fast.op) is type(general) and type(e_fast.op) is type(e_slow.op)
        for name, value in _fields(general).items():
            got = _fields(e_fast.op)[name]
            if name.endswith("_version"):
                assert (got is None) == (value is None)
            else:
                assert got == value or got is value, (name, got, value)
        assert e_fast.inputs == (x.grad_id, None) and e_fast.outputs == (fast.grad_id,)
        assert e_fast.input_avals == e_slow.input_avals[:1] + (None,)
        assert e_fast.output_avals == e_slow.output_avals
        known = {id(fast.value): fast.grad_id, id(x.value): x.grad_id, id(scalar): None}
        assert tuple(e_fast.provenance) == provenance_of(e_fast.op, known)
        np.testing.assert_array_equal(fast.value, slow.value)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int32"])
@pytest.mark.parametrize("scalar", [2.0, 3, 1e30, -0.0, float("nan")])
def test_cached_scalar_operand_is_what_jit_makes_of_the_scalar(dtype, scalar):
    """Note [Eager fast path]: ``t <op> python scalar`` passes a cached device
    array for the scalar; the result (value, dtype, weak type, placement) is
    that of the jitted op given the python scalar itself, with and without
    x64, under another default device, and recorded or not."""
    from rumus_fx.ops._core import scalar_operand

    def check():
        x = rf.tensor(jnp.arange(4).astype(dtype))
        with jax.numpy_dtype_promotion("standard"):
            for kind, ref in (("mul", jnp.multiply), ("add", jnp.add), ("div", jnp.divide)):
                got = getattr(rf, kind)(x, scalar).value
                want = jax.jit(ref)(x.value, scalar)
                assert got.dtype == want.dtype and got.weak_type == want.weak_type, kind
                assert got.sharding == want.sharding and got.committed == want.committed, kind
                np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64))
        cached = scalar_operand(scalar)
        if not scalar or scalar != scalar:
            assert cached is scalar  # zeros and nan are never cached
        else:
            assert cached is scalar_operand(scalar)
            assert cached.aval == jnp.asarray(scalar).aval

    check()
    with jax.enable_x64(True):
        check()
    with jax.default_device(jax.devices()[-1]):
        check()
    with rf.Tape():
        x = rf.tensor(jnp.ones(3), requires_grad=True)
        y = x * 2.0
    np.testing.assert_array_equal(y.value, jnp.full(3, 2.0))


def _entry_fields(e):
    return (e.op, e.inputs, e.outputs, e.input_avals, e.output_avals, e.input_shardings, tuple(e.provenance), e.replay)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_record_fast_path_records_what_the_general_path_does(dtype, layout):
    """Note [Eager fast path]: ``record`` of ``f(t)`` and ``t <op> python
    scalar`` (t tracked, not explicitly sharded) appends the entry the general
    loop (``record_general``) appends for the same record, inputs and output."""
    from rumus_fx.ops._core import record_general

    with rf.Tape() as tape:
        base = rf.tensor(jnp.arange(6.0, dtype=dtype).reshape(2, 3), requires_grad=True)
        x = base if layout == "contiguous" else base.T
        outs = [rf.tanh(x), rf.relu(x), rf.exp(x), x * 1.5, x + 2, x - 0.5, x / 4.0, rf.sigmoid(x)]
    entries = [e for e in tape.entries if e.outputs[0] in {o.grad_id for o in outs}]
    assert len(entries) == len(outs)
    scalars = [None, None, None, 1.5, 2, 0.5, 4.0, None]
    for e, out, scalar in zip(entries, outs, scalars):
        assert (len(e.inputs) == 2) == (scalar is not None)
        inputs = (x,) if scalar is None else (x, scalar)
        scratch = rf.Tape()
        record_general(scratch, e.op, inputs, out)
        (general,) = scratch.entries
        assert _entry_fields(e) == _entry_fields(general), e.op.name


def test_recorded_avals_are_the_tensors_shapes_and_dtypes():
    """Note [Eager fast path]: an entry's avals (kept on the storage once read)
    are ``(t.shape, t.dtype)`` of its input and output, also for a view and
    after an in-place write."""
    from rumus_fx.ops._core import tensor_aval

    with rf.Tape() as tape:
        x = rf.tensor(jnp.arange(6.0).reshape(2, 3), requires_grad=True)
        y = rf.tanh(x)
        with rf.no_grad():
            y.mul_(2.0)
        z = rf.relu(y.T)
        w = rf.exp(y) * 2.0
    for t in (x, y, y.T, z, w):
        assert tensor_aval(t) == (t.shape, t.dtype)
    for e in tape.entries:
        assert all(a is None or len(a) == 2 for a in e.input_avals)
    by_out = {e.outputs[0]: e for e in tape.entries}
    assert by_out[z.grad_id].input_avals == ((y.T.shape, y.dtype),)
    assert by_out[z.grad_id].output_avals == ((z.shape, z.dtype),)
    assert by_out[w.grad_id].input_avals == ((w.shape, w.dtype), None)
