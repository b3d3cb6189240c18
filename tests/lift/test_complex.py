"""Complex numbers under ``rf.lift`` and ``rf.grad``: every rule that accepts
complex operands (``COMPLEX_OK``) gives ``jax.grad``'s value (its convention,
``holomorphic=False``: a real loss of complex inputs), each complex argument
alone and both together, eager and jit; a rule not checked for complex values
refuses them, naming the primitive. The real-input programs through complex
values are in the primitive table (float64 finite differences there)."""

from __future__ import annotations

import itertools

import chex
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import jax.scipy as jsp
import numpy as np
import pytest
from equinox.internal._loop import common as _eqx_loop
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import linear_call
from jax.experimental import sparse
from jax.experimental.compute_on import compute_on2
from jax.experimental.scheduling_groups import scheduling_group
from jax.experimental.shard_alike import shard_alike

import rumus_fx as rf
import rumus_fx.numpy as rnp
from rumus_fx.lift.rules import COMPLEX_OK


def _c(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape) + 1j * rng.standard_normal(shape))


def _args():
    rng = np.random.default_rng(11)
    return _c(rng, 3, 4), _c(rng, 3, 4)


M = np.random.default_rng(2).standard_normal((4, 2)) * (1 - 0.5j)

UNARY = {
    "exp": jnp.exp, "exp2": jnp.exp2, "log": jnp.log, "sin": jnp.sin, "cos": jnp.cos, "tan": jnp.tan,
    "tanh": jnp.tanh, "sinh": jnp.sinh, "cosh": jnp.cosh, "sqrt": jnp.sqrt, "rsqrt": lax.rsqrt,
    "square": jnp.square, "integer_pow": lambda z: z**3, "neg": lambda z: -z, "expm1": jnp.expm1,
    "log1p": jnp.log1p, "asin": jnp.arcsin, "acos": jnp.arccos, "atan": jnp.arctan, "asinh": jnp.arcsinh,
    "acosh": jnp.arccosh, "atanh": jnp.arctanh, "logistic": lax.logistic,
    "real": jnp.real, "imag": jnp.imag, "conj": jnp.conj, "abs": jnp.abs,
    "convert": lambda z: z.astype(jnp.complex64).astype(z.dtype), "copy": lambda z: jnp.array(z, copy=True),
}  # fmt: skip

_SPARSE_ROW, _SPARSE_COL = np.array([0, 0, 1, 2, 2]), np.array([1, 3, 0, 2, 2])  # a repeated element


def _bcoo(z):
    return sparse.BCOO((z.reshape(-1)[:5], np.stack([_SPARSE_ROW, _SPARSE_COL], 1)), shape=(3, 4))


def _coo(z):
    return sparse.COO((z.reshape(-1)[:5], _SPARSE_ROW, _SPARSE_COL), shape=(3, 4))


def _bcsr(z):
    return sparse.BCSR((z.reshape(-1)[:5], _SPARSE_COL, np.array([0, 2, 3, 5])), shape=(3, 4))


def _csr(z):  # no padding element: jax.grad, the oracle here, misreads one
    return sparse.CSR((z.reshape(-1)[:5], _SPARSE_COL, np.array([0, 2, 3, 5])), shape=(3, 4))


