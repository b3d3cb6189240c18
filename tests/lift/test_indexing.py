"""Indexing and sorting rules of ``rf.lift`` beyond the primitive table (the cases
without a gradient are declared error cases of their rules, run by the error
audit): ``sort``/``top_k`` save only what they need."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import rumus_fx as rf

IDX = jnp.array([0, 2, 2])


def _grad(f, *args, argnums=0):
    return rf.grad(lambda *a: rf.sum(rf.lift(f)(*a)), argnums=argnums)(*args)


def test_scatter_mul_operand_gradient_with_repeated_indices():
    """The updates' gradient raises here (a declared error case of the
    'scatter-mul' rule, run by tests/test_errors_audit.py); the operand's is defined."""
    x, u = jnp.ones((4, 2)), jnp.full((3, 2), 2.0)
    g = _grad(lambda x, u: x.at[IDX].multiply(u), x, u, argnums=0)
    np.testing.assert_allclose(g, [[2, 2], [1, 1], [4, 4], [1, 1]])


def _residual_bytes(f, *args):
    with rf.Tape() as tape:
        ts = [rf.tensor(a, requires_grad=True) for a in args]
        rf.lift(f)(*ts)
    (entry,) = tape.entries
    return sum(int(np.asarray(r).nbytes) for r in entry.op.residuals)


def test_argsort_saves_only_the_keys():
    x = jnp.arange(12.0).reshape(3, 4)[::-1]
    # the keys (float32) and nothing else: not the iota, not the sorted outputs
    assert _residual_bytes(lambda x: jnp.argsort(x, axis=1).astype(x.dtype) + jnp.sort(x, axis=0), x) == x.nbytes


def test_top_k_saves_only_the_indices():
    x = jnp.arange(12.0).reshape(3, 4)
    assert _residual_bytes(lambda x: lax.top_k(x, 2)[0], x) == 3 * 2 * 4  # int32 indices


def _set_twice(x, u):
    """Position 1 is written by updates 0 and 1 (which one wins is XLA's choice),
    position 3 by update 2; updates 3 and 4 write out of bounds (dropped)."""
    return x.at[jnp.array([1, 1, 3, 7, 9])].set(u)


def test_scatter_backward_gives_the_gradient_to_the_update_the_forward_kept():
    """XLA leaves the winner among duplicate writes to the device (this CPU keeps
    the last write, an H200 kept the first): the backward must read the winners
    the forward chose, not scatter again. Here the forward's choice is replaced by
    the other possible one and the gradient follows it."""
    from rumus_fx.lift.program import Program

    x, u = np.arange(5.0), np.array([10.0, 20.0, 30.0, 40.0, 50.0])
    prog = Program(jax.make_jaxpr(_set_twice)(x, u), (True, True), "set twice")
    (out,), (values, (landed,)) = prog.forward([x, u])
    kept = int(landed[1])  # the id (1 or 2) of the update the forward wrote at position 1
    assert kept in (1, 2)
    np.testing.assert_array_equal(out, [0, u[kept - 1], 2, 30, 4])
    np.testing.assert_array_equal(landed, [0, kept, 0, 3, 0])  # the forward's winners, as update ids
    seed = [np.arange(1.0, 6.0)]
    for winner in (kept, 3 - kept):  # what the forward chose, then the other possible choice
        g_x, g_u = prog.backward((values, (landed.at[1].set(winner),)), seed)
        np.testing.assert_array_equal(g_x, [1, 0, 3, 0, 5])
        np.testing.assert_array_equal(g_u, [2 * (winner == 1), 2 * (winner == 2), 4, 0, 0])


@pytest.mark.parametrize("mode", ["fill", "clip", "promise_in_bounds"])
def test_scatter_forward_built_from_its_winners_is_the_scatter_bit_for_bit(mode):
    """The forward builds the output from the winners it found; the value is the
    plain scatter's, signed zeros, nan and inf included, in every mode."""
    x = jnp.array([1.0, -2.0, 3.0, 4.0, np.inf, 6.0])
    u = jnp.array([-0.0, np.nan, 0.0, -np.inf, 7.0, -0.0])
    i = jnp.array([0, 1, 1, 2, 9, 5])

    def f(x, u):
        return x.at[i].set(u, mode=mode)

    with rf.Tape() as tape:
        out = rf.lift(f)(rf.tensor(x, requires_grad=True), rf.tensor(u, requires_grad=True))
    want = f(x, u)
    got = out.numpy()
    assert len(tape.entries) == 1  # recorded: the forward ran the rule's own program
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
