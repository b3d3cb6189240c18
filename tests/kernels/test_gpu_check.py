"""benchmarks/gpu_check.py runs on a CPU-only machine: it reports that there is
no GPU, and with --interpret it exercises every row with tiny sizes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def _run(*flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, str(SCRIPT), *flags], env=env, capture_output=True, text=True, timeout=600)


def test_reports_no_gpu():
    proc = _run()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("no GPU")


def test_interpret_rows_all_check_out():
    proc = _run("--interpret", "--iters", "1", "--markdown")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "kernel" not in line]
    assert len(rows) == 19
    assert all("| ok |" in row for row in rows), "\n".join(rows)
