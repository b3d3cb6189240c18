"""Layouts, strided reads/writes and the storage registry."""

import gc
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf
from rumus_fx.storage import Layout, read_layout, write_layout


def _np_view(base: np.ndarray, layout: Layout) -> np.ndarray:
    item = base.itemsize
    return np.lib.stride_tricks.as_strided(
        base.reshape(-1)[layout.offset :],
        shape=layout.shape,
        strides=[s * item for s in layout.strides],
    )


@pytest.mark.parametrize("shape", [(3, 5), (2, 3, 4), (4, 1, 3), (1,), (2, 1, 1, 5)])
def test_permuted_layouts_read_and_write(shape):
    base = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    buf = jnp.asarray(base)
    for perm in itertools.permutations(range(len(shape))):
        layout = Layout.contiguous(shape)
        # build the permuted layout by successive swaps
        cur = list(range(len(shape)))
        for i, p in enumerate(perm):
            j = cur.index(p)
            if i != j:
                layout = layout.transpose(i, j)
                cur[i], cur[j] = cur[j], cur[i]
        np.testing.assert_array_equal(np.asarray(read_layout(buf, layout)), base.transpose(perm))
        new = np.asarray(read_layout(buf, layout)) * 10 + 1
        written = np.asarray(write_layout(buf, layout, jnp.asarray(new)))
        np.testing.assert_array_equal(written, base * 10 + 1)


def test_permuted_view_reads_as_one_compiled_call(monkeypatch):
    """Eagerly, a permuted view (the attention heads' ``[B, T, H, Dh] ->
    [B, H, T, Dh]``) materialises as one compiled relayout call, not a reshape,
    a transpose and a reshape (each reshape a copy of its own), and reads the
    same values."""
    import rumus_fx.eager as E

    calls = []
    monkeypatch.setattr(E, "relayout", lambda *a, _f=E.relayout: calls.append(a[1:]) or _f(*a))
    monkeypatch.setattr(E, "reshape", lambda *a: pytest.fail(f"a separate reshape {a[1:]}"))
    base = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 20)
    t = rf.tensor(jnp.asarray(base)).reshape(2, 3, 4, 5).transpose(1, 2)
    assert t.shape == (2, 4, 3, 5)
    np.testing.assert_array_equal(np.asarray(t.value), base.reshape(2, 3, 4, 5).transpose(0, 2, 1, 3))
    assert len(calls) == 1
    # writing through the view is the same one call, inverted
    new = np.asarray(t.value) * 10 + 1
    written = write_layout(jnp.asarray(base), t.layout, jnp.asarray(new))
    np.testing.assert_array_equal(np.asarray(written), base * 10 + 1)
    assert len(calls) == 2


def test_general_strided_window_uses_gather():
    base = np.arange(24, dtype=np.float32)
    layout = Layout((3, 2), (5, 2), 1)  # not a permutation of the buffer
    np.testing.assert_array_equal(np.asarray(read_layout(jnp.asarray(base), layout)), _np_view(base, layout))
    out = np.asarray(write_layout(jnp.asarray(base), layout, jnp.zeros((3, 2))))
    expect = base.copy()
    _np_view(expect, layout)[...] = 0
    np.testing.assert_array_equal(out, expect)


@pytest.mark.parametrize(
    "shape,strides,new,ok",
    [
        ((2, 3), (3, 1), (6,), True),
        ((2, 3), (3, 1), (3, 2), True),
        ((3, 2), (1, 3), (6,), False),  # a transposed matrix cannot be flattened as a view
        ((3, 2), (1, 3), (3, 2, 1), True),
        ((4, 6), (1, 4), (4, 2, 3), True),  # split the outer (strided) axis
        ((4, 6), (1, 4), (2, 2, 6), True),
        ((4, 6), (1, 4), (8, 3), False),
    ],
)
def test_layout_view_rule_matches_torch(shape, strides, new, ok):
    layout = Layout(shape, strides, 0)
    got = layout.view(new)
    assert (got is not None) == ok
    if ok:
        base = np.arange(24, dtype=np.float32)[: int(np.prod(shape))]
        np.testing.assert_array_equal(_np_view(base, got), _np_view(base, layout).reshape(new))


def test_versions_start_at_zero_and_count_writes():
    t = rf.tensor([1.0, 2.0])
    assert t.version == 0 and t.storage.version == 0
    t.add_(1.0)
    t.mul_(2.0)
    assert t.version == 2
    np.testing.assert_allclose(np.asarray(t), [4.0, 6.0])


def test_weak_handle_upgrade_and_death():
    t = rf.tensor([1.0])
    weak = t.storage.downgrade()
    assert weak.upgrade() is t.storage
    del t
    gc.collect()
    assert weak.upgrade() is None


def test_live_storages_counts():
    gc.collect()
    before = rf.debug.live_storages()
    ts = [rf.tensor([float(i)]) for i in range(5)]
    views = [t.detach() for t in ts]  # views share storages
    assert rf.debug.live_storages() == before + 5
    del ts, views
    gc.collect()
    assert rf.debug.live_storages() == before


def test_copy_on_write_keeps_old_buffers_intact():
    t = rf.tensor([1.0, 2.0])
    old = t.value
    t.add_(5.0)
    np.testing.assert_allclose(np.asarray(old), [1.0, 2.0])
    np.testing.assert_allclose(np.asarray(t.value), [6.0, 7.0])
