"""The docstring examples of rumus_fx.nn run and print what they claim."""

from __future__ import annotations

import doctest
import importlib

import jax
import pytest

MODULES = [
    "rumus_fx.nn",
    "rumus_fx.nn.init",
    "rumus_fx.nn.layers",
    "rumus_fx.nn.transformer",
    "rumus_fx.nn.serialization",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    pytest.importorskip("optax")
    pytest.importorskip("safetensors")
    # optax's adam (rf.nn's example) mixes a python float with its int32 step count
    with jax.numpy_dtype_promotion("standard" if name == "rumus_fx.nn" else "strict"):
        result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0
