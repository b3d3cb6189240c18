"""Records keep only what their backward reads (Note [Record fields]).

For every record type of the fused ops: record it on a tape from the op table's
samples (every sample, all differentiable inputs tracked and each one alone, plus
a few programs for the records no table entry appends), run its ``backward`` with
the record's attribute reads instrumented, and check that every field is read by
the rule or is a version snapshot (checked before the rule runs); and that
``saved_bytes`` counts exactly the arrays the record's fields hold.
"""

from __future__ import annotations

import dataclasses
import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf
from rumus_fx.autograd import registry
from rumus_fx.autograd.record import VersionSnapshot
from rumus_fx.storage import nbytes_of

from .optable import OPS, OpInfo


def _reads(rec, g, needs) -> set[str]:
    """The fields ``rec.backward(g, needs)`` reads (instrumented attribute access)."""
    cls = type(rec)
    names = {f.name for f in dataclasses.fields(cls)}
    seen: set[str] = set()
    assert "__getattribute__" not in cls.__dict__

    def spy(self, name):
        if name in names:
            seen.add(name)
        return object.__getattribute__(self, name)

    cls.__getattribute__ = spy
    try:
        # traced, not run: the reads are Python's, and nothing compiles
        jax.eval_shape(lambda: rec.backward(g, needs))
    finally:
        del cls.__getattribute__
    return seen


def _run_entries(tape, found: dict) -> None:
    for entry in tape.entries:
        rec = entry.op
        needs = tuple(i is not None for i in entry.inputs)
        (shape, dtype) = entry.output_avals[0]
        g = jnp.ones(shape, dtype)
        found.setdefault(type(rec), [set(), []])
        found[type(rec)][0] |= _reads(rec, g, needs)
        found[type(rec)][1].append(rec)


def _table_records(info: OpInfo, found: dict) -> None:
    samples = info.samples(np.random.default_rng(zlib.crc32(info.name.encode())))
    for sample in samples:
        subsets = [sample.diff] + [(d,) for d in sample.diff] if len(sample.diff) > 1 else [sample.diff]
        for subset in subsets:
            with rf.Tape() as tape:
                args = [
                    rf.tensor(jnp.asarray(a, jnp.float32) if a.dtype.kind == "f" else a, requires_grad=i in subset)
                    if isinstance(a, np.ndarray)
                    else a
                    for i, a in enumerate(sample.args)
                ]
                info.op(*args, **sample.kwargs)
            _run_entries(tape, found)


def _extra_records(found: dict) -> None:
    """Records no op-table entry appends: in-place writes, casts, reshard."""
    w = rf.tensor(jnp.ones((3, 4)), requires_grad=True)
    v = rf.tensor(jnp.asarray(2.0), requires_grad=True)
    with rf.Tape() as tape:
        y = rf.mul(w, 1.0)
        y.fill_(v)
        z = rf.mul(w, 1.0)
        z.copy_(rf.tensor(jnp.ones((4,)), requires_grad=True))
        rf.tensor(w, dtype=jnp.bfloat16)
        rf.reshard(w, jax.sharding.PartitionSpec())
        u = rf.mul(w, 1.0)
        u.add_(rf.tensor(jnp.ones((4,)), requires_grad=True))  # broadcasting in-place: BroadcastAddBackward
        u.sub_(rf.tensor(jnp.ones((4,)), requires_grad=True))
        u.mul_(rf.tensor(jnp.ones((4,)), requires_grad=True))
    _run_entries(tape, found)


@pytest.fixture(scope="module")
def recorded() -> dict:
    found: dict = {}
    for info in OPS:
        _table_records(info, found)
    _extra_records(found)
    return found


def _op_record_types() -> list[type]:
    return sorted({r for d in registry.declarations("op") for r in d.records}, key=lambda t: t.__name__)


@pytest.mark.parametrize("cls", _op_record_types(), ids=lambda t: t.__name__)
def test_every_field_is_read_by_backward(cls, recorded):
    assert cls in recorded, f"no program records {cls.__name__}"
    read, _ = recorded[cls]
    kinds = cls.field_kinds()
    snapshots = {n for n, k in kinds.items() if k == "snapshot"}
    unread = set(kinds) - read - snapshots
    assert not unread, f"{cls.__name__} keeps fields its backward never reads: {sorted(unread)}"


def _arrays_in(value) -> list:
    if isinstance(value, (jax.Array, np.ndarray)):
        return [value]
    if isinstance(value, (tuple, list)):
        return [a for v in value for a in _arrays_in(v)]
    return []


@pytest.mark.parametrize("cls", _op_record_types(), ids=lambda t: t.__name__)
def test_saved_bytes_counts_exactly_the_saved_fields(cls, recorded):
    for rec in recorded[cls][1]:
        kinds = type(rec).field_kinds()
        held = []
        for f in dataclasses.fields(rec):
            value = getattr(rec, f.name)
            arrays = _arrays_in(value)
            if kinds[f.name] == "static":
                assert not arrays, f"{cls.__name__}.{f.name} holds an array but is not declared saved"
            if kinds[f.name] == "snapshot":
                assert value is None or isinstance(value, (VersionSnapshot, tuple))
            held += arrays
        assert rec.saved_bytes == sum(nbytes_of(a) for a in held), cls.__name__


def test_attention_keeps_the_mask_at_its_own_shape():
    q = rf.tensor(jnp.ones((2, 3, 5, 4)), requires_grad=True)
    mask = jnp.asarray(np.tril(np.ones((5, 5), bool)))
    with rf.Tape() as tape:
        rf.scaled_dot_product_attention(q, q, q, mask)
    rec = tape.entries[0].op
    assert rec.mask.shape == (5, 5)
    # q, k, v (2*3*5*4 float32 each), the output, the log-sum-exp and the 25-byte mask
    lse = rec.lse
    assert rec.saved_bytes == 4 * (2 * 3 * 5 * 4) * 4 + nbytes_of(lse) + 25


def test_the_instrumentation_sees_reads():
    rec = next(iter(itertools.islice((e.op for e in _mm_tape().entries), 1)))
    assert _reads(rec, jnp.ones((2, 2)), (True, False)) == {"rhs", "lhs_dtype", "lhs_sharding"}
    assert _reads(rec, jnp.ones((2, 2)), (False, True)) == {"lhs", "rhs_dtype", "rhs_sharding", "merge_rows"}


def _mm_tape():
    a = rf.tensor(jnp.ones((2, 3)), requires_grad=True)
    b = rf.tensor(jnp.ones((3, 2)), requires_grad=True)
    with rf.Tape() as tape:
        rf.matmul(a, b)
    return tape
