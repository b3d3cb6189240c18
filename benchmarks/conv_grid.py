"""Timed grid behind conv2d's choice of formulation (Note [Convolution plan]
in ``rumus_fx/ops/_conv_plan.py``).

Usage: ``python -m benchmarks.conv_grid [--ynn] [--quick] [--gemm SHAPES]``

For every shape of the grid (input channels 1..256, kernel 1/3/5, stride 1/2,
padding ``K // 2``) it times each of conv2d's three products -- the forward ``y``,
``dx`` and ``dw`` -- in both formulations ("conv": one ``lax.conv_general_dilated``;
"dot": im2col slices + one ``dot_general``; for dw also "bdot": one product per
sample, summed), each as its own compiled program, in alternating blocks (medians
of several rounds), and prints the ratio dot / conv (below 1.00 the dot is faster)
next to what ``conv_plan`` chooses. ``--ynn`` compiles with
``rf.CPU_COMPILER_OPTIONS`` instead of XLA's defaults.

A product timed alone is not the whole story: XLA fuses the consumers of a
product's result (batch norm, relu, pooling) and reads it in their order, so the
layout a formulation produces changes the cost of the fusions behind it. The
plan's choices for the few-channel layers (the NCHW forward dot, "bdot" for dw)
come from timing the CNN step of ``benchmarks/models.py`` (RESULTS.md, issue 16).
So does "gemm" (y and dw over one channel-major im2col, which the two share
under jit): ``--gemm B,C_IN,C_OUT,HW,STRIDE ...`` times, per shape, the jitted
``value_and_grad`` of ``sum(tanh(conv2d(tanh(x))))`` (3x3, padding 1) with the
plan and with "gemm" switched off, in alternating blocks, and prints the ratio.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import rumus_fx as rf
from rumus_fx.ops import _conv_formulations as C
from rumus_fx.ops import _conv_plan as P

from .compare import _blocks

CHANNELS = (1, 3, 8, 16, 32, 64, 128, 256)
KERNELS = (1, 3, 5)
STRIDES = (1, 2)


def shape_for(c_in: int) -> tuple[int, int, int]:
    """(batch, spatial size, output channels): the spatial size shrinks as channels grow, as in a CNN."""
    hw = 28 if c_in <= 16 else 14 if c_in <= 64 else 7
    return 32, hw, min(256, max(16, 2 * c_in))


def _time(f: Callable[[], jax.Array], target_s: float = 0.15) -> float:
    jax.block_until_ready(f())
    t0 = time.perf_counter()
    jax.block_until_ready(f())
    once = max(time.perf_counter() - t0, 1e-6)
    n = int(min(40, max(5, target_s / once)))
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def products(c_in: int, k: int, s: int) -> dict[str, tuple[Callable, Callable, tuple]]:
    """{product: (conv formulation, dot formulation, arguments)} for one grid shape."""
    b, hw, c_out = shape_for(c_in)
    p = k // 2
    oh = (hw + 2 * p - k) // s + 1
    keys = jax.random.split(jax.random.key(c_in * 100 + k * 10 + s), 3)
    x = jax.random.normal(keys[0], (b, c_in, hw, hw), jnp.float32)
    w = jax.random.normal(keys[1], (c_out, c_in, k, k), jnp.float32) / np.sqrt(c_in * k * k)
    g = jax.random.normal(keys[2], (b, c_out, oh, oh), jnp.float32)
    f32 = jnp.float32
    return {
        "y": (
            lambda x, w: C.conv_conv_forward(x, w, s, p, f32),
            lambda x, w: C.conv_dot_forward(x, w, s, p, f32),
            (x, w),
        ),
        "dx": (
            lambda w, g: C.conv_conv_dx(w, g, hw, hw, s, p, f32),
            lambda w, g: C.conv_dot_dx(w, g, hw, hw, s, p, f32),
            (w, g),
        ),
        "dw": (
            lambda x, g: C.conv_conv_dw(x, g, k, s, p, f32),
            lambda x, g: C.conv_dot_dw(x, g, k, s, p, f32),
            (x, g),
        ),
        "dw bdot": (
            lambda x, g: C.conv_conv_dw(x, g, k, s, p, f32),
            lambda x, g: C.conv_dot_dw(x, g, k, s, p, f32, per_sample=True),
            (x, g),
        ),
    }


def measure(c_in: int, k: int, s: int, options: dict | None, rounds: int = 3) -> dict[str, tuple[float, float]]:
    """{product: (conv seconds, dot seconds)}; asserts both formulations agree."""
    out = {}
    for name, (f_conv, f_dot, args) in products(c_in, k, s).items():
        a = jax.jit(f_conv).lower(*args).compile(compiler_options=options)
        d = jax.jit(f_dot).lower(*args).compile(compiler_options=options)
        np.testing.assert_allclose(np.asarray(a(*args)), np.asarray(d(*args)), rtol=2e-3, atol=2e-3)
        ta, td = [], []
        for _ in range(rounds):
            ta.append(_time(functools.partial(a, *args)))
            td.append(_time(functools.partial(d, *args)))
        out[name] = (statistics.median(ta), statistics.median(td))
    return out


def gemm_step_ratio(b: int, c_in: int, c_out: int, hw: int, s: int, rounds: int = 8) -> tuple[float, float]:
    """(seconds with the plan, seconds with "gemm" switched off) of one jitted
    ``value_and_grad`` step of ``sum(tanh(conv2d(tanh(x))))`` for a 3x3 kernel,
    padding 1, in alternating blocks (medians of the blocks' minima); asserts
    both give the same gradients."""
    keys = jax.random.split(jax.random.key(b * 7 + c_in * 5 + c_out * 3 + hw + s), 2)
    x = jax.random.normal(keys[0], (b, c_in, hw, hw), jnp.float32)
    w = jax.random.normal(keys[1], (c_out, c_in, 3, 3), jnp.float32) / np.sqrt(9 * c_in)

    def loss(x, w):
        return rf.sum(rf.tanh(rf.conv2d(rf.tanh(x), w, None, s, 1)))

    steps = []
    for gemm in (True, False):
        saved = P.GEMM_MAX_C
        P.GEMM_MAX_C = saved if gemm else 0  # read by conv_plan while tracing
        try:
            steps.append(jax.jit(rf.value_and_grad(loss, argnums=(0, 1))).lower(x, w).compile())
        finally:
            P.GEMM_MAX_C = saved
    (_, ga), (_, gb) = steps[0](x, w), steps[1](x, w)
    for a, r in zip(ga, gb):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-3, atol=1e-3 * float(jnp.max(jnp.abs(r))))
    per = 5
    times = _blocks([lambda f=f: f(x, w) for f in steps], rounds, per, warm_s=0.0)
    mins = [[min(t[j : j + per]) for j in range(0, len(t), per)] for t in times]
    return statistics.median(mins[0]), statistics.median(mins[1])


def gemm_table(shapes: list[tuple[int, ...]]) -> None:
    print('jitted step with the plan / with "gemm" off (< 1.00: the plan is faster)')
    print("| input | C_out | stride | im2col elements | plan (y, dx, dw) | plan ms | gemm off ms | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for b, c_in, c_out, hw, s in shapes:
        cols = P.cols_size(b, c_in, hw, hw, 3, s, 1)
        plan = ", ".join(P.conv_plan(c_in, 3, s, cols=cols))
        t_plan, t_off = gemm_step_ratio(b, c_in, c_out, hw, s)
        print(
            f"| [{b}, {c_in}, {hw}, {hw}] | {c_out} | {s} | {cols / 2**20:.1f}M | {plan} "
            f"| {1e3 * t_plan:.2f} | {1e3 * t_off:.2f} | {t_plan / t_off:.2f} |",
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ynn", action="store_true", help="compile with rf.CPU_COMPILER_OPTIONS")
    parser.add_argument("--quick", action="store_true", help="channels 1, 16, 64 only, one round")
    parser.add_argument("--channels", default=None, help="comma-separated input channels (default: the grid)")
    parser.add_argument("--gemm", nargs="+", default=None, metavar="B,C_IN,C_OUT,HW,STRIDE", help="time these steps")
    args = parser.parse_args(argv)
    if args.gemm:
        gemm_table([tuple(int(v) for v in shape.split(",")) for shape in args.gemm])
        return
    options = dict(rf.CPU_COMPILER_OPTIONS) if args.ynn else None
    channels = CHANNELS if args.channels is None else tuple(int(c) for c in args.channels.split(","))
    if args.quick:
        channels = (1, 16, 64)
    print(f"jax {jax.__version__}; compile options: {options or 'XLA defaults'}")
    print("ratio dot / conv per product (< 1.00: the dot formulation is faster); conv ms in brackets; plan = chosen")
    print("| C_in | C_out | K | stride | B, HxW | y | dx | dw | dw bdot | plan (y, dx, dw) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c_in in channels:
        b, hw, c_out = shape_for(c_in)
        for k in KERNELS:
            for s in STRIDES:
                r = measure(c_in, k, s, options, rounds=1 if args.quick else 3)
                cells = " | ".join(f"{td / ta:.2f} ({1e3 * ta:.2f})" for ta, td in r.values())
                cols = P.cols_size(b, c_in, hw, hw, k, s, k // 2)
                plan = ", ".join(P.conv_plan(c_in, k, s, cols=cols))
                print(f"| {c_in} | {c_out} | {k} | {s} | {b}, {hw}x{hw} | {cells} | {plan} |", flush=True)


if __name__ == "__main__":  # pragma: no cover
    main()
