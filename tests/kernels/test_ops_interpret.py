"""The ops on the Pallas path (interpret mode) against the reference mode:
``rf.grad`` (whose records call the backward kernels), ``jax.jit``, per-example
gradients under ``jax.vmap``, and forward-over-reverse Hessian-vector products
``jax.jvp(rf.grad(f))`` (which differentiate the backward kernels' custom_jvp
rules)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf

from ._jaxpr import has_pallas

TOL = dict(rtol=5e-5, atol=5e-5)
R = np.random.default_rng(0)


def normal(*shape):
    return jnp.asarray(R.standard_normal(shape), jnp.float32)


def weights(shape):
    """A fixed cotangent so every output element matters."""
    return jnp.asarray(np.random.default_rng(1).standard_normal(shape), jnp.float32)


X = normal(2, 3, 7)
W7, B7 = normal(7), normal(7)
IMG = normal(3, 4, 5, 3)
C4 = normal(4)
LOGITS = normal(2, 3, 9)
TARGETS = np.asarray(R.integers(0, 9, (2, 3)), np.int32)
IGNORE = int(TARGETS[0, 0])
A, M = normal(2, 5, 6), normal(6, 4)
Q, K, V = normal(2, 6, 8), normal(2, 7, 8), normal(2, 7, 8)
TABLE = normal(11, 5)
IDS = jnp.asarray(R.integers(0, 11, (3, 4)), jnp.int32)


def _softmax(x):
    return rf.sum(rf.mul(rf.softmax(x, axis=1), weights((2, 3, 7))))


def _layer_norm(x, w, b):
    return rf.sum(rf.mul(rf.layer_norm(x, w, b), weights((2, 3, 7))))


def _batch_norm(x, w, b):
    y, _, _ = rf.batch_norm_2d(x, w, b, jnp.zeros(4), jnp.ones(4), training=True)
    return rf.sum(rf.mul(y, weights((3, 4, 5, 3))))


def _cross_entropy(logits):
    return rf.cross_entropy(logits, TARGETS, ignore_index=IGNORE)


def _matmul(a, m):
    return rf.sum(rf.mul(rf.tanh(rf.matmul(a, m)), weights((2, 5, 4))))


def _bmm(a, b):
    return rf.sum(rf.mul(rf.bmm(a, b), weights((2, 5, 5))))


def _attention(q, k, v):
    return rf.sum(rf.mul(rf.scaled_dot_product_attention(q, k, v), weights((2, 6, 8))))


def _attention_causal(q, k):
    return rf.sum(rf.mul(rf.scaled_dot_product_attention(q, k, k, causal=True), weights((2, 6, 8))))


def _embedding(table):
    return rf.sum(rf.mul(rf.tanh(rf.embedding(IDS, table)), weights((3, 4, 5))))


OPS = {
    "softmax": (_softmax, (X,)),
    "layer_norm": (_layer_norm, (X, W7, B7)),
    "batch_norm_2d": (_batch_norm, (IMG, C4, C4 + 1)),
    "cross_entropy": (_cross_entropy, (LOGITS,)),
    "matmul": (_matmul, (A, M)),
    "bmm": (_bmm, (A, jnp.swapaxes(A, 1, 2))),
    "attention": (_attention, (Q, K, V)),
    "attention_causal": (_attention_causal, (Q, Q[:, :6])),
    "embedding": (_embedding, (TABLE,)),
}


def _both(fun):
    with rf.kernels.use("reference"):
        want = fun()
    with rf.kernels.use("interpret"):
        got = fun()
    return got, want


@pytest.mark.parametrize("name", list(OPS))
def test_rf_grad_matches_reference(name):
    f, args = OPS[name]
    argnums = tuple(range(len(args)))
    got, want = _both(lambda: jax.jit(rf.value_and_grad(f, argnums=argnums))(*args))
    chex.assert_trees_all_close(got, want, **TOL)
    with rf.kernels.use("interpret"):
        assert has_pallas(rf.grad(f, argnums=argnums), *args)
    with rf.kernels.use("reference"):
        assert not has_pallas(rf.grad(f, argnums=argnums), *args)


@pytest.mark.parametrize(
    "name", ["softmax", "layer_norm", "batch_norm_2d", "cross_entropy", "matmul", "attention_causal", "embedding"]
)
def test_hessian_vector_product(name):
    """Forward-over-reverse: jax.jvp through rf.grad, i.e. through the backward kernels."""
    f, args = OPS[name]
    argnums = tuple(range(len(args)))
    tangents = tuple(jnp.asarray(np.random.default_rng(3).standard_normal(a.shape), a.dtype) for a in args)
    got, want = _both(lambda: jax.jvp(rf.grad(f, argnums=argnums), args, tangents))
    chex.assert_trees_all_close(got, want, **TOL)


@pytest.mark.parametrize("name,in_axes", [("layer_norm", (0, None, None)), ("attention", 0), ("matmul", (0, None))])
def test_per_example_gradients_under_vmap(name, in_axes):
    f, args = OPS[name]
    got, want = _both(lambda: jax.jit(jax.vmap(rf.grad(f), in_axes=in_axes))(*args))
    chex.assert_trees_all_close(got, want, **TOL)


def test_eager_calls_reuse_compiled_kernels():
    """Eager (un-jitted) op calls go through a jitted kernel entry, so a second
    call with the same shapes traces and compiles nothing new."""
    from rumus_fx.kernels import softmax

    with rf.kernels.use("interpret"):
        rf.grad(_softmax)(X)
        sizes = softmax._softmax_fwd_local._cache_size(), softmax._softmax_bwd_local._cache_size()
        jax.block_until_ready(rf.grad(_softmax)(X))
    assert (softmax._softmax_fwd_local._cache_size(), softmax._softmax_bwd_local._cache_size()) == sizes
