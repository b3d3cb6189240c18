"""``rf.autograd.BackwardOp``: the union of every record type (docs/SPEC.md
section 4), usable with ``isinstance`` and as a type hint."""

from __future__ import annotations

import dataclasses
import typing

import jax.numpy as jnp

import rumus_fx as rf
from rumus_fx.autograd.record import Record, record_types


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _subclasses(sub)
    return out


def test_backward_op_is_the_union_of_every_record_type():
    members = typing.get_args(rf.autograd.BackwardOp)
    assert typing.get_origin(rf.autograd.BackwardOp) is typing.Union
    # the declared record types (Note [Declaring an op]): every record type of
    # the package; record classes a test module defines are not declared
    package = {t for t in record_types() if t.__module__.startswith("rumus_fx.")}
    assert set(members) == package
    assert len(members) == len(set(members))
    # every record class of the package (ops, rf.lift's composite and primitive
    # records) whose name says it is one is in it
    named = {c for c in _subclasses(Record) if c.__name__.endswith("Backward") and c.__module__.startswith("rumus_fx.")}
    assert named <= set(members), sorted(c.__name__ for c in named - set(members))
    names = {c.__name__ for c in members}
    for name in ("AddBackward", "MulBackward", "MatmulBackward", "ReshapeBackward", "CastBackward",
                 "LayerNormBackward", "ScaledDotProductAttentionBackward", "LiftedBackward"):  # fmt: skip
        assert name in names, name


def test_every_record_type_is_a_frozen_dataclass():
    for cls in typing.get_args(rf.autograd.BackwardOp):
        assert issubclass(cls, Record), cls
        assert dataclasses.is_dataclass(cls), cls
        assert cls.__dataclass_params__.frozen, cls
        assert cls.__name__.endswith("Backward"), cls


def test_every_recorded_op_is_a_backward_op():
    x = jnp.arange(6.0).reshape(2, 3)
    with rf.Tape() as tape:
        w = rf.tensor(jnp.ones((3, 3)), requires_grad=True)
        h = rf.relu(x @ w).reshape(3, 2)
        loss = rf.sum(rf.lift(jnp.sin)(h) * 2.0)
    assert len(tape) >= 4
    for entry in tape.entries:
        assert isinstance(entry.op, rf.autograd.BackwardOp), entry.op.name
        assert isinstance(entry.op, Record)
    tape.backward(loss)
    assert not isinstance(object(), rf.autograd.BackwardOp)
    assert not isinstance(x, rf.autograd.BackwardOp)


def name_of(op: rf.autograd.BackwardOp) -> str:
    return op.name


def test_backward_op_as_a_type_hint():
    hints = typing.get_type_hints(name_of)
    assert hints["op"] == rf.autograd.BackwardOp
    with rf.Tape() as tape:
        rf.exp(rf.tensor([1.0], requires_grad=True))
    assert name_of(tape.entries[0].op) == "ExpBackward"
