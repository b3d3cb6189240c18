"""Eager ``rf.grad(rf.lift(loss))`` when ``loss`` reads values through its closure.

Usage: ``python -m benchmarks.closures [--blocks N] [--per-block N]``

The same [64,32] x [32,10] tanh regression, its target ``y`` (or a scale) reached five
ways: as an argument, as a module-level jax array, as a module-level NumPy array, a
module-level Python float the loss multiplies by, and an array attribute of a callable
object. Each row's eager gradient call is timed in blocks of its own, taking turns
with the other rows' blocks and with blocks of ``jax.grad`` of the same function, eager
(``compare._blocks``: medians over ``--blocks`` turns of ``--per-block`` calls, after
warm-up); the table gives ms per call, the ratio to the argument row, the ratio to
``jax.grad`` eager, and the header the traces during the timed calls (``rumus_fx.lift.closure.traces()``; the
cached program is reused when only values change: Note [Closures of a lifted function]
in rumus_fx/lift/closure.py). Before timing each row's gradient is checked against
``jax.grad``, with the closed-over value changed once in between.
"""

from __future__ import annotations

import argparse
import platform
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import rumus_fx as rf
from rumus_fx.lift import closure

from .compare import EAGER_WARMUP, _block, _blocks

_rng = np.random.default_rng(0)
X = jnp.asarray(_rng.standard_normal((64, 32)), jnp.float32)
W = jnp.asarray(_rng.standard_normal((32, 10)) * 0.1, jnp.float32)
Y = jnp.asarray(_rng.standard_normal((64, 10)), jnp.float32)
Y_NP = np.array(Y)
SCALE = 0.5


def loss_arg(w, x, y):
    return jnp.mean((jnp.tanh(x @ w) - y) ** 2)


def loss_global(w, x):
    return jnp.mean((jnp.tanh(x @ w) - Y) ** 2)


def loss_numpy(w, x):
    return jnp.mean((jnp.tanh(x @ w) - Y_NP) ** 2)


def loss_scale(w, x, y):
    return jnp.mean((jnp.tanh(x @ w) - y) ** 2) * SCALE


class Regression:
    def __init__(self, y):
        self.y = y

    def __call__(self, w, x):
        return jnp.mean((jnp.tanh(x @ w) - self.y) ** 2)


def _rows() -> list[tuple[str, object, tuple, object]]:
    """(label, function, arguments, change): ``change()`` gives the closed-over
    value a new one (for the correctness check)."""
    model = Regression(Y)

    def set_global():
        global Y
        Y = Y * 0.5 + 0.1

    def set_numpy():
        Y_NP[...] = Y_NP * 0.5 - 0.1

    def set_scale():
        global SCALE
        SCALE = SCALE + 0.25

    def set_attr():
        model.y = model.y * 0.5 + 0.2

    return [
        ("y as an argument", loss_arg, (W, X, Y), None),
        ("y, a jax array, from the module scope", loss_global, (W, X), set_global),
        ("y, a NumPy array, from the module scope", loss_numpy, (W, X), set_numpy),
        ("a Python float from the module scope", loss_scale, (W, X, Y), set_scale),
        ("an array attribute of a callable object", model, (W, X), set_attr),
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--per-block", type=int, default=20)
    args = p.parse_args(argv)
    rows = _rows()
    rf_fns, jax_fns = [], []
    for label, fun, a, change in rows:
        g_rf, g_jax = rf.grad(rf.lift(fun)), jax.grad(fun)
        for _ in range(2 if change else 1):
            np.testing.assert_allclose(g_rf(*a), g_jax(*a), rtol=1e-5, atol=1e-6, err_msg=label)
            if change:
                change()
        rf_fns.append(lambda g=g_rf, a=a: g(*a))
        jax_fns.append(lambda g=g_jax, a=a: g(*a))
    for f in rf_fns + jax_fns:  # warm-up: the last change of a Python value retraces here,
        for _ in range(EAGER_WARMUP):  # and rf's whole-tape choice is made
            _block(f())
    t0 = closure.traces()
    per_fn = _blocks(rf_fns + jax_fns, args.blocks, args.per_block)
    times = [statistics.median(t) for t in per_fn]
    traces = closure.traces() - t0
    n = len(rows)
    base = times[0]
    print(f"# {platform.machine()} {platform.processor() or ''}, jax {jax.__version__}, {jax.devices()[0].platform}")
    calls = n * args.blocks * args.per_block
    print(
        f"# medians of {args.blocks} alternating blocks of {args.per_block} timed calls per row; "
        f"traces during the {calls} timed rf calls (and their untimed warm calls): {traces}"
    )
    print()
    print("| the loss reads | rf ms per call | rf / argument row | jax.grad eager ms | rf / jax.grad eager |")
    print("|---|---|---|---|---|")
    for i, (label, *_) in enumerate(rows):
        r, j = times[i], times[n + i]
        print(f"| {label} | {r * 1e3:.2f} | {r / base:.2f} | {j * 1e3:.2f} | {r / j:.2f} |")


if __name__ == "__main__":  # pragma: no cover
    main()
