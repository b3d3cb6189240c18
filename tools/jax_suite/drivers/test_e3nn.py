"""e3nn-jax 0.21: equivariant ops and modules (tensor products, spherical harmonics,
gates, radial bases, S2 grids, rotations, scatter, flax/haiku/equinox layers), each
differentiated by jax.grad with respect to each argument alone and all, eagerly and
under jit."""

import e3nn_jax as e3nn
import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import pytest

jax.config.update("jax_enable_x64", True)
K = jax.random.PRNGKey


def ia(irreps, seed, lead=()):
    return e3nn.normal(irreps, K(seed), lead).array


def vec(seed, n=5):
    return jax.random.normal(K(seed), (n, 3))


def arr(a):
    return a.array if isinstance(a, e3nn.IrrepsArray) else a


def _weighted(out):
    out = arr(out)
    return jnp.sum(jnp.sin(out) * jnp.arange(1.0, 1.0 + out.size).reshape(out.shape))


IR1, IR2 = "2x0e + 1o + 2e", "0e + 2x1o + 1e"

CASES = {
    "tensor_product": (
        lambda a, b: e3nn.tensor_product(e3nn.IrrepsArray(IR1, a), e3nn.IrrepsArray(IR2, b)),
        (ia(IR1, 0, (3,)), ia(IR2, 1, (3,))),
    ),
    "tensor_product_filtered": (
        lambda a, b: e3nn.tensor_product(e3nn.IrrepsArray(IR1, a), e3nn.IrrepsArray(IR2, b), filter_ir_out="0e + 1o"),
        (ia(IR1, 2, (4,)), ia(IR2, 3, (4,))),
    ),
    "elementwise_tensor_product": (
        lambda a, b: e3nn.elementwise_tensor_product(e3nn.IrrepsArray("3x1o", a), e3nn.IrrepsArray("0e + 1e + 2e", b)),
        (ia("3x1o", 4, (2,)), ia("0e + 1e + 2e", 5, (2,))),
    ),
    "tensor_square": (lambda a: e3nn.tensor_square(e3nn.IrrepsArray(IR1, a)), (ia(IR1, 6, (3,)),)),
    "tensor_square_normalized": (
        lambda a: e3nn.tensor_square(e3nn.IrrepsArray(IR1, a), irrep_normalization="norm"),
        (ia(IR1, 7, (3,)),),
    ),
    "spherical_harmonics": (
        lambda x: e3nn.spherical_harmonics(4, e3nn.IrrepsArray("1o", x), normalize=True),
        (vec(8),),
    ),
    "spherical_harmonics_unnormalized": (
        lambda x: e3nn.spherical_harmonics("0e + 1o + 2e + 3o", x, normalize=False, normalization="norm"),
        (vec(9),),
    ),
    "spherical_harmonics_component_recursive": (
        lambda x: e3nn.spherical_harmonics(
            6,
            e3nn.IrrepsArray("1o", x),
            normalize=True,
            normalization="component",
            algorithm=("recursive", "sparse", "custom_jvp"),
        ),
        (vec(10),),
    ),
    "tp_with_sh": (
        lambda a, x: e3nn.tensor_product_with_spherical_harmonics(
            e3nn.IrrepsArray(IR1, a), e3nn.IrrepsArray("1o", x), 3
        ),
        (ia(IR1, 12, (5,)), vec(13)),
    ),
    "norm": (lambda a: e3nn.norm(e3nn.IrrepsArray(IR1, a)), (ia(IR1, 14, (4,)),)),
    "norm_squared": (
        lambda a: e3nn.norm(e3nn.IrrepsArray(IR1, a), squared=True, per_irrep=False),
        (ia(IR1, 15, (4,)),),
    ),
    "dot": (
        lambda a, b: e3nn.dot(e3nn.IrrepsArray(IR1, a), e3nn.IrrepsArray(IR1, b)),
        (ia(IR1, 16, (3,)), ia(IR1, 17, (3,))),
    ),
    "cross": (
        lambda a, b: e3nn.cross(e3nn.IrrepsArray("2x1o", a), e3nn.IrrepsArray("2x1e", b)),
        (ia("2x1o", 18), ia("2x1e", 19)),
    ),
    "gate": (
        lambda a: e3nn.gate(e3nn.IrrepsArray("4x0e + 2x0o + 1o + 2e + 1e", a)),
        (ia("4x0e + 2x0o + 1o + 2e + 1e", 20, (3,)),),
    ),
    "gate_acts": (
        lambda a: e3nn.gate(e3nn.IrrepsArray("3x0e + 1o + 2e", a), even_act=jax.nn.silu, even_gate_act=jnp.tanh),
        (ia("3x0e + 1o + 2e", 21, (3,)),),
    ),
    "norm_activation": (
        lambda a: e3nn.norm_activation(
            e3nn.IrrepsArray("0e + 1o + 2e", a), [jnp.tanh, jax.nn.sigmoid, jax.nn.softplus]
        ),
        (ia("0e + 1o + 2e", 22, (3,)),),
    ),
    "scalar_activation": (
        lambda a: e3nn.scalar_activation(e3nn.IrrepsArray("2x0e + 0o", a), [jax.nn.gelu, jnp.tanh]),
        (ia("2x0e + 0o", 23, (4,)),),
    ),
    "soft_one_hot_linspace": (
        lambda r: e3nn.soft_one_hot_linspace(r, start=0.0, end=2.0, number=8, basis="smooth_finite", cutoff=True),
        (jnp.array([0.3, 0.9, 1.4, 1.8]),),
    ),
    "soft_one_hot_gaussian": (
        lambda r: e3nn.soft_one_hot_linspace(r, start=0.0, end=2.0, number=6, basis="gaussian", cutoff=False),
        (jnp.array([0.3, 0.9, 1.4, 1.8]),),
    ),
    "bessel": (lambda r: e3nn.bessel(r, 8, x_max=2.0), (jnp.array([0.3, 0.9, 1.4, 1.8]),)),
    "poly_envelope": (lambda r: e3nn.poly_envelope(5, 2)(r), (jnp.array([0.1, 0.5, 0.8, 0.95]),)),
    "soft_envelope": (lambda r: e3nn.soft_envelope(r, x_max=2.0), (jnp.array([0.1, 0.5, 1.3, 1.95]),)),
    "sus": (lambda r: e3nn.sus(r), (jnp.array([-0.5, 0.2, 0.9, 3.0]),)),
    "soft_odd": (lambda r: e3nn.soft_odd(r), (jnp.array([-0.5, 0.2, 0.9, 3.0]),)),
    "to_s2grid": (
        lambda a: (
            e3nn.to_s2grid(
                e3nn.IrrepsArray("0e + 1o + 2e + 3o", a), 12, 11, quadrature="soft", p_val=1, p_arg=-1
            ).grid_values
        ),
        (ia("0e + 1o + 2e + 3o", 24, (2,)),),
    ),
    "s2grid_roundtrip": (
        lambda a: e3nn.from_s2grid(
            e3nn.to_s2grid(
                e3nn.IrrepsArray("0e + 1o + 2e", a), 10, 9, quadrature="gausslegendre", p_val=1, p_arg=-1
            ).apply(jnp.tanh),
            "0e + 1o + 2e",
        ),
        (ia("0e + 1o + 2e", 25),),
    ),
    "angles_to_matrix": (
        lambda a, b, c: e3nn.angles_to_matrix(a, b, c),
        (jnp.array([0.1, 1.2]), jnp.array([0.4, 2.0]), jnp.array([-0.7, 0.3])),
    ),
    "matrix_to_angles": (lambda R: jnp.stack(e3nn.matrix_to_angles(R)), (e3nn.rand_matrix(K(26), (3,)),)),
    "xyz_to_angles": (lambda x: jnp.stack(e3nn.xyz_to_angles(x)), (vec(27),)),
    "quaternion_to_matrix": (
        lambda q: e3nn.quaternion_to_matrix(q / jnp.linalg.norm(q, axis=-1, keepdims=True)),
        (jax.random.normal(K(28), (3, 4)),),
    ),
    "axis_angle_to_matrix": (
        lambda ax, an: e3nn.axis_angle_to_matrix(ax, an),
        (vec(29, 3), jnp.array([0.3, 1.1, -2.0])),
    ),
    "log_coordinates_to_matrix": (lambda l: e3nn.log_coordinates_to_matrix(l), (vec(30, 3) * 0.5,)),
    "irreps_transform_by_matrix": (
        lambda a, R: e3nn.IrrepsArray(IR1, a).transform_by_matrix(R),
        (ia(IR1, 31), e3nn.rand_matrix(K(32), ())),
    ),
    "irreps_transform_by_angles": (
        lambda a, al, be, ga: e3nn.IrrepsArray(IR1, a).transform_by_angles(al, be, ga),
        (ia(IR1, 33), jnp.array(0.3), jnp.array(1.1), jnp.array(-0.4)),
    ),
    "legendre": (
        lambda z, y: e3nn.legendre.legendre(4, z, y),
        (jnp.array([0.1, -0.5, 0.9]), jnp.array([0.99, 0.86, 0.43])),
    ),
    "scatter_sum": (
        lambda a: e3nn.scatter_sum(e3nn.IrrepsArray(IR1, a), dst=jnp.array([0, 2, 2, 1, 0]), output_size=3),
        (ia(IR1, 34, (5,)),),
    ),
    "scatter_mean": (
        lambda a: e3nn.scatter_mean(e3nn.IrrepsArray(IR1, a), dst=jnp.array([0, 2, 2, 1, 0]), output_size=4),
        (ia(IR1, 35, (5,)),),
    ),
    "scatter_max": (
        lambda a: e3nn.scatter_max(e3nn.IrrepsArray("3x0e", a), dst=jnp.array([0, 2, 2, 1, 0]), output_size=4),
        (ia("3x0e", 36, (5,)),),
    ),
    "index_add_nel": (
        lambda a: e3nn.index_add(n_elements=jnp.array([2, 0, 3]), input=e3nn.IrrepsArray(IR1, a)),
        (ia(IR1, 37, (5,)),),
    ),
    "concatenate_regroup": (
        lambda a, b: (
            e3nn.concatenate([e3nn.IrrepsArray(IR1, a), e3nn.IrrepsArray(IR2, b)]).regroup().filter(drop="2e") * 2.0
        ),
        (ia(IR1, 38, (2,)), ia(IR2, 39, (2,))),
    ),
    "mean_sum": (
        lambda a: e3nn.mean(e3nn.IrrepsArray(IR1, a), axis=0) + e3nn.sum(e3nn.IrrepsArray(IR1, a), axis=0),
        (ia(IR1, 40, (4,)),),
    ),
    "where": (
        lambda a, b: e3nn.where(
            jnp.array([[True], [False], [True]]), e3nn.IrrepsArray(IR1, a), e3nn.IrrepsArray(IR1, b)
        ),
        (ia(IR1, 41, (3,)), ia(IR1, 42, (3,))),
    ),
    "slice_by_mul_chunks": (
        lambda a: jnp.concatenate(
            [c.reshape(-1) for c in e3nn.IrrepsArray("3x1o + 2x2e", a).slice_by_mul[1:4].chunks if c is not None]
        ),
        (ia("3x1o + 2x2e", 43, (2,)),),
    ),
    "s2_dirac_conv": (
        lambda x: e3nn.s2_dirac(x, 3, p_val=1, p_arg=-1),
        (jnp.array([0.3, -0.5, 0.8]),),
    ),
    "reduced_symmetric_basis_contract": (
        lambda a: jnp.einsum("ijkz,i,j,k->z", e3nn.reduced_symmetric_tensor_product_basis("1o", 3).array, a, a, a),
        (jnp.array([0.3, -0.5, 0.8]),),
    ),
    "clebsch_gordan_contract": (
        lambda a, b: jnp.einsum("ijk,i,j->k", e3nn.clebsch_gordan(1, 2, 2), a, b),
        (jnp.array([0.3, -0.5, 0.8]), jax.random.normal(K(44), (5,))),
    ),
}


