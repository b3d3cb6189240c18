"""Data parallelism: the digits-CNN training step sharded over N devices.

Nothing in the model or the tape knows about devices. We build a mesh of N
devices with ``jax.make_mesh`` (its default ``Explicit`` axes: shardings are part
of the array types), replicate the parameters (``P()``), split the batch along
its first axis (``P("data")``) and ``jax.jit`` the very same step as
train_cnn.py; XLA inserts the all-reduces (gradient sums, BatchNorm batch
statistics). Every gradient comes back with its parameter's sharding. The
example runs the step on one device and on the mesh and checks that losses,
gradients and parameters agree. ``--auto`` uses ``AxisType.Auto`` axes instead
(XLA's partitioner chooses the shardings); the results are the same.

Multi-host: start the same script in one process per host with ``--distributed``
(``jax.distributed.initialize()``; ``--coordinator``/``--num-processes``/``--process-id``
where the environment does not describe the cluster); ``jax.devices()`` then lists
every process's devices and the mesh spans them. The model and the step do not
change; each process runs the one-device reference on one of its own devices, and
arrays spread over processes are gathered (``process_allgather``) to compare them
(tests/test_examples.py starts examples/tensor_parallel.py that way, as two
processes of 4 CPU devices on localhost).

On a CPU-only machine ``--devices 8`` sets
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before jax is imported,
which splits the host into 8 virtual devices. On a multi-GPU/TPU host the same
code runs on the real accelerators.

    python examples/data_parallel.py --devices 8
    python examples/data_parallel.py --devices 8 --steps 2 --batch-size 32   # smoke run
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/: multihost, digits_cnn

from multihost import add_distributed_args, force_host_devices  # plain python: before jax


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=8, help="devices in the mesh (virtual CPU devices if needed)")
    p.add_argument("--steps", type=int, default=5, help="training steps to compare")
    p.add_argument("--batch-size", type=int, default=64, help="global batch; must be divisible by --devices")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=1e-4, help="max abs difference accepted as identical")
    p.add_argument("--auto", action="store_true", help="Auto mesh axes instead of jax.make_mesh's Explicit default")
    add_distributed_args(p)
    return p.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()
    force_host_devices(ARGS.devices // (ARGS.num_processes or 1))  # MUST happen before the first `import jax`

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from digits_cnn import DigitsCNN, load_digits_split  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import rumus_fx as rf  # noqa: E402


def fetch(x) -> np.ndarray:
    """``x`` on the host; an array spread over several processes is gathered first."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def max_diff(a, b) -> float:
    """Largest elementwise difference of two pytrees (fetched to the host: they live on different devices)."""
    pairs = zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
    return max(float(np.max(np.abs(fetch(x) - fetch(y)))) for x, y in pairs)


def main(args: argparse.Namespace) -> float:
    if args.distributed:  # one process per host; the cluster is read from the environment
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    n = args.devices
    devices = jax.devices()
    if len(devices) < n:  # e.g. one GPU: fall back to the (forced) virtual CPU devices
        devices = jax.devices("cpu")
    if len(devices) < n:
        raise SystemExit(
            f"asked for {n} devices but only {len(devices)} exist; run this script directly (it sets XLA_FLAGS)"
        )
    if args.batch_size % n:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by --devices {n}")
    devices = devices[:n]
    print(f"{n} devices: {', '.join(str(d) for d in devices)}")

    model = DigitsCNN()
    params, state = model.init(jax.random.key(args.seed))
    # SGD with momentum: its update is linear in the gradient, so float rounding differences
    # between the two runs stay at rounding level (Adam's first steps ~ lr * sign(g) would
    # amplify a 1e-8 difference in a near-zero gradient into a full step of lr).
    opt = optax.sgd(0.02, momentum=0.9)
    opt_state = opt.init(params)

    def train_step(params, opt_state, state, x, y):
        (loss, new_state), grads = rf.value_and_grad(model.loss, has_aux=True)(params, state, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, new_state, loss, grads

    # the mesh: one axis named "data"; params replicated, the batch split along axis 0
    kind = AxisType.Auto if args.auto else AxisType.Explicit  # Explicit is jax.make_mesh's default
    mesh = jax.make_mesh((n,), ("data",), axis_types=(kind,), devices=devices)
    print(f"mesh axes: {dict(mesh.shape)} ({kind.name})")
    replicated = NamedSharding(mesh, P())
    batch_sharded = NamedSharding(mesh, P("data"))
    sharded_step = jax.jit(
        train_step,
        in_shardings=(replicated, replicated, replicated, batch_sharded, batch_sharded),
        out_shardings=replicated,
    )
    single_step = jax.jit(train_step)

    x_train, y_train, _, _ = load_digits_split(args.seed)
    rng = np.random.default_rng(args.seed)
    batches = [rng.choice(len(x_train), args.batch_size, replace=False) for _ in range(args.steps)]

    # the one-device reference run: on each process, one of its own devices
    one_dev = next(d for d in devices if d.process_index == jax.process_index())
    single = [jax.device_put(t, one_dev) for t in (params, opt_state, state)]
    multi = [jax.device_put(t, replicated) for t in (params, opt_state, state)]

    x0 = jax.device_put(x_train[batches[0]], batch_sharded)
    print(
        f"global batch {tuple(x0.shape)} -> per-device shards {[tuple(s.data.shape) for s in x0.addressable_shards][:n]}"
    )
    hlo = sharded_step.lower(*multi, x0, jax.device_put(y_train[batches[0]], batch_sharded)).compile().as_text()
    print(f"compiled sharded step: {hlo.count('all-reduce(')} all-reduce ops inserted by XLA")

    worst = 0.0
    for step, idx in enumerate(batches, 1):
        xb, yb = x_train[idx], y_train[idx]
        *single, loss_1, grads_1 = single_step(*single, jax.device_put(xb, one_dev), jax.device_put(yb, one_dev))
        *multi, loss_n, grads_n = sharded_step(
            *multi, jax.device_put(xb, batch_sharded), jax.device_put(yb, batch_sharded)
        )
        d_loss, d_grad = abs(float(loss_1) - float(loss_n)), max_diff(grads_1, grads_n)
        worst = max(worst, d_loss, d_grad)
        print(
            f"step {step}: loss 1 device {float(loss_1):.6f} | {n} devices {float(loss_n):.6f} "
            f"| max |diff| loss {d_loss:.1e}, grads {d_grad:.1e}"
        )
    same = all(
        g.sharding.is_equivalent_to(p.sharding, g.ndim) for g, p in zip(*map(jax.tree.leaves, (grads_n, multi[0])))
    )
    print(f"every gradient has its parameter's sharding: {same}")
    worst = worst if same else float("inf")
    d_params = max_diff(single[0], multi[0])
    d_state = max_diff(single[2], multi[2])
    worst = max(worst, d_params, d_state)
    print(f"after {args.steps} steps: max |diff| params {d_params:.1e}, BatchNorm state {d_state:.1e}")
    print(f"params sharding: {jax.tree_util.tree_leaves(multi[0])[0].sharding}")
    if worst > args.tol:
        raise SystemExit(f"MISMATCH: {n}-device results differ from 1 device by {worst:.2e} > {args.tol}")
    print(f"OK: {n}-device data-parallel training matches 1 device (max abs diff {worst:.1e} <= {args.tol})")
    return worst


if __name__ == "__main__":
    main(ARGS)
