"""The primitive-rule suite: every entry of the primitive table under
``rf.grad(rf.lift(f))`` against ``jax.grad(f)`` (compiled) — float64 eager, float32
jit (every eighth entry; all four modes with -m slow), every differentiable
argument alone and all together, float64 finite differences (in the float64
eager case), non-contiguous Tensor inputs, a ``jax.vmap`` subset — and a
coverage test: every rule is exercised by some entry."""

from __future__ import annotations

import itertools
import re
import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

import rumus_fx as rf
from rumus_fx.lift.rules import RULES
from rumus_fx.testing import check_fd

from .ptable import ENTRIES, Sample, TableEntry


def _samples(info: TableEntry) -> list[Sample]:
    return info.samples(np.random.default_rng(zlib.crc32(info.name.encode())))


FIRST = [pytest.param(info, 0, id=info.name) for info in ENTRIES]
# per-example gradients: the entries marked ``vmap`` by default, every other entry with -m
# slow (left out where jax's own vmap raises: ``reshard``, a mesh axis being named, and
# the ragged dots, whose batching rule needs the group sizes batched too; for the entries
# of ``JAX_VMAP_RAISES`` the test checks that rf raises jax's error)
VMAP = [
    pytest.param(info, 0, id=info.name, marks=() if info.vmap else pytest.mark.slow)
    for info in ENTRIES
    if info.name != "reshard" and not info.name.startswith("ragged_dot")
]


# jax.experimental.sparse's COO and CSR primitives, spsolve and linear_call have no batching rule, and
# kfac-jax's loss tag fails under jax.vmap: jax's own vmap raises for these entries
JAX_VMAP_RAISES = {
    *(f"{fmt}_{op}" for fmt in ("coo", "csr") for op in ("todense", "fromdense", "matvec", "matmat")),
    *(f"{fmt}_{op}_transposed" for fmt in ("coo", "csr") for op in ("matvec", "matmat")),
    "spsolve",
    "linear_call",
    "kfac_loss_tag",
}


def _setup(info: TableEntry, k: int, dtype):
    sample = _samples(info)[k]
    args = [jnp.asarray(a, dtype) if np.asarray(a).dtype.kind == "f" else jnp.asarray(a) for a in sample.args]
    out = jax.eval_shape(info.fun, *args)
    ct = jnp.asarray(np.random.default_rng(7).standard_normal(out.shape), dtype)

    def f_ref(*a):
        y = (info.oracle or info.fun)(*a)
        return jnp.sum(y * ct.astype(y.dtype))  # float64 under the finite-difference check

    def f_rf(*a):
        y = rf.lift(info.fun)(*a)
        return rf.sum(y * ct.astype(y.dtype))

    return args, f_rf, f_ref, sample.diff


def _tols(info, dtype):
    return dict(rtol=1e-10, atol=1e-10) if dtype == jnp.float64 else dict(rtol=info.rtol32, atol=info.atol32)


def _oracle(f_ref, argnums):
    """``jax.grad`` of the oracle, compiled: one program instead of one per
    primitive run eagerly, which cost twice rf's own time in this suite."""
    return jax.jit(jax.grad(f_ref, argnums=argnums))


def _check(info, args, f_rf, f_ref, argnums, dtype, jit, want=None):
    """rf's gradient against ``want``, jax's (computed here when not given); returns rf's."""
    g = rf.grad(f_rf, argnums=argnums)
    if jit:
        g = jax.jit(g)
    got = g(*args)
    if want is None:
        want = _oracle(f_ref, argnums)(*args)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    chex.assert_trees_all_close(got, want, **_tols(info, dtype))
    return got


# float64 eager for every entry and float32 jit for every eighth one by default (a rule
# runs the same code under jit, and the program tests run whole lifted programs under jit);
# the rest with -m slow
MODES = [
    (jnp.float64, False, "f64-eager", lambda j: False),
    (jnp.float32, True, "f32-jit", lambda j: j % 8 != 1),
    (jnp.float32, False, "f32-eager", lambda j: True),
    (jnp.float64, True, "f64-jit", lambda j: True),
]
RULE_CASES = [
    pytest.param(
        info,
        k,
        dtype,
        jit,
        id=f"{info.name}-{k}-{mode}",
        marks=pytest.mark.slow if (k > 0 or slow(j)) else (),
    )
    for j, info in enumerate(ENTRIES)
    for k in range(len(_samples(info)))  # samples after the first with -m slow
    for dtype, jit, mode, slow in MODES
]


