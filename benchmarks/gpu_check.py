"""Check every rumus_fx Pallas kernel against the jax.numpy reference on a GPU,
output by output, and time both against the H200 roofline.

    python benchmarks/gpu_check.py --out $OUT/gpu_check.md --time-limit 480   # on a GPU
    python benchmarks/gpu_check.py --cpu --out /tmp/check.md                   # anywhere: tiny shapes,
                                                                               # interpret-mode kernels
    python benchmarks/gpu_check.py --only layer_norm,softmax --dtypes float32

What a row checks
-----------------
Each kernel (forward and backward) runs at an aligned shape and an unaligned
one (1000x777 rows, sequence 1000, ...: the masking and padding paths), in
float32, bfloat16 and float16. Its reference runs on the same inputs upcast to
float32 (the kernels accumulate in float32; an XLA reference in bfloat16 would
be less exact than the kernel it judges). Then *every* output is compared on
its own scale:

* ``rel``: max |kernel - reference| / max |reference| of that output alone (a
  small output such as a bias gradient or a row mean is not hidden behind a
  large one);
* ``cos``: the cosine between the two as flat vectors (catches a zero, a
  negated or permuted gradient whatever its magnitude);
* ``norm``: ||kernel|| / ||reference|| (catches a scaled output);
* any NaN or infinity in the kernel's output fails.

Rows named ``kernel[mgpu]`` check the Mosaic GPU variants of the row kernels
(``rumus_fx/kernels/mosaic_gpu.py``) the same way; with ``--cpu`` they run the
jax.numpy emulation of their block algorithm, not the kernels.

The row fails when any output misses any bound (``TOLERANCE``). End-to-end
rows compare ``rf.grad`` of the benchmark MLP and TinyGPT (benchmarks/models.py)
under ``auto`` dispatch (``interpret`` with ``--cpu``) against the reference
mode at ``jax.default_matmul_precision("highest")``, parameter by parameter,
with the same measures. On a GPU the kernels' float32 products run on TF32
tensor cores, as XLA's do at the default precision, so each parameter's bound
there is a multiple of XLA's own TF32 error on it (``tf32_tolerances``).

``--out PATH`` gets the markdown table (date, jax version, device) rewritten
after every row, so a run cut short still leaves what it did; ``--time-limit``
is a hard limit on the whole run (rows not started are listed as skipped, and
a row still running at the limit ends the process with the table written).
The exit status is 0 when every row passed, 1 when one failed, 2 at the limit.
Without a GPU and without ``--cpu`` it says so and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import math
import os
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

import rumus_fx as rf
from rumus_fx.kernels import attention, batch_norm, cross_entropy, embedding, layer_norm, matmul, mosaic_gpu, softmax
from rumus_fx.kernels._pallas import Config

DTYPES = ("float32", "bfloat16", "float16")
# (max rel error, min cosine) per dtype; matrix products and attention allow
# more in float32 (Triton's float32 dot runs on TF32 tensor cores).
TOLERANCE = {"float32": (2e-3, 1 - 1e-6), "bfloat16": (4e-2, 1 - 2e-4), "float16": (1e-2, 1 - 2e-5)}
TF32_TOLERANCE = (1e-2, 1 - 2e-5)
E2E_TOLERANCE = (1e-3, 1 - 1e-6)  # float32 models, gradients through every kernel
# On a GPU the kernels' float32 products run on TF32, as XLA's do at the default
# precision: each parameter's gradient may be off the exact one by up to this many
# times XLA's own TF32 error on it (never held tighter than E2E_TF32_FLOOR, never
# looser than E2E_LOOSEST). A fixed bound cannot work: TF32 alone puts the MLP's
# first bias gradient 5e-2 off the exact one (an H200 run, and TF32 emulated on CPU).
E2E_TF32_FACTOR = 4.0
# TF32 keeps 10 of float32's 23 mantissa bits (unit roundoff 2^-11, 4.9e-4); where
# the operands are truncated rather than rounded (as a tensor core may read them)
# every product is biased the same way, and XLA's rounding need not match: with
# TF32 emulated on CPU, truncated against rounded, the gradients of the MLP and
# TinyGPT differ by up to 4.3e-3 (norm ratio 0.9965) with no fault anywhere.
E2E_TF32_FLOOR = (1e-2, 1 - 1e-4)
E2E_LOOSEST = (0.25, 0.99)
E2E_NOISE = 1e-4  # a parameter gradient below 1e-4 of the largest one is rounding noise (a key bias's)

HBM_BYTES_PER_S = 4.8e12  # H200
PEAK_FLOPS = {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12}
HEADER = ["kernel", "shape", "dtype", "check", "worst output", "rel", "cos", "norm", "kernel ms", "xla ms", "% roof"]


@dataclasses.dataclass
class Case:
    kernel: str
    shape: str
    dtype: str
    make: Callable[[], tuple]  # () -> args (built when the row runs)
    pallas: Callable[..., Any]  # pallas(*args, cfg=...) -> pytree
    reference: Callable[..., Any]  # reference(*float32 args) -> pytree
    names: tuple[str, ...]
    flops: Callable[[], float] | None = None
    tf32: bool = False


@dataclasses.dataclass
class OutputCheck:
    name: str
    rel: float
    cos: float
    norm: float
    finite: bool

    def ok(self, tol: tuple[float, float]) -> bool:
        max_rel, min_cos = tol
        return self.finite and self.rel <= max_rel and self.cos >= min_cos and abs(self.norm - 1.0) <= max_rel


def compare_output(name: str, got: Any, want: Any, floor: float = 0.0) -> OutputCheck:
    """One output against its reference on its own scale (see the module docstring).

    ``floor``: a reference whose largest magnitude is below it is rounding
    noise (a gradient that is zero in exact arithmetic, such as that of a key
    bias, which softmax cancels): its error is measured against ``floor`` and
    its direction and norm are not checked."""
    g = np.asarray(jnp.asarray(got, jnp.float32), np.float64).ravel()
    w = np.asarray(jnp.asarray(want, jnp.float32), np.float64).ravel()
    if g.shape != w.shape:
        return OutputCheck(name, math.inf, -1.0, math.inf, False)
    finite = bool(np.all(np.isfinite(g)))
    if not finite or g.size == 0:
        return OutputCheck(name, 0.0 if finite else math.inf, 1.0 if finite else -1.0, 1.0, finite)
    scale = float(np.max(np.abs(w)))
    err = float(np.max(np.abs(g - w)))
    gn, wn = float(np.linalg.norm(g)), float(np.linalg.norm(w))
    if 0.0 < scale < floor:
        return OutputCheck(name, err / floor, 1.0, 1.0, True)
    if wn == 0.0:  # an all-zero reference: the kernel's output must be zero too
        zero = err == 0.0
        return OutputCheck(name, 0.0 if zero else math.inf, 1.0 if zero else -1.0, 1.0 if zero else math.inf, True)
    cos = float(np.dot(g, w) / (gn * wn)) if gn > 0 else 0.0
    return OutputCheck(name, err / scale, cos, gn / wn, True)


def compare(names: Sequence[str], got: Any, want: Any, noise: float = 0.0) -> list[OutputCheck]:
    """Each output on its own scale; ``noise``: outputs below ``noise`` times the
    largest reference magnitude of all of them count as rounding noise."""
    gl, wl = jax.tree.leaves(got), jax.tree.leaves(want)
    if len(gl) != len(wl):
        return [OutputCheck("(structure)", math.inf, -1.0, math.inf, False)]
    names = list(names) + [f"out{i}" for i in range(len(names), len(gl))]
    top = max((float(jnp.max(jnp.abs(jnp.asarray(w, jnp.float32)))) for w in wl if jnp.size(w)), default=0.0)
    return [compare_output(n, g, w, noise * top) for n, g, w in zip(names, gl, wl)]


def _upcast(tree: Any) -> Any:
    def up(a: Any) -> Any:
        if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jnp.floating):
            return a.astype(jnp.float32)
        return a

    return jax.tree.map(up, tree)


# ---------------------------------------------------------------- the cases


def _normal(key: int, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Standard normal values made on the device (host RNG is seconds per 100M values)."""
    return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


