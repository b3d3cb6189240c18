"""Sharded training steps, rumus_fx vs jax.grad, on 8 host CPU devices.

Usage: ``python -m benchmarks.sharded [--repeats N]`` (it sets
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` itself).

For each model and layout (data parallel on ``(8,) "data"``, tensor parallel on a
2x4 ``("data", "model")`` mesh, FSDP on ``"data"``; Explicit mesh axes, as
``jax.make_mesh`` makes them) it checks that both steps give the same loss and
gradients, counts the collectives in each compiled program and checks its
all-gathers (:func:`check_gathers`: only parameter-sized arrays are gathered, never
activations, and no sharded parameter more than once per step, its gradient
aside), and reports the step time ratio rf / jax.grad (median of interleaved runs).
The last layout is the MLP written per device with ``jax.shard_map`` and
collectives, differentiated by ``rf.lift`` (Note [shard_map on the tape]).
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


_GATHER = re.compile(r"= (\(?[^=]*?) all-gather(?:-start)?\(")
_SHAPE = re.compile(r"[a-z]+\d*\[([\d,]*)\]")


def gathered(hlo: str) -> list[tuple[int, ...]]:
    """The shape of each all-gather's result in a compiled HLO text (an async
    ``all-gather-start`` returns a tuple whose last element is the result)."""
    out = []
    for m in _GATHER.finditer(hlo):
        shapes = _SHAPE.findall(m.group(1))
        if shapes:
            out.append(tuple(int(d) for d in shapes[-1].split(",") if d))
    return out


def check_gathers(name: str, hlo: str, params: Any, shardings: list[Any]) -> list[tuple[int, ...]]:
    """Assert that the step gathers no activation and no sharded parameter more
    than once: each all-gather's result is at most as large as the largest
    sharded parameter, and there are at most two all-gathers per sharded
    parameter (the parameter where it is used, its gradient in the backward;
    FSDP gathers its weights once and reduces their gradients instead)."""
    sharded = [x for x, s in zip(jax.tree.leaves(params), shardings) if not s.is_fully_replicated]
    largest = max((x.size for x in sharded), default=0)
    shapes = gathered(hlo)
    big = [g for g in shapes if int(np.prod(g)) > largest]
    assert not big, f"{name}: all-gathers larger than any sharded parameter (activations gathered): {big}"
    assert len(shapes) <= 2 * len(sharded), f"{name}: {len(shapes)} all-gathers for {len(sharded)} sharded params"
    return shapes


def block_model(batch: int = 16, seq: int = 64, d: int = 128, heads: int = 4, blocks: int = 2) -> models.Model:
    """``rf.nn.TransformerBlock`` x ``blocks`` (fused ``qkv`` projection) on
    ``[batch, seq, d]`` inputs, MSE to a target; jax.grad differentiates the same
    rf forward run as jax.numpy (no tape)."""
    layers = [rf.nn.TransformerBlock(d, heads) for _ in range(blocks)]
    keys = jax.random.split(jax.random.key(0), blocks + 2)
    params = [layer.init(k) for layer, k in zip(layers, keys)]
    x = jax.random.normal(keys[-2], (batch, seq, d))
    target = jax.random.normal(keys[-1], (batch, seq, d))

    def loss_rf(params, batch):
        h, y = batch
        for layer, p in zip(layers, params):
            h = layer(p, h, causal=True)
        return rf.mse_loss(h, y)

    def loss_jax(params, batch):
        return jax.numpy.asarray(loss_rf(params, batch))

    return models.Model(
        f"TransformerBlock d{d} h{heads} L{blocks} T{seq} b{batch}", loss_rf, loss_jax, params, (x, target)
    )


def _block_tp(path: str, leaf: Any) -> P:
    if any(f"['{n}']" in path for n in ("qkv", "fc1")):
        return P(None, "model") if leaf.ndim == 2 else P("model")
    if any(f"['{n}']" in path for n in ("proj", "fc2")) and leaf.ndim == 2:
        return P("model", None)
    return P()


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


def shard_map_mlp_loss(params: Any, batch: Any) -> Any:
    """The MLP's loss written per device with ``jax.shard_map`` (the mesh from
    ``jax.set_mesh``): layer 0 column parallel, layer 1 row parallel with an
    explicit ``psum`` over ``"model"``, the batch on ``"data"`` (``pmean``)."""

    def body(params: Any, x: Any, targets: Any) -> Any:
        h = x
        for i, layer in enumerate(params):
            h = h @ layer["weight"]
            if i == 1:
                h = jax.lax.psum(h, "model")
            h = h + layer["bias"]
            if i < len(params) - 1:
                h = jax.nn.relu(h)
        return jax.lax.pmean(models._ce_jax(h, targets), "data")

    specs = (_specs(params, _mlp_tp), P("data"), P("data"))
    return jax.shard_map(body, in_specs=specs, out_specs=P())(params, *batch)


def _gathered(loss: Callable, gather: Callable) -> Callable:
    return lambda params, batch: loss(jax.tree.map(gather, params), batch)


def layouts() -> list[tuple[str, models.Model, tuple, tuple, Callable[[str, Any], P], Callable, Callable]]:
    mlp, gpt, block = models.mlp(batch=256), models.tiny_gpt(), block_model()
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
        ("TransformerBlock (fused qkv) tensor parallel", block, *tp, _block_tp, block.loss_rf, block.loss_jax),
        (
            "MLP tensor parallel, jax.shard_map lifted",
            mlp,
            *tp,
            _mlp_tp,
            rf.lift(shard_map_mlp_loss),
            shard_map_mlp_loss,
        ),
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


def main(repeats: int, only: str | None = None) -> None:
    print(f"jax {jax.__version__}, {platform.processor() or platform.machine()}, {jax.device_count()} devices")
    print("| layout | step rf / jax.grad | rf collectives | jax.grad collectives (its mesh axes) | rf all-gathers |")
    print("|---|---|---|---|---|")
    for name, model, shape, axes, rule, loss_rf, loss_jax in layouts():
        if only and only.lower() not in name.lower():
            continue
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
        hlo_rf = rf_run.hlo(step_rf)
        shapes = check_gathers(name, hlo_rf, rf_run.params, rf_run.shardings)
        c_rf, c_jax = collectives(hlo_rf), collectives(jax_run.hlo(step_jax))
        t_rf, t_jax = _interleaved([functools.partial(rf_run, step_rf), functools.partial(jax_run, step_jax)], repeats)

        def fmt(c: dict[str, int]) -> str:
            return ", ".join(f"{k} {v}" for k, v in c.items() if v) or "none"

        gathers = ", ".join("x".join(map(str, g)) for g in shapes) or "none"
        print(
            f"| {name} | {t_rf / t_jax:.2f} ({t_rf * 1e3:.2f} / {t_jax * 1e3:.2f} ms) | {fmt(c_rf)} "
            f"| {fmt(c_jax)} ({kind}) | {gathers} |",
            flush=True,
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--only", default=None, help="run the layouts whose name contains this")
    a = p.parse_args()
    main(a.repeats, a.only)
