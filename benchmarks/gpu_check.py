"""Compile every rumus_fx Pallas kernel for the GPU, check it against the
jax.numpy reference, and time both against the H200 roofline.

    python benchmarks/gpu_check.py              # on a GPU: full sizes, table into benchmarks/RESULTS.md
    python benchmarks/gpu_check.py --quick      # on a GPU: small sizes, fewer iterations
    python benchmarks/gpu_check.py --markdown   # print the table as markdown
    python benchmarks/gpu_check.py --interpret  # anywhere: tiny sizes, kernels in interpret
                                                # mode (checks this script, times nothing real)

Each row compiles the Pallas kernel (``Config("gpu")``: Pallas on Triton, no
interpret mode) and the XLA-compiled reference (XLA's fused equivalent),
compares the outputs (largest error relative to the reference's largest
magnitude), and reports the median time of each with the achieved bandwidth
(GB/s: bytes of the kernel's inputs and outputs), the arithmetic rate (TFLOP/s,
matrix products and attention) and the fraction of the roofline reached:
``max(bytes / HBM bandwidth, flops / peak) / time`` with the H200's 4.8 TB/s
and 989 dense bfloat16 TFLOP/s (494 TF32 TFLOP/s for float32 rows). A kernel
that fails to compile or disagrees is reported in its row; the script exits
non-zero if any did. Rows still to run when ``--budget-s`` (default 420 s) is
spent are reported as skipped, so a full run stays under 8 minutes.

On a GPU the table is written to ``--results`` (default benchmarks/RESULTS.md)
as the section "GPU kernels", with the date, device and jax version; the rest
of the file is kept. Without a GPU (and without ``--interpret``) it says so
and exits 0; ``--interpret`` writes only when ``--results`` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import math
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from rumus_fx.kernels import (
    attention,
    batch_norm,
    cross_entropy,
    embedding,
    layer_norm,
    matmul,
    softmax,
)
from rumus_fx.kernels._pallas import Config

f32, bf16 = jnp.float32, jnp.bfloat16

# H200 roofline
HBM_BYTES_PER_S = 4.8e12
PEAK_FLOPS = {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12}  # dense; float32 through TF32
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## GPU kernels (`benchmarks/gpu_check.py`)"


@dataclasses.dataclass
class Bench:
    name: str
    shape: str
    dtype: str
    args: tuple
    pallas: Callable  # pallas(*args, cfg=...) -> pytree
    reference: Callable  # reference(*args) -> pytree
    flops: float | None = None  # None: report GB/s

    def nbytes(self, out) -> int:
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves((self.args, out)))


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)


def benches(scale: str) -> list[Bench]:
    """The kernels and sizes to check; ``scale`` is "full", "quick" or "tiny"."""
    rng = np.random.default_rng(0)
    s = {"full": 1, "quick": 4, "tiny": 64}[scale]
    out: list[Bench] = []

    def n(x: int, floor: int = 1) -> int:
        return max(floor, x // s)

    rows, cols = n(8192, 4), n(4096, 8)
    for dt in (f32, bf16):
        x = _normal(rng, (rows, cols), dt)
        y = softmax.softmax_reference(x, axis=-1)
        sm = functools.partial(softmax.softmax_pallas, axis=-1)
        smb = functools.partial(softmax.softmax_bwd_pallas, axis=-1)
        out.append(
            Bench("softmax", f"{rows}x{cols}", dt.__name__, (x,), sm, lambda x: softmax.softmax_reference(x, axis=-1))
        )
        out.append(
            Bench(
                "softmax_bwd",
                f"{rows}x{cols}",
                dt.__name__,
                (y, x),
                smb,
                lambda y, g: softmax.softmax_bwd_reference(y, g, axis=-1),
            )
        )
        w, b = _normal(rng, (cols,), dt), _normal(rng, (cols,), dt)
        _, mean, rstd = layer_norm.layer_norm_fwd_reference(x, w, b, eps=1e-5)
        lnf = functools.partial(layer_norm.layer_norm_fwd_pallas, eps=1e-5)
        lnb = functools.partial(layer_norm.layer_norm_bwd_pallas, has_bias=True)
        out.append(
            Bench(
                "layer_norm",
                f"{rows}x{cols}",
                dt.__name__,
                (x, w, b),
                lnf,
                lambda x, w, b: layer_norm.layer_norm_fwd_reference(x, w, b, eps=1e-5),
            )
        )
        out.append(
            Bench(
                "layer_norm_bwd",
                f"{rows}x{cols}",
                dt.__name__,
                (x, w, mean, rstd, x),
                lnb,
                lambda *a: layer_norm.layer_norm_bwd_reference(*a, has_bias=True),
            )
        )
    n_ce, vocab = n(4096, 4), n(32000, 16)
    logits = _normal(rng, (n_ce, vocab), bf16)
    targets = jnp.asarray(rng.integers(0, vocab, n_ce), jnp.int32)
    ce = functools.partial(cross_entropy.cross_entropy_pallas, ignore_index=None)
    out.append(
        Bench(
            "cross_entropy",
            f"{n_ce}x{vocab}",
            "bfloat16",
            (logits, targets),
            ce,
            lambda l, t: cross_entropy.cross_entropy_reference(l, t, ignore_index=None),
        )
    )
    img = (n(64, 2), n(128, 4), n(56, 4), n(56, 4))
    x = _normal(rng, img, f32)
    c = img[1]
    w, b = _normal(rng, (c,), f32), _normal(rng, (c,), f32)
    _, mean, _, rstd = batch_norm.batch_norm_train_reference(x, w, b, eps=1e-5)
    bnf = functools.partial(batch_norm.batch_norm_train_pallas, eps=1e-5)
    bnb = functools.partial(batch_norm.batch_norm_train_bwd_pallas, has_bias=True)
    shape = "x".join(map(str, img))
    out.append(
        Bench(
            "batch_norm",
            shape,
            "float32",
            (x, w, b),
            bnf,
            lambda x, w, b: batch_norm.batch_norm_train_reference(x, w, b, eps=1e-5),
        )
    )
    out.append(
        Bench(
            "batch_norm_bwd",
            shape,
            "float32",
            (x, w, mean, rstd, x),
            bnb,
            lambda *a: batch_norm.batch_norm_train_bwd_reference(*a, has_bias=True),
        )
    )
    mm = functools.partial(matmul.matmul_pallas, out_dtype=None)
    for dt in (bf16, f32):
        m = n(4096, 16)
        a, bb = _normal(rng, (m, m), dt), _normal(rng, (m, m), dt)
        out.append(Bench("matmul", f"{m}x{m}x{m}", dt.__name__, (a, bb), mm, matmul.matmul_reference, 2.0 * m**3))
    bt, m = n(16, 2), n(1024, 16)
    a = _normal(rng, (bt, m, m), bf16)
    out.append(Bench("bmm", f"{bt}x{m}x{m}x{m}", "bfloat16", (a, a), mm, matmul.matmul_reference, 2.0 * bt * m**3))
    bh, seq, d = n(32, 2), n(2048, 16), 128 if scale != "tiny" else 16
    q, k, v = (_normal(rng, (bh, seq, d), bf16) for _ in range(3))
    for causal in (False, True):
        sc = d**-0.5
        fl = 4.0 * bh * seq * seq * d * (0.5 if causal else 1.0)
        o, lse = attention.attention_fwd_reference(q, k, v, None, causal=causal, scale=sc)
        af = functools.partial(attention.attention_fwd_pallas, causal=causal, scale=sc)
        ab = functools.partial(attention.attention_bwd_pallas, causal=causal, scale=sc, mask_grad=False)
        tag = "attention_causal" if causal else "attention"
        out.append(
            Bench(
                tag,
                f"{bh}x{seq}x{d}",
                "bfloat16",
                (q, k, v, None),
                af,
                functools.partial(attention.attention_fwd_reference, causal=causal, scale=sc),
                fl,
            )
        )
        out.append(
            Bench(
                tag + "_bwd",
                f"{bh}x{seq}x{d}",
                "bfloat16",
                (q, k, v, None, o, lse, o),
                lambda *a, _ab=ab, **kw: _ab(*a, **kw)[:3],
                lambda *a, _c=causal, _s=sc: attention.attention_bwd_reference(*a, causal=_c, scale=_s)[:3],
                2.5 * fl,
            )
        )
    lookups, vocab, d = n(16384, 16), n(32000, 16), n(1024, 8)
    ids = jnp.asarray(rng.integers(0, vocab, lookups), jnp.int32)
    g = _normal(rng, (lookups, d), f32)
    eb = functools.partial(embedding.embedding_bwd_pallas, vocab_size=vocab, dtype=f32)
    out.append(
        Bench(
            "embedding_bwd",
            f"{lookups}->{vocab}x{d}",
            "float32",
            (ids, g),
            eb,
            functools.partial(embedding.embedding_bwd_reference, vocab_size=vocab, dtype=f32),
        )
    )
    return out


def _time(fn: Callable, args: tuple, iters: int) -> float:
    """Median wall time in milliseconds (after two warm-up calls)."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _rel_err(got, want) -> float:
    err, scale = 0.0, 0.0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        err = max(err, float(np.max(np.abs(g - w))) if g.size else 0.0)
        scale = max(scale, float(np.max(np.abs(w))) if w.size else 0.0)
    return err / max(scale, 1e-30)


