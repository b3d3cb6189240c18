"""Smoke runs of every script in examples/ (tiny flags, in a subprocess), plus the
full-length runs behind -m slow."""

from __future__ import annotations

import functools
import importlib
import re
import subprocess
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf

from ._subprocess import child_env

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run_example(script: str, *args: str, timeout: float = 600, stderr: bool = False) -> str | tuple[str, str]:
    """Run ``examples/<script> args...`` with this interpreter; its stdout (and
    stderr when asked). Fails the test with the output's tail on a non-zero exit."""
    # the examples obey the suite's strictness too
    env = child_env(JAX_NUMPY_RANK_PROMOTION="raise", MPLBACKEND="Agg")
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


def import_example(name: str):
    """``examples/<name>.py`` as a module (examples/ goes on sys.path, as when run)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


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


@pytest.mark.slow  # the main demo's (train_cnn) smoke run stays in the default run
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


@pytest.mark.slow  # its loss and gradients are checked against jax by default
def test_train_llama_smoke():
    out = run_example(
        "train_llama.py",
        *("--steps", "3", "--chars", "20000", "--block", "16", "--dim", "16", "--heads", "2", "--layers", "2"),
        *("--batch-size", "4", "--eval-batches", "2", "--sample-len", "12", "--no-progress"),
    )
    assert "standard library source" in out and "one rf.lax.scan" in out
    m = re.search(r"temp memory: ([0-9.]+) MiB with rf.checkpoint, ([0-9.]+) MiB without", out)
    assert m, out
    with_ckpt, without = float(m.group(1)), float(m.group(2))
    assert 0 < with_ckpt <= without
    assert "training with rf.checkpoint" in out
    assert 0.0 < _float(r"step 0: val loss ([0-9.]+)", out) < 10.0
    assert 0.0 < _float(r"final val loss: ([0-9.]+)", out) < 10.0
    assert "sample:" in out


@pytest.mark.parametrize(
    "dtype, remat",
    [  # with and without rf.checkpoint by default; float32 with it as well with -m slow
        pytest.param("float32", True, marks=pytest.mark.slow),
        ("float32", False),
        ("float64", True),
    ],
    ids=["f32-ckpt", "f32", "f64-ckpt"],
)
def test_train_llama_loss_and_grads_match_jax(dtype, remat):
    """The example's loss under rf.value_and_grad (rnp, rf.lax.scan, rf.checkpoint)
    equals jax.value_and_grad of the same function on jnp, lax.scan, jax.checkpoint."""
    tl = import_example("train_llama")
    f64 = dtype == "float64"
    with jax.enable_x64(f64):
        cfg = tl.Config(vocab=11, block=8, dim=16, heads=2, layers=2)
        params = tl.init_params(cfg, jax.random.key(0), jnp.dtype(dtype))
        rng = np.random.default_rng(0)
        x, y = (jnp.asarray(rng.integers(0, cfg.vocab, (2, cfg.block)), jnp.int32) for _ in range(2))
        got = jax.jit(rf.value_and_grad(functools.partial(tl.loss_fn, cfg=cfg, ops=tl.RF_OPS, remat=remat)))(
            params, x, y
        )
        want = jax.jit(jax.value_and_grad(functools.partial(tl.loss_fn, cfg=cfg, ops=tl.JAX_OPS, remat=remat)))(
            params, x, y
        )
        assert got[1]["layers"]["wq"].dtype == jnp.dtype(dtype)
        tol = 1e-9 if f64 else 1e-4
        chex.assert_trees_all_close(got, want, rtol=tol, atol=tol * 1e-2)


@pytest.mark.slow  # its gradients are checked against jax by default
def test_gradient_penalty_smoke():
    out = run_example(
        "gradient_penalty.py",
        *("--gan-steps", "4", "--n-critic", "2", "--batch-size", "32", "--hidden", "16"),
        *("--maml-steps", "4", "--tasks", "3", "--shots", "5"),
    )
    assert "Wasserstein estimate" in out and "gradient penalty" in out
    assert "modes covered" in out and "after one step" in out
    assert _float(r"vs jax.grad of jax.grad: max abs diff ([0-9.e+-]+)", out) < 1e-5
    assert _float(r"vs jax.grad through jax.grad: max abs diff ([0-9.e+-]+)", out) < 1e-5


def test_gradient_penalty_and_maml_grads_match_jax_float64(x64):
    gp = import_example("gradient_penalty")
    k1, k2, k3, k4 = jax.random.split(jax.random.key(3), 4)
    critic = gp.init_mlp(k1, (2, 8, 8, 1), jnp.float64)
    real = gp.sample_real(k2, 16).astype(jnp.float64)
    fake = jax.random.normal(k3, (16, 2), jnp.float64)
    eps = jax.random.uniform(k4, (16, 1), jnp.float64)
    got = jax.jit(rf.value_and_grad(gp.critic_loss, has_aux=True))(critic, real, fake, eps, 10.0)
    # the oracles compiled (eagerly each of their primitives compiles on its own)
    critic_loss_jnp = functools.partial(gp.critic_loss, critic=gp.mlp_jnp, grad=jax.grad, np_=jnp)
    want = jax.jit(jax.value_and_grad(critic_loss_jnp, has_aux=True))(critic, real, fake, eps, 10.0)
    chex.assert_trees_all_close(got, want, rtol=1e-9, atol=1e-12)
    assert float(jnp.abs(got[0][1][1])) > 0  # the penalty is not trivially zero

    net = gp.init_mlp(k1, (1, 8, 8, 1), jnp.float64)
    data = [a.astype(jnp.float64) for a in gp.sample_tasks(k2, 3, 5)]
    task_rf = jax.vmap(rf.value_and_grad(gp.maml_task_loss), in_axes=(None, 0, 0, 0, 0))
    task_jax = jax.vmap(jax.value_and_grad(gp.maml_jnp_task_loss), in_axes=(None, 0, 0, 0, 0))
    chex.assert_trees_all_close(jax.jit(task_rf)(net, *data), jax.jit(task_jax)(net, *data), rtol=1e-9, atol=1e-12)


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


@pytest.mark.slow  # the Explicit-axes run of the example stays in the default run
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


def test_tensor_parallel_two_processes():
    """The multi-host path of docs/sharding.md: the same script in two processes (4 CPU
    devices each, jax.distributed over localhost), one 2x4 mesh across them."""
    import socket

    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    env = child_env(JAX_PLATFORMS="cpu")
    args = ("--devices", "8", "--model", "4", "--steps", "1", "--layers", "1", "--distributed")
    args += ("--coordinator", f"localhost:{port}", "--num-processes", "2")
    procs = [
        subprocess.Popen(
            [sys.executable, str(EXAMPLES / "tensor_parallel.py"), *args, "--process-id", str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=str(ROOT),
        )
        for i in range(2)
    ]
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=600)[0])
    finally:
        for proc in procs:
            proc.kill()
    for i, (proc, out) in enumerate(zip(procs, outs)):
        assert proc.returncode == 0, f"process {i} failed (exit {proc.returncode}):\n{out[-4000:]}"
        assert "every gradient has its parameter's sharding: True" in out
        assert "OK: tensor-parallel training matches 1 device" in out
    # one all-gather each of the qkv weight, its bias and their gradients; no activation gathered
    assert "'all-gather': 4," in outs[0], outs[0][-2000:]


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


@pytest.mark.slow
def test_train_llama_default_learns():
    out = run_example("train_llama.py", "--no-progress")
    assert _float(r"final val loss: ([0-9.]+)", out) < 2.0


@pytest.mark.slow
def test_gradient_penalty_default_learns():
    out = run_example("gradient_penalty.py")
    assert _float(r"generator: (\d)/8 modes covered", out) >= 6
    assert _float(r"mean distance to the nearest mode ([0-9.]+)", out) < 0.6
    post = re.findall(r"held-out query MSE ([0-9.]+) before adaptation, ([0-9.]+) after one step", out)
    assert float(post[-1][1]) < 1.0 < float(post[0][1])
    assert _float(r"vs jax.grad of jax.grad: max abs diff ([0-9.e+-]+)", out) < 1e-4
    assert _float(r"vs jax.grad through jax.grad: max abs diff ([0-9.e+-]+)", out) < 1e-4
