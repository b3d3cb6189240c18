"""The digits CNN shared by train_cnn.py, data_parallel.py and inspect_tape.py.

Data: scikit-learn's bundled 8x8 handwritten digits (1797 images, no download),
split 80/20 (stratified) into train and test sets, pixels scaled to [0, 1].

Model: three conv-bn-relu stages with max pooling, then a linear classifier::

    [B, 1, 8, 8] -> conv 3x3 (32) bn relu                -> [B, 32, 8, 8]
                 -> conv 3x3 (64) bn relu, max pool 2    -> [B, 64, 4, 4]
                 -> conv 3x3 (128) bn relu, max pool 2   -> [B, 128, 2, 2]
                 -> flatten, linear                      -> [B, 10]

Parameters and BatchNorm running statistics are plain dicts of jax arrays.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import rumus_fx as rf

NUM_CLASSES = 10


def load_digits_split(seed: int = 0, test_size: float = 0.2) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)``: images ``[N, 1, 8, 8]`` float32 in
    [0, 1] and int32 labels."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[:, None, :, :]
    y = digits.target.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_size, random_state=seed, stratify=y)
    return x_tr, y_tr, x_te, y_te


class DigitsCNN:
    """conv-bn-relu(-pool) x3 -> flatten -> linear, on rf.nn layers."""

    def __init__(self, widths: tuple[int, int, int] = (32, 64, 128)) -> None:
        c1, c2, c3 = widths
        self.convs = (
            rf.nn.Conv2d(1, c1, 3, padding=1),
            rf.nn.Conv2d(c1, c2, 3, padding=1),
            rf.nn.Conv2d(c2, c3, 3, padding=1),
        )
        self.bns = tuple(rf.nn.BatchNorm2d(c) for c in widths)
        self.pool = rf.nn.MaxPool2d(2)
        self.flatten = rf.nn.Flatten()
        self.head = rf.nn.Linear(c3 * 2 * 2, NUM_CLASSES)

    def init(self, key: jax.Array) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(params, state)``: parameters and BatchNorm running statistics."""
        keys = jax.random.split(key, 4)
        params = {f"conv{i}": conv.init(k) for i, (conv, k) in enumerate(zip(self.convs, keys))}
        params |= {f"bn{i}": bn.init(keys[i]) for i, bn in enumerate(self.bns)}
        params["head"] = self.head.init(keys[3])
        state = {f"bn{i}": bn.init_state() for i, bn in enumerate(self.bns)}
        return params, state

    def apply(self, params: dict, state: dict, x: Any, *, training: bool) -> tuple[rf.Tensor, dict]:
        """``(logits, new_state)`` for images ``x:[B, 1, 8, 8]``."""
        new_state = {}
        for i, (conv, bn) in enumerate(zip(self.convs, self.bns)):
            x = conv(params[f"conv{i}"], x)
            x, new_state[f"bn{i}"] = bn(params[f"bn{i}"], x, state[f"bn{i}"], training=training)
            x = rf.relu(x)
            if i > 0:
                x = self.pool(x)
        return self.head(params["head"], self.flatten(x)), new_state

    def loss(self, params: dict, state: dict, x: Any, y: Any) -> tuple[rf.Tensor, dict]:
        """Mean cross-entropy (training mode) and the updated BatchNorm state."""
        logits, new_state = self.apply(params, state, x, training=True)
        return rf.cross_entropy(logits, y), new_state

    def predict(self, params: dict, state: dict, x: Any) -> jax.Array:
        """Logits in eval mode (running statistics), as a jax array."""
        logits, _ = self.apply(params, state, x, training=False)
        return logits.value


def accuracy(logits: jax.Array, labels: Any) -> float:
    return float(jnp.mean(jnp.argmax(logits, axis=-1) == jnp.asarray(labels)))


def num_params(tree: Any) -> int:
    return sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(tree))
