"""A small LLaMA-style decoder, its layers run with ``rf.lax.scan`` and ``rf.checkpoint``.

The model is LLaMA shaped but tiny: token embedding, pre-norm decoder layers with
RMSNorm, rotary position embeddings (RoPE) on the queries and keys, causal
multi-head attention and a SwiGLU MLP, a final RMSNorm and an untied head. The
layers' parameters are stacked along a leading axis and run with one
``rf.lax.scan`` over the layers (the layer is recorded once on the tape, not once
per layer); ``rf.checkpoint`` around the layer body (inside the scan) keeps only
each layer's input for the backward pass and recomputes the rest.

The model is written once, against a small namespace bundle (``Ops``): with
``RF_OPS`` (``rumus_fx.numpy``, ``rf.lax.scan``, ``rf.checkpoint``) it runs on
rf's tape and is differentiated with ``rf.value_and_grad``; with ``JAX_OPS``
(``jax.numpy``, ``jax.lax.scan``, ``jax.checkpoint``) the very same function is
plain JAX, which ``jax.value_and_grad`` differentiates (the tests compare the
two). It is trained with ``jax.jit(rf.value_and_grad(loss))`` + optax AdamW on the
same corpus as ``train_gpt.py`` (Python's standard library source), and reports
the validation loss, a generated sample and the compiled train step's temporary
memory with and without checkpointing.

    python examples/train_llama.py                    # ~1-2 minutes on 2 CPU cores
    python examples/train_llama.py --steps 5 --chars 20000 --sample-len 20    # smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import sysconfig
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import rumus_fx as rf
import rumus_fx.numpy as rnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import CharVocab, sample_batch, stdlib_corpus  # the GPT example's data

# ---------------------------------------------------------------------------
# the namespaces the model is written against
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ops:
    """What the model calls: a numpy namespace, jax.nn's functions, a scan and a
    rematerialisation transform."""

    np: Any
    nn: Any
    scan: Callable
    checkpoint: Callable


RF_OPS = Ops(np=rnp, nn=rf.nn, scan=rf.lax.scan, checkpoint=rf.checkpoint)  # on rf's tape
JAX_OPS = Ops(np=jnp, nn=jax.nn, scan=jax.lax.scan, checkpoint=jax.checkpoint)  # plain JAX


def as_array(x: Any) -> jax.Array:
    """An rf Tensor's value (or the array itself)."""
    return x.value if isinstance(x, rf.Tensor) else x


# ---------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int
    block: int = 64  # context length
    dim: int = 128
    heads: int = 4
    layers: int = 4
    hidden: int = 0  # SwiGLU width; 0: 8/3 * dim rounded up to a multiple of 32
    rope_base: float = 10000.0

    @property
    def mlp(self) -> int:
        return self.hidden or 32 * math.ceil(8 * self.dim / 3 / 32)

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


def init_params(cfg: Config, key: jax.Array, dtype: Any = jnp.float32) -> dict:
    """Parameters; the layers' arrays are stacked along a leading ``[layers]`` axis."""
    d, h, n = cfg.dim, cfg.mlp, cfg.layers
    ks = jax.random.split(key, 9)

    def normal(k, shape, fan_in, depth_scale=1.0):
        return (jax.random.normal(k, shape) * depth_scale / math.sqrt(fan_in)).astype(dtype)

    out_scale = 1.0 / math.sqrt(2 * n)  # residual-branch outputs scaled down with depth
    return {
        "embed": (0.02 * jax.random.normal(ks[0], (cfg.vocab, d))).astype(dtype),
        "layers": {
            "attn_norm": jnp.ones((n, d), dtype),
            "wq": normal(ks[1], (n, d, d), d),
            "wk": normal(ks[2], (n, d, d), d),
            "wv": normal(ks[3], (n, d, d), d),
            "wo": normal(ks[4], (n, d, d), d, out_scale),
            "mlp_norm": jnp.ones((n, d), dtype),
            "w_gate": normal(ks[5], (n, d, h), d),
            "w_up": normal(ks[6], (n, d, h), d),
            "w_down": normal(ks[7], (n, h, d), h, out_scale),
        },
        "norm": jnp.ones((d,), dtype),
        "head": (0.02 * jax.random.normal(ks[8], (d, cfg.vocab))).astype(dtype),  # starts near uniform
    }