LINEAR = {
    "dot_general": lambda z: z @ jnp.asarray(M, z.dtype),
    "reduce_sum": lambda z: jnp.sum(z, 0),
    "reduce_prod": lambda z: jnp.prod(z, 1),
    "cumsum": lambda z: jnp.cumsum(z, 1),
    "cumprod": lambda z: jnp.cumprod(z, 1),
    "transpose": lambda z: z.T,
    "reshape": lambda z: z.reshape(2, 6),
    "broadcast": lambda z: z[None] * jnp.ones((2, 1, 1), z.dtype),
    "pad": lambda z: jnp.pad(z, 1),
    "slice": lambda z: z[1:, ::2],
    "rev": lambda z: z[::-1],
    "dynamic_slice": lambda z: lax.dynamic_slice(z, (1, 1), (2, 2)),
    "gather": lambda z: z[jnp.array([0, 2, 2])],
    "squeeze": lambda z: z[None].squeeze(0),
    "split": lambda z: jnp.split(z, 2, axis=1)[1],
    "unstack": lambda z: jnp.unstack(z, axis=1)[2] * jnp.unstack(z)[0][1:],
    "tile": lambda z: jnp.tile(z, (2, 1)),
    "fft": lambda z: jnp.fft.fft2(z),
    "complex": lambda z: lax.complex(jnp.real(z) * 2, jnp.imag(z) ** 2),
    "angle": jnp.angle,
    "sort": lambda z: jnp.sort(z, axis=1),  # by real part, then imaginary part
    "device_put": lambda z: jax.device_put(z, jax.devices()[0]),
    "name": lambda z: checkpoint_name(z, "complex_named") * 2,
    "shard_alike": lambda z: (lambda a, b: a + b)(*shard_alike(z, z * 2j)),
    # jax.experimental.sparse: BCOO (the values' gradient sampled at the indices), COO, CSR
    "bcoo_todense": lambda z: sparse.BCOO.fromdense(z, nse=12).todense(),
    "bcoo_dot_general": lambda z: _bcoo(z) @ z.T,
    "bcoo_transpose": lambda z: _bcoo(z).T @ z,
    "bcoo_extract": lambda z: sparse.bcoo_extract(_bcoo(z), z * 2, assume_unique=True).data,
    "coo_matvec": lambda z: sparse.coo_matvec(_coo(z), z[0]),
    "coo_matmat": lambda z: sparse.coo_matmat(_coo(z), z.T),
    "csr_matvec": lambda z: sparse.csr_matvec(_csr(z), z[1]),  # not transposed: jax.grad misreads that
    "bcoo_dot_general_sampled": lambda z: sparse.bcoo_dot_general_sampled(
        z, z.T * 2, np.stack([_SPARSE_ROW, _SPARSE_ROW], 1), dimension_numbers=(((1,), (0,)), ((), ()))
    ),
    "csr_matmat": lambda z: sparse.csr_matmat(_csr(z), z.T) + _csr(z).todense() @ z.T,
    "coo_fromdense": lambda z: (
        sparse.coo_fromdense(z, nse=12).data + sparse.COO.fromdense(z, nse=12).todense().reshape(-1)
    ),
    "csr_fromdense": lambda z: sparse.csr_fromdense(z, nse=12).data * 2,
    "bcsr_todense": lambda z: sparse.BCSR.fromdense(z, nse=12).todense(),
    "bcsr_dot_general": lambda z: _bcsr(z) @ z.T,
    "bcsr_extract": lambda z: sparse.bcsr_extract(_SPARSE_COL, np.array([0, 2, 3, 5]), z * 2),
}

BINARY = {
    "add": lambda z, w: z + w,
    "sub": lambda z, w: z - w,
    "mul": lambda z, w: z * w,
    "div": lambda z, w: z / w,
    "pow": lambda z, w: z**w,
    "select_n": lambda z, w: jnp.where(jnp.real(w) > 0, z, w),
    "concatenate": lambda z, w: jnp.concatenate([z, w]),
    "stack": lambda z, w: jnp.stack([z, w]),
    "dynamic_update_slice": lambda z, w: lax.dynamic_update_slice(w, z[:2, :2], (1, 1)),
    "scatter-add": lambda z, w: w.at[jnp.array([0, 2, 2])].add(z),
    "scatter-sub": lambda z, w: w.at[jnp.array([0, 2, 2])].subtract(z),
    "scatter": lambda z, w: w.at[jnp.array([0, 2])].set(z[:2]),
    "scatter-mul": lambda z, w: w.at[jnp.array([0, 2])].multiply(z[:2], unique_indices=True),
    "conv": lambda z, w: lax.conv(z[None, None], w[None, None, :2, :2], (1, 1), "VALID"),
    "solve": lambda z, w: jnp.linalg.solve(z[:, :3] + 3 * jnp.eye(3, dtype=z.dtype), w[:, 3]),
    "det": lambda z, w: jnp.linalg.det(z[:, :3] * w[:, :3] + 3 * jnp.eye(3, dtype=z.dtype)),
    # a 4x4 determinant is a custom_jvp function (jax 0.11's 2x2 and 3x3 ones too)
    "det4": lambda z, w: jnp.linalg.det(jnp.concatenate([z, w[:1]]) + 3 * jnp.eye(4, dtype=z.dtype)),
    "eigh": lambda z, w: _eigh_parts(z[:, :3] * w[:, 1:]),
    "eig": lambda z, w: _eig_parts(z[:, :3] * w[:, 1:]),
    "cholesky": lambda z, w: jnp.linalg.cholesky(_hpd(z[:, :3] * w[:, 1:])),
    # a conjugated triangular solve (rf's rule lacked the conjugation: a wrong gradient)
    "solve_triangular_conj": lambda z, w: jsp.linalg.solve_triangular(
        jnp.triu(z[:, :3]) + 3 * jnp.eye(3, dtype=z.dtype), w[:, :2], trans="C"
    ),
    "triangular_solve_conj_right_unit": lambda z, w: lax.linalg.triangular_solve(
        jnp.tril(z[:, 1:]), w[:2, 1:], left_side=False, lower=True, conjugate_a=True, unit_diagonal=True
    ),
    "cho_solve": lambda z, w: jsp.linalg.cho_solve((jnp.linalg.cholesky(_hpd(z[:, :3])), True), w[:, :2]),
    "tridiagonal_solve": lambda z, w: lax.linalg.tridiagonal_solve(z[0], 4 + w[0], z[1], w[1:].T),
    "lu": lambda z, w: jnp.concatenate([m.ravel() for m in jsp.linalg.lu(z[:, :3] * w[:, 1:])[1:]]),
    "svd": lambda z, w: _svd_parts(z * w),
    "svd_tall": lambda z, w: _svd_parts((z * w).T),
    "svdvals": lambda z, w: jnp.linalg.svd(z * w, compute_uv=False),
    "qr_wide": lambda z, w: jnp.concatenate([m.ravel() for m in jnp.linalg.qr(z * w)]),
    "qr_tall": lambda z, w: jnp.concatenate([m.ravel() for m in jnp.linalg.qr((z * w).T)]),
    "qr_pivoting": lambda z, w: jnp.concatenate(
        [m.ravel() for m in lax.linalg.qr((z + w).T, pivoting=True, full_matrices=False)[:2]]
    ),
    "scan": lambda z, w: lax.scan(lambda c, x: (c * x + 1, c * w[0]), jnp.ones(4, z.dtype), z)[1],
    "cond": lambda z, w: lax.cond(True, lambda: z * w, lambda: z),
    "checkpoint": lambda z, w: jax.checkpoint(lambda a, b: jnp.sin(a) * b)(z, w),
    # calls that run their body somewhere or somehow, and a linear call (transposed, not conjugated)
    "compute_on": lambda z, w: compute_on2(
        lambda a, b: jnp.sin(a) * b, compute_type="device_host", out_memory_spaces=jax.memory.Space.Device
    )(z, w),
    "scheduling_group": lambda z, w: scheduling_group("complex")(lambda a, b: jnp.exp(a) * b)(z, w),
    "linear_call": lambda z, w: linear_call(
        lambda r, a: a * r, lambda r, ct: ct * r, jnp.asarray(1.5 - 0.5j, z.dtype), jnp.sin(z) * w
    ),
}