def _shapes(scale: str) -> dict[str, list[tuple]]:
    """Aligned and unaligned shapes per kernel family."""
    if scale == "cpu":
        return {
            "rows": [(16, 256), (10, 77)],
            "ce": [(16, 256), (10, 77)],
            "bn": [(2, 8, 4, 4), (3, 5, 3, 7)],
            "mm": [(32, 64, 32), (17, 33, 9)],
            "bmm": [(2, 32, 32, 32), (2, 9, 17, 13)],
            "attn": [(2, 32, 16), (3, 21, 8)],
            "emb": [(32, 64, 32), (29, 37, 13)],
        }
    return {
        "rows": [(8192, 4096), (1000, 777)],
        "ce": [(4096, 32000), (1000, 777)],
        "bn": [(64, 128, 56, 56), (6, 37, 13, 11)],
        "mm": [(4096, 4096, 4096), (1000, 777, 555)],
        "bmm": [(16, 1024, 1024, 1024), (5, 1000, 77, 333)],
        "attn": [(32, 2048, 128), (6, 1000, 64)],
        "emb": [(16384, 32000, 1024), (1000, 777, 333)],
    }


def _sh(shape: tuple) -> str:
    return "x".join(map(str, shape))


def cases(scale: str, dtypes: Sequence[str] = DTYPES) -> list[Case]:
    """Every kernel, forward and backward, at each shape and dtype.

    The kernels are looked up on their modules when a row runs, so a test can
    replace one (``monkeypatch.setattr(layer_norm, "layer_norm_fwd_pallas", ...)``)."""
    shp = _shapes(scale)
    out: list[Case] = []
    for name in dtypes:
        dt = jnp.dtype(name)
        for rows, cols in shp["rows"]:
            s = _sh((rows, cols))

            def sm_args(rows=rows, cols=cols, dt=dt):
                return (_normal(1, (rows, cols), dt),)

            def smb_args(rows=rows, cols=cols, dt=dt):
                x = _normal(1, (rows, cols), jnp.float32)
                return (jax.nn.softmax(x, axis=-1).astype(dt), _normal(2, (rows, cols), dt))

            out.append(
                Case(
                    "softmax",
                    s,
                    name,
                    sm_args,
                    lambda x, cfg: softmax.softmax_pallas(x, axis=-1, cfg=cfg),
                    lambda x: softmax.softmax_reference(x, axis=-1),
                    ("y",),
                )
            )
            out.append(
                Case(
                    "softmax_bwd",
                    s,
                    name,
                    smb_args,
                    lambda y, g, cfg: softmax.softmax_bwd_pallas(y, g, axis=-1, cfg=cfg),
                    lambda y, g: softmax.softmax_bwd_reference(y, g, axis=-1),
                    ("dx",),
                )
            )

            def ln_args(rows=rows, cols=cols, dt=dt):
                x = _normal(3, (rows, cols), jnp.float32) * 2.0 + 0.5  # a mean and scale away from 0 and 1
                return (x.astype(dt), _normal(4, (cols,), dt), _normal(5, (cols,), dt))

            def lnb_args(rows=rows, cols=cols, dt=dt):
                x, w, b = ln_args(rows, cols, dt)
                _, mean, rstd = layer_norm.layer_norm_fwd_reference(_upcast(x), _upcast(w), _upcast(b), eps=1e-5)
                return (x, w, mean, rstd, _normal(6, (rows, cols), dt))

            out.append(
                Case(
                    "layer_norm",
                    s,
                    name,
                    ln_args,
                    lambda x, w, b, cfg: layer_norm.layer_norm_fwd_pallas(x, w, b, eps=1e-5, cfg=cfg),
                    lambda x, w, b: layer_norm.layer_norm_fwd_reference(x, w, b, eps=1e-5),
                    ("y", "mean", "rstd"),
                )
            )
            out.append(
                Case(
                    "layer_norm_bwd",
                    s,
                    name,
                    lnb_args,
                    lambda *a, cfg: layer_norm.layer_norm_bwd_pallas(*a, has_bias=True, cfg=cfg),
                    lambda *a: layer_norm.layer_norm_bwd_reference(*a, has_bias=True),
                    ("dx", "dw", "db"),
                )
            )
        for n, c in shp["ce"]:
            for ignore in (None, 0):

                def ce_args(n=n, c=c, dt=dt):
                    t = np.random.default_rng(8).integers(0, c, n)
                    t[::3] = 0  # rows for ignore_index=0 to drop
                    return (_normal(7, (n, c), dt) * 3.0, jnp.asarray(t, jnp.int32))

                out.append(
                    Case(
                        "cross_entropy" + ("" if ignore is None else "_ignore"),
                        _sh((n, c)),
                        name,
                        ce_args,
                        lambda lg, t, cfg, _i=ignore: cross_entropy.cross_entropy_pallas(
                            lg, t, ignore_index=_i, cfg=cfg
                        ),
                        lambda lg, t, _i=ignore: cross_entropy.cross_entropy_reference(lg, t, ignore_index=_i),
                        ("loss", "dlogits"),
                    )
                )
        for img in shp["bn"]:

            def bn_args(img=img, dt=dt):
                x = _normal(9, img, jnp.float32) * 1.5 - 0.7
                return (x.astype(dt), _normal(10, (img[1],), dt), _normal(11, (img[1],), dt))

            def bnb_args(img=img, dt=dt):
                x, w, b = bn_args(img, dt)
                _, mean, _, rstd = batch_norm.batch_norm_train_reference(_upcast(x), _upcast(w), _upcast(b), eps=1e-5)
                return (x, w, mean, rstd, _normal(12, img, dt))

            out.append(
                Case(
                    "batch_norm",
                    _sh(img),
                    name,
                    bn_args,
                    lambda x, w, b, cfg: batch_norm.batch_norm_train_pallas(x, w, b, eps=1e-5, cfg=cfg),
                    lambda x, w, b: batch_norm.batch_norm_train_reference(x, w, b, eps=1e-5),
                    ("y", "mean", "var", "rstd"),
                )
            )
            out.append(
                Case(
                    "batch_norm_bwd",
                    _sh(img),
                    name,
                    bnb_args,
                    lambda *a, cfg: batch_norm.batch_norm_train_bwd_pallas(*a, has_bias=True, cfg=cfg),
                    lambda *a: batch_norm.batch_norm_train_bwd_reference(*a, has_bias=True),
                    ("dx", "dw", "db"),
                )
            )
        for m, k, n in shp["mm"]:
            out.append(
                Case(
                    "matmul",
                    _sh((m, k, n)),
                    name,
                    lambda m=m, k=k, n=n, dt=dt: (_normal(13, (m, k), dt), _normal(14, (k, n), dt)),
                    lambda a, b, cfg: matmul.matmul_pallas(a, b, out_dtype=None, cfg=cfg),
                    lambda a, b: matmul.matmul_reference(a, b),
                    ("c",),
                    lambda m=m, k=k, n=n: 2.0 * m * k * n,
                    tf32=True,
                )
            )
        for bt, m, k, n in shp["bmm"]:
            out.append(
                Case(
                    "bmm",
                    _sh((bt, m, k, n)),
                    name,
                    lambda bt=bt, m=m, k=k, n=n, dt=dt: (_normal(15, (bt, m, k), dt), _normal(16, (bt, k, n), dt)),
                    lambda a, b, cfg: matmul.matmul_pallas(a, b, out_dtype=None, cfg=cfg),
                    lambda a, b: matmul.matmul_reference(a, b),
                    ("c",),
                    lambda bt=bt, m=m, k=k, n=n: 2.0 * bt * m * k * n,
                    tf32=True,
                )
            )
        for bh, seq, d in shp["attn"]:
            for causal in (False, True):
                sc = d**-0.5
                tag = "attention" + ("_causal" if causal else "")

                def at_args(bh=bh, seq=seq, d=d, dt=dt):
                    return tuple(_normal(17 + i, (bh, seq, d), dt) for i in range(3)) + (None,)

                def atb_args(bh=bh, seq=seq, d=d, dt=dt, causal=causal, sc=sc):
                    q, k, v, _ = at_args(bh, seq, d, dt)
                    o, lse = attention.attention_fwd_reference(*_upcast((q, k, v)), None, causal=causal, scale=sc)
                    return (q, k, v, None, o.astype(dt), lse, _normal(20, (bh, seq, d), dt))

                fl = 4.0 * bh * seq * seq * d * (0.5 if causal else 1.0)
                out.append(
                    Case(
                        tag,
                        _sh((bh, seq, d)),
                        name,
                        at_args,
                        lambda *a, cfg, _c=causal, _s=sc: attention.attention_fwd_pallas(
                            *a, causal=_c, scale=_s, cfg=cfg
                        ),
                        lambda *a, _c=causal, _s=sc: attention.attention_fwd_reference(*a, causal=_c, scale=_s),
                        ("out", "lse"),
                        lambda fl=fl: fl,
                        tf32=True,
                    )
                )
                out.append(
                    Case(
                        tag + "_bwd",
                        _sh((bh, seq, d)),
                        name,
                        atb_args,
                        lambda *a, cfg, _c=causal, _s=sc: attention.attention_bwd_pallas(
                            *a, causal=_c, scale=_s, mask_grad=False, cfg=cfg
                        )[:3],
                        lambda *a, _c=causal, _s=sc: attention.attention_bwd_reference(*a, causal=_c, scale=_s)[:3],
                        ("dq", "dk", "dv"),
                        lambda fl=fl: 2.5 * fl,
                        tf32=True,
                    )
                )
        for lookups, vocab, d in shp["emb"]:

            def emb_args(lookups=lookups, vocab=vocab, d=d, dt=dt):
                ids = jnp.asarray(np.random.default_rng(21).integers(0, vocab, lookups), jnp.int32)
                return (ids, _normal(22, (lookups, d), dt))

            out.append(
                Case(
                    "embedding_bwd",
                    f"{lookups}->{vocab}x{d}",
                    name,
                    emb_args,
                    lambda i, g, cfg, _v=vocab, _dt=dt: embedding.embedding_bwd_pallas(
                        i, g, vocab_size=_v, dtype=_dt, cfg=cfg
                    ),
                    lambda i, g, _v=vocab: embedding.embedding_bwd_reference(i, g, vocab_size=_v, dtype=jnp.float32),
                    ("dtable",),
                )
            )
    return out + _mosaic_twins(out)


