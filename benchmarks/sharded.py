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
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import rumus_fx as rf

from . import models
from .compare import _interleaved

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def collectives(hlo: str) -> dict[str, int]:
    """Collective ops in a compiled HLO text (async pairs counted once)."""
    # the op itself is ` all-reduce(` (or `-start(`); its users name it as `%all-reduce`
    return {op: len(re.findall(rf" {op}(?:-start)?\(", hlo)) for op in COLLECTIVES}


def _specs(tree: Any, rule: Callable[[str, Any], P]) -> Any:
    return jax.tree_util.tree_map_with_path(lambda path, leaf: rule(jax.tree_util.keystr(path), leaf), tree)


def _mlp_tp(path: str, leaf: Any) -> P:
    layer = int(re.findall(r"\[(\d+)\]", path)[0])
    if leaf.shape[-1] % 4:  # the 10 output classes: replicated
        return P()
    if leaf.ndim == 2:
        return P(None, "model") if layer % 2 == 0 else P("model", None)
    return P("model") if layer % 2 == 0 else P()


def _gpt_tp(path: str, leaf: Any) -> P:
    if any(f"['{n}']" in path for n in ("q", "k", "v", "fc1")):
        return P(None, "model") if leaf.ndim == 2 else P("model")
    if any(f"['{n}']" in path for n in ("proj", "fc2")) and leaf.ndim == 2:
        return P("model", None)
    return P()  # embeddings, norms, row-parallel biases and the head (65 classes: not divisible by 4)


def _fsdp(path: str, leaf: Any) -> P:
    return P("data") if leaf.ndim == 2 and leaf.shape[0] % 8 == 0 else P()


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


class _placed:
    """The model's params and batch on a mesh; calling it runs a step there."""

    def __init__(self, model: models.Model, shape: tuple, axes: tuple, rule: Callable, kind: AxisType) -> None:
        self.mesh = jax.make_mesh(shape, axes, axis_types=(kind,) * len(axes))
        specs = _specs(model.params, rule)
        tree = jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda s: isinstance(s, P))
        self.shardings = jax.tree.leaves(tree)
        self.params = jax.device_put(model.params, tree)
        self.batch = jax.device_put(model.batch, NamedSharding(self.mesh, P("data")))

    def __call__(self, step: Callable) -> Any:
        with jax.set_mesh(self.mesh):
            return step(self.params, self.batch)

    def hlo(self, step: Any) -> str:
        with jax.set_mesh(self.mesh):
            return step.lower(self.params, self.batch).compile().as_text()


def main(repeats: int) -> None:
    print(f"jax {jax.__version__}, {platform.processor() or platform.machine()}, {jax.device_count()} devices")
    print("| layout | step rf / jax.grad | rf collectives | jax.grad collectives (its mesh axes) |")
    print("|---|---|---|---|")
    for name, model, shape, axes, rule, loss_rf, loss_jax in layouts():
        rf_run = _placed(model, shape, axes, rule, AxisType.Explicit)
        step_rf = jax.jit(rf.value_and_grad(loss_rf))
        v1, g1 = rf_run(step_rf)
        step_jax = jax.jit(jax.value_and_grad(loss_jax))
        try:  # jax.grad of the plain jnp model on the same Explicit mesh ...
            jax_run, kind = rf_run, "Explicit"
            v2, g2 = jax_run(step_jax)
        except Exception:  # ... which needs out_sharding annotations for tensor parallel: Auto axes then
            jax_run, kind = _placed(model, shape, axes, rule, AxisType.Auto), "Auto"
            v2, g2 = jax_run(step_jax)
        np.testing.assert_allclose(v1, v2, rtol=2e-4, atol=2e-5)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5), g1, g2)
        kept = all(g.sharding.is_equivalent_to(s, g.ndim) for g, s in zip(jax.tree.leaves(g1), rf_run.shardings))
        assert kept, f"{name}: a gradient lost its parameter's sharding"
        c_rf, c_jax = collectives(rf_run.hlo(step_rf)), collectives(jax_run.hlo(step_jax))
        t_rf, t_jax = _interleaved([functools.partial(rf_run, step_rf), functools.partial(jax_run, step_jax)], repeats)

        def fmt(c: dict[str, int]) -> str:
            return ", ".join(f"{k} {v}" for k, v in c.items() if v) or "none"

        print(
            f"| {name} | {t_rf / t_jax:.2f} ({t_rf * 1e3:.2f} / {t_jax * 1e3:.2f} ms) | {fmt(c_rf)} "
            f"| {fmt(c_jax)} ({kind}) |"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=30)
    main(p.parse_args().repeats)