# smooth functions of two complex arguments outside the holomorphic list above
SMOOTH = {
    "atan2": lambda z, w: jnp.arctan2(z, w + 3),
    "cumlogsumexp": lambda z, w: lax.cumlogsumexp(0.3 * z * w, 1) + lax.cumlogsumexp(z - w, 0, reverse=True),
    # the maximum is taken under stop_gradient: no gradient reaches the (refused) complex max
    "softmax": lambda z, w: jax.nn.softmax(z * w, axis=1),
}


def _on_one_device(body, in_specs, out_specs, check_vma=True):
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)


_X = jax.sharding.PartitionSpec("x")
_R = jax.sharding.PartitionSpec()

# shard_map and the collectives on a one-device mesh (their semantics on eight devices:
# tests/_shard_map_cases.py, a complex case among them)
PARALLEL = {
    "psum": lambda z, w: _on_one_device(lambda a, b: lax.psum(a * b, "x"), (_X, _X), _R)(z, w),
    "pvary": lambda z, w: _on_one_device(lambda a, b: a * jnp.sin(b), (_X, _R), _X)(z, w),
    "psum_unchecked": lambda z, w: _on_one_device(lambda a, b: lax.psum(a - b, "x"), (_X, _X), _R, False)(z, w),
    "all_gather": lambda z, w: _on_one_device(
        lambda a, b: lax.all_gather(a * b, "x", axis=1, tiled=True), (_X, _X), _X
    )(z, w),
    "all_gather_invariant": lambda z, w: _on_one_device(
        lambda a, b: lax.all_gather(a * b, "x", axis=0, to="invarying"), (_X, _X), _R
    )(z, w),
    "psum_scatter": lambda z, w: _on_one_device(
        lambda a, b: lax.psum_scatter(a * b, "x", scatter_dimension=1, tiled=True), (_X, _X), _X
    )(z, w),
    "ppermute": lambda z, w: _on_one_device(lambda a, b: lax.ppermute(a, "x", perm=[(0, 0)]) * b, (_X, _X), _X)(z, w),
    "all_to_all": lambda z, w: _on_one_device(
        lambda a, b: lax.all_to_all(a * b, "x", split_axis=1, concat_axis=0, tiled=True), (_X, _X), _X
    )(z, w),
}


