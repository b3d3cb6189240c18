"""rumus_fx.numpy, rf.lax and rf.nn mirror jax.numpy, jax.lax and jax.nn name for
name, and every function that takes one or two float arrays is checked: its
forward equals jax's and ``rf.grad`` through it equals ``jax.grad`` (float64,
eager) and float64 finite differences (at inputs of both signs). Functions that need other arguments are exercised by the primitive table
and the program tests; the lists below say which names the sweep could call."""

from __future__ import annotations

import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import rumus_fx as rf
import rumus_fx.numpy as rnp


def _functions(mod: types.ModuleType) -> list[str]:
    return sorted(
        n
        for n in dir(mod)
        if not n.startswith("_") and callable(getattr(mod, n)) and not isinstance(getattr(mod, n), type)
    )


def test_names_mirror_jax():
    for mine, theirs in ((rnp, jnp), (rnp.linalg, jnp.linalg), (rnp.fft, jnp.fft), (rf.lax, lax)):
        missing = [n for n in dir(theirs) if not n.startswith("_") and not hasattr(mine, n)]
        assert not missing, missing
    assert all(hasattr(rf.nn, n) for n in dir(jax.nn) if not n.startswith("_") and n != "initializers")
    import rumus_fx.numpy.linalg as rl  # importable as a module too

    assert rl.solve is rnp.linalg.solve


def _x(shape=(3, 4), seed=0):
    # values in (0.2, 0.9): inside the domain of log, sqrt, arcsin, ... and tie-free
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.uniform(0.2, 0.9, shape))


def _try(fn, *args):
    try:
        with jax.numpy_rank_promotion("allow"):
            out = fn(*args)
    except Exception:
        return None
    leaves = jax.tree.leaves(out)
    if len(leaves) != 1 or not hasattr(leaves[0], "dtype") or not jnp.issubdtype(leaves[0].dtype, jnp.floating):
        return None
    return leaves[0]


def _callable_with(fn, arity: int) -> bool:
    """Whether ``fn`` takes ``arity`` float arrays to one float array: abstractly with
    ``jax.eval_shape`` (no compile, no computation: collection stays fast), and by a real
    call only where the abstract call fails (a function of values, as ``jnp.unique``)."""
    shape = jax.ShapeDtypeStruct((3, 4), jnp.float64)
    try:
        # through a lambda: jax.jit of some jnp callables themselves (jnp.array_repr) crashes the process
        with jax.numpy_rank_promotion("allow"):
            out = jax.eval_shape(lambda *a: fn(*a), *([shape] * arity))
    except Exception:
        return _try(fn, *[_x(seed=i) for i in range(arity)]) is not None
    leaves = jax.tree.leaves(out)
    return len(leaves) == 1 and hasattr(leaves[0], "dtype") and jnp.issubdtype(leaves[0].dtype, jnp.floating)


def _sweep(mod_j, names):
    """(name, arity) of every function callable with 1 or 2 float arrays."""
    out = []
    with jax.enable_x64(True):
        for n in names:
            fj = getattr(mod_j, n)
            for arity in (1, 2):
                if _callable_with(fj, arity):
                    out.append((n, arity))
                    break
    return out


def _sweep_eagerly(mod_j, names):
    """The sweep by real calls (what ``_sweep`` must agree with)."""
    out = []
    with jax.enable_x64(True):
        for n in names:
            for arity in (1, 2):
                if _try(getattr(mod_j, n), *[_x(seed=i) for i in range(arity)]) is not None:
                    out.append((n, arity))
                    break
    return out


# names whose derivative jax itself does not define at these inputs, or that are not
# functions of their input's value (random draws, constructors)
_SKIP = {
    "empty_like", "zeros_like", "ones_like", "full_like", "array", "asarray", "copy", "fix", "rint",
    "floor", "ceil", "round", "around", "trunc", "sign", "signbit", "spacing", "nextafter", "frexp",
    "histogram", "histogram_bin_edges", "histogramdd", "histogram2d", "bincount", "digitize",
    "searchsorted", "unique", "unique_values", "nonzero", "flatnonzero", "argwhere", "where",
    "ldexp", "float_power", "copysign", "heaviside", "modf", "divmod", "floor_divide", "fmod",
    "remainder", "mod", "interp", "piecewise", "select", "nanargmax", "nanargmin", "from_dlpack", "frombuffer", "fromfunction", "fromiter", "fromstring",
}  # fmt: skip


