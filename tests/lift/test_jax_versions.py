"""The readers of jax's data structures that differ between the jax versions rf
supports (rumus_fx/lift/jax_versions.py). This machine runs one version; the
other's form is built by hand, as jax 0.11 makes it (checked on a GPU machine
running jax 0.11.2: benchmarks/RESULTS.md, "rf's own tests on jax 0.11.2")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core as jcore

from rumus_fx.lift.jax_versions import ONE_JAXPR_CLASS, bwd_cotangents, closed, scan_counts


def _scan_eqn():
    def f(c, xs, w, v):
        return lax.scan(lambda carry, x: ((carry[0] + w * x, carry[1] * v), x * w), c, xs)

    closed_jaxpr = jax.make_jaxpr(f)((1.0, 2.0), jnp.ones(3), 3.0, 4.0)
    (eqn,) = [e for e in closed_jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    return eqn


def test_scan_counts_read_this_jax_scan():
    eqn = _scan_eqn()
    n_consts, n_carry = scan_counts(eqn.params)
    assert n_carry == 2
    assert n_consts + n_carry + 1 == len(eqn.invars)


class _FlatTree:
    """jax 0.11's flat tree of a scan's inputs, as far as scan_counts reads it."""

    def __init__(self, *groups):
        self.groups = groups

    def unpack(self):
        return tuple(list(g) for g in self.groups)


def test_scan_counts_read_the_flat_trees_of_jax_011():
    params = {"ft_in": _FlatTree([None] * 3, [None] * 2, [None]), "ft_out": None, "length": 4}
    assert scan_counts(params) == (3, 2)
    assert scan_counts({"num_consts": 1, "num_carry": 5}) == (1, 5)


def test_bwd_cotangents_of_either_form():
    a, b = np.ones(2), np.zeros(3)
    assert bwd_cotangents([a, b]) == [a, b]  # jax 0.10: the cotangents
    assert bwd_cotangents(([a, b], None)) == [a, b]  # jax 0.11: (cotangents, logs)
    assert bwd_cotangents(([a], {"step": 1})) == [a]
    # two cotangents of a two-argument function, in the old form, stay as they are
    got = bwd_cotangents((a, b))
    assert got[0] is a and got[1] is b


def test_closed_keeps_a_closed_jaxpr_and_closes_an_open_one():
    c = jnp.arange(3.0)
    closed_jaxpr = jax.make_jaxpr(lambda x: x * c)(jnp.ones(3))
    assert closed(closed_jaxpr) is closed_jaxpr
    assert closed(closed_jaxpr).consts  # the constant is not turned into an input
    open_jaxpr = closed_jaxpr.jaxpr
    again = closed(open_jaxpr, closed_jaxpr.consts)
    np.testing.assert_array_equal(jcore.jaxpr_as_fun(again)(jnp.ones(3))[0], c)
    assert len(again.jaxpr.invars) == 1
    if not ONE_JAXPR_CLASS:
        with pytest.raises(ValueError):
            closed(closed_jaxpr, [c])


@pytest.mark.parametrize("dropped", ["num_res", "transpose_thunk"])
def test_a_primitive_whose_parameters_changed_is_refused_by_name(dropped, monkeypatch):
    """A rule that reads parameters by name (``linear_call``, ``compute_on``) refuses,
    naming the primitive and the parameter, a step that lacks one (as a later jax
    may rename it), rather than crash inside the rule: the parameter is dropped
    here from this jax's own ``linear_call`` step as the program is built."""
    import rumus_fx as rf
    from rumus_fx.lift import program as program_module
    from rumus_fx.lift.tracing import clear_programs

    from .test_custom_rules import _lin_pair, _lin_pair_transpose

    def loss(x):
        from jax.custom_derivatives import linear_call

        u, v = linear_call(_lin_pair, _lin_pair_transpose, jnp.ones(3), (jnp.sin(x), x))
        return jnp.sum(u * v)

    real = program_module.Params

    def without(params):
        out = real(params)
        return real({k: v for k, v in out.items() if k != dropped}) if "num_callee_consts" in out else out

    monkeypatch.setattr(program_module, "Params", without)
    clear_programs()
    try:
        with pytest.raises(rf.AutogradError, match=f"'linear_call'.*{dropped!r}"):
            rf.grad(rf.lift(loss))(jnp.linspace(0.1, 1.0, 3))
    finally:
        clear_programs()
