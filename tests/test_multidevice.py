"""Multi-device: rf.grad inside jax.jit over a mesh of 8 virtual CPU devices
gives the gradients of one device (and of jax.grad), on the jnp/reference
kernel path. Each check runs in a subprocess, which sets
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before importing jax.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ._subprocess import child_env

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """
import os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["RUMUS_FX_KERNELS"] = "reference"

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

jax.config.update("jax_numpy_rank_promotion", "raise")

import rumus_fx as rf
from tests.ops.optable import (
    ref_attention, ref_batch_norm, ref_conv2d, ref_cross_entropy, ref_dropout, ref_layer_norm, ref_max_pool2d,
)

assert jax.device_count() == 8, jax.devices()
assert rf.kernels.backend() == "reference"
rng = np.random.default_rng(0)


def f32(*shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


def close(a, b, tol):
    jax.tree_util.tree_map(
        lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=tol, atol=tol), a, b
    )
"""

# A CNN + attention model touching most ops (conv2d, batch_norm_2d, relu,
# max_pool2d, flatten, matmul, add_bias, gelu, layer_norm, reshape, embedding,
# dropout, scaled_dot_product_attention, an in-place mul_, mean, tanh, softmax,
# cross_entropy, mse_loss), on Auto mesh axes: batch over "data", some
# weights over "model".
AUTO_MESH = """
B = 8
params = {
    "conv_w": f32(4, 3, 3, 3, scale=0.3), "conv_b": f32(4, scale=0.1),
    "bn_w": f32(4, scale=0.1) + 1.0, "bn_b": f32(4, scale=0.1),
    "w1": f32(16, 16, scale=0.3), "b1": f32(16, scale=0.1),
    "ln_w": f32(16, scale=0.1) + 1.0, "ln_b": f32(16, scale=0.1),
    "emb": f32(10, 4, scale=0.5), "w2": f32(4, 5, scale=0.3),
}
batch = {
    "x": f32(B, 3, 6, 6), "y": jnp.asarray(rng.integers(0, 5, B), jnp.int32),
    "tok": jnp.asarray(rng.integers(0, 10, (B, 4)), jnp.int32), "target": f32(B, 4, 4),
}
KEY = jax.random.key(7)
STATS = (jnp.zeros(4, jnp.float32), jnp.ones(4, jnp.float32))


def loss_rf(p, b):
    h = rf.conv2d(b["x"], p["conv_w"], p["conv_b"], padding=1)
    h, _, _ = rf.batch_norm_2d(h, p["bn_w"], p["bn_b"], *STATS, training=True)
    h = rf.flatten(rf.max_pool2d(rf.relu(h), 3))
    h = rf.gelu(rf.add_bias(h @ p["w1"], p["b1"]))
    h = rf.layer_norm(h, p["ln_w"], p["ln_b"])
    seq = rf.dropout(rf.reshape(h, (B, 4, 4)) + rf.embedding(b["tok"], p["emb"]), 0.25, KEY)
    att = rf.scaled_dot_product_attention(seq, seq, seq, causal=True)
    att.mul_(2.0)
    pooled = rf.mean(rf.tanh(att), axis=1)
    return rf.cross_entropy(rf.softmax(pooled @ p["w2"]) * 3.0, b["y"]) + rf.mse_loss(att, b["target"]) * 0.1


def loss_ref(p, b):
    h = ref_conv2d(b["x"], p["conv_w"], p["conv_b"], 1, 1)
    h = ref_batch_norm(h, p["bn_w"], p["bn_b"], *STATS, training=True)[0]
    h = ref_max_pool2d(jax.nn.relu(h), 3).reshape(B, -1)
    h = jax.nn.gelu(h @ p["w1"] + p["b1"][None, :])
    h = ref_layer_norm(h, p["ln_w"], p["ln_b"])
    seq = ref_dropout(h.reshape(B, 4, 4) + jnp.take(p["emb"], b["tok"], axis=0), 0.25, KEY)
    att = ref_attention(seq, seq, seq, causal=True) * 2.0
    pooled = jnp.mean(jnp.tanh(att), axis=1)
    ce = ref_cross_entropy(jax.nn.softmax(pooled @ p["w2"], axis=-1) * 3.0, b["y"])
    return ce + jnp.mean((att - b["target"]) ** 2) * 0.1


