"""Per-example gradients: ``jax.vmap`` of ``rf.grad``.

rf.grad records a tape while tracing, so ``jax.vmap`` simply batches the
recorded forward and the hand-written backward records: one call gives the
gradient of every example's own loss (what DP-SGD clipping or influence
estimates need) without a Python loop.

    python examples/per_example_grads.py
    python examples/per_example_grads.py --batch 8
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.datasets import load_digits

import rumus_fx as rf


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    # Data: flattened 8x8 digits (64 features), labels 0..9.
    digits = load_digits()
    x = jnp.asarray(digits.data[: args.batch] / 16.0, jnp.float32)  # [B, 64]
    y = jnp.asarray(digits.target[: args.batch], jnp.int32)  # [B]

    # A small MLP from rf.nn layers; params is a plain dict of arrays.
    mlp = rf.nn.Sequential([rf.nn.Linear(64, 32), rf.tanh, rf.nn.Linear(32, 10)])
    params = mlp.init(jax.random.key(args.seed))

    # The loss of ONE example: x_i is [64], y_i a scalar label (Linear accepts a vector).
    def example_loss(params, x_i, y_i):
        return rf.cross_entropy(mlp(params, x_i), y_i)

    # vmap over the examples, not over the parameters: one gradient pytree per example,
    # each leaf with a leading batch axis.
    per_example = jax.jit(jax.vmap(rf.grad(example_loss), in_axes=(None, 0, 0)))(params, x, y)
    for name, g in jax.tree_util.tree_leaves_with_path(per_example):
        print(f"per-example grad {jax.tree_util.keystr(name, simple=True, separator='.')}: shape {g.shape}")

    # Check 1: their mean is the gradient of the mean loss over the batch.
    batch_loss = lambda params: rf.cross_entropy(mlp(params, x), y)  # noqa: E731
    batch_grad = rf.grad(batch_loss)(params)
    mean_err = max(
        float(jnp.max(jnp.abs(jnp.mean(g, axis=0) - b)))
        for g, b in zip(jax.tree_util.tree_leaves(per_example), jax.tree_util.tree_leaves(batch_grad))
    )
    print(f"mean of per-example grads vs batch grad: max abs diff {mean_err:.2e}")

    # Check 2: JAX's own autodiff of the same maths in plain jax.numpy (the oracle).
    def jnp_loss(params, x_i, y_i):
        h = jnp.tanh(x_i @ params["0"]["weight"] + params["0"]["bias"])
        logits = h @ params["2"]["weight"] + params["2"]["bias"]
        return -jax.nn.log_softmax(logits)[y_i]

    oracle = jax.jit(jax.vmap(jax.grad(jnp_loss), in_axes=(None, 0, 0)))(params, x, y)
    oracle_err = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree_util.tree_leaves(per_example), jax.tree_util.tree_leaves(oracle))
    )
    print(f"vs jax.vmap(jax.grad(...)) of the jnp version: max abs diff {oracle_err:.2e}")

    # A use: per-example gradient norms (DP-SGD clips these; large ones flag hard examples).
    norms = jnp.sqrt(
        sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in jax.tree_util.tree_leaves(per_example))
    )
    top = np.argsort(-np.asarray(norms))[:3]
    print(
        "largest per-example gradient norms: "
        + ", ".join(f"#{i} (label {int(y[i])}): {float(norms[i]):.3f}" for i in top)
    )
    assert mean_err < 1e-5 and oracle_err < 1e-5, "per-example gradients disagree"
    return max(mean_err, oracle_err)


if __name__ == "__main__":
    main()