NP_CASES = _sweep(jnp, [n for n in _functions(jnp) if n not in _SKIP])


def test_sweep_reaches_most_of_jax_numpy():
    assert len(NP_CASES) >= 130, len(NP_CASES)


@pytest.mark.slow
def test_abstract_sweep_equals_the_eager_sweep():
    names = [n for n in _functions(jnp) if n not in _SKIP]
    assert NP_CASES == _sweep_eagerly(jnp, names)
    assert NN_CASES == _sweep_eagerly(jax.nn, [n for n in _functions(jax.nn) if n not in {"initializers"}])
    assert LAX_CASES == _sweep_eagerly(lax, [n for n in _functions(lax) if n not in _SKIP | {"stop_gradient"}])


def _jax_grad(f, nums, args):
    """``jax.grad`` compiled (one program, where eagerly jax compiles one per
    primitive); eagerly where it does not compile (a function that needs a
    value while tracing), raising what jax.grad raises there."""
    try:
        return jax.jit(jax.grad(f, argnums=nums))(*args)
    except Exception:
        return jax.grad(f, argnums=nums)(*args)


@pytest.mark.parametrize("name,arity", NP_CASES, ids=[n for n, _ in NP_CASES])
def test_rnp_function_forward_and_grad(name, arity):
    with jax.enable_x64(True), jax.numpy_rank_promotion("allow"):
        args = [_x(seed=i) for i in range(arity)]
        fj, fr = getattr(jnp, name), getattr(rnp, name)
        want_out = _try(fj, *args)
        ct = jnp.asarray(np.random.default_rng(5).standard_normal(want_out.shape))

        def loss_j(*a):
            return jnp.sum(jax.tree.leaves(fj(*a))[0] * ct)

        def loss_r(*a):
            return rf.sum(jax.tree.leaves(fr(*a), is_leaf=lambda t: isinstance(t, rf.Tensor))[0] * ct)

        try:
            jax.make_jaxpr(fj)(*args)
        except Exception:
            # not traceable abstractly (an output shape that depends on values, as in
            # jnp.unique): rf.lift traces it with its values (Note [Concrete tracing] in
            # rumus_fx/lift/concrete.py), and then equals jax.grad run eagerly or refuses
            # to read a tracked float as a constant (jax.grad drops such a term silently:
            # its gradient of jnp.unique is zero), for each argument alone and all together
            for nums in [*((k,) for k in range(arity)), tuple(range(arity))] if arity > 1 else [(0,)]:
                try:
                    got = rf.grad(loss_r, argnums=nums)(*args)
                except rf.AutogradError as e:
                    assert "cut it out of the gradient" in str(e), e
                    continue
                chex.assert_trees_all_close(got, jax.grad(loss_j, argnums=nums)(*args), rtol=1e-12, atol=1e-12)
            return
        got_out = rf.testing.as_array(jax.tree.leaves(fr(*args), is_leaf=lambda t: isinstance(t, rf.Tensor))[0])
        chex.assert_trees_all_close(got_out, want_out, rtol=1e-12, atol=1e-12)
        nums = tuple(range(arity))
        try:
            want = _jax_grad(loss_j, nums, args)
        except Exception:  # jax itself cannot differentiate it: rf must not give a value either
            with pytest.raises(Exception):  # noqa: B017
                rf.grad(loss_r, argnums=nums)(*args)
            return
        got = rf.grad(loss_r, argnums=nums)(*args)
        chex.assert_trees_all_close(got, want, rtol=1e-9, atol=1e-9)


NN_CASES = _sweep(jax.nn, [n for n in _functions(jax.nn) if n not in {"initializers"}])


@pytest.mark.parametrize("name,arity", NN_CASES, ids=[n for n, _ in NN_CASES])
def test_rf_nn_function_grad(name, arity):
    with jax.enable_x64(True):
        args = [_x(seed=i) - 0.55 for i in range(arity)]  # both signs
        fj, fr = getattr(jax.nn, name), getattr(rf.nn, name)
        want = _jax_grad(lambda *a: jnp.sum(fj(*a) ** 2), tuple(range(arity)), args)
        got = rf.grad(lambda *a: rf.sum(fr(*a) ** 2), argnums=tuple(range(arity)))(*args)
        chex.assert_trees_all_close(got, want, rtol=1e-9, atol=1e-9)


