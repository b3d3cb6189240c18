"""Random plain-JAX programs (``tests/lift/random_programs.py``) under
``rf.grad(rf.lift(f))`` against ``jax.grad(f)`` in float64: eagerly and under
``jax.jit``, with respect to all four arguments and to each one alone, and
second order (per-example ``jax.vmap``, ``jax.jvp`` of the gradient, and
``rf.grad`` of a function of ``rf.grad``). Where jax raises, rf must raise too.

The default run takes one program for every fourth catalogue entry (that entry
as its first step, then two drawn ones), so a quarter of the entries run eagerly, every
8th under jit and every 64th at second order (the primitive table checks every rule
they reach on its own); ``-m slow`` runs the other three quarters, every 32nd at second
order, and 600 more, longer ones (ten steps, eager and jit over every argument, a
third at second order).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf

from .random_programs import ARG_SHAPES, CATALOG, program

ALL = tuple(range(len(ARG_SHAPES)))
DEFAULT_STEPS = 3  # the default run's programs: the catalogue entry, then two drawn steps


@pytest.fixture(autouse=True)
def _broadcasting():
    """The programs broadcast and promote dtypes (complex intermediates) as users'
    code does (the suite's own settings raise on both)."""
    with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
        yield


def _outcome(f):
    try:
        return jax.tree_util.tree_map(np.asarray, f())
    except Exception as exc:  # jax refuses: rf must refuse too
        return exc


def _same(got, want, what, rtol=1e-7):
    if isinstance(want, Exception) or isinstance(got, Exception):
        assert isinstance(want, Exception) and isinstance(got, Exception), (what, got, want)
        return
    got, want = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert len(got) == len(want), what
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, k, a.shape, b.shape, a.dtype, b.dtype)
        scale = max(1.0, float(np.max(np.abs(b), where=np.isfinite(b), initial=0.0)))
        np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-9 * scale, equal_nan=True, err_msg=f"{what}, leaf {k}")


def _same_as_jax(got, want, what, rtol=1e-7):
    """``got`` against jax's gradient compiled, ``want(True)``, or, where they
    differ, computed eagerly, ``want(False)``: XLA rewrites a product with a 0/1
    mask into a select, so ``0 * inf`` (a mask times an infinite cotangent)
    is nan op by op and 0 compiled. Compiled first: one program, where jax
    eagerly compiles one per primitive (twice rf's own time here). Returns the
    outcome of jax's that ``got`` matched."""
    want_jit = _outcome(lambda: want(True))
    try:
        _same(got, want_jit, what + " (against jax compiled)", rtol)
        return want_jit
    except AssertionError:
        want_eager = _outcome(lambda: want(False))
        _same(got, want_eager, what, rtol)
        return want_eager


def _run(fn, args, jit):
    return (jax.jit(fn) if jit else fn)(*args)


def _first_order(seed: int, steps: int, cases: tuple[tuple[bool, tuple[int, ...]], ...]) -> tuple:
    """rf against jax in each ``(jit, argnums)`` case; returns the program (its
    ``applied`` filled in by the runs) and jax's outcomes."""
    f, args = program(seed, steps)
    outcomes = []
    for jit, argnums in cases:
        g = rf.grad(rf.lift(f), argnums=argnums)
        got = _outcome(lambda g=g, jit=jit: (jax.jit(g) if jit else g)(*args))
        want = functools.partial(_run, jax.grad(f, argnums=argnums), args)
        what = f"program {seed} ({f.applied}), {'jit' if jit else 'eager'}, argnums {argnums}"
        outcomes.append(_same_as_jax(got, want, what))
    return f, outcomes


def _second_order(seed: int, steps: int) -> None:
    f, args = program(seed, steps)
    t = [jnp.asarray(np.random.default_rng(seed + 11).standard_normal(s)) for s in ARG_SHAPES]
    g_rf, g_jax = rf.grad(rf.lift(f), argnums=ALL), jax.grad(f, argnums=ALL)
    what = f"program {seed} ({f.applied})"
    # per-example gradients: a batch of the first argument, the others shared
    xs = jnp.stack([args[0], 0.5 * args[0] + 0.1, -args[0]])
    _same_as_jax(
        _outcome(lambda: jax.vmap(lambda x: g_rf(x, *args[1:]))(xs)),
        functools.partial(_run, jax.vmap(lambda x: g_jax(x, *args[1:])), (xs,)),
        what + ", vmap",
    )
    # Hessian-vector product, forward over rf's reverse
    _same_as_jax(
        _outcome(lambda: jax.jvp(g_rf, tuple(args), tuple(t))[1]),
        functools.partial(_run, lambda *a: jax.jvp(g_jax, a, tuple(t))[1], args),
        what + ", jvp of the gradient",
        rtol=1e-6,
    )
    # reverse over reverse: the gradient of <grad f, t>
    dot_rf = rf.lift(lambda gs: sum(jnp.sum(a * b) for a, b in zip(gs, t)))
    dot_jax = jax.grad(lambda *a: sum(jnp.sum(x * y) for x, y in zip(g_jax(*a), t)), argnums=ALL)
    _same_as_jax(
        _outcome(lambda: rf.grad(lambda *a: dot_rf(g_rf(*a)), argnums=ALL)(*args)),
        functools.partial(_run, dot_jax, args),
        what + ", grad of grad",
        rtol=1e-6,
    )


# every fourth catalogue entry by default (those at seeds divisible by 4, which hold every
# 8th and every 64th), the rest with -m slow
@pytest.mark.parametrize(
    "seed",
    [pytest.param(s, id=CATALOG[s][0], marks=pytest.mark.slow if s % 4 else ()) for s in range(len(CATALOG))],
)
def test_random_program_matches_jax_grad(seed, x64):
    # eager over every argument; every 8th program jit over one alone (each argument
    # in turn over those seeds); the long programs of -m slow run jit over all
    cases = ((False, ALL),) + (((True, ((seed // 8) % len(ALL),)),) if seed % 8 == 0 else ())
    f, outcomes = _first_order(seed, DEFAULT_STEPS, cases)
    # the program differentiates under jax.grad (the comparison compared gradients, not
    # two refusals) and applies its own catalogue entry
    assert not isinstance(outcomes[0], Exception), outcomes[0]
    assert f.first in f.applied, (f.first, f.applied)


# every 64th entry by default, every 32nd with -m slow
@pytest.mark.parametrize(
    "seed",
    [pytest.param(s, id=CATALOG[s][0], marks=pytest.mark.slow if s % 64 else ()) for s in range(0, len(CATALOG), 32)],
)
def test_random_program_second_order(seed, x64):
    _second_order(seed, 5)


@pytest.mark.slow
@pytest.mark.parametrize("block", range(20))
def test_random_programs_long(block, x64):
    for seed in range(1000 + 30 * block, 1000 + 30 * (block + 1)):
        _first_order(seed, 10, ((False, ALL), (True, ALL), (False, (seed % len(ALL),))))
        if seed % 3 == 0:
            _second_order(seed, 8)
