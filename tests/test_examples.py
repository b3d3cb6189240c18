"""Smoke runs of every script in examples/ (tiny flags, in a subprocess), plus the
full-length runs behind -m slow."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run_example(script: str, *args: str, timeout: float = 600, stderr: bool = False) -> str | tuple[str, str]:
    """Run ``examples/<script> args...`` with this interpreter; its stdout (and
    stderr when asked). Fails the test with the output's tail on a non-zero exit."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["JAX_NUMPY_RANK_PROMOTION"] = "raise"  # the examples obey the suite's strictness too
    env["MPLBACKEND"] = "Agg"
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(ROOT),
        timeout=timeout,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} failed (exit {proc.returncode}):\n{output[-4000:]}"
    return (proc.stdout, proc.stderr) if stderr else proc.stdout


def _float(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not found in:\n{text}"
    return float(m.group(1))


def test_train_cnn_smoke(tmp_path):
    out, err = run_example(
        "train_cnn.py", "--epochs", "1", "--limit", "256", "--batch-size", "32", "--out", str(tmp_path), stderr=True
    )
    assert "train:" in err and "loss=" in err  # the tqdm progress bar, with the loss
    acc = _float(r"final test accuracy: ([0-9.]+)", out)
    assert 0.0 <= acc <= 1.0
    assert "reloaded predictions identical: True" in out
    plot, ckpt = tmp_path / "train_cnn.png", tmp_path / "digits_cnn.safetensors"
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ckpt.stat().st_size > 0
    assert str(plot) in out and str(ckpt) in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["digits_cnn.safetensors", "train_cnn.png"]


def test_train_gpt_smoke(tmp_path):
    out = run_example(
        "train_gpt.py",
        *("--steps", "3", "--chars", "20000", "--block", "16", "--dim", "16", "--heads", "2", "--layers", "1"),
        *("--batch-size", "4", "--eval-batches", "2", "--sample-len", "12", "--out", str(tmp_path), "--no-progress"),
    )
    assert "standard library source" in out
    val = _float(r"final val loss: ([0-9.]+)", out)
    assert 0.0 < val < 10.0
    assert "sample:" in out
    assert (tmp_path / "tiny_gpt.safetensors").exists()


def test_per_example_grads():
    out = run_example("per_example_grads.py", "--batch", "4")
    assert "per-example grad 0.weight: shape (4, 64, 32)" in out
    assert _float(r"batch grad: max abs diff ([0-9.e+-]+)", out) < 1e-5
    assert _float(r"jnp version: max abs diff ([0-9.e+-]+)", out) < 1e-5


def test_hvp():
    out = run_example("hvp.py", "--n", "6", "--hidden", "3")
    assert _float(r"jax.hessian\(loss\) @ v: max abs diff ([0-9.e+-]+)", out) < 1e-10
    assert _float(r"vmapped HVPs vs jax.hessian: max abs diff ([0-9.e+-]+)", out) < 1e-10


def test_data_parallel_8_virtual_devices_matches_one_device():
    out = run_example("data_parallel.py", "--devices", "8", "--steps", "2", "--batch-size", "16")
    assert "8 devices: " in out
    assert "per-device shards [(2, 1, 8, 8)" in out
    assert "OK: 8-device data-parallel training matches 1 device" in out
    for line in re.findall(r"step \d+: .*", out):
        one, eight = re.findall(r"device[s]? ([0-9.]+)", line)
        assert abs(float(one) - float(eight)) < 1e-5


def test_data_parallel_auto_axes():
    out = run_example("data_parallel.py", "--devices", "8", "--steps", "1", "--batch-size", "16", "--auto")
    assert "(Auto)" in out and "every gradient has its parameter's sharding: True" in out
    assert "OK: 8-device data-parallel training matches 1 device" in out


def test_tensor_parallel_2x4_mesh_matches_one_device():
    out = run_example("tensor_parallel.py", "--devices", "8", "--model", "4", "--steps", "2", "--layers", "1")
    assert "mesh: {'data': 2, 'model': 4}, axis types ['Explicit', 'Explicit']" in out
    assert "fc1 weight (32, 128) P(None, 'model'): per-device shard (32, 32)" in out
    assert "every gradient has its parameter's sharding: True" in out
    assert "OK: tensor-parallel training matches 1 device" in out


def test_inspect_tape():
    out = run_example("inspect_tape.py", "--batch-size", "2")
    for record in (
        "Conv2dBackward",
        "BatchNorm2dBackward",
        "ReluBackward",
        "MaxPool2dBackward",
        "CrossEntropyBackward",
    ):
        assert record in out
    assert "saved for backward" in out and "tape.saved_bytes = " in out
    assert "caught rf.VersionMismatch" in out


@pytest.mark.slow
def test_train_cnn_default_reaches_97_percent(tmp_path):
    out = run_example("train_cnn.py", "--out", str(tmp_path), "--no-progress")
    assert _float(r"final test accuracy: ([0-9.]+)", out) >= 0.97


@pytest.mark.slow
def test_train_gpt_default_learns(tmp_path):
    out = run_example("train_gpt.py", "--out", str(tmp_path), "--no-progress")
    assert _float(r"final val loss: ([0-9.]+)", out) < 2.0
