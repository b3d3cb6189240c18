"""Small helpers shared by the kernel references."""

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
    dt = compute_dtype(x.dtype)
    return x if x.dtype == dt else x.astype(dt)


def explicit_sharding(x: Any) -> Any:
    """The sharding of ``x`` when it is sharded over *Explicit* mesh axes
    (sharding in types, ``jax.make_mesh``'s default), else None. Backward rules
    pass it as ``out_sharding`` to contractions over a sharded axis, which JAX
    otherwise refuses (it cannot guess the result's sharding)."""
    try:
        sharding = jax.typeof(x).sharding
    except (AttributeError, TypeError):
        return None
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True):
        return None
    if not any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return None
    return sharding