def rope_tables(cfg: Config, t: int, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the rotary angles, ``[T, head_dim]`` each (constants)."""
    half = cfg.head_dim // 2
    inv_freq = cfg.rope_base ** (-np.arange(half) / half)
    angles = np.arange(t)[:, None] * inv_freq[None, :]  # [T, half]
    angles = np.concatenate([angles, angles], axis=-1)  # [T, head_dim]
    return jnp.asarray(np.cos(angles), dtype), jnp.asarray(np.sin(angles), dtype)


def rms_norm(ops: Ops, x: Any, gain: Any, eps: float = 1e-5) -> Any:
    """``x / rms(x) * gain`` over the last axis."""
    np_ = ops.np
    ms = np_.mean(x * x, axis=-1, keepdims=True)
    return x / np_.sqrt(ms + eps) * np_.reshape(gain, (1,) * (x.ndim - 1) + (-1,))


def apply_rope(ops: Ops, x: Any, cos: jax.Array, sin: jax.Array) -> Any:
    """Rotate ``x:[B, H, T, hd]`` by position (the rotate-half form of RoPE)."""
    np_ = ops.np
    half = x.shape[-1] // 2
    rotated = np_.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[None, None] + rotated * sin[None, None]


def decoder_layer(ops: Ops, cfg: Config, p: dict, x: Any, cos: jax.Array, sin: jax.Array) -> Any:
    """One pre-norm layer: ``x + attn(norm(x))``, then ``+ swiglu(norm(x))``.
    ``p`` holds one layer's slice of the stacked parameters."""
    np_, nn = ops.np, ops.nn
    b, t, d = x.shape
    nh, hd = cfg.heads, cfg.head_dim

    def heads(v):  # [B, T, D] -> [B, H, T, hd]
        return np_.transpose(np_.reshape(v, (b, t, nh, hd)), (0, 2, 1, 3))

    h = rms_norm(ops, x, p["attn_norm"])
    q = apply_rope(ops, heads(h @ p["wq"]), cos, sin)
    k = apply_rope(ops, heads(h @ p["wk"]), cos, sin)
    v = heads(h @ p["wv"])
    scores = q @ np_.swapaxes(k, -1, -2) / math.sqrt(hd)  # [B, H, T, T]
    causal = np.tril(np.ones((t, t), bool))[None, None]
    scores = np_.where(causal, scores, -1e9)
    attn = nn.softmax(scores, axis=-1) @ v  # [B, H, T, hd]
    x = x + np_.reshape(np_.transpose(attn, (0, 2, 1, 3)), (b, t, d)) @ p["wo"]

    h = rms_norm(ops, x, p["mlp_norm"])
    return x + (nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]


def forward(params: dict, tokens: Any, cfg: Config, ops: Ops = RF_OPS, remat: bool = True) -> Any:
    """tokens ``[B, T]`` (integers) -> logits ``[B, T, vocab]``."""
    t = tokens.shape[-1]
    dtype = params["embed"].dtype
    cos, sin = rope_tables(cfg, t, dtype)
    # the embedding as a one-hot matmul: the same dot_general in rf and in JAX
    x = jax.nn.one_hot(tokens, cfg.vocab, dtype=dtype) @ params["embed"]

    def layer(p, x):
        return decoder_layer(ops, cfg, p, x, cos, sin)

    if remat:
        layer = ops.checkpoint(layer)

    def body(x, p):  # one scan step per layer, over the stacked parameters
        return layer(p, x), None

    x, _ = ops.scan(body, x, params["layers"])
    return rms_norm(ops, x, params["norm"]) @ params["head"]


def loss_fn(params: dict, tokens: Any, targets: Any, cfg: Config, ops: Ops = RF_OPS, remat: bool = True) -> Any:
    """Mean next-character cross-entropy (nats)."""
    np_ = ops.np
    logits = forward(params, tokens, cfg, ops, remat)
    onehot = jax.nn.one_hot(targets, cfg.vocab, dtype=logits.dtype)
    return -np_.mean(np_.sum(onehot * ops.nn.log_softmax(logits, axis=-1), axis=-1))


def generate(params: dict, cfg: Config, prompt: np.ndarray, length: int, key: jax.Array, temperature: float) -> list:
    """Sample ``length`` characters after ``prompt`` (greedy if temperature is 0);
    the window of ``block`` tokens is padded on the right, which causal attention
    ignores."""

    @jax.jit
    def next_logits(params, window, pos):
        logits = as_array(forward(params, window[None], cfg))[0]
        return jax.lax.dynamic_index_in_dim(logits, pos, keepdims=False)

    ids = list(prompt[-cfg.block :])
    n0 = len(ids)
    for i in range(length):
        window = ids[-cfg.block :]
        pos = len(window) - 1
        window = np.pad(np.asarray(window, np.int32), (0, cfg.block - len(window)))
        logits = next_logits(params, window, pos)
        if temperature <= 0:
            ids.append(int(jnp.argmax(logits)))
        else:
            ids.append(int(jax.random.categorical(jax.random.fold_in(key, i), logits / temperature)))
    return ids[n0:]


# ---------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------


def make_train_step(cfg: Config, opt: optax.GradientTransformation, remat: bool) -> Callable:
    """``jax.jit(rf.value_and_grad(loss))`` + an optax update."""
    loss = functools.partial(loss_fn, cfg=cfg, ops=RF_OPS, remat=remat)

    @jax.jit
    def train_step(params, opt_state, x, y):
        value, grads = rf.value_and_grad(loss)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return train_step


def temp_bytes(step: Callable, *args: Any) -> int:
    """The compiled step's temporary (activation and scratch) memory."""
    return int(step.lower(*args).compile().memory_analysis().temp_size_in_bytes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block", type=int, default=64, help="context length in characters")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--chars", type=int, default=2_000_000, help="corpus size in characters")
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--sample-len", type=int, default=300)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--no-checkpoint", action="store_true", help="train without rf.checkpoint around the layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    text = stdlib_corpus(args.chars)
    vocab = CharVocab(text)
    data = vocab.encode(text)
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    if len(val) <= args.block + 1:
        raise SystemExit(f"--chars {args.chars} is too small for --block {args.block}")
    print(
        f"corpus: {len(text):,} characters of Python {sys.version.split()[0]} standard library source "
        f"({sysconfig.get_paths()['stdlib']}), vocabulary {len(vocab)}"
    )

    cfg = Config(vocab=len(vocab), block=args.block, dim=args.dim, heads=args.heads, layers=args.layers)
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(args.seed))
    n_params = sum(a.size for a in jax.tree_util.tree_leaves(params))
    print(
        f"LLaMA-style decoder: {cfg.layers} layers (one rf.lax.scan), dim {cfg.dim}, {cfg.heads} heads, "
        f"SwiGLU {cfg.mlp}, RoPE, {n_params:,} parameters"
    )
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(100, args.steps // 10 + 1), max(args.steps, 2))
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    opt_state = opt.init(params)

    rng = np.random.default_rng(args.seed)
    example = (params, opt_state, *sample_batch(train, rng, args.batch_size, args.block))
    steps = {remat: make_train_step(cfg, opt, remat) for remat in (True, False)}
    mem = {remat: temp_bytes(steps[remat], *example) for remat in (True, False)}
    print(
        f"compiled train step temp memory: {mem[True] / 2**20:.2f} MiB with rf.checkpoint, "
        f"{mem[False] / 2**20:.2f} MiB without ({mem[False] / max(mem[True], 1):.1f}x)"
    )
    remat = not args.no_checkpoint
    train_step = steps[remat]
    print(f"training {'with' if remat else 'without'} rf.checkpoint")

    eval_loss = jax.jit(lambda p, x, y: as_array(loss_fn(p, x, y, cfg)))

    def val_loss(params) -> float:
        vrng = np.random.default_rng(1234)  # the same validation batches every time
        batches = [sample_batch(val, vrng, args.batch_size, args.block) for _ in range(args.eval_batches)]
        return float(np.mean([eval_loss(params, x, y) for x, y in batches]))

    t0 = time.perf_counter()
    print(f"step 0: val loss {val_loss(params):.3f} (uniform guess: {math.log(len(vocab)):.3f})")
    bar = tqdm(range(1, args.steps + 1), desc="train", unit="step", disable=args.no_progress, dynamic_ncols=True)
    eval_every = max(args.steps // 5, 1)
    for step in bar:
        params, opt_state, loss = train_step(params, opt_state, *sample_batch(train, rng, args.batch_size, args.block))
        if step % 10 == 0 or step == args.steps:
            bar.set_postfix(loss=f"{float(loss):.3f}")
        if step % eval_every == 0 or step == args.steps:
            bar.write(f"step {step}: train loss {float(loss):.3f}, val loss {val_loss(params):.3f}")
    bar.close()
    final = val_loss(params)
    elapsed = time.perf_counter() - t0
    print(
        f"final val loss: {final:.3f} nats/char ({final / math.log(2):.2f} bits/char) after {args.steps} steps in {elapsed:.1f}s"
    )

    prompt = vocab.encode("def ")
    ids = generate(params, cfg, prompt, args.sample_len, jax.random.key(args.seed + 1), args.temperature)
    print("sample:\n" + "-" * 60 + "\ndef " + vocab.decode(ids) + "\n" + "-" * 60)
    return final


if __name__ == "__main__":
    main()
