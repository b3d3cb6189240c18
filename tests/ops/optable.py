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
    # pytest marks for every case of this op (e.g. ``(pytest.mark.slow,)``)
    marks: tuple[Any, ...] = ()

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


# -- oracles for the vision, normalisation and sequence ops (plain jnp / lax) --


def ref_layer_norm(x, w=None, b=None, eps=1e-5):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    y = (x - mean) / jnp.sqrt(var + eps)
    lead = (1,) * (x.ndim - 1)
    if w is not None:
        y = y * w.reshape(lead + w.shape)
    if b is not None:
        y = y + b.reshape(lead + b.shape)
    return y


def ref_batch_norm(x, w, b, rm, rv, *, training, momentum=0.1, eps=1e-5):
    c = lambda v: v.reshape(1, -1, 1, 1)  # noqa: E731
    if training:
        mean = jnp.mean(x, axis=(0, 2, 3))
        var = jnp.var(x, axis=(0, 2, 3))
    else:
        mean, var = rm, rv
    y = (x - c(mean)) / jnp.sqrt(c(var) + eps) * c(w) + c(b)
    if training:
        return y, (1 - momentum) * rm + momentum * mean, (1 - momentum) * rv + momentum * var
    return y, rm, rv


def ref_cross_entropy(logits, targets, ignore_index=None):
    logp = jax.nn.log_softmax(logits, axis=-1)
    valid = jnp.ones(targets.shape, bool) if ignore_index is None else targets != ignore_index
    safe = jnp.where(valid, targets, 0)
    picked = jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]
    return -jnp.sum(jnp.where(valid, picked, 0)) / jnp.sum(valid).astype(picked.dtype)


def ref_im2col(x, k, stride=1, padding=0):
    single = x.ndim == 3
    xb = x[None] if single else x.reshape((-1,) + x.shape[-3:])
    p = jax.lax.conv_general_dilated_patches(xb, (k, k), (stride, stride), [(padding, padding)] * 2)
    out = p.reshape(p.shape[0], p.shape[1], -1)
    return out[0] if single else out.reshape(x.shape[:-3] + out.shape[1:])


def ref_conv2d(x, w, b=None, stride=1, padding=0):
    y = jax.lax.conv_general_dilated(x, w, (stride, stride), [(padding, padding)] * 2)
    return y if b is None else y + b.reshape(1, -1, 1, 1)


def ref_max_pool2d(x, k, stride=None, padding=0):
    s = k if stride is None else stride
    nd = x.ndim
    pads = [(0, 0)] * (nd - 2) + [(padding, padding)] * 2
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1,) * (nd - 2) + (k, k), (1,) * (nd - 2) + (s, s), pads)


def ref_adaptive_avg_pool2d(x, out):
    oh, ow = (out, out) if isinstance(out, int) else out
    h, w = x.shape[-2:]
    rows = []
    for i in range(oh):
        h0, h1 = (i * h) // oh, -((-(i + 1) * h) // oh)
        cols = []
        for j in range(ow):
            w0, w1 = (j * w) // ow, -((-(j + 1) * w) // ow)
            cols.append(jnp.mean(x[..., h0:h1, w0:w1], axis=(-2, -1)))
        rows.append(jnp.stack(cols, axis=-1))
    return jnp.stack(rows, axis=-2)


def ref_attention(q, k, v, mask=None, causal=False):
    s = jnp.einsum("...qd,...kd->...qk", q, k) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf) if mask.dtype == bool else s + mask
    if causal:
        sq, sk = s.shape[-2:]
        s = jnp.where(np.tril(np.ones((sq, sk), bool)), s, -jnp.inf)
    return jnp.einsum("...qk,...kd->...qd", jax.nn.softmax(s, axis=-1), v)


def ref_dropout(x, p, key, training=True):
    if not training:
        return x
    keep = jax.random.bernoulli(key, 1.0 - p, x.shape)
    return jnp.where(keep, x / (1.0 - p), 0.0)


def _bn_samples(training):
    def gen(r):
        out = []
        for shape in [(3, 4, 5, 3), (2, 3, 1, 7)]:
            c = shape[1]
            out.append(
                Sample(
                    (normal(r, *shape), positive(r, c), normal(r, c), normal(r, c) * 0.1, positive(r, c)),
                    {"training": training},
                    diff=(0, 1, 2) if training else (0, 1, 2, 3, 4),
                )
            )
        return out

    return gen


