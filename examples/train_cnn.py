"""Train a small CNN on scikit-learn's handwritten digits with rumus_fx + optax.

The main demo: real data (bundled with scikit-learn, no download), a jitted
training step whose gradients come from rumus_fx's tape (``rf.value_and_grad``),
optax's Adam, a tqdm progress bar with the running loss, test accuracy per
epoch, a PNG of the loss/accuracy curves, and a safetensors checkpoint that is
saved and loaded back to prove the round trip.

    python examples/train_cnn.py                  # ~98-99% test accuracy
    python examples/train_cnn.py --epochs 1 --limit 256 --out /tmp/cnn   # smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/digits_cnn.py

import jax
import jax.numpy as jnp
import numpy as np
import optax
from digits_cnn import DigitsCNN, accuracy, load_digits_split, num_params
from tqdm import tqdm

import rumus_fx as rf


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=12, help="passes over the training set (default 12)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3, help="peak Adam learning rate (cosine decay)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=0, help="use only this many training images (0: all)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    p.add_argument("--no-progress", action="store_true", help="disable the progress bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()

    x_train, y_train, x_test, y_test = load_digits_split(args.seed)
    if args.limit:
        x_train, y_train = x_train[: args.limit], y_train[: args.limit]
    model = DigitsCNN()
    params, state = model.init(jax.random.key(args.seed))
    steps_per_epoch = max(len(x_train) // args.batch_size, 1)
    total_steps = steps_per_epoch * args.epochs
    schedule = optax.cosine_decay_schedule(args.lr, decay_steps=max(total_steps, 1), alpha=0.05)
    opt = optax.adam(schedule)
    opt_state = opt.init(params)
    print(
        f"digits: {len(x_train)} train / {len(x_test)} test images of 8x8; "
        f"CNN with {num_params(params):,} parameters; backend {jax.default_backend()}, "
        f"kernels {rf.kernels.backend()}"
    )

    @jax.jit
    def train_step(params, opt_state, state, x, y):
        # rf.value_and_grad records the forward pass on a tape and walks it backward;
        # under jax.jit all of that happens once, at trace time.
        (loss, new_state), grads = rf.value_and_grad(model.loss, has_aux=True)(params, state, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, new_state, loss

    predict = jax.jit(model.predict)

    rng = np.random.default_rng(args.seed)
    step_losses: list[float] = []
    epoch_losses: list[float] = []
    test_accs: list[float] = []
    bar = tqdm(total=total_steps, desc="train", unit="step", disable=args.no_progress, dynamic_ncols=True)
    for epoch in range(args.epochs):
        order = rng.permutation(len(x_train))
        losses = []
        for i in range(steps_per_epoch):
            idx = order[i * args.batch_size : (i + 1) * args.batch_size]
            params, opt_state, state, loss = train_step(params, opt_state, state, x_train[idx], y_train[idx])
            losses.append(float(loss))
            bar.update(1)
            bar.set_postfix(epoch=epoch + 1, loss=f"{losses[-1]:.4f}")
        step_losses += losses
        epoch_losses.append(float(np.mean(losses)))
        test_accs.append(accuracy(predict(params, state, x_test), y_test))
        bar.set_postfix(epoch=epoch + 1, loss=f"{epoch_losses[-1]:.4f}", test_acc=f"{test_accs[-1]:.3f}")
        bar.write(f"epoch {epoch + 1:3d}  train loss {epoch_losses[-1]:.4f}  test accuracy {test_accs[-1]:.4f}")
    bar.close()
    train_time = time.perf_counter() - t_start

    test_logits = predict(params, state, x_test)
    acc = accuracy(test_logits, y_test)
    print(f"final test accuracy: {acc:.4f} ({round(acc * len(y_test))}/{len(y_test)}) in {train_time:.1f}s")

    # checkpoint: save params + BatchNorm state, load them back into the same structure
    ckpt = os.path.join(args.out, "digits_cnn.safetensors")
    rf.nn.save(ckpt, {"params": params, "state": state}, metadata={"test_accuracy": f"{acc:.4f}"})
    like = {"params": model.init(jax.random.key(args.seed + 1))[0], "state": state}
    restored = rf.nn.load(ckpt, like=like)
    same = bool(jnp.array_equal(predict(restored["params"], restored["state"], x_test), test_logits))
    print(f"checkpoint: {ckpt} ({os.path.getsize(ckpt) / 1024:.1f} KiB); reloaded predictions identical: {same}")
    if not same:
        raise SystemExit("checkpoint round trip changed the predictions")

    plot = os.path.join(args.out, "train_cnn.png")
    save_plot(plot, step_losses, steps_per_epoch, epoch_losses, test_accs)
    print(f"plot: {plot}")
    return acc


def save_plot(path: str, step_losses, steps_per_epoch: int, epoch_losses, test_accs) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    steps = np.arange(1, len(step_losses) + 1)
    ax1.plot(steps, step_losses, lw=0.8, alpha=0.5, label="per step")
    ax1.plot(np.arange(1, len(epoch_losses) + 1) * steps_per_epoch, epoch_losses, "o-", label="epoch mean")
    ax1.set_yscale("log")
    ax1.set_xlabel("step")
    ax1.set_ylabel("cross-entropy")
    ax1.set_title("training loss")
    ax1.legend()
    ax2.plot(np.arange(1, len(test_accs) + 1), np.asarray(test_accs) * 100, "o-", color="C2")
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("accuracy (%)")
    ax2.set_title(f"test accuracy (final {test_accs[-1] * 100:.1f}%)")
    ax2.grid(alpha=0.3)
    fig.suptitle("rumus_fx: digits CNN")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
