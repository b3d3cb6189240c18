"""The GPU benchmark scripts run anywhere with ``--cpu`` (interpret-mode kernels,
tiny shapes) and say so when asked for a GPU on a machine without one."""

from __future__ import annotations

import jax

from benchmarks import gpu_matmul_blocks, gpu_steps


def test_steps_table_has_every_way_and_agrees_with_jax(tmp_path):
    out = tmp_path / "steps.md"
    with jax.numpy_rank_promotion("allow"):  # the benchmark models' plain-jax losses broadcast biases
        assert gpu_steps.main(["--cpu", "--repeats", "1", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith(("| MLP", "| TinyGPT"))]
    assert len(rows) == 2
    for row in rows:
        cells = row.split("|")[3:-1]
        assert len(cells) == len(gpu_steps.WAYS) - 1
        for cell in cells:  # "ms (ratio; err)": every rf way's gradient is jax.grad's
            err = float(cell.split(";")[1].strip(" )"))
            assert err < 1e-5, row


def test_matmul_candidates_all_compute_the_product(tmp_path):
    out = tmp_path / "blocks.md"
    assert gpu_matmul_blocks.main(["--cpu", "--dtypes", "float32", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| float32")]
    assert len(rows) == len(gpu_matmul_blocks.CANDIDATES)
    for row in rows:
        assert "FAIL" not in row and float(row.split("|")[-2]) < 1e-5, row


def test_no_gpu_says_so(capsys):
    assert gpu_steps.main([]) == 0 and capsys.readouterr().out.startswith("no GPU")
    assert gpu_matmul_blocks.main([]) == 0 and capsys.readouterr().out.startswith("no GPU")
