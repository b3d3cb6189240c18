"""The Pallas path on sharded inputs: 8 host devices in a subprocess (the
device count is fixed when jax starts), kernels in interpret mode, meshes with
``Auto`` axes (``custom_partitioning``) and ``Explicit`` axes (``shard_map``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from .._subprocess import child_env

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import rumus_fx as rf
    from rumus_fx.kernels import attention, embedding, layer_norm, matmul, softmax

    jax.config.update("jax_numpy_rank_promotion", "raise")
    assert jax.device_count() == 8
    r = np.random.default_rng(0)
    x, w, g = r.standard_normal((8, 6, 16)), r.standard_normal(16), r.standard_normal((8, 6, 16))
    a, b = r.standard_normal((8, 6, 16)), r.standard_normal((16, 5))
    q = r.standard_normal((8, 2, 6, 8))
    ids, rows = np.arange(16) % 5, r.standard_normal((16, 8))
    x, w, g, a, b, q, rows = (jnp.asarray(v, jnp.float32) for v in (x, w, g, a, b, q, rows))

    def ln_grads(x, w):
        return rf.grad(lambda x, w: rf.sum(rf.mul(rf.layer_norm(x, w, None), g)), argnums=(0, 1))(x, w)

    def attn_grad(q):
        return rf.grad(lambda q: rf.sum(rf.scaled_dot_product_attention(q, q, q, causal=True)))(q)

    programs = {
        "softmax": (lambda x: softmax.softmax_fwd(x), (x,)),
        "vmap_softmax": (jax.vmap(lambda x: softmax.softmax_fwd(x)), (x,)),
        "layer_norm_grads": (ln_grads, (x, w)),
        "matmul": (lambda a, b: matmul.matmul(a, b), (a, b)),
        "attention": (lambda q: attention.attention_fwd(q, q, q, None, causal=True, scale=0.3), (q,)),
        "attention_grad": (attn_grad, (q,)),
        "embedding_bwd": (lambda i, g: embedding.embedding_bwd(i, g, 5), (jnp.asarray(ids), rows)),
    }
    specs = {"softmax": [P("a", "b")], "vmap_softmax": [P("a", "b")], "layer_norm_grads": [P("a", "b"), P()],
             "matmul": [P("a"), P()], "attention": [P("a", "b")], "attention_grad": [P("a", "b")],
             "embedding_bwd": [P("a"), P("a")]}

    with rf.kernels.use("reference"):
        want = {k: jax.jit(f)(*args) for k, (f, args) in programs.items()}

    for kind in (AxisType.Auto, AxisType.Explicit):
        mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(kind, kind))
        with jax.set_mesh(mesh), rf.kernels.use("interpret"):
            for name, (f, args) in programs.items():
                sharded = [jax.device_put(v, NamedSharding(mesh, s)) for v, s in zip(args, specs[name])]
                got = jax.jit(f)(*sharded)
                np.testing.assert_allclose(
                    np.concatenate([np.ravel(t) for t in jax.tree.leaves(got)]),
                    np.concatenate([np.ravel(t) for t in jax.tree.leaves(want[name])]),
                    rtol=2e-5, atol=2e-5, err_msg=f"{kind} {name}")
                if name == "softmax":
                    assert "pallas_call" in str(jax.make_jaxpr(f)(*sharded))
                    assert got.sharding.spec[:2] == ("a", "b"), got.sharding
                    hlo = jax.jit(f).lower(*sharded).compile().as_text()
                    assert "all-gather" not in hlo, "the kernel should run on local shards"
                if name == "layer_norm_grads":
                    assert "all-reduce" in jax.jit(f).lower(*sharded).compile().as_text()
            print("ok", kind.name)
    """
)


def test_kernels_on_a_sharded_mesh():
    env = child_env(devices=8, JAX_PLATFORMS="cpu")
    env.pop("RUMUS_FX_KERNELS", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.split() == ["ok", "Auto", "ok", "Explicit"]