def _subsets(n):
    return [(i,) for i in range(n)] + ([tuple(range(n))] if n > 1 else [])


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_op(name, jit):
    f, args = CASES[name]
    for argnums in _subsets(len(args)):
        g = jax.grad(lambda *a: _weighted(f(*a)), argnums)
        (jax.jit(g) if jit else g)(*args)


@pytest.mark.parametrize(
    "name", ["tensor_product", "spherical_harmonics", "gate", "bessel", "to_s2grid", "norm_activation"]
)
def test_op_float32(name):
    f, args = CASES[name]
    args = tuple(jnp.asarray(a, jnp.float32) for a in args)
    for argnums in _subsets(len(args)):
        jax.grad(lambda *a: _weighted(f(*a)), argnums)(*args)


# -- modules --------------------------------------------------------------------
def _graph(seed, n=6):
    pos = jax.random.normal(K(seed), (n, 3))
    src = jnp.array([0, 1, 2, 3, 4, 5, 0, 2])
    dst = jnp.array([1, 2, 3, 4, 5, 0, 3, 5])
    return pos, src, dst


class FlaxConv(nn.Module):
    @nn.compact
    def __call__(self, pos, feats, src, dst):
        vecs = e3nn.IrrepsArray("1o", pos[dst] - pos[src])
        sh = e3nn.spherical_harmonics("0e + 1o + 2e", vecs, normalize=True, normalization="component")
        r = e3nn.norm(vecs).array[:, 0]
        emb = e3nn.soft_one_hot_linspace(r, start=0.0, end=4.0, number=6, basis="smooth_finite", cutoff=True) * 6**0.5
        x = e3nn.IrrepsArray("4x0e + 2x1o", feats)
        msg = e3nn.tensor_product(x[src], sh)
        w = e3nn.flax.MultiLayerPerceptron([16, msg.irreps.num_irreps], jax.nn.silu)(emb)
        msg = msg * w
        agg = e3nn.scatter_sum(msg, dst=dst, output_size=pos.shape[0]) / 2.0
        out = e3nn.flax.Linear("8x0e + 4x0o + 2x1o + 1e")(agg)
        out = e3nn.gate(out)
        return e3nn.flax.Linear("0e")(out).array.sum()


