"""Strict settings for the whole suite: silent rank promotion, implicit dtype
promotion and warnings fail (a test that mixes dtypes on purpose says so with
``jax.numpy_dtype_promotion("standard")``)."""

import jax
import numpy as np
import pytest

from rumus_fx.lift.rules import load_library_rules

# the rules rf ships for other libraries' primitives (equinox) join the primitive
# table and the error audit when the library is installed
load_library_rules()

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def x64():
    """Run a test with 64-bit types enabled."""
    with jax.enable_x64(True):
        yield
