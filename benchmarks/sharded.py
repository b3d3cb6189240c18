"""Sharded training steps, rumus_fx vs jax.grad, on 8 host CPU devices.

Usage: ``python -m benchmarks.sharded [--repeats N]`` (it sets
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` itself).

For each model and layout (data parallel on ``(8,) "data"``, tensor parallel on a
2x4 ``("data", "model")`` mesh, FSDP on ``"data"``; Explicit mesh axes, as
``jax.make_mesh`` makes them) it checks that both steps give the same loss and
gradients, counts the collectives in each compiled program (``all-gather`` of a
sharded weight is what FSDP pays; data/tensor parallel should not gather weights)
and reports the step time ratio rf / jax.grad (median of interleaved runs).
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import functools
import platform
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rumus_fx as rf

from . import models
from .compare import _interleaved

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def collectives(hlo: str) -> dict[str, int]:
    """Collective ops in a compiled HLO text (async pairs counted once)."""
    return {op: len(re.findall(rf"= [^=\n]* {op}(?:-start)?\(", hlo)) for op in COLLECTIVES}


def _specs(tree: Any, rule: Callable[[str, Any], P]) -> Any:
    return jax.tree_util.tree_map_with_path(lambda path, leaf: rule(jax.tree_util.keystr(path), leaf), tree)


def _mlp_tp(path: str, leaf: Any) -> P:
    layer = int(re.findall(r"\[(\d+)\]", path)[0])
    if leaf.ndim == 2:
        return P(None, "model") if layer % 2 == 0 else P("model", None)
    return P("model") if layer % 2 == 0 else P()


def _gpt_tp(path: str, leaf: Any) -> P:
    if any(f"['{n}']" in path for n in ("q", "k", "v", "fc1")):
        return P(None, "model") if leaf.ndim == 2 else P("model")
    if any(f"['{n}']" in path for n in ("proj", "fc2")) and leaf.ndim == 2:
        return P("model", None)
    if "['head']" in path:
        return P(None, "model")
    return P()


def _fsdp(path: str, leaf: Any) -> P:
    return P("data") if leaf.ndim == 2 else P()


def _gathered(loss: Callable, gather: Callable) -> Callable:
    return lambda params, batch: loss(jax.tree.map(gather, params), batch)


def layouts() -> list[tuple[str, models.Model, tuple, tuple, Callable[[str, Any], P], Callable, Callable]]:
    mlp, gpt = models.mlp(batch=256), models.tiny_gpt()
    rep = lambda path, leaf: P()  # noqa: E731
    fsdp_rf = _gathered(gpt.loss_rf, lambda w: rf.reshard(w, P()))
    fsdp_jax = _gathered(gpt.loss_jax, lambda w: jax.sharding.reshard(w, P()))
    dp, tp = ((8,), ("data",)), ((2, 4), ("data", "model"))
    return [
        ("MLP data parallel", mlp, *dp, rep, mlp.loss_rf, mlp.loss_jax),
        ("MLP tensor parallel", mlp, *tp, _mlp_tp, mlp.loss_rf, mlp.loss_jax),
        ("TinyGPT data parallel", gpt, *dp, rep, gpt.loss_rf, gpt.loss_jax),
        ("TinyGPT tensor parallel", gpt, *tp, _gpt_tp, gpt.loss_rf, gpt.loss_jax),
        ("TinyGPT FSDP", gpt, *dp, _fsdp, fsdp_rf, fsdp_jax),
    ]


def main(repeats: int) -> None:
    print(f"jax {jax.__version__}, {platform.processor() or platform.machine()}, {jax.device_count()} devices")
    print("| layout | step rf / jax.grad | rf collectives | jax.grad collectives |")
    print("|---|---|---|---|")
    for name, model, shape, axes, rule, loss_rf, loss_jax in layouts():
        mesh = jax.make_mesh(shape, axes)
        shardings = jax.tree.map(
            lambda s, m=mesh: NamedSharding(m, s), _specs(model.params, rule), is_leaf=lambda s: isinstance(s, P)
        )
        params = jax.device_put(model.params, shardings)
        batch = jax.device_put(model.batch, NamedSharding(mesh, P("data")))
        with jax.set_mesh(mesh):
            step_rf = jax.jit(rf.value_and_grad(loss_rf))
            step_jax = jax.jit(jax.value_and_grad(loss_jax))
            (v1, g1), (v2, g2) = step_rf(params, batch), step_jax(params, batch)
            np.testing.assert_allclose(v1, v2, rtol=2e-4, atol=2e-5)
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5), g1, g2)
            same = all(a.sharding.is_equivalent_to(b.sharding, a.ndim) for a, b in zip(*map(jax.tree.leaves, (g1, g2))))
            assert same, f"{name}: gradient shardings differ from jax.grad's"
            c_rf = collectives(step_rf.lower(params, batch).compile().as_text())
            c_jax = collectives(step_jax.lower(params, batch).compile().as_text())
            runs = [functools.partial(step_rf, params, batch), functools.partial(step_jax, params, batch)]
            t_rf, t_jax = _interleaved(runs, repeats)

        def fmt(c: dict[str, int]) -> str:
            return ", ".join(f"{k} {v}" for k, v in c.items() if v) or "none"

        print(f"| {name} | {t_rf / t_jax:.2f} ({t_rf * 1e3:.2f} / {t_jax * 1e3:.2f} ms) | {fmt(c_rf)} | {fmt(c_jax)} |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=30)
    main(p.parse_args().repeats)
