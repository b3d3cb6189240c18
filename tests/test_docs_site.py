"""The documentation site: ``mkdocs build --strict`` succeeds, every page is in the
navigation, every public name has an API entry, and every python block of the guides
runs (blocks named ``<!-- example-... -->`` run in tests/test_readme.py against their
oracles; the others run here, page by page, in order, as a reader would)."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

import jax
import pytest
import yaml

import rumus_fx as rf

from ._markdown_blocks import DOCS, ROOT, all_blocks, blocks, pages
from ._subprocess import child_env


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs tooling (pip install -e '.[docs]') is not installed")
    env = child_env(NO_MKDOCS_2_WARNING="1")
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    ops = (tmp_path / "site" / "api" / "ops" / "index.html").read_text()
    assert 'id="rumus_fx.ops.activation.relu"' in ops  # the reference is rendered from the docstrings


def _nav_files(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [f for v in node.values() for f in _nav_files(v)]
    return [f for v in node for f in _nav_files(v)]


def test_every_page_is_in_the_navigation():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    nav = set(_nav_files(config["nav"]))
    assert nav == {str(p.relative_to(DOCS)) for p in pages()}


def _api_targets() -> set[str]:
    return {m for p in (DOCS / "api").glob("*.md") for m in re.findall(r"^::: ([\w.]+)", p.read_text(), re.M)}


def test_every_public_name_has_an_api_entry():
    targets = _api_targets()
    missing = []
    for name in sorted(dir(rf)):
        obj = getattr(rf, name)
        if name.startswith("_") or name == "TYPE_CHECKING" or isinstance(obj, type(rf)):
            continue
        path = "rumus_fx.compiler.CPU_COMPILER_OPTIONS" if name == "CPU_COMPILER_OPTIONS" else None
        path = path or f"{obj.__module__}.{obj.__qualname__}"
        if path not in targets and f"rumus_fx.{name}" not in targets:
            missing.append(f"rf.{name} ({path})")
    for name in rf.nn.__all__:
        obj = getattr(rf.nn, name)
        path = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', name)}"
        if not ({path, f"rumus_fx.nn.{name}", f"rumus_fx.nn.layers.{name}"} & targets):
            missing.append(f"rf.nn.{name}")
    assert not missing, f"no ::: entry in docs/api/*.md for {missing}"


def test_every_named_block_has_its_test():
    tests = (ROOT / "tests" / "test_readme.py").read_text()
    for b in all_blocks():
        if b.marker is not None:
            assert f'"{b.marker}"' in tests, f"{b.where}: <!-- {b.marker} --> is run by no test"


GUIDES = [p for p in pages() if p.name != "SPEC.md" and p.parent == DOCS]


@pytest.mark.parametrize("page", GUIDES, ids=[p.stem for p in GUIDES])
def test_guide_blocks_run(page: pathlib.Path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # files the blocks write land here
    ns: dict = {"__name__": f"docs_{page.stem}"}
    ran, left_out = 0, []
    for b in blocks(page):
        if b.lang != "python" or b.marker is not None:
            continue
        missing = [m for m in b.requires if importlib.util.find_spec(m) is None]
        if missing:
            left_out.append(f"{b.where} (needs {', '.join(missing)})")
            continue
        # user code as a reader runs it: default promotion rules, not the suite's strict ones
        with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
            exec(compile(b.code, b.where, "exec"), ns)
        ran += 1
    if left_out:
        pytest.skip(f"{page.name}: ran {ran} blocks; not installed, so not run: {left_out}")
