"""The README's code blocks run as written, and its test command is .ci/run's."""

import pathlib
import re

import jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _block(marker: str) -> str:
    """The ```python block that follows ``<!-- marker -->`` in the README."""
    m = re.search(rf"<!-- {marker} -->\s*```python\n(.*?)```", README, re.S)
    assert m, f"README has no python block after <!-- {marker} -->"
    return m.group(1)


def test_training_example_runs_and_learns(capsys):
    ns: dict = {}
    with jax.numpy_rank_promotion("allow"):  # user code, not library code
        exec(compile(_block("example-mlp"), "README.md:example-mlp", "exec"), ns)
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