def test_flax_point_conv():
    pos, src, dst = _graph(50)
    feats = ia("4x0e + 2x1o", 51, (6,))
    m = FlaxConv()
    params = m.init(K(0), pos, feats, src, dst)
    for argnums in [(0,), (1,), (2,), (0, 1, 2)]:
        g = jax.grad(lambda p, q, f: m.apply(p, q, f, src, dst), argnums)
        g(params, pos, feats)
        jax.jit(g)(params, pos, feats)


def test_haiku_modules():
    def fwd(x, y):
        x = e3nn.IrrepsArray("3x0e + 2x1o + 1e", x)
        y = e3nn.IrrepsArray("2x0e + 1o", y)
        a = e3nn.haiku.FullyConnectedTensorProduct("4x0e + 2x1o + 2e")(x, y)
        b = e3nn.haiku.Linear("4x0e + 2x1o")(x)
        c = e3nn.haiku.SymmetricTensorProduct((1, 2))(
            e3nn.IrrepsArray("2x0e + 2x1o", b.filter(keep="0e + 1o").array[..., :8])
        )
        mlp = e3nn.haiku.MultiLayerPerceptron([8, 4], jax.nn.gelu)(e3nn.norm(a).array)
        return _weighted(a) + _weighted(c) + jnp.sum(mlp**2)

    f = hk.without_apply_rng(hk.transform(fwd))
    x, y = ia("3x0e + 2x1o + 1e", 60, (4,)), ia("2x0e + 1o", 61, (4,))
    p = f.init(K(1), x, y)
    for argnums in [(0,), (1,), (2,), (0, 1, 2)]:
        g = jax.grad(f.apply, argnums)
        g(p, x, y)
        jax.jit(g)(p, x, y)


