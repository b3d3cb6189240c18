"""Sharded checks, run in a subprocess with 8 host CPU devices (see
tests/test_sharding.py): ``python -m tests._sharded_cases GROUP [GROUP ...]``.

Every case is one scalar loss written with rf ops, its jax.numpy oracle, the
arguments and a ``PartitionSpec`` per argument. Each case runs

* on one device (the reference gradients, also checked against ``jax.grad`` of the oracle),
* inside ``jax.jit`` on meshes with Explicit axes (``jax.make_mesh``'s default) and
  with Auto axes, each with and without ``jax.set_mesh``,

and checks that the sharded loss and gradients equal the one-device ones and that
every gradient has its argument's sharding. Groups: ``ops`` (data parallel, batch on
"data"), ``ops_tp`` (tensor parallel on a 2x4 ("data", "model") mesh), ``kernels``
(the same with the Pallas kernels in interpret mode), ``models_dp``
(MLP, CNN, TransformerBlock, TinyGPT data parallel), ``models_tp`` (the same
tensor parallel, and FSDP), ``lift`` / ``lift_tp`` (the primitive rules of ``rf.lift``:
``rf.grad(rf.lift(f))`` of plain jnp/lax code, compared with ``jax.grad(f)``; one case
per family, ``lift_slow`` adds variants) and
``errors`` (``rf.ShardingError``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.pop("RUMUS_FX_KERNELS", None)

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import rumus_fx as rf
import rumus_fx.numpy as rnp
from tests.ops.optable import (
    ref_adaptive_avg_pool2d,
    ref_attention,
    ref_batch_norm,
    ref_conv2d,
    ref_cross_entropy,
    ref_dropout,
    ref_im2col,
    ref_layer_norm,
    ref_max_pool2d,
)

RNG = np.random.default_rng(0)
KEY = jax.random.key(3)


def f32(*shape: int, scale: float = 1.0) -> jax.Array:
    return jnp.asarray(RNG.standard_normal(shape) * scale, jnp.float32)


def pos(*shape: int) -> jax.Array:
    return jnp.asarray(RNG.uniform(0.5, 2.0, shape), jnp.float32)


def sq(t: Any) -> Any:
    return t * t


def ints(high: int, *shape: int) -> jax.Array:
    return jnp.asarray(RNG.integers(0, high, shape), jnp.int32)


@dataclasses.dataclass
class Case:
    name: str
    rf_loss: Callable[..., Any]
    ref_loss: Callable[..., Any]
    args: tuple
    specs: tuple  # one PartitionSpec per argument
    argnums: tuple[int, ...] = (0,)
    tol: float = 1e-5
    every_setting: bool = False  # run all four settings by default too (a regression case)


# ---------------------------------------------------------------------------
# op cases: data parallel (batch axis on "data")
# ---------------------------------------------------------------------------

D = P("data")
R = P()
B = 16  # two rows per device


def op_cases() -> list[Case]:
    x, y, bias = f32(B, 6), pos(B, 6), f32(6)
    x3 = f32(B, 3, 5)
    img, conv_w, conv_b = f32(B, 3, 6, 6), f32(4, 3, 3, 3, scale=0.3), f32(4)
    q, k, v = f32(B, 2, 5, 4), f32(B, 2, 5, 4), f32(B, 2, 5, 4)
    mask = jnp.asarray((RNG.uniform(size=(5, 5)) > 0.3) | np.eye(5, dtype=bool))
    tok, table = ints(7, B, 3), f32(7, 4)
    logits, labels = f32(B, 5), ints(5, B)
    labels_ign = labels.at[::3].set(-100)
    lw, lb = pos(5), f32(5)
    bn = (pos(3), f32(3), f32(3, scale=0.1), pos(3))
    proj = f32(B, 6)

    cases = [
        Case("add", lambda a, b: rf.sum(rf.tanh(a + b)), lambda a, b: jnp.sum(jnp.tanh(a + b)), (x, y), (D, D), (0, 1)),
        Case(
            "sub_mul_div",
            lambda a, b: rf.sum((a - b) * a / b),
            lambda a, b: jnp.sum((a - b) * a / b),
            (x, y),
            (D, D),
            (0, 1),
        ),
        Case(
            "broadcast_add_bias",
            lambda a, b: rf.sum(rf.tanh(a + b) * a),
            lambda a, b: jnp.sum(jnp.tanh(a + b) * a),
            (x, bias),
            (D, R),
            (0, 1),
        ),
        Case("broadcast_mul", lambda a, b: rf.sum(a * b), lambda a, b: jnp.sum(a * b[None]), (x, bias), (D, R), (0, 1)),
        Case(
            "neg_exp_log",
            lambda a, b: rf.sum(rf.log(rf.exp(-a) + b)),
            lambda a, b: jnp.sum(jnp.log(jnp.exp(-a) + b)),
            (x, y),
            (D, D),
            (0, 1),
        ),
        Case(
            "add_bias",
            lambda a, b: rf.sum(rf.relu(rf.add_bias(a, b)) * proj),
            lambda a, b: jnp.sum(jax.nn.relu(a + b[None]) * proj),
            (x, bias),
            (D, R),
            (0, 1),
        ),
        Case(
            "add_channel_bias",
            lambda a, b: rf.sum(rf.tanh(rf.add_channel_bias(a, b))),
            lambda a, b: jnp.sum(jnp.tanh(a + b[None, :, None])),
            (x3, f32(3)),
            (D, R),
            (0, 1),
        ),
        Case(
            "sum_mean_axes",
            lambda a: rf.sum(sq(rf.mean(a, axis=0))) + rf.sum(sq(rf.sum(a, axis=1, keepdims=True))) + rf.mean(a * a),
            lambda a: (
                jnp.sum(sq(jnp.mean(a, axis=0))) + jnp.sum(sq(jnp.sum(a, axis=1, keepdims=True))) + jnp.mean(a * a)
            ),
            (x3,),
            (D,),
        ),
        Case(
            "activations",
            lambda a: rf.sum(
                rf.gelu(a) * rf.sigmoid(a)
                + rf.leaky_relu(a, 0.1)
                + rf.relu(a) * rf.tanh(a)
                + rf.gelu(a, approximate=False)
            ),
            lambda a: jnp.sum(
                jax.nn.gelu(a) * jax.nn.sigmoid(a)
                + jax.nn.leaky_relu(a, 0.1)
                + jax.nn.relu(a) * jnp.tanh(a)
                + jax.nn.gelu(a, approximate=False)
            ),
            (x,),
            (D,),
        ),
        Case(
            "softmax",
            lambda a: rf.sum(rf.softmax(a) * proj) + rf.sum(rf.softmax(a, axis=0) * proj),
            lambda a: jnp.sum(jax.nn.softmax(a) * proj) + jnp.sum(jax.nn.softmax(a, axis=0) * proj),
            (x,),
            (D,),
        ),
        Case(
            "matmul",
            lambda a, w: rf.sum(rf.tanh(a @ w)),
            lambda a, w: jnp.sum(jnp.tanh(a @ w)),
            (x, f32(6, 4)),
            (D, R),
            (0, 1),
        ),
        Case(
            "matmul_3d",
            lambda a, w: rf.sum(rf.tanh(rf.matmul(a, w))),
            lambda a, w: jnp.sum(jnp.tanh(a @ w)),
            (x3, f32(5, 4)),
            (D, R),
            (0, 1),
        ),
        Case(
            "bmm_sum",
            lambda a, b: rf.sum(rf.bmm(a, b)),
            lambda a, b: jnp.sum(a @ b),
            (x3, f32(B, 5, 2)),
            (D, D),
            (0, 1),
        ),
        Case(
            "mse_loss",
            lambda a, b: rf.mse_loss(rf.tanh(a), b),
            lambda a, b: jnp.mean(sq(jnp.tanh(a) - b)),
            (x, y),
            (D, D),
            (0, 1),
        ),
        Case(
            "cross_entropy",
            lambda a: rf.cross_entropy(a, labels),
            lambda a: ref_cross_entropy(a, labels),
            (logits,),
            (D,),
        ),
        Case(
            "cross_entropy_3d",
            lambda a: rf.cross_entropy(a, ints(5, B, 3)[:, :3] * 0 + 1),
            lambda a: ref_cross_entropy(a, jnp.ones((B, 3), jnp.int32)),
            (f32(B, 3, 5),),
            (D,),
        ),
        Case(
            "cross_entropy_ignore",
            lambda a: rf.cross_entropy(a, labels_ign, ignore_index=-100),
            lambda a: ref_cross_entropy(a, labels_ign, -100),
            (logits,),
            (D,),
        ),
        Case(
            "mlp",
            lambda w1, w2, xx, yy: rf.cross_entropy(rf.relu(xx @ w1) @ w2, yy),
            lambda w1, w2, xx, yy: ref_cross_entropy(jax.nn.relu(xx @ w1) @ w2, yy),
            (f32(6, 8, scale=0.5), f32(8, 5, scale=0.5), x, labels),
            (R, R, D, D),
            (0, 1, 2),
        ),
        Case(
            "embedding",
            lambda i, w: rf.sum(rf.tanh(rf.embedding(i, w))),
            lambda i, w: jnp.sum(jnp.tanh(jnp.take(w, i, axis=0))),
            (tok, table),
            (D, R),
            (1,),
        ),
        Case(
            "conv2d",
            lambda a, w, b: rf.sum(rf.tanh(rf.conv2d(a, w, b, padding=1))),
            lambda a, w, b: jnp.sum(jnp.tanh(ref_conv2d(a, w, b, padding=1))),
            (img, conv_w, conv_b),
            (D, R, R),
            (0, 1, 2),
            2e-5,
        ),
        Case(
            "conv2d_stride",
            lambda a, w: rf.sum(rf.tanh(rf.conv2d(a, w, stride=2))),
            lambda a, w: jnp.sum(jnp.tanh(ref_conv2d(a, w, stride=2))),
            (img, conv_w),
            (D, R),
            (0, 1),
            2e-5,
        ),
        Case(
            "im2col",
            lambda a: rf.sum(rf.tanh(rf.im2col(a, 3, 2, 1))),
            lambda a: jnp.sum(jnp.tanh(ref_im2col(a, 3, 2, 1))),
            (img,),
            (D,),
        ),
        Case(
            "max_pool2d",
            lambda a: rf.sum(sq(rf.max_pool2d(a, 2))) + rf.sum(rf.max_pool2d(a, 3, 2, 1)),
            lambda a: jnp.sum(sq(ref_max_pool2d(a, 2))) + jnp.sum(ref_max_pool2d(a, 3, 2, 1)),
            (img,),
            (D,),
        ),
        Case(
            "adaptive_avg_pool2d",
            lambda a: rf.sum(sq(rf.adaptive_avg_pool2d(a, (2, 3)))),
            lambda a: jnp.sum(sq(ref_adaptive_avg_pool2d(a, (2, 3)))),
            (img,),
            (D,),
        ),
        Case(
            "flatten_pool",
            lambda a: rf.sum(sq(rf.flatten(rf.max_pool2d(rf.relu(a), 2)))),
            lambda a: jnp.sum(sq(jnp.reshape(ref_max_pool2d(jax.nn.relu(a), 2), (B, -1)))),
            (img,),
            (D,),
        ),
        Case(
            "reshape_transpose",
            lambda a: rf.sum(rf.tanh(rf.reshape(a, (B, 15))) * rf.flatten(rf.transpose(a, 1, 2))),
            lambda a: jnp.sum(jnp.tanh(a.reshape(B, 15)) * jnp.swapaxes(a, 1, 2).reshape(B, 15)),
            (x3,),
            (D,),
        ),
        Case(
            "reshape_split",
            lambda a: rf.sum(sq(rf.tanh(rf.reshape(a, (B, 2, 3))))),
            lambda a: jnp.sum(sq(jnp.tanh(a.reshape(B, 2, 3)))),
            (x,),
            (D,),
        ),
        Case(
            "stack",
            lambda a, b: rf.sum(rf.tanh(rf.stack([a, b, a]))) + rf.sum(sq(rf.stack([a, b], axis=-1))),
            lambda a, b: jnp.sum(jnp.tanh(jnp.stack([a, b, a]))) + jnp.sum(sq(jnp.stack([a, b], axis=-1))),
            (x, y),
            (D, D),
            (0, 1),
        ),
        Case(
            "slice_batch",
            lambda a: rf.sum(sq(rf.slice_batch(a, 3))) + rf.sum(rf.tanh(rf.slice_batch(a, -1))),
            lambda a: jnp.sum(sq(a[3])) + jnp.sum(jnp.tanh(a[-1])),
            (x3,),
            (D,),
        ),
        Case(
            "index",
            lambda a: rf.sum(sq(rf.index(a, (slice(None), np.array([0, 2, 2]))))) + rf.sum(rf.index(a, (Ellipsis, 1))),
            lambda a: jnp.sum(sq(a[:, np.array([0, 2, 2])])) + jnp.sum(a[..., 1]),
            (x3,),
            (D,),
        ),
        Case(
            "layer_norm",
            lambda a, w, b: rf.sum(rf.layer_norm(a, w, b) * x3),
            lambda a, w, b: jnp.sum(ref_layer_norm(a, w, b) * x3),
            (x3, lw, lb),
            (D, R, R),
            (0, 1, 2),
            2e-5,
        ),
        Case(
            "batch_norm_train",
            lambda a, w, b: _bn_rf(a, w, b, bn, True),
            lambda a, w, b: _bn_ref(a, w, b, bn, True),
            (img[:, :3], *bn[:2]),
            (D, R, R),
            (0, 1, 2),
            2e-5,
        ),
        Case(
            "batch_norm_eval",
            lambda a, w, b: _bn_rf(a, w, b, bn, False),
            lambda a, w, b: _bn_ref(a, w, b, bn, False),
            (img[:, :3], *bn[:2]),
            (D, R, R),
            (0, 1, 2),
            2e-5,
        ),
        Case(
            "attention",
            lambda q, k, v: rf.sum(sq(rf.scaled_dot_product_attention(q, k, v, causal=True))),
            lambda q, k, v: jnp.sum(sq(ref_attention(q, k, v, causal=True))),
            (q, k, v),
            (D, D, D),
            (0, 1, 2),
            2e-5,
        ),
        Case(
            "attention_mask",
            lambda q, k, v: rf.sum(sq(rf.scaled_dot_product_attention(q, k, v, mask))),
            lambda q, k, v: jnp.sum(sq(ref_attention(q, k, v, mask))),
            (q, k, v),
            (D, D, D),
            (0, 1, 2),
            2e-5,
        ),
        Case(
            "dropout",
            lambda a: rf.sum(rf.dropout(a, 0.3, KEY) * proj),
            lambda a: jnp.sum(ref_dropout(a, 0.3, KEY) * proj),
            (x,),
            (D,),
        ),
    ]
    return cases


# ---------------------------------------------------------------------------
# op cases: tensor parallel on a 2x4 ("data", "model") mesh
# ---------------------------------------------------------------------------

M = P("model")
DM = P("data", "model")


def tp_cases() -> list[Case]:
    x, x3, x4 = f32(8, 6), f32(8, 3, 6), f32(8, 4, 6)
    w1, b1, w2 = f32(6, 8, scale=0.5), f32(8), f32(8, 4, scale=0.5)
    labels = ints(4, 8)
    q = f32(8, 4, 5, 3)
    tok, table = ints(8, 8, 3), f32(8, 4)
    img, conv_w, conv_b = f32(8, 3, 5, 5), f32(4, 3, 3, 3, scale=0.3), f32(4)
    lw, lb = pos(8), f32(8)

    def mlp_rf(w1, b1, w2, xx):
        h = rf.gelu(rf.add_bias(xx @ w1, b1))  # column parallel: h is [B@data, N@model]
        return rf.cross_entropy(h @ w2, labels)  # row parallel: a sum over "model"

    def mlp_ref(w1, b1, w2, xx):
        return ref_cross_entropy(jax.nn.gelu(xx @ w1 + b1) @ w2, labels)

    return [
        Case("mlp_tp", mlp_rf, mlp_ref, (w1, b1, w2, x), (P(None, "model"), M, M, D), (0, 1, 2, 3)),
        Case(
            "matmul_3d_tp",
            lambda a, w: rf.sum(rf.tanh(a @ w)),
            lambda a, w: jnp.sum(jnp.tanh(a @ w)),
            (x3, w1),
            (D, P(None, "model")),
            (0, 1),
        ),
        Case(
            "matmul_contract_tp",
            lambda a, w: rf.sum(rf.tanh(a @ w)),
            lambda a, w: jnp.sum(jnp.tanh(a @ w)),
            (f32(8, 3, 8), w2),
            (P("data", None, "model"), M),
            (0, 1),
        ),
        Case(
            "layer_norm_tp",
            lambda a, w, b: rf.sum(rf.tanh(rf.layer_norm(a, w, b))),
            lambda a, w, b: jnp.sum(jnp.tanh(ref_layer_norm(a, w, b))),
            (f32(8, 4, 8), lw, lb),
            (DM, R, R),
            (0, 1, 2),
            2e-5,
        ),
        Case(
            "attention_heads_tp",
            lambda q: rf.sum(sq(rf.scaled_dot_product_attention(q, q * 0.5, q, causal=True))),
            lambda q: jnp.sum(sq(ref_attention(q, q * 0.5, q, causal=True))),
            (q,),
            (P("data", "model"),),
            (0,),
            2e-5,
        ),
        Case(
            "bmm_heads_tp",
            lambda a, b: rf.sum(rf.tanh(rf.bmm(a, b))),
            lambda a, b: jnp.sum(jnp.tanh(a @ b)),
            (q, jnp.swapaxes(q, -1, -2)),
            (DM, DM),
            (0, 1),
        ),
        Case(
            "embedding_dim_tp",
            lambda i, w: rf.sum(rf.tanh(rf.embedding(i, w))),
            lambda i, w: jnp.sum(jnp.tanh(jnp.take(w, i, axis=0))),
            (tok, table),
            (D, P(None, "model")),
            (1,),
        ),
        Case(
            "embedding_vocab_tp",
            lambda i, w: rf.sum(rf.tanh(rf.embedding(i, w))),
            lambda i, w: jnp.sum(jnp.tanh(jnp.take(w, i, axis=0))),
            (tok, table),
            (D, M),
            (1,),
        ),
        Case(
            "conv2d_channels_tp",
            lambda a, w, b: rf.sum(rf.tanh(rf.conv2d(a, w, b, padding=1))),
            lambda a, w, b: jnp.sum(jnp.tanh(ref_conv2d(a, w, b, padding=1))),
            (img, conv_w, conv_b),
            (D, M, M),
            (0, 1, 2),
            2e-5,
        ),
        Case(
            "softmax_tp",
            lambda a: rf.sum(rf.softmax(a) * x4),
            lambda a: jnp.sum(jax.nn.softmax(a) * x4),
            (f32(8, 4, 6),),
            (DM,),
        ),
        Case(
            "fsdp_matmul",
            lambda w, a: rf.sum(rf.tanh(a @ w)),
            lambda w, a: jnp.sum(jnp.tanh(a @ w)),
            (f32(8, 4), x3[..., :8] if False else f32(8, 3, 8)),
            (P("data"), D),
            (0, 1),
        ),
    ]


# ---------------------------------------------------------------------------
# lifted programs: the primitive rules of rf.lift on plain jnp / lax code
# ---------------------------------------------------------------------------
#
# Each function is plain jax code: rf sees it only through rf.lift, the oracle is
# jax.grad of the same function. Explicit axes: only code that plain JAX accepts
# on these shardings (a cumsum/sort along the sharded batch axis, an integer
# index into it, are refused by JAX itself; error_group checks rf's error then).


def _lift_families() -> dict[str, tuple[Callable[..., Any], tuple, tuple, tuple]]:
    """name -> (jnp loss, args, specs, argnums): one per primitive family, data parallel."""
    x, y, b = f32(B, 6), pos(B, 6), f32(6)
    x3 = f32(B, 3, 5)
    img, cw = f32(B, 3, 6, 6), f32(4, 3, 3, 3, scale=0.3)
    idx = np.array([0, 2, 2, 5])
    tidx = ints(6, B, 3)
    ws = f32(3, 6, 6, scale=0.3)

    def elementwise(a, c):  # broadcasts of a replicated operand against the batch
        return (
            jnp.sum(jnp.tanh(a + c) * a)
            + jnp.sum(jnp.exp(-a) * c)
            + jnp.sum(jnp.where(a > 0, a, 0.1 * a) * c)
            + jnp.sum(jnp.maximum(a, c) ** 2)
            + jnp.sum(jnp.clip(a, -0.5, c))
            + 2.0 * jnp.sum(a)
        )

    def reductions(a):  # over the sharded batch axis and over the others
        return (
            jnp.sum(jnp.mean(a, axis=0) ** 2)
            + jnp.sum(jnp.max(a, axis=1) ** 2)
            + jnp.sum(jnp.max(a, axis=0))
            + jnp.sum(jax.nn.logsumexp(a, axis=-1))
            + jnp.var(a)
            + jnp.sum(jnp.prod(a[..., :3], axis=-1))
            + jnp.mean(a * a)
        )

    def dot(a, w):  # batch sharded, weight replicated; a batched contraction
        return jnp.sum(jnp.tanh(a @ w)) + jnp.sum(jnp.einsum("bij,bkj->bik", a, a * 0.5) * a[:, :, :3])

    def shapes(a):
        h = jnp.reshape(a, (B, 15)) * jnp.swapaxes(a, 1, 2).reshape(B, 15)
        c = jnp.concatenate([a, a * 2], axis=1)
        c2 = jnp.concatenate([a, a[:, :1]], axis=1)
        return (
            jnp.sum(jnp.tanh(h))
            + jnp.sum(c**2)
            + jnp.sum(jnp.transpose(c2, (2, 0, 1))[0] ** 3)
            + jnp.sum(jnp.squeeze(a[:, :1, :], 1) ** 2)
            + jnp.sum(jnp.pad(a, ((0, 0), (1, 2), (0, 1))) * 0.5)
        )

    def indexing(a, u):  # gather, scatter-add, scatter-max, take_along_axis, .at[].set
        return (
            jnp.sum(a[:, idx] ** 2)
            + jnp.sum(jnp.tanh(a.at[:, idx].add(u[:, :4])))
            + jnp.sum(a.at[:, idx].max(u[:, :4]) ** 2)
            + jnp.sum(jnp.take_along_axis(a, tidx, axis=1) ** 2)
            + jnp.sum(a[:, 3] ** 2)
            # updates sharded as the rows they land in (jax 0.11 refuses a scalar's replicated broadcast)
            + jnp.sum(a.at[:, 1].set(a[:, 0] * 0.0) ** 2)
        )

    def conv_pool(a, k):
        h = lax.conv_general_dilated(a, k, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"))
        p = lax.reduce_window(h, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
        s = lax.reduce_window(jnp.tanh(h), 0.0, lax.add, (1, 1, 3, 3), (1, 1, 1, 1), "SAME")
        return jnp.sum(p**2) + jnp.sum(s * 0.1)

    def cumulative(a):
        return (
            jnp.sum(jnp.cumsum(a, axis=1) ** 2)
            + jnp.sum(lax.cumprod(a[:, :3], axis=1))
            + jnp.sum(lax.cummax(a, axis=1))
        )

    def sort(a):
        return jnp.sum(jnp.sort(a, axis=1) * jnp.arange(6.0)) + jnp.sum(jnp.argsort(a, axis=1) * a)

    def scan(a, w):  # lax.scan over stacked layer weights
        def layer(h, wk):
            return jnp.tanh(h @ wk), jnp.sum(h)

        h, ys = lax.scan(layer, a, w)
        return jnp.sum(h**2) + jnp.sum(ys)

    def moved(a, w):  # jax.device_put onto the operand's own sharding, and onto the default device
        r = jax.device_put(a * 2.0, jax.typeof(a).sharding)
        return jnp.sum(jnp.tanh(r @ w)) + jnp.sum(jax.device_put(w) ** 2)

    def cond(a, c):
        r = lax.cond(jnp.sum(c) > 0, lambda v: jnp.tanh(v) * c, lambda v: v * v, a)
        return jnp.sum(r) + jnp.sum(lax.cond(jnp.sum(c) < 0, jnp.sin, lambda v: v * 2.0, a))

    def custom_jvp(a, w):  # jax.custom_jvp functions (jax.nn.relu) on sharded values, in a scan too
        def layer(h, _):
            return jax.nn.relu(h @ w - 0.1) + 0.5 * h, jnp.sum(jax.nn.relu(h))

        h, ys = lax.scan(layer, a, None, length=2)
        return jnp.sum(h**2) + jnp.sum(ys) + jnp.sum(jax.nn.relu(a) * a)

    return {
        "elementwise": (elementwise, (x, b), (D, R), (0, 1)),
        "custom_jvp": (custom_jvp, (x, f32(6, 6, scale=0.3)), (D, R), (0, 1)),
        "elementwise_sharded": (elementwise, (x, y), (D, D), (0, 1)),
        "reductions": (reductions, (x3,), (D,), (0,)),
        "dot_general": (dot, (x3, f32(5, 4)), (D, R), (0, 1)),
        "reshape_transpose_concatenate": (shapes, (x3,), (D,), (0,)),
        "gather_scatter": (indexing, (x, y), (D, D), (0, 1)),
        "conv_reduce_window": (conv_pool, (img, cw), (D, R), (0, 1)),
        "cumsum": (cumulative, (x,), (D,), (0,)),
        "sort": (sort, (x,), (D,), (0,)),
        "scan": (scan, (x, ws), (D, R), (0, 1)),
        "cond": (cond, (x, b), (D, R), (0, 1)),
        "device_put": (moved, (x, f32(6, 4)), (D, R), (0, 1)),
    }


def lift_cases(slow: bool = False) -> list[Case]:
    """Data parallel: one case per family and one of ``rumus_fx.numpy`` mixed
    with rf ops; ``slow`` adds the variants (elementwise with both operands sharded)."""
    variants = {"elementwise_sharded"}
    cases = [
        Case(f"lift_{n}", rf.lift(f), f, args, specs, argnums)
        for n, (f, args, specs, argnums) in _lift_families().items()
        if slow or n not in variants
    ]
    xr, wr = f32(B, 6), f32(6, 4)

    def rnp_loss(a, w):  # each rnp call is its own lifted program, between rf ops
        h = rnp.take_along_axis(rf.tanh(a @ w), rnp.argsort(a[:, :4], axis=1), axis=1)
        return rnp.sum(rnp.cumsum(h, axis=1) ** 2)

    def rnp_ref(a, w):
        h = jnp.take_along_axis(jnp.tanh(a @ w), jnp.argsort(a[:, :4], axis=1), axis=1)
        return jnp.sum(jnp.cumsum(h, axis=1) ** 2)

    return cases + [Case("lift_rumus_fx_numpy", rnp_loss, rnp_ref, (xr, wr), (D, R), (0, 1))]


def _row_parallel(h: Any, w: Any) -> Any:
    """``h @ w`` contracting a "model"-sharded axis: on Explicit axes plain JAX
    needs the output's sharding (batch on "data", the rest replicated)."""
    s = rf.sharding.sharding_of(h)
    out = None if s is None else rf.sharding.with_spec(s, (s.spec[0],) + (None,) * (h.ndim - 1))
    return jnp.matmul(h, w, out_sharding=out)