@pytest.mark.parametrize("info,k,dtype,jit", RULE_CASES)
def test_rule_matches_jax_grad(info, k, dtype, jit):
    """Against the compiled ``jax.grad`` of the oracle; the float64 eager case of
    the first sample also against float64 central differences (along two random
    directions: jax.grad is not the only oracle), and eagerly the forward value
    is jax's own."""
    with jax.enable_x64(dtype == jnp.float64):
        args, f_rf, f_ref, diff = _setup(info, k, dtype)
        want_out = want = None
        if not jit:  # jax's forward value and its gradient from one compiled program
            want_out, want = jax.jit(lambda *a: (info.fun(*a), jax.grad(f_ref, argnums=diff)(*a)))(*args)
        got = _check(info, args, f_rf, f_ref, diff, dtype, jit, want=want)
        if dtype == jnp.float64 and not jit and k == 0 and info.fd:
            check_fd(f_rf, args, diff, tol=info.fd_tol, directions=2, grads=got)
        if not jit:
            chex.assert_trees_all_close(rf.lift(info.fun)(*args), want_out, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("info,k", FIRST)
def test_each_argument_alone(info, k):
    """Each differentiable argument alone (the others plain data), float64
    eager (float32 jit too with -m slow): a rule that reads data saved for
    another argument fails here."""
    with jax.enable_x64(True):
        args, f_rf, f_ref, diff = _setup(info, k, jnp.float64)
        _check_subsets(info, args, f_rf, f_ref, diff, jnp.float64, False)


def _check_subsets(info, args, f_rf, f_ref, diff, dtype, jit):
    """Each proper subset of ``diff`` against jax's gradient with respect to all of
    ``diff`` (an argument's gradient does not depend on which others are taken)."""
    if len(diff) < 2:
        return
    want = dict(zip(diff, _oracle(f_ref, diff)(*args)))
    for r in range(1, len(diff)):
        for subset in itertools.combinations(diff, r):
            _check(info, args, f_rf, f_ref, subset, dtype, jit, want=tuple(want[d] for d in subset))


@pytest.mark.slow
@pytest.mark.parametrize("info,k", FIRST)
def test_each_argument_alone_f32_jit(info, k):
    with jax.enable_x64(False):
        args, f_rf, f_ref, diff = _setup(info, k, jnp.float32)
        _check_subsets(info, args, f_rf, f_ref, diff, jnp.float32, True)


# Tensor views are materialised before rf.lift traces (the rules see arrays), so the
# default run checks every other entry of the vmap subset; every entry with -m slow
_VMAP_NAMES = [info.name for info in ENTRIES if info.vmap]
NONCONTIGUOUS = [
    pytest.param(
        info, 0, id=info.name, marks=() if info.vmap and _VMAP_NAMES.index(info.name) % 2 == 0 else pytest.mark.slow
    )
    for info in ENTRIES
]


@pytest.mark.parametrize("info,k", NONCONTIGUOUS)
def test_noncontiguous_tensor_inputs(info, k):
    """Differentiable inputs arrive as transposed Tensor views."""
    args, f_rf, f_ref, diff = _setup(info, k, jnp.float32)
    swap = [j in diff and a.ndim >= 2 for j, a in enumerate(args)]

    def f_view(*a):
        views = [x.transpose(-1, -2) if s else x for x, s in zip(a, swap)]
        return f_rf(*views)

    flipped = [jnp.swapaxes(a, -1, -2) if s else a for a, s in zip(args, swap)]
    got = rf.grad(f_view, argnums=diff)(*flipped)
    want = _oracle(f_ref, diff)(*args)
    want = tuple(jnp.swapaxes(w, -1, -2) if swap[d] else w for w, d in zip(want, diff))
    chex.assert_trees_all_close(got, want, **_tols(info, jnp.float32))


# under jax.jit by default: rf's ops see the same batch tracers as eagerly, where each
# batched primitive is dispatched (and compiled) on its own, 5-10x the time; eagerly too
# with -m slow
@pytest.mark.parametrize("jit", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["jit", "eager"])
@pytest.mark.parametrize("info,k", VMAP)
def test_vmap_per_example(info, k, jit):
    """rf's per-example gradients equal jax's; where jax's own ``jax.vmap`` of the
    entry's function raises (``JAX_VMAP_RAISES``), rf raises the same error."""
    args, f_rf, f_ref, diff = _setup(info, k, jnp.float32)
    batched = [jnp.stack([a, a * 0.5 + 0.1]) if j in diff else a for j, a in enumerate(args)]
    axes = tuple(0 if j in diff else None for j in range(len(args)))
    maybe_jit = jax.jit if jit else (lambda f: f)
    if info.name in JAX_VMAP_RAISES:
        out = jax.eval_shape(info.fun, *args)
        ct = jnp.ones(out.shape, out.dtype)
        f_jax = lambda *a: jnp.sum(info.fun(*a) * ct)  # noqa: E731  (the primitive itself, not the oracle)
        with pytest.raises(Exception) as jax_error:
            maybe_jit(jax.vmap(jax.grad(f_jax, argnums=diff), in_axes=axes))(*batched)
        with pytest.raises(type(jax_error.value), match=re.escape(str(jax_error.value).splitlines()[0])):
            maybe_jit(jax.vmap(rf.grad(f_rf, argnums=diff), in_axes=axes))(*batched)
        return
    got = maybe_jit(jax.vmap(rf.grad(f_rf, argnums=diff), in_axes=axes))(*batched)
    want = maybe_jit(jax.vmap(jax.grad(f_ref, argnums=diff), in_axes=axes))(*batched)
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-5)


