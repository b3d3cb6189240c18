"""benchmarks/gpu_check.py cannot pass a wrong kernel: faults injected into the
interpret-mode kernels (a zero or negated gradient, an offset output, a wrong
row mean, a dropped masked tail, swapped or scaled gradients) each fail their
rows, and the clean kernels pass. Tiny shapes (the script's ``--cpu`` scale)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from rumus_fx.kernels import attention, batch_norm, cross_entropy, embedding, layer_norm, matmul, softmax
from rumus_fx.kernels._pallas import Config

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
CPU = Config("gpu", interpret=True)


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_check", None)


def _rows(gpu_check, kernel: str, dtypes=("float32",), unaligned_only: bool = False):
    """The check's rows of one kernel at the --cpu scale (both shapes, or the unaligned one)."""
    todo = [c for c in gpu_check.cases("cpu", dtypes) if c.kernel == kernel]
    assert todo, kernel
    if unaligned_only:
        todo = todo[len(todo) // 2 :]
    return [gpu_check.check_case(c, CPU) for c in todo]


def _wrap(monkeypatch, module, name, fault):
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: fault(original(*a, **k)))


def _peak(x):
    return jnp.max(jnp.abs(x.astype(jnp.float32)))


FAULTS = {
    # the faults that passed the old all-outputs-together check
    "cross_entropy dlogits zero": (
        cross_entropy,
        "cross_entropy_pallas",
        "cross_entropy",
        lambda out: (out[0], jnp.zeros_like(out[1])),
    ),
    "cross_entropy dlogits negated": (
        cross_entropy,
        "cross_entropy_pallas",
        "cross_entropy",
        lambda out: (out[0], -out[1]),
    ),
    "attention output + 0.1": (
        attention,
        "attention_fwd_pallas",
        "attention",
        lambda out: (out[0] + jnp.asarray(0.1, out[0].dtype), out[1]),
    ),
    "layer_norm mean off by 30% of its largest value": (
        layer_norm,
        "layer_norm_fwd_pallas",
        "layer_norm",
        lambda out: (out[0], out[1] + 0.3 * _peak(out[1]), out[2]),
    ),
    # and a few more
    "softmax_bwd scaled by 1.01": (softmax, "softmax_bwd_pallas", "softmax_bwd", lambda dx: dx * 1.01),
    "layer_norm_bwd dw and db swapped": (
        layer_norm,
        "layer_norm_bwd_pallas",
        "layer_norm_bwd",
        lambda out: (out[0], out[2], out[1]),
    ),
    "batch_norm_bwd last channel's dx dropped": (
        batch_norm,
        "batch_norm_train_bwd_pallas",
        "batch_norm_bwd",
        lambda out: (out[0].at[:, -1].set(0), out[1], out[2]),
    ),
    "matmul masked tail row lost": (matmul, "matmul_pallas", "matmul", lambda c: c.at[-1].set(0)),
    "attention_bwd dk halved": (
        attention,
        "attention_bwd_pallas",
        "attention_bwd",
        lambda out: (out[0], out[1] * 0.5, *out[2:]),
    ),
    "embedding_bwd last vocabulary row lost": (
        embedding,
        "embedding_bwd_pallas",
        "embedding_bwd",
        lambda t: t.at[-1].set(0),
    ),
}


# the slower interpret-mode kernels run in the slow suite only
_FAST = {
    "cross_entropy dlogits negated",
    "layer_norm mean off by 30% of its largest value",
    "softmax_bwd scaled by 1.01",
    "matmul masked tail row lost",
}


@pytest.mark.parametrize("fault", [f if f in _FAST else pytest.param(f, marks=pytest.mark.slow) for f in FAULTS])
def test_each_injected_fault_fails_its_rows(gpu_check, monkeypatch, fault):
    module, name, kernel, perturb = FAULTS[fault]
    _wrap(monkeypatch, module, name, perturb)
    rows = _rows(gpu_check, kernel, unaligned_only=True)
    assert all(not r.ok and r.cells[3] == "WRONG" for r in rows), [r.cells for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["cross_entropy dlogits negated", "attention output + 0.1"])
def test_faults_fail_in_low_precision_too(gpu_check, monkeypatch, fault):
    module, name, kernel, perturb = FAULTS[fault]
    _wrap(monkeypatch, module, name, perturb)
    rows = _rows(gpu_check, kernel, ("bfloat16",), unaligned_only=True)
    assert all(not r.ok for r in rows), [r.cells for r in rows]


def test_a_non_finite_output_fails(gpu_check, monkeypatch):
    _wrap(monkeypatch, softmax, "softmax_pallas", lambda y: y.at[0, 0].set(jnp.nan))
    assert not any(r.ok for r in _rows(gpu_check, "softmax", unaligned_only=True))


