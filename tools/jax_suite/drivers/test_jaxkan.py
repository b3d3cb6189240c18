"""jaxkan: Kolmogorov-Arnold network layers and models (flax nnx) differentiated by
jax.grad with respect to their parameters (``nnx.Param`` state), their input and both,
eagerly and under jit (float64). Layers: the B-spline layers (``BaseLayer`` and
``SplineLayer``: orders 1-3, with and without the SiLU residual, external weights and
bias), Chebyshev (default arccos, modified recursion and exact flavours), Legendre
(default and exact), Fourier (smooth and plain initialisation), Gaussian RBF and sine
layers, with several initialisation schemes; inputs between the knots, exactly on the
spline knots (the order-0 indicator's jumps, the order-1 kinks), outside the grid and,
for the tanh-squashed Chebyshev basis, where tanh rounds to +-1 (arccos's infinite
slope). Grid updates inside the loss (adaptive grids from sorted inputs and the
coefficients refitted by batched least squares) for each layer type. Models: ``KAN``
stacks of each layer type, ``KKAN``, ``ActNet`` (with and without projections) and
``RGAKAN`` (plain, periodic and random-Fourier-feature embeddings). Physics-informed
losses: the residuals of jaxkan's PDEs (Allen-Cahn, Burgers, KdV, Helmholtz; jax.grad
inside them up to third order) and ``get_frob``/``get_complexity``
(input gradients) differentiated with respect to the parameters and the collocation
points; the RBA/RAD/causal weighting helpers and ``lr_anneal``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jaxkan.layers import (
    BaseLayer,
    ChebyshevLayer,
    FourierLayer,
    LegendreLayer,
    RBFLayer,
    SineLayer,
    SplineLayer,
)
from jaxkan.models.ActNet import ActNet
from jaxkan.models.KAN import KAN
from jaxkan.models.KKAN import KKAN
from jaxkan.models.RGAKAN import RGAKAN
from jaxkan.models.utils import get_complexity, get_frob
from jaxkan.pikan import adaptive, pde

jax.config.update("jax_enable_x64", True)
_rng = np.random.default_rng(0)
X = jnp.asarray(_rng.uniform(-0.9, 0.9, (5, 2)))
# G = 4 on (-1, 1): knots at -1, -0.5, 0, 0.5, 1 (and the extension's -1.5, 1.5, ...)
X_KNOTS = jnp.asarray([[-1.0, -0.5], [0.0, 0.5], [1.0, -1.5], [0.5, 0.0], [-0.5, 1.0]])
X_OUTSIDE = jnp.asarray([[1.7, -2.3], [-4.0, 0.2], [0.3, 5.0], [2.1, -1.2], [-1.05, 1.02]])
X_SATURATED = jnp.asarray([[25.0, -0.3], [-30.0, 0.4], [0.1, 40.0], [0.2, 0.7], [-19.5, 0.0]])
POINTS = {"generic": X, "knots": X_KNOTS, "outside": X_OUTSIDE}


def _run(loss, args, argnums_list, jit):
    for argnums in argnums_list:
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*args)


def _split(model):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, params, rest


def _model_grads(model, x, jit, out_weights=None, argnums=((0,), (1,), (0, 1))):
    graphdef, params, rest = _split(model)

    def loss(params, x):
        m = nnx.merge(graphdef, params, rest)
        y = m(x)
        w = jnp.linspace(0.5, 1.5, y.size).reshape(y.shape) if out_weights is None else out_weights
        return jnp.sum(jnp.sin(y) * w)

    _run(loss, (params, x), argnums, jit)


LAYERS = {
    "base_k3": lambda: BaseLayer(n_in=2, n_out=3, k=3, G=4),
    "base_k1_plain": lambda: BaseLayer(
        n_in=2, n_out=3, k=1, G=4, residual=None, external_weights=False, add_bias=False
    ),
    "base_k2_lecun": lambda: BaseLayer(n_in=2, n_out=3, k=2, G=4, init_scheme={"type": "lecun"}),
    "spline_k3": lambda: SplineLayer(n_in=2, n_out=3, k=3, G=4),
    "spline_k1_glorot": lambda: SplineLayer(n_in=2, n_out=3, k=1, G=4, residual=None, init_scheme={"type": "glorot"}),
    "chebyshev_default": lambda: ChebyshevLayer(n_in=2, n_out=3, D=4),
    "chebyshev_modified_res": lambda: ChebyshevLayer(
        n_in=2, n_out=3, D=4, flavor="modified", residual=nnx.silu, external_weights=True
    ),
    "chebyshev_exact_power": lambda: ChebyshevLayer(
        n_in=2, n_out=3, D=4, flavor="exact", init_scheme={"type": "power"}
    ),
    "legendre_default": lambda: LegendreLayer(n_in=2, n_out=3, D=4),
    "legendre_exact_res": lambda: LegendreLayer(
        n_in=2, n_out=3, D=3, flavor="exact", residual=nnx.silu, external_weights=True
    ),
    "fourier_smooth": lambda: FourierLayer(n_in=2, n_out=3, D=3),
    "fourier_plain": lambda: FourierLayer(n_in=2, n_out=3, D=3, smooth_init=False, add_bias=False),
    "rbf": lambda: RBFLayer(n_in=2, n_out=3, D=5, kernel={"type": "gaussian", "std": 0.7}),
    "rbf_res_glorot_fine": lambda: RBFLayer(
        n_in=2, n_out=3, D=4, residual=nnx.silu, external_weights=True, init_scheme={"type": "glorot_fine"}
    ),
    "sine": lambda: SineLayer(n_in=2, n_out=3, D=4),
    "sine_res_lecun": lambda: SineLayer(n_in=2, n_out=3, D=3, residual=nnx.silu, init_scheme={"type": "lecun"}),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", list(POINTS))
@pytest.mark.parametrize("layer", list(LAYERS))
def test_layer(layer, point, jit):
    _model_grads(LAYERS[layer](), POINTS[point], jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("layer", ["chebyshev_default", "chebyshev_modified_res", "chebyshev_exact_power"])
def test_chebyshev_saturated(layer, jit):
    """tanh(x) rounds to +-1: the default flavour's arccos has an infinite slope there."""
    _model_grads(LAYERS[layer](), X_SATURATED, jit)


