"""Real users' models through ``rf.lift``: rf against ``jax.grad`` in one process.

Usage: ``python -m benchmarks.zoo [--models resnet18,mlp,...] [--repeats N] [--runs R]``

Each model is written as its library's users write it (haiku, flax linen,
equinox, diffrax, and the LLaMA example's plain-JAX path); its loss is
differentiated twice, as ``rf.value_and_grad(rf.lift(loss))`` and as
``jax.value_and_grad(loss)``. The two are first checked to agree (every
gradient leaf within a relative 1e-3 of its own scale in float32), then compared:

- jit step: median of interleaved calls of the two compiled steps;
- first call: trace + compile + one run of a fresh ``jax.jit`` (median of 3);
- temp memory: ``compiled.memory_analysis().temp_size_in_bytes``;
- eager step: the un-jitted calls, interleaved.

Ratios are rf / jax.grad (below 1.00: rf faster or smaller). With ``--runs R``
the whole measurement is repeated R times and each ratio is shown as the median
with its range over the runs: a 2-core shared machine moves single readings by
10 % or more. The libraries come with the ``bench`` extra.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import rumus_fx as rf

from .compare import _block, _interleaved


@dataclasses.dataclass
class ZooModel:
    name: str
    library: str
    loss: Callable[..., Any]  # plain JAX loss: (params, *data) -> scalar
    args: tuple  # (params, *data); the gradient is taken w.r.t. params


# ---------------------------------------------------------------------------
# the models, as their libraries' users write them
# ---------------------------------------------------------------------------


def haiku_resnet18() -> ZooModel:
    import haiku as hk

    def forward(x: jax.Array) -> jax.Array:
        return hk.nets.ResNet18(num_classes=10, resnet_v2=False)(x, is_training=True)

    net = hk.transform_with_state(forward)
    x = jax.random.normal(jax.random.key(0), (4, 32, 32, 3))
    y = jax.random.randint(jax.random.key(1), (4,), 0, 10)
    params, state = net.init(jax.random.key(2), x)
    # haiku zero-initialises the final layer; random weights make every gradient non-trivial
    params = jax.tree_util.tree_map(
        lambda p: p if np.any(np.asarray(p)) else 0.05 * jax.random.normal(jax.random.key(3), p.shape), params
    )

    def loss(params: Any, state: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        logits, _ = net.apply(params, state, None, x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    return ZooModel("haiku ResNet18 (batch norm, training) [4,32,32,3]", "haiku", loss, (params, state, x, y))


def haiku_mlp() -> ZooModel:
    import haiku as hk

    net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([256, 256, 10])(x)))
    x = jax.random.normal(jax.random.key(0), (64, 128))
    y = jax.random.randint(jax.random.key(1), (64,), 0, 10)
    params = net.init(jax.random.key(2), x)

    def loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        logits = net.apply(params, x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    return ZooModel("haiku MLP 128-256-256-10, batch 64", "haiku", loss, (params, x, y))


def flax_transformer() -> ZooModel:
    import flax.linen as nn

    class Block(nn.Module):
        dim: int = 64
        heads: int = 4

        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            h = nn.LayerNorm()(x)
            h = nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=nn.make_causal_mask(x[..., 0]))
            x = x + h
            h = nn.LayerNorm()(x)
            h = nn.Dense(4 * self.dim)(h)
            return x + nn.Dense(self.dim)(nn.gelu(h))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            for _ in range(2):
                x = Block()(x)
            return x

    model = Model()
    x = jax.random.normal(jax.random.key(0), (4, 32, 64))
    params = model.init(jax.random.key(1), x)

    def loss(params: Any, x: jax.Array) -> jax.Array:
        return jnp.mean(jnp.square(model.apply(params, x) - x))

    return ZooModel("flax linen transformer block x2, [4,32,64]", "flax", loss, (params, x))


def equinox_gru() -> ZooModel:
    import equinox as eqx

    cell = eqx.nn.GRUCell(16, 32, key=jax.random.key(0))
    head = eqx.nn.Linear(32, 1, key=jax.random.key(1))
    model = (cell, head)
    xs = jax.random.normal(jax.random.key(2), (64, 8, 16))  # [time, batch, features]
    ys = jax.random.normal(jax.random.key(3), (8,))
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(params: Any, xs: jax.Array, ys: jax.Array) -> jax.Array:
        cell, head = eqx.combine(params, static)

        def step(h: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
            return jax.vmap(cell)(x, h), None

        h, _ = jax.lax.scan(step, jnp.zeros((xs.shape[1], 32)), xs)
        return jnp.mean((jax.vmap(head)(h)[:, 0] - ys) ** 2)

    return ZooModel("equinox GRUCell over lax.scan, 64 steps, batch 8", "equinox", loss, (params, xs, ys))


def equinox_mlp() -> ZooModel:
    import equinox as eqx

    model = eqx.nn.MLP(128, 10, 256, depth=2, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    x = jax.random.normal(jax.random.key(1), (64, 128))
    y = jax.random.randint(jax.random.key(2), (64,), 0, 10)

    def loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        logits = jax.vmap(eqx.combine(params, static))(x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    return ZooModel("equinox MLP 128-256-256-10, batch 64", "equinox", loss, (params, x, y))


def llama() -> ZooModel:
    from examples import train_llama as ll

    cfg = ll.Config(vocab=64, block=32, dim=64, heads=4, layers=2)
    params = ll.init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (4, cfg.block), 0, cfg.vocab)
    targets = jnp.roll(tokens, -1, axis=1)

    def loss(params: Any, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        return ll.loss_fn(params, tokens, targets, cfg, ops=ll.JAX_OPS, remat=True)

    return ZooModel(
        "LLaMA example (plain JAX path), 2 layers, dim 64, [4,32]", "examples", loss, (params, tokens, targets)
    )


def diffrax_ode() -> ZooModel:
    import diffrax

    w0 = 0.5 * jax.random.normal(jax.random.key(0), (4, 4))
    y0 = jnp.ones(4)

    def loss(w: jax.Array, y0: jax.Array) -> jax.Array:
        term = diffrax.ODETerm(lambda t, y, w: jnp.tanh(w @ y))
        sol = diffrax.diffeqsolve(term, diffrax.Tsit5(), 0.0, 1.0, 0.1, y0, args=w, saveat=diffrax.SaveAt(t1=True))
        return jnp.sum(sol.ys**2)

    return ZooModel("diffrax Tsit5 ODE, 4 states, 10 steps (RecursiveCheckpointAdjoint)", "diffrax", loss, (w0, y0))


MODELS: dict[str, Callable[[], ZooModel]] = {
    "resnet18": haiku_resnet18,
    "haiku_mlp": haiku_mlp,
    "transformer": flax_transformer,
    "gru": equinox_gru,
    "eqx_mlp": equinox_mlp,
    "llama": llama,
    "diffrax": diffrax_ode,
}


# ---------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------


def steps(model: ZooModel) -> tuple[Callable, Callable]:
    """(rf, jax.grad) value-and-grad functions of ``model.loss`` w.r.t. its params."""
    return rf.value_and_grad(rf.lift(model.loss)), jax.value_and_grad(model.loss)


def check_same(model: ZooModel, rtol: float = 1e-3) -> float:
    """Assert rf and jax.grad agree (jit); returns the largest relative error,
    each gradient leaf against its own largest magnitude (floored at 1e-5 of the
    largest gradient of all: a leaf whose true gradient is zero, such as an
    attention key's bias, holds only round-off in both)."""
    vg_rf, vg_j = steps(model)
    v_rf, g_rf = jax.jit(vg_rf)(*model.args)
    v_j, g_j = jax.jit(vg_j)(*model.args)
    np.testing.assert_allclose(v_rf, v_j, rtol=rtol, atol=rtol)
    worst = 0.0
    leaves_j = [np.asarray(b, np.float64) for b in jax.tree_util.tree_leaves(g_j)]
    floor = 1e-5 * max(float(np.max(np.abs(b))) for b in leaves_j)
    for a, b in zip(jax.tree_util.tree_leaves(g_rf), leaves_j, strict=True):
        a = np.asarray(a, np.float64)
        scale = max(float(np.max(np.abs(b))), floor, 1e-30)
        worst = max(worst, float(np.max(np.abs(a - b))) / scale)
    if worst > rtol:
        raise AssertionError(f"{model.name}: rf and jax.grad differ, relative error {worst:.2e}")
    return worst


def _first_call(fun: Callable, args: tuple) -> float:
    wrapped = jax.jit(lambda *a: fun(*a))  # a fresh function: no cache reused
    t0 = time.perf_counter()
    _block(wrapped(*args))
    return time.perf_counter() - t0


def measure(model: ZooModel, repeats: int = 15, eager_repeats: int = 3) -> dict[str, Any]:
    args = model.args
    vg_rf, vg_j = steps(model)
    first_rf, first_j = [], []
    for _ in range(3):
        first_rf.append(_first_call(vg_rf, args))
        first_j.append(_first_call(vg_j, args))
    comp_rf = jax.jit(vg_rf).lower(*args).compile()
    comp_j = jax.jit(vg_j).lower(*args).compile()
    mem_rf = comp_rf.memory_analysis().temp_size_in_bytes
    mem_j = comp_j.memory_analysis().temp_size_in_bytes
    jit_rf, jit_j = jax.jit(vg_rf), jax.jit(vg_j)
    t_rf, t_j = _interleaved([lambda: jit_rf(*args), lambda: jit_j(*args)], repeats)
    e_rf, e_j = _interleaved([lambda: vg_rf(*args), lambda: vg_j(*args)], eager_repeats, warmup=2)
    return {
        "jit_ratio": t_rf / t_j,
        "jit_jax_ms": 1e3 * t_j,
        "first_ratio": statistics.median(first_rf) / statistics.median(first_j),
        "first_jax_s": statistics.median(first_j),
        "mem_ratio": mem_rf / mem_j if mem_j else float("nan"),
        "mem_jax": mem_j,
        "mem_rf": mem_rf,
        "eager_ratio": e_rf / e_j,
        "eager_jax_ms": 1e3 * e_j,
    }


def _spread(values: list[float]) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.2f}"
    return f"{med:.2f} ({min(values):.2f}-{max(values):.2f})"


