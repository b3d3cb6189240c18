"""The op table that drives the op test-suite (PyTorch OpInfo style), derived
from the op declarations (Note [Declaring an op] in rumus_fx/autograd/registry.py).

Each entry: the rf op, an independent ``jax.numpy`` oracle with the same call
signature, a sample generator (odd, non-power-of-two shapes included), which
arguments are differentiable, and the record names the op may append. Adding
an op = one ``@op(...)`` declaration next to its forward in rumus_fx/ops/; this
module only reads the registry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

import rumus_fx as rf  # noqa: F401  (imports every op module: their declarations)
from rumus_fx.autograd.registry import OpDecl, Sample, declarations
from rumus_fx.ops._declare import away_from_zero, normal, positive, ranked  # noqa: F401
from rumus_fx.ops.attention import ref_attention  # noqa: F401  (oracles other suites use)
from rumus_fx.ops.conv import ref_adaptive_avg_pool2d, ref_conv2d, ref_im2col, ref_max_pool2d  # noqa: F401
from rumus_fx.ops.dropout import ref_dropout  # noqa: F401
from rumus_fx.ops.loss import ref_cross_entropy  # noqa: F401
from rumus_fx.ops.norm import ref_batch_norm, ref_layer_norm  # noqa: F401

__all__ = ["OPS", "OpInfo", "Sample", "by_name", "table"]


@dataclasses.dataclass(frozen=True)
class OpInfo:
    name: str
    op: Callable
    ref: Callable
    samples: Callable[[np.random.Generator], list[Sample]]
    records: tuple[str, ...]
    # picks the differentiable output from the op's result (e.g. y of batch_norm)
    output: Callable[[Any], Any] = lambda out: out
    rtol32: float = 2e-5
    atol32: float = 2e-5
    fd_tol: float = 1e-6
    # pytest marks for every case of this op (e.g. ``(pytest.mark.slow,)``)
    marks: tuple[Any, ...] = ()

    def __str__(self) -> str:
        return self.name

    @classmethod
    def of(cls, d: OpDecl) -> OpInfo:
        kw: dict[str, Any] = {} if d.output is None else {"output": d.output}
        kw["marks"] = tuple(d.extra.get("marks", ()))
        return cls(
            d.name, d.op, d.ref, d.samples, d.record_names, rtol32=d.rtol32, atol32=d.atol32, fd_tol=d.fd_tol, **kw
        )


def table() -> list[OpInfo]:
    """Every declared fused op that has samples (read from the registry now)."""
    return [OpInfo.of(d) for d in declarations("op") if d.samples is not None]


OPS: list[OpInfo] = table()


def by_name(name: str) -> OpInfo:
    for info in OPS:
        if info.name == name:
            return info
    raise KeyError(name)