def _primitives(closed) -> set[str]:
    names = set()
    todo = [closed.jaxpr]
    while todo:
        jaxpr = todo.pop()
        for eqn in jaxpr.eqns:
            names.add(eqn.primitive.name)
            for v in eqn.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    if isinstance(sub, jcore.ClosedJaxpr):
                        todo.append(sub.jaxpr)
                    elif isinstance(sub, jcore.Jaxpr):
                        todo.append(sub)
    return names


def test_vmap_exceptions_name_entries():
    """Every name in ``JAX_VMAP_RAISES`` is an entry of the table (kfac-jax's only
    where kfac-jax is installed): a misspelt one would leave its entry unchecked."""
    assert JAX_VMAP_RAISES - {info.name for info in ENTRIES} <= {"kfac_loss_tag"}


def test_every_rule_is_exercised():
    seen: set[str] = set()
    for info in ENTRIES:
        for sample in _samples(info):
            args = [jnp.asarray(a) for a in sample.args]
            prims = _primitives(jax.make_jaxpr(info.fun)(*args))
            missing = set(info.prims) - prims
            assert not missing, f"{info.name} does not emit {missing} (it emits {sorted(prims)})"
            seen |= prims
    untested = sorted(set(RULES) - seen - UNEMITTED)
    assert not untested, f"rules without a primitive-table entry: {untested}"


# rules for primitives that no public jax function emits in a forward program
UNEMITTED = {"add_any", "copy", "copy_p", "real", "expand_dims", "checkpoint", "custom_vjp_call_jaxpr"}
# while: its reverse raises by design (a declared error case of its rule, run by
# tests/test_errors_audit.py; tests/lift/test_programs.py checks the forward)
UNEMITTED |= {"while"}
# emitted only by jax's own differentiation of a max/min pool (tests/lift/test_conv_rules.py)
UNEMITTED |= {"select_and_scatter_add", "select_and_gather_add"}


# -- second order: every rule's backward differentiated again by jax.jvp ------------------

# entries whose second derivative in their first argument jax.grad itself does not have
# ("Differentiation rule for 'igamma_grad_a' not implemented"; the eigenvalues' backward
# reads eigenvectors, whose derivative needs enable_eigvec_derivs): rf must raise as
# well, with a message naming the same thing
NO_SECOND_ORDER_IN_JAX = {
    "igamma": "igamma_grad_a",
    "igammac": "igamma_grad_a",
    "eigvals": "enable_eigvec_derivs",
    "poly": "enable_eigvec_derivs",
}
# entries whose second derivative in reverse mode jax.grad does not have, with what
# jax's and rf's errors name: the gamma sampler's backward runs a while_loop (its
# implicit derivative); a ragged dot's weight gradient is a ragged dot over a contracting
# axis, whose own gradient is not defined
_RAGGED = (NotImplementedError, "ragged dot general", "ragged axis")
NO_REVERSE_OVER_REVERSE_IN_JAX = {
    "random_gamma": (ValueError, "while_loop", "while_loop"),
    "ragged_dot": _RAGGED,
    "ragged_dot_permuted": _RAGGED,
    "ragged_dot_batched": _RAGGED,
}
# an entry whose custom_jvp rule deliberately differs from its primal (derivative 2 of the
# identity): rf applies the rule at every order; jax.grad's second order follows how the
# rule computes its primal output (``p[0]`` here), so the two differ by design
# (test_programs.py::test_inconsistent_custom_jvp_rule_holds_at_every_order)
RULE_NOT_ITS_PRIMALS_DERIVATIVE = {"custom_jvp_call"}
# entries whose second order alone takes over 10 s (jax's and rf's products each compile
# the gamma sampler's implicit derivative, a while_loop: 6 s apiece): with -m slow
SLOW_SECOND_ORDER = {"random_gamma"}
# (info, reverse): the Hessian-vector product for every fourth entry, and rf.grad over
# rf.grad too for every eighth one; the rest with -m slow (and rf.grad over rf.grad for
# the other entries in test_reverse_over_reverse_other_entries)
SECOND = [
    pytest.param(
        info, j % 8 == 0, id=info.name, marks=pytest.mark.slow if j % 4 or info.name in SLOW_SECOND_ORDER else ()
    )
    for j, info in enumerate(ENTRIES)
    if info.name not in RULE_NOT_ITS_PRIMALS_DERIVATIVE
]


