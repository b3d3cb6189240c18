"""rumus_fx vs jax.grad on the benchmark models, measured interleaved in one process.

Usage: ``python -m benchmarks.models [--models mlp,cnn,gpt] [--repeats N] [--chain-only]``

For each model it first asserts that both implementations give the same loss and
gradients, then reports ratios rf / jax.grad (below 1.00 means rumus_fx is
faster or smaller): the jit-compiled step (median of interleaved runs), trace +
compile time, the eager (un-jitted) step, and the compiled program's temporary
memory (``compiled.memory_analysis()``). A second table puts each step against
the machine: FLOPs per step from XLA's cost analysis of rf's compiled program, the
matmul rate this machine reaches (the fastest block of a 2048^3 float32 matmul),
the resulting bound and the fraction of it rf's jit step achieves, rf's jit step
compiled with ``rf.CPU_COMPILER_OPTIONS``, and -- with torch installed (the
``bench`` extra) -- the PyTorch eager step and the ratios rf / PyTorch. Last, the
per-op cost of a 200-op chain of tiny ops, forward (recording) and forward +
backward, eager. The second table's rf steps are timed again in blocks of their
own (each after 0.15 s of untimed calls), taking turns with blocks of PyTorch's
step where torch is installed, and its bound fraction and rf / PyTorch ratios come
from those blocks: PyTorch is never interleaved call by call with XLA programs
(its OpenMP threads keep spinning after each call), and rf's steps read slower
right after ``jax.grad``'s (RESULTS.md).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import rumus_fx as rf
from rumus_fx.autograd import whole_tape

from .models import CHAIN_OPS, MODELS, Model, chain_rf, chain_torch

EAGER_WARMUP = 2 + 2 * whole_tape.TIMED  # eager calls before timing: the whole-tape choice is made by then
STEP_BLOCKS = 3  # alternating blocks of rf jit, rf eager and PyTorch (measure)
# untimed calls at the start of each block: after a pause (PyTorch's settle) this
# machine ran the next 30-40 ms of XLA calls up to 2x slower, torch or not
# (a jitted MLP step: 9-10 ms for four calls after a 0.3 s sleep, then 5.4)
BLOCK_WARM_S = 0.15


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def _torch_settle() -> None:
    """Let torch's OpenMP workers stop spinning before XLA is timed again."""
    time.sleep(0.3)


def check_same(model: Model, rtol: float = 2e-4, atol: float = 2e-5) -> tuple[float, float]:
    """Assert rf and jax.grad agree on loss and gradients; returns the losses."""
    v_rf, g_rf = jax.jit(rf.value_and_grad(model.loss_rf))(model.params, model.batch)
    v_j, g_j = jax.jit(jax.value_and_grad(model.loss_jax))(model.params, model.batch)
    np.testing.assert_allclose(v_rf, v_j, rtol=rtol, atol=atol)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=atol), g_rf, g_j)
    return float(v_rf), float(v_j)


def _block(x: Any) -> Any:
    return jax.block_until_ready(x)


def _interleaved(fns: list[Callable[[], Any]], repeats: int, warmup: int = 2) -> list[float]:
    """Median seconds of each fn, running them alternately so drift hits both."""
    for f in fns:
        for _ in range(warmup):
            _block(f())
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            _block(f())
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def _compile_time(fun: Callable, args: tuple) -> tuple[float, Any]:
    # a fresh function object each time so no jit cache is reused
    wrapped = jax.jit(lambda *a: fun(*a))
    t0 = time.perf_counter()
    compiled = wrapped.lower(*args).compile()
    return time.perf_counter() - t0, compiled


def compile_pair(fun_a: Callable, fun_b: Callable, args: tuple, times: int) -> tuple[list, list, Any, Any]:
    """Trace + compile times of two functions, ``times`` each, interleaved: (seconds
    of a, seconds of b, a's last compiled program, b's)."""
    ct_a, ct_b = [], []
    for _ in range(times):
        t, comp_a = _compile_time(fun_a, args)
        ct_a.append(t)
        t, comp_b = _compile_time(fun_b, args)
        ct_b.append(t)
    return ct_a, ct_b, comp_a, comp_b


