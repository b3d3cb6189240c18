"""The fenced code blocks of the README and the documentation pages, for the tests that run them.

A block may be preceded (blank lines allowed) by HTML comments that the site does not
show: ``<!-- example-NAME -->`` names it for a test of its own (tests/test_readme.py), and
``<!-- requires: MODULE -->`` says it needs an optional package (PyTorch's loop in the
PyTorch guide). Blocks nested in list items are dedented."""

from __future__ import annotations

import dataclasses
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*$")
_COMMENT = re.compile(r"^\s*<!--\s*(?P<body>.*?)\s*-->\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    path: pathlib.Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None = None  # "example-..."
    requires: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: pathlib.Path) -> list[Block]:
    """Every fenced block of a markdown file, in order."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    comments: list[str] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        c = _COMMENT.match(lines[i])
        if c:
            comments.append(c.group("body"))
        elif m:
            indent, start = m.group("indent"), i
            i += 1
            body = []
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip())
                i += 1
            marker = next((x for x in comments if x.startswith("example-")), None)
            requires = tuple(
                r.strip() for x in comments if x.startswith("requires:") for r in x.split(":", 1)[1].split(",")
            )
            out.append(Block(path, start + 1, m.group("lang"), "\n".join(body) + "\n", marker, requires))
            comments = []
        elif lines[i].strip():
            comments = []
        i += 1
    return out


def pages() -> list[pathlib.Path]:
    """The documentation pages (docs/**/*.md)."""
    return sorted(DOCS.rglob("*.md"))


def all_blocks() -> list[Block]:
    """The blocks of the README and of every documentation page."""
    return [b for p in [ROOT / "README.md", *pages()] for b in blocks(p)]


def marked(marker: str) -> Block:
    """The python block named ``<!-- marker -->`` (exactly one, in the README or the docs)."""
    found = [b for b in all_blocks() if b.marker == marker and b.lang == "python"]
    assert len(found) == 1, f"{len(found)} python blocks are named <!-- {marker} -->: {[b.where for b in found]}"
    return found[0]


def output_after(marker: str) -> str:
    """The plain block printed right after the python block named ``marker``."""
    b = marked(marker)
    following = [x for x in blocks(b.path) if x.line > b.line]
    assert following and following[0].lang == "", f"{b.where}: no output block after <!-- {marker} -->"
    return following[0].code.strip()