def lift_tp_cases(slow: bool = False) -> list[Case]:
    """Tensor parallel on 2x4 ("data", "model"): a Megatron MLP (column then row
    parallel, biases, log_softmax and the label gather); ``slow`` adds the two
    products alone and attention over "model"-sharded heads."""
    x = f32(8, 6)
    w1, b1, w2 = f32(6, 8, scale=0.5), f32(8), f32(8, 4, scale=0.5)
    labels = ints(4, 8)

    def mlp(w1, b1, w2, xx):
        h = jax.nn.gelu(xx @ w1 + b1)
        logp = jax.nn.log_softmax(_row_parallel(h, w2))
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))

    def column(a, w):
        return jnp.sum(jnp.tanh(a @ w))

    def row(a, w):
        return jnp.sum(jnp.tanh(_row_parallel(a, w)))

    def heads(q):  # [B, H, S, Dh] with the heads on "model"
        s = jnp.einsum("bhqd,bhkd->bhqk", q, q * 0.5) / 2.0
        s = jnp.where(jnp.tril(jnp.ones((5, 5), bool)), s, -1e9)
        return jnp.sum(jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), q) ** 2)

    cases = [Case("lift_mlp_tp", rf.lift(mlp), mlp, (w1, b1, w2, x), (P(None, "model"), M, M, D), (0, 1, 2, 3))]
    if slow:
        cases += [
            Case("lift_column_tp", rf.lift(column), column, (f32(8, 3, 6), w1), (D, P(None, "model")), (0, 1)),
            Case("lift_row_tp", rf.lift(row), row, (f32(8, 3, 8), w2), (P("data", None, "model"), M), (0, 1)),
            Case("lift_heads_tp", rf.lift(heads), heads, (f32(8, 4, 5, 3),), (DM,), (0,)),
        ]
    return cases


