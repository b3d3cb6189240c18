"""One parametrised suite over the op table: forward vs the jnp oracle, rf.grad vs
jax.grad of the oracle (float32 and float64, eager and jit), every proper subset
of the differentiable arguments (the others plain arrays), a non-contiguous
view as input, and float64 finite differences."""

from __future__ import annotations

import itertools
import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf
from rumus_fx.testing import check_fd, check_grads, jax_oracle_grad

from .optable import OPS, OpInfo, Sample


def _is_array(a) -> bool:
    return isinstance(a, np.ndarray)


def _samples(info: OpInfo) -> list[Sample]:
    return info.samples(np.random.default_rng(zlib.crc32(info.name.encode())))


CASES = [
    pytest.param(info, k, id=f"{info.name}-{k}", marks=info.marks) for info in OPS for k in range(len(_samples(info)))
]
FIRST_CASES = [pytest.param(info, 0, id=f"{info.name}-0", marks=info.marks) for info in OPS]


def view_axes(a) -> tuple[int, int] | None:
    """Two axes of ``a`` longer than 1 (the last such pair), whose transpose is
    a non-contiguous view; None when ``a`` has fewer than two such axes (every
    view rf makes of it, a transpose or a reshape, is contiguous)."""
    long = [d for d in range(np.ndim(a)) if np.shape(a)[d] > 1]
    return (long[-2], long[-1]) if len(long) >= 2 else None


def _has_view(info: OpInfo, k: int) -> bool:
    sample = _samples(info)[k]
    return any(_is_array(sample.args[i]) and view_axes(sample.args[i]) is not None for i in sample.diff)


# the cases with a differentiable input that a non-contiguous view can show;
# the others (1-D inputs, (1, 4) @ (4, 1)) have none (test_every_op_has_a_view_case)
VIEW_CASES = [p for p in CASES if _has_view(*p.values)]
# each op's first such case by default (the op reads a view through one path whatever
# the sample's shapes); the others with -m slow
_FIRST_VIEW = {p.values[0].name: p.id for p in reversed(VIEW_CASES)}
DEFAULT_VIEW_CASES = [
    p if _FIRST_VIEW[p.values[0].name] == p.id else pytest.param(*p.values, id=p.id, marks=(*p.marks, pytest.mark.slow))
    for p in VIEW_CASES
]


def _setup(info: OpInfo, k: int, dtype):
    """(array args, fun_rf, fun_ref, diff argnums over the array args); static
    arguments are bound into the closures so the funs take arrays only."""
    sample = _samples(info)[k]
    positions = [i for i, a in enumerate(sample.args) if _is_array(a)]
    arrays = [
        jnp.asarray(sample.args[i], dtype) if sample.args[i].dtype.kind == "f" else jnp.asarray(sample.args[i])
        for i in positions
    ]

    def full(arr_args):
        args = list(sample.args)
        for i, a in zip(positions, arr_args):
            args[i] = a
        return args

    out_shape = np.shape(info.output(info.ref(*full(arrays), **sample.kwargs)))
    ct = jnp.asarray(np.random.default_rng(1).standard_normal(out_shape), dtype)

    # (ct in the output's dtype: check_fd runs the funs in float64)
    def fun_rf(*arr_args):
        out = info.output(info.op(*full(arr_args), **sample.kwargs))
        return rf.sum(rf.mul(out, ct.astype(out.dtype)))

    def fun_ref(*arr_args):
        out = info.output(info.ref(*full(arr_args), **sample.kwargs))
        return jnp.sum(out * ct.astype(out.dtype))

    diff = tuple(positions.index(d) for d in sample.diff)
    return arrays, fun_rf, fun_ref, diff, sample, full


def _tols(info: OpInfo, dtype):
    if dtype == jnp.float64:
        return dict(rtol=1e-10, atol=1e-10)
    return dict(rtol=info.rtol32, atol=info.atol32)


@pytest.mark.parametrize("info,k", CASES)
def test_forward_and_record(info: OpInfo, k: int):
    arrays, _, _, diff, sample, full = _setup(info, k, jnp.float32)
    got = info.output(info.op(*full(arrays), **sample.kwargs))
    want = info.output(info.ref(*full(arrays), **sample.kwargs))
    chex.assert_trees_all_close(rf.testing.as_array(got), want, **_tols(info, jnp.float32))
    # recorded: exactly one entry with one of the op's record names
    with rf.Tape() as tape:
        tracked = [rf.tensor(a, requires_grad=(j in diff)) for j, a in enumerate(arrays)]
        out = info.output(info.op(*full(tracked), **sample.kwargs))
    assert out.requires_grad
    assert len(tape) == 1, str(tape)
    assert tape.entries[0].op.name in info.records
    # untracked inputs record nothing
    with rf.Tape() as tape2:
        info.op(*full(arrays), **sample.kwargs)
    assert len(tape2) == 0


