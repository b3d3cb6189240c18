"""The primitive audit: every primitive the installed jax defines is in exactly
one class for ``rf.lift`` —

* rule: rf has a hand-written backward rule for it (or runs through it, as
  for ``jit``, or drops it as the identity it is on values, as for
  ``layout_constraint``: ``tests/lift/test_layouts.py``), tested by the primitive
  table (``tests/lift/test_ptable.py``);
* pass-through: provably no float derivative (integer/boolean/key/token
  outputs, random bits, rounding whose derivative is zero almost everywhere,
  ``stop_gradient``); its outputs are untracked;
* refused: a program whose gradient goes through it raises ``AutogradError``
  naming it — never a silent zero.

No pass-through primitive may carry a gradient from a float input to a float
output: each is either checked to have no float output, or checked with
``jax.jvp`` to have a zero derivative (``nextafter``, ``rng_uniform`` and a
float-to-float ``bitcast_convert_type`` were once pass-through; they are
refused). The README's coverage paragraph states the counts, checked here.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import jax
import jax.extend.random
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core as jcore

import rumus_fx as rf
from rumus_fx.lift.program import IDENTITIES, INLINE_CALLS, Program
from rumus_fx.lift.rules import NON_DIFFERENTIABLE, RULES

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"

# the jax modules whose primitives are listed (jax's own public namespaces and
# the experimental ones that define primitives)
JAX_MODULES = (
    "jax", "jax.numpy", "jax.lax", "jax.lax.linalg", "jax.nn", "jax.scipy", "jax.scipy.special",
    "jax.scipy.linalg", "jax.scipy.signal", "jax.random", "jax.extend", "jax.ad_checkpoint",
    "jax.experimental", "jax.experimental.pallas", "jax.experimental.shard_map", "jax.experimental.sparse",
    "jax.experimental.custom_partitioning", "jax.experimental.multihost_utils", "jax.experimental.compute_on",
    "jax.experimental.layout", "jax.experimental.scheduling_groups",
)  # fmt: skip

_LIST = """
import gc, importlib, json, sys
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
    except Exception:
        pass