# The Mosaic GPU variants (rumus_fx/kernels/mosaic_gpu.py) of the row kernels:
# the same inputs and references; on a CPU (--cpu) they run their jax.numpy
# emulation, so only a GPU run checks the kernels themselves.
_MOSAIC = {
    "softmax": lambda x, cfg: mosaic_gpu.softmax_mgpu(x, axis=-1),
    "softmax_bwd": lambda y, g, cfg: mosaic_gpu.softmax_bwd_mgpu(y, g, axis=-1),
    "layer_norm": lambda x, w, b, cfg: mosaic_gpu.layer_norm_fwd_mgpu(x, w, b, eps=1e-5),
    "layer_norm_bwd": lambda *a, cfg: mosaic_gpu.layer_norm_bwd_mgpu(*a, has_bias=True),
    "cross_entropy": lambda lg, t, cfg: mosaic_gpu.cross_entropy_mgpu(lg, t, ignore_index=None),
    "cross_entropy_ignore": lambda lg, t, cfg: mosaic_gpu.cross_entropy_mgpu(lg, t, ignore_index=0),
    "batch_norm": lambda x, w, b, cfg: mosaic_gpu.batch_norm_train_mgpu(x, w, b, eps=1e-5),
    "batch_norm_bwd": lambda *a, cfg: mosaic_gpu.batch_norm_train_bwd_mgpu(*a, has_bias=True),
}


