"""The op table that drives the op test-suite (PyTorch OpInfo style).

Each entry: the rf op, an independent ``jax.numpy`` oracle with the same call
signature, a sample generator (odd, non-power-of-two shapes included), which
arguments are differentiable, and the record names the op may append.
Adding an op = one entry here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import rumus_fx as rf


@dataclasses.dataclass(frozen=True)
class Sample:
    args: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)
    diff: tuple[int, ...] = (0,)


@dataclasses.dataclass(frozen=True)
class OpInfo:
    name: str
    op: Callable
    ref: Callable
    samples: Callable[[np.random.Generator], list[Sample]]
    records: tuple[str, ...]
    # picks the differentiable output from the op's result (e.g. y of batch_norm)
    output: Callable[[Any], Any] = lambda out: out
    rtol32: float = 2e-5
    atol32: float = 2e-5
    fd_tol: float = 1e-6

    def __str__(self) -> str:
        return self.name


def ranked(f):
    """A jnp binary op with explicit rank alignment (the suite runs with
    jax_numpy_rank_promotion='raise')."""

    def g(a, b):
        nd = max(jnp.ndim(a), jnp.ndim(b))
        a = jnp.reshape(a, (1,) * (nd - jnp.ndim(a)) + jnp.shape(a))
        b = jnp.reshape(b, (1,) * (nd - jnp.ndim(b)) + jnp.shape(b))
        return f(a, b)

    return g


def normal(rng, *shape):
    return rng.standard_normal(shape)


def positive(rng, *shape):
    return rng.uniform(0.5, 2.0, shape)


def away_from_zero(rng, *shape):
    x = rng.standard_normal(shape)
    return np.where(np.abs(x) < 0.1, 0.5, x)


def _binary_samples(rng, positive_rhs=False):
    rhs = positive if positive_rhs else normal
    pairs = [((3, 5), (3, 5)), ((2, 3, 7), (3, 7)), ((4, 1, 3), (5, 1)), ((3,), (2, 3)), ((), (3, 2))]
    return [Sample((normal(rng, *a), rhs(rng, *b)), diff=(0, 1)) for a, b in pairs]


def _unary(shapes, gen=normal):
    return lambda rng: [Sample((gen(rng, *s),)) for s in shapes]


OPS: list[OpInfo] = [
    OpInfo("add", rf.add, ranked(jnp.add), lambda r: _binary_samples(r), ("AddBackward", "BroadcastAddBackward")),
    OpInfo("sub", rf.sub, ranked(jnp.subtract), lambda r: _binary_samples(r), ("SubBackward", "BroadcastSubBackward")),
    OpInfo("mul", rf.mul, ranked(jnp.multiply), lambda r: _binary_samples(r), ("MulBackward", "BroadcastMulBackward")),
    OpInfo("div", rf.div, ranked(jnp.divide), lambda r: _binary_samples(r, positive_rhs=True), ("DivBackward",)),
    OpInfo("neg", rf.neg, jnp.negative, _unary([(3, 5), (2, 3, 7)]), ("NegBackward",)),
    OpInfo("exp", rf.exp, jnp.exp, _unary([(3, 5), (2, 3, 7)]), ("ExpBackward",)),
    OpInfo("log", rf.log, jnp.log, _unary([(3, 5), (2, 3, 7)], positive), ("LogBackward",)),
    OpInfo(
        "sum",
        rf.sum,
        jnp.sum,
        lambda r: [
            Sample((normal(r, 3, 5),)),
            Sample((normal(r, 2, 3, 7),), {"axis": 1}),
            Sample((normal(r, 2, 3, 7),), {"axis": (0, 2), "keepdims": True}),
            Sample((normal(r, 4, 6),), {"axis": -1}),
        ],
        ("SumBackward",),
    ),
    OpInfo(
        "mean",
        rf.mean,
        jnp.mean,
        lambda r: [
            Sample((normal(r, 3, 5),)),
            Sample((normal(r, 2, 3, 7),), {"axis": 1}),
            Sample((normal(r, 2, 3, 7),), {"axis": (0, 2), "keepdims": True}),
        ],
        ("MeanBackward",),
    ),
    OpInfo(
        "matmul",
        rf.matmul,
        jnp.matmul,
        lambda r: [
            Sample((normal(r, 3, 5), normal(r, 5, 7)), diff=(0, 1)),
            Sample((normal(r, 1, 4), normal(r, 4, 1)), diff=(0, 1)),
            Sample((normal(r, 2, 3, 5), normal(r, 5, 6)), diff=(0, 1)),
        ],
        ("MatmulBackward",),
    ),
    OpInfo("relu", rf.relu, jax.nn.relu, _unary([(3, 5), (2, 3, 7)], away_from_zero), ("ReluBackward",)),
    OpInfo(
        "mse_loss",
        rf.mse_loss,
        lambda p, t: jnp.mean((p - t) ** 2),
        lambda r: [
            Sample((normal(r, 3, 5), normal(r, 3, 5)), diff=(0, 1)),
            Sample((normal(r, 7), normal(r, 7)), diff=(0, 1)),
        ],
        ("MseLossBackward",),
    ),
    OpInfo(
        "add_bias",
        rf.add_bias,
        lambda m, b: m + b[None, :] if m.ndim == 2 else m + b.reshape((1,) * (m.ndim - 1) + b.shape),
        lambda r: [
            Sample((normal(r, 3, 5), normal(r, 5)), diff=(0, 1)),
            Sample((normal(r, 2, 3, 5), normal(r, 5)), diff=(0, 1)),
        ],
        ("AddBiasBackward",),
    ),
    OpInfo(
        "reshape",
        lambda x, shape: rf.reshape(x, shape),
        lambda x, shape: jnp.reshape(x, shape),
        lambda r: [
            Sample((normal(r, 3, 5), (5, 3))),
            Sample((normal(r, 2, 3, 7), (6, -1))),
            Sample((normal(r, 6, 5), (2, 3, 5))),
        ],
        ("ReshapeBackward",),
    ),
    OpInfo(
        "flatten",
        rf.flatten,
        lambda x: jnp.reshape(x, (x.shape[0], -1)),
        _unary([(3, 5), (2, 3, 7), (2, 3, 2, 5)]),
        ("FlattenBackward",),
    ),
    OpInfo(
        "transpose",
        rf.transpose,
        jnp.swapaxes,
        lambda r: [
            Sample((normal(r, 3, 5), 0, 1)),
            Sample((normal(r, 2, 3, 7), 0, 2)),
            Sample((normal(r, 2, 3, 7), -1, 1)),
        ],
        ("TransposeBackward",),
    ),
]


def by_name(name: str) -> OpInfo:
    for info in OPS:
        if info.name == name:
            return info
    raise KeyError(name)
