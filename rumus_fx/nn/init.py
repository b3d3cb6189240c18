"""Default parameter initialisers (PyTorch's defaults), as plain functions of a key.

Every layer of ``rumus_fx.nn`` draws its parameters with one of these:

* ``Linear`` / ``Conv2d`` weights: ``kaiming_uniform`` with ``a = sqrt(5)``, i.e.
  ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` (``torch.nn.Linear.reset_parameters``);
* their biases: ``uniform(bound=1/sqrt(fan_in))`` (same as PyTorch);
* ``Embedding`` weight: ``normal(std=1)`` (``torch.nn.Embedding``);
* ``LayerNorm`` / ``BatchNorm2d``: weight ones, bias zeros.

To use another scheme, replace entries of the params dict, e.g.
``params["weight"] = normal(key, params["weight"].shape, std=0.02)``.

>>> import jax
>>> from rumus_fx.nn import init
>>> w = init.kaiming_uniform(jax.random.key(0), (4, 3), fan_in=4)
>>> bool((abs(w) <= 0.5).all())
True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["kaiming_uniform", "normal", "ones", "uniform", "zeros"]


def uniform(key: jax.Array, shape: Sequence[int], bound: float, dtype: Any = jnp.float32) -> jax.Array:
    """``U(-bound, bound)`` samples of ``shape``."""
    return jax.random.uniform(key, tuple(shape), dtype, minval=-bound, maxval=bound)


def kaiming_uniform(
    key: jax.Array, shape: Sequence[int], fan_in: int, a: float = math.sqrt(5.0), dtype: Any = jnp.float32
) -> jax.Array:
    """He-uniform with leaky-relu slope ``a``: bound ``sqrt(6 / ((1 + a^2) fan_in))``.

    The default ``a = sqrt(5)`` is PyTorch's default for Linear and Conv2d
    weights, which gives the bound ``1 / sqrt(fan_in)``."""
    gain = math.sqrt(2.0 / (1.0 + a * a))
    bound = gain * math.sqrt(3.0 / max(fan_in, 1))
    return uniform(key, shape, bound, dtype)


def normal(key: jax.Array, shape: Sequence[int], std: float = 1.0, dtype: Any = jnp.float32) -> jax.Array:
    """``N(0, std^2)`` samples of ``shape``."""
    return (std * jax.random.normal(key, tuple(shape), jnp.float32)).astype(dtype)


def zeros(shape: Sequence[int], dtype: Any = jnp.float32) -> jax.Array:
    return jnp.zeros(tuple(shape), dtype)


def ones(shape: Sequence[int], dtype: Any = jnp.float32) -> jax.Array:
    return jnp.ones(tuple(shape), dtype)
