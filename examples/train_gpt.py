"""A character-level TinyGPT trained on Python's own standard library source.

The corpus ships with every Python installation: the ``.py`` files of the
standard library (found with ``sysconfig``), concatenated in sorted order,
restricted to printable ASCII. The model is GPT-2 shaped but tiny: token and
position embeddings, pre-norm ``rf.nn.TransformerBlock``s with causal
attention, a final LayerNorm and a linear head, trained with
``rf.value_and_grad`` + optax AdamW under ``jax.jit``. It reports the
validation loss (nats per character) and prints a generated sample.

    python examples/train_gpt.py                      # ~1-2 minutes on 2 CPU cores
    python examples/train_gpt.py --steps 5 --chars 20000 --sample-len 20    # smoke run
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import rumus_fx as rf

# ---------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------


def stdlib_corpus(max_chars: int) -> str:
    """Up to ``max_chars`` characters of the standard library's top-level ``.py``
    files (sorted, so the corpus is deterministic for a Python version)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    if not files:
        raise SystemExit(f"no standard-library sources found under {stdlib}")
    parts, total = [], 0
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read().replace("\t", "    ")
        # printable ASCII + newline only: keeps the vocabulary small (<= 96 symbols)
        text = "".join(c if (" " <= c <= "~" or c == "\n") else "?" for c in text)
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


class CharVocab:
    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        return np.array([self.index[c] for c in text], dtype=np.int32)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


# ---------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------


class TinyGPT:
    """tokens [B, T] -> logits [B, T, vocab]."""

    def __init__(self, vocab: int, block: int, dim: int, heads: int, layers: int) -> None:
        self.block = block
        self.tok = rf.nn.Embedding(vocab, dim)
        self.pos = rf.nn.Embedding(block, dim)
        self.blocks = [rf.nn.TransformerBlock(dim, heads) for _ in range(layers)]
        self.ln_f = rf.nn.LayerNorm(dim)
        self.head = rf.nn.Linear(dim, vocab)

    def init(self, key: jax.Array) -> dict:
        k_tok, k_pos, k_head, *k_blocks = jax.random.split(key, 3 + len(self.blocks))
        params = {
            "tok": self.tok.init(k_tok),
            "pos": self.pos.init(k_pos),
            "blocks": [b.init(k) for b, k in zip(self.blocks, k_blocks)],
            "ln_f": self.ln_f.init(k_head),
            "head": self.head.init(k_head),
        }
        # GPT-2 style: small embeddings (PyTorch's N(0, 1) default is meant for other uses)
        for name in ("tok", "pos"):
            params[name]["weight"] = params[name]["weight"] * 0.02
        return params

    def __call__(self, params: dict, tokens) -> rf.Tensor:
        t = tokens.shape[-1]
        pos = self.pos(params["pos"], jnp.arange(t))  # [T, D], the same for every sequence
        x = self.tok(params["tok"], tokens) + rf.reshape(pos, (1, t, -1))
        for block, p in zip(self.blocks, params["blocks"]):
            x = block(p, x, causal=True)
        return self.head(params["head"], self.ln_f(params["ln_f"], x))

    def loss(self, params: dict, tokens, targets) -> rf.Tensor:
        return rf.cross_entropy(self(params, tokens), targets)


def sample_batch(data: np.ndarray, rng: np.random.Generator, batch: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    starts = rng.integers(0, len(data) - block - 1, size=batch)
    x = np.stack([data[s : s + block] for s in starts])
    y = np.stack([data[s + 1 : s + block + 1] for s in starts])
    return x, y


def generate(model: TinyGPT, params: dict, prompt: np.ndarray, length: int, key: jax.Array, temperature: float):
    """Sample ``length`` characters after ``prompt`` (a window of ``block``
    tokens; with causal attention, padding on the right changes nothing)."""

    @jax.jit
    def next_logits(params, window, pos):
        logits = model(params, window[None]).value[0]
        return jax.lax.dynamic_index_in_dim(logits, pos, keepdims=False)

    block = model.block
    ids = list(prompt[-block:])
    for i in range(length):
        window = ids[-block:]
        pos = len(window) - 1
        window = np.pad(np.asarray(window, np.int32), (0, block - len(window)))
        logits = next_logits(params, window, pos)
        ids.append(int(jax.random.categorical(jax.random.fold_in(key, i), logits / temperature)))
    return ids[len(prompt[-block:]) :]


# ---------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--block", type=int, default=64, help="context length in characters")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--chars", type=int, default=2_000_000, help="corpus size in characters")
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--sample-len", type=int, default=300)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
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

    model = TinyGPT(len(vocab), args.block, args.dim, args.heads, args.layers)
    params = model.init(jax.random.key(args.seed))
    n_params = sum(a.size for a in jax.tree_util.tree_leaves(params))
    print(f"TinyGPT: {args.layers} blocks, dim {args.dim}, {args.heads} heads, {n_params:,} parameters")
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(100, args.steps // 10 + 1), max(args.steps, 2))
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    opt_state = opt.init(params)

    @jax.jit
    def train_step(params, opt_state, x, y):
        loss, grads = rf.value_and_grad(model.loss)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    eval_loss = jax.jit(lambda p, x, y: model.loss(p, x, y).value)

    def val_loss(params) -> float:
        rng = np.random.default_rng(1234)  # the same validation batches every time
        return float(
            np.mean(
                [
                    eval_loss(params, *sample_batch(val, rng, args.batch_size, args.block))
                    for _ in range(args.eval_batches)
                ]
            )
        )

    rng = np.random.default_rng(args.seed)
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

    ckpt = os.path.join(args.out, "tiny_gpt.safetensors")
    rf.nn.save(ckpt, params)
    print(f"checkpoint: {ckpt}")

    prompt = vocab.encode("def ")
    ids = generate(model, params, prompt, args.sample_len, jax.random.key(args.seed + 1), args.temperature)
    print("sample:\n" + "-" * 60 + "\ndef " + vocab.decode(ids) + "\n" + "-" * 60)
    return final


if __name__ == "__main__":
    main()