def _mosaic_twins(rows: list[Case]) -> list[Case]:
    return [
        dataclasses.replace(c, kernel=c.kernel + "[mgpu]", pallas=_MOSAIC[c.kernel])
        for c in rows
        if c.kernel in _MOSAIC
    ]


# ---------------------------------------------------------------- running


@dataclasses.dataclass
class Row:
    cells: list[str]
    ok: bool


def _time(fn: Callable, args: tuple, iters: int) -> float:
    """Median wall time in milliseconds (after one warm-up call)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _roof(case: Case, args: tuple, out: Any, ms: float) -> str:
    nbytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves((args, out)))
    roof = nbytes / HBM_BYTES_PER_S
    if case.flops is not None:
        roof = max(roof, case.flops() / PEAK_FLOPS[case.dtype])
    return f"{100 * roof / (ms / 1e3):.0f}%" if ms > 0 else "-"


def _summary(checks: list[OutputCheck], tol: tuple[float, float] | list[tuple[float, float]]) -> tuple[bool, list[str]]:
    """(all passed, [worst output, rel, cos, norm]) with the worst the first failing
    one; ``tol``: one bound for every output, or one per output."""
    tols = tol if isinstance(tol, list) else [tol] * len(checks)
    bad = [c for c, t in zip(checks, tols, strict=True) if not c.ok(t)]
    worst = bad[0] if bad else max(checks, key=lambda c: c.rel)
    label = worst.name if not bad else ", ".join(c.name for c in bad)
    return not bad, [label, f"{worst.rel:.1e}", f"{worst.cos:.6f}", f"{worst.norm:.4f}"]


def check_case(case: Case, cfg: Config, iters: int = 0) -> Row:
    """Run one kernel row: every output against the float32 reference."""
    head = [case.kernel, case.shape, case.dtype]
    tol = TF32_TOLERANCE if case.tf32 and case.dtype == "float32" and not cfg.interpret else TOLERANCE[case.dtype]
    try:
        args = case.make()
        kernel = jax.jit(functools.partial(case.pallas, cfg=cfg))
        reference = jax.jit(case.reference)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # Pallas-Triton is deprecated from jax 0.11
            got = jax.block_until_ready(kernel(*args))
        with jax.default_matmul_precision("highest"):  # not TF32: the reference is exact float32
            want = jax.block_until_ready(reference(*_upcast(args)))
        ok, cells = _summary(compare(case.names, got, want), tol)
        timing = ["-", "-", "-"]
        if iters:
            t_kernel = _time(kernel, args, iters)
            t_xla = _time(jax.jit(case.reference), args, iters)
            timing = [f"{t_kernel:.3f}", f"{t_xla:.3f}", _roof(case, args, got, t_kernel)]
        return Row(head + ["ok" if ok else "WRONG"] + cells + timing, ok)
    except Exception as exc:  # report the row, keep going
        msg = str(exc).splitlines()[0][:80] if str(exc) else ""
        return Row(head + [f"FAIL {type(exc).__name__}: {msg}"] + ["-"] * (len(HEADER) - 4), False)


def e2e_cases(scale: str) -> list[tuple[str, Any]]:
    from benchmarks import models

    if scale == "cpu":
        return [
            ("e2e MLP", models.mlp(batch=8, widths=(20, 16, 10))),
            ("e2e TinyGPT", models.tiny_gpt(batch=2, seq=8, vocab=17, d=32, heads=2, blocks=1)),
        ]
    return [("e2e MLP", models.mlp()), ("e2e TinyGPT", models.tiny_gpt())]


def tf32_tolerances(xla: list[OutputCheck]) -> list[tuple[float, float]]:
    """Per output, the bound for the kernels' gradient given XLA's own error at the
    same precision (both against the exact reference): ``E2E_TF32_FACTOR`` times
    XLA's error, within ``E2E_TF32_FLOOR`` .. ``E2E_LOOSEST`` (so a zero, negated or
    swapped gradient fails however inexact XLA's is)."""
    (tight_rel, tight_cos), (loose_rel, loose_cos) = E2E_TF32_FLOOR, E2E_LOOSEST
    out = []
    for x in xla:
        if not x.finite:
            out.append(E2E_TF32_FLOOR)
            continue
        err = max(x.rel, abs(x.norm - 1.0))
        rel = min(max(tight_rel, E2E_TF32_FACTOR * err), loose_rel)
        # 1 - cos grows as the square of an error: the same factor on the error
        cos = max(min(tight_cos, 1.0 - E2E_TF32_FACTOR**2 * (1.0 - x.cos)), loose_cos)
        out.append((rel, cos))
    return out


