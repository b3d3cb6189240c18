"""The scaling study's grid, table and plot (its timings live in
``python -m benchmarks.scaling``; none here)."""

import math

import pytest

from benchmarks import scaling


def test_grid_grows_one_axis_at_a_time():
    pts = scaling.points()
    axes = {(p.family, p.axis): [q.value for q in pts if (q.family, q.axis) == (p.family, p.axis)] for p in pts}
    assert axes[("GPT", "depth")] == [2, 4, 8]
    assert axes[("GPT", "width")] == [128, 256, 512]
    assert axes[("GPT", "sequence")] == [64, 128, 256, 512]
    assert axes[("CNN", "batch")] == [16, 64, 256]
    assert axes[("CNN", "channels x")] == [1, 2, 4]


def test_the_models_it_builds_have_the_sizes_it_names():
    pts = {(p.family, p.axis, p.value): p for p in scaling.points(quick=True)}
    gpt = pts[("GPT", "width", 256)].make()
    assert gpt.params["wte"].shape[1] == 256
    deep = scaling.points()[2].make()  # depth 8 needs more keys than the default GPT
    assert len(deep.params["blocks"]) == 8
    wide_cnn = pts[("CNN", "channels x", 2)].make()
    assert wide_cnn.params["conv2"]["weight"].shape == (64, 32, 3, 3)
    assert wide_cnn.batch[0].shape[0] == 16


def test_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    pts = scaling.points(quick=True)[:3]
    row = {"jit": 1.0, "compile": 1.1, "memory": 0.9, "torch": math.nan, "jit_jax_ms": 2.0, "mem_jax_mib": 1.5}
    results = [(p, dict(row, jit=1.0 + 0.1 * i)) for i, p in enumerate(pts)]
    table = scaling.format_table(results)
    assert "| GPT | depth | 2 | 1.00 | 1.10 | 0.90 (1.5 MiB) | n/a | 2.0 ms |" in table
    png = tmp_path / "s.png"
    scaling.plot(results, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