def _rates(bench: Bench, out, ms: float) -> tuple[str, str, str]:
    """(GB/s, TFLOP/s, % of the roofline) of one timing."""
    if not math.isfinite(ms) or ms <= 0:
        return "-", "-", "-"
    seconds = ms / 1e3
    nbytes = bench.nbytes(out)
    roof = nbytes / HBM_BYTES_PER_S
    tflops = "-"
    if bench.flops is not None:
        roof = max(roof, bench.flops / PEAK_FLOPS[bench.dtype])
        tflops = f"{bench.flops / seconds / 1e12:.1f}"
    return f"{nbytes / seconds / 1e9:.0f}", tflops, f"{100 * roof / seconds:.0f}%"


def run(scale: str, iters: int, interpret: bool, budget_s: float = math.inf) -> tuple[list[list[str]], bool]:
    cfg = Config("gpu", interpret)
    rows, ok_all = [], True
    start = time.perf_counter()
    for bench in benches(scale):
        row = [bench.name, bench.shape, bench.dtype]
        if time.perf_counter() - start > budget_s:
            rows.append(row + ["-", "SKIPPED (time budget)"] + ["-"] * (len(HEADER) - 5))
            ok_all = False
            continue
        pallas = jax.jit(functools.partial(bench.pallas, cfg=cfg))
        reference = jax.jit(bench.reference)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # Pallas:Triton is deprecated in jax 0.11
                got = jax.block_until_ready(pallas(*bench.args))
            want = jax.block_until_ready(reference(*bench.args))
            err = _rel_err(got, want)
            ok = err < (3e-2 if bench.dtype == "bfloat16" else 2e-3)
            t_pallas = _time(pallas, bench.args, iters)
            t_ref = _time(reference, bench.args, iters)
            gbs, tflops, roof = _rates(bench, got, t_pallas)
            row += [
                f"{err:.1e}",
                "ok" if ok else "MISMATCH",
                f"{t_pallas:.3f}",
                f"{t_ref:.3f}",
                f"{t_ref / t_pallas:.2f}x",
                gbs,
                tflops,
                roof,
                _rates(bench, got, t_ref)[2],
            ]
        except Exception as exc:  # report the row, keep going
            ok = False
            row += ["-", f"FAIL {type(exc).__name__}: {str(exc).splitlines()[0][:60]}"] + ["-"] * (len(HEADER) - 5)
        ok_all &= ok
        rows.append(row)
        print("  " + " | ".join(row), file=sys.stderr, flush=True)
    return rows, ok_all


