"""Accumulation precision: low-precision floats (bfloat16, float16) are
upcast to float32 for statistics and sums, by the kernel references and the ops."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_low_precision(dtype: Any) -> bool:
    """bfloat16/float16 (and smaller floats): accumulate these in float32."""
    return jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize < 4


def compute_dtype(dtype: Any) -> Any:
    """float32 for bfloat16/float16 inputs (statistics accumulate in f32)."""
    return jnp.float32 if is_low_precision(dtype) else dtype


def upcast(x: jax.Array) -> jax.Array:
    """``x`` in its compute dtype (float32 for bfloat16/float16; unchanged otherwise)."""
    dt = compute_dtype(x.dtype)
    return x if x.dtype == dt else x.astype(dt)