# float64 eager for every sample and float32 jit for each op's first sample by default
# (the eager path and the jit path, each dtype once; the argument-subset test runs both
# on ops of several arguments); the rest with -m slow
GRAD_MODES = [
    (jnp.float64, False, "f64-eager", lambda k: False),
    (jnp.float32, True, "f32-jit", lambda k: k > 0),
    (jnp.float32, False, "f32-eager", lambda k: True),
    (jnp.float64, True, "f64-jit", lambda k: True),
]
GRAD_CASES = [
    pytest.param(
        *p.values,
        dtype,
        jit,
        id=f"{p.id}-{mode}",
        marks=tuple(p.marks) + ((pytest.mark.slow,) if slow(p.values[1]) else ()),
    )
    for p in CASES
    for dtype, jit, mode, slow in GRAD_MODES
]


@pytest.mark.parametrize("info,k,dtype,jit", GRAD_CASES)
def test_grad_matches_jax(info: OpInfo, k: int, dtype, jit: bool):
    with jax.enable_x64(dtype == jnp.float64):
        arrays, fun_rf, fun_ref, diff, _, _ = _setup(info, k, dtype)
        # rf.grad (eager or jitted) vs jax.grad of the jnp oracle, shapes and dtypes too
        check_grads(fun_rf, arrays, diff, oracle=fun_ref, jit=jit, fd=False, **_tols(info, dtype))