def _blocks(
    fns: list[Callable[[], Any]],
    blocks: int,
    per_block: int,
    settle: list[Any] | None = None,
    warm_s: float = BLOCK_WARM_S,
) -> list[list[float]]:
    """Seconds of each call of each fn, timed in blocks of its own
    (``per_block`` consecutive calls after untimed ones for ``warm_s`` seconds,
    at least one), the blocks taking turns (A B C A B C ...) so that drift on a
    shared machine hits all; ``settle[i]``, when given, runs after each of fn
    i's blocks."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(blocks):
        for i, f in enumerate(fns):
            t_warm = time.perf_counter() + warm_s
            _block(f())
            while time.perf_counter() < t_warm:
                _block(f())
            for _ in range(per_block):
                t0 = time.perf_counter()
                _block(f())
                times[i].append(time.perf_counter() - t0)
            if settle is not None and settle[i] is not None:
                settle[i]()
    return times


def matmul_gflops(n: int = 2048, repeats: int = 5, blocks: int = 3) -> float:
    """The float32 matmul rate (GFLOP/s) of this machine under XLA, the bound's
    rate: the fastest of ``blocks`` blocks of ``repeats`` calls, since a
    median on a shared machine reads the neighbours' load into the bound (one
    run's median read 103 GFLOP/s where the machine reaches 190-200)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jax.numpy.float32)
    f = jax.jit(lambda a: a @ a).lower(a).compile()
    (t,) = _blocks([lambda: f(a)], blocks, repeats)
    return 2 * n**3 / min(t) / 1e9


def cost_flops(compiled: Any) -> float | None:
    """FLOPs of a compiled program from XLA's cost analysis (None if it gives none)."""
    try:
        ca = compiled.cost_analysis()
    except Exception:  # pragma: no cover - backends without a cost model
        return None
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    flops = (ca or {}).get("flops")
    return None if flops is None else float(flops)


def chain_per_op(repeats: int = 20, n: int = CHAIN_OPS, with_torch: bool | None = None) -> dict[str, float]:
    """Microseconds per op of the ``n``-op chain, eagerly: ``rf_fwd`` (the forward,
    recorded on a tape), ``rf_fwd_bwd`` (``rf.value_and_grad``), and the same for
    PyTorch (``torch_fwd`` with ``requires_grad``, ``torch_fwd_bwd``) when installed."""
    x0 = jax.random.normal(jax.random.key(1), (64,), jax.numpy.float32)
    vg = rf.value_and_grad(lambda x: chain_rf(x, n))

    def fwd():
        with rf.Tape():
            return chain_rf(rf.tensor(x0, requires_grad=True), n).value

    t_fwd, t_fb = _interleaved([fwd, lambda: vg(x0)], repeats, warmup=EAGER_WARMUP)
    out = {"n": n, "rf_fwd": 1e6 * t_fwd / n, "rf_fwd_bwd": 1e6 * t_fb / n}
    if with_torch is None:
        with_torch = torch_available()
    if with_torch:
        import torch

        xt = torch.from_numpy(np.array(x0)).requires_grad_(True)
        t_fwd, t_fb = _interleaved([lambda: chain_torch(xt, n), lambda: chain_torch(xt, n).backward()], repeats, 2)
        out.update(torch_fwd=1e6 * t_fwd / n, torch_fwd_bwd=1e6 * t_fb / n)
        _torch_settle()
    return out


