"""Packaging: the version the CHANGELOG, pyproject and ``rf.__version__`` agree on, the
metadata an index shows, ``python -m rumus_fx``, what ``import rumus_fx`` loads, and a
wheel that builds and installs in a clean virtual environment (``-m slow``)."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile

import pytest

import rumus_fx as rf

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_agrees_with_pyproject_and_changelog():
    from rumus_fx import _version

    assert rf.__version__ == _version.__version__
    project = PYPROJECT["project"]
    assert "version" in project.get("dynamic", []) and "version" not in project
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "rumus_fx._version.__version__"}
    releases = re.findall(r"^## (\d+\.\d+\.\d+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases[0] == rf.__version__, "the CHANGELOG's latest release is not rf.__version__"
    assert releases[-1] == "0.1.0"
    assert releases == sorted(releases, key=lambda v: tuple(map(int, v.split("."))), reverse=True)


def test_metadata_license_classifiers_and_urls():
    project = PYPROJECT["project"]
    assert project["license"] == {"text": "MIT"}
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert "License :: OSI Approved :: MIT License" in project["classifiers"]
    assert "Typing :: Typed" in project["classifiers"]
    py = re.fullmatch(r">=3\.(\d+)", project["requires-python"])
    assert py and f"Programming Language :: Python :: 3.{py.group(1)}" in project["classifiers"]
    assert {"Homepage", "Documentation", "Source", "Issues", "Changelog"} <= set(project["urls"])
    # the tests build the docs site: the test extra carries what the docs extra needs
    assert set(project["optional-dependencies"]["docs"]) <= set(project["optional-dependencies"]["test"])


def test_python_m_rumus_fx_prints_the_environment():
    out = subprocess.run(
        [sys.executable, "-m", "rumus_fx"], capture_output=True, text=True, check=True, cwd=ROOT, timeout=120
    ).stdout
    fields = dict(line.split(": ", 1) for line in out.strip().splitlines())
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    import jax

    assert fields["rumus_fx"].startswith(rf.__version__)
    assert fields["jax"] == jax.__version__
    assert fields["backend"] == jax.default_backend()
    assert fields["kernel mode"].split()[0] in rf.kernels.MODES
    assert fields["devices"].startswith(f"{len(jax.devices())}:")
    assert {"python", "platform", "jaxlib", "numpy"} <= set(fields)


def test_import_loads_no_optional_dependency():
    """``import rumus_fx`` costs little over ``import jax``: it leaves chex (rf.testing),
    safetensors, optax, torch and matplotlib unloaded. Measured: 0.12-0.15 s of CPU over
    ``import jax, jax.numpy`` (0.87-1.0 s) with bytecode cached, as installed; about 0.45 s
    where ``PYTHONDONTWRITEBYTECODE`` makes every import compile its sources."""
    code = (
        "import sys, time; import jax, jax.numpy; t = time.perf_counter(); import rumus_fx; "
        "print(time.perf_counter() - t); "
        "print(','.join(m for m in ('chex', 'safetensors', 'optax', 'torch', 'matplotlib', 'scipy') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    seconds, loaded = out.stdout.strip().splitlines() + [""] * (2 - len(out.stdout.strip().splitlines()))
    assert loaded == "", f"import rumus_fx loaded {loaded}"
    print(f"import rumus_fx over jax: {float(seconds):.2f} s")


def _build_wheel(dest: pathlib.Path) -> pathlib.Path:
    # from a copy of what the sdist holds, so the build leaves nothing in the checkout
    src = dest.parent / "src"
    shutil.copytree(ROOT / "rumus_fx", src / "rumus_fx", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dest), str(src)],
        check=True,
        timeout=600,
    )
    (wheel,) = dest.glob("rumus_fx-*.whl")
    return wheel


@pytest.mark.slow
def test_wheel_builds_and_installs_in_a_clean_venv(tmp_path):
    wheel = _build_wheel(tmp_path / "dist")
    assert wheel.name == f"rumus_fx-{rf.__version__}-py3-none-any.whl"
    names = zipfile.ZipFile(wheel).namelist()
    assert "rumus_fx/py.typed" in names and "rumus_fx/__main__.py" in names
    assert not any(n.startswith(("tests/", "benchmarks/", "examples/")) for n in names)
    meta = zipfile.ZipFile(wheel).read(f"rumus_fx-{rf.__version__}.dist-info/METADATA").decode()
    assert "Classifier: License :: OSI Approved :: MIT License" in meta
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False, clear=True).create(env_dir)
    py = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], check=True, timeout=900, env=env, cwd=tmp_path)
    out = subprocess.run(
        [str(py), "-m", "rumus_fx"], capture_output=True, text=True, check=True, cwd=tmp_path, env=env, timeout=300
    ).stdout
    assert re.match(rf"rumus_fx: +{re.escape(rf.__version__)} \({re.escape(str(env_dir))}/", out), out
    code = (
        "import jax.numpy as jnp, rumus_fx as rf; print(float(rf.grad(lambda x: rf.sum(rf.tanh(x)))(jnp.zeros(3))[0]))"
    )
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path, env=env)
    assert out.stdout.strip() == "1.0"
