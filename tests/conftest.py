"""Strict settings for the whole suite: silent rank promotion and warnings fail."""

import jax
import numpy as np
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def x64():
    """Run a test with 64-bit types enabled."""
    with jax.enable_x64(True):
        yield