def check_e2e(label: str, model: Any, mode: str, tf32: bool | None = None) -> Row:
    """``rf.grad`` of a model's loss under ``mode`` against the reference mode,
    parameter by parameter; ``tf32`` (default: not in interpret mode) bounds each
    parameter by XLA's own error at the default precision (``tf32_tolerances``)."""
    head = [label, f"rf.grad ({mode} vs reference)", "float32"]
    try:

        def grads(m: str, precision: str | None = None) -> Any:
            with rf.kernels.use(m), jax.default_matmul_precision(precision):
                return jax.block_until_ready(jax.jit(rf.grad(model.loss_rf))(model.params, model.batch))

        got, want = grads(mode), grads("reference", "highest")
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(want)[0]]
        checks = compare(paths, got, want, E2E_NOISE)
        if tf32 if tf32 is not None else mode != "interpret":  # XLA at the kernels' precision: what TF32 costs
            ok, cells = _summary(checks, tf32_tolerances(compare(paths, grads("reference"), want, E2E_NOISE)))
        else:  # exact float32 products on both sides
            ok, cells = _summary(checks, E2E_TOLERANCE)
        return Row(head + ["ok" if ok else "WRONG"] + cells + ["-", "-", "-"], ok)
    except Exception as exc:
        msg = str(exc).splitlines()[0][:80] if str(exc) else ""
        return Row(head + [f"FAIL {type(exc).__name__}: {msg}"] + ["-"] * (len(HEADER) - 4), False)


