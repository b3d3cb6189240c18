"""Scaled dot-product attention: flash-style Pallas forward (output + per-row
log-sum-exp) and backward kernels, their ``custom_jvp`` glue, and the
jax.numpy reference.

Forward: one program per (batch*head, query block); keys and values are visited
in blocks with an online softmax (running max, running sum, rescaled
accumulator), so the ``[Sq, Sk]`` matrix never exists, only one
``[bq, bk]`` tile at a time. With ``causal=True`` (query ``i`` sees keys
``j <= i``, top-left aligned) the loop stops at the diagonal block.

Backward: two kernels, so that no two programs write the same output: one per
key block accumulates ``dk``/``dv`` over the query blocks, one per query block
accumulates ``dq`` over the key blocks; both recompute the probabilities from
the saved log-sum-exp. ``delta = rowsum(dO * O)`` is a cheap host-side reduction.

The kernels handle ``mask=None`` (with or without ``causal``). Explicit masks
(boolean or additive, already broadcast to ``[..., Sq, Sk]`` by the op) take the
reference: reading a materialised mask per tile is possible, but the additive
mask's gradient is the full ``[..., Sq, Sk]`` matrix anyway, so the fused
kernel would save little there. The tangent rules (``custom_jvp``, used by
``jax.jvp``/``jax.grad`` through the kernels) are jax.numpy and do materialise
the score matrix; rumus_fx's own ``rf.grad`` uses the backward kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import blocks
from ._pallas import MASK_VALUE, Config, chunk_loop, dot, ds, iota, pad_to, pallas_call, vmem
from ._sharding import sharded_call
from .dispatch import call
from .precision import upcast

# ---------------------------------------------------------------- kernels


def _keep(rows: int, cols: int, q_start, k_start, *, sk: int, causal: bool) -> jax.Array:
    """Which (query, key) pairs of a tile are real keys (and causal-visible)."""
    kpos = iota((rows, cols), 1, k_start)
    keep = kpos < sk
    if causal:
        keep = keep & (kpos <= iota((rows, cols), 0, q_start))
    return keep


# Block ranges under causal masking. lax.div, not //: the operands are
# non-negative, and integer // lowers through lax.sign, whose Mosaic TPU rule
# needs to know the TPU chip it targets.


def _kv_end(i, bq: int, bk: int, n_kv: int):
    """Key blocks ``[0, end)`` hold keys visible to query block ``i``."""
    return jnp.minimum(n_kv, lax.div((i + 1) * bq + bk - 1, bk))


def _q_begin(j, bq: int, bk: int):
    """Query blocks ``[begin, n_q)`` see some key of key block ``j``."""
    return lax.div(j * bk, bq)


def _probs(q, kb, lse, q_start, k_start, *, sk: int, causal: bool, scale: float) -> jax.Array:
    s = dot(q, kb, (1, 1)) * scale
    keep = _keep(q.shape[0], kb.shape[0], q_start, k_start, sk=sk, causal=causal)
    return jnp.exp(jnp.where(keep, s, MASK_VALUE) - lse)


def _fwd_step(q, kb, vb, carry, q_start, k_start, *, sk: int, causal: bool, scale: float):
    """One key block of the online softmax: ``(max, sum, acc)`` updated."""
    m, s_sum, acc = carry
    s = dot(q, kb, (1, 1)) * scale
    s = jnp.where(_keep(q.shape[0], kb.shape[0], q_start, k_start, sk=sk, causal=causal), s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp(s - m_new)
    alpha = jnp.exp(m - m_new)
    s_sum = s_sum * alpha + jnp.sum(p, axis=1, keepdims=True)
    acc = acc * alpha + dot(p.astype(vb.dtype), vb)
    return m_new, s_sum, acc


def _dkdv_step(q, do, lse, delta, kb, vb, carry, q_start, k_start, **mask):
    """One query block's contribution to a key block's ``(dk, dv)`` (dk unscaled)."""
    dk, dv = carry
    p = _probs(q, kb, lse, q_start, k_start, **mask)
    dv = dv + dot(p.astype(do.dtype), do, (0, 0))
    dscore = p * (dot(do, vb, (1, 1)) - delta)
    dk = dk + dot(dscore.astype(q.dtype), q, (0, 0))
    return dk, dv


def _dq_step(q, do, lse, delta, kb, vb, dq, q_start, k_start, **mask):
    """One key block's contribution to a query block's ``dq`` (unscaled)."""
    p = _probs(q, kb, lse, q_start, k_start, **mask)
    dscore = p * (dot(do, vb, (1, 1)) - delta)
    return dq + dot(dscore.astype(kb.dtype), kb)


def _fwd_init(bq: int, dv: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    return (
        jnp.full((bq, 1), -jnp.inf, jnp.float32),
        jnp.zeros((bq, 1), jnp.float32),
        jnp.zeros((bq, dv), jnp.float32),
    )


# GPU (Triton): one program per query block (forward, dq) or key block (dk/dv)
# loops over the other axis; the whole K/V (or Q/dO) of the head stays in
# global memory and each iteration loads one block.


def _attn_fwd_gpu_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, bk: int, n_kv: int, **mask):
    # Inputs: q_ref [bq, d_pad], k_ref [sk_pad, d_pad], v_ref [sk_pad, dv_pad]
    # Outputs: o_ref [bq, dv_pad], lse_ref [bq, 1] (float32)
    bq = q_ref.shape[0]
    i = pl.program_id(1)
    q = q_ref[...]

    def body(j, carry):
        return _fwd_step(q, k_ref[ds(j, bk), :], v_ref[ds(j, bk), :], carry, i * bq, j * bk, **mask)

    init = _fwd_init(bq, o_ref.shape[1])
    if mask["causal"] and n_kv > 1:
        m, s_sum, acc = lax.fori_loop(0, _kv_end(i, bq, bk, n_kv), body, init)
    else:
        m, s_sum, acc = chunk_loop(n_kv, body, init)
    o_ref[...] = (acc / s_sum).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(s_sum)


def _attn_bwd_dkdv_gpu_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, bq: int, n_q: int, scale: float, **mask
):
    # Inputs: q_ref [sq_pad, d_pad], k_ref [bk, d_pad], v_ref [bk, dv_pad], do_ref [sq_pad, dv_pad],
    #         lse_ref, delta_ref [sq_pad, 1]
    # Outputs: dk_ref [bk, d_pad], dv_ref [bk, dv_pad]
    bk = k_ref.shape[0]
    j = pl.program_id(1)
    kb, vb = k_ref[...], v_ref[...]

    def body(i, carry):
        rows = ds(i, bq)
        q, do, lse, delta = q_ref[rows, :], do_ref[rows, :], lse_ref[rows, :], delta_ref[rows, :]
        return _dkdv_step(q, do, lse, delta, kb, vb, carry, i * bq, j * bk, scale=scale, **mask)

    init = (jnp.zeros(dk_ref.shape, jnp.float32), jnp.zeros(dv_ref.shape, jnp.float32))
    if mask["causal"] and n_q > 1:  # query blocks entirely above this key block see none of it
        dk, dv = lax.fori_loop(_q_begin(j, bq, bk), n_q, body, init)
    else:
        dk, dv = chunk_loop(n_q, body, init)
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _attn_bwd_dq_gpu_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, bk: int, n_kv: int, scale: float, **mask
):
    # Inputs: q_ref [bq, d_pad], k_ref [sk_pad, d_pad], v_ref [sk_pad, dv_pad], do_ref [bq, dv_pad],
    #         lse_ref, delta_ref [bq, 1]
    # Outputs: dq_ref [bq, d_pad]
    bq = q_ref.shape[0]
    i = pl.program_id(1)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]

    def body(j, dq):
        kb, vb = k_ref[ds(j, bk), :], v_ref[ds(j, bk), :]
        return _dq_step(q, do, lse, delta, kb, vb, dq, i * bq, j * bk, scale=scale, **mask)

    init = jnp.zeros(dq_ref.shape, jnp.float32)
    if mask["causal"] and n_kv > 1:
        dq = lax.fori_loop(0, _kv_end(i, bq, bk, n_kv), body, init)
    else:
        dq = chunk_loop(n_kv, body, init)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


# TPU (Mosaic): the loop axis is the last grid axis, run in order
# ("arbitrary"), with the carries in VMEM scratch; each step copies one block
# of each operand into VMEM. Under causal masking the steps past the diagonal
# do nothing, and their index maps repeat the last useful block (no copy).


def _when_visible(causal: bool, visible, body) -> None:
    if causal:
        pl.when(visible)(body)
    else:
        body()


def _attn_fwd_tpu_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref, *, n_kv: int, **mask):
    # Inputs: q_ref [bq, d_pad], k_ref [bk, d_pad], v_ref [bk, dv_pad] (key block program_id(2))
    # Outputs: o_ref [bq, dv_pad], lse_ref [bq, 1]; scratch m_ref, l_ref [bq, 1], acc_ref [bq, dv_pad]
    bq, bk = q_ref.shape[0], k_ref.shape[0]
    i, j = pl.program_id(1), pl.program_id(2)

    @pl.when(j == 0)
    def _():
        for ref, v in zip((m_ref, l_ref, acc_ref), _fwd_init(bq, acc_ref.shape[1])):
            ref[...] = v

    def step():
        carry = (m_ref[...], l_ref[...], acc_ref[...])
        m, s_sum, acc = _fwd_step(q_ref[...], k_ref[...], v_ref[...], carry, i * bq, j * bk, **mask)
        m_ref[...], l_ref[...], acc_ref[...] = m, s_sum, acc

    _when_visible(mask["causal"], j < _kv_end(i, bq, bk, n_kv), step)

    @pl.when(j == n_kv - 1)
    def _():
        o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)
        lse_ref[...] = m_ref[...] + jnp.log(l_ref[...])


def _attn_bwd_dkdv_tpu_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_acc, dv_acc, *, n_q: int, scale: float, **mask
):
    # Inputs: q_ref [bq, d_pad], do_ref [bq, dv_pad], lse_ref, delta_ref [bq, 1] (query block
    #         program_id(2)), k_ref [bk, d_pad], v_ref [bk, dv_pad]
    # Outputs: dk_ref [bk, d_pad], dv_ref [bk, dv_pad]; scratch dk_acc, dv_acc of the same shapes
    bq, bk = q_ref.shape[0], k_ref.shape[0]
    j, i = pl.program_id(1), pl.program_id(2)

    @pl.when(i == 0)
    def _():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    def step():
        args = (q_ref[...], do_ref[...], lse_ref[...], delta_ref[...], k_ref[...], v_ref[...])
        carry = (dk_acc[...], dv_acc[...])
        dk_acc[...], dv_acc[...] = _dkdv_step(*args, carry, i * bq, j * bk, scale=scale, **mask)

    _when_visible(mask["causal"], i >= _q_begin(j, bq, bk), step)

    @pl.when(i == n_q - 1)
    def _():
        dk_ref[...] = (dk_acc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _attn_bwd_dq_tpu_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dq_acc, *, n_kv: int, scale: float, **mask
):
    # Inputs: q_ref [bq, d_pad], do_ref [bq, dv_pad], lse_ref, delta_ref [bq, 1],
    #         k_ref [bk, d_pad], v_ref [bk, dv_pad] (key block program_id(2))
    # Outputs: dq_ref [bq, d_pad]; scratch dq_acc of the same shape
    bq, bk = q_ref.shape[0], k_ref.shape[0]
    i, j = pl.program_id(1), pl.program_id(2)

    @pl.when(j == 0)
    def _():
        dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

    def step():
        args = (q_ref[...], do_ref[...], lse_ref[...], delta_ref[...], k_ref[...], v_ref[...])
        dq_acc[...] = _dq_step(*args, dq_acc[...], i * bq, j * bk, scale=scale, **mask)

    _when_visible(mask["causal"], j < _kv_end(i, bq, bk, n_kv), step)

    @pl.when(j == n_kv - 1)
    def _():
        dq_ref[...] = (dq_acc[...] * scale).astype(dq_ref.dtype)


def _flat(x: jax.Array, rows: int, cols: int) -> jax.Array:
    """``[..., S, D]`` -> ``[B*H, rows, cols]`` zero padded."""
    x3 = x.reshape(-1, *x.shape[-2:])
    return pad_to(x3, (x3.shape[0], rows, cols))


def _tile(rows: int, cols: int, index) -> pl.BlockSpec:
    return pl.BlockSpec((pl.squeezed, rows, cols), index)


def _gpu_params(t: blocks.AttentionBlocks) -> dict:
    return dict(num_warps=t.num_warps, num_stages=t.num_stages)


def _tpu_params(*scratch: tuple[int, int]) -> dict:
    return dict(semantics=("parallel", "parallel", "arbitrary"), scratch_shapes=[vmem(s) for s in scratch])


def _tpu_kv_index(t: blocks.AttentionBlocks, causal: bool):
    """Key block of step ``j`` for query block ``i`` (causal: clamped at the diagonal)."""
    n_kv = t.sk_pad // t.bk
    if not causal:
        return lambda b, i, j: (b, j, 0)
    return lambda b, i, j: (b, jnp.minimum(j, _kv_end(i, t.bq, t.bk, n_kv) - 1), 0)


def _tpu_q_index(t: blocks.AttentionBlocks, causal: bool):
    """Query block of step ``i`` for key block ``j`` (causal: from the first visible)."""
    n_q = t.sq_pad // t.bq
    if not causal:
        return lambda b, j, i: (b, i, 0)
    # (a key block past every query, when Sk > Sq, clamps to the last query block: no step runs)
    return lambda b, j, i: (b, jnp.minimum(jnp.maximum(i, _q_begin(j, t.bq, t.bk)), n_q - 1), 0)


@functools.partial(jax.jit, static_argnums=0)
def _attn_fwd_local(key: tuple, q: jax.Array, k: jax.Array, v: jax.Array):
    cfg, causal, scale = key
    lead, (sq, d), (sk, dv) = q.shape[:-2], q.shape[-2:], v.shape[-2:]
    t = blocks.attention_blocks(sq, sk, d, dv, cfg.target)
    q3, k3, v3 = _flat(q, t.sq_pad, t.d_pad), _flat(k, t.sk_pad, t.d_pad), _flat(v, t.sk_pad, t.dv_pad)
    bh, n_q, n_kv = q3.shape[0], t.sq_pad // t.bq, t.sk_pad // t.bk
    mask = dict(sk=sk, causal=causal, scale=scale)
    out_shape = (
        jax.ShapeDtypeStruct((bh, t.sq_pad, t.dv_pad), q.dtype),
        jax.ShapeDtypeStruct((bh, t.sq_pad, 1), jnp.float32),
    )
    if cfg.target == blocks.GPU:
        kernel = functools.partial(_attn_fwd_gpu_kernel, bk=t.bk, n_kv=n_kv, **mask)
        grid, params = (bh, n_q), _gpu_params(t)
        q_at, kv_at = (lambda b, i: (b, i, 0)), (lambda b, i: (b, 0, 0))
        kv_rows = t.sk_pad
    else:
        kernel = functools.partial(_attn_fwd_tpu_kernel, n_kv=n_kv, **mask)
        grid, params = (bh, n_q, n_kv), _tpu_params((t.bq, 1), (t.bq, 1), (t.bq, t.dv_pad))
        q_at, kv_at = (lambda b, i, j: (b, i, 0)), _tpu_kv_index(t, causal)
        kv_rows = t.bk
    out, lse = pallas_call(
        kernel,
        cfg,
        name="attention_fwd",
        grid=grid,
        in_specs=[_tile(t.bq, t.d_pad, q_at), _tile(kv_rows, t.d_pad, kv_at), _tile(kv_rows, t.dv_pad, kv_at)],
        out_specs=(_tile(t.bq, t.dv_pad, q_at), _tile(t.bq, 1, q_at)),
        out_shape=out_shape,
        **params,
    )(q3, k3, v3)
    return out[:, :sq, :dv].reshape(*lead, sq, dv), lse[:, :sq, 0].reshape(*lead, sq)


@functools.partial(jax.jit, static_argnums=0)
def _attn_bwd_local(key: tuple, q, k, v, out, lse, g):
    cfg, causal, scale = key
    lead, (sq, d), (sk, dv) = q.shape[:-2], q.shape[-2:], v.shape[-2:]
    t = blocks.attention_blocks(sq, sk, d, dv, cfg.target)
    q3, k3, v3 = _flat(q, t.sq_pad, t.d_pad), _flat(k, t.sk_pad, t.d_pad), _flat(v, t.sk_pad, t.dv_pad)
    do3 = _flat(g.astype(q.dtype), t.sq_pad, t.dv_pad)
    delta = jnp.sum(upcast(g) * upcast(out), axis=-1, keepdims=True)
    delta3 = _flat(delta, t.sq_pad, 1)
    lse3 = _flat(lse[..., None].astype(jnp.float32), t.sq_pad, 1)
    args = (q3, k3, v3, do3, lse3, delta3)
    bh, n_q, n_kv = q3.shape[0], t.sq_pad // t.bq, t.sk_pad // t.bk
    mask = dict(sk=sk, causal=causal, scale=scale)
    dkdv_shape = (
        jax.ShapeDtypeStruct((bh, t.sk_pad, t.d_pad), k.dtype),
        jax.ShapeDtypeStruct((bh, t.sk_pad, t.dv_pad), v.dtype),
    )
    dq_shape = jax.ShapeDtypeStruct((bh, t.sq_pad, t.d_pad), q.dtype)
    if cfg.target == blocks.GPU:
        q_rows, kv_rows = t.sq_pad, t.sk_pad  # the whole loop axis, in global memory
        dkdv_kernel = functools.partial(_attn_bwd_dkdv_gpu_kernel, bq=t.bq, n_q=n_q, **mask)
        dkdv_grid, dkdv_params = (bh, n_kv), _gpu_params(t)
        dkdv_q_at, dkdv_kv_at = (lambda b, j: (b, 0, 0)), (lambda b, j: (b, j, 0))
        dq_kernel = functools.partial(_attn_bwd_dq_gpu_kernel, bk=t.bk, n_kv=n_kv, **mask)
        dq_grid, dq_params = (bh, n_q), _gpu_params(t)
        dq_q_at, dq_kv_at = (lambda b, i: (b, i, 0)), (lambda b, i: (b, 0, 0))
    else:
        q_rows, kv_rows = t.bq, t.bk
        dkdv_kernel = functools.partial(_attn_bwd_dkdv_tpu_kernel, n_q=n_q, **mask)
        dkdv_grid, dkdv_params = (bh, n_kv, n_q), _tpu_params((t.bk, t.d_pad), (t.bk, t.dv_pad))
        dkdv_q_at, dkdv_kv_at = _tpu_q_index(t, causal), (lambda b, j, i: (b, j, 0))
        dq_kernel = functools.partial(_attn_bwd_dq_tpu_kernel, n_kv=n_kv, **mask)
        dq_grid, dq_params = (bh, n_q, n_kv), _tpu_params((t.bq, t.d_pad))
        dq_q_at, dq_kv_at = (lambda b, i, j: (b, i, 0)), _tpu_kv_index(t, causal)

    def specs(q_block: int, kv_block: int, q_at, kv_at) -> list[pl.BlockSpec]:
        return [
            _tile(q_block, t.d_pad, q_at),
            _tile(kv_block, t.d_pad, kv_at),
            _tile(kv_block, t.dv_pad, kv_at),
            _tile(q_block, t.dv_pad, q_at),
            _tile(q_block, 1, q_at),
            _tile(q_block, 1, q_at),
        ]

    dk, dv_ = pallas_call(
        dkdv_kernel,
        cfg,
        name="attention_bwd_dkdv",
        grid=dkdv_grid,
        in_specs=specs(q_rows, t.bk, dkdv_q_at, dkdv_kv_at),
        out_specs=(_tile(t.bk, t.d_pad, dkdv_kv_at), _tile(t.bk, t.dv_pad, dkdv_kv_at)),
        out_shape=dkdv_shape,
        **dkdv_params,
    )(*args)
    dq = pallas_call(
        dq_kernel,
        cfg,
        name="attention_bwd_dq",
        grid=dq_grid,
        in_specs=specs(t.bq, kv_rows, dq_q_at, dq_kv_at),
        out_specs=_tile(t.bq, t.d_pad, dq_q_at),
        out_shape=dq_shape,
        **dq_params,
    )(*args)
    return (
        dq[:, :sq, :d].reshape(*lead, sq, d),
        dk[:, :sk, :d].reshape(*lead, sk, d),
        dv_[:, :sk, :dv].reshape(*lead, sk, dv),
    )


# ---------------------------------------------------------------- custom_jvp glue
# jax.numpy tangents, linear in the tangents (these materialise [Sq, Sk]).


def _dense_probs(q, k, lse, *, causal: bool, scale: float) -> jax.Array:
    return jnp.exp(_scores(q, k, None, causal=causal, scale=scale) - lse[..., None])


def _mm(a, b, spec: str) -> jax.Array:
    return jnp.einsum(spec, upcast(a), upcast(b))


# Sharding: batch/head axes may be sharded; keys and head dims stay whole, and
# so do queries under causal masking (it needs the global query position).
_FWD_RULE = "... q d, ... k d, ... k e -> ... q e, ... q"
_BWD_RULE = "... q d, ... k d, ... k e, ... q e, ... q, ... q e -> ... q d, ... k d, ... k e"


def _replicated(causal: bool) -> str:
    return "k d e q" if causal else "k d e"


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _attn_fwd(key: tuple, q, k, v):
    return sharded_call(_attn_fwd_local, key, _FWD_RULE, q, k, v, replicated=_replicated(key[1]))


@_attn_fwd.defjvp
def _attn_fwd_jvp(key, primals, tangents):
    _, causal, scale = key
    (q, k, v), (dq, dk, dv) = primals, tangents
    out, lse = _attn_fwd(key, q, k, v)
    p = _dense_probs(q, k, lse, causal=causal, scale=scale)
    dscore = (_mm(dq, k, "...qd,...kd->...qk") + _mm(q, dk, "...qd,...kd->...qk")) * scale
    dlse = jnp.sum(p * dscore, axis=-1)
    dp = p * (dscore - dlse[..., None])
    dout = _mm(dp, v, "...qk,...kd->...qd") + _mm(p, dv, "...qk,...kd->...qd")
    return (out, lse), (dout.astype(out.dtype), dlse.astype(lse.dtype))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _attn_bwd(key: tuple, q, k, v, out, lse, g):
    return sharded_call(_attn_bwd_local, key, _BWD_RULE, q, k, v, out, lse, g, replicated=_replicated(key[1]))


@_attn_bwd.defjvp
def _attn_bwd_jvp(key, primals, tangents):
    _, causal, scale = key
    q, k, v, out, lse, g = primals
    tq, tk, tv, tout, tlse, tg = tangents
    res = _attn_bwd(key, *primals)
    gf = upcast(g)
    p = _dense_probs(q, k, lse, causal=causal, scale=scale)
    dscore_in = (_mm(tq, k, "...qd,...kd->...qk") + _mm(q, tk, "...qd,...kd->...qk")) * scale
    tp = p * (dscore_in - upcast(tlse)[..., None])
    dp = _mm(g, v, "...qd,...kd->...qk")
    tdp = _mm(tg, v, "...qd,...kd->...qk") + _mm(g, tv, "...qd,...kd->...qk")
    delta = jnp.sum(gf * upcast(out), axis=-1, keepdims=True)
    tdelta = jnp.sum(upcast(tg) * upcast(out) + gf * upcast(tout), axis=-1, keepdims=True)
    ds_ = p * (dp - delta)
    tds = tp * (dp - delta) + p * (tdp - tdelta)
    tdq = (_mm(tds, k, "...qk,...kd->...qd") + _mm(ds_, tk, "...qk,...kd->...qd")) * scale
    tdk = (_mm(tds, q, "...qk,...qd->...kd") + _mm(ds_, tq, "...qk,...qd->...kd")) * scale
    tdv = _mm(tp, g, "...qk,...qd->...kd") + _mm(p, tg, "...qk,...qd->...kd")
    return res, tuple(t.astype(r.dtype) for t, r in zip((tdq, tdk, tdv), res))


def attention_fwd_pallas(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, *, causal: bool, scale: float, cfg: Config
) -> tuple[jax.Array, jax.Array]:
    """The flash forward for ``mask=None``; explicit masks take the reference."""
    if mask is not None:  # explicit masks: the reference (see the module docstring)
        return attention_fwd_reference(q, k, v, mask, causal=causal, scale=scale)
    return _attn_fwd((cfg, causal, scale), q, k, v)


def attention_bwd_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    out: jax.Array,
    lse: jax.Array,
    g: jax.Array,
    *,
    causal: bool,
    scale: float,
    mask_grad: bool,
    cfg: Config,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """The flash backward for ``mask=None``; explicit masks take the reference."""
    if mask is not None:
        return attention_bwd_reference(q, k, v, mask, out, lse, g, causal=causal, scale=scale, mask_grad=mask_grad)
    dq, dk, dv = _attn_bwd((cfg, causal, scale), q, k, v, out, lse, g)
    return dq, dk, dv, None


# ---------------------------------------------------------------- reference


def _scores(q, k, mask, *, causal: bool, scale: float):
    s = jnp.einsum("...qd,...kd->...qk", upcast(q), upcast(k)) * scale
    neg = jnp.finfo(s.dtype).min
    if mask is not None:
        if mask.dtype == jnp.bool_:
            s = jnp.where(mask, s, neg)
        else:
            s = s + upcast(mask)
    if causal:
        sq, sk = s.shape[-2], s.shape[-1]
        keep = jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None]
        s = jnp.where(keep, s, neg)
    return s


def attention_fwd_reference(q, k, v, mask, *, causal: bool, scale: float):
    """-> (out [..., Sq, Dv], lse [..., Sq] in float32 or wider)."""
    s = _scores(q, k, mask, causal=causal, scale=scale)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - m)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / denom
    out = jnp.einsum("...qk,...kd->...qd", p, upcast(v))
    lse = (m + jnp.log(denom))[..., 0]
    return out.astype(q.dtype), lse


def attention_lse(q, k, mask, *, causal: bool, scale: float):
    """The per-row log-sum-exp of the scores, as ``attention_fwd_reference``."""
    s = _scores(q, k, mask, causal=causal, scale=scale)
    m = jnp.max(s, axis=-1, keepdims=True)
    return (m + jnp.log(jnp.sum(jnp.exp(s - m), axis=-1, keepdims=True)))[..., 0]


def attention_bwd_reference(q, k, v, mask, out, lse, g, *, causal: bool, scale: float, mask_grad: bool = False):
    """-> (dq, dk, dv, dmask | None); dmask only for a float (additive) mask."""
    s = _scores(q, k, mask, causal=causal, scale=scale)
    p = jnp.exp(s - lse[..., None])
    gf = upcast(g)
    dv = jnp.einsum("...qk,...qd->...kd", p, gf)
    dp = jnp.einsum("...qd,...kd->...qk", gf, upcast(v))
    delta = jnp.sum(gf * upcast(out), axis=-1, keepdims=True)
    ds = p * (dp - delta)
    dq = jnp.einsum("...qk,...kd->...qd", ds, upcast(k)) * scale
    dk = jnp.einsum("...qk,...qd->...kd", ds, upcast(q)) * scale
    dmask = ds if mask_grad else None
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dmask


# ---------------------------------------------------------------- entry points


def attention_fwd(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None, causal: bool = False, scale: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """``(out, lse)``: flash kernel for ``mask=None``, the reference otherwise."""
    return call(attention_fwd_reference, attention_fwd_pallas, q, k, v, mask, causal=causal, scale=scale)


def attention_bwd(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    out: jax.Array,
    lse: jax.Array,
    g: jax.Array,
    causal: bool = False,
    scale: float = 1.0,
    mask_grad: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """``(dq, dk, dv, dmask | None)`` from the saved output and log-sum-exp."""
    return call(
        attention_bwd_reference,
        attention_bwd_pallas,
        q,
        k,
        v,
        mask,
        out,
        lse,
        g,
        causal=causal,
        scale=scale,
        mask_grad=mask_grad,
    )
