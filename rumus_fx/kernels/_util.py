"""Small helpers shared by the kernel references."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def compute_dtype(dtype: Any) -> Any:
    """float32 for bfloat16/float16 inputs (statistics accumulate in f32)."""
    if jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize < 4:
        return jnp.float32
    return dtype


def upcast(x: jax.Array) -> jax.Array:
    dt = compute_dtype(x.dtype)
    return x if x.dtype == dt else x.astype(dt)
