"""The op registry (Note [Declaring an op] in rumus_fx/autograd/registry.py):
one declaration per op, from which the exports, ``rf.autograd.BackwardOp``, the
op table, the error audit, the primitive table and the docs check (docs/tape.md) are derived.
An op declared here, in a test module, reaches every one of them."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import typing

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import rumus_fx as rf
from rumus_fx.autograd import registry
from rumus_fx.autograd.record import Record, VersionSnapshot, record_types
from rumus_fx.ops._core import array_of, new_output, reads, record, require_float, tape_for
from rumus_fx.ops._declare import BadInput, Sample, integers, normal, op, tracked, unary_samples

from . import optable

ROOT = pathlib.Path(__file__).resolve().parents[2]


# -- a throwaway op, declared the way rumus_fx/ops/<family>.py declares its ops --


@dataclasses.dataclass(frozen=True, eq=False)
class CubeBackward(Record):
    """``y = x^3``: ``dx = 3 x^2 dy``. Saves the input."""

    input: jax.Array
    input_version: VersionSnapshot | None

    def backward(self, g, needs):
        return (3 * g * self.input * self.input,)


def cube(x):
    """``x ** 3`` (records CubeBackward)."""
    xv = array_of(x, "cube")
    require_float("cube", xv)
    out = xv * xv * xv
    tape = tape_for(x)
    if tape is None:
        return rf.Tensor._wrap(out)
    saved, version = reads(x, True)
    return record(tape, CubeBackward(saved, version), (x,), new_output(out, tape))


def _declare_cube():
    op(
        records=(CubeBackward,),
        ref=lambda x: x**3,
        samples=unary_samples([(3, 5), (2, 3, 7)]),
        errors=lambda: [BadInput("integer input", (integers(3),), TypeError, ("int32",))],
    )(cube)


@pytest.fixture
def cube_declared():
    _declare_cube()
    yield registry.lookup("op", "cube")
    registry.undeclare("op", "cube")


def test_a_declared_op_reaches_every_derived_list(cube_declared):
    decl = cube_declared
    assert decl in registry.declarations("op")
    assert registry.exports()["cube"] is cube
    assert registry.exports(toplevel=True)["cube"] is cube
    assert CubeBackward in registry.declared_records()
    # the op table, built from the registry
    info = next(i for i in optable.table() if i.name == "cube")
    assert info.op is cube and info.records == ("CubeBackward",)
    from . import test_optable

    # ... and the op-table checks run on it: forward + record, gradients vs jax.grad, fd
    test_optable.test_forward_and_record(info, 1)
    for dtype in (jnp.float32, jnp.float64):
        for jit in (False, True):
            test_optable.test_grad_matches_jax(info, 0, dtype, jit)
    test_optable.test_grad_through_noncontiguous_view(info, 1, False)
    test_optable.test_finite_differences_f64(info, 0)
    # the error audit's cases come from its errors=
    from .. import test_errors_audit as audit

    (case,) = decl.errors()
    bad = audit._bad(decl.fn, case)
    audit._expect_rejected(bad.call, bad.exc, "cube", bad.also)


def test_the_throwaway_op_is_gone_after_undeclare():
    assert "cube" not in registry.exports()
    assert all(d.name != "cube" for d in registry.declarations())


def test_redeclaring_from_another_module_is_an_error(cube_declared):
    dup = dataclasses.replace(cube_declared, module="somewhere.else")
    with pytest.raises(ValueError, match="already declared"):
        registry.declare(dup)


def test_records_must_be_named_backward():
    class Cube(Record):
        pass

    with pytest.raises(TypeError, match="<Op>Backward"):
        registry.OpDecl("cube2", "op", (Cube,))


# -- the real ops -------------------------------------------------------------


def test_exports_are_the_declared_ops():
    ops = registry.exports()
    assert sorted(ops) == rf.ops.__all__
    for name, fn in ops.items():
        assert getattr(rf.ops, name) is fn
    for name, fn in registry.exports(toplevel=True).items():
        assert getattr(rf, name) is fn, name
    assert set(registry.exports()) - set(registry.exports(toplevel=True)) == {"cast_to", "matmul_or_bmm"}


def test_every_record_type_is_declared_and_backward_op_is_their_union():
    declared = set(registry.declared_records())
    undeclared = [t.__name__ for t in record_types() if t.__module__.startswith("rumus_fx.") and t not in declared]
    assert not undeclared, f"record types no op declares: {undeclared}"
    assert set(typing.get_args(rf.autograd.BackwardOp)) == declared
    for name in ("AddBackward", "MatmulBackward", "SinBackward", "ScanBackward", "LiftedBackward"):
        assert name in {t.__name__ for t in declared}


def test_every_op_module_record_belongs_to_its_modules_declarations():
    by_module: dict[str, set[type]] = {}
    for d in registry.declarations("op"):
        by_module.setdefault(d.module, set()).update(d.records)
    for t in record_types():
        if t.__module__.startswith("rumus_fx.ops."):
            assert t in by_module.get(t.__module__, set()), f"{t.__name__} is not declared by {t.__module__}"


def test_every_primitive_rule_is_declared():
    from rumus_fx.lift.rules import RULES

    assert {d.name for d in registry.declarations("primitive")} == set(RULES)
    for d in registry.declarations("primitive"):
        assert d.records == (RULES[d.name].record,)


def test_op_table_is_every_op_with_samples():
    assert [i.name for i in optable.OPS] == [d.name for d in registry.declarations("op") if d.samples is not None]
    # ops without a table entry say where they are tested instead
    assert {d.name for d in registry.declarations("op") if d.samples is None} == {
        "matmul_or_bmm",
        "reshard",
        "cast_to",
        "fill_",
        "copy_",
    }


def _docs_ops_table() -> str:
    page = (ROOT / "docs" / "tape.md").read_text()
    m = re.search(r"## Ops and their records\n(.*?)\n## ", page, re.S)
    assert m, "docs/tape.md has no 'Ops and their records' section"
    return m.group(1)


def test_docs_ops_table_names_every_op_and_record():
    table = _docs_ops_table()
    for d in registry.declarations("op"):
        if d.export is not None and d.toplevel:
            assert f"`{d.export}" in table, f"docs/tape.md's ops table does not list {d.export}"
        for r in d.record_names:
            assert f"`{r}`" in table, f"docs/tape.md's ops table does not name {r} (declared by {d.name})"


def test_sample_is_the_registry_sample():
    assert optable.Sample is Sample
    s = Sample((normal(__import__("numpy").random.default_rng(0), 2),))
    assert s.diff == (0,) and s.kwargs == {}
    assert tracked(2).make().requires_grad


def test_the_primitive_table_is_the_rules_table_entries():
    from ..lift import ptable

    declared = [e.name for d in registry.declarations("primitive") for e in d.extra["table"]]
    assert {"exp2", "log1p", "expm1", "cbrt", "square", "scan", "gather_embedding", "det"} <= set(declared)
    assert [info.name for info in ptable.ENTRIES] == declared
    assert len(set(declared)) == len(declared), "two table entries share a name"
    for d in registry.declarations("primitive"):
        for e in d.extra["table"]:
            assert d.module.startswith("rumus_fx.lift.rules_"), (e.name, d.module)


def test_a_declared_primitive_rule_reaches_the_table_and_the_audit():
    """A rule declared the way rumus_fx/lift/rules_<family>.py declares one, with
    a table entry and an error case, reaches the primitive table and the audit."""
    from rumus_fx.autograd.registry import BadProgram, TableEntry
    from rumus_fx.lift.rules import RULES, defrule

    from .. import test_errors_audit as audit
    from ..lift import ptable

    def vjp(r, g):
        return (g,)

    defrule(
        "throwaway_prim",
        vjp,
        table=(TableEntry("throwaway_sin", jnp.sin, unary_samples([(3,)]), prims=("sin",)),),
        errors=lambda: [
            BadProgram(
                "householder_product",
                lambda a: lax.linalg.householder_product(a, jnp.ones(3, a.dtype)),
                (jnp.eye(4, 3) + 0.1,),
                rf.AutogradError,
                names=("rf.lift", "'householder_product'"),
            )
        ],
    )
    try:
        decl = registry.lookup("primitive", "throwaway_prim")
        (entry,) = [e for e in ptable.entries() if e.name == "throwaway_sin"]
        assert entry.prims == ("sin",) and entry.fun is jnp.sin
        params = [p for p in audit._program_params() if p.values[0] is decl]
        assert [p.id for p in params] == ["throwaway_prim-householder_product"]
        audit.run_bad_program(decl, params[0].values[1])
    finally:
        RULES.pop("throwaway_prim", None)
        registry.undeclare("primitive", "throwaway_prim")
    assert all(e.name != "throwaway_sin" for e in ptable.entries())