OPS += [
    OpInfo("sigmoid", rf.sigmoid, jax.nn.sigmoid, _unary([(3, 5), (2, 3, 7)]), ("SigmoidBackward",)),
    OpInfo("tanh", rf.tanh, jnp.tanh, _unary([(3, 5), (2, 3, 7)]), ("TanhBackward",)),
    OpInfo(
        "gelu",
        rf.gelu,
        jax.nn.gelu,
        lambda r: [
            Sample((normal(r, 3, 5),)),
            Sample((normal(r, 2, 3, 7),), {"approximate": False}),
            Sample((normal(r, 4, 6),), {"approximate": True}),
        ],
        ("GeluBackward",),
    ),
    OpInfo(
        "leaky_relu",
        rf.leaky_relu,
        lambda x, alpha=0.01: jax.nn.leaky_relu(x, alpha),
        lambda r: [Sample((away_from_zero(r, 3, 5),)), Sample((away_from_zero(r, 2, 3, 7), 0.2))],
        ("LeakyReluBackward",),
    ),
    OpInfo(
        "softmax",
        rf.softmax,
        jax.nn.softmax,
        lambda r: [
            Sample((normal(r, 3, 5),)),
            Sample((normal(r, 2, 3, 7),), {"axis": 1}),
            Sample((normal(r, 2, 3, 7) * 5,), {"axis": 0}),
        ],
        ("SoftmaxBackward",),
    ),
    OpInfo(
        "layer_norm",
        rf.layer_norm,
        ref_layer_norm,
        lambda r: [
            Sample((normal(r, 3, 5), positive(r, 5), normal(r, 5)), diff=(0, 1, 2)),
            Sample((normal(r, 2, 3, 7), positive(r, 7), normal(r, 7)), diff=(0, 1, 2)),
            Sample((normal(r, 2, 2, 3, 6),), diff=(0,)),
            Sample((normal(r, 4, 6), positive(r, 6), None, 1e-3), diff=(0, 1)),
        ],
        ("LayerNormBackward",),
        rtol32=1e-4,
        atol32=1e-4,
    ),
    OpInfo(
        "batch_norm_2d_train",
        rf.batch_norm_2d,
        ref_batch_norm,
        _bn_samples(True),
        ("BatchNorm2dBackward",),
        output=lambda out: out[0],
        rtol32=1e-4,
        atol32=1e-4,
    ),
    OpInfo(
        "batch_norm_2d_eval",
        rf.batch_norm_2d,
        ref_batch_norm,
        _bn_samples(False),
        ("BatchNorm2dBackward",),
        output=lambda out: out[0],
        rtol32=1e-4,
        atol32=1e-4,
    ),
    OpInfo(
        "cross_entropy",
        rf.cross_entropy,
        ref_cross_entropy,
        lambda r: [
            Sample((normal(r, 6, 5), r.integers(0, 5, (6,))), diff=(0,)),
            Sample((normal(r, 2, 3, 7), r.integers(0, 7, (2, 3))), diff=(0,)),
            Sample(
                (normal(r, 7, 4), np.array([0, 3, -100, 1, 2, -100, 3])),
                {"ignore_index": -100},
                diff=(0,),
            ),
        ],
        ("CrossEntropyBackward",),
    ),
    OpInfo(
        "im2col",
        rf.im2col,
        ref_im2col,
        lambda r: [
            Sample((normal(r, 2, 5, 6), 3)),
            Sample((normal(r, 2, 3, 7, 5), 3, 2, 1)),
            Sample((normal(r, 1, 2, 6, 6), 2, 2)),
            Sample((normal(r, 3, 5, 5), 3, 1, 1)),
        ],
        ("Im2ColBackward",),
    ),
    OpInfo(
        "conv2d",
        rf.conv2d,
        ref_conv2d,
        lambda r: [
            Sample((normal(r, 2, 3, 7, 6), normal(r, 4, 3, 3, 3), normal(r, 4)), diff=(0, 1, 2)),
            Sample((normal(r, 2, 3, 7, 8), normal(r, 5, 3, 3, 3), None, 2, 1), diff=(0, 1)),
            Sample((normal(r, 1, 2, 6, 5), normal(r, 3, 2, 2, 2), normal(r, 3), 3, 0), diff=(0, 1, 2)),
            Sample((normal(r, 2, 1, 5, 5), normal(r, 2, 1, 5, 5), None, 1, 2), diff=(0, 1)),
        ],
        ("Conv2dBackward",),
        rtol32=1e-4,
        atol32=1e-4,
    ),
    OpInfo(
        "add_channel_bias",
        rf.add_channel_bias,
        lambda x, b: x + b.reshape((1,) * (x.ndim - 2) + (-1, 1)),
        lambda r: [
            Sample((normal(r, 3, 5), normal(r, 3)), diff=(0, 1)),
            Sample((normal(r, 2, 4, 7), normal(r, 4)), diff=(0, 1)),
        ],
        ("AddChannelBiasBackward",),
    ),
    OpInfo(
        "max_pool2d",
        rf.max_pool2d,
        ref_max_pool2d,
        lambda r: [
            Sample((normal(r, 2, 3, 6, 7), 2)),
            Sample((normal(r, 2, 3, 7, 5), 3, 2)),  # overlapping windows
            Sample((normal(r, 3, 5, 6), 3, 1, 1)),  # unbatched, padded
            Sample((normal(r, 1, 2, 7, 7), 2, 3)),  # stride > kernel
        ],
        ("MaxPool2dBackward",),
    ),
    OpInfo(
        "adaptive_avg_pool2d",
        rf.adaptive_avg_pool2d,
        ref_adaptive_avg_pool2d,
        lambda r: [
            Sample((normal(r, 2, 3, 7, 5), 3)),
            Sample((normal(r, 2, 3, 5, 6), (2, 4))),
            Sample((normal(r, 3, 4, 4), 1)),
            Sample((normal(r, 1, 2, 3, 5), (5, 7))),  # bins overlap when upsampling
        ],
        ("AdaptiveAvgPool2dBackward",),
    ),
    OpInfo(
        "stack",
        lambda a, b, c, axis=0: rf.stack([a, b, c], axis=axis),
        lambda a, b, c, axis=0: jnp.stack([a, b, c], axis=axis),
        lambda r: [
            Sample((normal(r, 3, 5), normal(r, 3, 5), normal(r, 3, 5)), diff=(0, 1, 2)),
            Sample((normal(r, 2, 3), normal(r, 2, 3), normal(r, 2, 3)), {"axis": -1}, diff=(0, 2)),
        ],
        ("StackBackward",),
    ),
    OpInfo(
        "slice_batch",
        rf.slice_batch,
        lambda x, i: x[i],
        lambda r: [Sample((normal(r, 4, 3, 5), 2)), Sample((normal(r, 3, 5), -1)), Sample((normal(r, 5, 2), 0))],
        ("SliceBatchBackward",),
    ),
    OpInfo(
        "index",
        rf.index,
        lambda x, key: x[key],
        lambda r: [
            Sample((normal(r, 4, 5), (slice(1, None), 2))),
            Sample((normal(r, 3, 4, 5), (Ellipsis, np.array([0, 2, 2, 4])))),  # repeats accumulate
            Sample((normal(r, 6, 3), (np.array([[5, 0], [0, 1]]), None, slice(None, None, 2)))),
            Sample((normal(r, 3, 5), -1)),
        ],
        ("IndexBackward",),
    ),
    OpInfo(
        "bmm",
        rf.bmm,
        jnp.matmul,
        lambda r: [
            Sample((normal(r, 3, 4, 5), normal(r, 3, 5, 2)), diff=(0, 1)),
            Sample((normal(r, 2, 3, 4, 5), normal(r, 2, 3, 5, 7)), diff=(0, 1)),
        ],
        ("BmmBackward",),
    ),
    OpInfo(
        "embedding",
        rf.embedding,
        lambda idx, w: jnp.take(w, idx, axis=0),
        lambda r: [
            Sample((r.integers(0, 7, (5,)), normal(r, 7, 3)), diff=(1,)),
            Sample((r.integers(0, 5, (2, 6)), normal(r, 5, 4)), diff=(1,)),
            Sample((np.array([[1, 1], [1, 3]]), normal(r, 4, 3)), diff=(1,)),  # repeated rows accumulate
        ],
        ("EmbeddingBackward",),
    ),
    OpInfo(
        "dropout",
        rf.dropout,
        ref_dropout,
        lambda r: [
            Sample((normal(r, 6, 7), 0.3, jax.random.key(1))),
            Sample((normal(r, 2, 3, 5), 0.5, jax.random.key(2))),
        ],
        ("DropoutBackward",),
    ),
    OpInfo(
        "scaled_dot_product_attention",
        rf.scaled_dot_product_attention,
        ref_attention,
        lambda r: [
            Sample((normal(r, 2, 5, 3), normal(r, 2, 7, 3), normal(r, 2, 7, 4)), diff=(0, 1, 2)),
            Sample(
                (normal(r, 2, 2, 6, 4), normal(r, 2, 2, 6, 4), normal(r, 2, 2, 6, 4)), {"causal": True}, diff=(0, 1, 2)
            ),
            Sample(
                (
                    normal(r, 3, 5, 4),
                    normal(r, 3, 5, 4),
                    normal(r, 3, 5, 4),
                    (r.uniform(size=(5, 5)) > 0.3) | np.eye(5, dtype=bool),
                ),
                diff=(0, 1, 2),
            ),
            Sample((normal(r, 4, 3), normal(r, 5, 3), normal(r, 5, 2), normal(r, 4, 5)), diff=(0, 1, 2, 3)),
        ],
        ("ScaledDotProductAttentionBackward",),
        rtol32=1e-4,
        atol32=1e-4,
    ),
]


def by_name(name: str) -> OpInfo:
    for info in OPS:
        if info.name == name:
            return info
    raise KeyError(name)