def run(param_specs, batch_axis):
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    dev0 = jax.devices()[0]
    single = jax.jit(rf.grad(loss_rf))(jax.device_put(params, dev0), jax.device_put(batch, dev0))
    assert all(len(g.devices()) == 1 for g in jax.tree_util.tree_leaves(single))
    pshard = {k: NamedSharding(mesh, param_specs.get(k, P())) for k in params}
    bshard = NamedSharding(mesh, P(batch_axis))
    ps = {k: jax.device_put(v, pshard[k]) for k, v in params.items()}
    bs = {k: jax.device_put(v, bshard) for k, v in batch.items()}
    with jax.set_mesh(mesh):
        step = jax.jit(rf.value_and_grad(loss_rf), out_shardings=(NamedSharding(mesh, P()), pshard))
        value, sharded = step(ps, bs)
        ref_value, ref = jax.jit(jax.value_and_grad(loss_ref))(ps, bs)
        for k, g in sharded.items():
            assert len(g.devices()) == 8 and g.sharding.is_equivalent_to(pshard[k], g.ndim), (k, g.sharding)
        close(sharded, single, 2e-5)  # 8 devices == 1 device
        close(sharded, ref, 1e-4)  # == jax.grad of the same program in jnp
        np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-5)
        # anomaly mode: an Inf in one example's shard is reported (naming a
        # backward record) when the block exits, without hanging the devices
        bad = dict(bs, x=jax.device_put(batch["x"].at[3].set(jnp.inf), bshard))
        try:
            with rf.debug.detect_anomaly():
                g = jax.jit(rf.grad(loss_rf))(ps, bad)
        except rf.AutogradError as e:
            assert "Backward (tape index" in str(e), str(e)
        else:
            raise AssertionError("anomaly mode did not report the Inf")
        with rf.debug.detect_anomaly():  # finite inputs: nothing reported, same gradients
            close(jax.jit(rf.grad(loss_rf))(ps, bs), sharded, 2e-5)


run({"w1": P(None, "model"), "emb": P(None, "model"), "ln_w": P("model")}, "data")
run({}, ("data", "model"))
print("OK")
"""

# Explicit mesh axes (jax.make_mesh's default): a data-parallel MLP.
EXPLICIT_MESH = """
mesh = jax.make_mesh((8,), ("data",))
assert mesh.axis_types == (AxisType.Explicit,)
x, w1, w2 = f32(16, 5), f32(5, 6, scale=0.5), f32(6, 3, scale=0.5)


def loss_rf(w1, w2, x):
    return rf.mean(rf.tanh(rf.tanh(x @ w1) @ w2))


def loss_ref(w1, w2, x):
    return jnp.mean(jnp.tanh(jnp.tanh(x @ w1) @ w2))


single = jax.jit(rf.grad(loss_rf, argnums=(0, 1)))(w1, w2, x)
with jax.set_mesh(mesh):
    rep = NamedSharding(mesh, P())
    args = (jax.device_put(w1, rep), jax.device_put(w2, rep), jax.device_put(x, NamedSharding(mesh, P("data"))))
    sharded = jax.jit(rf.grad(loss_rf, argnums=(0, 1)))(*args)
    ref = jax.jit(jax.grad(loss_ref, argnums=(0, 1)))(*args)
close(sharded, single, 2e-5)
close(sharded, ref, 1e-5)
print("OK")
"""


def _run(tmp_path: Path, body: str, timeout: int = 300) -> subprocess.CompletedProcess:
    script = tmp_path / "multidevice.py"
    script.write_text(textwrap.dedent(PRELUDE) + textwrap.dedent(body))
    env = child_env()
    return subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow  # tests/test_sharding.py covers sharded gradients by default
def test_sharded_grads_match_one_device(tmp_path):
    out = _run(tmp_path, AUTO_MESH)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout[-3000:] + out.stderr[-6000:]


def test_explicit_mesh_axes_data_parallel(tmp_path):
    """Explicit axes need out_sharding on contractions over a sharded axis:
    MatmulBackward/BmmBackward pass the operands' shardings (every other op on
    Explicit axes: tests/test_sharding.py)."""
    out = _run(tmp_path, EXPLICIT_MESH)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout[-3000:] + out.stderr[-6000:]
