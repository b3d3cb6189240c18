"""Rich display in notebooks: ``_repr_html_`` for ``Tape``, ``TapeEntry`` and ``Tensor``.

Jupyter (and VS Code, Colab) show an object's ``_repr_html_()`` instead of its
``repr``. A tape shows its record table (the rows of ``print(tape)``: index,
record, input -> output grad ids, shapes, saved bytes, with a lifted call's
primitive records under it), the total kept for backward, and the graph as an
inline SVG drawn here (no graphviz): tensors as rounded boxes labelled with their
grad id and type, records as boxes with their saved bytes, edges from inputs to
records to outputs, laid out in columns by depth. An entry shows its row and what
its record saves, field by field; a tensor its shape, dtype, grad id, storage
version and a preview of its values. Everything is escaped text, inline styles
and SVG: no script, so notebook sanitizers keep it.
"""

from __future__ import annotations

import html
from typing import Any

import jax
import numpy as np

from ..tensor import Tensor
from .tape import Tape, TapeEntry, _fmt_aval, _fmt_bytes

_TABLE = "border-collapse:collapse;font-family:monospace;font-size:12px"
_CELL = "border:1px solid #ccc;padding:2px 6px;text-align:left"
_HEAD = _CELL + ";background:#f0f0f0"
_SUB = _CELL + ";color:#555"


def _e(x: Any) -> str:
    return html.escape(str(x))


def _ids(ids: tuple[int | None, ...]) -> str:
    return ", ".join("-" if x is None else str(x) for x in ids)


def _avals(avals: tuple[Any, ...]) -> str:
    return ", ".join(_fmt_aval(a) for a in avals)


def _row(cells: list[str], style: str = _CELL) -> str:
    return "<tr>" + "".join(f'<td style="{style}">{_e(c)}</td>' for c in cells) + "</tr>"


def _header(names: list[str]) -> str:
    return "<tr>" + "".join(f'<th style="{_HEAD}">{_e(n)}</th>' for n in names) + "</tr>"


def _entry_rows(i: int | str, e: TapeEntry) -> list[str]:
    label = getattr(e.op, "label", e.op.name)
    rows = [
        _row(
            [
                str(i),
                label,
                f"({_ids(e.inputs)}) -> ({_ids(e.outputs)})",
                f"{_avals(e.input_avals)} -> {_avals(e.output_avals)}",
                _fmt_bytes(e.op.saved_bytes),
            ]
        )
    ]
    inner = getattr(e.op, "records", None)
    if inner is not None:  # a lifted call: one row per primitive record
        for j, rec in enumerate(inner()):
            shapes = f"{_avals(rec.in_avals)} -> {_avals(rec.out_avals)}"
            rows.append(
                _row(
                    [f"{i}.{j}" if i != "" else str(j), f"\u2003{rec.name}", "", shapes, _fmt_bytes(rec.saved_bytes)],
                    _SUB,
                )
            )
    return rows


_COLUMNS = ["#", "record", "inputs -> outputs", "shapes", "saved"]


def tape_html(tape: Tape) -> str:
    """The tape as HTML: a summary line, the record table and the graph (inline SVG)."""
    entries = tape.entries
    state = ", consumed by backward" if tape.consumed else ""
    summary = f"rumus_fx.Tape: {len(entries)} entries, {_fmt_bytes(tape.saved_bytes)} saved for backward{state}"
    rows = [_header(_COLUMNS)]
    for i, e in enumerate(entries):
        rows.extend(_entry_rows(i, e))
    by_record = ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in tape.saved_bytes_by_record().items())
    parts = [
        '<div class="rumus-fx-tape">',
        f'<div style="font-family:monospace;font-weight:bold">{_e(summary)}</div>',
        f'<table style="{_TABLE}">{"".join(rows)}</table>',
    ]
    if by_record:
        parts.append(f'<div style="font-family:monospace;font-size:11px;color:#555">by record: {_e(by_record)}</div>')
    if entries:
        parts.append(f'<div style="overflow:auto;max-width:100%">{graph_svg(tape)}</div>')
    parts.append("</div>")
    return "".join(parts)


def entry_html(entry: TapeEntry) -> str:
    """One entry as HTML: its table row and what its record saves, field by field."""
    rows = [_header(_COLUMNS), *_entry_rows("", entry)]
    saved = [_header(["saved field", "shape", "bytes"])]
    for name, value in entry.op.saved_arrays().items():
        for k, v in enumerate(value if isinstance(value, tuple) else (value,)):
            field = name if not isinstance(value, tuple) else f"{name}[{k}]"
            shape = f"{np.dtype(v.dtype).name}{list(v.shape)}" if hasattr(v, "shape") else type(v).__name__
            saved.append(_row([field, shape, _fmt_bytes(int(getattr(v, "nbytes", 0)))]))
    body = f'<table style="{_TABLE}">{"".join(rows)}</table>'
    if len(saved) > 1:
        body += f'<table style="{_TABLE};margin-top:4px">{"".join(saved)}</table>'
    return f'<div class="rumus-fx-entry">{body}</div>'