def _bn_rf(x, w, b, bn, training):
    y, rm, rv = rf.batch_norm_2d(x, w, b, *bn[2:], training=training)
    return rf.sum(y * y) * 0.01 + rf.sum(rf.tanh(y))


def _bn_ref(x, w, b, bn, training):
    y, rm, rv = ref_batch_norm(x, w, b, *bn[2:], training=training)
    return jnp.sum(y * y) * 0.01 + jnp.sum(jnp.tanh(y))


# ---------------------------------------------------------------------------
# running a case
# ---------------------------------------------------------------------------


def close(got: Any, want: Any, tol: float, what: str) -> None:
    for i, (u, v) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=tol, atol=tol, err_msg=f"{what} leaf {i}")


def one_device(case: Case) -> Any:
    dev = jax.devices()[0]
    args = jax.device_put(case.args, dev)
    want = jax.jit(rf.value_and_grad(case.rf_loss, case.argnums))(*args)
    oracle = jax.jit(jax.value_and_grad(case.ref_loss, case.argnums))(*args)
    close(want, oracle, max(case.tol, 1e-4), f"{case.name}: rf vs jax.grad on one device")
    return want


RESHARDS: list[str] = []


def _reshard_hook(name: str, k: int, found: Any, wanted: Any) -> None:
    RESHARDS.append(f"{name} input {k}: {found.spec} -> {wanted.spec}")


