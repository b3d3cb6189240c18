"""The named code blocks of the README and the documentation pages run as written and do what
they say (against jax.grad where they compute a gradient), and the README's test command is
.ci/run's."""

import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp

import rumus_fx as rf

from ._markdown_blocks import marked, output_after

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _block(marker: str) -> str:
    """The ```python block that follows ``<!-- marker -->`` in the README or a docs page."""
    return marked(marker).code


def test_training_example_runs_and_learns(capsys):
    ns: dict = {}
    # user code, not library code; optax's adam mixes a python float with its int32 step count (not strict-clean)
    with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
        exec(compile(_block("example-mlp"), "README.md:example-mlp", "exec"), ns)
    assert marked("example-mlp").path.name == "README.md"
    assert len(_block("example-mlp").strip().splitlines()) <= 25
    assert float(ns["loss"]) < 0.5 * float(ns["first_loss"])
    assert "loss" in capsys.readouterr().out


def test_tape_example_runs():
    ns: dict = {}
    exec(compile(_block("example-tape"), "README.md:example-tape", "exec"), ns)
    assert ns["grads"][ns["w"]].shape == ns["w"].shape


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1].strip()
    assert ci in README, f".ci/run runs {ci!r}, which the README does not print"


def _output_after(marker: str) -> str:
    """The plain ``` block printed right after the python block of ``marker``."""
    return output_after(marker)


_PRELUDE = "import jax, jax.numpy as jnp\nimport rumus_fx as rf\n"


def test_nn_tour_runs(tmp_path, monkeypatch):
    # optax's adam mixes a python float with its int32 step count (not strict-clean)
    with jax.numpy_dtype_promotion("standard"):
        monkeypatch.chdir(tmp_path)
        ns: dict = {}
        exec(compile(_block("example-nn"), "README.md:example-nn", "exec"), ns)
        x = jnp.ones((2, 1, 8, 8))
        y = jnp.array([1, 2])
        params, opt_state, state, loss = ns["step"](ns["params"], ns["opt_state"], ns["state"], x, y)
        assert jnp.isfinite(loss)
        assert jax.tree_util.tree_structure(ns["restored"]) == jax.tree_util.tree_structure(
            {"params": ns["params"], "state": ns["state"]}
        )


def test_debugging_outputs_are_real():
    import pytest

    import rumus_fx as rf

    with pytest.raises(rf.AutogradError) as info:
        exec(_PRELUDE + _block("example-anomaly"), {})
    assert f"{type(info.value).__name__}: {info.value}" == _output_after("example-anomaly")
    # in a fresh interpreter, as a reader runs it (leaves get odd grad ids from 3, results even ones)
    out = subprocess.run(
        [sys.executable, "-c", _PRELUDE + _block("example-table")], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == _output_after("example-table")
    with pytest.raises(rf.VersionMismatch) as info:
        exec(_PRELUDE + _block("example-version"), {})
    assert f"VersionMismatch: {info.value}" == _output_after("example-version")


def test_tape_example_table_is_real():
    out = subprocess.run([sys.executable, "-c", _block("example-tape")], capture_output=True, text=True, check=True)
    table = [line for line in out.stdout.splitlines() if line.startswith(("#", "0 ", "1 "))]
    assert len(table) == 3
    assert marked("example-tape").path.name == "README.md"
    for line in table:
        assert line in README, line


def test_any_jax_program_sections_run():
    ns: dict = {}
    with jax.numpy_rank_promotion("allow"):  # user code, not library code
        exec(compile(_block("example-lift"), "README.md:example-lift", "exec"), ns)
    for k in ns["grads"]:
        assert float(jnp.abs(ns["grads"][k] - ns["want"][k]).max()) < 1e-6
    out = subprocess.run(
        [sys.executable, "-c", _block("example-lift-table")], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == _output_after("example-lift-table")


def test_control_flow_and_custom_vjp_sections_run(capsys):
    from jax import lax

    ns: dict = {}
    exec(compile(_block("example-scan"), "README.md:example-scan", "exec"), ns)

    def rnn_j(ws, h0):
        h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h0, ws)
        return jnp.sum(h * h)

    want = jax.grad(rnn_j)(ns["ws"], jnp.ones((2, 8)))
    assert float(jnp.abs(ns["g"] - want).max()) < 1e-5
    exec(compile(_block("example-custom-vjp"), "README.md:example-custom-vjp", "exec"), {})
    assert capsys.readouterr().out.strip().startswith("[1. 1.]")


def test_higher_order_section_runs():
    ns: dict = {}
    exec(compile(_block("example-higher"), "README.md:example-higher", "exec"), ns)
    w, x = ns["w"], ns["x"]

    def penalty_j(w, x):
        gx = jax.grad(lambda x: jnp.sum(jnp.tanh(x @ w)))(x)
        return jnp.mean((jnp.sqrt(jnp.sum(gx * gx, axis=1)) - 1.0) ** 2)

    assert float(jnp.abs(ns["gw"] - jax.grad(penalty_j)(w, x)).max()) < 1e-5
    d3 = jax.grad(jax.grad(jax.grad(jnp.tanh)))(0.5)
    assert abs(float(ns["d3"]) - float(d3)) < 1e-5


def test_create_graph_section_runs():
    ns: dict = {}
    exec(compile(_block("example-create-graph"), "README.md:example-create-graph", "exec"), ns)
    x0 = jnp.linspace(-1.0, 1.0, 4)

    def penalty_j(x):
        gx = jax.grad(lambda x: jnp.sum(jnp.tanh(x) * jnp.exp(x)))(x)
        return jnp.sum((gx - 1.0) ** 2)

    assert isinstance(ns["gx"], rf.Tensor)
    assert float(jnp.abs(ns["hx"] - jax.grad(penalty_j)(x0)).max()) < 1e-5


def test_the_cited_contract_is_in_the_repository():
    """The README and the tests cite docs/SPEC.md (and its sections): it is in the
    repository, and every section cited exists."""
    spec = (ROOT / "docs" / "SPEC.md").read_text()
    sections = set(re.findall(r"^## (\d+)\.", spec, re.M))
    assert "[docs/SPEC.md](docs/SPEC.md)" in README
    cited = 0
    for path in [ROOT / "README.md", *sorted((ROOT / "tests").rglob("*.py"))]:
        text = path.read_text()
        assert not re.search(r'(?<![\w/"])SPEC\.md', text.replace("docs/SPEC.md", "")), f"{path}: cite docs/SPEC.md"
        for n in re.findall(r"docs/SPEC\.md,? section (\d+)", text.replace("\n", " ")):
            assert n in sections, f"{path.name} cites docs/SPEC.md section {n}, which it does not have"
            cited += 1
    assert cited >= 3
