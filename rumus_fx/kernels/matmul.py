"""Matrix products (2-D and batched) with float32 accumulation."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .dispatch import call


def _low(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize < 4


def matmul_reference(a: jax.Array, b: jax.Array, *, out_dtype: Any = None) -> jax.Array:
    out_dtype = out_dtype or jnp.result_type(a, b)
    if _low(a.dtype) or _low(b.dtype) or _low(out_dtype):
        return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(out_dtype)
    return jnp.matmul(a, b).astype(out_dtype)


def matmul(a: jax.Array, b: jax.Array, out_dtype: Any = None) -> jax.Array:
    """``a @ b`` for ``[M, K] @ [K, N]`` (also with equal leading batch axes)."""
    return call(matmul_reference, None, a, b, out_dtype=out_dtype)


def bmm(a: jax.Array, b: jax.Array, out_dtype: Any = None) -> jax.Array:
    """Batched ``[..., M, K] @ [..., K, N]``."""
    return call(matmul_reference, None, a, b, out_dtype=out_dtype)
