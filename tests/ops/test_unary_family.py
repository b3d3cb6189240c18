"""Fused unary ops declared by family (Note [Unary op family] in
rumus_fx/ops/_unary.py): one ``unary_op`` call gives the record, the forward,
the deferral and the op-table entry. ``softplus`` is declared that way; a
throwaway op declared here reaches the op table and the error audit."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf
from rumus_fx.autograd import registry
from rumus_fx.autograd.record import _field_kinds
from rumus_fx.ops import _formulas as formulas
from rumus_fx.ops._declare import BadInput, integers, unary_samples
from rumus_fx.ops._unary import unary_op
from rumus_fx.testing import check_fd

from . import optable


def _softplus_ref(x):
    return jnp.logaddexp(x, 0.0)  # an independent oracle: not jax.nn.softplus


@pytest.mark.parametrize("jit", [False, True])
def test_softplus_gradient_matches_jax_grad(rng, jit):
    x = jnp.asarray(rng.standard_normal((3, 5)) * 3, jnp.float32)
    f = rf.grad(lambda t: rf.sum(rf.softplus(t) * rf.softplus(t)))
    got = jax.jit(f)(x) if jit else f(x)
    want = jax.grad(lambda t: jnp.sum(_softplus_ref(t) ** 2))(x)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(rf.softplus(x).value, _softplus_ref(x), rtol=1e-6, atol=1e-6)


def test_softplus_finite_differences_f64(rng):
    with jax.enable_x64(True):
        x = jnp.asarray(rng.standard_normal((2, 3, 4)) * 3, jnp.float64)
        check_fd(lambda t: rf.sum(rf.softplus(t) * t), (x,), (0,), tol=1e-6, directions=3)


def test_softplus_records_its_declared_record(rng):
    x = rf.tensor(jnp.asarray(rng.standard_normal((2, 3)), jnp.float32), requires_grad=True)
    with rf.Tape() as tape:
        y = rf.softplus(x)
    (entry,) = tape.entries
    assert entry.op.name == "SoftplusBackward"
    assert _field_kinds(type(entry.op)) == {"input": "saved", "input_version": "snapshot"}
    np.testing.assert_array_equal(entry.op.input, x.value)
    del y
    with pytest.raises(TypeError, match="softplus: input must have a floating dtype, got int32"):
        rf.softplus(jnp.ones(3, jnp.int32))


def test_softplus_is_a_declared_exported_op_with_a_table_entry():
    decl = registry.lookup("op", "softplus")
    assert decl.fn is rf.softplus is rf.ops.softplus
    assert decl.records == (rf.ops.activation.SoftplusBackward,)
    assert "softplus" in [i.name for i in optable.OPS]


@pytest.mark.parametrize(
    "name, saves",
    [("relu", "input"), ("sigmoid", "output"), ("tanh", "output"), ("neg", None), ("exp", "output"), ("log", "input")],
)
def test_family_records_keep_their_fields(name, saves):
    """The records of the ops declared by family keep their names and fields."""
    (rec,) = registry.lookup("op", name).records
    assert rec.__name__ == name.capitalize() + "Backward"
    assert rec.__module__ == registry.lookup("op", name).module
    fields = [f.name for f in dataclasses.fields(rec)]
    assert fields == ([] if saves is None else [saves, f"{saves}_version"])


# -- a throwaway op declared by family -----------------------------------------


@pytest.fixture
def square_declared():
    cls, fn = unary_op(
        "square_family_test",
        jnp.square,
        lambda g, x: 2 * g * x,
        "input",
        doc="``x * x``",
        record_doc="``y = x^2``: ``dx = 2 x dy``. Saves the input.",
        ref=lambda x: x * x,
        samples=unary_samples([(3, 4)]),
        errors=lambda: [BadInput("integer input", (integers(3),), TypeError, ("int32",))],
    )
    yield cls, fn
    registry.undeclare("op", "square_family_test")


def test_a_family_op_reaches_the_op_table_and_the_error_audit(square_declared):
    cls, fn = square_declared
    assert cls.__name__ == "SquareFamilyTestBackward" and cls.__module__ == __name__
    assert fn.__name__ == "square_family_test" and fn.__module__ == __name__
    assert registry.exports()["square_family_test"] is fn
    info = next(i for i in optable.table() if i.name == "square_family_test")
    from . import test_optable

    test_optable.test_forward_and_record(info, 0)
    test_optable.test_grad_matches_jax(info, 0, jnp.float64, True)
    test_optable.test_finite_differences_f64(info, 0)
    from .. import test_errors_audit as audit

    (case,) = registry.lookup("op", "square_family_test").errors()
    bad = audit._bad(fn, case)
    audit._expect_rejected(bad.call, bad.exc, "square_family_test", bad.also)


def test_unary_op_refuses_an_unknown_saves():
    with pytest.raises(ValueError, match="saves must be one of"):
        unary_op("bad_saves", jnp.sin, formulas.neg, "both", doc="", record_doc="")


def test_family_formulas_are_the_records_backward(rng):
    x = jnp.asarray(rng.standard_normal((4,)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((4,)), jnp.float32)
    y = jax.nn.sigmoid(x)
    (dx,) = rf.ops.activation.SigmoidBackward(y, None).backward(g, (True,))
    np.testing.assert_array_equal(dx, formulas.sigmoid(g, y))
