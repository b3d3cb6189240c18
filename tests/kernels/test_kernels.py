"""Every kernel entry point in interpret mode against the reference mode, odd
shapes included: outputs, forward-mode tangents (``jax.jvp``, the custom_jvp
rules of forward AND backward kernels), reverse-mode gradients (``jax.grad``
transposes those rules), ``vmap`` and ``jit``; and the traced program holds a
``pallas_call`` only in interpret mode.

Interpret mode is a sequential loop compiled by XLA: shapes stay small, and a
few cases also run with the TPU block shapes (one chunk per row).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf
from rumus_fx.kernels import (
    attention,
    batch_norm,
    blocks,
    cross_entropy,
    dispatch,
    embedding,
    layer_norm,
    matmul,
    softmax,
)

from ._jaxpr import has_pallas

TOL = dict(rtol=2e-5, atol=2e-5)


@dataclasses.dataclass
class Case:
    """``fun(*args)`` through dispatch; ``diff`` are the float arguments whose
    tangents/gradients are checked (the others are held fixed)."""

    name: str
    fun: Callable
    args: tuple
    diff: tuple[int, ...]
    tol: dict = dataclasses.field(default_factory=lambda: TOL)

    def __str__(self) -> str:
        return self.name


def _rng(name: str):
    return np.random.default_rng(zlib.crc32(name.encode()))


def normal(rng, *shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _softmax(name, shape, axis):
    r = _rng(name)
    x = normal(r, *shape) * 3
    y = softmax.softmax_reference(x, axis=axis)
    yield Case(name, functools.partial(softmax.softmax_fwd, axis=axis), (x,), (0,))
    yield Case(name + "_bwd", functools.partial(softmax.softmax_bwd, axis=axis), (y, normal(r, *shape)), (0, 1))


def _layer_norm(name, shape, affine):
    r = _rng(name)
    d = shape[-1]
    x = normal(r, *shape) * 2 + 1
    w, b = (normal(r, d), normal(r, d)) if affine else (None, None)
    _, mean, rstd = layer_norm.layer_norm_fwd_reference(x, w, b, eps=1e-5)
    g = normal(r, *shape)
    fwd = functools.partial(layer_norm.layer_norm_fwd, eps=1e-5)
    bwd = functools.partial(layer_norm.layer_norm_bwd, has_bias=affine)
    if affine:
        yield Case(name, fwd, (x, w, b), (0, 1, 2))
        yield Case(name + "_bwd", bwd, (x, w, mean, rstd, g), (0, 1, 2, 3, 4))
    else:
        yield Case(name, lambda x: fwd(x, None, None), (x,), (0,))
        yield Case(name + "_bwd", lambda x, m, s, g: bwd(x, None, m, s, g), (x, mean, rstd, g), (0, 1, 2, 3))


def _batch_norm(name, shape, affine):
    r = _rng(name)
    c = shape[1]
    x = normal(r, *shape) * 2 + 1
    w, b = (normal(r, c), normal(r, c)) if affine else (None, None)
    _, mean, _, rstd = batch_norm.batch_norm_train_reference(x, w, b, eps=1e-5)
    g = normal(r, *shape)
    fwd = functools.partial(batch_norm.batch_norm_train_fwd, eps=1e-5)
    bwd = functools.partial(batch_norm.batch_norm_train_bwd, has_bias=affine)
    if affine:
        yield Case(name, fwd, (x, w, b), (0, 1, 2))
        yield Case(name + "_bwd", bwd, (x, w, mean, rstd, g), (0, 1, 2, 3, 4))
    else:
        yield Case(name, lambda x: fwd(x, None, None), (x,), (0,))
        yield Case(name + "_bwd", lambda x, m, s, g: bwd(x, None, m, s, g), (x, mean, rstd, g), (0, 1, 2, 3))


def _cross_entropy(name, n, c, ignore):
    r = _rng(name)
    logits = normal(r, n, c) * 3
    targets = jnp.asarray(r.integers(0, c, n), jnp.int32)
    if ignore is not None:
        targets = targets.at[0].set(ignore)
    yield Case(name, functools.partial(cross_entropy.cross_entropy_fwd, ignore_index=ignore), (logits, targets), (0,))


def _matmul(name, sa, sb, fun):
    r = _rng(name)
    yield Case(name, fun, (normal(r, *sa), normal(r, *sb)), (0, 1))


def _attention(name, lead, sq, sk, d, dv, causal):
    r = _rng(name)
    q, k, v = normal(r, *lead, sq, d), normal(r, *lead, sk, d), normal(r, *lead, sk, dv)
    scale = d**-0.5
    out, lse = attention.attention_fwd_reference(q, k, v, None, causal=causal, scale=scale)
    g = normal(r, *lead, sq, dv)
    fwd = lambda q, k, v: attention.attention_fwd(q, k, v, None, causal=causal, scale=scale)  # noqa: E731

    def bwd(q, k, v, out, lse, g):
        return attention.attention_bwd(q, k, v, None, out, lse, g, causal=causal, scale=scale)[:3]

    yield Case(name, fwd, (q, k, v), (0, 1, 2))
    yield Case(name + "_bwd", bwd, (q, k, v, out, lse, g), (0, 1, 2, 3, 4, 5))


def _embedding(name, n, vocab, d):
    r = _rng(name)
    idx = jnp.asarray(r.integers(0, vocab + 1, n), jnp.int32)  # vocab means "drop"
    fun = functools.partial(embedding.embedding_bwd, vocab_size=vocab)
    yield Case(name, fun, (idx, normal(r, n, d)), (1,))


class LazyCase:
    """A Case whose arrays are made when a test first reads it, not at collection (the
    references that make them run eagerly: seconds for the whole list)."""

    def __init__(self, name: str, build: Callable[[], dict[str, Case]]):
        self.name = name
        self._build = build

    def __getattr__(self, attr: str):
        return getattr(self._build()[self.name], attr)

    def __str__(self) -> str:
        return self.name


def _lazy(gen: Callable, name: str, *params) -> list[LazyCase]:
    """The cases ``gen(name, *params)`` yields (``name``, and ``name + "_bwd"`` for the
    kernels with a backward entry point), built on first use."""
    names = (name, name + "_bwd") if gen in (_softmax, _layer_norm, _batch_norm, _attention) else (name,)
    build = functools.cache(lambda: {c.name: c for c in gen(name, *params)})
    return [LazyCase(n, build) for n in names]


CASES = [
    *_lazy(_softmax, "softmax_rows", (3, 5), -1),
    *_lazy(_softmax, "softmax_axis1_multichunk", (2, 1100, 3), 1),
    *_lazy(_layer_norm, "layer_norm", (2, 3, 37), True),
    *_lazy(_layer_norm, "layer_norm_plain_multichunk", (5, 1030), False),
    *_lazy(_batch_norm, "batch_norm", (3, 5, 4, 7), True),
    *_lazy(_batch_norm, "batch_norm_plain_chunks", (2, 3, 23, 25), False),
    *_lazy(_cross_entropy, "cross_entropy", 7, 11, None),
    *_lazy(_cross_entropy, "cross_entropy_ignore_multichunk", 5, 1500, 3),
    *_lazy(_matmul, "matmul_lead", (2, 3, 17), (17, 9), matmul.matmul),
    *_lazy(_matmul, "matmul_k_loop", (20, 130), (130, 140), matmul.matmul),
    *_lazy(_matmul, "bmm", (2, 3, 7, 5), (2, 3, 5, 6), matmul.bmm),
    *_lazy(_attention, "attention", (2,), 9, 13, 8, 6, False),
    *_lazy(_attention, "attention_causal_blocks", (1,), 150, 140, 8, 8, True),
    *_lazy(_attention, "attention_causal_keys_past_queries", (1,), 20, 200, 8, 8, True),
    *_lazy(_embedding, "embedding_bwd", 150, 37, 5),
    *_lazy(_embedding, "embedding_bwd_many_chunks", 700, 300, 9),
]


def _cotangents(out, seed=1):
    r = np.random.default_rng(seed)
    return jax.tree.map(lambda o: jnp.asarray(r.standard_normal(o.shape), o.dtype), out)


def _split(case: Case):
    """(float args to differentiate, f(*diff_args) with the rest closed over)."""

    def f(*diff_args):
        args = list(case.args)
        for i, a in zip(case.diff, diff_args):
            args[i] = a
        return case.fun(*args)

    return tuple(case.args[i] for i in case.diff), f


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_tangents_gradients(case: Case):
    primals, f = _split(case)
    tangents = _cotangents(primals, seed=2)
    with rf.kernels.use("reference"):
        want = case.fun(*case.args)
        # the references compiled (eagerly each of their primitives compiles on its own)
        want_jvp = jax.jit(lambda p, t: jax.jvp(f, p, t))(primals, tangents)
        ct = _cotangents(want)
        loss = lambda *a: sum(jnp.sum(o * c) for o, c in zip(jax.tree.leaves(f(*a)), jax.tree.leaves(ct)))  # noqa: E731
        want_grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(primals)))))(*primals)
    with rf.kernels.use("interpret"):
        assert has_pallas(case.fun, *case.args)
        chex.assert_trees_all_close(case.fun(*case.args), want, **case.tol)
        chex.assert_trees_all_close(jax.jvp(f, primals, tangents), want_jvp, **case.tol)
        got_grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(primals)))))(*primals)
        chex.assert_trees_all_close(got_grad, want_grad, **case.tol)
    with rf.kernels.use("reference"):
        assert not has_pallas(case.fun, *case.args)


VMAP_CASES = [
    c
    for c in CASES
    if c.name
    in ("softmax_rows", "layer_norm_bwd", "batch_norm", "matmul_lead", "attention_causal_blocks", "embedding_bwd")
]


@pytest.mark.parametrize("case", VMAP_CASES, ids=str)
def test_vmap(case: Case):
    """vmap over a new leading axis of the differentiated arguments (Pallas
    batches the kernel by adding a grid axis)."""
    primals, f = _split(case)
    stacked = jax.tree.map(lambda a: jnp.stack([a, a * 0.5 + 0.25]), primals)
    with rf.kernels.use("reference"):
        want = jax.vmap(f)(*stacked)
    with rf.kernels.use("interpret"):
        got = jax.jit(jax.vmap(f))(*stacked)
    chex.assert_trees_all_close(got, want, **TOL)


@pytest.mark.parametrize(
    "name",
    [
        "softmax_axis1_multichunk",
        "layer_norm_plain_multichunk_bwd",
        "cross_entropy_ignore_multichunk",
        "matmul_k_loop",
        "bmm",
        "attention_causal_blocks",
        "attention_causal_blocks_bwd",
        "attention_causal_keys_past_queries_bwd",
        "attention_bwd",
        "embedding_bwd_many_chunks",
        "batch_norm_plain_chunks",
        "batch_norm_plain_chunks_bwd",
    ],
)
def test_tpu_block_shapes_in_interpret_mode(name):
    """The same kernels with the TPU target's blocks and grids (whole rows; K,
    key/query blocks and lookup chunks as sequential grid axes)."""
    (case,) = [c for c in CASES if c.name == name]
    with rf.kernels.use("reference"):
        want = case.fun(*case.args)
    with rf.kernels.use("interpret"), dispatch.interpret_target(blocks.TPU):
        got = case.fun(*case.args)
    chex.assert_trees_all_close(got, want, **TOL)


ROWS_ON_THE_GRID = [
    *_lazy(_softmax, "softmax_wide_rows", (3, 700), -1),
    *_lazy(_layer_norm, "layer_norm_wide_rows", (4, 650), True),
    *_lazy(_layer_norm, "layer_norm_plain_wide_rows", (4, 650), False),
    *_lazy(_cross_entropy, "cross_entropy_wide_rows", 5, 600, 2),
]


@pytest.mark.parametrize("case", ROWS_ON_THE_GRID, ids=str)
def test_tpu_rows_on_the_grid_in_interpret_mode(case, monkeypatch):
    """TPU rows wider than one block (32768 columns) are visited in chunks on the
    grid (pass, chunk); narrower limits here put these small rows there (shapes
    no other test uses, since the kernels' jit caches do not see the limits)."""
    monkeypatch.setattr(blocks, "TPU_MAX_ROW", 256)
    monkeypatch.setattr(blocks, "TPU_ROW_CHUNK", 256)
    assert blocks.row_blocks(5, 600, blocks.TPU).on_grid
    with rf.kernels.use("reference"):
        want = case.fun(*case.args)
    with rf.kernels.use("interpret"), dispatch.interpret_target(blocks.TPU):
        got = case.fun(*case.args)
    chex.assert_trees_all_close(got, want, **TOL)


def test_bfloat16_inputs_accumulate_in_float32():
    r = np.random.default_rng(0)
    a, b = normal(r, 33, 70, dtype=jnp.bfloat16), normal(r, 70, 20, dtype=jnp.bfloat16)
    x = normal(r, 4, 300, dtype=jnp.bfloat16)
    with rf.kernels.use("interpret"):
        got = (
            matmul.matmul(a, b),
            matmul.matmul(a, b, out_dtype=jnp.float32),
            layer_norm.layer_norm_fwd(x, None, None),
        )
    with rf.kernels.use("reference"):
        want = (
            matmul.matmul(a, b),
            matmul.matmul(a, b, out_dtype=jnp.float32),
            layer_norm.layer_norm_fwd(x, None, None),
        )
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32 and got[2][1].dtype == jnp.float32
    chex.assert_trees_all_close(got[1], want[1], rtol=1e-5, atol=1e-4)
    chex.assert_trees_all_close(
        jax.tree.map(lambda t: t.astype(jnp.float32), (got[0], got[2])),
        jax.tree.map(lambda t: t.astype(jnp.float32), (want[0], want[2])),
        rtol=2e-2,
        atol=2e-2,
    )


def test_explicit_masks_fall_back_to_the_reference():
    r = np.random.default_rng(0)
    q = normal(r, 2, 4, 8)
    mask = jnp.asarray(r.random((2, 4, 4)) > 0.3) | jnp.eye(4, dtype=bool)[None]
    with rf.kernels.use("interpret"):
        assert not has_pallas(lambda q: attention.attention_fwd(q, q, q, mask, scale=0.3), q)
        assert has_pallas(lambda q: attention.attention_fwd(q, q, q, None, scale=0.3), q)