def _eqx_buffers(z, w, kind):
    """A complex state carried through equinox's loop, written into its buffer at
    each step (``maybe_set``, and ``select_if_vmap`` inside the loop's machinery)."""

    def body(c):
        i, acc, buf = c
        acc = acc * jnp.exp(0.3j * w[0]) + z[1]
        return i + 1, acc, buf.at[i].set(acc * z[2])

    init = (0, z[0], jnp.zeros((3, 4), z.dtype))
    _, acc, buf = eqxi.while_loop(lambda c: c[0] < 3, body, init, max_steps=3, kind=kind, buffers=lambda c: c[2])
    return buf * acc[None]


# equinox's linear primitives, as diffrax and dynamiqs emit them on complex states
EQUINOX = {
    "bounded_loop_buffers": lambda z, w: _eqx_buffers(z, w, "bounded"),
    "checkpointed_loop_buffers": lambda z, w: _eqx_buffers(z, w, "checkpointed"),
    "select_if_vmap": lambda z, w: _eqx_loop._select_if_vmap(
        jnp.sum(jnp.real(w)) > 0, z * w, z - w, makes_false_steps=False
    ),
}


def _eigh_parts(a):
    """Eigenvalues and phase-free functions of the eigenvectors of a complex
    Hermitian matrix (``jnp.linalg.eigh`` takes ``(a + a^H) / 2``)."""
    w, v = jnp.linalg.eigh(a)
    return jnp.concatenate([w.astype(a.dtype), (jnp.abs(v[0]) ** 2).astype(a.dtype), v[1] * jnp.conj(v[2])])


def _svd_parts(a):
    """Phase-free functions of a complex SVD (each singular pair's phase is
    arbitrary): the singular values, the rank-one pieces ``u_k v_k^H`` and
    ``|U|^2``, ``|V|^2``."""
    u, s, vt = jnp.linalg.svd(a, full_matrices=False)
    pieces = jnp.einsum("ik,kj->kij", u, vt)
    return jnp.concatenate(
        [
            s.astype(a.dtype),
            pieces.ravel(),
            (jnp.abs(u) ** 2).ravel().astype(a.dtype),
            (jnp.abs(vt) ** 2).ravel().astype(a.dtype),
        ]
    )


def _hpd(a):
    """A Hermitian positive definite matrix."""
    return a @ jnp.conj(a.T) + 3 * jnp.eye(a.shape[0], dtype=a.dtype)


def _eig_parts(a):
    """Eigenvalues, right and left eigenvectors of a general complex matrix, with
    LAPACK's normalisation (unit norm, a real largest component)."""
    w, vl, vr = lax.linalg.eig(a, enable_eigvec_derivs=True)
    return jnp.concatenate([w, vl.ravel(), vr.ravel()])


def _real_loss(y):
    """A real loss weighing real and imaginary parts differently."""
    if jnp.iscomplexobj(y):
        y = y * (0.3 - 0.7j)
        return jnp.sum(jnp.real(y) + 2 * jnp.imag(y) ** 2)
    return jnp.sum(y * 1.3)


def _unary_group(names):
    return lambda z, w: sum(_real_loss(UNARY[n](z * 0.5 + w * 0.1)) for n in names)


GROUPS = {
    "unary": _unary_group(UNARY),
    "linear": lambda z, w: sum(_real_loss(f(z * w)) for f in LINEAR.values()),
    "binary": lambda z, w: sum(_real_loss(f(z, w)) for f in BINARY.values()),
    "smooth": lambda z, w: sum(_real_loss(f(z, w)) for f in SMOOTH.values()),
    "parallel": lambda z, w: sum(_real_loss(f(z, w)) for f in PARALLEL.values()),
    "equinox": lambda z, w: sum(_real_loss(f(z, w)) for f in EQUINOX.values()),
}


def _jax_acosh_gradient_is_right() -> bool:
    """jax before 0.11 differentiates a complex ``acosh`` as ``1/sqrt(z^2-1)``,
    which has the wrong sign off the real axis where the real part is negative; 0.11
    uses ``1/(sqrt(z-1) sqrt(z+1))``. Read from jax itself at ``z = -0.5+0.5j``."""
    with jax.enable_x64(True):
        z = jnp.asarray(-0.5 + 0.5j)
        got = jax.grad(lambda z: jnp.real(jnp.arccosh(z)))(z)
        return bool(np.isclose(got, np.conj(1 / (np.sqrt(z - 1) * np.sqrt(z + 1)))))


# jax.grad is the oracle where it is right; the finite differences below check every rule
JAX_GROUPS = dict(GROUPS)
if not _jax_acosh_gradient_is_right():
    JAX_GROUPS["unary"] = _unary_group([n for n in UNARY if n != "acosh"])
