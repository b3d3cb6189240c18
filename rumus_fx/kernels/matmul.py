"""Matrix products (2-D and batched) with float32 accumulation: a tiled Pallas
kernel, its ``custom_jvp`` glue, and the jax.numpy reference.

Each program computes one ``bm x bn`` output tile, reducing over K in steps of
``bk`` into a float32 accumulator (bfloat16/float16 inputs feed the tensor
cores directly): on GPU a loop inside the program (the operands stay in global
memory, each step loads a ``bm x bk`` and a ``bk x bn`` tile); on TPU the last
grid axis, run in order, with the accumulator in VMEM scratch (each step copies
one tile of each operand into VMEM). ``[..., M, K] @ [K, N]`` folds the leading axes into M; the
batched form ``[..., M, K] @ [..., K, N]`` puts the batch on the grid. Other
broadcasting patterns take the reference explicitly.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from . import blocks
from ._pallas import Config, chunk_loop, dot, ds, pad_to, pallas_call, vmem
from ._sharding import carries, sharded_call
from .dispatch import call
from .precision import is_low_precision

# ---------------------------------------------------------------- kernel


def _matmul_gpu_kernel(a_ref, b_ref, o_ref, *, bk: int, n_k: int):
    # Inputs: a_ref [bm, k_pad], b_ref [k_pad, bn]
    # Outputs: o_ref [bm, bn]
    def step(kk, acc):
        return acc + dot(a_ref[:, ds(kk, bk)], b_ref[ds(kk, bk), :])

    acc = chunk_loop(n_k, step, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _matmul_tpu_kernel(a_ref, b_ref, o_ref, *scratch, n_k: int):
    # Inputs: a_ref [bm, bk], b_ref [bk, bn] (step program_id(3) of n_k along K)
    # Outputs: o_ref [bm, bn]; scratch: acc_ref [bm, bn] float32 when n_k > 1
    if n_k == 1:
        o_ref[...] = dot(a_ref[...], b_ref[...]).astype(o_ref.dtype)
        return
    (acc_ref,) = scratch
    kk = pl.program_id(3)

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    acc_ref[...] += dot(a_ref[...], b_ref[...])

    @pl.when(kk == n_k - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnums=0)
def _matmul_local(key: tuple, a: jax.Array, b: jax.Array) -> tuple[jax.Array]:
    cfg, out_dtype, batched = key
    lead, (m, k), n = a.shape[:-2], a.shape[-2:], b.shape[-1]
    ct = jnp.result_type(a.dtype, b.dtype)
    if batched:
        a3, b3 = a.reshape(-1, m, k), b.reshape(-1, k, n)
    else:
        a3, b3 = a.reshape(1, -1, k), b.reshape(1, k, n)
    nb, rows = a3.shape[0], a3.shape[1]
    t = blocks.matmul_blocks(rows, k, n, cfg.target, jnp.dtype(ct).itemsize)
    a3 = pad_to(a3.astype(ct), (nb, t.m_pad, t.k_pad))
    b3 = pad_to(b3.astype(ct), (b3.shape[0], t.k_pad, t.n_pad))
    out_shape = jax.ShapeDtypeStruct((nb, t.m_pad, t.n_pad), out_dtype)
    out_spec = pl.BlockSpec((pl.squeezed, t.bm, t.bn), lambda bi, i, j, *_: (bi, i, j))
    if cfg.target == blocks.GPU:
        b_index = (lambda bi, i, j: (bi, 0, j)) if batched else (lambda bi, i, j: (0, 0, j))
        out = pallas_call(
            functools.partial(_matmul_gpu_kernel, bk=t.bk, n_k=t.n_k),
            cfg,
            name="matmul",
            grid=(nb, t.m_pad // t.bm, t.n_pad // t.bn),
            in_specs=[
                pl.BlockSpec((pl.squeezed, t.bm, t.k_pad), lambda bi, i, j: (bi, i, 0)),
                pl.BlockSpec((pl.squeezed, t.k_pad, t.bn), b_index),
            ],
            out_specs=out_spec,
            out_shape=out_shape,
            num_warps=t.num_warps,
            num_stages=t.num_stages,
        )(a3, b3)
    else:
        b_index = (lambda bi, i, j, kk: (bi, kk, j)) if batched else (lambda bi, i, j, kk: (0, kk, j))
        out = pallas_call(
            functools.partial(_matmul_tpu_kernel, n_k=t.n_k),
            cfg,
            name="matmul",
            grid=(nb, t.m_pad // t.bm, t.n_pad // t.bn, t.n_k),
            in_specs=[
                pl.BlockSpec((pl.squeezed, t.bm, t.bk), lambda bi, i, j, kk: (bi, i, kk)),
                pl.BlockSpec((pl.squeezed, t.bk, t.bn), b_index),
            ],
            out_specs=out_spec,
            out_shape=out_shape,
            semantics=("parallel", "parallel", "parallel", "arbitrary"),
            scratch_shapes=[vmem((t.bm, t.bn))] if t.n_k > 1 else [],
        )(a3, b3)
    return (out[:, :rows, :n].reshape((*lead, m, n)),)


# ---------------------------------------------------------------- custom_jvp glue


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _matmul(key: tuple, a: jax.Array, b: jax.Array) -> jax.Array:
    return sharded_call(_matmul_local, key, _rule(key[2]), a, b, replicated="k")[0]


def _rule(batched: bool) -> str:
    return "... m k, ... k n -> ... m n" if batched else "... m k, k n -> ... m n"


@_matmul.defjvp
def _matmul_jvp(key, primals, tangents):
    (a, b), (da, db) = primals, tangents
    out = _matmul(key, a, b)
    # product rule in jax.numpy (float32 accumulation), linear in (da, db)
    dout = matmul_reference(da, b, out_dtype=jnp.float32) + matmul_reference(a, db, out_dtype=jnp.float32)
    return out, dout.astype(out.dtype)


def _pallas_form(a: jax.Array, b: jax.Array) -> bool | None:
    """True: batched; False: ``[..., M, K] @ [K, N]``; None: not a kernel shape."""
    if a.ndim >= 2 and b.ndim == 2 and a.shape[-1] == b.shape[0]:
        return False
    if a.ndim == b.ndim >= 3 and a.shape[:-2] == b.shape[:-2] and a.shape[-1] == b.shape[-2]:
        return True
    return None


def matmul_pallas(a: jax.Array, b: jax.Array, *, out_dtype: Any, cfg: Config, out_sharding: Any = None) -> jax.Array:
    """The tiled kernel for ``[..., M, K] @ [K, N]`` and equal-batch products;
    run per shard it gives ``out_sharding`` by itself (``matmul`` checks that)."""
    out_dtype = np.dtype(out_dtype or jnp.result_type(a, b))
    form = _pallas_form(a, b)
    if form is None:  # other broadcasting patterns (1-D operands, broadcast batches)
        return matmul_reference(a, b, out_dtype=out_dtype, out_sharding=out_sharding)
    return _matmul((cfg, out_dtype, form), a, b)


# ---------------------------------------------------------------- reference


def matmul_reference(a: jax.Array, b: jax.Array, *, out_dtype: Any = None, out_sharding: Any = None) -> jax.Array:
    out_dtype = out_dtype or jnp.result_type(a, b)
    if is_low_precision(a.dtype) or is_low_precision(b.dtype) or is_low_precision(out_dtype):
        out = jnp.matmul(a, b, preferred_element_type=jnp.float32, out_sharding=out_sharding)
        return out.astype(out_dtype)
    return jnp.matmul(a, b, out_sharding=out_sharding).astype(out_dtype)


# ---------------------------------------------------------------- entry points


def kernel_carries(a: jax.Array, b: jax.Array, out_sharding: Any) -> bool:
    """Whether the kernel, run per shard (``sharded_call``), gives
    ``out_sharding`` with nothing gathered: the contracted K whole on both
    operands and the result's sharding (``a``'s batch/M axes, ``b``'s N axis)
    equal to ``out_sharding``."""
    form = _pallas_form(a, b)
    return form is not None and carries(_rule(form), (out_sharding,), a, b, replicated="k")


def matmul(a: jax.Array, b: jax.Array, out_dtype: Any = None, out_sharding: Any = None) -> jax.Array:
    """``a @ b`` for ``[..., M, K] @ [K, N]`` and the batched ``[..., M, K] @
    [..., K, N]`` (the kernel reads the form from the shapes, ``_pallas_form``).

    ``out_sharding``: the result's sharding, for operands sharded over Explicit
    mesh axes (a backward rule's gradient must have its operand's). Where the
    kernel gives it by itself (:func:`kernel_carries`: each device multiplies
    its own rows, K whole) the kernel runs per shard; where it cannot, the
    product takes XLA's dot with ``out_sharding``. That is the case of a
    contraction over a sharded axis (the weight gradient ``x^T dy`` over a
    batch sharded on "data"; ``dy W^T`` of a column-parallel layer, over N on
    "model"): the kernel needs K whole, so running it would all-gather those
    activations (or the weight) first, where XLA multiplies the local shards and
    sums the partial products (all-reduce, or reduce-scatter into a sharded
    result)."""
    if out_sharding is not None and not kernel_carries(a, b, out_sharding):
        return matmul_reference(a, b, out_dtype=out_dtype, out_sharding=out_sharding)
    return call(matmul_reference, matmul_pallas, a, b, out_dtype=out_dtype, out_sharding=out_sharding)


bmm = matmul  # the batched product: the same entry point (one body)
