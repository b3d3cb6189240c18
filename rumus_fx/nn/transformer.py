"""Self-attention and the pre-norm transformer block, built from rumus_fx ops."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from .. import ops
from .. import sharding as shd
from ..tensor import Tensor
from .layers import Dropout, LayerNorm, Linear, Module, Params, _check_float, _check_int, _param, _shape

__all__ = ["MultiheadAttention", "TransformerBlock"]


@dataclasses.dataclass(frozen=True)
class MultiheadAttention(Module):
    """Multi-head self-attention over ``x:[..., S, dim]`` -> ``[..., S, dim]``.

    Params: ``{"qkv": Linear(dim, 3*dim), "proj": Linear(dim, dim)}`` (each
    ``{"weight", "bias"}``, Linear's default init). The fused ``qkv``
    projection is split into ``heads`` heads of size ``dim // heads`` by views
    (reshape/transpose), attended with ``rf.scaled_dot_product_attention``
    (scale ``1/sqrt(dim // heads)``) and projected back.

    Tensor parallel: with the ``qkv`` weight sharded on its output axis over
    Explicit mesh axes (``P(None, "model")``, column parallel) the heads stay
    sharded end to end; see Note [Head-parallel fused qkv].

    Call: ``mha(params, x, *, causal=False, mask=None)``; ``mask`` broadcasts to
    ``[..., heads, S, S]`` (boolean, True = attend, or an additive float mask).

    >>> import jax, jax.numpy as jnp, rumus_fx as rf
    >>> mha = rf.nn.MultiheadAttention(8, heads=2)
    >>> mha(mha.init(jax.random.key(0)), jnp.ones((3, 5, 8)), causal=True).shape
    (3, 5, 8)
    """

    dim: int
    heads: int
    bias: bool = True
    dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        _check_int("MultiheadAttention", "dim", self.dim, 1)
        _check_int("MultiheadAttention", "heads", self.heads, 1)
        if self.dim % self.heads:
            raise ValueError(f"MultiheadAttention: dim {self.dim} must be divisible by heads {self.heads}")

    @property
    def _qkv(self) -> Linear:
        return Linear(self.dim, 3 * self.dim, self.bias, self.dtype)

    @property
    def _proj(self) -> Linear:
        return Linear(self.dim, self.dim, self.bias, self.dtype)

    def init(self, key: jax.Array) -> Params:
        k1, k2 = jax.random.split(key)
        return {"qkv": self._qkv.init(k1), "proj": self._proj.init(k2)}

    def __call__(self, params: Params, x: Any, *, causal: bool = False, mask: Any = None) -> Tensor:
        shape = _shape(x)
        if len(shape) < 2 or shape[-1] != self.dim:
            raise ValueError(f"MultiheadAttention: expects x of shape [..., S, {self.dim}], got {shape}")
        *lead, s, d = shape
        h, dh = self.heads, self.dim // self.heads
        p_qkv = _param(params, "qkv", "MultiheadAttention")
        head_major = self._head_major(p_qkv)
        if head_major is not None:
            qkv = self._qkv(head_major, x)  # [..., S, 3D], columns ordered (H, 3, Dh)
            qkv = ops.transpose(ops.reshape(qkv, (-1, s, h, 3, dh)), 2, 3)  # [N, S, 3, H, Dh]
        else:
            qkv = self._qkv(p_qkv, x)  # [..., S, 3D]
            qkv = ops.reshape(qkv, (-1, s, 3, h, dh))
        # [N, S, 3, H, Dh] -> [3, N, H, S, Dh] by three axis swaps (views)
        qkv = ops.transpose(qkv, 0, 2)  # [3, S, N, H, Dh]
        qkv = ops.transpose(qkv, 1, 2)  # [3, N, S, H, Dh]
        qkv = ops.transpose(qkv, 2, 3)  # [3, N, H, S, Dh]
        heads_shape = (*lead, h, s, dh)
        q, k, v = (ops.reshape(ops.slice_batch(qkv, i), heads_shape) for i in range(3))
        o = ops.scaled_dot_product_attention(q, k, v, mask=mask, causal=causal, scale=1.0 / math.sqrt(dh))
        n = len(lead)
        o = ops.transpose(o, n, n + 1)  # [..., S, H, Dh]
        o = ops.reshape(o, (*lead, s, d))
        return self._proj(_param(params, "proj", "MultiheadAttention"), o)

    # Note [Head-parallel fused qkv]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # The fused weight is PyTorch's ``[D, 3D]`` with columns ordered (3, H, Dh):
    # q's heads, then k's, then v's. Sharded contiguously on its output axis
    # (column parallel), a shard holds a run of columns that cuts across q/k/v,
    # so splitting the projected activations into heads would all-gather them
    # over the model axis (``[N, S, 3D]`` per layer, forward and backward). Here
    # the *weight* is reordered instead, once per step: ``[D, 3D]`` ->
    # ``[D, 3, H@model, Dh]`` -> ``[D, H@model, 3, Dh]`` -> ``[D, 3D@model]`` with
    # columns ordered (H, 3, Dh), so each shard holds whole heads of q, k and v.
    # The projection then leaves the activations head-sharded, attention runs
    # per head shard and the row-parallel ``proj`` sums its partial products:
    # no activation is gathered. The reorder costs one all-gather of the weight
    # (and of its bias) in the forward and one of their gradients in the
    # backward: ``3D^2`` numbers instead of ``N*S*3D`` per layer.

    def _head_major(self, p: Any) -> dict[str, Any] | None:
        """The ``qkv`` params with columns ordered (H, 3, Dh) and whole heads on
        each shard, when the weight is sharded on its output axis over Explicit
        mesh axes into a number of shards that divides ``heads``; else None."""
        w = p.get("weight") if hasattr(p, "get") else None
        spec = shd.spec_of(w) if w is not None and len(_shape(w)) == 2 else None
        if spec is None or spec[1] is None:
            return None
        sharding = shd.sharding_of(w)
        model = spec[1]
        names = model if isinstance(model, tuple) else (model,)
        if self.heads % math.prod(sharding.mesh.shape[n] for n in names):
            return None
        d, h, dh = self.dim, self.heads, self.dim // self.heads
        b = p.get("bias")
        if b is not None and shd.spec_of(b) not in ((model,), None):
            return None
        P = jax.sharding.PartitionSpec
        w = ops.reshard(ops.reshape(w, (d, 3, h, dh)), P(spec[0], None, model, None))
        out = {"weight": ops.reshape(ops.transpose(w, 1, 2), (d, 3 * d))}
        if b is not None:
            b = ops.reshard(ops.reshape(b, (3, h, dh)), P(None, model, None))
            out["bias"] = ops.reshape(ops.transpose(b, 0, 1), (3 * d,))
        return out


@dataclasses.dataclass(frozen=True)
class TransformerBlock(Module):
    """Pre-norm transformer block (GPT-2 style) over ``x:[..., S, dim]``::

        x = x + attn(ln1(x))                  # multi-head self-attention
        x = x + fc2(gelu(fc1(ln2(x))))        # MLP of width mlp_ratio * dim (4x)

    Params: ``{"ln1", "attn", "ln2", "fc1", "fc2"}``. Call:
    ``block(params, x, *, causal=False, mask=None, key=None, training=True)``;
    with ``dropout > 0`` the attention and MLP outputs are dropped out while
    training (``key`` required then).

    >>> import jax, jax.numpy as jnp, rumus_fx as rf
    >>> block = rf.nn.TransformerBlock(16, heads=4)
    >>> block(block.init(jax.random.key(0)), jnp.ones((2, 7, 16)), causal=True).shape
    (2, 7, 16)
    """

    dim: int
    heads: int
    mlp_ratio: int = 4
    dropout: float = 0.0
    eps: float = 1e-5
    dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        _check_int("TransformerBlock", "mlp_ratio", self.mlp_ratio, 1)
        _check_float("TransformerBlock", "dropout", self.dropout, 0.0, 1.0, hi_open=True)
        MultiheadAttention(self.dim, self.heads)  # validates dim and heads

    @property
    def _parts(self) -> dict[str, Module]:
        hidden = self.mlp_ratio * self.dim
        return {
            "ln1": LayerNorm(self.dim, self.eps, self.dtype),
            "attn": MultiheadAttention(self.dim, self.heads, dtype=self.dtype),
            "ln2": LayerNorm(self.dim, self.eps, self.dtype),
            "fc1": Linear(self.dim, hidden, dtype=self.dtype),
            "fc2": Linear(hidden, self.dim, dtype=self.dtype),
        }

    def init(self, key: jax.Array) -> Params:
        parts = self._parts
        keys = jax.random.split(key, len(parts))
        return {name: layer.init(k) for (name, layer), k in zip(parts.items(), keys)}

    def __call__(
        self,
        params: Params,
        x: Any,
        *,
        causal: bool = False,
        mask: Any = None,
        key: jax.Array | None = None,
        training: bool = True,
    ) -> Tensor:
        p = {name: _param(params, name, "TransformerBlock") for name in ("ln1", "attn", "ln2", "fc1", "fc2")}
        parts = self._parts
        drop = Dropout(self.dropout)
        k_attn, k_mlp = jax.random.split(key) if key is not None else (None, None)
        a = parts["attn"](p["attn"], parts["ln1"](p["ln1"], x), causal=causal, mask=mask)
        x = ops.add(x, drop(a, key=k_attn, training=training))
        m = parts["fc2"](p["fc2"], ops.gelu(parts["fc1"](p["fc1"], parts["ln2"](p["ln2"], x))))
        return ops.add(x, drop(m, key=k_mlp, training=training))