rf.sharding.RESHARD_HOOK = _reshard_hook


def _is_spec(s: Any) -> bool:
    return isinstance(s, P)


ALL_COMBOS = tuple((k, m) for k in (AxisType.Explicit, AxisType.Auto) for m in (False, True))


def combos(index: int) -> tuple[tuple[AxisType, bool], ...]:
    """The (axis type, under ``jax.set_mesh``) settings case ``index`` of a group
    runs. By default each case runs one of the four settings, taken in turn from
    one case to the next (so every combination runs in every group of four or
    more cases, and every case runs on a mesh); ``SHARDED_ALL_COMBOS=1`` (the
    ``-m slow`` run) runs all four for every case."""
    if os.environ.get("SHARDED_ALL_COMBOS"):
        return ALL_COMBOS
    return (ALL_COMBOS[index % len(ALL_COMBOS)],)


def run_case(
    case: Case,
    mesh_shape: tuple[int, ...],
    axes: tuple[str, ...],
    settings: tuple[tuple[AxisType, bool], ...] = ALL_COMBOS,
):
    want = one_device(case)
    RESHARDS.clear()
    for kind, under_mesh in settings:
        mesh = jax.make_mesh(mesh_shape, axes, axis_types=(kind,) * len(axes))
        shardings = jax.tree.map(lambda s, mesh=mesh: NamedSharding(mesh, s), case.specs, is_leaf=_is_spec)
        args = jax.device_put(case.args, shardings)
        what = f"{case.name} [{kind.name}, {'set_mesh' if under_mesh else 'no set_mesh'}]"
        with jax.set_mesh(mesh) if under_mesh else contextlib.nullcontext():
            value, grads = jax.jit(rf.value_and_grad(case.rf_loss, case.argnums))(*args)
        close((value, grads), want, case.tol, what)
        assert not RESHARDS, f"{what}: the engine resharded gradients: {RESHARDS}"
        # Explicit axes: the sharding is in the types, so each gradient must have its
        # argument's. Auto axes: XLA's partitioner picks, so rf must agree with jax.grad
        # (or have the argument's sharding, where jax.grad's is a constant's).
        expected = [[jax.tree.leaves(shardings[i])] for i in case.argnums]
        if kind == AxisType.Auto:
            with jax.set_mesh(mesh) if under_mesh else contextlib.nullcontext():
                oracle = jax.jit(jax.grad(case.ref_loss, case.argnums))(*args)
            expected = [e + [[o.sharding for o in jax.tree.leaves(t)]] for e, t in zip(expected, oracle)]
        for i, g, e in zip(case.argnums, grads, expected):
            for n, leaf in enumerate(jax.tree.leaves(g)):
                assert any(leaf.sharding.is_equivalent_to(s[n], leaf.ndim) for s in e), (
                    f"{what}: gradient leaf {n} of argument {i} has sharding {leaf.sharding}, "
                    f"expected one of {[s[n] for s in e]}"
                )


