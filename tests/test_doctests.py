"""Every docstring example in the package runs and prints what it claims
(``doctest`` over every module of rumus_fx; run under the suite's strict
settings, tests/conftest.py)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import jax
import pytest

import rumus_fx

OPTAX_EXAMPLES = {"rumus_fx.nn"}
MODULES = sorted(m.name for m in pkgutil.walk_packages(rumus_fx.__path__, "rumus_fx."))


def test_every_module_is_listed():
    assert "rumus_fx.autograd.transforms" in MODULES
    assert "rumus_fx.kernels.dispatch" in MODULES
    assert len(MODULES) > 50


def test_the_examples_are_found():
    """The modules known to hold examples are searched (a broken finder would pass
    every module below with zero examples)."""
    finder = doctest.DocTestFinder()
    for name in ("rumus_fx.autograd.transforms", "rumus_fx.kernels.dispatch", "rumus_fx.ops.cast", "rumus_fx.numpy"):
        tests = finder.find(importlib.import_module(name))
        assert sum(len(t.examples) for t in tests) > 0, name


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    if name.startswith("rumus_fx.nn"):
        pytest.importorskip("optax")
        pytest.importorskip("safetensors")
    # optax's adam (rf.nn's example) mixes a python float with its int32 step count
    promotion = "standard" if name in OPTAX_EXAMPLES else "strict"
    with jax.numpy_dtype_promotion(promotion):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples in {name} failed"
