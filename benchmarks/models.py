"""Three models built twice: with rumus_fx ops (differentiated by the tape) and as
idiomatic jax.numpy / lax code differentiated by ``jax.grad``.

Run ``python -m benchmarks.models`` for the comparison table (see
``benchmarks/compare.py``); the test-suite imports this module to check that both
implementations give the same loss and gradients.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import rumus_fx as rf


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    loss_rf: Callable[[Any, Any], Any]  # (params, batch) -> scalar Tensor
    loss_jax: Callable[[Any, Any], Any]  # (params, batch) -> scalar array
    params: Any
    batch: Any
    torch_step: Callable[[], Callable[[], None]] | None = None


def _init(key: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    return jax.random.uniform(key, shape, jnp.float32, -1.0, 1.0) / math.sqrt(fan_in)


def _ce_jax(logits: jax.Array, targets: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


# ---------------------------------------------------------------------------
# 1. MLP 784-512-512-10, batch 256
# ---------------------------------------------------------------------------


def mlp(batch: int = 256, widths: tuple[int, ...] = (784, 512, 512, 10), seed: int = 0) -> Model:
    keys = jax.random.split(jax.random.key(seed), 2 * len(widths))
    params = [
        {"weight": _init(keys[2 * i], (a, b), a), "bias": _init(keys[2 * i + 1], (b,), a)}
        for i, (a, b) in enumerate(itertools.pairwise(widths))
    ]
    x = jax.random.normal(keys[-2], (batch, widths[0]), jnp.float32)
    y = jax.random.randint(keys[-1], (batch,), 0, widths[-1])

    def loss_rf(params, batch):
        h, targets = batch
        for i, layer in enumerate(params):
            h = rf.add_bias(h @ layer["weight"], layer["bias"])
            if i < len(params) - 1:
                h = rf.relu(h)
        return rf.cross_entropy(h, targets)

    def loss_jax(params, batch):
        h, targets = batch
        for i, layer in enumerate(params):
            h = h @ layer["weight"] + layer["bias"]
            if i < len(params) - 1:
                h = jax.nn.relu(h)
        return _ce_jax(h, targets)

    return Model(
        f"MLP {'-'.join(map(str, widths))} b{batch}",
        loss_rf,
        loss_jax,
        params,
        (x, y),
        lambda: _torch_mlp(params, (x, y)),
    )


# ---------------------------------------------------------------------------
# 2. CNN on [64, 1, 28, 28]
# ---------------------------------------------------------------------------


def cnn(batch: int = 64, seed: int = 0, width: int = 1) -> Model:
    """Two conv + batch-norm + pool blocks and a linear head on [batch, 1, 28, 28];
    ``width`` multiplies the channels (16 and 32)."""
    k = jax.random.split(jax.random.key(seed), 8)
    c1, c2 = 16 * width, 32 * width
    params = {
        "conv1": {"weight": _init(k[0], (c1, 1, 3, 3), 9), "bias": _init(k[1], (c1,), 9)},
        "bn1": {"weight": jnp.ones(c1), "bias": jnp.zeros(c1)},
        "conv2": {"weight": _init(k[2], (c2, c1, 3, 3), 9 * c1), "bias": _init(k[3], (c2,), 9 * c1)},
        "bn2": {"weight": jnp.ones(c2), "bias": jnp.zeros(c2)},
        "fc": {"weight": _init(k[4], (c2 * 7 * 7, 10), c2 * 49), "bias": _init(k[5], (10,), c2 * 49)},
    }
    state = {"bn1": (jnp.zeros(c1), jnp.ones(c1)), "bn2": (jnp.zeros(c2), jnp.ones(c2))}
    x = jax.random.normal(k[6], (batch, 1, 28, 28), jnp.float32)
    y = jax.random.randint(k[7], (batch,), 0, 10)

    def loss_rf(params, batch):
        x, targets = batch
        h = x
        for conv, bn in (("conv1", "bn1"), ("conv2", "bn2")):
            h = rf.conv2d(h, params[conv]["weight"], params[conv]["bias"], padding=1)
            h, _, _ = rf.batch_norm_2d(h, params[bn]["weight"], params[bn]["bias"], *state[bn], training=True)
            h = rf.max_pool2d(rf.relu(h), 2)
        logits = rf.add_bias(rf.flatten(h) @ params["fc"]["weight"], params["fc"]["bias"])
        return rf.cross_entropy(logits, targets)

    def loss_jax(params, batch):
        x, targets = batch
        h = x
        for conv, bn in (("conv1", "bn1"), ("conv2", "bn2")):
            h = lax.conv_general_dilated(h, params[conv]["weight"], (1, 1), [(1, 1), (1, 1)])
            h = h + params[conv]["bias"].reshape(1, -1, 1, 1)
            mean = jnp.mean(h, axis=(0, 2, 3), keepdims=True)
            var = jnp.var(h, axis=(0, 2, 3), keepdims=True)
            h = (h - mean) * lax.rsqrt(var + 1e-5)
            h = h * params[bn]["weight"].reshape(1, -1, 1, 1) + params[bn]["bias"].reshape(1, -1, 1, 1)
            h = jax.nn.relu(h)
            h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
        logits = h.reshape(h.shape[0], -1) @ params["fc"]["weight"] + params["fc"]["bias"]
        return _ce_jax(logits, targets)

    name = f"CNN [{batch},1,28,28]" + (f" x{width} channels" if width != 1 else "")
    return Model(name, loss_rf, loss_jax, params, (x, y), lambda: _torch_cnn(params, (x, y)))


# ---------------------------------------------------------------------------
# 3. TinyGPT: vocab 65, seq 64, batch 16, d 128, 4 heads, 2 pre-norm blocks
# ---------------------------------------------------------------------------


def tiny_gpt(
    batch: int = 16, seq: int = 64, vocab: int = 65, d: int = 128, heads: int = 4, blocks: int = 2, seed: int = 0
) -> Model:
    keys = iter(jax.random.split(jax.random.key(seed), max(64, 16 * blocks + 8)))  # 16 per block and a few more

    def lin(a, b):
        return {"weight": _init(next(keys), (a, b), a), "bias": _init(next(keys), (b,), a)}

    def ln():
        return {"weight": jnp.ones(d), "bias": jnp.zeros(d)}

    params = {
        "wte": jax.random.normal(next(keys), (vocab, d)) * 0.02,
        "wpe": jax.random.normal(next(keys), (seq, d)) * 0.02,
        "blocks": [
            {
                "ln1": ln(),
                "q": lin(d, d),
                "k": lin(d, d),
                "v": lin(d, d),
                "proj": lin(d, d),
                "ln2": ln(),
                "fc1": lin(d, 4 * d),
                "fc2": lin(4 * d, d),
            }
            for _ in range(blocks)
        ],
        "ln_f": ln(),
        "head": _init(next(keys), (d, vocab), d),
    }
    tokens = jax.random.randint(next(keys), (batch, seq + 1), 0, vocab)
    x, y = tokens[:, :-1], tokens[:, 1:]
    hd = d // heads

    def loss_rf(params, batch):
        idx, targets = batch
        b, t = idx.shape
        h = rf.embedding(idx, params["wte"]) + params["wpe"]
        for blk in params["blocks"]:
            a = rf.layer_norm(h, blk["ln1"]["weight"], blk["ln1"]["bias"])
            q, k, v = (
                rf.add_bias(a @ blk[n]["weight"], blk[n]["bias"]).reshape(b, t, heads, hd).transpose(1, 2)
                for n in "qkv"
            )
            att = rf.scaled_dot_product_attention(q, k, v, causal=True).transpose(1, 2).reshape(b, t, d)
            h = h + rf.add_bias(att @ blk["proj"]["weight"], blk["proj"]["bias"])
            m = rf.layer_norm(h, blk["ln2"]["weight"], blk["ln2"]["bias"])
            m = rf.gelu(rf.add_bias(m @ blk["fc1"]["weight"], blk["fc1"]["bias"]))
            h = h + rf.add_bias(m @ blk["fc2"]["weight"], blk["fc2"]["bias"])
        h = rf.layer_norm(h, params["ln_f"]["weight"], params["ln_f"]["bias"])
        return rf.cross_entropy(h @ params["head"], targets)

    return Model(
        f"TinyGPT d{d} h{heads} L{blocks} T{seq} b{batch}",
        loss_rf,
        gpt_loss_jax(heads),
        params,
        (x, y),
        lambda: _torch_gpt(params, (x, y), heads),
    )


def _layer_norm_jax(x: jax.Array, p: dict) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + 1e-5) * p["weight"] + p["bias"]


def gpt_loss_jax(heads: int, remat: bool = False) -> Callable[[Any, Any], Any]:
    """TinyGPT's plain-JAX loss (``tiny_gpt``'s ``loss_jax``); with ``remat``,
    each transformer block inside ``jax.checkpoint``."""

    def block(h: jax.Array, blk: dict, causal: jax.Array) -> jax.Array:
        b, t, d = h.shape
        hd = d // heads
        a = _layer_norm_jax(h, blk["ln1"])
        q, k, v = (
            (a @ blk[n]["weight"] + blk[n]["bias"]).reshape(b, t, heads, hd).transpose(0, 2, 1, 3) for n in "qkv"
        )
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(hd)
        s = jnp.where(causal[None, None], s, -jnp.inf)
        att = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)
        att = att.transpose(0, 2, 1, 3).reshape(b, t, d)
        h = h + att @ blk["proj"]["weight"] + blk["proj"]["bias"]
        m = jax.nn.gelu(_layer_norm_jax(h, blk["ln2"]) @ blk["fc1"]["weight"] + blk["fc1"]["bias"])
        return h + m @ blk["fc2"]["weight"] + blk["fc2"]["bias"]

    step = jax.checkpoint(block) if remat else block

    def loss_jax(params, batch):
        idx, targets = batch
        t = idx.shape[1]
        h = params["wte"][idx] + params["wpe"][None]
        causal = jnp.tril(jnp.ones((t, t), bool))
        for blk in params["blocks"]:
            h = step(h, blk, causal)
        h = _layer_norm_jax(h, params["ln_f"])
        return _ce_jax(h @ params["head"], targets)

    return loss_jax


MODELS: dict[str, Callable[[], Model]] = {"mlp": mlp, "cnn": cnn, "gpt": tiny_gpt}


# ---------------------------------------------------------------------------
# A chain of tiny ops: what one recorded op costs eagerly
# ---------------------------------------------------------------------------

CHAIN_OPS = 200


def chain_rf(x: Any, n: int = CHAIN_OPS) -> Any:
    """``n`` tiny elementwise ops (scale, shift, tanh, relu in turn) on ``x``, then a sum."""
    h = x
    for i in range(n - 1):
        r = i % 4
        h = h * 1.01 if r == 0 else h + 0.1 if r == 1 else rf.tanh(h) if r == 2 else rf.relu(h)
    return rf.sum(h)


def chain_torch(x: Any, n: int = CHAIN_OPS) -> Any:
    """The same chain in PyTorch."""
    import torch

    h = x
    for i in range(n - 1):
        r = i % 4
        h = h * 1.01 if r == 0 else h + 0.1 if r == 1 else torch.tanh(h) if r == 2 else torch.relu(h)
    return h.sum()


# ---------------------------------------------------------------------------
# PyTorch eager equivalents (an extra column when torch is installed)
# ---------------------------------------------------------------------------


def _to_torch(tree: Any, grad: bool = True) -> Any:
    import torch

    def conv(a):
        t = torch.from_numpy(np.array(a))
        return t.requires_grad_(grad) if t.is_floating_point() else t.long()

    return jax.tree_util.tree_map(conv, tree)


def _torch_mlp(params, batch):
    import torch.nn.functional as F

    p = _to_torch(params)
    x, y = _to_torch(batch, grad=False)

    def step():
        h = x
        for i, layer in enumerate(p):
            h = h @ layer["weight"] + layer["bias"]
            if i < len(p) - 1:
                h = F.relu(h)
        F.cross_entropy(h, y).backward()

    return step


def _torch_cnn(params, batch):
    import torch.nn.functional as F

    p = _to_torch(params)
    x, y = _to_torch(batch, grad=False)

    def step():
        h = x
        for conv, bn in (("conv1", "bn1"), ("conv2", "bn2")):
            h = F.conv2d(h, p[conv]["weight"], p[conv]["bias"], padding=1)
            h = F.batch_norm(h, None, None, p[bn]["weight"], p[bn]["bias"], training=True)
            h = F.max_pool2d(F.relu(h), 2)
        logits = h.flatten(1) @ p["fc"]["weight"] + p["fc"]["bias"]
        F.cross_entropy(logits, y).backward()

    return step


def _torch_gpt(params, batch, heads):
    import torch.nn.functional as F

    p = _to_torch(params)
    idx, y = _to_torch(batch, grad=False)

    def step():
        b, t = idx.shape
        d = p["wte"].shape[1]
        h = p["wte"][idx] + p["wpe"][None]
        for blk in p["blocks"]:
            a = F.layer_norm(h, (d,), blk["ln1"]["weight"], blk["ln1"]["bias"])
            q, k, v = ((a @ blk[n]["weight"] + blk[n]["bias"]).view(b, t, heads, -1).transpose(1, 2) for n in "qkv")
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            h = h + att @ blk["proj"]["weight"] + blk["proj"]["bias"]
            m = F.layer_norm(h, (d,), blk["ln2"]["weight"], blk["ln2"]["bias"])
            m = F.gelu(m @ blk["fc1"]["weight"] + blk["fc1"]["bias"], approximate="tanh")
            h = h + m @ blk["fc2"]["weight"] + blk["fc2"]["bias"]
        h = F.layer_norm(h, (d,), p["ln_f"]["weight"], p["ln_f"]["bias"])
        F.cross_entropy((h @ p["head"]).reshape(b * t, -1), y.reshape(-1)).backward()

    return step


if __name__ == "__main__":  # pragma: no cover
    from .compare import main

    main()