def run_group(name: str, cases: list[Case], mesh_shape, axes) -> list[str]:
    failures = []
    only = os.environ.get("SHARDED_ONLY")
    for index, case in enumerate(cases):
        if only and case.name not in only.split(","):
            continue
        t0 = time.perf_counter()
        try:
            run_case(case, mesh_shape, axes, ALL_COMBOS if case.every_setting else combos(index))
        except Exception as e:  # collect all failures, report at the end
            failures.append(f"{name}/{case.name}: {type(e).__name__}: {str(e)[:2000]}")
            if os.environ.get("SHARDED_TRACEBACK"):
                traceback.print_exc()
            print(f"FAIL {name}/{case.name} ({time.perf_counter() - t0:.1f}s)", flush=True)
        else:
            print(f"ok {name}/{case.name} ({time.perf_counter() - t0:.1f}s)", flush=True)
    return failures


# ---------------------------------------------------------------------------
# models: data parallel, tensor parallel, FSDP
# ---------------------------------------------------------------------------


def _specs(tree: Any, rule: Callable[[str, Any], P]) -> Any:
    """A spec per leaf of ``tree`` from its dotted path."""
    return jax.tree_util.tree_map_with_path(lambda path, leaf: rule(jax.tree_util.keystr(path), leaf), tree)