LAX_CASES = _sweep(lax, [n for n in _functions(lax) if n not in _SKIP | {"stop_gradient"}])


@pytest.mark.parametrize("name,arity", LAX_CASES, ids=[n for n, _ in LAX_CASES])
def test_rf_lax_function_grad(name, arity):
    with jax.enable_x64(True):
        args = [_x(seed=i) for i in range(arity)]
        fj, fr = getattr(lax, name), getattr(rf.lax, name)
        try:
            want = _jax_grad(lambda *a: jnp.sum(fj(*a)), tuple(range(arity)), args)
        except Exception:
            return  # not differentiable in jax either (checked for rnp above)
        got = rf.grad(lambda *a: rf.sum(fr(*a)), argnums=tuple(range(arity)))(*args)
        chex.assert_trees_all_close(got, want, rtol=1e-9, atol=1e-9)


# -- every swept function against finite differences ---------------------------------


def _scipy_modules() -> list[types.ModuleType]:
    import importlib
    import pkgutil

    import jax.scipy.stats

    stats = [
        importlib.import_module(f"jax.scipy.stats.{m.name}") for m in pkgutil.iter_modules(jax.scipy.stats.__path__)
    ]
    return [jax.scipy.special, *stats]


# jax.scipy.special and the jax.scipy.stats distributions, swept the same way (with -m
# slow: 130 more cases, about a minute on 2 workers; the primitive table already checks
# the special functions' rules against finite differences)
SCIPY_CASES = [(m, n, a) for m in _scipy_modules() for n, a in _sweep(m, [n for n in _functions(m) if n not in _SKIP])]
_ALL_CASES = (
    [(jnp, n, a) for n, a in NP_CASES]
    + [(jax.nn, n, a) for n, a in NN_CASES]
    + [(lax, n, a) for n, a in LAX_CASES]
    + SCIPY_CASES
)


# every fourth jnp/jax.nn/lax function by default (each one's gradient is also checked
# against jax.grad above, and every primitive rule against finite differences in the
# primitive table); the rest with -m slow
@pytest.mark.parametrize(
    "mod,name,arity",
    [
        pytest.param(
            m,
            n,
            a,
            id=f"{m.__name__}.{n}",
            marks=pytest.mark.slow if (m, n, a) in SCIPY_CASES or j % 4 else (),
        )
        for j, (m, n, a) in enumerate(_ALL_CASES)
    ],
)
def test_sweep_matches_finite_differences(mod, name, arity):
    """rf's gradient of every swept function against float64 central differences
    along random directions, at inputs of both signs where the function is finite
    there, else in (0.2, 0.9): jax.grad is not the only oracle (jax 0.10's complex
    ``acosh`` gradient was wrong, and rf's rule had copied it)."""
    fj = getattr(mod, name)
    with jax.enable_x64(True), jax.numpy_rank_promotion("allow"):

        def first(*a):
            return jax.tree.leaves(fj(*a))[0]

        nums = tuple(range(arity))
        for args in (
            [jnp.asarray(np.random.default_rng(i).standard_normal((3, 4))) for i in range(arity)],
            [_x(seed=i) for i in range(arity)],
        ):
            try:
                out = jax.jit(fj)(*args)
                want = _jax_grad(lambda *a: jnp.sum(first(*a)), nums, args)
            except Exception:
                continue  # not traceable or not differentiable by jax here (checked above)
            y = jax.tree.leaves(out)[0]
            if np.all(np.isfinite(y)) and all(np.all(np.isfinite(w)) for w in want):
                break
        else:
            return  # no point where jax differentiates it to a finite value
        ct = jnp.asarray(np.random.default_rng(5).standard_normal(y.shape))

        def loss(*a):
            return jnp.sum(first(*a) * ct)

        got = jax.jit(rf.grad(rf.lift(loss), argnums=nums))(*args)
        f = jax.jit(loss)
        rng = np.random.default_rng(3)
        h = 1e-6
        for _ in range(2):
            vs = [jnp.asarray(rng.standard_normal(a.shape)) for a in args]
            fd = (f(*[a + h * v for a, v in zip(args, vs)]) - f(*[a - h * v for a, v in zip(args, vs)])) / (2 * h)
            dr = sum(jnp.sum(g * v) for g, v in zip(got, vs))
            np.testing.assert_allclose(float(dr), float(fd), rtol=1e-5, atol=1e-5)
