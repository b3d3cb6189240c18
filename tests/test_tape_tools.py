"""Tape tooling: the str(tape) table, tape.to_dot() and the saved-bytes summaries."""

from __future__ import annotations

import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf

F32 = np.float32


def _diamond_tape():
    """h is read by three records (relu, sigmoid's input is not saved, h * h)."""
    with rf.Tape() as tape:
        w = rf.tensor(np.ones((3, 4), F32), requires_grad=True)
        x = rf.tensor(np.ones((2, 3), F32))
        h = x @ w  # MatmulBackward saves x (24 B)
        a = rf.relu(h)  # ReluBackward saves h (32 B)
        b = rf.sigmoid(h)  # SigmoidBackward saves its output (32 B)
        c = h * h  # MulBackward saves h twice (the same buffer)
        loss = rf.mean(a + b + c)
    return tape, loss


# ---------------------------------------------------------------------------
# a small, strict reader for the subset of DOT that to_dot writes
# ---------------------------------------------------------------------------

_ID = r"[A-Za-z_][A-Za-z0-9_]*"
_QUOTED = r'"(?:[^"\\]|\\.)*"'
_ATTR = rf"{_ID}=(?:{_ID}|{_QUOTED}|[0-9.]+)"
_ATTRS = rf"\[{_ATTR}(?:, {_ATTR})*\]"
_NODE = re.compile(rf"^({_ID}) ({_ATTRS});$")
_EDGE = re.compile(rf"^({_ID}) -> ({_ID});$")
_GRAPH_ATTR = re.compile(rf"^(?:{_ATTR}|node {_ATTRS});$")
_LABEL = re.compile(rf"label=({_QUOTED})")


def parse_dot(text: str) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """(node id -> label, edges); AssertionError on anything malformed."""
    lines = text.strip().splitlines()
    assert lines[0] == "digraph tape {", lines[0]
    assert lines[-1] == "}", lines[-1]
    assert text.count("{") == text.count("}") == 1
    nodes: dict[str, str] = {}
    edges: list[tuple[str, str]] = []
    for raw in lines[1:-1]:
        line = raw.strip()
        if _GRAPH_ATTR.match(line):
            continue
        if m := _NODE.match(line):
            assert m.group(1) not in nodes, f"node declared twice: {line}"
            label = _LABEL.search(m.group(2))
            assert label, line
            nodes[m.group(1)] = label.group(1)[1:-1]
        elif m := _EDGE.match(line):
            for end in m.groups():
                assert end in nodes, f"edge to an undeclared node: {line}"
            edges.append(m.groups())
        else:
            raise AssertionError(f"not a DOT statement: {line!r}")
    return nodes, edges


def test_to_dot_is_valid_and_matches_the_entries():
    tape, _ = _diamond_tape()
    nodes, edges = parse_dot(tape.to_dot())
    entries = tape.entries
    ops = {k: v for k, v in nodes.items() if k.startswith("op")}
    tensors = {k: v for k, v in nodes.items() if k.startswith("t")}
    assert len(ops) == len(entries)
    for i, e in enumerate(entries):
        assert ops[f"op{i}"].startswith(f"{i}: {e.op.name}\\nsaves ")
        ins = [a for a, b in edges if b == f"op{i}"]
        outs = [b for a, b in edges if a == f"op{i}"]
        assert ins == [f"t{g}" for g in e.inputs if g is not None]  # untracked inputs are not drawn
        assert outs == [f"t{g}" for g in e.outputs]
    # every tracked tensor once, labelled with its id and aval
    ids = {g for e in entries for g in (*e.inputs, *e.outputs) if g is not None}
    assert set(tensors) == {f"t{g}" for g in ids}
    w_id = entries[0].inputs[1]
    assert tensors[f"t{w_id}"] == f"{w_id}\\nfloat32[3, 4]"
    # the diamond: h feeds ReluBackward, SigmoidBackward and MulBackward (twice)
    h = f"t{entries[0].outputs[0]}"
    assert sorted(b for a, b in edges if a == h) == ["op1", "op2", "op3", "op3"]


def test_to_dot_of_empty_and_consumed_tapes():
    nodes, edges = parse_dot(rf.Tape().to_dot())
    assert nodes == {} and edges == []
    tape, loss = _diamond_tape()
    tape.backward(loss)
    assert parse_dot(tape.to_dot()) == ({}, [])