def _direction(args, subset):
    """A fixed random direction for the arguments in ``subset``."""
    rng = np.random.default_rng(3)
    return tuple(jnp.asarray(rng.standard_normal(np.shape(args[d])), args[d].dtype) for d in subset)


def _with(args, subset, xs):
    """``args`` with the arguments in ``subset`` replaced by ``xs``."""
    a = list(args)
    for d, x in zip(subset, xs):
        a[d] = x
    return a


def _hvp(f, grad, args, subset):
    """``jax.jvp`` of ``grad(f, argnums=subset)`` along ``_direction`` (the other
    arguments plain data), float64 under jit."""
    ts = _direction(args, subset)
    inner = lambda *xs: grad(f, argnums=subset)(*_with(args, subset, xs))  # noqa: E731
    return jax.jit(lambda: jax.jvp(inner, tuple(args[d] for d in subset), ts)[1])()


def _reverse_over_reverse(f, args, subset):
    """``rf.grad`` of ``<rf.grad(f), v>`` (the inner backward recorded on the
    outer tape), float64 under jit, along the same direction as ``_hvp``."""
    ts = _direction(args, subset)

    def inner(*xs):
        gs = rf.grad(f, argnums=subset)(*_with(args, subset, xs))
        return sum(rf.sum(g * t) for g, t in zip(gs, ts))

    return jax.jit(rf.grad(inner, argnums=tuple(range(len(subset)))))(*(args[d] for d in subset))


def _check_second_order(info, subsets, reverse=False):
    with jax.enable_x64(True):
        args, f_rf, f_ref, diff = _setup(info, 0, jnp.float64)
        for subset in subsets(diff):
            try:
                want = _hvp(f_ref, jax.grad, args, subset)
            except NotImplementedError:  # a known gap of jax's, not a skip: rf must raise too
                assert info.name in NO_SECOND_ORDER_IN_JAX, info.name
                with pytest.raises(NotImplementedError, match=NO_SECOND_ORDER_IN_JAX[info.name]):
                    _hvp(f_rf, rf.grad, args, subset)
                if reverse:
                    with pytest.raises(
                        (NotImplementedError, rf.AutogradError), match=NO_SECOND_ORDER_IN_JAX[info.name]
                    ):
                        _reverse_over_reverse(f_rf, args, subset)
                continue
            got = _hvp(f_rf, rf.grad, args, subset)
            chex.assert_trees_all_close(got, want, rtol=1e-8, atol=1e-8)
            if reverse and info.name in NO_REVERSE_OVER_REVERSE_IN_JAX:
                exc, in_jax, in_rf = NO_REVERSE_OVER_REVERSE_IN_JAX[info.name]
                with pytest.raises(exc, match=in_jax):
                    jax.grad(lambda *a, s=subset: sum(jnp.sum(g) for g in jax.grad(f_ref, argnums=s)(*a)))(*args)
                with pytest.raises(rf.AutogradError, match=in_rf):
                    _reverse_over_reverse(f_rf, args, subset)
            elif reverse:
                got = _reverse_over_reverse(f_rf, args, subset)
                chex.assert_trees_all_close(tuple(got), tuple(want), rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("info,reverse", SECOND)
def test_second_order_matches_jax(info, reverse):
    """Hessian-vector products ``jax.jvp(rf.grad(f))`` against
    ``jax.jvp(jax.grad(f))``, all differentiable arguments together, float64: every
    rule's backward must itself be differentiable in every value it reads (a
    rule that evaluates a stop-gradient'ed factorisation where JAX re-solves,
    as custom_linear_solve once did, loses the Hessian's terms silently); and
    (``reverse``) the same product as ``rf.grad`` over ``rf.grad``."""
    _check_second_order(info, lambda diff: [tuple(diff)], reverse=reverse)


@pytest.mark.slow
@pytest.mark.parametrize("info", [pytest.param(p.values[0], id=p.id) for p in SECOND if not p.values[1]])
def test_reverse_over_reverse_other_entries(info):
    _check_second_order(info, lambda diff: [tuple(diff)], reverse=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "info", [pytest.param(p.values[0], id=p.id) for p in SECOND if len(_samples(p.values[0])[0].diff) > 1]
)
def test_second_order_each_argument_alone(info):
    _check_second_order(info, lambda diff: [(d,) for d in diff])