def _rf_as_jax(loss: Callable[..., Any]) -> Callable[..., Any]:
    """The same rf forward differentiated by jax.grad (rf ops run as jnp without a tape)."""
    return lambda *a: jnp.asarray(loss(*a))


def model_cases() -> tuple[list[Case], list[Case], list[Case]]:
    """(data parallel on (8,) "data", tensor parallel on 2x4 ("data", "model"), FSDP on (8,) "data")."""
    from benchmarks import models

    mlp = models.mlp(batch=16, widths=(16, 32, 16, 8))
    cnn = models.cnn(batch=8)
    gpt = models.tiny_gpt(batch=8, seq=8, vocab=16, d=16, heads=4, blocks=1)
    block = rf.nn.TransformerBlock(16, heads=4)
    bparams = block.init(jax.random.key(1))
    bx, btarget = f32(8, 8, 16), f32(8, 8, 16)

    def block_loss(p, batch):
        x, target = batch
        return rf.mse_loss(block(p, x, causal=True), target)

    rep = lambda path, leaf: R  # noqa: E731

    def mlp_tp(path, leaf):  # Megatron: column parallel, then row parallel, alternating
        layer = int(path[1])
        if leaf.ndim == 2:
            return P(None, "model") if layer % 2 == 0 else P("model", None)
        return M if layer % 2 == 0 else R

    def cnn_tp(path, leaf):  # output channels on "model"; fc rows follow the flattened channels
        if "fc" in path:
            return P("model", None) if "weight" in path else R
        return M

    def block_tp(path, leaf):
        if "qkv" in path or "fc1" in path:
            return P(None, "model") if leaf.ndim == 2 else M
        if ("proj" in path or "fc2" in path) and leaf.ndim == 2:
            return P("model", None)
        return R

    def fsdp(path, leaf):  # every weight matrix sharded along its first axis
        return D if leaf.ndim == 2 else R

    dp = [
        Case("mlp_dp", mlp.loss_rf, mlp.loss_jax, (mlp.params, mlp.batch), (_specs(mlp.params, rep), (D, D)), (0,)),
        Case(
            "cnn_dp", cnn.loss_rf, cnn.loss_jax, (cnn.params, cnn.batch), (_specs(cnn.params, rep), (D, D)), (0,), 2e-5
        ),
        Case(
            "block_dp",
            block_loss,
            _rf_as_jax(block_loss),
            (bparams, (bx, btarget)),
            (_specs(bparams, rep), (D, D)),
            (0,),
            2e-5,
        ),
        Case(
            "gpt_dp", gpt.loss_rf, gpt.loss_jax, (gpt.params, gpt.batch), (_specs(gpt.params, rep), (D, D)), (0,), 2e-5
        ),
    ]
    tp = [
        Case("mlp_tp", mlp.loss_rf, mlp.loss_jax, (mlp.params, mlp.batch), (_specs(mlp.params, mlp_tp), (D, D)), (0,)),
        Case(
            "cnn_tp",
            cnn.loss_rf,
            cnn.loss_jax,
            (cnn.params, cnn.batch),
            (_specs(cnn.params, cnn_tp), (D, D)),
            (0,),
            2e-5,
        ),
        Case(
            "block_tp",
            block_loss,
            _rf_as_jax(block_loss),
            (bparams, (bx, btarget)),
            (_specs(bparams, block_tp), (D, D)),
            (0,),
            2e-5,
            # Auto axes without set_mesh: the qkv weight gradient was once replicated
            # (rows merged for the dW dot; Note [Weight gradient as one 2-D dot])
            every_setting=True,
        ),
    ]

    def gathered(loss):  # FSDP: each layer's weights are gathered where they are used
        def f(params, batch):
            return loss(jax.tree.map(lambda w: rf.reshard(w, R), params), batch)

        return f

    def gathered_ref(loss):
        def f(params, batch):
            return loss(jax.tree.map(lambda w: jax.sharding.reshard(w, R) if _explicit(w) else w, params), batch)

        return f

    fs = [
        Case(
            "gpt_fsdp",
            gathered(gpt.loss_rf),
            gathered_ref(gpt.loss_jax),
            (gpt.params, gpt.batch),
            (_specs(gpt.params, fsdp), (D, D)),
            (0,),
            2e-5,
        ),
        Case("mlp_fsdp", mlp.loss_rf, mlp.loss_jax, (mlp.params, mlp.batch), (_specs(mlp.params, fsdp), (D, D)), (0,)),
    ]
    return dp, tp, fs


