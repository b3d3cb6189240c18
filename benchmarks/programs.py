"""rumus_fx vs jax.grad on the round-2 programs, in one process (ratios).

Usage: ``python -m benchmarks.programs [--repeats N]``

- the LLaMA-style decoder of ``examples/train_llama.py`` (layers in one scan, a
  checkpoint per layer): ``rf.value_and_grad`` of the rnp / rf.lax.scan /
  rf.checkpoint model vs ``jax.value_and_grad`` of the same model written with
  jnp / jax.lax.scan / jax.checkpoint;
- the WGAN-GP critic step of ``examples/gradient_penalty.py``: ``rf.grad`` inside
  ``rf.value_and_grad`` vs ``jax.grad`` inside ``jax.value_and_grad``.

Both sides are checked to agree first; then the jit-compiled steps are timed
interleaved (medians) and trace + compile is timed three times each (median).
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import rumus_fx as rf

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import gradient_penalty as gp
import train_llama as llama

from .compare import _interleaved


def _compile(fun, args) -> float:
    times = []
    for _ in range(3):
        wrapped = jax.jit(lambda *a: fun(*a))
        t0 = time.perf_counter()
        wrapped.lower(*args).compile()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _row(name, f_rf, f_jax, args, repeats):
    out_rf, out_j = jax.jit(f_rf)(*args), jax.jit(f_jax)(*args)
    for a, b in zip(jax.tree.leaves(out_rf), jax.tree.leaves(out_j)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-4)
    c_rf, c_j = _compile(f_rf, args), _compile(f_jax, args)
    j_rf, j_j = jax.jit(f_rf), jax.jit(f_jax)
    t_rf, t_j = _interleaved([lambda: j_rf(*args), lambda: j_j(*args)], repeats)
    return (
        f"| {name} | {t_rf / t_j:.2f} ({1e3 * t_rf:.1f} / {1e3 * t_j:.1f} ms) "
        f"| {c_rf / c_j:.2f} ({c_rf:.2f} / {c_j:.2f} s) |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.default_backend()} ({platform.processor() or platform.machine()})")
    rows = []

    cfg = llama.Config(vocab=96, block=64, dim=128, heads=4, layers=4)
    params = llama.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab, (16, cfg.block)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, cfg.vocab, (16, cfg.block)), jnp.int32)
    for remat in (True, False):
        f_rf = rf.value_and_grad(functools.partial(llama.loss_fn, cfg=cfg, ops=llama.RF_OPS, remat=remat))
        f_j = jax.value_and_grad(functools.partial(llama.loss_fn, cfg=cfg, ops=llama.JAX_OPS, remat=remat))
        name = f"LLaMA d128 L4 T64 b16, {'checkpoint per layer' if remat else 'no checkpoint'}"
        rows.append(_row(name, f_rf, f_j, (params, tokens, targets), args.repeats))
        print(rows[-1], flush=True)

    critic = gp.init_mlp(jax.random.key(1), (2, 128, 128, 1))
    k = jax.random.split(jax.random.key(2), 3)
    real = jax.random.normal(k[0], (256, 2))
    fake = jax.random.normal(k[1], (256, 2))
    eps = jax.random.uniform(k[2], (256, 1))
    f_rf = rf.value_and_grad(gp.critic_loss, has_aux=True)
    f_j = jax.value_and_grad(functools.partial(gp.critic_loss, critic=gp.mlp_jnp, grad=jax.grad, np_=jnp), has_aux=True)
    rows.append(
        _row(
            "WGAN-GP critic step (grad of grad), MLP 2-128-128-1 b256",
            f_rf,
            f_j,
            (critic, real, fake, eps),
            args.repeats,
        )
    )
    print(rows[-1], flush=True)
    print()
    print("| program | jit step rf / jax.grad | trace + compile rf / jax |")
    print("|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":  # pragma: no cover
    main()