# a float32 round trip has no float64 finite differences
FD_GROUPS = dict(GROUPS, unary=_unary_group([n for n in UNARY if n != "convert"]))


# both arguments together under jit by default (one compiled program per group);
# each argument alone, and eagerly, with -m slow
SUBSETS = [
    pytest.param((0, 1), True, id="both-jit"),
    pytest.param((0,), True, id="first-jit", marks=pytest.mark.slow),
    pytest.param((1,), True, id="second-jit", marks=pytest.mark.slow),
    pytest.param((0, 1), False, id="both-eager", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("nums,jit", SUBSETS)
@pytest.mark.parametrize("group", list(GROUPS))
def test_complex_rules_match_jax_grad(group, nums, jit):
    f = JAX_GROUPS[group]
    with jax.enable_x64(True):
        args = _args()
        g = rf.grad(rf.lift(f), argnums=nums)
        got = (jax.jit(g) if jit else g)(*args)
        want = jax.jit(jax.grad(f, argnums=nums))(*args)
        chex.assert_trees_all_equal_dtypes(got, want)
        chex.assert_trees_all_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("group", list(GROUPS))
def test_complex_rules_match_finite_differences(group):
    """The same programs against float64 central differences along random complex
    directions ``v``: with jax.grad's convention the derivative of the loss along
    ``v`` is ``Re(sum(g * v))``. jax.grad is not the only oracle: jax 0.10's
    gradient of a complex ``acosh`` had the wrong sign off the real axis, and rf's
    rule agreed with it."""
    f = FD_GROUPS[group]
    with jax.enable_x64(True):
        z, w = _args()
        gz, gw = jax.jit(rf.grad(rf.lift(f), argnums=(0, 1)))(z, w)
        fj = jax.jit(f)
        rng = np.random.default_rng(5)
        h = 1e-6
        for _ in range(3):
            vz, vw = _c(rng, 3, 4), _c(rng, 3, 4)
            fd = (fj(z + h * vz, w + h * vw) - fj(z - h * vz, w - h * vw)) / (2 * h)
            got = jnp.real(jnp.sum(gz * vz) + jnp.sum(gw * vw))
            np.testing.assert_allclose(got, fd, rtol=2e-6, atol=2e-6)


def test_every_complex_rule_is_exercised():
    """Each rule listed as accepting complex values is emitted with a complex
    operand by one of the programs above."""
    seen: set[str] = set()

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if any(jnp.iscomplexobj(jnp.zeros((), v.aval.dtype)) for v in (*e.invars, *e.outvars)):
                seen.add(e.primitive.name)
            for p in e.params.values():
                for q in p if isinstance(p, (tuple, list)) else (p,):
                    inner = getattr(q, "jaxpr", q)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    with jax.enable_x64(True):
        for f in GROUPS.values():
            walk(jax.make_jaxpr(f)(*_args()).jaxpr)
    # primitives that only forward their operand (or call a body checked rule by rule)
    # and those jax.numpy emits for complex values only in programs jax.grad refuses
    untested = {"add_any", "copy_p", "expand_dims", "optimization_barrier", "sharding_constraint", "reshard"}
    untested |= {"custom_vjp_call", "custom_vjp_call_jaxpr", "checkpoint"}
    untested |= {"custom_linear_solve", "reduce"}
    missing = COMPLEX_OK - seen - untested
    assert not missing, missing


# products of a real and a complex operand: jax.numpy passes the two dtypes to one
# dot_general, whose real operand's gradient is the real part of the complex product
MIXED = {
    "real @ complex": lambda a, b: jnp.cos(a) @ b,
    "complex @ real": lambda a, b: b.T @ jnp.cos(a).T,
    "batched einsum": lambda a, b: jnp.einsum("bij,bjk->bik", jnp.stack([a, a * a]), jnp.stack([b, 2 * b])),
    # x @ W with x computed elementwise in the program: the weight gradient as one 2-D dot
    "weight gradient": lambda a, b: jnp.sin(jnp.stack([b.T, b.T * 0.5])) @ a.T,
}


@pytest.mark.parametrize("nums", [(0,), (1,), (0, 1)], ids=["real", "complex", "both"])
@pytest.mark.parametrize("name", list(MIXED))
def test_product_of_a_real_and_a_complex_operand(name, nums):
    """Each operand alone and both, against jax.grad and float64 central differences;
    a warning is an error here, so casting the complex cotangent to the real operand's
    dtype (which jax deprecates) fails this test as it failed qujax's density tensors.
    Standard promotion, jax's default, lets jax.numpy mix the two dtypes."""
    f = lambda a, b: _real_loss(MIXED[name](a, b))  # noqa: E731
    with jax.enable_x64(True), jax.numpy_dtype_promotion("standard"):
        rng = np.random.default_rng(7)
        a, b = jnp.asarray(rng.standard_normal((3, 4))), _c(rng, 4, 2)
        got = rf.grad(rf.lift(f), argnums=nums)(a, b)
        chex.assert_trees_all_equal_dtypes(got, jax.grad(f, argnums=nums)(a, b))
        chex.assert_trees_all_close(got, jax.grad(f, argnums=nums)(a, b), rtol=1e-10, atol=1e-12)
        got_jit = jax.jit(rf.grad(rf.lift(f), argnums=nums))(a, b)
        chex.assert_trees_all_close(got_jit, got, rtol=1e-12, atol=1e-12)
        h = 1e-6
        for _ in range(2):
            va, vb = jnp.asarray(rng.standard_normal((3, 4))), _c(rng, 4, 2)
            va, vb = (va if 0 in nums else 0 * va), (vb if 1 in nums else 0 * vb)
            fd = (f(a + h * va, b + h * vb) - f(a - h * va, b - h * vb)) / (2 * h)
            g = dict(zip(nums, got))
            along = jnp.sum(g.get(0, 0 * a) * va) + jnp.real(jnp.sum(g.get(1, 0 * b) * vb))
            np.testing.assert_allclose(along, fd, rtol=1e-7, atol=1e-7)


def test_abs_of_complex():
    """``sum(abs(v * (1 + 2j)))``: jax.grad gives sqrt(5) sign(v) (rf gave
    -1.34 sign(v)), through rf.lift and through rnp.abs on a complex Tensor."""
    with jax.enable_x64(True):
        v = jnp.array([0.5, -1.5, 2.0, -0.1])
        f = lambda v: jnp.sum(jnp.abs(v.astype(jnp.complex128) * (1 + 2j)))  # noqa: E731
        want = np.sqrt(5.0) * np.sign(v)
        np.testing.assert_allclose(jax.grad(f)(v), want, rtol=1e-12)
        np.testing.assert_allclose(rf.grad(rf.lift(f))(v), want, rtol=1e-12)
        z = lax.complex(v, 2 * v)
        np.testing.assert_allclose(rf.grad(lambda z: rf.sum(rnp.abs(z)))(z), jax.grad(lambda z: jnp.sum(jnp.abs(z)))(z))
        np.testing.assert_allclose(rf.grad(lambda z: rf.sum(abs(z)))(z), np.conj(z) / np.abs(z))


def test_abs_at_zero():
    """jax.grad(jnp.abs)(0.) is 1 for a real operand, 0 for a complex one."""
    x = jnp.zeros(3)
    np.testing.assert_array_equal(rf.grad(lambda x: rf.sum(rnp.abs(x)))(x), [1, 1, 1])
    np.testing.assert_array_equal(rf.grad(rf.lift(lambda x: jnp.sum(jnp.abs(lax.complex(x, x * 0)))))(x), [0, 0, 0])


def test_grad_accepts_complex_inputs_as_jax_grad_does():
    with jax.enable_x64(True):
        z, w = _args()
        f = lambda z, w: jnp.sum(jnp.abs(jnp.sin(z) * w) ** 2)  # noqa: E731
        got = rf.grad(rf.lift(f), argnums=(0, 1))(z, w)
        chex.assert_trees_all_close(got, jax.grad(f, argnums=(0, 1))(z, w), rtol=1e-10)
        with pytest.raises(TypeError, match="real-valued outputs"):
            rf.grad(rf.lift(lambda z: jnp.sum(z)))(z)


def test_a_rule_not_checked_for_complex_refuses_them():
    """A maximum of complex values (lexicographic) has no rule checked for them: an
    error naming the primitive, not a value that might be wrong (Note [Complex
    gradients]: under jax.jit, XLA:CPU's complex products defeat the comparison);
    nor has a complete QR of a tall complex matrix."""
    z, w = _args()
    with pytest.raises(rf.AutogradError, match=r"'reduce_max'.*complex"):
        rf.grad(rf.lift(lambda z: jnp.real(jnp.max(z))))(z)
    for f, name in ((jnp.maximum, "max"), (jnp.minimum, "min"), (lax.cummax, "cummax"), (lax.cummin, "cummin")):
        with pytest.raises(rf.AutogradError, match=rf"'{name}'.*complex"):
            rf.grad(rf.lift(lambda z, f=f: jnp.sum(jnp.real(f(z, w) if f in (jnp.maximum, jnp.minimum) else f(z)))))(z)
    with pytest.raises(rf.AutogradError, match=r"full_matrices=True.*complex"):
        rf.grad(rf.lift(lambda z: jnp.sum(jnp.real(jnp.linalg.qr(z.T, mode="complete")[0]))))(z)


def _solve_with(opts, nums, fixed):
    """``triangular_solve`` as a function of the arguments at ``nums`` only."""

    def f(*given):
        full = list(fixed)
        for k, v in zip(nums, given):
            full[k] = v
        return lax.linalg.triangular_solve(*full, **opts)

    return f


@pytest.mark.parametrize("dtype", [pytest.param("float64", marks=pytest.mark.slow), "complex128"])
def test_triangular_solve_every_option_and_argument(dtype):
    """``lax.linalg.triangular_solve`` with each of its 32 option sets (lower,
    transpose_a, conjugate_a, unit_diagonal, left_side), each argument alone and
    both, against ``jax.vjp``, and both against a float64 central difference: rf's
    rule dropped the conjugation of ``a``'s gradient (``conjugate_a=True``, used by
    ``solve_triangular(trans="C")`` and ``cho_solve``) and returned a wrong complex
    gradient with no error."""
    cplx = dtype == "complex128"
    with jax.enable_x64(True):
        rng = np.random.default_rng(4)
        z, b_left, b_right = (
            _c(rng, *s) if cplx else jnp.asarray(rng.standard_normal(s)) for s in ((4, 4), (4, 3), (3, 4))
        )
        for lower, trans, conj, unit, left in itertools.product([False, True], repeat=5):
            tri = (jnp.tril if lower else jnp.triu)(jnp.ones((4, 4), z.dtype))
            a = tri * z + 4 * jnp.eye(4, dtype=z.dtype)
            b = b_left if left else b_right
            opts = dict(lower=lower, transpose_a=trans, conjugate_a=conj, unit_diagonal=unit, left_side=left)
            ct = jnp.asarray(np.cos(np.arange(b.size)).reshape(b.shape) * (1 - 0.5j if cplx else 1))
            for nums in ((0,), (1,), (0, 1)):
                f = _solve_with(opts, nums, (a, b))
                primals = [(a, b)[k] for k in nums]
                got = rf.vjp(rf.lift(f), *primals)[1](ct)
                want = jax.jit(lambda ct, *p, f=f: jax.vjp(f, *p)[1](ct))(ct, *primals)  # one program
                chex.assert_trees_all_close(got, want, rtol=1e-10, atol=1e-10, custom_message=str((opts, nums)))
            # Re<ct, f> along a direction of the triangle the solve reads and of b
            v = (tri * (0.7 + 0.2j if cplx else 0.7), jnp.ones_like(b) * 0.3)
            h = 1e-6
            step = f(a + h * v[0], b + h * v[1]) - f(a - h * v[0], b - h * v[1])
            fd = jnp.real(jnp.sum(ct * step)) / (2 * h)
            lin = sum(jnp.real(jnp.sum(g * d)) for g, d in zip(got, v))
            np.testing.assert_allclose(lin, fd, rtol=1e-6, atol=1e-8, err_msg=str(opts))


# -- asin, acos, asinh and acosh on their branch cuts ----------------------------------

# the derivative of each function, written to be evaluated off the cuts (numpy complex)
_INVERSE = {
    "asin": (jnp.arcsin, np.arcsin, lambda z: 1 / np.sqrt(1 - z * z)),
    "acos": (jnp.arccos, np.arccos, lambda z: -1 / np.sqrt(1 - z * z)),
    "asinh": (jnp.arcsinh, np.arcsinh, lambda z: 1 / np.sqrt(1 + z * z)),
    "acosh": (jnp.arccosh, np.arccosh, lambda z: 1 / (np.sqrt(z - 1) * np.sqrt(z + 1))),
}
_TINY = 1e-200


def _cut_points(name):
    """Points on the function's cuts (and on the axis beside them), with either sign
    of zero: the real axis, the imaginary axis for asinh."""
    along = [-3.0, -1.5, -0.5, 0.5, 1.5, 3.0]
    if name == "asinh":
        return [complex(s, t) for t in along for s in (0.0, -0.0)]
    return [complex(t, s) for t in along for s in (0.0, -0.0)]


def _off_the_cut(z, sign, name):
    """``z`` moved off its axis by a tiny step to the side ``sign``."""
    return complex(sign * _TINY, z.imag) if name == "asinh" else complex(z.real, sign * _TINY)


def _side_of(f, z, name):
    """+1 or -1: the side of the cut whose values ``f`` takes at ``z``."""
    at = complex(f(z))
    for sign in (1, -1):
        if np.isclose(at, complex(f(_off_the_cut(z, sign, name))), rtol=1e-12, atol=0):
            return sign
    raise AssertionError(f"{name}({z}) = {at} is on neither side")


def _cut_loss(f):
    # a real loss weighing both parts: jax.grad's convention gives (1 - 0.5i) f'(z)
    return lambda z: jnp.sum(jnp.real(f(z)) + 0.5 * jnp.imag(f(z)))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(_INVERSE))
def test_inverse_functions_on_their_branch_cuts(name, jit):
    """On a branch cut the function takes one side's values, and its gradient must be
    that side's limit (Note [Derivatives on a branch cut]). Checked at points on each
    cut, with either sign of zero, against the analytic derivative just off the cut
    on that side, and its component along the cut against central differences along
    the cut. ``1/sqrt(1 - z*z)`` (jax 0.10.2's asin rule, rf's before) gave the
    other side's value at ``asin(1.5+0j)``, a complex made from a real value."""
    f, _, deriv = _INVERSE[name]
    with jax.enable_x64(True):
        pts = _cut_points(name)
        grad = rf.grad(rf.lift(_cut_loss(f)))
        got = np.asarray((jax.jit(grad) if jit else grad)(jnp.asarray(pts)))
        h = 1e-6
        for z, g in zip(pts, got, strict=True):
            side = _side_of(lambda v: f(jnp.asarray(v)), z, name)
            want = (1 - 0.5j) * deriv(_off_the_cut(z, side, name))
            np.testing.assert_allclose(g, want, rtol=1e-10, err_msg=f"{name} at {z}")
            # along the cut, the zero part kept exactly (complex(x + h, -0.0), not z + h)
            if name == "asinh":
                step = [complex(z.real, z.imag + h), complex(z.real, z.imag - h)]
                along = -g.imag  # dL/dy
            else:
                step = [complex(z.real + h, z.imag), complex(z.real - h, z.imag)]
                along = g.real  # dL/dx
            up, down = (float(_cut_loss(f)(jnp.asarray(v))) for v in step)
            np.testing.assert_allclose(along, (up - down) / (2 * h), rtol=1e-6, err_msg=f"{name} at {z}")


@pytest.mark.parametrize("name", list(_INVERSE))
def test_inverse_derivative_follows_the_side_the_value_is_on(name):
    """XLA's functions take the same side for either sign of zero, so the rule's
    reading of the side from the function's value is checked with values that take
    the side of the zero's sign, as C99 and NumPy do: the derivative is that side's."""
    from rumus_fx.lift.rules_elementwise import _inverse_derivative

    _, fn_np, deriv = _INVERSE[name]
    sign_of_asin = -1 if name == "acos" else 1  # acos's rule negates asin's derivative
    with jax.enable_x64(True):
        pts = _cut_points(name)
        for z in pts:
            value = fn_np(z)
            side = _side_of(fn_np, z, name)
            want = deriv(_off_the_cut(z, side, name)) * sign_of_asin
            got = complex(_inverse_derivative(name, jnp.asarray(z), jnp.asarray(value)))
            np.testing.assert_allclose(got, want, rtol=1e-10, err_msg=f"{name} at {z}")
        # the sides these points cover: both, so the conjugating branch is exercised
        assert {_side_of(fn_np, z, name) for z in pts} == {1, -1}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_exp2_at_overflow_multiplies_in_jaxs_order(jit):
    """Second order through a complex ``exp2`` whose value overflows (``2 ** 1e300``):
    the rule multiplied ``g * 2**x`` first, which made both parts of a complex ``g``
    infinite, and then by ``log 2`` (a complex number), which made them nan where
    jax.grad's ``(g * log 2) * 2**x`` is infinite (``tools/special_values.py --mode
    complex-second``). Below overflow the two orders agree with jax to rounding."""

    def first(z):
        e = jnp.exp2(z)
        return jnp.sum(jnp.real(e)) + 0.5 * jnp.sum(jnp.imag(e))

    def loss(z):
        g = jax.grad(first)(z)
        return jnp.sum(jnp.real(g)) + 0.5 * jnp.sum(jnp.imag(g))

    with jax.enable_x64(True):
        z = jnp.asarray([1e300 + 0j, 1e300 - 0j, 3.0 + 1.5j, -2.0 - 0.5j])
        grad = rf.grad(rf.lift(loss))
        got = np.asarray((jax.jit(grad) if jit else grad)(z))
        want = np.asarray(jax.grad(loss)(z))
        assert not np.isnan(got).any(), got
        np.testing.assert_allclose(got, want, rtol=1e-12)
        np.testing.assert_allclose(got, np.asarray(jax.jit(jax.grad(loss))(z)), rtol=1e-12)
