"""Property tests and fuzzing with hypothesis.

(a) broadcasting ops on random shapes vs jnp and jax.grad;
(b) random small programs over every op, with reuse (diamonds), vs jax.grad of the
    same program written in jnp;
(c) random in-place writes under ``rf.no_grad()`` between forward and backward:
    ``rf.VersionMismatch`` is raised exactly when a live record read a storage that
    was written, as predicted by an independent model of what each record reads
    (docs/SPEC.md section 4), and gradients are unchanged otherwise.

Profiles
--------
CI runs a small deterministic profile (``derandomize=True``, no example database,
no deadline). For a longer, randomised run by hand, either

* scale every test here:  ``RUMUS_FX_FUZZ=long python -m pytest tests/test_fuzz.py``
  (``RUMUS_FX_FUZZ_EXAMPLES=5000`` sets the count; default 1000), or
* run the ``fuzz_long`` tests, left out of the default run by pyproject's
  ``-m 'not slow and not fuzz_long'``:  ``python -m pytest tests/test_fuzz.py -m fuzz_long``.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rumus_fx as rf

from .ops.optable import (
    ref_attention,
    ref_batch_norm,
    ref_cross_entropy,
    ref_dropout,
    ref_layer_norm,
    ref_max_pool2d,
)

# When a property fails, hypothesis's pytest plugin imports libcst (to print a
# patch), whose import emits a DeprecationWarning that this suite's
# "warnings are errors" turns into an INTERNALERROR hiding the failure. Import
# it once here with that warning silenced (the module is then cached).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        import hypothesis.extra._patching  # noqa: F401
    except ImportError:  # pragma: no cover - libcst not installed: nothing to pre-import
        pass

# ---------------------------------------------------------------------------
# profiles
# ---------------------------------------------------------------------------

LONG = os.environ.get("RUMUS_FX_FUZZ", "").lower() == "long"
LONG_EXAMPLES = int(os.environ.get("RUMUS_FX_FUZZ_EXAMPLES", "1000"))
_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def fuzz(ci_examples: int) -> settings:
    """The CI profile (deterministic, ``ci_examples``), or the long one."""
    if LONG:
        return long_fuzz()
    return settings(max_examples=ci_examples, derandomize=True, database=None, print_blob=True, **_COMMON)


def long_fuzz() -> settings:
    return settings(max_examples=LONG_EXAMPLES, derandomize=False, print_blob=True, **_COMMON)


# ---------------------------------------------------------------------------
# (a) broadcasting ops on random shapes
# ---------------------------------------------------------------------------

_BINARY = {
    "add": (rf.add, jnp.add, ("AddBackward", "BroadcastAddBackward")),
    "sub": (rf.sub, jnp.subtract, ("SubBackward", "BroadcastSubBackward")),
    "mul": (rf.mul, jnp.multiply, ("MulBackward", "BroadcastMulBackward")),
    "div": (rf.div, jnp.divide, ("DivBackward", "DivBackward")),
}


def _ranked(f):
    def g(a, b):
        nd = max(jnp.ndim(a), jnp.ndim(b))
        return f(
            jnp.reshape(a, (1,) * (nd - jnp.ndim(a)) + jnp.shape(a)),
            jnp.reshape(b, (1,) * (nd - jnp.ndim(b)) + jnp.shape(b)),
        )

    return g


def check_broadcasting(op: str, shapes, tracked: str, scalar: str, view: bool, jit: bool, seed: int):
    """``op(a, b)`` for broadcast-compatible shapes: the output and recorded
    record name, and ``rf.grad`` vs ``jax.grad`` for the tracked operands. A
    python scalar may replace either operand; with ``view`` the lhs arrives
    transposed and is viewed back (a non-contiguous operand)."""
    rf_op, jnp_op, (same_rec, bcast_rec) = _BINARY[op]
    rng = np.random.default_rng(seed)
    sa, sb = shapes.input_shapes
    a = rng.standard_normal(sa).astype(np.float32)
    b = rng.standard_normal(sb).astype(np.float32)
    if op == "div":  # keep denominators away from 0
        b = np.where(b < 0, -1.0, 1.0).astype(np.float32) * rng.uniform(0.5, 2.0, sb).astype(np.float32)
    args: list[Any] = [jnp.asarray(a), jnp.asarray(b)]
    if scalar == "lhs":
        args[0] = 0.75
    elif scalar == "rhs":
        args[1] = -1.25
    arrays = [i for i in (0, 1) if not isinstance(args[i], float)]
    argnums = tuple(i for i in arrays if tracked in ("both", ("lhs", "rhs")[i])) or tuple(arrays[:1])
    out_shape = np.broadcast_shapes(np.shape(args[0]), np.shape(args[1]))
    ct = jnp.asarray(rng.standard_normal(out_shape), jnp.float32)
    flip = view and 0 in argnums and np.ndim(args[0]) >= 2

    def fun_rf(x, y):
        if flip:
            x = x.transpose(-1, -2)
            assert not x.is_contiguous() or 1 in x.shape[-2:]
        return rf.sum(rf.mul(rf_op(x, y), ct))

    def fun_ref(x, y):
        return jnp.sum(_ranked(jnp_op)(x, y) * ct)

    # forward and the record name (equal shapes: the plain record)
    with rf.Tape() as tape:
        tx = [rf.tensor(v, requires_grad=True) if i in argnums else v for i, v in enumerate(args)]
        out = rf_op(*tx)
    assert out.shape == out_shape
    want_out = _ranked(jnp_op)(*args)
    np.testing.assert_allclose(np.asarray(out.value), np.asarray(want_out), rtol=1e-6, atol=1e-6)
    same = np.shape(args[0]) == np.shape(args[1]) == out_shape
    assert [e.op.name for e in tape.entries] == [same_rec if same else bcast_rec]
    # gradients
    rf_args = list(args)
    if flip:
        rf_args[0] = jnp.swapaxes(args[0], -1, -2)
    g = rf.grad(fun_rf, argnums=argnums)
    got = (jax.jit(g) if jit else g)(*rf_args)
    want = jax.grad(fun_ref, argnums=argnums)(*args)
    for gg, ww, i in zip(got, want, argnums):
        if flip and i == 0:
            gg = jnp.swapaxes(gg, -1, -2)
        assert gg.shape == np.shape(args[i]) and gg.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(gg), np.asarray(ww), rtol=2e-5, atol=2e-5)


_SHAPES = hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=4, min_side=1, max_side=3)
_BCAST_ARGS = dict(
    op=st.sampled_from(sorted(_BINARY)),
    shapes=_SHAPES,
    tracked=st.sampled_from(["both", "lhs", "rhs"]),
    scalar=st.sampled_from(["none", "none", "none", "lhs", "rhs"]),
    view=st.booleans(),
    seed=st.integers(0, 2**16),
)


@fuzz(30)
@given(**_BCAST_ARGS)
def test_broadcasting_ops_random_shapes(op, shapes, tracked, scalar, view, seed):
    check_broadcasting(op, shapes, tracked, scalar, view, False, seed)


@fuzz(5)
@given(**_BCAST_ARGS)
def test_broadcasting_ops_random_shapes_jit(op, shapes, tracked, scalar, view, seed):
    check_broadcasting(op, shapes, tracked, scalar, view, True, seed)


@pytest.mark.fuzz_long
@long_fuzz()
@given(**_BCAST_ARGS, jit=st.booleans())
def test_broadcasting_ops_long(op, shapes, tracked, scalar, view, jit, seed):
    check_broadcasting(op, shapes, tracked, scalar, view, jit, seed)


# ---------------------------------------------------------------------------
# (b) random programs over every op, with reuse
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    args: tuple[int, ...]  # indices into the pool of values computed so far


class Ctx:
    """Shapes and fixed constants (drawn from the program's seed) that some
    instructions use; identical for the rf and the jnp run."""

    def __init__(self, m: int, n: int, seed: int):
        rng = np.random.default_rng(seed)
        self.m, self.n = m, n
        self.conv_w = jnp.asarray(rng.standard_normal((1, 1, 3, 3)) * 0.3)
        self.targets = jnp.asarray(np.arange(m) % n, jnp.int32)
        self.idx = jnp.asarray(rng.integers(0, m, (3,)), jnp.int32)
        self.rows = np.asarray(rng.integers(0, m, (m,)))  # a gather with repeats
        self.ramp = jnp.asarray(np.arange(m * n).reshape(m, n) * 1e-3)
        self.key = jax.random.key(seed)


def _ref_bn(x4):
    n = x4.shape[1]
    training = x4.shape[0] > 1
    return ref_batch_norm(x4, jnp.ones(n), jnp.zeros(n), jnp.zeros(n), jnp.ones(n), training=training)[0]


def _rf_bn(x4):
    n = x4.shape[1]
    training = x4.shape[0] > 1
    return rf.batch_norm_2d(x4, None, None, jnp.zeros(n), jnp.ones(n), training=training)[0]


def _rf_bmm(a3, shape):
    return rf.reshape(rf.tanh(rf.bmm(rf.bmm(a3, rf.transpose(a3, 1, 2)), a3) * 0.25), shape)


def _rf_inplace(kind):
    def f(c, a, b):
        y = rf.mul(a, 1.0)  # a fresh storage that may be written while recording
        getattr(y, kind)(rf.tanh(b))
        return y

    return f


# name -> (arity, rf implementation, jnp implementation); every fn gets (ctx, *operands)
PROGRAM_OPS: dict[str, tuple[int, Callable, Callable]] = {
    "neg": (1, lambda c, a: -a, lambda c, a: -a),
    "exp_tanh": (1, lambda c, a: rf.exp(rf.tanh(a)), lambda c, a: jnp.exp(jnp.tanh(a))),
    "log_sq": (1, lambda c, a: rf.log(a * a + 1.0), lambda c, a: jnp.log(a * a + 1.0)),
    "relu": (1, lambda c, a: rf.relu(a), lambda c, a: jax.nn.relu(a)),
    "sigmoid": (1, lambda c, a: rf.sigmoid(a), lambda c, a: jax.nn.sigmoid(a)),
    "tanh": (1, lambda c, a: rf.tanh(a), lambda c, a: jnp.tanh(a)),
    "softplus": (1, lambda c, a: rf.softplus(a), lambda c, a: jax.nn.softplus(a)),
    "gelu": (1, lambda c, a: rf.gelu(a), lambda c, a: jax.nn.gelu(a)),
    "gelu_exact": (1, lambda c, a: rf.gelu(a, approximate=False), lambda c, a: jax.nn.gelu(a, approximate=False)),
    "leaky_relu": (1, lambda c, a: rf.leaky_relu(a, 0.1), lambda c, a: jax.nn.leaky_relu(a, 0.1)),
    "softmax_rows": (1, lambda c, a: rf.softmax(a), lambda c, a: jax.nn.softmax(a, axis=-1)),
    "softmax_cols": (1, lambda c, a: rf.softmax(a, axis=0), lambda c, a: jax.nn.softmax(a, axis=0)),
    "layer_norm": (1, lambda c, a: rf.layer_norm(a), lambda c, a: ref_layer_norm(a)),
    "center_rows": (
        1,
        lambda c, a: a - rf.mean(a, axis=1, keepdims=True),
        lambda c, a: a - jnp.mean(a, axis=1, keepdims=True),
    ),
    "scale_by_colsum": (
        1,
        lambda c, a: a * rf.tanh(rf.sum(a, axis=0)),
        lambda c, a: a * jnp.tanh(jnp.sum(a, axis=0))[None, :],
    ),
    "transpose_twice": (
        1,
        lambda c, a: rf.transpose(rf.tanh(rf.transpose(a, 0, 1)), 1, 0),
        lambda c, a: jnp.tanh(a.T).T,
    ),
    "reshape_flat": (
        1,
        lambda c, a: rf.reshape(rf.sigmoid(rf.reshape(a, (-1,))), (c.m, c.n)),
        lambda c, a: jax.nn.sigmoid(a.reshape(-1)).reshape(c.m, c.n),
    ),
    "flatten": (
        1,
        lambda c, a: rf.flatten(rf.tanh(rf.reshape(a, (c.m, 1, c.n)))),
        lambda c, a: jnp.tanh(a),
    ),
    "gram": (
        1,
        lambda c, a: rf.tanh(rf.matmul(a @ a.T, a) * 0.25),
        lambda c, a: jnp.tanh(a @ a.T @ a * 0.25),
    ),
    "bmm": (
        1,
        lambda c, a: _rf_bmm(rf.reshape(a, (1, c.m, c.n)), (c.m, c.n)),
        lambda c, a: jnp.tanh(a @ a.T @ a * 0.25),
    ),
    "self_attention": (
        1,
        lambda c, a: rf.scaled_dot_product_attention(a, a, a),
        lambda c, a: ref_attention(a, a, a),
    ),
    "causal_attention": (
        1,
        lambda c, a: rf.scaled_dot_product_attention(a, a * 0.5, a, causal=True),
        lambda c, a: ref_attention(a, a * 0.5, a, causal=True),
    ),
    "cross_entropy": (
        1,
        lambda c, a: a * rf.tanh(rf.cross_entropy(a, c.targets)),
        lambda c, a: a * jnp.tanh(ref_cross_entropy(a, c.targets)),
    ),
    "conv": (
        1,
        lambda c, a: rf.reshape(rf.conv2d(rf.reshape(a, (1, 1, c.m, c.n)), c.conv_w, padding=1), (c.m, c.n)),
        lambda c, a: jax.lax.conv_general_dilated(
            a.reshape(1, 1, c.m, c.n), c.conv_w, (1, 1), [(1, 1), (1, 1)]
        ).reshape(c.m, c.n),
    ),
    "max_pool": (
        1,
        lambda c, a: rf.reshape(rf.max_pool2d(rf.reshape(a + c.ramp, (1, c.m, c.n)), 3, 1, 1), (c.m, c.n)),
        lambda c, a: ref_max_pool2d((a + c.ramp).reshape(1, c.m, c.n), 3, 1, 1).reshape(c.m, c.n),
    ),
    "adaptive_pool": (
        1,
        lambda c, a: a * rf.tanh(rf.mean(rf.adaptive_avg_pool2d(rf.reshape(a, (1, c.m, c.n)), 2))),
        lambda c, a: a * jnp.tanh(jnp.mean(_ref_adaptive(a))),
    ),
    "im2col": (
        1,
        lambda c, a: a * rf.tanh(rf.mean(rf.im2col(rf.reshape(a, (1, c.m, c.n)), 2, 1, 1) * 1.5)),
        lambda c, a: a * jnp.tanh(jnp.mean(_ref_im2col(a) * 1.5)),
    ),
    "embedding": (
        1,
        lambda c, a: rf.add_bias(a, rf.mean(rf.embedding(c.idx, a), axis=0)),
        lambda c, a: a + jnp.mean(jnp.take(a, c.idx, axis=0), axis=0)[None, :],
    ),
    "batch_norm": (
        1,
        lambda c, a: rf.reshape(_rf_bn(rf.reshape(a, (c.m, c.n, 1, 1))), (c.m, c.n)),
        lambda c, a: _ref_bn(a.reshape(c.m, c.n, 1, 1)).reshape(c.m, c.n),
    ),
    "dropout": (
        1,
        lambda c, a: rf.dropout(a, 0.3, c.key),
        lambda c, a: ref_dropout(a, 0.3, c.key),
    ),
    # binary
    "add": (2, lambda c, a, b: a + b, lambda c, a, b: a + b),
    "sub": (2, lambda c, a, b: rf.sub(a, b), lambda c, a, b: a - b),
    "mul_tanh": (2, lambda c, a, b: a * rf.tanh(b), lambda c, a, b: a * jnp.tanh(b)),
    "div_safe": (2, lambda c, a, b: a / (b * b + 1.0), lambda c, a, b: a / (b * b + 1.0)),
    "matmul_bt": (
        2,
        lambda c, a, b: rf.tanh(rf.matmul(rf.matmul(a, b.T), b) * 0.25),
        lambda c, a, b: jnp.tanh(a @ b.T @ b * 0.25),
    ),
    "attention": (
        2,
        lambda c, a, b: rf.scaled_dot_product_attention(a, b, b),
        lambda c, a, b: ref_attention(a, b, b),
    ),
    "add_bias": (
        2,
        lambda c, a, b: rf.add_bias(a, rf.mean(b, axis=0)),
        lambda c, a, b: a + jnp.mean(b, axis=0)[None, :],
    ),
    "channel_bias": (
        2,
        lambda c, a, b: rf.add_channel_bias(a, rf.mean(b, axis=1)),
        lambda c, a, b: a + jnp.mean(b, axis=1)[:, None],
    ),
    "stack_mean": (
        2,
        lambda c, a, b: rf.mean(rf.stack([a, rf.tanh(b), a], axis=2), axis=2),
        lambda c, a, b: jnp.mean(jnp.stack([a, jnp.tanh(b), a], axis=2), axis=2),
    ),
    "index": (
        1,
        lambda c, a: rf.index(a, (c.rows, slice(None, None, -1))) * 0.5 + a,
        lambda c, a: a[c.rows, ::-1] * 0.5 + a,
    ),
    "stack_slice": (
        2,
        lambda c, a, b: rf.slice_batch(rf.stack([a, b]), 0) + rf.slice_batch(rf.stack([a, b]), -1) * 0.5,
        lambda c, a, b: a + b * 0.5,
    ),
    "mse": (
        2,
        lambda c, a, b: a * rf.tanh(rf.mse_loss(a, b)),
        lambda c, a, b: a * jnp.tanh(jnp.mean((a - b) ** 2)),
    ),
    "inplace_add": (2, lambda c, a, b: _rf_inplace("add_")(c, a, b), lambda c, a, b: a + jnp.tanh(b)),
    "inplace_mul": (2, lambda c, a, b: _rf_inplace("mul_")(c, a, b), lambda c, a, b: a * jnp.tanh(b)),
    "inplace_div": (
        2,
        lambda c, a, b: _rf_inplace("div_")(c, a, b * b + 1.0),
        lambda c, a, b: a / jnp.tanh(b * b + 1.0),
    ),
}


def _ref_adaptive(a):
    from .ops.optable import ref_adaptive_avg_pool2d

    return ref_adaptive_avg_pool2d(a.reshape(1, *a.shape), 2)


def _ref_im2col(a):
    from .ops.optable import ref_im2col

    return ref_im2col(a.reshape(1, *a.shape), 2, 1, 1)


@st.composite
def programs(draw):
    # few shapes, so that the compiled primitives are reused across examples:
    # the programs' structure is what varies
    m, n = draw(st.sampled_from([(2, 3), (3, 2), (1, 4)]))
    n_leaves = draw(st.integers(1, 3))
    n_const = draw(st.integers(0, 1))
    length = draw(st.integers(1, 7))
    names = sorted(PROGRAM_OPS)
    instrs = []
    for i in range(length):
        name = draw(st.sampled_from(names))
        arity = PROGRAM_OPS[name][0]
        pool = n_leaves + n_const + i
        # bias towards the newest values so programs get deep, but reuse any
        args = tuple(draw(st.integers(0, pool - 1)) for _ in range(arity))
        instrs.append(Instr(name, args))
    total = n_leaves + n_const + length
    outputs = sorted(set(draw(st.lists(st.integers(0, total - 1), min_size=0, max_size=3))) | {total - 1})
    seed = draw(st.integers(0, 2**16))
    return m, n, n_leaves, n_const, instrs, outputs, seed


def run_program(impl: int, ctx: Ctx, leaves, consts, instrs, outputs, weights):
    """impl 1: rf; impl 2: jnp. Returns the scalar loss."""
    pool = [*leaves, *consts]
    for ins in instrs:
        fn = PROGRAM_OPS[ins.name][impl]
        pool.append(fn(ctx, *(pool[i] for i in ins.args)))
    if impl == 1:
        terms = [rf.sum(rf.mul(pool[j], weights[k])) for k, j in enumerate(outputs)]
        loss = terms[0]
        for t in terms[1:]:
            loss = loss + t
        return loss
    return sum(jnp.sum(pool[j] * weights[k]) for k, j in enumerate(outputs))


def check_program(prog, jit: bool):
    m, n, n_leaves, n_const, instrs, outputs, seed = prog
    with jax.enable_x64(True):
        rng = np.random.default_rng(seed)
        ctx = Ctx(m, n, seed)
        leaves = [jnp.asarray(rng.standard_normal((m, n))) for _ in range(n_leaves)]
        consts = [jnp.asarray(rng.standard_normal((m, n))) for _ in range(n_const)]
        weights = [jnp.asarray(rng.standard_normal((m, n))) for _ in outputs]

        def f_rf(*ls):
            return run_program(1, ctx, ls, consts, instrs, outputs, weights)

        def f_ref(*ls):
            return run_program(2, ctx, ls, consts, instrs, outputs, weights)

        argnums = tuple(range(n_leaves))
        g = rf.value_and_grad(f_rf, argnums=argnums)
        value, got = (jax.jit(g) if jit else g)(*leaves)
        want_value, want = jax.value_and_grad(f_ref, argnums=argnums)(*leaves)
        np.testing.assert_allclose(float(value), float(want_value), rtol=1e-9, atol=1e-9)
        for gg, ww in zip(got, want):
            assert gg.shape == (m, n) and gg.dtype == jnp.float64
            np.testing.assert_allclose(np.asarray(gg), np.asarray(ww), rtol=1e-8, atol=1e-8)


@fuzz(15)
@given(prog=programs())
def test_random_programs(prog):
    check_program(prog, jit=False)


@fuzz(3)
@given(prog=programs())
def test_random_programs_jit(prog):
    check_program(prog, jit=True)


@pytest.mark.fuzz_long
@long_fuzz()
@given(prog=programs(), jit=st.booleans())
def test_random_programs_long(prog, jit):
    check_program(prog, jit)


def test_program_ops_cover_the_op_table():
    """Every public op appears in some program instruction (checked on one tape)."""
    from .ops.optable import OPS

    seen: set[str] = set()
    with jax.enable_x64(True):
        ctx = Ctx(2, 3, 0)
        for arity, fn, _ in PROGRAM_OPS.values():
            with rf.Tape() as tape:
                xs = [
                    rf.tensor(np.random.default_rng(k).standard_normal((2, 3)), requires_grad=True)
                    for k in range(arity)
                ]
                fn(ctx, *xs)
            seen |= {e.op.name for e in tape.entries}
    want = {rec for info in OPS for rec in info.records}
    missing = want - seen
    assert not missing, f"records no program instruction produces: {sorted(missing)}"


# ---------------------------------------------------------------------------
# (c) in-place writes under no_grad between forward and backward
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Val:
    t: rf.Tensor
    sid: int  # the model's storage identity: views share their base's
    tracked: bool
    positive: bool
    vid: int  # index in Model.values


@dataclasses.dataclass
class Rec:
    name: str
    out_gid: int
    in_gids: tuple[int, ...]
    reads: tuple[tuple[int, int | None], ...]  # (storage id, grad id of the operand read)


_UNARY_C = {
    # name: (rf op, jnp op, record, what its backward reads, output positive)
    "exp": (rf.exp, jnp.exp, "ExpBackward", "output", True),
    "sigmoid": (rf.sigmoid, jax.nn.sigmoid, "SigmoidBackward", "output", True),
    "tanh": (rf.tanh, jnp.tanh, "TanhBackward", "output", False),
    "softmax": (rf.softmax, jax.nn.softmax, "SoftmaxBackward", "output", True),
    "relu": (rf.relu, jax.nn.relu, "ReluBackward", "input", False),
    "log": (rf.log, jnp.log, "LogBackward", "input", False),
    "gelu": (rf.gelu, jax.nn.gelu, "GeluBackward", "input", False),
    "leaky_relu": (rf.leaky_relu, jax.nn.leaky_relu, "LeakyReluBackward", "input", False),
    "layer_norm": (rf.layer_norm, ref_layer_norm, "LayerNormBackward", "input", False),
    "neg": (rf.neg, jnp.negative, "NegBackward", "nothing", False),
}
_BINARY_C = {
    "add": (rf.add, jnp.add, "AddBackward"),
    "sub": (rf.sub, jnp.subtract, "SubBackward"),
    "mul": (rf.mul, jnp.multiply, "MulBackward"),
    "div": (rf.div, jnp.divide, "DivBackward"),
}


class Model:
    """An independent model of the forward program: which records it appends,
    which storages (by the model's own storage ids; views share them) each
    record's backward reads (docs/SPEC.md section 4: MulBackward the other operand of
    each tracked one, Exp/Sigmoid/Tanh/Softmax their output, Relu/Log/Gelu/
    LeakyRelu/LayerNorm their input, Add/Sub/Neg/Sum/Mean/Reshape/Transpose
    nothing), and the same program in jnp for the gradient oracle."""

    def __init__(self):
        self.records: list[Rec] = []
        self.values: list[Val] = []
        self.steps: list[tuple[int, Callable, tuple[int, ...]]] = []  # (out vid, jnp fn, in vids)
        self.inputs: dict[int, Any] = {}  # vid -> leaf index (int) or constant array
        self.writes: dict[int, int] = {}  # sid -> number of in-place writes
        self._sids = itertools.count()

    def new(self, t: rf.Tensor, tracked: bool, positive=False, sid=None) -> Val:
        assert t.requires_grad == tracked, "model and implementation disagree on tracking"
        v = Val(t, next(self._sids) if sid is None else sid, tracked, positive, len(self.values))
        self.values.append(v)
        return v

    def step(self, out: Val, fn: Callable, *ins: Val) -> Val:
        self.steps.append((out.vid, fn, tuple(v.vid for v in ins)))
        return out

    def record(self, name: str, out: Val, inputs: list[Val], reads: list[Val]) -> None:
        if any(v.tracked for v in inputs):  # an op records iff an input is tracked
            gids = tuple(v.t.grad_id for v in inputs if v.tracked)
            self.records.append(Rec(name, out.t.grad_id, gids, tuple((v.sid, v.t.grad_id) for v in reads)))

    # -- sources ------------------------------------------------------------
    def leaf(self, k: int, data) -> Val:
        v = self.new(rf.tensor(data, requires_grad=True), True)
        self.inputs[v.vid] = k
        return v

    def const(self, data) -> Val:
        v = self.new(rf.tensor(data), False)
        self.inputs[v.vid] = jnp.asarray(data)
        return v

    # -- ops ----------------------------------------------------------------
    def unary(self, kind: str, a: Val) -> Val:
        fn, jfn, name, reads, positive = _UNARY_C[kind]
        out = self.new(fn(a.t), a.tracked, positive)
        self.record(name, out, [a], {"input": [a], "output": [out], "nothing": []}[reads])
        return self.step(out, jfn, a)

    def binary(self, kind: str, a: Val, b: Val) -> Val:
        fn, jfn, name = _BINARY_C[kind]
        out = self.new(fn(a.t, b.t), a.tracked or b.tracked, kind == "add" and a.positive and b.positive)
        reads = []
        if kind == "mul":  # da = g * b, db = g * a
            reads = ([b] if a.tracked else []) + ([a] if b.tracked else [])
        elif kind == "div":  # da = g / b, db = -g * a / b^2
            reads = ([b] if a.tracked or b.tracked else []) + ([a] if b.tracked else [])
        self.record(name, out, [a, b], reads)
        return self.step(out, jfn, a, b)

    def view(self, kind: str, a: Val) -> Val:
        """Views share the storage (same sid); their records read nothing."""
        if kind == "detach":
            return self.step(self.new(a.t.detach(), False, a.positive, sid=a.sid), jax.lax.stop_gradient, a)
        if kind == "transpose_twice":
            mid = self.new(rf.transpose(a.t, 0, 1), a.tracked, a.positive, sid=a.sid)
            self.record("TransposeBackward", mid, [a], [])
            self.step(mid, jnp.transpose, a)
            out = self.new(mid.t.transpose(1, 0), a.tracked, a.positive, sid=a.sid)
            self.record("TransposeBackward", out, [mid], [])
            return self.step(out, jnp.transpose, mid)
        assert a.t.is_contiguous()  # so reshape makes a view (docs/SPEC.md section 2)
        shape = a.t.shape
        mid = self.new(rf.reshape(a.t, (-1,)), a.tracked, a.positive, sid=a.sid)
        self.record("ReshapeBackward", mid, [a], [])
        self.step(mid, lambda x: x.reshape(-1), a)
        out = self.new(mid.t.reshape(shape), a.tracked, a.positive, sid=a.sid)
        self.record("ReshapeBackward", out, [mid], [])
        return self.step(out, lambda x: x.reshape(shape), mid)

    def rowsum_add(self, a: Val, b: Val) -> Val:
        s = self.new(rf.sum(b.t, axis=1, keepdims=True), b.tracked)
        self.record("SumBackward", s, [b], [])
        self.step(s, lambda x: jnp.sum(x, axis=1, keepdims=True), b)
        out = self.new(rf.add(a.t, s.t), a.tracked or s.tracked)
        self.record("BroadcastAddBackward", out, [a, s], [])
        return self.step(out, jnp.add, a, s)

    def rowmean_mul(self, a: Val, b: Val) -> Val:
        s = self.new(b.t.mean(axis=1, keepdims=True), b.tracked)
        self.record("MeanBackward", s, [b], [])
        self.step(s, lambda x: jnp.mean(x, axis=1, keepdims=True), b)
        out = self.new(a.t * s.t, a.tracked or s.tracked)
        self.record("BroadcastMulBackward", out, [a, s], ([s] if a.tracked else []) + ([a] if s.tracked else []))
        return self.step(out, jnp.multiply, a, s)

    def gram(self, a: Val, b: Val, c: Val) -> Val:
        bt = self.new(b.t.T, b.tracked, sid=b.sid)  # a non-contiguous view of b
        self.record("TransposeBackward", bt, [b], [])
        self.step(bt, jnp.transpose, b)
        t = self.new(rf.matmul(a.t, bt.t), a.tracked or bt.tracked)  # [m, m]
        self.record("MatmulBackward", t, [a, bt], ([bt] if a.tracked else []) + ([a] if bt.tracked else []))
        self.step(t, jnp.matmul, a, bt)
        u = self.new(t.t @ c.t, t.tracked or c.tracked)
        self.record("MatmulBackward", u, [t, c], ([c] if t.tracked else []) + ([t] if c.tracked else []))
        return self.step(u, jnp.matmul, t, c)

    def mse_scale(self, a: Val, b: Val, c: Val) -> Val:
        s = self.new(rf.mse_loss(b.t, c.t), b.tracked or c.tracked)  # 0-d
        self.record("MseLossBackward", s, [b, c], [b, c])  # both gradients read pred - target
        self.step(s, lambda x, y: jnp.mean((x - y) ** 2), b, c)
        out = self.new(a.t * s.t, a.tracked or s.tracked)
        self.record("BroadcastMulBackward", out, [a, s], ([s] if a.tracked else []) + ([a] if s.tracked else []))
        return self.step(out, jnp.multiply, a, s)

    # -- the jnp program ----------------------------------------------------
    def replay(self, leaves: Sequence[Any]) -> dict[int, Any]:
        env = {vid: (leaves[src] if isinstance(src, int) else src) for vid, src in self.inputs.items()}
        for out, fn, ins in self.steps:
            env[out] = fn(*(env[i] for i in ins))
        return env


_WRITES = ["add_", "mul_1", "zero_", "fill_", "copy_", "div_", "sub_", "T.add_", "detach.mul_", "flat.add_"]


def _write(t: rf.Tensor, how: str) -> None:
    """One in-place write (the caller holds no_grad), directly or through a view."""
    if how == "T.add_" and t.ndim != 2:
        how = "add_"
    if how == "flat.add_" and not t.is_contiguous():
        how = "detach.mul_"
    if how == "add_":
        t.add_(0.5)
    elif how == "mul_1":
        t.mul_(1.0)  # the same values, yet a write: the version moves
    elif how == "zero_":
        t.zero_()
    elif how == "fill_":
        t.fill_(0.25)
    elif how == "copy_":
        t.copy_(jnp.full(t.shape, 2.0, t.dtype))
    elif how == "div_":
        t.div_(2.0)
    elif how == "sub_":
        t.sub_(t.detach() * 0.5)
    elif how == "T.add_":
        t.T.add_(1.0)
    elif how == "detach.mul_":
        t.detach().mul_(3.0)
    else:
        t.reshape(-1).add_(1.0)


@dataclasses.dataclass
class Program:
    """A recorded forward program with its model, ready for writes and backward."""

    model: Model
    tape: rf.Tape
    loss: rf.Tensor
    leaves: list[Val]
    leaf_data: list[Any]
    in_loss: list[Val]
    weights: list[Any]

    def visited(self) -> list[Rec]:
        """The records backward visits, in its order: those whose output reaches the loss."""
        live = {self.loss.grad_id}
        out = []
        for rec in reversed(self.model.records):
            if rec.out_gid in live:
                out.append(rec)
                live |= set(rec.in_gids)
        return out

    def write(self, target: Val, how: str) -> None:
        with rf.no_grad():
            _write(target.t, how)
        self.model.writes[target.sid] = self.model.writes.get(target.sid, 0) + 1

    def verify(self) -> bool:
        """Backward raises VersionMismatch exactly as the model predicts (at the
        latest visited record that read a written storage); otherwise it returns
        the gradients of the unmodified program. Returns whether it raised."""
        model = self.model
        stale = [r for r in self.visited() if any(model.writes.get(sid) for sid, _ in r.reads)]
        if stale:
            first = stale[0]  # backward walks in reverse: the latest stale record raises
            with pytest.raises(rf.VersionMismatch) as info:
                self.tape.backward(self.loss)
            err = info.value
            assert err.op == first.name, f"expected {first.name}: {err}"
            allowed = {(gid, model.writes[sid]) for sid, gid in first.reads if model.writes.get(sid)}
            assert (err.grad_id, err.found) in allowed and err.expected == 0, (str(err), allowed)
            return True
        grads = self.tape.backward(self.loss)

        # records keep the immutable buffers they read, never a storage: the
        # gradient is exactly that of the unmodified program
        def oracle(*leaves):
            env = model.replay(leaves)
            return sum(jnp.sum(env[v.vid] * w) for v, w in zip(self.in_loss, self.weights))

        argnums = tuple(range(len(self.leaves)))
        want = jax.grad(oracle, argnums=argnums)(*(jnp.asarray(d) for d in self.leaf_data))
        for v, w in zip(self.leaves, want):
            np.testing.assert_allclose(np.asarray(grads[v.t]), np.asarray(w), rtol=1e-9, atol=1e-9)
        return False


def record_program(shape, seed, operands: str, body, choose_loss, positive=False) -> Program:
    """Record ``body(model, pool)`` on a tape. ``operands`` says what the pool
    starts with, in order: ``t`` a tracked leaf, ``c`` an untracked constant.
    ``choose_loss(tracked values)`` picks the values whose weighted sums make
    the loss (its records read no storage)."""
    rng = np.random.default_rng(seed)

    def sample():
        return rng.uniform(0.5, 2.0, shape) if positive else rng.standard_normal(shape)

    model = Model()
    leaf_data = []
    with rf.Tape() as tape:
        pool = []
        for kind in operands:
            if kind == "t":
                leaf_data.append(sample())
                pool.append(model.leaf(len(leaf_data) - 1, leaf_data[-1]))
            else:
                pool.append(model.const(sample()))
            pool[-1].positive = positive
        leaves = [v for v in pool if v.tracked]
        body(model, pool)
        in_loss = choose_loss([v for v in pool if v.tracked])
        weights = [jnp.asarray(rng.standard_normal(v.t.shape)) for v in in_loss]
        terms = [rf.sum(rf.mul(v.t, w)) for v, w in zip(in_loss, weights)]  # MulBackward reads w: an array
        loss = terms[0]
        for term in terms[1:]:
            loss = loss + term
    names = [e.op.name for e in tape.entries]
    assert names[: len(model.records)] == [r.name for r in model.records], "the model's records are off"
    for e in tape.entries[len(model.records) :]:  # the loss's own records
        model.records.append(Rec(e.op.name, e.outputs[0], tuple(i for i in e.inputs if i is not None), ()))
    return Program(model, tape, loss, leaves, leaf_data, in_loss, weights)


def check_inplace_versions(data, m: int, n: int, seed: int) -> bool:
    """A random program, random writes under no_grad; returns whether it raised."""

    def body(model: Model, pool: list[Val]) -> None:
        for _ in range(data.draw(st.integers(1, 6), label="length")):
            kind = data.draw(st.sampled_from(["unary", "binary", "view", "other"]), label="kind")

            def pick():
                return pool[data.draw(st.integers(0, len(pool) - 1), label="operand")]

            if kind == "unary":
                op, a = data.draw(st.sampled_from(sorted(_UNARY_C)), label="op"), pick()
                pool.append(model.unary("exp" if op == "log" and not a.positive else op, a))
            elif kind == "binary":
                op, a, b = data.draw(st.sampled_from(sorted(_BINARY_C)), label="op"), pick(), pick()
                pool.append(model.binary("mul" if op == "div" and not b.positive else op, a, b))
            elif kind == "view":
                pool.append(model.view(data.draw(st.sampled_from(["detach", "transpose_twice", "reshape"])), pick()))
            else:
                op = data.draw(st.sampled_from(["rowsum_add", "rowmean_mul", "gram", "mse_scale"]), label="op")
                args = [pick(), pick()] + ([pick()] if op in ("gram", "mse_scale") else [])
                pool.append(getattr(model, op)(*args))

    def choose_loss(tracked: list[Val]) -> list[Val]:
        if data.draw(st.booleans(), label="loss uses every tracked value"):
            return tracked
        picks = data.draw(st.lists(st.sampled_from(range(len(tracked))), min_size=1, max_size=3, unique=True))
        return [tracked[k] for k in picks]

    operands = "t" * data.draw(st.integers(1, 2), label="leaves") + "c" * data.draw(st.integers(0, 2), label="consts")
    prog = record_program((m, n), seed, operands, body, choose_loss)
    # writes to anything created (leaves, constants, outputs, intermediates,
    # views), directly or through a fresh view; often aimed at a storage that
    # some record, or some record backward will visit, reads
    for _ in range(data.draw(st.integers(0, 3), label="writes")):
        aim = data.draw(st.sampled_from(["anything", "read", "read by a visited record"]), label="aim")
        records = prog.model.records if aim == "read" else prog.visited()
        read = {sid for r in records for sid, _ in r.reads} if aim != "anything" else set()
        candidates = [v for v in prog.model.values if v.sid in read] or prog.model.values
        target = candidates[data.draw(st.integers(0, len(candidates) - 1), label="target")]
        prog.write(target, data.draw(st.sampled_from(_WRITES), label="how"))
    return prog.verify()


_INPLACE_ARGS = dict(
    data=st.data(), shape=st.sampled_from([(2, 3), (3, 2), (1, 4), (3, 3)]), seed=st.integers(0, 2**16)
)


def test_inplace_writes_raise_exactly_when_a_read_storage_changed():
    """Also checks that the deterministic profile exercises both outcomes."""
    outcomes = []

    @fuzz(100)
    @given(**_INPLACE_ARGS)
    def run(data, shape, seed):
        with jax.enable_x64(True):
            outcomes.append(check_inplace_versions(data, *shape, seed))

    run()
    if not LONG:
        raised = sum(outcomes)
        assert raised >= 15 and len(outcomes) - raised >= 15, f"{raised} of {len(outcomes)} raised"


@pytest.mark.fuzz_long
@long_fuzz()
@given(**_INPLACE_ARGS)
def test_inplace_writes_long(data, shape, seed):
    with jax.enable_x64(True):
        check_inplace_versions(data, *shape, seed)


# Exhaustively: every op of the model, every tracked (t) / constant (c) mix of
# its operands, one write to each storage the program created.

_SINGLE_OPS = (
    [("unary", op, 1) for op in sorted(_UNARY_C)]
    + [("binary", op, 2) for op in sorted(_BINARY_C)]
    + [("view", op, 1) for op in ("detach", "transpose_twice", "reshape")]
    + [("other", "rowsum_add", 2), ("other", "rowmean_mul", 2), ("other", "gram", 3), ("other", "mse_scale", 3)]
)
_SINGLE_CASES = [
    pytest.param(kind, op, "".join(mix), id=f"{op}-{''.join(mix)}")
    for kind, op, arity in _SINGLE_OPS
    for mix in itertools.product("tc", repeat=arity)
    if "t" in mix
]


@pytest.mark.parametrize("kind,op,operands", _SINGLE_CASES)
def test_each_record_reads_what_the_model_says(kind, op, operands):
    def body(model: Model, pool: list[Val]) -> None:
        args = list(pool)
        if kind == "view":
            pool.append(model.view(op, *args))
        elif kind in ("unary", "binary"):
            pool.append(getattr(model, kind)(op, *args))
        else:
            pool.append(getattr(model, op)(*args))

    def build():
        return record_program((2, 3), 0, operands, body, lambda tracked: tracked, positive=True)

    raised = []
    with jax.enable_x64(True):
        for target in range(len(build().model.values)):
            prog = build()
            prog.write(prog.model.values[target], "add_")
            raised.append(prog.verify())
        reads = {sid for r in build().model.records for sid, _ in r.reads}
    assert any(raised) == bool(reads)  # the op reads something exactly when some write raised