def test_haiku_batchnorm():
    def fwd(x, is_training):
        x = e3nn.IrrepsArray("2x0e + 2x1o + 2e", x)
        return e3nn.haiku.BatchNorm(instance=False)(x, is_training=is_training)

    f = hk.transform_with_state(fwd)
    x = ia("2x0e + 2x1o + 2e", 62, (8,))
    p, s = f.init(K(2), x, True)

    def loss(p, x):
        out, _ = f.apply(p, s, None, x, True)
        return _weighted(out)

    for argnums in [(0,), (1,), (0, 1)]:
        jax.grad(loss, argnums)(p, x)
        jax.jit(jax.grad(loss, argnums))(p, x)


def test_flax_batchnorm():
    m = e3nn.flax.BatchNorm(instance=True)
    x = e3nn.IrrepsArray("2x0e + 2x1o", ia("2x0e + 2x1o", 63, (3, 5)))
    v = m.init(K(3), x)

    def loss(p, a):
        out, _ = m.apply(
            {"params": p, **{k: v[k] for k in v if k != "params"}},
            e3nn.IrrepsArray("2x0e + 2x1o", a),
            mutable=["batch_stats"],
        )
        return _weighted(out)

    for argnums in [(0,), (1,), (0, 1)]:
        jax.grad(loss, argnums)(v.get("params", {}), x.array)


