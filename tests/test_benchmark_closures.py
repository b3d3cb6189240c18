"""benchmarks/closures.py: every row's gradient equals jax.grad's (with the closed-over
value changed in between), and the timed calls neither trace nor walk a closure again."""

from __future__ import annotations

from benchmarks import closures


def test_closure_rows_time_without_retracing():
    out = closures.measure(blocks=1, per_block=2, runs=1)
    assert out["traces"] == 0 and out["walks"] == 0, out
    n = len(closures._rows())
    assert [len(r) for r in out["wall"]] == [2 * n]  # each rf row and its jax.grad counterpart
    assert all(t > 0 for t in out["wall"][0] + out["cpu"][0])


def test_closure_table(capsys):
    closures.main(["--blocks", "1", "--per-block", "1", "--runs", "1"])
    lines = capsys.readouterr().out.splitlines()
    table = [line for line in lines if line.startswith("| ")]
    assert len(table) == 1 + len(closures._rows())  # header and one line per row
    assert any(line.startswith("#") and line.endswith(": 0 traces, 0 closure walks") for line in lines), lines


def test_per_call_rows_alternate_without_retracing(capsys):
    out = closures.per_call(rounds=3)
    assert out["traces"] == 0 and out["walks"] == 0, out
    n = len(closures._rows())
    assert out["calls"] == 3 * n
    for t in (out["wall"], out["cpu"]):
        assert len(t["ratio"]) == n and t["ratio"][0] == 1.0
        assert all(lo <= hi for lo, hi in zip(t["low"], t["high"]))
    closures.main(["--per-call", "2"])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + n