def format_table(rows: list[tuple[ZooModel, list[dict[str, Any]] | str]]) -> str:
    lines = [
        "| model | library | jit step | first call | temp memory | eager step | jax.grad jit step |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, runs in rows:
        if isinstance(runs, str):
            lines.append(f"| {model.name} | {model.library} | {runs} | | | | |")
            continue
        col = {k: _spread([r[k] for r in runs]) for k in ("jit_ratio", "first_ratio", "mem_ratio", "eager_ratio")}
        mem = runs[0]
        lines.append(
            f"| {model.name} | {model.library} | {col['jit_ratio']} | {col['first_ratio']} | "
            f"{col['mem_ratio']} ({mem['mem_rf'] / 2**20:.1f} / {mem['mem_jax'] / 2**20:.1f} MiB) | "
            f"{col['eager_ratio']} | {statistics.median(r['jit_jax_ms'] for r in runs):.2f} ms |"
        )
    return "\n".join(lines)


def versions() -> str:
    import importlib.metadata as md

    libs = []
    for dist in ("jax", "flax", "dm-haiku", "equinox", "diffrax"):
        try:
            libs.append(f"{dist} {md.version(dist)}")
        except md.PackageNotFoundError:
            libs.append(f"{dist} not installed")
    return f"{platform.machine()} {platform.processor() or ''} python {platform.python_version()}; " + ", ".join(libs)


def main(argv: list[str] | None = None) -> list[tuple[ZooModel, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {','.join(MODELS)}")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved jit calls per run")
    parser.add_argument("--runs", type=int, default=1, help="whole measurements per model (spread)")
    ns = parser.parse_args(argv)
    rows: list[tuple[ZooModel, Any]] = []
    for key in ns.models.split(","):
        model = MODELS[key]()
        try:
            err = check_same(model)
        except Exception as e:  # a model rf cannot differentiate is a row, not a crash
            traceback.print_exc(file=sys.stderr)
            rows.append((model, f"fails: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"))
            print(f"{model.name}: FAILS ({type(e).__name__})", flush=True)
            continue
        runs = [measure(model, ns.repeats) for _ in range(ns.runs)]
        print(
            f"{model.name}: same gradients (max rel. error {err:.1e}); jit {_spread([r['jit_ratio'] for r in runs])}",
            flush=True,
        )
        rows.append((model, runs))
    print()
    print(f"rf.value_and_grad(rf.lift(loss)) / jax.value_and_grad(loss), medians (range over {ns.runs} runs)")
    print(versions())
    print(format_table(rows))
    return rows


if __name__ == "__main__":  # pragma: no cover
    main()