def test_equinox_linear():
    lin = e3nn.equinox.Linear(irreps_out="3x0e + 2x1o + 2e", irreps_in="2x0e + 1o + 2e + 1e", key=K(4))
    x = ia("2x0e + 1o + 2e + 1e", 64, (3,))

    def loss(m, a):
        return _weighted(jax.vmap(m)(e3nn.IrrepsArray("2x0e + 1o + 2e + 1e", a)))

    eqx.filter_grad(loss)(lin, x)  # equinox's own wrapper of jax.grad
    params, static = eqx.partition(lin, eqx.is_array)
    for argnums in [(0,), (1,), (0, 1)]:
        jax.grad(lambda p, a: loss(eqx.combine(p, static), a), argnums)(params, x)


def test_legacy_fctp():
    tp = e3nn.legacy.FunctionalFullyConnectedTensorProduct(
        e3nn.Irreps("2x0e + 1o + 2e"), e3nn.Irreps("0e + 1o"), e3nn.Irreps("3x0e + 2x1o + 1e + 2e")
    )
    ws = [jax.random.normal(K(70 + i), ins.path_shape) for i, ins in enumerate(tp.instructions)]
    x, y = ia("2x0e + 1o + 2e", 71), ia("0e + 1o", 72)

    def loss(ws, a, b):
        return _weighted(tp.left_right(ws, e3nn.IrrepsArray("2x0e + 1o + 2e", a), e3nn.IrrepsArray("0e + 1o", b)))

    for argnums in [(0,), (1,), (2,), (0, 1, 2)]:
        jax.grad(loss, argnums)(ws, x, y)
        jax.jit(jax.grad(loss, argnums))(ws, x, y)


def test_forces_and_hessian_vector():
    """An energy of positions through a point convolution, its force, and the force's
    own derivative along a direction (grad of a grad dot v)."""
    pos, src, dst = _graph(80)
    feats = ia("4x0e + 2x1o", 81, (6,))
    m = FlaxConv()
    params = m.init(K(5), pos, feats, src, dst)

    def energy(q):
        return m.apply(params, q, feats, src, dst)

    v = jax.random.normal(K(82), pos.shape)
    jax.grad(lambda q: jnp.vdot(jax.grad(energy)(q), v))(pos)
