"""Hessian-vector products, forward-over-reverse: ``jax.jvp`` of ``rf.grad``.

``rf.grad`` builds the gradient from hand-written backward records, all plain
jax.numpy, so JAX can push a tangent through the whole forward + backward
computation: ``jax.jvp(rf.grad(f), (w,), (v,))`` returns ``H v`` at the cost
of about two gradient evaluations, without ever forming ``H``. Here we check it
against ``jax.hessian`` of the same function written in jax.numpy, in float64.

    python examples/hvp.py
"""

from __future__ import annotations

import argparse

import jax

jax.config.update("jax_enable_x64", True)  # float64 makes the comparison tight (~1e-12)

import jax.numpy as jnp  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402

import rumus_fx as rf  # noqa: E402


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=16, help="number of data points")
    p.add_argument("--hidden", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    kx, ky, kp, kv = jax.random.split(jax.random.key(args.seed), 4)
    x = jax.random.normal(kx, (args.n, 3), jnp.float64)
    y = jnp.sin(x.sum(axis=1, keepdims=True))

    # A tiny tanh MLP regression; float64 parameters.
    mlp = rf.nn.Sequential(
        [rf.nn.Linear(3, args.hidden, dtype=jnp.float64), rf.tanh, rf.nn.Linear(args.hidden, 1, dtype=jnp.float64)]
    )
    params = mlp.init(kp)

    def loss(params):
        return rf.mse_loss(mlp(params, x), y)

    # Hessian-vector product: forward-mode (jvp) over rumus_fx's reverse mode (rf.grad).
    def hvp(params, v):
        return jax.jvp(rf.grad(loss), (params,), (v,))[1]

    flat, unravel = ravel_pytree(params)
    v = unravel(jax.random.normal(kv, flat.shape, jnp.float64))
    hv = jax.jit(hvp)(params, v)

    # The oracle: the full Hessian of the same loss in plain jax.numpy.
    def jnp_loss(flat_params):
        p = unravel(flat_params)
        h = jnp.tanh(x @ p["0"]["weight"] + p["0"]["bias"][None, :])
        return jnp.mean((h @ p["2"]["weight"] + p["2"]["bias"][None, :] - y) ** 2)

    hessian = jax.jit(jax.hessian(jnp_loss))(flat)
    err = float(jnp.max(jnp.abs(ravel_pytree(hv)[0] - hessian @ ravel_pytree(v)[0])))
    print(f"{flat.size} parameters; Hessian {hessian.shape}")
    print(f"jax.jvp(rf.grad(loss)) vs jax.hessian(loss) @ v: max abs diff {err:.2e}")

    # The whole Hessian, one HVP per basis vector (vmap batches them).
    cols = jax.jit(jax.vmap(lambda e: ravel_pytree(hvp(params, unravel(e)))[0]))(jnp.eye(flat.size, dtype=flat.dtype))
    full_err = float(jnp.max(jnp.abs(cols.T - hessian)))
    eig = jnp.linalg.eigvalsh(0.5 * (cols + cols.T))
    print(f"Hessian from vmapped HVPs vs jax.hessian: max abs diff {full_err:.2e}")
    print(f"Hessian eigenvalues: min {float(eig[0]):.4f}, max {float(eig[-1]):.4f}")
    assert err < 1e-10 and full_err < 1e-10, "HVP disagrees with jax.hessian"
    return max(err, full_err)


if __name__ == "__main__":
    main()
