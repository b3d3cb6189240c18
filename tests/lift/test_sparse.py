"""jax.experimental.sparse (BCOO) through rf.lift: a graph-convolution loss whose
adjacency is a BCOO array (its values differentiated with the features and the
weights, each alone and together), under jax.jit, with the sparse matrix never
made dense in the backward (rumus_fx/lift/rules_sparse.py). The per-primitive
checks are the primitive table's (``bcoo_*`` entries in tests/lift/test_ptable.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import rumus_fx as rf
from rumus_fx.testing import check_grads

N, NSE = 12, 30


def _graph(n: int = N, nse: int = NSE, seed: int = 0):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(nse, 2)).astype(np.int32)
    idx[1] = idx[0]  # a repeated edge: its two values add up
    idx[-1] = n  # a padding entry (dropped by todense, no gradient through it)
    return rng.standard_normal(nse), jnp.asarray(idx)


def _gcn(values, x, w, idx):
    a = sparse.BCOO((values, idx), shape=(N, N))
    h = jnp.tanh(a @ (x @ w))
    back = a.T @ h  # the transposed adjacency too
    return jnp.sum(h**2) + jnp.sum(jnp.sin(back)) + jnp.sum(a.todense() * 0.1)


def _gcn_dense(values, x, w, idx):
    """The same loss with the adjacency made dense by hand (jnp only)."""
    a = jnp.zeros((N + 1, N + 1), values.dtype).at[idx[:, 0], idx[:, 1]].add(values)[:N, :N]
    h = jnp.tanh(a @ (x @ w))
    return jnp.sum(h**2) + jnp.sum(jnp.sin(a.T @ h)) + jnp.sum(a * 0.1)


@pytest.mark.parametrize("argnums", [0, 1, 2, (0, 1, 2)], ids=["values", "x", "w", "all"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_graph_convolution_with_a_bcoo_adjacency(argnums, jit):
    with jax.enable_x64(True):
        values, idx = _graph()
        rng = np.random.default_rng(1)
        x, w = rng.standard_normal((N, 5)), rng.standard_normal((5, 3)) * 0.5

        def f(values, x, w):
            return _gcn(values, x, w, idx)

        def oracle(values, x, w):
            return _gcn_dense(values, x, w, idx)

        check_grads(rf.lift(f), (values, x, w), argnums, oracle=oracle, jit=jit, atol=1e-10, rtol=1e-10)


def test_the_backward_never_makes_the_sparse_matrix_dense():
    """S @ x and S^T @ y differentiated in S's values and x: the gradient of the
    values is sampled at the indices, so no [n, n] array appears in the program
    (n = 4096: dense, 64 MiB in float32)."""
    n, nse = 4096, 64
    rng = np.random.default_rng(0)
    idx = jnp.asarray(rng.integers(0, n, size=(nse, 2)).astype(np.int32))

    def f(values, x):
        a = sparse.BCOO((values, idx), shape=(n, n))
        return jnp.sum(jnp.tanh(a @ x)) + jnp.sum(a.T @ x)

    values, x = jnp.ones(nse), jnp.ones((n, 2))
    text = str(jax.make_jaxpr(rf.grad(rf.lift(f), argnums=(0, 1)))(values, x))
    assert "bcoo_dot_general_sampled" in text
    assert f"[{n},{n}]" not in text
    got = rf.grad(rf.lift(f), argnums=(0, 1))(values, x)
    want = jax.grad(f, argnums=(0, 1))(values, x)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_bcoo_extract_with_repeated_indices_is_refused_by_name():
    values, idx = _graph()

    def f(m):
        a = sparse.BCOO((jnp.asarray(values, jnp.float32), idx), shape=(N, N))
        return jnp.sum(sparse.bcoo_extract(a, m, assume_unique=False).data ** 2)

    with pytest.raises(rf.AutogradError, match="bcoo_extract with assume_unique=False"):
        rf.grad(rf.lift(f))(jnp.ones((N, N)))


def test_data_broadcast_along_a_batch_axis():
    """A BCOO's values may have size 1 on a batch axis, broadcast against the
    indices': their gradient sums over that axis (jax.grad fails here with a
    cotangent shape error; the oracle makes the matrix dense by hand)."""
    idx = jnp.array([[[0], [2]], [[1], [1]]], np.int32)
    weights = np.arange(6.0).reshape(2, 3)

    def f(d):
        return jnp.sum(jnp.sin(sparse.BCOO((d, idx), shape=(2, 3)).todense()) * weights)

    def oracle(d):
        b = jnp.broadcast_to(d, (2, 2))
        m = jnp.zeros((2, 3), d.dtype).at[0, 0].add(b[0, 0]).at[0, 2].add(b[0, 1]).at[1, 1].add(b[1, 0] + b[1, 1])
        return jnp.sum(jnp.sin(m) * weights)

    with jax.enable_x64(True):
        check_grads(rf.lift(f), (jnp.array([[0.5, -1.0]]),), 0, oracle=oracle, atol=1e-12, rtol=1e-12)


# jax.grad's own rules for the COO/CSR primitives are wrong in three places (jax 0.10.2),
# where rf's follow the forward and finite differences confirm them:
# 1. the COO and CSR matvec/matmat with transpose=True: the values' gradient reads ct[row] * v[col]
#    where the forward multiplies v[row] into out[col];
# 2. coo_fromdense's padding elements (row = col = 0, value a constant 0) send their
#    cotangent into m[0, 0];
# 3. a CSR's padding element (row = n_rows, dropped where the product writes it) gets
#    the cotangent of the clamped last row.
IDX_ROW = np.array([0, 0, 1, 2, 2], np.int32)
IDX_COL = np.array([1, 3, 0, 2, 2], np.int32)


@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transposed"])
@pytest.mark.parametrize("op", ["matvec", "matmat"])
def test_coo_products_match_finite_differences(op, transpose):
    def dense(d):
        return jnp.zeros((3, 4), d.dtype).at[IDX_ROW, IDX_COL].add(d)

    def f(d, v):
        a = sparse.COO((d, jnp.asarray(IDX_ROW), jnp.asarray(IDX_COL)), shape=(3, 4))
        return jnp.sum(jnp.sin(getattr(sparse, f"coo_{op}")(a, v, transpose=transpose)))

    def oracle(d, v):
        m = dense(d).T if transpose else dense(d)
        return jnp.sum(jnp.sin(m @ v))

    with jax.enable_x64(True):
        rng = np.random.default_rng(2)
        n = 3 if transpose else 4
        v = rng.standard_normal((n,) if op == "matvec" else (n, 2))
        for argnums in (0, 1, (0, 1)):
            check_grads(rf.lift(f), (rng.standard_normal(5), v), argnums, oracle=oracle, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("fmt", ["coo", "csr"])
def test_padding_elements_of_fromdense_have_no_gradient(fmt):
    """Seven stored elements of which two are padding (constant zeros): a loss that
    reads every stored value gives m no gradient through the padding."""
    m = np.array([[0.9, 0.0, -1.2], [0.0, 2.0, 0.0], [-0.7, 0.8, 0.0]])
    weights = np.arange(1.0, 8.0)

    def f(m):
        s = getattr(sparse, f"{fmt}_fromdense")(m, nse=7)
        return jnp.sum(jnp.sin(s.data) * weights)

    rows, cols = np.nonzero(m)  # the five nonzeros, in row-major order

    def oracle(m):
        return jnp.sum(jnp.sin(m[rows, cols]) * weights[:5])  # the padding: sin(0) * w, a constant

    with jax.enable_x64(True):
        got = rf.grad(rf.lift(f))(jnp.asarray(m))
        np.testing.assert_allclose(got, jax.grad(oracle)(jnp.asarray(m)), rtol=1e-12, atol=1e-12)
        want = np.zeros_like(m)
        want[rows, cols] = np.cos(m[rows, cols]) * weights[:5]
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)  # m[0, 0] = 0.9: its own weight only


@pytest.mark.parametrize("op", ["matvec", "matmat", "todense"])
def test_a_csr_padding_element_dropped_by_the_product_has_no_gradient(op):
    indices = jnp.array([1, 3, 0, 2, 2, 0], jnp.int32)
    indptr = jnp.array([0, 2, 3, 5], jnp.int32)  # element 5 is padding: its row is 3, out of range

    def f(d, v):
        a = sparse.CSR((d, indices, indptr), shape=(3, 4))
        out = a.todense() * v[0] if op == "todense" else getattr(sparse, f"csr_{op}")(a, v)
        return jnp.sum(jnp.sin(out))

    with jax.enable_x64(True):
        rng = np.random.default_rng(3)
        d, v = rng.standard_normal(6), rng.standard_normal((4,) if op != "matmat" else (4, 2))
        got = rf.grad(rf.lift(f))(d, v)
        eps = 1e-6
        fd = [(f(d + eps * e, v) - f(d - eps * e, v)) / (2 * eps) for e in np.eye(6)]
        np.testing.assert_allclose(got, fd, rtol=1e-7, atol=1e-8)
        assert got[5] == 0.0


def test_spsolve_with_a_padding_element():
    """jax.experimental.sparse.linalg.spsolve of a CSR matrix with a padding element
    (past indptr[-1]): rf's rule transposes the matrix with the padding kept last
    and gives it no gradient, which finite differences confirm (jax.grad's own
    transpose hands it to scipy, which fails: "COLAMD failed")."""
    from jax.experimental.sparse.linalg import spsolve

    indices = jnp.array([0, 2, 1, 0, 2, 3, 1, 3, 0], jnp.int32)
    indptr = jnp.array([0, 2, 3, 6, 8], jnp.int32)

    def f(d, b):
        return jnp.sum(jnp.sin(spsolve(d, indices, indptr, b)) * jnp.arange(1.0, 5.0))

    with jax.enable_x64(True):
        d = jnp.array([4.0, 0.3, 3.5, -0.2, 5.0, 0.7, 0.1, 4.5, 9.0])
        b = jnp.array([1.0, -2.0, 0.5, 1.5])
        gd, gb = rf.grad(rf.lift(f), (0, 1))(d, b)
        eps = 1e-6
        fd_d = [(f(d + eps * e, b) - f(d - eps * e, b)) / (2 * eps) for e in np.eye(9)]
        fd_b = [(f(d, b + eps * e) - f(d, b - eps * e)) / (2 * eps) for e in np.eye(4)]
        np.testing.assert_allclose(gd, fd_d, rtol=1e-7, atol=1e-9)
        np.testing.assert_allclose(gb, fd_b, rtol=1e-7, atol=1e-9)
        assert gd[8] == 0.0


def test_the_sparse_rules_load_when_a_program_first_holds_a_sparse_primitive():
    """``import rumus_fx`` imports neither jax.experimental.sparse (it imports
    scipy.sparse) nor rf's rules for it; the first lifted program holding a sparse
    primitive declares them."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import sys
        import jax.numpy as jnp
        import rumus_fx as rf
        assert "jax.experimental.sparse" not in sys.modules, "imported by rumus_fx"
        assert "rumus_fx.lift.rules_sparse" not in sys.modules
        from jax.experimental import sparse
        idx = sparse.BCOO.fromdense(jnp.eye(2)).indices
        f = lambda d, x: jnp.sum(sparse.BCOO((d, idx), shape=(2, 2)) @ x)
        g = rf.grad(rf.lift(f))(jnp.array([2.0, 3.0]), jnp.array([1.0, -1.0]))
        assert "rumus_fx.lift.rules_sparse" in sys.modules
        print(g.tolist())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[1.0, -1.0]"


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_sparsified_function(jit):
    """``jax.experimental.sparse.sparsify`` turns jnp code on a BCOO argument into the
    sparse primitives (a product, a scaled copy, a sum over an axis); its gradient in
    the stored values and the dense argument is jax.grad's and ``sparse.grad``'s."""

    @sparse.sparsify
    def f(a, x):
        y = a @ x
        z = (a * 2.0) @ x + jnp.sum(a, axis=0) @ x
        return jnp.sum(jnp.sin(y) * z)

    m = jnp.array([[0.0, 1.5, 0.0, 2.0], [3.0, 0.0, 0.0, -1.0], [0.0, 0.0, 4.0, 0.0]])
    a = sparse.BCOO.fromdense(m)
    x = jnp.arange(4.0) / 3

    def loss(values, x):
        return f(sparse.BCOO((values, a.indices), shape=a.shape), x)

    g = rf.grad(rf.lift(loss), (0, 1))
    got = (jax.jit(g) if jit else g)(a.data, x)
    want = jax.grad(loss, (0, 1))(a.data, x)
    by_sparse_grad = sparse.grad(f, (0, 1))(a, x)
    for u, v, w in zip(got, want, (by_sparse_grad[0].data, by_sparse_grad[1])):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(u, w, rtol=1e-5, atol=1e-6)


def test_sort_indices_gives_each_tied_value_the_gradient_of_its_own_place():
    """Repeated indices tie in bcoo_sort_indices, and XLA may order ties either way:
    rf's forward keeps its own permutation and the backward sends each place's
    cotangent back through it, so every value gets the weight of the place its own
    forward put it in (the values are distinct, so the place is read off the output)."""
    idx = jnp.array([[2, 1], [0, 3], [2, 1], [1, 0], [2, 1], [3, 4]], jnp.int32)
    weights = jnp.array([3.0, -1.0, 0.5, 2.0, 7.0, -4.0])

    def sorted_values(d):
        return sparse.bcoo_sort_indices(sparse.BCOO((d, idx), shape=(3, 4))).data

    d = jnp.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    out = np.asarray(rf.lift(sorted_values)(d))
    np.testing.assert_array_equal(out, sorted_values(d))  # the primitive's own order
    place = [int(np.flatnonzero(out == v)[0]) for v in np.asarray(d)]
    got = rf.grad(rf.lift(lambda d: jnp.sum(sorted_values(d) * weights)))(d)
    np.testing.assert_array_equal(got, np.asarray(weights)[place])
