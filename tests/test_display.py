"""Notebook display: ``_repr_html_`` of Tape, TapeEntry and Tensor, checked as HTML text and
rendered in headless Chromium (the record table's rows, the graph's SVG boxes with every
label inside its box, escaped names such as ``<lambda>``)."""

from __future__ import annotations

import html.parser
import json
import shutil
import subprocess

import jax
import jax.numpy as jnp
import pytest

import rumus_fx as rf


def _tape():
    op = rf.lift(lambda x: jnp.sin(x) * 2.0)  # its label holds "<lambda>": escaped or the page breaks
    with rf.Tape() as tape:
        w = rf.tensor(jnp.full((3, 2), 0.5), requires_grad=True)
        h = rf.relu(jnp.ones((4, 3)) @ w)
        loss = rf.mse_loss(op(h), jnp.zeros((4, 2)))
    return tape, w, loss


class _Parser(html.parser.HTMLParser):
    """Counts tags and checks they nest (the HTML is well formed)."""

    VOID = frozenset({"br", "hr", "img", "meta", "input", "col"})

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.count: dict[str, int] = {}
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.count[tag] = self.count.get(tag, 0) + 1
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.count[tag] = self.count.get(tag, 0) + 1

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-1:]}"
        self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def _parse(markup: str) -> _Parser:
    p = _Parser()
    p.feed(markup)
    p.close()
    assert not p.stack, f"unclosed tags {p.stack}"
    return p


def test_tape_entry_and_tensor_html():
    tape, w, loss = _tape()
    p = _parse(tape._repr_html_())
    text = "".join(p.text)
    assert "<lambda>" in text and "<lambda>" not in tape._repr_html_()  # escaped in the markup
    assert "MatmulBackward" in text and "SinBackward" in text and "MseLossBackward" in text
    assert f"{len(tape)} entries" in text and "saved for backward" in text
    lifted = next(e for e in tape.entries if "Lifted" in e.op.name)
    n_sub = len(lifted.op.records())
    assert p.count["tr"] == 1 + len(tape) + n_sub  # header, one row per entry, one per primitive record
    assert p.count["svg"] == 1 and p.count["rect"] == len(tape) + len({*w_ids(tape)})
    entry = _parse(tape.entries[0]._repr_html_())
    assert "saved field" in "".join(entry.text)
    t = _parse(w._repr_html_())
    assert "grad_id" in "".join(t.text) and "0.5" in "".join(t.text)
    tape.backward(loss)
    assert "consumed" in "".join(_parse(tape._repr_html_()).text)


def w_ids(tape):
    """Every tracked grad id the graph draws."""
    for e in tape.entries:
        yield from (g for g in e.inputs if g is not None)
        yield from e.outputs


def test_tensor_html_under_jit():
    seen = []

    @jax.jit
    def f(x):
        seen.append(rf.tensor(x)._repr_html_())
        return x

    f(jnp.ones(3))
    assert "traced float32[3]" in seen[0]


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


_PROBE = """
<script>
window.addEventListener("load", () => {
  const out = {rows: document.querySelectorAll("tr").length, boxes: [], overflow: []};
  for (const g of document.querySelectorAll("svg g")) {
    const rect = g.querySelector("rect").getBBox();
    out.boxes.push([rect.width, rect.height]);
    for (const t of g.querySelectorAll("text")) {
      const b = t.getBBox();
      if (b.x + b.width > rect.x + rect.width || b.width <= 0) out.overflow.push(t.textContent);
    }
  }
  const svg = document.querySelector("svg").getBoundingClientRect();
  out.svg = [svg.width, svg.height];
  out.text = document.body.innerText;
  const pre = document.createElement("pre");
  pre.id = "probe";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>
"""


def test_renders_in_headless_chromium(tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("headless Chromium not found (apt-get install chromium): the browser rendering check did not run")
    tape, w, _ = _tape()
    page = tmp_path / "tape.html"
    page.write_text(
        "<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>"
        + tape._repr_html_()
        + tape.entries[0]._repr_html_()
        + w._repr_html_()
        + _PROBE
        + "</body></html>"
    )
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000", "--dump-dom"]
    out = subprocess.run([*cmd, page.as_uri()], capture_output=True, text=True, timeout=120, check=True).stdout
    probe = out.split('<pre id="probe">', 1)[1].split("</pre>", 1)[0]
    result = json.loads(probe.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))
    lifted = next(e for e in tape.entries if "Lifted" in e.op.name)
    assert result["rows"] == (1 + len(tape) + len(lifted.op.records())) + 2 + (1 + 1) + 5
    assert len(result["boxes"]) == len(tape) + len(set(w_ids(tape)))
    assert all(wd > 0 and ht > 0 for wd, ht in result["boxes"])
    assert result["overflow"] == [], f"labels drawn outside their boxes: {result['overflow']}"
    assert result["svg"][0] > 0 and result["svg"][1] > 0
    assert "LiftedBackward(<lambda>)" in result["text"] and "MatmulBackward" in result["text"]
