"""Tensor parallelism (Megatron style) plus data parallelism on a 2-D device mesh.

A small transformer language model (embedding, ``rf.nn.TransformerBlock``s, a
final layer norm and a linear head) trains on a ``(data, model)`` mesh from
``jax.make_mesh`` (Explicit axes, its default). The batch is split over
``"data"``; the weights are split over ``"model"``:

* column parallel (output features on ``"model"``): the attention's fused
  ``qkv`` projection, the MLP's ``fc1`` and the vocabulary head;
* row parallel (input features on ``"model"``): the attention's ``proj`` and the
  MLP's ``fc2`` (XLA sums their partial products over ``"model"``);
* everything else (embedding, layer norms, biases of row-parallel layers)
  replicated.

Nothing in the model code mentions devices: the shardings travel in the array
types, every rf op and backward rule keeps them, and each gradient comes back
with its parameter's sharding, so the optimizer update runs shard by shard. The
script trains the same steps on one device and checks that losses, gradients
and parameters agree.

On a CPU-only machine ``--devices 8`` sets
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before jax is imported.
On a multi-GPU/TPU host the same code runs on the accelerators; on several
hosts, start it in one process per host with ``--distributed``
(``jax.distributed.initialize()``; ``--coordinator``, ``--num-processes`` and
``--process-id`` where the environment does not describe the cluster).
tests/test_examples.py runs it as two processes of 4 CPU devices each.

    python examples/tensor_parallel.py --devices 8 --model 4
    python examples/tensor_parallel.py --devices 8 --model 4 --steps 2   # smoke run
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/: multihost, digits_cnn

from multihost import add_distributed_args, force_host_devices  # plain python: before jax


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=8, help="devices in the mesh (virtual CPU devices if needed)")
    p.add_argument("--model", type=int, default=4, help="size of the 'model' mesh axis (must divide --devices)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8, help="global batch; divisible by devices // model")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=1e-4, help="max abs difference accepted as identical")
    add_distributed_args(p)
    return p.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()
    force_host_devices(ARGS.devices // (ARGS.num_processes or 1))  # MUST happen before the first `import jax`

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import rumus_fx as rf  # noqa: E402


class TinyLM:
    """Embedding -> TransformerBlock x layers -> LayerNorm -> Linear head (next-token loss)."""

    def __init__(self, vocab: int, seq: int, dim: int, heads: int, layers: int) -> None:
        self.embed = rf.nn.Embedding(vocab, dim)
        self.pos = rf.nn.Embedding(seq, dim)
        self.blocks = [rf.nn.TransformerBlock(dim, heads) for _ in range(layers)]
        self.norm = rf.nn.LayerNorm(dim)
        self.head = rf.nn.Linear(dim, vocab)

    def init(self, key: jax.Array) -> dict:
        k = jax.random.split(key, 4 + len(self.blocks))
        return {
            "embed": self.embed.init(k[0]),
            "pos": self.pos.init(k[1]),
            "blocks": [b.init(kb) for b, kb in zip(self.blocks, k[4:])],
            "norm": self.norm.init(k[2]),
            "head": self.head.init(k[3]),
        }

    def loss(self, params: dict, tokens: jax.Array, targets: jax.Array) -> rf.Tensor:
        positions = np.arange(tokens.shape[1])
        h = self.embed(params["embed"], tokens) + self.pos(params["pos"], positions)
        for block, p in zip(self.blocks, params["blocks"]):
            h = block(p, h, causal=True)
        return rf.cross_entropy(self.head(params["head"], self.norm(params["norm"], h)), targets)


def megatron_spec(path: str, leaf: jax.Array) -> P:
    """The PartitionSpec of one parameter, from its path in the params tree."""
    column = any(f"['{n}']" in path for n in ("qkv", "fc1", "head"))
    row = any(f"['{n}']" in path for n in ("proj", "fc2"))
    if column:  # [in, out] weight and [out] bias: the output features on "model"
        return P(None, "model") if leaf.ndim == 2 else P("model")
    if row and leaf.ndim == 2:  # [in, out] weight: the input features on "model"
        return P("model", None)
    return P()


def fetch(x) -> np.ndarray:
    """``x`` on the host; an array spread over several processes is gathered first."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def max_diff(a, b) -> float:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b))
    return max(float(np.max(np.abs(fetch(x) - fetch(y)))) for x, y in pairs)


