"""benchmarks/gpu_check.py runs on a CPU-only machine: it reports that there is
no GPU, and with --interpret it exercises every row with tiny sizes and writes
its section of a results file, keeping the others."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
OTHER_SECTIONS = """# Benchmark results

## rumus_fx vs jax.grad (`python -m benchmarks.models`)

| model | jit step |
|---|---|
| MLP | 1.00 |

## GPU kernels (`benchmarks/gpu_check.py`)

Not measured.

## Later notes

Kept as they are.
"""


def _run(*flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, str(SCRIPT), *flags], env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_check", None)


def test_reports_no_gpu(tmp_path):
    results = tmp_path / "RESULTS.md"
    proc = _run("--results", str(results))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("no GPU")
    assert not results.exists()  # nothing measured, nothing written


@pytest.mark.slow  # the kernels' interpret and lowering tests run by default
def test_interpret_rows_all_check_out_and_fill_their_section(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text(OTHER_SECTIONS)
    proc = _run("--interpret", "--iters", "1", "--markdown", "--results", str(results))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "kernel" not in line]
    assert len(rows) == 19
    assert all("| ok |" in row for row in rows), "\n".join(rows)
    text = results.read_text()
    assert text.count("## GPU kernels") == 1 and "Not measured." not in text
    assert "| MLP | 1.00 |" in text and "## Later notes\n\nKept as they are.\n" in text
    assert "NOT GPU measurements" in text and "jax 0." in text
    assert all(row in text for row in rows)


def test_results_section_is_replaced_not_appended(gpu_check, tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text(OTHER_SECTIONS)
    row = ["softmax", "8x8", "float32", "0.0e+00", "ok", "1.000", "2.000", "2.00x", "1", "-", "1%", "1%"]
    for _ in range(2):
        gpu_check.write_results(results, [row], devices="NVIDIA H200", scale="full", iters=30, interpret=False)
    text = results.read_text()
    assert text.count("## GPU kernels") == 1 and text.count("| softmax | 8x8 |") == 1
    assert "Device: NVIDIA H200" in text and text.endswith("Kept as they are.\n")
    assert text.index("## rumus_fx vs jax.grad") < text.index("## GPU kernels") < text.index("## Later notes")
    fresh = tmp_path / "NEW.md"
    gpu_check.write_results(fresh, [row], devices="NVIDIA H200", scale="full", iters=30, interpret=False)
    assert fresh.read_text().startswith("# Benchmark results\n\n## GPU kernels")


def test_roofline_fractions(gpu_check):
    import jax.numpy as jnp

    x = jnp.zeros((1000, 1000), jnp.float32)  # 4 MB in, 4 MB out
    copy = gpu_check.Bench("copy", "", "float32", (x,), None, None)
    gbs, tflops, roof = gpu_check._rates(copy, x, 8e6 / 4.8e12 * 1e3)  # exactly at the HBM roofline
    assert (gbs, tflops, roof) == ("4800", "-", "100%")
    mm = gpu_check.Bench("matmul", "", "bfloat16", (x,), None, None, flops=989e12 * 1e-3)  # 1 ms at peak
    assert gpu_check._rates(mm, x, 2.0) == ("4", "494.5", "50%")
