"""Calls that run their body somewhere or somehow, inside a lifted function (both
refused by name before): ``jax.experimental.compute_on.compute_on2`` (the primitive
``compute_on``: the body runs on the host) and
``jax.experimental.scheduling_groups.scheduling_group`` (``xla_metadata_call``: XLA
metadata on the body). rf runs the body's program inside the same call and its
backward inside another, as jax's transpose does; residuals stay in device memory and
each gradient comes in its operand's memory space. Each program under
``rf.grad(rf.lift(f))``, eagerly and under jit, each argument alone and both, against
``jax.grad`` (of the same function, or of it without the placement where jax.grad
itself fails) and float64 central differences."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.compute_on import compute_on2
from jax.experimental.scheduling_groups import scheduling_group

import rumus_fx as rf
from rumus_fx.testing import check_grads

HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device
_W = np.linspace(-1.0, 1.0, 12).reshape(3, 4)  # a constant the body closes over


def _on_host(fun, spaces=DEVICE):
    return compute_on2(fun, compute_type="device_host", out_memory_spaces=spaces)


def _one_output_unused(x, y):
    # the body's second output, sqrt at 0 (infinite derivative), is never read
    u, _ = _on_host(lambda a, b: (jnp.sin(a) * b, jnp.sqrt(b * 0.0)), (DEVICE, DEVICE))(x, y)
    return jnp.sum(u)


def _scan_in_body(x, y):
    def body(a, b):
        def step(c, row):
            return jnp.tanh(c * row + b[0]), c * 2.0

        c, ys = lax.scan(step, jnp.ones(a.shape[1]), a)
        return c.sum() + ys.sum()

    return _on_host(body)(x, y)


def _host_output(x, y):
    # an output left in host memory and moved back (jax.grad fails on it:
    # "Expected cotangent type float64[3,4] but got float64<host>[3,4]")
    u = _on_host(lambda a, b: jnp.exp(a) * b, HOST)(x, y)
    return jnp.sum(jax.device_put(u, DEVICE) * x)


PROGRAMS = {
    "two_outputs": lambda x, y: jnp.sum(
        jnp.prod(jnp.stack(_on_host(lambda a, b: (a @ b.T, jnp.exp(b)), (DEVICE, DEVICE))(x, y)[1:]), 0) * x
    ),
    "one_output_unused": _one_output_unused,
    "closes_over_a_constant": lambda x, y: jnp.sum(_on_host(lambda a, b: jnp.cos(a * _W) * b)(x, y) ** 2),
    "scan_in_body": _scan_in_body,
    "host_output": _host_output,
    "scheduling_group": lambda x, y: jnp.sum(scheduling_group("g1")(lambda a, b: jnp.sin(a) * b**2)(x, y) * x),
    "scheduling_group_in_compute_on": lambda x, y: jnp.sum(
        _on_host(lambda a, b: scheduling_group("g2")(lambda c: jnp.tanh(c) * b)(a) * a)(x, y)
    ),
}
# the same programs without the placement, for jax.grad where it fails with it
_PLAIN = {"host_output": lambda x, y: jnp.sum(jnp.exp(x) * y * x)}


def _args():
    r = np.random.default_rng(3)
    return r.standard_normal((3, 4)) * 0.5, r.standard_normal((3, 4)) * 0.5


@pytest.mark.parametrize("argnums", [(0,), (1,), (0, 1)], ids=["x", "y", "both"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_gradient_through_compute_on_is_jax_grads(name, jit, argnums):
    f = PROGRAMS[name]
    with jax.enable_x64(True):
        x, y = (jnp.asarray(a) for a in _args())
        check_grads(rf.lift(f), (x, y), argnums, oracle=_PLAIN.get(name, f), jit=jit, atol=1e-12, rtol=1e-12)


def test_jax_grad_itself_fails_on_a_host_output():
    """Why ``host_output`` is checked against the program without its placement."""
    with jax.enable_x64(True):
        x, y = (jnp.asarray(a) for a in _args())
        with pytest.raises(ValueError, match="cotangent type"):
            jax.grad(_host_output)(x, y)


@pytest.mark.parametrize(
    "name,attribute",
    [("closes_over_a_constant", '_xla_compute_type = "host"'), ("scheduling_group", 'scheduling_group = "g1"')],
)
def test_the_backward_runs_where_and_as_the_body_ran(name, attribute):
    """The compiled gradient program has as many calls with the body's attribute
    (on the host; in a scheduling group) as jax.grad's: the forward's body and its
    backward."""
    f = PROGRAMS[name]

    def calls(fun):
        text = jax.jit(fun).lower(x, x).as_text()
        return sum("call @" in line and attribute in line for line in text.splitlines())

    # in float64 as the other tests: jax caches the body's trace by function, not by
    # the 64-bit mode, and the body closes over a float64 constant
    with jax.enable_x64(True):
        x = jnp.ones((3, 4))
        ours = calls(rf.grad(rf.lift(f), argnums=(0, 1)))
        assert ours == calls(jax.grad(f, argnums=(0, 1))) == 2
