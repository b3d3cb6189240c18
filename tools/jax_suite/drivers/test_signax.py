"""signax: path signatures (``signature``: a ``lax.scan`` of fused multiply-exponentiate
steps; depths 1 to 4, flattened or as a list of tensors, streamed, batched, chunked with
and without a remainder, paths of dimension 1 to 3), log-signatures (``logsignature``
and ``signature_to_logsignature``: the tensor logarithm compressed on Lyndon words),
Chen's identity (``signature_combine`` and ``multi_signature_combine``, an
``associative_scan``), the ``SignatureTransform``/``LogSignatureTransform`` modules and
the tensor-algebra operations (``otimes``, ``addcmul``, ``restricted_exp``, ``mult``,
``log``, ``index_select``, ``unravel_signature``, ``compress``); differentiated by
jax.grad with respect to each argument alone and all together, eagerly and under jit,
at generic paths, paths with repeated points (zero increments), constant paths and the
shortest path (two points: an empty scan).

signax 0.2.1 calls ``jax.tree_map``, which jax 0.10 no longer has (chunked signatures
and ``multi_signature_combine``); the driver aliases it to ``jax.tree.map``. Its
``utils.term_at`` passes an array as a static argument and fails under jax 0.10 with or
without a gradient: left out."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import signax
from signax import tensor_ops, utils

jax.config.update("jax_enable_x64", True)
if not hasattr(jax, "tree_map"):
    jax.tree_map = jax.tree.map


def _run(loss, args, argnums_list, jit):
    for argnums in argnums_list:
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*args)


def _fold(tree):
    """A scalar of every leaf, each entry with its own weight."""
    total = 0.0
    for i, leaf in enumerate(jax.tree_util.tree_leaves(tree)):
        w = jnp.cos(0.7 * jnp.arange(leaf.size, dtype=leaf.dtype) + i).reshape(leaf.shape)
        total = total + jnp.sum(w * leaf)
    return total


def _path(length, dim, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(length, dim)).cumsum(0) * 0.5)


PATHS = {
    "generic": _path(6, 2),
    "dim3": _path(5, 3, 1),
    "dim1": _path(5, 1, 2),
    "repeated": jnp.repeat(_path(3, 2, 3), 2, axis=0),  # zero increments
    "constant": jnp.ones((4, 2)) * 0.3,
    "two_points": _path(2, 2, 4),  # one increment: the scan is empty
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("flatten", [True, False])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", list(PATHS))
def test_signature(path, stream, flatten, jit):
    def loss(p):
        return _fold(signax.signature(p, 3, stream=stream, flatten=flatten))

    _run(loss, (PATHS[path],), [(0,)], jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_signature_depth(depth, jit):
    def loss(p):
        return _fold(signax.signature(p, depth))

    _run(loss, (PATHS["generic"],), [(0,)], jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_signature_batched(stream, jit):
    batch = jnp.stack([_path(5, 2, s) for s in range(3)])

    def loss(p):
        return _fold(signax.signature(p, 3, stream=stream)) + _fold(signax.logsignature(p, 3, stream=stream))

    _run(loss, (batch,), [(0,)], jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chunks", [(9, 4), (10, 3)])  # (length, num_chunks): no remainder, a remainder
def test_signature_chunked(chunks, stream, jit):
    length, num_chunks = chunks

    def loss(p):
        return _fold(signax.signature(p, 3, stream=stream, num_chunks=num_chunks))

    _run(loss, (_path(length, 2, 5),), [(0,)], jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["generic", "dim3", "repeated", "constant", "two_points"])
def test_logsignature(path, stream, jit):
    depth = 3 if path == "dim3" else 4

    def loss(p):
        return _fold(signax.logsignature(p, depth, stream=stream))

    _run(loss, (PATHS[path],), [(0,)], jit)


@pytest.mark.parametrize("jit", [False, True])
def test_logsignature_chunked(jit):
    def loss(p):
        return _fold(signax.logsignature(p, 3, num_chunks=3, flatten=False))

    _run(loss, (_path(10, 2, 6),), [(0,)], jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("which", ["path_signatures", "arbitrary_tensors"])
def test_signature_combine(which, jit):
    if which == "path_signatures":
        a = signax.signature(_path(4, 2, 7), 3, flatten=False)
        b = signax.signature(_path(5, 2, 8), 3, flatten=False)
    else:  # not group-like: the tensor algebra's product as it is
        rng = np.random.default_rng(9)
        a = [jnp.asarray(rng.normal(size=(2,) * k)) for k in (1, 2, 3)]
        b = [jnp.asarray(rng.normal(size=(2,) * k)) for k in (1, 2, 3)]

    def loss(a, b):
        c = signax.signature_combine(a, b)
        return _fold(c) + _fold(signax.signature_to_logsignature(c))

    _run(loss, (a, b), [(0,), (1,), (0, 1)], jit)


@pytest.mark.parametrize("jit", [False, True])
def test_multi_signature_combine(jit):
    sigs = signax.signature(jnp.stack([_path(4, 2, s) for s in range(5)]), 3, flatten=False)

    def loss(sigs):
        return _fold(signax.multi_signature_combine(sigs))

    _run(loss, (sigs,), [(0,)], jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_modules(stream, jit):
    sig = signax.module.SignatureTransform(3, stream=stream)
    logsig = signax.module.LogSignatureTransform(3, stream=stream)

    def loss(p):
        return _fold(sig(p)) + _fold(logsig(p))

    _run(loss, (PATHS["generic"],), [(0,)], jit)


@pytest.mark.parametrize("jit", [False, True])
def test_tensor_ops(jit):
    rng = np.random.default_rng(10)
    x = jnp.asarray(rng.normal(size=(3,)))
    y = jnp.asarray(rng.normal(size=(3, 3)))
    z = jnp.asarray(rng.normal(size=(3,)))

    def loss(x, y, z):
        out = tensor_ops.addcmul(tensor_ops.otimes(y, z), y, z)
        exp_x = tensor_ops.restricted_exp(x, 3)
        exp_z = tensor_ops.restricted_exp(z, 3)
        prod = tensor_ops.mult(exp_x, [z, y, out])
        fused = tensor_ops.mult_fused_restricted_exp(x, exp_z)
        return _fold(out) + _fold(prod) + _fold(fused) + _fold(tensor_ops.log(prod))

    _run(loss, (x, y, z), [(0,), (1,), (2,), (0, 1, 2)], jit)


@pytest.mark.parametrize("jit", [False, True])
def test_utils(jit):
    flat = signax.signature(PATHS["dim3"], 3)
    indices = utils.lyndon_words(3, 3)

    def loss(flat):
        terms = utils.unravel_signature(flat, 3, 3)
        picked = utils.compress(terms, indices)
        return _fold(picked) + _fold(utils.index_select(terms[2], indices[1]))

    _run(loss, (flat,), [(0,)], jit)