def _explicit(w: Any) -> bool:
    return rf.sharding.sharding_of(w) is not None


def model_group(which: str) -> list[str]:
    dp, tp, fs = model_cases()
    if which == "dp":
        return run_group("models_dp", dp, (8,), ("data",))
    fails = run_group("models_tp", tp, (2, 4), ("data", "model")) + run_group("models_fsdp", fs, (8,), ("data",))
    return fails + _block_tp_collectives(next(c for c in tp if c.name == "block_tp"))


def _block_tp_collectives(case: Case) -> list[str]:
    """The tensor-parallel TransformerBlock step (fused qkv column parallel,
    proj/fc2 row parallel, Explicit axes) gathers no activation: every
    all-gather in its compiled program is parameter-sized (the qkv weight and
    bias reordered into whole heads, and their gradients), checked as
    benchmarks/sharded.py checks it."""
    from benchmarks.sharded import check_gathers

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), case.specs, is_leaf=_is_spec)
    args = jax.device_put(case.args, shardings)
    try:
        hlo = jax.jit(rf.value_and_grad(case.rf_loss)).lower(*args).compile().as_text()
        shapes = check_gathers("block_tp", hlo, args[0], jax.tree.leaves(shardings[0]))
        if len(shapes) != 4:  # weight and bias of qkv, forward; their gradients, backward
            raise AssertionError(f"expected 4 all-gathers (qkv weight, bias and their gradients), got {shapes}")
    except Exception as e:
        print("FAIL models_tp/block_tp collectives", flush=True)
        return [f"models_tp/block_tp collectives: {type(e).__name__}: {e}"]
    print("ok models_tp/block_tp collectives", flush=True)
    return []


KERNEL_CASES = {
    "softmax",
    "layer_norm",
    "cross_entropy",
    "mlp",
    "matmul_3d",
    "bmm_sum",
    "embedding",
    "attention",
    "batch_norm_train",
}
KERNEL_TP_CASES = {"mlp_tp", "attention_heads_tp", "embedding_dim_tp", "layer_norm_tp"}


def kernel_group() -> list[str]:
    """The Pallas kernels (interpret mode) on the same checks."""
    with rf.kernels.use("interpret"):
        fails = run_group("kernels", [c for c in op_cases() if c.name in KERNEL_CASES], (8,), ("data",))
        fails += run_group(
            "kernels_tp", [c for c in tp_cases() if c.name in KERNEL_TP_CASES], (2, 4), ("data", "model")
        )
    return fails


def error_group() -> list[str]:
    """A combination that cannot work raises rf.ShardingError naming the op, the
    shardings and the fix (never JAX's raw error)."""
    mesh = jax.make_mesh((8,), ("data",))
    h = jax.device_put(f32(8, 8, 16), NamedSharding(mesh, D))
    wpe = jax.device_put(f32(8, 16), NamedSharding(mesh, D))  # sharded on "data" too: clashes with h's batch
    fails = []
    for under_mesh in (False, True):
        with jax.set_mesh(mesh) if under_mesh else contextlib.nullcontext():
            try:
                jax.jit(rf.grad(lambda w, h: rf.sum(rf.tanh(rf.add(h, w)))))(wpe, h)
            except rf.ShardingError as e:
                text = str(e)
                for part in ("add:", "float32[8@data,16]", "float32[8@data,8,16]", "rf.reshard", "AxisType.Auto"):
                    if part not in text:
                        fails.append(f"errors: {part!r} missing from: {text}")
                # the fix it names works
                g = jax.jit(rf.grad(lambda w, h: rf.sum(rf.tanh(rf.add(h, rf.reshard(w, R))))))(wpe, h)
                want = jax.grad(lambda w: jnp.sum(jnp.tanh(jnp.asarray(np.asarray(h)) + w)))(
                    jnp.asarray(np.asarray(wpe))
                )
                close(g, want, 1e-5, "errors: rf.reshard fix")
                if not g.sharding.is_equivalent_to(wpe.sharding, 2):
                    fails.append(f"errors: reshard gradient sharding {g.sharding}")
            except Exception as e:
                fails.append(f"errors: {type(e).__name__}: {e}")
            else:
                fails.append("errors: no error raised")
    fails += _lift_errors(mesh)
    print("ok errors" if not fails else "FAIL errors", flush=True)
    return fails