def tensor_html(t: Tensor) -> str:
    """A tensor as HTML: shape, dtype, grad id, storage version, a preview of its values."""
    value = t.value
    if isinstance(value, jax.core.Tracer):
        preview = f"traced {np.dtype(t.dtype).name}{list(t.shape)}"
    else:
        preview = np.array2string(np.asarray(value), separator=", ", threshold=50, edgeitems=3)
    kind = "tracked" if t.grad_id is not None else "untracked"
    facts = [
        ("shape", str(tuple(t.shape))),
        ("dtype", np.dtype(t.dtype).name),
        ("grad_id", "-" if t.grad_id is None else str(t.grad_id)),
        ("requires_grad", str(t.requires_grad)),
        ("version", str(t.version)),
    ]
    table = "".join(_row([k, v]) for k, v in facts)
    return (
        '<div class="rumus-fx-tensor">'
        f'<div style="font-family:monospace;font-weight:bold">rumus_fx.Tensor ({kind})</div>'
        f'<table style="{_TABLE}">{table}</table>'
        f'<pre style="font-size:12px;margin:4px 0">{_e(preview)}</pre></div>'
    )


# ---------------------------------------------------------------------------
# the graph as SVG
# ---------------------------------------------------------------------------

_COL_W, _ROW_H, _BOX_W, _BOX_H, _PAD = 200, 56, 170, 38, 12


def graph_svg(tape: Tape) -> str:
    """The recorded graph as an SVG element: tensors (grad id and type) and records (name
    and saved bytes) in columns by depth, edges input -> record -> output."""
    depth: dict[str, int] = {}
    labels: dict[str, tuple[str, str, bool]] = {}  # node -> (line 1, line 2, is a record)
    edges: list[tuple[str, str]] = []
    for i, e in enumerate(tape.entries):
        op = f"op{i}"
        d = 0
        for gid, aval in zip(e.inputs, e.input_avals or (None,) * len(e.inputs)):
            if gid is None:
                continue
            t = f"t{gid}"
            if t not in depth:
                depth[t] = 0
                labels[t] = (f"#{gid}", _fmt_aval(aval), False)
            d = max(d, depth[t] + 1)
            edges.append((t, op))
        depth[op] = max(d, 1)
        labels[op] = (f"{i}: {getattr(e.op, 'label', e.op.name)}", f"saves {_fmt_bytes(e.op.saved_bytes)}", True)
        for gid, aval in zip(e.outputs, e.output_avals or (None,) * len(e.outputs)):
            t = f"t{gid}"
            depth[t] = depth[op] + 1
            labels[t] = (f"#{gid}", _fmt_aval(aval), False)
            edges.append((op, t))
    columns: dict[int, list[str]] = {}
    for node, d in depth.items():
        columns.setdefault(d, []).append(node)
    pos: dict[str, tuple[float, float]] = {}
    for d, nodes in columns.items():
        for r, node in enumerate(nodes):
            pos[node] = (_PAD + d * _COL_W, _PAD + r * _ROW_H)
    width = _PAD * 2 + (max(columns) * _COL_W if columns else 0) + _BOX_W
    height = _PAD * 2 + max(len(n) for n in columns.values()) * _ROW_H - (_ROW_H - _BOX_H)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="rumus-fx-graph" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" style="font-family:monospace;font-size:11px">',
        '<defs><marker id="rfx-arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#666"/></marker></defs>',
    ]
    for a, b in edges:
        (xa, ya), (xb, yb) = pos[a], pos[b]
        x1, y1, x2, y2 = xa + _BOX_W, ya + _BOX_H / 2, xb, yb + _BOX_H / 2
        mid = (x1 + x2) / 2
        out.append(
            f'<path d="M {x1} {y1} C {mid} {y1}, {mid} {y2}, {x2} {y2}" fill="none" stroke="#666" '
            'marker-end="url(#rfx-arrow)"/>'
        )
    for node, (x, y) in pos.items():
        line1, line2, is_record = labels[node]
        fill, rx = ("#e8f0fe", 2) if is_record else ("#f6f6f6", 12)
        out.append(
            f'<g class="{"rfx-record" if is_record else "rfx-tensor"}"><title>{_e(line1)} {_e(line2)}</title>'
            f'<rect x="{x}" y="{y}" width="{_BOX_W}" height="{_BOX_H}" rx="{rx}" fill="{fill}" stroke="#888"/>'
            f'<text x="{x + 6}" y="{y + 15}">{_e(_clip(line1))}</text>'
            f'<text x="{x + 6}" y="{y + 30}" fill="#555">{_e(_clip(line2))}</text></g>'
        )
    out.append("</svg>")
    return "".join(out)


def _clip(s: str, n: int = 23) -> str:
    return s if len(s) <= n else s[: n - 1] + "\u2026"


def install() -> None:
    """Attach ``_repr_html_`` to ``Tape``, ``TapeEntry`` and ``Tensor``."""
    Tape._repr_html_ = tape_html  # type: ignore[attr-defined]
    TapeEntry._repr_html_ = entry_html  # type: ignore[attr-defined]
    Tensor._repr_html_ = tensor_html  # type: ignore[attr-defined]