from jax.extend.core import Primitive
print(json.dumps(sorted({o.name for o in gc.get_objects() if isinstance(o, Primitive)})))
"""


def jax_primitives() -> list[str]:
    """The names of every primitive the installed jax defines (listed in a fresh
    interpreter that imports jax's modules only, so no other library's primitive
    and no test's throwaway primitive is counted)."""
    out = subprocess.run(
        [sys.executable, "-c", _LIST, *JAX_MODULES], capture_output=True, text=True, check=True, timeout=600
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


PRIMS = jax_primitives()


def classify(name: str) -> str:
    if name in RULES or name in INLINE_CALLS or name in IDENTITIES:
        return "rule"
    if name in NON_DIFFERENTIABLE:
        return "pass-through"
    return "refused"


def counts() -> dict[str, int]:
    out = {"rule": 0, "pass-through": 0, "refused": 0}
    for n in PRIMS:
        out[classify(n)] += 1
    return out


# every pass-through primitive, and why it has no float derivative:
# "int": its outputs are never floating (integers, booleans, keys, tokens, nothing);
# "zero": a float output whose derivative is zero almost everywhere (jax.grad's too),
#         checked with jax.jvp on the program given.
_X = np.array([-1.7, -0.5, 0.25, 1.5, 2.6])
PASS_THROUGH: dict[str, tuple[str, object]] = {
    "stop_gradient": ("zero", lambda x: lax.stop_gradient(x)),
    "floor": ("zero", jnp.floor),
    "ceil": ("zero", jnp.ceil),
    "round": ("zero", jnp.round),
    "sign": ("zero", jnp.sign),
    "is_finite": ("int", jnp.isfinite),
    **{n: ("int", f) for n, f in [
        ("eq", lambda x: x == 0.25), ("ne", lambda x: x != 0.25), ("lt", lambda x: x < 0.25),
        ("le", lambda x: x <= 0.25), ("gt", lambda x: x > 0.25), ("ge", lambda x: x >= 0.25),
        ("and", lambda x: (x > 0) & (x < 2)), ("or", lambda x: (x > 0) | (x < -1)), ("not", lambda x: ~(x > 0)),
        ("xor", lambda x: (x > 0) ^ (x < 2)), ("argmax", jnp.argmax), ("argmin", jnp.argmin),
        ("iota", lambda x: lax.iota(jnp.int32, x.shape[0]) + x.astype(jnp.int32)),
        ("population_count", lambda x: lax.population_count(x.astype(jnp.int32))),
        ("clz", lambda x: lax.clz(x.astype(jnp.int32))),
        ("shift_left", lambda x: lax.shift_left(x.astype(jnp.int32), jnp.int32(1))),
        ("shift_right_logical", lambda x: lax.shift_right_logical(x.astype(jnp.int32), jnp.int32(1))),
        ("shift_right_arithmetic", lambda x: lax.shift_right_arithmetic(x.astype(jnp.int32), jnp.int32(1))),
        ("mulhi", lambda x: lax.mulhi(x.astype(jnp.int32), x.astype(jnp.int32))),
        ("reduce_and", lambda x: jnp.all(x > 0)), ("reduce_or", lambda x: jnp.any(x > 0)),
        ("reduce_xor", lambda x: lax.reduce_xor_p.bind(x > 0, axes=(0,))),
        ("lu_pivots_to_permutation", lambda x: lax.linalg.lu_pivots_to_permutation(jnp.zeros(3, jnp.int32), 3)),
        ("random_bits", lambda x: jax.random.bits(jax.random.key(0), (2,))),
        ("random_seed", lambda x: jax.random.key_data(jax.random.key(x.shape[0]))),
        ("random_wrap", lambda x: jax.random.wrap_key_data(jnp.zeros(2, jnp.uint32))),
        ("random_unwrap", lambda x: jax.random.key_data(jax.random.key(1))),
        ("random_fold_in", lambda x: jax.random.key_data(jax.random.fold_in(jax.random.key(0), 3))),
        ("random_split", lambda x: jax.random.key_data(jax.random.split(jax.random.key(0)))),
        ("random_clone", lambda x: jax.random.key_data(jax.random.clone(jax.random.key(0)))),
        ("threefry2x32", lambda x: jax.extend.random.threefry_2x32(jnp.zeros(2, jnp.uint32), x.astype(jnp.uint32))),
        ("rng_bit_generator", lambda x: lax.rng_bit_generator(jnp.zeros(4, jnp.uint32), (2,))[1]),
        ("debug_callback", lambda x: jax.debug.callback(lambda v: None, x)),
        ("debug_print", lambda x: jax.debug.print("{}", x)),
    ]},
    # not reachable from a plain CPU program: outputs never floating by definition
    "threefry4x32": ("int", None), "philox2x32": ("int", None), "philox4x32": ("int", None),
    "iota_2x32_shape": ("int", None), "eq_to": ("int", None), "le_to": ("int", None), "lt_to": ("int", None),
    "axis_index": ("int", None), "platform_index": ("int", None), "create_token": ("int", None),
    "after_all": ("int", None),
}  # fmt: skip


def _emitted(fun, x) -> set[str]:
    names: set[str] = set()
    todo = [jax.make_jaxpr(fun)(x).jaxpr]
    while todo:
        j = todo.pop()
        names.update(e.primitive.name for e in j.eqns)
        todo.extend(jcore.subjaxprs(j))
    return names


def _synthetic(name: str) -> jcore.ClosedJaxpr:
    """A one-equation jaxpr: ``name`` applied to a float32 vector, giving one
    (no primitive is bound: only rf.lift's static pass reads it)."""
    closed = jax.make_jaxpr(jnp.sin)(jnp.ones(3, jnp.float32))
    (eqn,) = closed.jaxpr.eqns
    eqn = eqn.replace(primitive=jcore.Primitive(name), params={})
    return jcore.ClosedJaxpr(closed.jaxpr.replace(eqns=[eqn]), closed.consts)


def test_jax_defines_hundreds_of_primitives():
    assert len(PRIMS) > 250 and {"sin", "scan", "dot_general", "fft", "while"} <= set(PRIMS)


def test_every_primitive_is_in_exactly_one_class():
    by = {c: {n for n in PRIMS if classify(n) == c} for c in ("rule", "pass-through", "refused")}
    assert by["rule"].isdisjoint(by["pass-through"]) and by["rule"].isdisjoint(by["refused"])
    assert by["pass-through"].isdisjoint(by["refused"])
    assert by["rule"] | by["pass-through"] | by["refused"] == set(PRIMS)
    assert not (set(RULES) & NON_DIFFERENTIABLE), "a primitive both has a rule and passes through"


def test_every_pass_through_primitive_says_why():
    jax_pass = {n for n in PRIMS if classify(n) == "pass-through"}
    assert jax_pass <= set(PASS_THROUGH), f"pass-through without a reason: {sorted(jax_pass - set(PASS_THROUGH))}"
    assert set(PASS_THROUGH) <= NON_DIFFERENTIABLE


@pytest.mark.parametrize("name", sorted(n for n, (_, f) in PASS_THROUGH.items() if f is not None))
def test_no_pass_through_primitive_carries_a_float_gradient(name):
    kind, fun = PASS_THROUGH[name]
    with jax.enable_x64(True):
        x = jnp.asarray(_X)
        assert name in _emitted(fun, x), f"the program for {name} does not emit it"
        outs = jax.tree.leaves(jax.eval_shape(fun, x))
        floating = [o for o in outs if jnp.issubdtype(o.dtype, jnp.inexact)]
        if kind == "int":
            assert not floating, f"{name}: a float output, yet it is classed as having none"
            return
        # a float output: jax's own derivative is zero at these points, and rf's too (no error)
        _, t = jax.jvp(fun, (x,), (jnp.ones_like(x),))
        np.testing.assert_array_equal(np.asarray(t), 0.0)
        g = rf.grad(lambda v: rf.sum(rf.lift(fun)(v) * v))(x)
        np.testing.assert_allclose(np.asarray(getattr(g, "value", g)), np.asarray(fun(x)))


@pytest.mark.parametrize("name", sorted(PASS_THROUGH))
def test_pass_through_primitives_give_untracked_outputs(name):
    prog = Program(_synthetic(name), [True])
    assert prog.out_tracked == [False] and not prog.tracked_steps


def test_refused_primitives_raise_naming_themselves():
    refused = [n for n in PRIMS if classify(n) == "refused"]
    assert len(refused) > 50
    for name in refused:
        with pytest.raises(rf.AutogradError, match=f"no backward rule for the primitive '{re.escape(name)}'"):
            Program(_synthetic(name), [True], "audit")


@pytest.mark.parametrize(
    "name,fun,x",
    [
        ("nextafter", lambda x: lax.nextafter(x, jnp.full_like(x, 10.0)), _X),
        ("rng_uniform", lambda x: lax.rng_uniform(x[0], x[0] + 1.0, (3,)), _X),
        ("bitcast_convert_type", lambda x: lax.bitcast_convert_type(x.astype(jnp.float32), jnp.float32), _X),
    ],
)
def test_float_to_float_primitives_without_a_derivative_are_refused(name, fun, x):
    """Once pass-through (a silent zero gradient), now refused with their name."""
    assert classify(name) == "refused"
    with pytest.raises(rf.AutogradError, match=f"'{name}'"):
        rf.grad(lambda v: rf.sum(rf.lift(fun)(v)))(jnp.asarray(x, jnp.float32))


def test_bitcast_to_integers_still_passes_through():
    """frexp's path: a float bitcast to integers has no float output, so it gives no gradient and no error."""
    f = lambda x: (lax.bitcast_convert_type(x, jnp.int32) >> 23).astype(jnp.float32) + x  # noqa: E731
    g = rf.grad(lambda v: rf.sum(rf.lift(f)(v)))(jnp.asarray(_X, jnp.float32))
    np.testing.assert_allclose(np.asarray(getattr(g, "value", g)), np.ones(5))


def test_a_refusal_names_the_library_call_that_emitted_the_primitive():
    def my_model_step(a):
        return lax.linalg.householder_product(a, jnp.ones(3, a.dtype))

    a = jnp.asarray(np.random.default_rng(0).standard_normal((4, 3)), jnp.float32)
    with pytest.raises(
        rf.AutogradError, match=r"'householder_product'.*by my_model_step at test_primitive_audit\.py:\d+"
    ):
        rf.grad(lambda v: rf.sum(rf.lift(my_model_step)(v)))(a)


def test_readme_states_the_counts():
    """The README states the audit once per jax version it was made on (each jax
    defines its own set of primitives: 0.11 has fewer than 0.10); the statement
    for the installed jax must match the audit."""
    c = counts()
    text = README.read_text()
    stated = {
        m[1]: tuple(int(v) for v in m.groups()[1:])
        for m in re.finditer(
            r"jax (\d+\.\d+\.\d+)[^0-9]*?(\d+) primitives in all: (\d+) with a rule, "
            r"(\d+) passing through[^,]*, (\d+) refused",
            text,
        )
    }
    assert stated, "README's coverage paragraph does not state the audit's counts"
    assert jax.__version__ in stated, f"README states the counts for jax {sorted(stated)}, not {jax.__version__}"
    assert stated[jax.__version__] == (len(PRIMS), c["rule"], c["pass-through"], c["refused"]), (
        f"README states {stated[jax.__version__]} for jax {jax.__version__}; "
        f"the audit counts {len(PRIMS)} primitives: {c}"
    )
    # the guide for jax users repeats jax 0.10.2's counts
    guide = re.search(
        r"counts on jax (\d+\.\d+\.\d+):\s+(\d+) with a rule, (\d+) passing through, (\d+) refused",
        (README.parent / "docs" / "from-jax.md").read_text(),
    )
    assert guide, "docs/from-jax.md does not state the audit's counts"
    assert tuple(int(v) for v in guide.groups()[1:]) == stated[guide[1]][1:], (guide[0], stated[guide[1]])