def test_a_kernel_that_raises_is_reported(gpu_check, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("lowering failed")

    monkeypatch.setattr(layer_norm, "layer_norm_fwd_pallas", broken)
    rows = _rows(gpu_check, "layer_norm")
    assert all(r.cells[3].startswith("FAIL RuntimeError: lowering failed") for r in rows)


@pytest.mark.parametrize(
    "kernel",
    ["softmax_bwd", "layer_norm"] + [pytest.param(k, marks=pytest.mark.slow) for k in ("cross_entropy", "attention")],
)
def test_clean_kernels_pass(gpu_check, kernel):
    rows = _rows(gpu_check, kernel)
    assert len(rows) == 2 and all(r.ok for r in rows), [r.cells for r in rows]


@pytest.mark.slow
def test_clean_kernels_pass_every_row(gpu_check):
    rows = [gpu_check.check_case(c, CPU) for c in gpu_check.cases("cpu", ("float32", "float16"))]
    assert all(r.ok for r in rows), [r.cells for r in rows if not r.ok]


def test_compare_scales_each_output_on_its_own(gpu_check):
    big, small = jnp.full((4,), 1000.0), jnp.full((4,), 1e-3)
    (b, s) = gpu_check.compare(("big", "small"), (big, small * 2), (big, small))
    assert b.rel == 0 and s.rel == pytest.approx(1.0) and s.norm == pytest.approx(2.0)
    (z,) = gpu_check.compare(("zero",), (jnp.zeros(3),), (jnp.arange(3.0),))
    assert z.cos == 0 and not z.ok(gpu_check.TOLERANCE["float32"])
    # below the noise floor (a gradient zero in exact arithmetic): error against the floor only
    got, want = (big, jnp.full(3, -1e-9)), (big, jnp.full(3, 1e-9))
    _, n = gpu_check.compare(("big", "noise"), got, want, noise=1e-4)
    assert n.ok(gpu_check.TOLERANCE["float32"]) and n.rel == pytest.approx(2e-9 / 0.1)
    _, n = gpu_check.compare(("big", "noise"), (big, jnp.full(3, 1e-2)), want, noise=1e-4)
    assert not n.ok(gpu_check.TOLERANCE["float32"])


def test_end_to_end_bound_follows_xla_tf32_error(gpu_check):
    """On a GPU the end-to-end rows bound each gradient by XLA's own TF32 error on
    it: a kernel as inexact as XLA passes, a wrong gradient fails however inexact
    XLA is, and where XLA is exact the bound is TF32's floor (the H200 run of
    2026-12-04 failed the old fixed bound: the MLP's first bias is 5e-2 off under
    TF32, and so it is with TF32 emulated on CPU)."""
    w = jax.random.normal(jax.random.key(0), (64,))
    wobble = jax.random.normal(jax.random.key(1), (64,))
    names, noise = ("p",), 0.0

    def tols(xla):
        return gpu_check.tf32_tolerances(gpu_check.compare(names, (xla,), (w,), noise))

    def passes(kernel, xla):
        return gpu_check._summary(gpu_check.compare(names, (kernel,), (w,), noise), tols(xla))[0]

    inexact = w + 0.05 * _peak(w) * wobble / _peak(wobble)  # XLA's TF32 error, 5e-2 of the largest
    assert passes(w - 0.1 * _peak(w) * wobble / _peak(wobble), inexact)  # twice XLA's error, other sign
    for wrong in (jnp.zeros_like(w), -w, 1.5 * w, jnp.roll(w, 1), w + 0.3 * _peak(w)):
        assert not passes(wrong, inexact)
    assert not passes(w + 0.3 * _peak(w) * wobble / _peak(wobble), inexact)  # six times XLA's error
    # XLA exact: TF32's own floor (its 10-bit mantissa, whatever its rounding)
    floor = gpu_check.E2E_TF32_FLOOR
    assert tols(w) == [floor]
    assert passes(w * (1 + floor[0] / 2), w) and not passes(w * (1 + 2 * floor[0]), w)
    # XLA's gradient not finite: the floor too, not an infinite bound
    assert tols(w.at[0].set(jnp.nan)) == [floor]


def _run(*flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, str(SCRIPT), *flags], env=env, capture_output=True, text=True, timeout=600)


def test_reports_no_gpu(gpu_check, tmp_path, capsys):
    out = tmp_path / "check.md"
    assert gpu_check.main(["--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith("no GPU") and not out.exists()


def test_cpu_run_writes_its_table(gpu_check, tmp_path):
    out = tmp_path / "sub" / "check.md"
    assert gpu_check.main(["--cpu", "--only", "softmax_bwd", "--dtypes", "float32", "--out", str(out)]) == 0
    text = out.read_text()
    assert "NOT a GPU run" in text and f"jax {jax.__version__}" in text
    assert text.count("| softmax_bwd |") == 2 and "| ok |" in text


@pytest.mark.slow  # a subprocess (the limit ends the process)
@pytest.mark.parametrize("limit", ["3", "0.001"])
def test_time_limit_is_hard_and_keeps_the_table(tmp_path, limit):
    """A limit reached during the rows or (0.001 s) while they are still being
    listed: the process ends with 2 and the table says what was skipped (on a
    slow machine the 3 s limit can also come before the list is complete)."""
    out = tmp_path / "check.md"
    proc = _run("--cpu", "--only", "attention", "--out", str(out), "--time-limit", limit)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "time limit" in proc.stdout
    table = out.read_text()
    assert "SKIPPED (time limit)" in table
    if limit == "0.001":
        assert "before the rows were listed" in proc.stdout and "| (rows not yet listed) |" in table


@pytest.mark.parametrize("fault", ["cross_entropy dlogits negated", "matmul masked tail row lost"])
def test_end_to_end_rows_fail_a_wrong_kernel_under_either_bound(gpu_check, monkeypatch, fault):
    """The end-to-end rows, with the exact bound (interpret mode) and with the GPU's
    TF32 bound (here XLA is exact, so it is TF32's floor): clean kernels pass, and a
    wrong kernel fails the row that reaches it through rf.grad."""
    (label, model), *_ = gpu_check.e2e_cases("cpu")
    with jax.numpy_rank_promotion("allow"):
        for tf32 in (False, True):
            assert gpu_check.check_e2e(label, model, "interpret", tf32=tf32).ok
        module, name, _, perturb = FAULTS[fault]
        _wrap(monkeypatch, module, name, perturb)
        for tf32 in (False, True):
            row = gpu_check.check_e2e(label, model, "interpret", tf32=tf32)
            assert not row.ok and row.cells[3] == "WRONG", row.cells