def test_to_dot_with_inplace_and_views():
    with rf.Tape() as tape:
        x = rf.tensor(np.ones((2, 3), F32), requires_grad=True)
        y = x * 1.0
        y.add_(x)  # moves y's grad id
        v = y.T
        loss = rf.sum(rf.tanh(v))
    nodes, edges = parse_dot(tape.to_dot())
    assert len([k for k in nodes if k.startswith("op")]) == len(tape) == 5
    assert any("TransposeBackward" in lbl for lbl in nodes.values())
    del loss


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` is not installed")
def test_to_dot_renders_with_graphviz(tmp_path):
    tape, _ = _diamond_tape()
    out = subprocess.run(["dot", "-Tsvg"], input=tape.to_dot(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "<svg" in out.stdout


def test_parse_dot_rejects_malformed_text():
    for bad in ["digraph tape {\n  op0 -> t1;\n}", 'digraph tape {\n  op0 [label="x"]\n}', "graph {\n}"]:
        with pytest.raises(AssertionError):
            parse_dot(bad)


# ---------------------------------------------------------------------------
# saved bytes: per record, per record type, total
# ---------------------------------------------------------------------------


def test_saved_bytes_by_record_and_total():
    tape, _ = _diamond_tape()
    per_entry = [e.op.saved_bytes for e in tape.entries]
    assert per_entry == [24, 32, 32, 64, 0, 0, 0]
    summary = tape.saved_bytes_by_record()
    assert summary == {
        "MulBackward": 64,
        "ReluBackward": 32,
        "SigmoidBackward": 32,
        "MatmulBackward": 24,
        "AddBackward": 0,
        "MeanBackward": 0,
    }
    assert list(summary.values()) == sorted(summary.values(), reverse=True)
    assert sum(summary.values()) == sum(per_entry)
    # the total counts each buffer once: x (24) + h (32) + sigmoid's output (32)
    assert tape.saved_bytes == 88
    assert str(tape).splitlines()[-1] == "7 entries, 88 B saved for backward"


def test_summary_sums_records_of_one_type():
    with rf.Tape() as tape:
        w = rf.tensor(np.ones((4, 8), F32), requires_grad=True)
        h = w
        for _ in range(3):
            h = rf.tanh(h)  # each saves its own 4x8 output
        rf.sum(h)
    assert tape.saved_bytes_by_record() == {"TanhBackward": 3 * 128, "SumBackward": 0}
    assert tape.saved_bytes == 3 * 128


def test_saved_bytes_of_small_dtypes():
    with rf.Tape() as tape:
        x = rf.tensor(np.ones((2, 3, 4, 4), F32), requires_grad=True)
        rf.max_pool2d(x, 2)  # saves int8 window offsets: 2*3*2*2 bytes
        rf.dropout(x, 0.5, jax.random.key(0))  # saves a bool mask: 96 bytes
        xb = rf.tensor(jnp.ones((5, 3), jnp.bfloat16), requires_grad=True)
        rf.relu(xb)  # saves the bfloat16 input: 30 bytes
    summary = tape.saved_bytes_by_record()
    assert summary["MaxPool2dBackward"] == 2 * 3 * 2 * 2
    assert summary["DropoutBackward"] == 96
    assert summary["ReluBackward"] == 30
    assert tape.saved_bytes == 24 + 96 + 30


def test_consumed_tape_reports_nothing():
    tape, loss = _diamond_tape()
    tape.backward(loss)
    assert tape.saved_bytes == 0 and tape.saved_bytes_by_record() == {}
    assert str(tape).splitlines()[-1] == "0 entries, 0 B saved for backward (consumed)"
    assert "consumed" in repr(tape)


def test_str_table_rows_and_units():
    with rf.Tape() as tape:
        w = rf.tensor(np.ones((64, 64), F32), requires_grad=True)
        x = rf.tensor(np.ones((512, 64), F32))
        y = x @ w  # saves x: 128 KiB
        rf.mean(rf.exp(y))  # saves its 512x64 output: 128 KiB
    lines = str(tape).splitlines()
    assert lines[0].split() == ["#", "record", "inputs", "->", "outputs", "shapes", "saved"]
    assert len(lines) == len(tape) + 2
    assert lines[1].split()[:2] == ["0", "MatmulBackward"] and lines[1].endswith("128.0 KiB")
    x_id = "-"  # untracked
    assert f"({x_id}, {w.grad_id}) -> ({y.grad_id})" in lines[1]
    assert "float32[512, 64], float32[64, 64] -> float32[512, 64]" in lines[1]
    assert lines[-1] == "3 entries, 256.0 KiB saved for backward"


def test_table_and_summary_under_jit():
    """Printing the tape while tracing shows avals and sizes, never values."""
    seen = {}

    def f(w):
        with rf.Tape() as tape:
            t = rf.tensor(w, requires_grad=True)
            loss = rf.sum(rf.sigmoid(t) * t)
        seen["table"] = str(tape)
        seen["dot"] = tape.to_dot()
        seen["summary"] = tape.saved_bytes_by_record()
        seen["total"] = tape.saved_bytes
        return tape.backward(loss)[t]

    jax.jit(f)(jnp.ones((3, 5)))
    assert "SigmoidBackward" in seen["table"] and "float32[3, 5]" in seen["table"]
    assert "Traced" not in seen["table"] and "Tracer" not in seen["dot"]
    parse_dot(seen["dot"])
    # MulBackward keeps sigmoid's output (the buffer SigmoidBackward keeps) and t
    assert seen["summary"] == {"MulBackward": 120, "SigmoidBackward": 60, "SumBackward": 0}
    assert seen["total"] == 120
