"""Eager ``rf.grad(rf.lift(loss))`` when ``loss`` reads values through its closure.

Usage: ``python -m benchmarks.closures [--blocks N] [--per-block N] [--runs N] [--processes N]``
or ``python -m benchmarks.closures --per-call ROUNDS`` (``per_call``: the rows alternate
call by call, no blocks)

The same [64,32] x [32,10] tanh regression, its target ``y`` (or a scale) reached five
ways: as an argument, as a module-level jax array, as a module-level NumPy array, a
module-level Python float the loss multiplies by, and an array attribute of a callable
object; a sixth row, a second function with the same text as the argument row's, shows
the noise of the ratios. Each row's eager gradient call is timed in blocks of its own,
taking turns with the other rows' blocks and with blocks of ``jax.grad`` of the same
function, eager (as ``compare._blocks``: medians over ``--blocks`` turns of
``--per-block`` calls, after warm-up; the order of the blocks rotates at each turn),
``--runs`` times per process, in ``--processes`` fresh processes one after another
(their runs pooled: a process can carry a bias of its own). The table gives ms per
call (median over the runs), the ratio to the argument row (median over the runs, and their range) in wall
time and in the calling thread's CPU time (what the load of a shared machine leaves
out), the ratio to ``jax.grad`` eager, and the header the traces and full closure
walks during the timed calls (``rumus_fx.lift.closure.traces()`` and ``walks()``; the
cached program and the kept walk are reused when only values change: Note [Closures
of a lifted function] in rumus_fx/lift/closure.py). Before timing each
row's gradient is checked against ``jax.grad``, with the closed-over value changed once
in between.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import rumus_fx as rf
from rumus_fx.lift import closure

from .compare import BLOCK_WARM_S, EAGER_WARMUP, _block

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_rng = np.random.default_rng(0)
X = jnp.asarray(_rng.standard_normal((64, 32)), jnp.float32)
W = jnp.asarray(_rng.standard_normal((32, 10)) * 0.1, jnp.float32)
Y = jnp.asarray(_rng.standard_normal((64, 10)), jnp.float32)
Y_NP = np.array(Y)
SCALE = 0.5


def loss_arg(w, x, y):
    return jnp.mean((jnp.tanh(x @ w) - y) ** 2)


def loss_arg_again(w, x, y):  # the argument row's text: its own code, program and tape entry
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
        ("(noise) y as an argument, a second function of the same text", loss_arg_again, (W, X, Y), None),
    ]


def measure(blocks: int, per_block: int, runs: int) -> dict:
    """This process's measurement: per run, each fn's median seconds (the rf rows,
    then their ``jax.grad`` counterparts), wall and calling-thread CPU time, and the
    traces and closure walks during the timed calls."""
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
    t0, w0 = closure.traces(), closure.walks()
    fns = rf_fns + jax_fns
    wall_runs, cpu_runs = [], []
    for _ in range(runs):
        wall: list[list[float]] = [[] for _ in fns]
        cpu: list[list[float]] = [[] for _ in fns]
        for b in range(blocks):  # one turn of blocks, the order rotated at each turn (in a
            # fixed order the last rf row read 1.06-1.08 of the first, the noise row included)
            _turn(fns, [(b + i) % len(fns) for i in range(len(fns))], per_block, wall, cpu)
        wall_runs.append([statistics.median(t) for t in wall])
        cpu_runs.append([statistics.median(t) for t in cpu])
    return {
        "wall": wall_runs,
        "cpu": cpu_runs,
        "traces": closure.traces() - t0,
        "walks": closure.walks() - w0,
        "calls": len(rows) * blocks * per_block * runs,
    }


def per_call(rounds: int, seed: int = 1) -> dict:
    """The rf rows called one call each in a shuffled order, ``rounds`` times (no
    blocks, no ``jax.grad`` calls in between): every call finds the caches as
    the other rows' calls left them, as a call in a user's loop between other
    work does. Per row: the median wall and calling-thread CPU seconds, and the
    ratio of each row's median to the argument row's with a 95 % bootstrap
    interval (the rounds resampled)."""
    rows = _rows()
    fns = []
    for _label, fun, a, _change in rows:
        g = rf.grad(rf.lift(fun))
        fns.append(lambda g=g, a=a: g(*a))
    for f in fns:
        for _ in range(EAGER_WARMUP):
            _block(f())
    t0, w0 = closure.traces(), closure.walks()
    rng = np.random.default_rng(seed)
    n = len(fns)
    wall, cpu = np.zeros((rounds, n)), np.zeros((rounds, n))
    for k in range(rounds):
        for i in rng.permutation(n):
            s0, c0 = time.perf_counter(), time.thread_time()
            _block(fns[i]())
            wall[k, i], cpu[k, i] = time.perf_counter() - s0, time.thread_time() - c0
    out: dict = {"traces": closure.traces() - t0, "walks": closure.walks() - w0, "calls": rounds * n}
    for name, t in (("wall", wall), ("cpu", cpu)):
        med = np.median(t, axis=0)
        boot = np.array([np.median(t[rng.integers(0, rounds, rounds)], axis=0) for _ in range(300)])
        boot = boot / boot[:, :1]
        out[name] = {
            "median": med.tolist(),
            "ratio": (med / med[0]).tolist(),
            "low": np.percentile(boot, 2.5, axis=0).tolist(),
            "high": np.percentile(boot, 97.5, axis=0).tolist(),
        }
    return out


def _print_per_call(rounds: int) -> None:
    out = per_call(rounds)
    print(f"# {platform.machine()} {platform.processor() or ''}, jax {jax.__version__}, {jax.devices()[0].platform}")
    print(
        f"# per call: {rounds} rounds of one call per row in a shuffled order; during the {out['calls']} "
        f"timed rf calls: {out['traces']} traces, {out['walks']} closure walks"
    )
    print()
    print(
        "| the loss reads | rf ms per call | rf / argument row [95 % interval] | the same, calling thread's CPU time |"
    )
    print("|---|---|---|---|")
    w, c = out["wall"], out["cpu"]
    for i, (label, *_) in enumerate(_rows()):
        print(
            f"| {label} | {w['median'][i] * 1e3:.3f} | {w['ratio'][i]:.3f} [{w['low'][i]:.3f}-{w['high'][i]:.3f}] "
            f"| {c['ratio'][i]:.3f} [{c['low'][i]:.3f}-{c['high'][i]:.3f}] |"
        )


def _in_processes(args: argparse.Namespace) -> list[dict]:
    """``measure`` in ``args.processes`` fresh interpreters, one after another: a
    process can carry a bias of its own (one read the float row at 1.12 in every
    block of two runs, the next at 1.00), so runs of several processes are pooled."""
    out = []
    for _ in range(args.processes):
        cmd = [sys.executable, "-m", "benchmarks.closures", "--blocks", str(args.blocks)]
        cmd += ["--per-block", str(args.per_block), "--runs", str(args.runs), "--json"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=_ROOT)
        out.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--per-block", type=int, default=20)
    p.add_argument("--runs", type=int, default=3, help="runs per process")
    p.add_argument("--processes", type=int, default=1, help="fresh processes whose runs are pooled")
    p.add_argument("--json", action="store_true", help="print this process's measurement as one JSON line")
    p.add_argument("--per-call", type=int, default=0, metavar="ROUNDS", help="rows alternate call by call (per_call)")
    args = p.parse_args(argv)
    if args.per_call:
        _print_per_call(args.per_call)
        return
    if args.json or args.processes <= 1:
        parts = [measure(args.blocks, args.per_block, args.runs)]
        if args.json:
            print(json.dumps(parts[0]))
            return
    else:
        parts = _in_processes(args)
    rows = _rows()
    n = len(rows)
    runs = [r for part in parts for r in part["wall"]]
    cpu_runs = [r for part in parts for r in part["cpu"]]
    traces, walks = sum(x["traces"] for x in parts), sum(x["walks"] for x in parts)
    print(f"# {platform.machine()} {platform.processor() or ''}, jax {jax.__version__}, {jax.devices()[0].platform}")
    calls = sum(x["calls"] for x in parts)
    print(
        f"# {len(parts)} process(es) x {args.runs} runs of {args.blocks} alternating blocks of {args.per_block} "
        f"timed calls per row (medians); during the {calls} timed rf calls (and their untimed warm calls): "
        f"{traces} traces, {walks} closure walks"
    )
    print()
    print(
        "| the loss reads | rf ms per call | rf / argument row (range over runs) "
        "| the same, calling thread's CPU time | jax.grad eager ms | rf / jax.grad eager |"
    )
    print("|---|---|---|---|---|---|")

    def ratio(per_run: list[list[float]], i: int) -> str:
        r = [t[i] / t[0] for t in per_run]
        return f"{statistics.median(r):.3f}" + (f" ({min(r):.2f}-{max(r):.2f})" if len(r) > 1 else "")

    for i, (label, *_) in enumerate(rows):
        r = statistics.median(t[i] for t in runs)
        j = statistics.median(t[n + i] for t in runs)
        print(f"| {label} | {r * 1e3:.3f} | {ratio(runs, i)} | {ratio(cpu_runs, i)} | {j * 1e3:.2f} | {r / j:.2f} |")


def _turn(fns: list, order: list[int], per_block: int, wall: list[list[float]], cpu: list[list[float]]) -> None:
    """One block of each fn in ``order`` (as ``compare._blocks``: untimed calls for
    ``BLOCK_WARM_S`` first), each call's wall time and calling-thread CPU time
    appended to ``wall[i]`` and ``cpu[i]``. (The CPU time leaves out the time the
    thread waits while another process has the core: a shared machine's load.)"""
    for i in order:
        f = fns[i]
        t_warm = time.perf_counter() + BLOCK_WARM_S
        _block(f())
        while time.perf_counter() < t_warm:
            _block(f())
        for _ in range(per_block):
            t0, c0 = time.perf_counter(), time.thread_time()
            _block(f())
            wall[i].append(time.perf_counter() - t0)
            cpu[i].append(time.thread_time() - c0)


if __name__ == "__main__":  # pragma: no cover
    main()
