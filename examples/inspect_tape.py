"""Look inside the tape of one digits-CNN training step, then break it on purpose.

rumus_fx records one explicit backward record per op. With the imperative
``rf.Tape`` API you can print what was recorded (record types, tensor ids,
shapes, and the bytes each record keeps alive for backward) before running
``tape.backward``.

Second part: every storage has a version counter, and records snapshot the
versions of the tensors whose data their backward reads. Modifying such a
tensor in place between forward and backward (here: "normalising" the input
batch under ``rf.no_grad()``) is caught as ``rf.VersionMismatch`` instead of
silently producing wrong gradients.

    python examples/inspect_tape.py
    python examples/inspect_tape.py --batch-size 4
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/digits_cnn.py

import jax
import jax.numpy as jnp
from digits_cnn import DigitsCNN, load_digits_split

import rumus_fx as rf


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    x_train, y_train, _, _ = load_digits_split(args.seed)
    xb, yb = x_train[: args.batch_size], y_train[: args.batch_size]
    model = DigitsCNN()
    params, state = model.init(jax.random.key(args.seed))

    # --- 1. record one step and print the tape -------------------------------
    with rf.Tape() as tape:
        # leaves we want gradients for: tracked tensors (rf.grad does this for you)
        tracked = jax.tree_util.tree_map(lambda a: rf.tensor(a, requires_grad=True), params)
        x = rf.tensor(xb)  # the input batch: an untracked tensor with its own storage
        loss, _ = model.loss(tracked, state, x, yb)

    print(f"one training step on a batch of {args.batch_size}: loss {float(loss):.4f}\n")
    print(tape)
    print(f"\nlen(tape) = {len(tape)}, tape.saved_bytes = {tape.saved_bytes:,}")
    print("saved bytes by record type:")
    for name, nbytes in tape.saved_bytes_by_record().items():
        print(f"  {name:<24} {nbytes:>10,}")

    grads = tape.backward(loss)
    g = grads[tracked["conv0"]["weight"]]
    print(f"\ngrads[conv0.weight]: shape {g.shape}, norm {float(jnp.linalg.norm(g)):.4f}")

    # --- 2. an in-place write between forward and backward ------------------
    print("\n--- modifying a saved input in place before backward ---")
    with rf.Tape() as tape:
        tracked = jax.tree_util.tree_map(lambda a: rf.tensor(a, requires_grad=True), params)
        x = rf.tensor(xb)
        loss, _ = model.loss(tracked, state, x, yb)
    print(f"x.version after forward: {x.version}")
    with rf.no_grad():
        x.mul_(2.0)  # "rescale the batch for the next step" -- but conv0's record saved x for backward
    print(f"x.version after x.mul_(2.0) under rf.no_grad(): {x.version}")
    try:
        tape.backward(loss)
    except rf.VersionMismatch as e:
        print(f"caught rf.VersionMismatch: {e}")
        what = "the input batch x (untracked)" if e.grad_id is None else f"tensor {e.grad_id}"
        print(
            f"  -> record {e.op} saved {what} at version {e.expected}, but its storage is now at "
            f"version {e.found}.\n     Its backward would have used the modified data and returned wrong "
            "gradients, so rumus_fx refuses. Fix: modify a copy (x * 2.0) or only after backward."
        )
    else:
        raise SystemExit("expected rf.VersionMismatch")


if __name__ == "__main__":
    main()
