"""The GPU matmul kernel's block choice against XLA's product, on a GPU.

    python benchmarks/gpu_matmul_blocks.py --out $OUT/matmul_blocks.md --time-limit 90
    python benchmarks/gpu_matmul_blocks.py --cpu    # anywhere: one tiny shape, interpret mode

Times ``matmul_pallas`` with each candidate ``(bm, bn, bk, num_warps,
num_stages)`` (``blocks.matmul_blocks`` replaced for the call) at a few shapes
and dtypes, next to ``jnp.matmul`` at the default precision, median of 20 calls
each after a warm-up; a candidate that does not compile (shared memory) is
listed as such. Each result is checked against XLA's at the highest precision.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gpu_check import _time
from rumus_fx.kernels import blocks, matmul
from rumus_fx.kernels._pallas import Config

CANDIDATES = [  # (bm, bn, bk, num_warps, num_stages); the first is blocks.matmul_blocks' choice
    (128, 128, 64, 8, 3),
    (128, 128, 32, 4, 4),
    (128, 128, 64, 4, 3),
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 64, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (64, 64, 64, 4, 3),
    (128, 128, 128, 8, 3),
]
SHAPES = [(4096, 4096, 4096), (256, 784, 512), (4096, 1024, 4096)]
CALLS = 20  # timed calls per product (median, after a warm-up call)


def _blocks(bm: int, bn: int, bk: int, warps: int, stages: int, m: int, k: int, n: int) -> blocks.MatmulBlocks:
    r = blocks.round_up
    return blocks.MatmulBlocks(bm, bk, bn, r(k, bk) // bk, r(m, bm), r(k, bk), r(n, bn), warps, stages)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--time-limit", type=float, default=90.0)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--cpu", action="store_true", help="one tiny shape, interpret-mode kernel (any platform)")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu" and not args.cpu:
        print(f"no GPU: jax backend is {jax.default_backend()!r}; nothing timed")
        return 0
    lines = [
        "## GPU matmul blocks (`benchmarks/gpu_matmul_blocks.py`)",
        "",
        f"- Date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}; jax {jax.__version__}; "
        f"{jax.devices()[0].device_kind}; median of {CALLS} calls",
        "",
        "| dtype | M x K x N | XLA ms | bm, bn, bk, warps, stages | kernel ms | kernel / XLA | max rel err |",
        "|---|---|---|---|---|---|---|",
    ]

    def flush() -> None:
        text = "\n".join(lines) + "\n"
        if args.out is not None:
            args.out.write_text(text)

    def at_limit() -> None:
        lines.append(f"\n(time limit of {args.time_limit:.0f} s reached)")
        flush()
        print("\n".join(lines), flush=True)
        os._exit(2)

    timer = threading.Timer(args.time_limit, at_limit)
    timer.daemon = True
    timer.start()
    original = blocks.matmul_blocks
    cfg = Config("gpu", interpret=args.cpu)
    for name in args.dtypes.split(","):
        dt = jnp.dtype(name)
        for m, k, n in [(100, 70, 130)] if args.cpu else SHAPES:
            a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(dt)
            b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32).astype(dt)
            with jax.default_matmul_precision("highest"):
                want = np.asarray(jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32)))
            xla = _time(jax.jit(lambda a, b: matmul.matmul_reference(a, b)), (a, b), CALLS)
            for cand in CANDIDATES:
                blocks.matmul_blocks = lambda m_, k_, n_, target, itemsize=4, c=cand: _blocks(*c, m_, k_, n_)
                try:
                    local = matmul._matmul_local.__wrapped__  # past its jit cache: a fresh trace per candidate
                    fn = jax.jit(lambda a, b, f=local, key=(cfg, dt, False): f(key, a, b)[0])
                    got = np.asarray(jax.block_until_ready(fn(a, b)), np.float32)
                    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
                    ms = _time(fn, (a, b), CALLS)
                    cells = [f"{ms:.3f}", f"{ms / xla:.2f}", f"{err:.1e}"]
                except Exception as exc:  # a candidate that does not fit
                    cells = [
                        f"FAIL {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}",
                        "-",
                        "-",
                    ]
                finally:
                    blocks.matmul_blocks = original
                lines.append(
                    f"| {name} | {m}x{k}x{n} | {xla:.3f} | {', '.join(map(str, cand))} | " + " | ".join(cells) + " |"
                )
                flush()
    timer.cancel()
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