def measure(model: Model, repeats: int = 30, eager_repeats: int = 5, with_torch: bool | None = None) -> dict[str, Any]:
    args = (model.params, model.batch)
    vg_rf = rf.value_and_grad(model.loss_rf)
    vg_j = jax.value_and_grad(model.loss_jax)

    # trace + compile (interleaved, median of 3) and compiled temp memory
    ct_rf, ct_j, comp_rf, comp_j = compile_pair(vg_rf, vg_j, args, 3)
    mem_rf = comp_rf.memory_analysis().temp_size_in_bytes
    mem_j = comp_j.memory_analysis().temp_size_in_bytes
    flops = cost_flops(comp_rf)

    jit_rf, jit_j = jax.jit(vg_rf), jax.jit(vg_j)
    fns = [lambda: jit_rf(*args), lambda: jit_j(*args)]
    if jax.default_backend() == "cpu":
        jit_opt = jax.jit(vg_rf).lower(*args).compile(compiler_options=rf.CPU_COMPILER_OPTIONS)
        fns.append(lambda: jit_opt(*args))
    t_jit_rf, t_jit_j, *t_opt = _interleaved(fns, repeats)
    # warm up past the whole-tape choice (rules, two timed rule walks, compile, two timed compiled walks)
    t_eager_rf, t_eager_j = _interleaved(
        [lambda: vg_rf(*args), lambda: vg_j(*args)], eager_repeats, warmup=EAGER_WARMUP
    )

    row = {
        "model": model.name,
        "jit_rf_ms": 1e3 * t_jit_rf,
        "jit_jax_ms": 1e3 * t_jit_j,
        "jit_ratio": t_jit_rf / t_jit_j,
        "compile_ratio": statistics.median(ct_rf) / statistics.median(ct_j),
        "eager_ratio": t_eager_rf / t_eager_j,
        "eager_rf_ms": 1e3 * t_eager_rf,
        "eager_jax_ms": 1e3 * t_eager_j,
        "mem_rf": mem_rf,
        "mem_jax": mem_j,
        "mem_ratio": mem_rf / mem_j if mem_j else float("nan"),
        "flops": flops,
        "jit_opt_ms": 1e3 * t_opt[0] if t_opt else None,
        "torch_ratio": None,
        "torch_ms": None,
    }
    if with_torch is None:
        with_torch = torch_available()
    # the speed table's steps: rf's jit and eager steps (and PyTorch's, where
    # installed), each in blocks of its own, taking turns. Interleaved call by
    # call, PyTorch's spinning OpenMP threads slow XLA's programs, and jax.grad's
    # steps (its eager one thousands of dispatches, its CNN 40 MiB of
    # temporaries) slow the rf step that follows them: rf's eager CNN step read
    # 14.9 ms interleaved against 12.0 ms in its own blocks (RESULTS.md)
    fns: list[Callable[[], Any]] = [lambda: jit_rf(*args), lambda: vg_rf(*args)]
    settle: list[Any] = [None, None]
    if model.torch_step is not None and with_torch:
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads()))
        fns.append(model.torch_step())
        settle.append(_torch_settle)
    t_jit_b, t_eager_b, *t_torch = (
        statistics.median(t) for t in _blocks(fns, STEP_BLOCKS, max(repeats // 4, eager_repeats), settle)
    )
    row["jit_rf_block_ms"] = 1e3 * t_jit_b
    row["eager_rf_block_ms"] = 1e3 * t_eager_b
    if t_torch:
        row["torch_ms"] = 1e3 * t_torch[0]
        row["torch_ratio"] = t_eager_b / t_torch[0]
        row["torch_jit_ratio"] = t_jit_b / t_torch[0]
    gc.collect()
    return row


def format_table(rows: list[dict[str, Any]], no_torch: str = "n/a (torch not installed)") -> str:
    head = (
        "| model | jit step rf/jax.grad | trace+compile rf/jax | eager step rf/jax.grad "
        "| temp memory rf/jax | eager rf/torch |"
    )
    lines = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        torch_col = (
            no_torch
            if r["torch_ratio"] is None
            else (
                f"{r['torch_ratio']:.2f} ({r.get('eager_rf_block_ms', r['eager_rf_ms']):.1f} / {r['torch_ms']:.1f} ms)"
            )
        )
        lines.append(
            f"| {r['model']} | {r['jit_ratio']:.2f} ({r['jit_rf_ms']:.2f} / {r['jit_jax_ms']:.2f} ms) "
            f"| {r['compile_ratio']:.2f} | {r['eager_ratio']:.2f} ({r['eager_rf_ms']:.1f} / {r['eager_jax_ms']:.1f} ms) "
            f"| {r['mem_ratio']:.2f} ({r['mem_rf'] / 2**20:.1f} / {r['mem_jax'] / 2**20:.1f} MiB) | {torch_col} |"
        )
    return "\n".join(lines)


def format_speed_table(rows: list[dict[str, Any]], gflops: float, no_torch: str = "n/a (torch not installed)") -> str:
    """Steps against the machine's matmul rate and against PyTorch eager (ms per
    step; rf's jit and eager steps and PyTorch's from their own alternating
    blocks, the jax.grad and compile-option columns from the interleaved runs);
    ``no_torch`` fills the PyTorch cells of rows measured without it."""
    head = (
        "| model | GFLOP/step | bound ms | rf jit ms (bound fraction) | rf jit + CPU_COMPILER_OPTIONS "
        "| jax.grad jit | PyTorch eager | rf jit / PyTorch | rf eager ms | rf eager / PyTorch |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fl = r.get("flops")
        bound = None if not fl else 1e3 * fl / (gflops * 1e9)
        jit_ms = r.get("jit_rf_block_ms", r["jit_rf_ms"])  # rf's steps in blocks of their own (measure)
        frac = "" if bound is None else f" ({bound / jit_ms:.2f})"
        opt = "n/a" if r.get("jit_opt_ms") is None else f"{r['jit_opt_ms']:.2f}"
        eager_ms = r.get("eager_rf_block_ms", r["eager_rf_ms"])
        if r.get("torch_ms") is None:
            t_ms = t_jit = t_eager = no_torch
        else:
            t_ms = f"{r['torch_ms']:.2f}"
            t_jit = f"{r['torch_jit_ratio']:.2f}"
            t_eager = f"{r['torch_ratio']:.2f}"
        lines.append(
            f"| {r['model']} | {'n/a' if not fl else f'{fl / 1e9:.2f}'} | {'n/a' if bound is None else f'{bound:.2f}'} "
            f"| {jit_ms:.2f}{frac} | {opt} | {r['jit_jax_ms']:.2f} | {t_ms} | {t_jit} "
            f"| {eager_ms:.1f} | {t_eager} |"
        )
    return "\n".join(lines)


def format_chain(c: dict[str, float]) -> str:
    line = f"{c.get('n', CHAIN_OPS)}-op chain, µs per op: rf forward {c['rf_fwd']:.1f}, forward+backward {c['rf_fwd_bwd']:.1f}"
    if "torch_fwd" in c:
        line += (
            f"; PyTorch forward {c['torch_fwd']:.1f}, forward+backward {c['torch_fwd_bwd']:.1f}"
            f" (rf / PyTorch {c['rf_fwd_bwd'] / c['torch_fwd_bwd']:.2f})"
        )
    else:
        line += "; PyTorch n/a (torch not installed)"
    return line


def main(
    argv: list[str] | None = None,
    *,
    description: str | None = None,
    prepare: Callable[[Model], Model] = lambda model: model,
    title: str = "ratios rf / jax.grad (< 1.00: rumus_fx faster or smaller), medians of interleaved runs",
    chain: bool = True,
) -> None:
    """Check and measure the models; ``prepare`` turns each into the pair to time."""
    parser = argparse.ArgumentParser(description=description or __doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn,gpt", help="comma-separated subset of mlp,cnn,gpt")
    parser.add_argument("--repeats", type=int, default=30, help="timed runs of each jit step")
    parser.add_argument("--eager-repeats", type=int, default=5, help="timed runs of each eager step")
    if chain:
        parser.add_argument("--chain-only", action="store_true", help="only the 200-op chain's line")
    args = parser.parse_args(argv)
    with_torch = torch_available()
    versions = ""
    if with_torch:
        import torch

        versions = f"; torch {torch.__version__} ({torch.get_num_threads()} threads)"
    print(
        f"jax {jax.__version__} on {jax.default_backend()} ({platform.processor() or platform.machine()}, "
        f"{jax.device_count()} device(s)); rumus_fx {rf.__version__}; kernels: {rf.kernels.backend()}{versions}"
    )
    if chain and args.chain_only:
        print(format_chain(chain_per_op(with_torch=with_torch)))
        return
    gflops = matmul_gflops()
    print(f"matmul rate (2048^3 float32, XLA): {gflops:.0f} GFLOP/s", flush=True)
    rows = []
    for name in args.models.split(","):
        model = prepare(MODELS[name.strip()]())
        l_rf, l_j = check_same(model)
        print(f"{model.name}: same loss ({l_rf:.6f} vs {l_j:.6f}) and gradients; measuring ...", flush=True)
        rows.append(measure(model, args.repeats, args.eager_repeats, with_torch))
    print()
    print(title)
    no_torch = "n/a (no PyTorch step)" if with_torch else "n/a (torch not installed)"
    print(format_table(rows, no_torch))
    print()
    print(
        f"ms per step against the machine (bound = FLOPs at {gflops:.0f} GFLOP/s) and PyTorch eager; "
        "rf's steps and PyTorch's in alternating blocks of their own"
    )
    print(format_speed_table(rows, gflops, no_torch))
    if chain:
        print()
        print(format_chain(chain_per_op(with_torch=with_torch)))


if __name__ == "__main__":  # pragma: no cover
    main()