GRID_UPDATES = {
    "base": ("base", {"k": 3, "G": 2}, 4),
    "spline": ("spline", {"k": 2, "G": 2}, 3),
    "chebyshev": ("chebyshev", {"D": 3}, 5),
    "legendre": ("legendre", {"D": 3}, 4),
    "fourier": ("fourier", {"D": 2}, 4),
    "rbf": ("rbf", {"D": 4}, 5),
    "sine": ("sine", {"D": 2}, 3),  # (larger sine bases make the refit's normal equations singular)
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("kind", list(GRID_UPDATES))
def test_update_grids(kind, jit):
    """The grid update (sorted inputs, least-squares refit of the coefficients) inside the loss."""
    layer_type, params_, new = GRID_UPDATES[kind]

    def make():
        return KAN([2, 2, 1], layer_type=layer_type, required_parameters=params_, seed=3)

    _, params, _ = _split(make())
    x_fit = jnp.asarray(_rng.uniform(-1.0, 1.0, (12, 2)))  # more points than basis functions

    def loss(params, x_fit):
        # a fresh model each time: the grids are plain attributes, shared by merged copies
        m = make()
        nnx.update(m, params)
        m.update_grids(x_fit, new)
        return jnp.sum(jnp.cos(m(X))) + jnp.sum(m(x_fit) ** 2)

    _run(loss, (params, x_fit), [(0,), (1,), (0, 1)], jit)


MODELS = {
    "kan_base": lambda: KAN([2, 3, 2], "base", {"k": 3, "G": 3}, seed=1),
    "kan_spline": lambda: KAN([2, 3, 2], "spline", {"k": 3, "G": 3}, seed=1),
    "kan_chebyshev": lambda: KAN([2, 3, 2], "chebyshev", {"D": 3, "flavor": "exact"}, seed=1),
    "kan_legendre": lambda: KAN([2, 3, 2], "legendre", {"D": 3}, seed=1),
    "kan_fourier": lambda: KAN([2, 3, 2], "fourier", {"D": 3}, seed=1),
    "kan_rbf": lambda: KAN([2, 3, 2], "rbf", {"D": 4}, seed=1),
    "kan_sine": lambda: KAN([2, 3, 2], "sine", {"D": 3}, seed=1),
    "kkan_sine": lambda: KKAN(n_in=2, n_out=2, m=3, seed=1),
    "kkan_chebyshev_relu": lambda: KKAN(
        n_in=2, n_out=1, m=3, activation="relu", outer_layer_type="chebyshev", outer_layer_params={"D": 3}, seed=1
    ),
    "actnet": lambda: ActNet([2, 3, 1], N=3, seed=1),
    "actnet_projections": lambda: ActNet([2, 3, 2], N=3, use_projections=True, omega0=2.0, seed=1),
    "rgakan": lambda: RGAKAN(n_in=2, n_out=1, n_hidden=4, num_blocks=2, D=3, sine_D=3, seed=1),
    "rgakan_periodic": lambda: RGAKAN(
        n_in=2, n_out=1, n_hidden=4, num_blocks=1, D=3, sine_D=2, period_axes={0: (2.0 * np.pi, True)}, seed=1
    ),
    "rgakan_rff_sine": lambda: RGAKAN(n_in=2, n_out=2, n_hidden=4, num_blocks=1, D=3, rff_std=1.0, sine_D=3, seed=1),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", list(MODELS))
def test_model(name, jit):
    _model_grads(MODELS[name](), X, jit)


PDES = {  # each inner jax.grad is probed too: a few equations only
    "allen_cahn": lambda: pde.get_ac_res(D=1e-2, c=2.0),
    "burgers": lambda: pde.get_burgers_res(),
    "kdv": lambda: pde.get_kdv_res(),
    "helmholtz": lambda: pde.get_helmholtz_res(),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("layer_type", ["chebyshev", "spline"])
@pytest.mark.parametrize("name", list(PDES))
def test_pde_residual(name, layer_type, jit):
    """A physics-informed loss: jax.grad of the network inside, up to third order (KdV)."""
    if layer_type == "spline" and name != "kdv":
        pytest.skip("one spline network (third order) is enough")
    req = {"D": 3, "flavor": "exact"} if layer_type == "chebyshev" else {"k": 3, "G": 2}
    model = KAN([2, 3, 1] if layer_type == "chebyshev" else [2, 1], layer_type, req, seed=2)
    graphdef, params, rest = _split(model)
    res_fn = PDES[name]()
    collocs = jnp.asarray(_rng.uniform(-0.8, 0.8, (4, 2)))

    def loss(params, collocs):
        m = nnx.merge(graphdef, params, rest)
        return jnp.mean(res_fn(m, collocs) ** 2)

    _run(loss, (params, collocs), [(0,), (1,), (0, 1)], jit)


@pytest.mark.parametrize("jit", [False, True])
def test_frob_complexity(jit):
    def make():
        return KAN([2, 3, 1], "chebyshev", {"D": 3}, seed=4)

    _, params, _ = _split(make())

    def loss(params, x):
        m = make()  # get_complexity's nnx.jit updates the model's Rngs: built inside the trace
        nnx.update(m, params)
        return get_frob(m, x[0]) + get_complexity(m, x[1:3], x[3:])

    _run(loss, (params, X), [(0,), (1,), (0, 1)], jit)


RESIDUALS = {
    "generic": jnp.asarray([[0.3], [-1.2], [0.7], [0.05]]),
    "tied_max": jnp.asarray([[0.9], [-0.9], [0.2], [0.0]]),  # |r| ties at the max; a zero
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", list(RESIDUALS))
def test_adaptive_weights(point, jit):
    r0 = RESIDUALS[point]
    causal = jnp.tril(jnp.ones((4, 4)))

    def loss(r, w, gamma):
        w_new = adaptive.update_rba_weights(r, w, gamma, 0.01)
        weighted = adaptive.apply_rba_weights(r, w_new)
        probs = adaptive.get_rad_probabilities(weighted, 1.5, 0.5)
        cw = adaptive.get_causal_weights(jnp.abs(r[:, 0]), causal, 1.0)
        return jnp.sum(weighted**2) + jnp.sum(probs * jnp.arange(4.0)) + jnp.sum(cw * r[:, 0] ** 2) + jnp.sum(w_new)

    args = (r0, jnp.asarray([[1.0], [0.5], [2.0], [1.5]]), jnp.asarray(0.99))
    _run(loss, args, [(0,), (1,), (2,), (0, 1, 2)], jit)


@pytest.mark.parametrize("jit", [False, True])
def test_lr_anneal(jit):
    def loss(g1, g2, lam):
        lams = adaptive.lr_anneal([{"a": g1}, {"a": g2, "b": g1 * 0.5}], [lam, 1.0], 0.9)
        return lams[0] * jnp.sum(g1) + lams[1] ** 2

    _run(loss, (X[:, 0], X[:, 1], jnp.asarray(2.0)), [(0,), (1,), (2,), (0, 1, 2)], jit)