def main(args: argparse.Namespace) -> float:
    if args.distributed:  # one process per host; the cluster is read from the environment
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    n, m = args.devices, args.model
    if n % m or args.batch_size % (n // m):
        raise SystemExit(f"--model {m} must divide --devices {n}, and devices // model must divide --batch-size")
    devices = jax.devices()
    if len(devices) < n:
        devices = jax.devices("cpu")
    if len(devices) < n:
        raise SystemExit(f"asked for {n} devices but only {len(devices)} exist; run this script directly")
    mesh = jax.make_mesh((n // m, m), ("data", "model"), devices=devices[:n])  # Explicit axes (the default)
    print(f"mesh: {dict(mesh.shape)}, axis types {[t.name for t in mesh.axis_types]}")

    model = TinyLM(args.vocab, args.seq, args.dim, args.heads, args.layers)
    params = model.init(jax.random.key(args.seed))
    specs = jax.tree_util.tree_map_with_path(lambda path, x: megatron_spec(jax.tree_util.keystr(path), x), params)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))
    opt = optax.sgd(0.1, momentum=0.9)

    def train_step(params, opt_state, tokens, targets):
        loss, grads = rf.value_and_grad(model.loss)(params, tokens, targets)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    step = jax.jit(train_step)
    rng = np.random.default_rng(args.seed)
    data = rng.integers(0, args.vocab, (args.steps, args.batch_size, args.seq + 1)).astype(np.int32)
    batch = NamedSharding(mesh, P("data"))

    one_dev = next(d for d in devices if d.process_index == jax.process_index())  # this process's own
    single_params = jax.device_put(params, one_dev)
    single = (single_params, opt.init(single_params))
    multi_params = jax.device_put(params, shardings)
    multi = (multi_params, opt.init(multi_params))
    w = multi_params["blocks"][0]["fc1"]["weight"]
    print(
        f"fc1 weight {tuple(w.shape)} {w.sharding.spec}: per-device shard {tuple(w.addressable_shards[0].data.shape)}"
    )

    tok0, tgt0 = jax.device_put(data[0, :, :-1], batch), jax.device_put(data[0, :, 1:], batch)
    hlo = step.lower(*multi, tok0, tgt0).compile().as_text()
    counts = {op: len(re.findall(rf"= \S+ {op}\(", hlo)) for op in ("all-reduce", "all-gather", "reduce-scatter")}
    print(f"compiled sharded step: {counts}")

    worst = 0.0
    for i in range(args.steps):
        tok, tgt = data[i, :, :-1], data[i, :, 1:]
        *single, loss_1, grads_1 = step(*single, jax.device_put(tok, one_dev), jax.device_put(tgt, one_dev))
        *multi, loss_n, grads_n = step(*multi, jax.device_put(tok, batch), jax.device_put(tgt, batch))
        d_loss, d_grad = abs(float(loss_1) - float(loss_n)), max_diff(grads_1, grads_n)
        worst = max(worst, d_loss, d_grad)
        print(f"step {i + 1}: loss 1 device {float(loss_1):.6f} | mesh {float(loss_n):.6f} | grads diff {d_grad:.1e}")
    kept = all(
        g.sharding.is_equivalent_to(s, g.ndim) for g, s in zip(jax.tree.leaves(grads_n), jax.tree.leaves(shardings))
    )
    print(f"every gradient has its parameter's sharding: {kept}")
    d_params = max_diff(single[0], multi[0])
    worst = max(worst, d_params) if kept else float("inf")
    if worst > args.tol:
        raise SystemExit(f"MISMATCH: mesh results differ from 1 device by {worst:.2e} > {args.tol}")
    print(f"OK: tensor-parallel training matches 1 device (max abs diff {worst:.1e} <= {args.tol})")
    return worst


if __name__ == "__main__":
    main(ARGS)