HEADER = [
    "kernel",
    "shape",
    "dtype",
    "rel err",
    "check",
    "pallas ms",
    "xla ms",
    "speedup",
    "pallas GB/s",
    "pallas TFLOP/s",
    "pallas % roof",
    "xla % roof",
]


def render(rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in col) for col in zip(HEADER, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*HEADER), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows])


def write_results(path: Path, rows: list[list[str]], *, devices: str, scale: str, iters: int, interpret: bool) -> None:
    """Replace the "GPU kernels" section of ``path`` (up to the next ``## ``
    heading) with this run's table; every other section is kept."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    kind = "Pallas interpreter on CPU: a dry run of the script, NOT GPU measurements" if interpret else devices
    body = "\n".join(
        [
            SECTION,
            "",
            f"- Date: {datetime.date.today().isoformat()}; jax {jax.__version__} / jaxlib {jaxlib.__version__}",
            f"- Device: {kind}; sizes {scale}, median of {iters} timed calls after two warm-ups",
            "- Roofline: H200, 4.8 TB/s HBM, 989 dense bfloat16 TFLOP/s (494 TF32 for float32 rows);",
            "  `% roof` = max(bytes / bandwidth, flops / peak) / measured time; xla = the jitted jnp reference.",
            "",
            render(rows, markdown=True),
            "",
        ]
    )
    pattern = re.compile(r"^" + re.escape(SECTION) + r"$.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: body + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + body
    path.write_text(text.rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer iterations")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations per kernel")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--interpret", action="store_true", help="tiny sizes in interpret mode (any platform)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip the rows left after this many seconds")
    parser.add_argument(
        "--results", type=Path, default=None, help=f"markdown file to update (default on a GPU: {RESULTS})"
    )
    parser.add_argument("--no-results", action="store_true", help="do not write the results file")
    args = parser.parse_args(argv)
    backend = jax.default_backend()
    devices = ", ".join(sorted({d.device_kind for d in jax.devices()}))
    if backend != "gpu" and not args.interpret:
        print(f"no GPU: jax backend is {backend!r} ({devices}); nothing compiled or timed.")
        print("Run this on a GPU machine, or pass --interpret to exercise the script with tiny sizes.")
        return 0
    scale = "tiny" if args.interpret else ("quick" if args.quick else "full")
    iters = args.iters or (3 if args.interpret else (10 if args.quick else 30))
    print(f"jax {jax.__version__}, backend {backend} ({devices}), sizes {scale}, {iters} timed iterations")
    if args.interpret:
        print("interpret mode: the timings below measure Pallas' interpreter, not a GPU kernel")
    rows, ok = run(scale, iters, args.interpret, args.budget_s)
    print(render(rows, args.markdown))
    results = args.results if args.results is not None else (None if args.interpret else RESULTS)
    if results is not None and not args.no_results:
        write_results(results, rows, devices=devices, scale=scale, iters=iters, interpret=args.interpret)
        print(f"table written to {results}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