def render(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def write_table(path: Path, rows: list[list[str]], *, device: str, note: str) -> None:
    text = "\n".join(
        [
            "## GPU kernel check (`benchmarks/gpu_check.py`)",
            "",
            f"- Date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}; "
            f"jax {jax.__version__} / jaxlib {jaxlib.__version__}",
            f"- Device: {device}",
            f"- {note}",
            "- Per output: rel = max error / that output's max |reference|, cos = cosine, norm = norm ratio;",
            "  references run in float32 on the same inputs. % roof: H200 (4.8 TB/s, 989 bf16 TFLOP/s).",
            "",
            render(rows),
            "",
        ]
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _select(items: list[Any], only: Sequence[str] | None, key: Callable[[Any], str]) -> list[Any]:
    if not only:
        return items
    return [x for x in items if any(o in key(x) for o in only)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny shapes, interpret-mode kernels (any platform)")
    parser.add_argument("--out", type=Path, default=None, help="markdown file for the table (rewritten per row)")
    parser.add_argument("--time-limit", type=float, default=480.0, help="hard limit on the whole run, seconds")
    parser.add_argument("--only", default="", help="comma-separated substrings of the kernels to run (e2e: 'e2e')")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated dtypes")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per row (0: no timing)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    todo: list[Any] = []
    rows: list[list[str]] = []
    lock = threading.Lock()
    device = ", ".join(sorted({d.device_kind for d in jax.devices()}))
    note = ""

    def flush(extra: Sequence[list[str]] = ()) -> None:
        if args.out is not None:
            write_table(args.out, rows + list(extra), device=device, note=note)

    listed = threading.Event()  # set once ``todo`` holds every row

    def at_limit() -> None:
        with lock:
            left = [[*_label(x), "SKIPPED (time limit)"] + ["-"] * (len(HEADER) - 4) for x in todo[len(rows) :]]
            if not listed.is_set():  # the limit came while the rows were still being listed
                left.append(["(rows not yet listed)", "-", "-", "SKIPPED (time limit)"] + ["-"] * (len(HEADER) - 4))
            flush(left)
            when = f"after {len(rows)} rows" if listed.is_set() else "before the rows were listed"
            print(f"time limit of {args.time_limit:g} s reached {when}", flush=True)
            os._exit(2)

    timer = threading.Timer(args.time_limit, at_limit)
    timer.daemon = True
    timer.start()
    backend = jax.default_backend()
    if backend != "gpu" and not args.cpu:
        print(f"no GPU: jax backend is {backend!r} ({device}); nothing checked.")
        print("Run this on a GPU machine, or pass --cpu to check the interpret-mode kernels with tiny shapes.")
        timer.cancel()
        return 0
    scale = "cpu" if args.cpu else "gpu"
    dtypes = [d for d in args.dtypes.split(",") if d]
    unknown = set(dtypes) - set(DTYPES)
    if unknown:
        parser.error(f"unknown dtypes {sorted(unknown)}; expected some of {DTYPES}")
    only = [o for o in args.only.split(",") if o]
    iters = args.iters if args.iters is not None else (0 if args.cpu else 10)
    cfg = Config("gpu", interpret=args.cpu)
    note = (
        "Pallas interpreter on CPU (--cpu): checks the script and the kernels' logic, NOT a GPU run"
        if args.cpu
        else f"Pallas kernels compiled for the GPU; median of {iters} timed calls"
    )
    todo += _select(e2e_cases(scale), only, lambda e: e[0])  # first: they cover every kernel at once
    todo += _select(cases(scale, dtypes), only, lambda c: c.kernel)
    listed.set()
    print(f"jax {jax.__version__}, backend {backend} ({device}); {len(todo)} rows", flush=True)
    ok_all = True
    for item in todo:
        if isinstance(item, Case):
            row = check_case(item, cfg, iters)
        else:
            row = check_e2e(item[0], item[1], "interpret" if args.cpu else "auto")
        with lock:
            rows.append(row.cells)
            ok_all &= row.ok
            flush()
        print("  " + " | ".join(row.cells), flush=True)
    timer.cancel()
    print(render(rows))
    print(f"{sum(r[3] == 'ok' for r in rows)}/{len(rows)} rows ok in {time.perf_counter() - start:.0f} s")
    return 0 if ok_all else 1


def _label(item: Any) -> list[str]:
    if isinstance(item, Case):
        return [item.kernel, item.shape, item.dtype]
    return [item[0], "rf.grad", "float32"]


if __name__ == "__main__":
    sys.exit(main())
