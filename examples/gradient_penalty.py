"""Second-order reverse mode with rf: a WGAN-GP gradient penalty and a MAML step.

Part 1, WGAN-GP on a ring of eight Gaussians (2-D): a critic (GELU) and a
generator (ReLU), both MLPs of ``rf.nn.Linear`` layers. The critic's loss is
``E[D(fake)] - E[D(real)] + lambda * E[(||grad_x D(x_hat)||_2 - 1)^2]`` at points
``x_hat`` between real and fake samples (``lambda = 1`` by default); the input
gradient ``grad_x D`` is an inner ``rf.grad`` taken inside the outer
``rf.value_and_grad`` with respect to the critic's parameters, so the outer
backward differentiates a backward pass (recorded on the outer tape). Training is
``jax.jit`` + optax Adam, five critic steps per generator step; it prints the
Wasserstein estimate and the penalty, how well the generator covers the modes,
and the critic-step gradient against ``jax.grad`` of ``jax.grad`` of the same
critic written in jax.numpy.

Part 2, MAML on sine regression (``A sin(x + phase)``, a tanh MLP): one inner SGD
step per task with ``rf.grad``, the outer (meta) gradient taken through it with
``rf.value_and_grad``, ``jax.vmap``'d over a batch of tasks; it prints the
held-out query loss before and after one adaptation step, and the meta-gradient
against ``jax.grad`` through ``jax.grad``.

    python examples/gradient_penalty.py               # both parts, ~1 minute on 2 CPU cores
    python examples/gradient_penalty.py --only maml --maml-steps 5    # smoke run of one part
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import rumus_fx as rf
import rumus_fx.numpy as rnp

Params = list  # [{"weight": [in, out], "bias": [out]}, ...]


# ---------------------------------------------------------------------------
# MLPs: with rf ops (rf.nn.Linear), and the same in jax.numpy (the oracle)
# ---------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(1, 2))
def init_mlp(key: jax.Array, sizes: tuple[int, ...], dtype: Any = jnp.float32) -> Params:
    keys = jax.random.split(key, len(sizes) - 1)
    params = [rf.nn.Linear(m, n).init(k) for k, m, n in zip(keys, sizes[:-1], sizes[1:])]
    return jax.tree.map(lambda a: a.astype(dtype), params)


def mlp_rf(params: Params, x: Any, act: Callable = rf.gelu) -> rf.Tensor:
    """``rf.nn.Linear`` layers with ``act`` between them."""
    for i, p in enumerate(params):
        w = p["weight"].shape
        x = rf.nn.Linear(w[0], w[1])(p, x)
        if i < len(params) - 1:
            x = act(x)
    return x


def mlp_jnp(params: Params, x: Any, act: Callable = jax.nn.gelu) -> jax.Array:
    for i, p in enumerate(params):
        x = x @ p["weight"] + p["bias"][None, :]
        if i < len(params) - 1:
            x = act(x)
    return x


# ---------------------------------------------------------------------------
# part 1: WGAN-GP
# ---------------------------------------------------------------------------

MODES = 2.0 * np.stack([np.cos(2 * np.pi * np.arange(8) / 8), np.sin(2 * np.pi * np.arange(8) / 8)], 1)


@functools.partial(jax.jit, static_argnums=1)
def sample_real(key: jax.Array, n: int) -> jax.Array:
    """A ring of eight Gaussians of radius 2 and standard deviation 0.05."""
    k1, k2 = jax.random.split(key)
    centers = jnp.asarray(MODES, jnp.float32)[jax.random.randint(k1, (n,), 0, 8)]
    return centers + 0.05 * jax.random.normal(k2, (n, 2), jnp.float32)


def critic_loss(
    critic_params: Params,
    real: Any,
    fake: Any,
    eps: Any,
    lam: float = 1.0,
    critic: Callable = mlp_rf,
    grad: Callable = rf.grad,
    np_: Any = rnp,
) -> tuple[Any, tuple[Any, Any]]:
    """WGAN-GP critic loss and (Wasserstein estimate, gradient penalty).

    ``x_hat = eps * real + (1 - eps) * fake``; ``grad(sum(D(x_hat)))`` w.r.t.
    ``x_hat`` gives every sample's input gradient (samples do not interact).
    With the defaults this runs on rf's tape (``rf.grad`` inside the outer
    transform); with ``mlp_jnp, jax.grad, jnp`` it is the same loss in JAX.
    """
    x_hat = eps * real + (1.0 - eps) * fake
    gx = grad(lambda x: np_.sum(critic(critic_params, x)))(x_hat)  # [N, 2]
    norm = np_.sqrt(np_.sum(gx * gx, axis=1) + 1e-12)
    penalty = np_.mean((norm - 1.0) ** 2)
    w_est = np_.mean(critic(critic_params, real)) - np_.mean(critic(critic_params, fake))
    return -w_est + lam * penalty, (w_est, penalty)


def generator_loss(gen_params: Params, critic_params: Params, z: Any) -> rf.Tensor:
    return -rf.mean(mlp_rf(critic_params, mlp_rf(gen_params, z, rf.relu)))


def modes_covered(samples: np.ndarray, radius: float = 0.3) -> tuple[int, float, float]:
    """How many of the eight modes have a sample within ``radius``, the fraction
    of samples within ``radius`` of some mode, and the samples' mean distance to
    the nearest mode."""
    d = np.linalg.norm(samples[:, None, :] - MODES[None], axis=-1).min(axis=1)  # [N]
    nearest = np.argmin(np.linalg.norm(samples[:, None, :] - MODES[None], axis=-1), axis=1)
    covered = len(set(nearest[d < radius].tolist()))
    return covered, float(np.mean(d < radius)), float(np.mean(d))


def run_wgan(args: argparse.Namespace) -> float:
    print(f"== WGAN-GP on a ring of 8 Gaussians: {args.gan_steps} generator steps x {args.n_critic} critic steps ==")
    kc, kg, key = jax.random.split(jax.random.key(args.seed), 3)
    critic_params = init_mlp(kc, (2, args.hidden, args.hidden, 1))
    gen_params = init_mlp(kg, (args.z_dim, args.hidden, args.hidden, 2))
    opt_c = optax.adam(args.gan_lr, b1=0.5, b2=0.9)
    opt_g = optax.adam(args.gan_lr, b1=0.5, b2=0.9)
    state_c, state_g = opt_c.init(critic_params), opt_g.init(gen_params)
    n = args.batch_size

    @jax.jit
    def batch(key, gen_params):
        kr, kz, ke = jax.random.split(key, 3)
        fake = rf.testing.as_array(mlp_rf(gen_params, jax.random.normal(kz, (n, args.z_dim)), rf.relu))
        return sample_real(kr, n), fake, jax.random.uniform(ke, (n, 1))

    @jax.jit
    def critic_step(critic_params, state_c, gen_params, key):
        real, fake, eps = batch(key, gen_params)
        (_, (w_est, gp)), grads = rf.value_and_grad(critic_loss, has_aux=True)(critic_params, real, fake, eps, args.lam)
        updates, state_c = opt_c.update(grads, state_c)
        return optax.apply_updates(critic_params, updates), state_c, w_est, gp

    @jax.jit
    def generator_step(gen_params, state_g, critic_params, key):
        grads = rf.grad(generator_loss)(gen_params, critic_params, jax.random.normal(key, (n, args.z_dim)))
        updates, state_g = opt_g.update(grads, state_g)
        return optax.apply_updates(gen_params, updates), state_g

    t0 = time.perf_counter()
    every = max(args.gan_steps // 5, 1)
    for step in range(1, args.gan_steps + 1):
        for _ in range(args.n_critic):
            key, k = jax.random.split(key)
            critic_params, state_c, w_est, gp = critic_step(critic_params, state_c, gen_params, k)
        key, k = jax.random.split(key)
        gen_params, state_g = generator_step(gen_params, state_g, critic_params, k)
        if step % every == 0 or step == args.gan_steps:
            print(f"step {step}: Wasserstein estimate {float(w_est):.4f}, gradient penalty {float(gp):.4f}")
    key, k = jax.random.split(key)
    generate = jax.jit(lambda p, k: rf.testing.as_array(mlp_rf(p, jax.random.normal(k, (2000, args.z_dim)), rf.relu)))
    samples = np.asarray(generate(gen_params, k))
    covered, near, dist = modes_covered(samples)
    print(
        f"generator: {covered}/8 modes covered, {100 * near:.0f}% of samples within 0.3 of a mode, "
        f"mean distance to the nearest mode {dist:.3f} ({time.perf_counter() - t0:.1f}s)"
    )

    # the critic-step gradient (rf.grad inside rf.grad) against jax.grad of jax.grad
    real, fake, eps = batch(k, gen_params)
    got = jax.jit(rf.grad(critic_loss, has_aux=True))(critic_params, real, fake, eps, args.lam)[0]
    want = jax.jit(jax.grad(critic_loss, has_aux=True), static_argnums=(5, 6, 7))(
        critic_params, real, fake, eps, args.lam, mlp_jnp, jax.grad, jnp
    )[0]
    diff = max_abs_diff(got, want)
    print(f"critic gradient (rf.grad of rf.grad) vs jax.grad of jax.grad: max abs diff {diff:.2e}")
    return diff


# ---------------------------------------------------------------------------
# part 2: MAML on sine regression
# ---------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(1, 2))
def sample_tasks(key: jax.Array, tasks: int, shots: int) -> tuple[jax.Array, ...]:
    """``tasks`` sine waves ``A sin(x + phase)``, A in [0.1, 5], phase in [0, pi];
    ``shots`` support and ``shots`` query points each, x in [-5, 5]."""
    ka, kp, kx = jax.random.split(key, 3)
    amp = jax.random.uniform(ka, (tasks, 1, 1), minval=0.1, maxval=5.0)
    phase = jax.random.uniform(kp, (tasks, 1, 1), minval=0.0, maxval=math.pi)
    x = jax.random.uniform(kx, (tasks, 2 * shots, 1), minval=-5.0, maxval=5.0)
    y = amp * jnp.sin(x + phase)
    return x[:, :shots], y[:, :shots], x[:, shots:], y[:, shots:]


def maml_task_loss(
    params: Params,
    xs: Any,
    ys: Any,
    xq: Any,
    yq: Any,
    alpha: float = 0.03,
    net: Callable = mlp_rf,
    grad: Callable = rf.grad,
    np_: Any = rnp,
    act: Callable = rf.tanh,
) -> Any:
    """Query loss after one inner SGD step on the support set:
    ``L_q(params - alpha * grad L_s(params))``."""

    def mse(p, x, y):
        return np_.mean((net(p, x, act) - y) ** 2)

    g = grad(mse)(params, xs, ys)
    adapted = jax.tree.map(lambda p, gp: p - alpha * gp, params, g, is_leaf=lambda x: isinstance(x, rf.Tensor))
    return mse(adapted, xq, yq)


def maml_jnp_task_loss(params: Params, xs: Any, ys: Any, xq: Any, yq: Any, alpha: float = 0.03) -> jax.Array:
    return maml_task_loss(params, xs, ys, xq, yq, alpha, mlp_jnp, jax.grad, jnp, jnp.tanh)


def run_maml(args: argparse.Namespace) -> float:
    print(f"== MAML on sine regression: {args.maml_steps} meta-steps of {args.tasks} tasks, {args.shots} shots ==")
    key_init, key = jax.random.split(jax.random.key(args.seed + 1))
    params = init_mlp(key_init, (1, 40, 40, 1))
    opt = optax.adam(args.meta_lr)
    state = opt.init(params)
    alpha = args.alpha
    # one task's query loss and meta-gradient, vmapped over the task batch
    task_value_and_grad = jax.vmap(
        rf.value_and_grad(lambda p, *data: maml_task_loss(p, *data, alpha)), in_axes=(None, 0, 0, 0, 0)
    )

    @jax.jit
    def meta_step(params, state, key):
        losses, grads = task_value_and_grad(params, *sample_tasks(key, args.tasks, args.shots))
        grads = jax.tree.map(lambda g: jnp.mean(g, axis=0), grads)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(params, updates), state, jnp.mean(losses)

    @jax.jit
    def query_mse(params, key):  # held-out tasks: query MSE before and after one inner step
        xs, ys, xq, yq = sample_tasks(key, 100, args.shots)
        pre = jnp.mean((jax.vmap(lambda x: mlp_jnp(params, x, jnp.tanh))(xq) - yq) ** 2)
        post = jnp.mean(jax.vmap(lambda *d: maml_jnp_task_loss(params, *d, alpha))(xs, ys, xq, yq))
        return pre, post

    def pre_post(params, key):
        return tuple(float(v) for v in query_mse(params, key))

    held_out = jax.random.key(args.seed + 1000)
    pre, post = pre_post(params, held_out)
    print(f"meta-step 0: held-out query MSE {pre:.3f} before adaptation, {post:.3f} after one step")
    t0 = time.perf_counter()
    every = max(args.maml_steps // 5, 1)
    for step in range(1, args.maml_steps + 1):
        key, k = jax.random.split(key)
        params, state, loss = meta_step(params, state, k)
        if step % every == 0 or step == args.maml_steps:
            pre, post = pre_post(params, held_out)
            print(
                f"meta-step {step}: train query loss {float(loss):.3f}; held-out query MSE {pre:.3f} before "
                f"adaptation, {post:.3f} after one step"
            )
    print(f"({time.perf_counter() - t0:.1f}s)")

    # the meta-gradient (through the inner rf.grad) against JAX's, on one task batch
    data = sample_tasks(jax.random.key(7), args.tasks, args.shots)
    got = jax.jit(jax.vmap(rf.grad(lambda p, *d: maml_task_loss(p, *d, alpha)), in_axes=(None, 0, 0, 0, 0)))(
        params, *data
    )
    want = jax.jit(jax.vmap(jax.grad(lambda p, *d: maml_jnp_task_loss(p, *d, alpha)), in_axes=(None, 0, 0, 0, 0)))(
        params, *data
    )
    diff = max_abs_diff(got, want)
    print(f"MAML meta-gradient (rf.grad through rf.grad) vs jax.grad through jax.grad: max abs diff {diff:.2e}")
    return diff


def max_abs_diff(a: Any, b: Any) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=("wgan", "maml"), help="run one part only")
    p.add_argument("--gan-steps", type=int, default=400, help="generator steps")
    p.add_argument("--n-critic", type=int, default=5, help="critic steps per generator step")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--gan-lr", type=float, default=2e-3)
    p.add_argument(
        "--lam", type=float, default=1.0, help="gradient penalty weight (10 in the paper's image experiments)"
    )
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--z-dim", type=int, default=4)
    p.add_argument("--maml-steps", type=int, default=500)
    p.add_argument("--tasks", type=int, default=10, help="tasks per meta-step")
    p.add_argument("--shots", type=int, default=10)
    p.add_argument("--alpha", type=float, default=0.03, help="inner SGD step size")
    p.add_argument("--meta-lr", type=float, default=1e-2, help="outer Adam step size")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = {}
    if args.only in (None, "wgan"):
        out["wgan"] = run_wgan(args)
    if args.only in (None, "maml"):
        out["maml"] = run_maml(args)
    return out


if __name__ == "__main__":
    main()