def _lift_errors(mesh: Any) -> list[str]:
    """A lifted function JAX itself refuses on these shardings (a cumsum along the
    sharded batch axis) raises rf.ShardingError naming the function, the
    primitive, the operand's sharded type and the fix; the fix (reshard inside
    the function) works, and the gradient has the argument's sharding."""
    fails = []
    x = jax.device_put(f32(16, 6), NamedSharding(mesh, D))

    def bad(a):
        return jnp.sum(jnp.tanh(jnp.cumsum(a, axis=0)))

    def fixed(a):
        gathered = jax.sharding.reshard(a, NamedSharding(jax.typeof(a).sharding.mesh, R))
        return jnp.sum(jnp.tanh(jnp.cumsum(gathered, axis=0)))

    want = jax.grad(bad)(jax.device_put(np.asarray(x), jax.devices()[0]))
    for under_mesh in (False, True):
        with jax.set_mesh(mesh) if under_mesh else contextlib.nullcontext():
            fails += _raises(
                "errors/lift",
                lambda: jax.jit(rf.grad(rf.lift(bad)))(x),
                rf.ShardingError,
                ("rf.lift(bad)", "'cumsum'", "float32[16@data,6]", "rf.reshard", "AxisType.Auto"),
            )
            g = jax.jit(rf.grad(rf.lift(fixed)))(x)
            close(g, want, 1e-5, "errors/lift: the fix")
            if not g.sharding.is_equivalent_to(x.sharding, 2):
                fails.append(f"errors/lift: reshard gradient sharding {g.sharding}")
    fails += _reduced_axes_refused(mesh)
    return fails


def _reduced_axes_refused(mesh: Any) -> list[str]:
    """A value with reduced mesh axes (PartitionSpec(reduced=...), jax's explicit
    sharding sums) is refused by name when the gradient reads it: rf's rules do
    not follow them (they failed inside rf with jax's "Using *pspec is dangerous";
    jax's pjit_test.py through tools/jax_suite)."""
    if mesh.axis_types[0] != AxisType.Explicit:
        return []
    axis = mesh.axis_names[0]
    w = jax.device_put(f32(4, 2), NamedSharding(mesh, P(reduced={axis})))
    v = jax.device_put(f32(2, 8), NamedSharding(mesh, P(None, axis)))

    def f(a, b):
        return jnp.sum(jnp.sin(a) @ jnp.sin(b))

    def identity(a, b):  # no step to refuse: the input and the output are (pjit_test.py's test_vjp_unreduced_zeros)
        return b

    with jax.set_mesh(mesh):
        fails = _raises(
            "errors/reduced",
            lambda: jax.jit(rf.grad(rf.lift(f), argnums=(0, 1)))(w, v),
            rf.AutogradError,
            ("reduced or unreduced", "rf.lift"),
        )
        ct = jax.device_put(f32(4, 2), NamedSharding(mesh, P(unreduced={axis})))
        fails += _raises(
            "errors/reduced identity",
            lambda: rf.vjp(rf.lift(jax.jit(identity)), w, w)[1](ct),
            rf.AutogradError,
            ("reduced or unreduced", "rf.lift", "input 0"),
        )
        return fails


def _raises(label: str, call: Callable[[], Any], exc: type[Exception], parts: tuple[str, ...]) -> list[str]:
    """What is wrong with ``call()``'s error: it must raise ``exc`` naming each of ``parts``."""
    try:
        call()
    except exc as e:
        return [f"{label}: {part!r} missing from: {e}" for part in parts if part not in str(e)]
    except Exception as e:
        return [f"{label}: {type(e).__name__}: {e}"]
    return [f"{label}: no error raised"]


GROUPS: dict[str, Callable[[], list[str]]] = {
    "errors": error_group,
    "kernels": kernel_group,
    "models_dp": lambda: model_group("dp"),
    "models_tp": lambda: model_group("tp"),
    "lift": lambda: run_group("lift", lift_cases(), (8,), ("data",)),
    "lift_tp": lambda: run_group("lift_tp", lift_tp_cases(), (2, 4), ("data", "model")),
    "lift_slow": lambda: (
        run_group("lift", lift_cases(slow=True), (8,), ("data",))
        + run_group("lift_tp", lift_tp_cases(slow=True), (2, 4), ("data", "model"))
    ),
    "ops": lambda: run_group("ops", op_cases(), (8,), ("data",)),
    "ops_tp": lambda: run_group("ops_tp", tp_cases(), (2, 4), ("data", "model")),
}


def emulate_jax011_broadcast() -> bool:
    """Make ``broadcast_in_dim`` infer its result's sharding as jax 0.11 does
    (``SHARDED_EMULATE_JAX011=1``), so that jax 0.10 runs check what 0.11 needs.

    jax 0.10 gave ``broadcast_in_dim`` its own abstract evaluation, which always
    honours its ``sharding`` (``out_sharding=``) parameter. jax 0.11 makes it a
    standard primitive (jax/_src/lax/lax.py ``broadcast_in_dim_p =
    standard_primitive(...)``), whose sharding inference
    (jax/_src/lax/utils.py ``call_sharding_rule``) skips the rule -- and the
    parameter -- when neither the context mesh (``jax.set_mesh``) nor the
    operand's type has Explicit axes: broadcasting a meshless value (a constant,
    the seed of a backward pass) to ``out_sharding=`` gives a replicated result
    when no mesh is set; so do ``jnp.zeros(..., out_sharding=)`` and
    ``jnp.full_like`` of a sharded tracer, which broadcast a scalar. Returns
    whether the emulation was installed (not on a jax that already does this)."""
    from jax._src import mesh as mesh_lib
    from jax._src.lax import lax as lax_internal

    prim = lax_internal.broadcast_in_dim_p
    if not hasattr(lax_internal, "_broadcast_in_dim_abstract_eval"):
        return False  # jax 0.11 and later: already the standard primitive
    orig = prim.abstract_eval

    def abstract_eval(x, **params):
        out, effects = orig(x, **params)
        cur, mesh = mesh_lib.get_abstract_mesh(), x.sharding.mesh
        if (cur.empty or cur._are_all_axes_auto_or_manual) and (mesh.empty or mesh._are_all_axes_auto_or_manual):
            out = out.update(sharding=NamedSharding(cur if mesh.empty else mesh, P()))
        return out, effects

    prim.abstract_eval = abstract_eval
    return True


def main(names: list[str]) -> int:
    assert jax.device_count() == 8, jax.devices()
    if os.environ.get("SHARDED_EMULATE_JAX011"):
        print(f"emulating jax 0.11's broadcast_in_dim: {emulate_jax011_broadcast()}", flush=True)
    failures = []
    for n in names:
        failures += GROUPS[n]()
    for f in failures:
        print(f, file=sys.stderr)
    print("FAILED" if failures else "OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