def proper_subsets(diff: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every non-empty proper subset of ``diff`` (none for a single argument)."""
    return [c for r in range(1, len(diff)) for c in itertools.combinations(diff, r)]


def _subset_cases(samples: str) -> list:
    cases = []
    for info in OPS:
        ks = [0] if samples == "first" else range(1, len(_samples(info)))
        for k in ks:
            if proper_subsets(_samples(info)[k].diff):
                cases.append(pytest.param(info, k, id=f"{info.name}-{k}"))
    return cases


def check_argument_subsets(info: OpInfo, k: int, dtype, jit: bool) -> None:
    """rf.grad with respect to each proper subset of the differentiable
    arguments, the others passed as plain arrays (untracked operands), against
    jax.grad of the oracle with respect to all of them (an argument's gradient
    does not depend on which others are taken; one oracle program per case)."""
    with jax.enable_x64(dtype == jnp.float64):
        arrays, fun_rf, fun_ref, diff, _, _ = _setup(info, k, dtype)
        want = dict(zip(diff, jax_oracle_grad(fun_ref, arrays, diff)))
        for subset in proper_subsets(diff):
            g = rf.grad(fun_rf, argnums=subset)
            got = (jax.jit(g) if jit else g)(*arrays)
            expected = tuple(want[d] for d in subset)
            try:
                chex.assert_trees_all_equal_shapes_and_dtypes(got, expected)
                chex.assert_trees_all_close(got, expected, **_tols(info, dtype))
            except AssertionError as err:
                raise AssertionError(f"{info.name} sample {k}, argnums={subset}: {err}") from None


# float64 eager and float32 jit by default (as in test_grad_matches_jax); the other two
# with -m slow
SUBSET_MODES = [
    pytest.param(jnp.float32, False, id="f32-eager", marks=pytest.mark.slow),
    pytest.param(jnp.float32, True, id="f32-jit"),
    pytest.param(jnp.float64, False, id="f64-eager"),
    pytest.param(jnp.float64, True, id="f64-jit", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("dtype,jit", SUBSET_MODES)
@pytest.mark.parametrize("info,k", _subset_cases("first"))
def test_grad_of_each_argument_subset(info: OpInfo, k: int, dtype, jit: bool):
    check_argument_subsets(info, k, dtype, jit)


@pytest.mark.slow
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("info,k", _subset_cases("rest"))
def test_grad_of_each_argument_subset_all_samples(info: OpInfo, k: int, dtype, jit: bool):
    check_argument_subsets(info, k, dtype, jit)


def test_every_op_has_a_view_case():
    """Each op is checked through a non-contiguous view in some sample, and only
    cases no view can reach are left out of the view test."""
    assert len(CASES) - len(VIEW_CASES) <= 2, [p.id for p in CASES if p not in VIEW_CASES]
    for info in OPS:
        assert any(p.values[0] is info for p in VIEW_CASES), info.name
    for p in CASES:
        if p not in VIEW_CASES:
            arrays, _, _, diff, _, _ = _setup(*p.values, jnp.float32)
            assert all(view_axes(arrays[d]) is None for d in diff), p.id


def test_cases_carry_their_ops_marks():
    for p in CASES + FIRST_CASES + VIEW_CASES:
        assert tuple(p.marks) == tuple(p.values[0].marks)


@pytest.mark.parametrize("jit", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "jit"])
@pytest.mark.parametrize("info,k", DEFAULT_VIEW_CASES)
def test_grad_through_noncontiguous_view(info: OpInfo, k: int, jit: bool):
    """Differentiable inputs with two axes longer than 1 arrive transposed and
    are viewed back (a non-contiguous Tensor view) before the op reads them;
    every case gets at least one such view."""
    arrays, fun_rf, fun_ref, diff, _, _ = _setup(info, k, jnp.float32)
    swap = [view_axes(a) if j in diff else None for j, a in enumerate(arrays)]
    assert any(s is not None for s in swap)
    flipped = [a if s is None else jnp.swapaxes(a, *s) for a, s in zip(arrays, swap)]

    def fun_view(*args):
        views = [a if s is None else a.transpose(*s) for a, s in zip(args, swap)]
        for v, s in zip(views, swap):
            if s is not None:
                assert not v.is_contiguous()
        return fun_rf(*views)

    g = rf.grad(fun_view, argnums=diff)
    if jit:
        g = jax.jit(g)
    got = g(*flipped)
    want = jax_oracle_grad(fun_ref, arrays, diff)
    want = tuple(w if swap[d] is None else jnp.swapaxes(w, *swap[d]) for w, d in zip(want, diff))
    chex.assert_trees_all_close(got, want, **_tols(info, jnp.float32))


@pytest.mark.parametrize("info,k", CASES)
def test_untracked_view_operand(info: OpInfo, k: int):
    """An untracked, non-contiguous Tensor view is a valid operand."""
    arrays, _, _, _, sample, full = _setup(info, k, jnp.float32)
    views = [rf.tensor(jnp.swapaxes(a, -1, -2)).transpose(-1, -2) if a.ndim >= 2 else a for a in arrays]
    got = info.output(info.op(*full(views), **sample.kwargs))
    want = info.output(info.ref(*full(arrays), **sample.kwargs))
    chex.assert_trees_all_close(rf.testing.as_array(got), want, **_tols(info, jnp.float32))


@pytest.mark.parametrize("info,k", FIRST_CASES)
def test_finite_differences_f64(info: OpInfo, k: int):
    arrays, fun_rf, _, diff, _, _ = _setup(info, k, jnp.float32)
    check_fd(fun_rf, arrays, diff, tol=info.fd_tol, directions=2)


@pytest.mark.slow
@pytest.mark.parametrize("info,k", CASES)
def test_finite_differences_f64_all_samples(info: OpInfo, k: int):
    arrays, fun_rf, _, diff, _, _ = _setup(info, k, jnp.float32)
    check_fd(fun_rf, arrays, diff, tol=info.fd_tol, directions=3, jit=True)


# ops whose eager forward may still bind a primitive through JAX's Python
# dispatch: ``index``'s basic indexing (``x[1:, 0]``) is jnp indexing, whose
# keys would each need a program of their own as one compiled call
_BINDS_EAGERLY = {"index"}


@pytest.mark.parametrize("info", [pytest.param(info, id=info.name, marks=info.marks) for info in OPS])
def test_eager_forward_and_backward_are_compiled_calls(info: OpInfo):
    """Eagerly, an op's forward and its record's backward are cached compiled
    calls (Note [Eager compilation] in rumus_fx/eager.py): no jnp function runs
    on concrete arrays outside them, binding each primitive through JAX's
    Python dispatch (20-60 µs a primitive)."""
    from tests._eager import primitives_bound_one_by_one

    arrays, fun_rf, _, diff, _, _ = _setup(info, 0, jnp.float32)
    vg = rf.value_and_grad(fun_rf, argnums=diff)
    bound = primitives_bound_one_by_one(lambda: vg(*arrays))
    assert (bound != []) == (info.name in _BINDS_EAGERLY), bound
