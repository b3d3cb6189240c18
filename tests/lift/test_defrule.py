"""``rf.defrule`` / ``rf.undefrule``: a library's (or a user's) rule for a
primitive rf does not ship, its validation, and the lazy loading of rf's rules
for equinox's primitives."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import mlir

import rumus_fx as rf
from rumus_fx.autograd.registry import Sample, TableEntry, declarations
from rumus_fx.lift.rules import RULES


def _primitive(name: str, impl, multiple_results: bool = False) -> Primitive:
    """A primitive as a library defines one: an implementation, an abstract
    evaluation and a lowering (no JVP or transpose: jax.grad cannot take it)."""
    p = Primitive(name)
    p.multiple_results = multiple_results
    p.def_impl(impl)

    def abstract(*xs, **kw):
        out = jax.eval_shape(lambda *a: impl(*a, **kw), *xs)
        return jax.tree.map(lambda o: jax.core.ShapedArray(o.shape, o.dtype), out)

    p.def_abstract_eval(abstract)
    mlir.register_lowering(p, mlir.lower_fun(impl, multiple_results=multiple_results))
    return p


def _scaled_sin(x, *, a):
    return a * jnp.sin(x)


SCALED_SIN = _primitive("scaled_sin_test", _scaled_sin)


def _scaled_sin_vjp(r, g):
    return (g * r.params["a"] * jnp.cos(r.ins[0]),)


def _val(x):
    return np.asarray(getattr(x, "value", x))


@pytest.fixture
def scaled_sin():
    rec = rf.defrule(SCALED_SIN, _scaled_sin_vjp, saves=((0,), ()))
    try:
        yield rec
    finally:
        rf.undefrule(SCALED_SIN)


def test_a_registered_rule_gives_the_gradient(scaled_sin):
    x = jnp.linspace(-1.0, 2.0, 5)
    y = jnp.linspace(0.5, 1.5, 5)

    def f(x, y):
        return jnp.sum(SCALED_SIN.bind(x * y, a=3.0) ** 2)

    def ref(x, y):
        return jnp.sum((3.0 * jnp.sin(x * y)) ** 2)

    for argnums in (0, 1, (0, 1)):
        got = rf.grad(lambda *a: rf.lift(f)(*a), argnums=argnums)(x, y)
        chex.assert_trees_all_close(got, jax.grad(ref, argnums=argnums)(x, y), rtol=1e-5, atol=1e-6)
    # under jit, and recorded as the rule's own record type
    got = jax.jit(rf.grad(lambda x: rf.lift(f)(x, y)))(x)
    np.testing.assert_allclose(_val(got), jax.grad(ref)(x, y), rtol=1e-5, atol=1e-6)
    assert scaled_sin.__name__ == "ScaledSinTestBackward"
    with rf.Tape() as tape:
        rf.lift(f)(rf.tensor(x, requires_grad=True), y)
    assert "ScaledSinTestBackward" in str(tape)


def test_a_rule_checked_in_float64_against_finite_differences(scaled_sin):
    from rumus_fx.testing import check_fd

    check_fd(lambda x: rf.sum(rf.lift(lambda v: SCALED_SIN.bind(v, a=2.0) * v)(x)), (np.linspace(0.1, 1, 4),))


def test_default_saves_every_input_and_output():
    seen = {}

    def vjp(r, g):
        seen["ins"], seen["outs"] = r.ins, r.outs
        return (g * r.params["a"] * jnp.cos(r.ins[0]),)

    rf.defrule(SCALED_SIN, vjp)
    try:
        x = jnp.array([0.3, 0.7])
        g = rf.grad(lambda v: rf.sum(rf.lift(lambda u: SCALED_SIN.bind(u, a=1.0))(v)))(x)
        np.testing.assert_allclose(_val(g), np.cos(x), rtol=1e-6)
        assert all(v is not None for v in seen["ins"]) and all(v is not None for v in seen["outs"])
    finally:
        rf.undefrule(SCALED_SIN)


def test_a_primitive_with_several_outputs():
    sincos = _primitive("sincos_test", lambda x: [jnp.sin(x), jnp.cos(x)], multiple_results=True)

    def vjp(r, g):
        gs, gc = g
        x = r.ins[0]
        return (gs * jnp.cos(x) - gc * jnp.sin(x),)

    rf.defrule(sincos, vjp, saves=((0,), ()))
    try:
        x = jnp.array([0.1, 0.9, 2.0])
        only_sin = rf.grad(lambda v: rf.sum(rf.lift(lambda u: sincos.bind(u)[0])(v)))(x)
        np.testing.assert_allclose(_val(only_sin), np.cos(x), rtol=1e-6)  # the cos output got zeros
        both = rf.grad(lambda v: rf.sum(rf.lift(lambda u: sum(sincos.bind(u)))(v)))(x)
        np.testing.assert_allclose(_val(both), np.cos(x) - np.sin(x), rtol=1e-6)
    finally:
        rf.undefrule(sincos)


def test_a_rule_with_its_table_entry_joins_the_primitive_table():
    entry = TableEntry(
        "scaled_sin_entry", lambda x: SCALED_SIN.bind(x, a=2.0), lambda rng: [Sample((rng.standard_normal(3),))]
    )
    rf.defrule(SCALED_SIN, _scaled_sin_vjp, saves=((0,), ()), table=(entry,))
    try:
        (decl,) = [d for d in declarations("primitive") if d.name == "scaled_sin_test"]
        assert decl.extra["table"] == (entry,)
    finally:
        rf.undefrule(SCALED_SIN)
    assert "scaled_sin_test" not in RULES and all(d.name != "scaled_sin_test" for d in declarations("primitive"))


def test_undefrule_makes_the_program_refuse_again():
    x = jnp.array([0.5, 1.0])

    def f(v):
        return SCALED_SIN.bind(v, a=1.0)

    rf.defrule(SCALED_SIN, _scaled_sin_vjp, saves=((0,), ()))
    rf.grad(lambda v: rf.sum(rf.lift(f)(v)))(x)  # traced and cached with the rule
    rf.undefrule(SCALED_SIN)
    with pytest.raises(rf.AutogradError, match=r"no backward rule for the primitive 'scaled_sin_test'.*rf\.defrule"):
        rf.grad(lambda v: rf.sum(rf.lift(f)(v)))(x)


def test_a_rule_for_a_primitive_object_serves_only_that_object(scaled_sin):
    other = _primitive("scaled_sin_test", _scaled_sin)  # another library's primitive, same name
    with pytest.raises(rf.AutogradError, match="'scaled_sin_test'"):
        rf.grad(lambda v: rf.sum(rf.lift(lambda u: other.bind(u, a=1.0))(v)))(jnp.ones(2))


def test_a_rule_by_name_serves_every_primitive_of_that_name():
    rf.defrule("scaled_sin_test", _scaled_sin_vjp, saves=((0,), ()))
    try:
        other = _primitive("scaled_sin_test", _scaled_sin)
        g = rf.grad(lambda v: rf.sum(rf.lift(lambda u: other.bind(u, a=2.0))(v)))(jnp.zeros(2))
        np.testing.assert_allclose(_val(g), [2.0, 2.0])
    finally:
        rf.undefrule("scaled_sin_test")


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        ((3, _scaled_sin_vjp), {}, TypeError, "must be a jax.extend.core.Primitive or a primitive's name"),
        (("", _scaled_sin_vjp), {}, TypeError, "primitive's name"),
        ((SCALED_SIN, "not a function"), {}, TypeError, "vjp must be a function"),
        ((SCALED_SIN, lambda r: r), {}, TypeError, r"must take \(record, g\)"),
        ((SCALED_SIN, _scaled_sin_vjp), {"saves": (0,)}, TypeError, "saves must be"),
        ((SCALED_SIN, _scaled_sin_vjp), {"saves": ((0,), ("a",))}, TypeError, "saves must be"),
        ((SCALED_SIN, _scaled_sin_vjp), {"table": ("x",)}, TypeError, "TableEntry"),
        ((SCALED_SIN, _scaled_sin_vjp), {"errors": [1]}, TypeError, "errors must be a function"),
        (("sin", _scaled_sin_vjp), {}, ValueError, "built-in rule"),
        (("sin", _scaled_sin_vjp), {"replace": True}, ValueError, "built-in rule"),
        (("floor", _scaled_sin_vjp), {}, ValueError, "no derivative"),
        (("jit", _scaled_sin_vjp), {}, ValueError, "runs through itself"),
        (("scan", _scaled_sin_vjp), {}, ValueError, "runs through itself"),
    ],
)
def test_defrule_refuses_malformed_registrations(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        rf.defrule(*args, **kwargs)
    assert "scaled_sin_test" not in RULES


def test_registering_twice_needs_replace(scaled_sin):
    with pytest.raises(ValueError, match=r"already has a rule.*replace=True"):
        rf.defrule(SCALED_SIN, _scaled_sin_vjp)
    rf.defrule(SCALED_SIN, lambda r, g: (2 * g * r.params["a"] * jnp.cos(r.ins[0]),), saves=((0,), ()), replace=True)
    g = rf.grad(lambda v: rf.sum(rf.lift(lambda u: SCALED_SIN.bind(u, a=1.0))(v)))(jnp.zeros(2))
    np.testing.assert_allclose(_val(g), [2.0, 2.0])  # the new rule (and no stale cached program)


def test_undefrule_refuses_builtin_and_unknown_rules():
    with pytest.raises(ValueError, match="built-in rule"):
        rf.undefrule("sin")
    with pytest.raises(KeyError, match="no rule is registered"):
        rf.undefrule("no_such_primitive")
    with pytest.raises(TypeError):
        rf.undefrule(None)


def test_equinox_rules_load_when_a_program_first_holds_one_of_its_primitives():
    """``import rumus_fx`` imports neither equinox nor rf's rules for it; the
    first lifted program holding an equinox primitive declares them."""
    code = textwrap.dedent(
        """
        import sys
        import jax.numpy as jnp
        import rumus_fx as rf
        assert "equinox" not in sys.modules and "rumus_fx.lift.rules_equinox" not in sys.modules
        import equinox.internal as eqxi
        from equinox.internal._loop.common import _select_if_vmap
        assert "rumus_fx.lift.rules_equinox" not in sys.modules
        f = lambda x: _select_if_vmap(jnp.sum(x) > 0, x, 2 * x, makes_false_steps=False) * x
        g = rf.grad(lambda v: rf.sum(rf.lift(f)(v)))(jnp.array([1.0, 2.0]))
        assert "rumus_fx.lift.rules_equinox" in sys.modules
        print(list(g.tolist()))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[2.0, 4.0]"


def test_equinox_nondifferentiable_backward_refuses_a_nonzero_gradient():
    """``symbolic=False``: a zero gradient passes, a nonzero one fails at run time
    with equinox's message, as under ``jax.grad``."""
    import equinox.internal as eqxi

    def f(x):
        return jnp.sin(eqxi.nondifferentiable_backward(x, name="the state", symbolic=False))

    x = jnp.array([0.5, 1.0])
    with pytest.raises(Exception, match="the state cannot be reverse-mode autodifferentiated"):
        jax.grad(lambda v: jnp.sum(f(v)))(x)
    with pytest.raises(Exception, match="the state cannot be reverse-mode autodifferentiated"):
        rf.grad(lambda v: rf.sum(rf.lift(f)(v)))(x)
    with pytest.raises(Exception, match="the state cannot be reverse-mode autodifferentiated"):
        jax.block_until_ready(jax.jit(rf.grad(lambda v: rf.sum(rf.lift(f)(v))))(x))
