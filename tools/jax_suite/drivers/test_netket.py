"""NetKet: variational wave functions (flax models evaluated with ``model.apply``:
RBM with real and complex parameters, RBMModPhase, RBMSymm, Jastrow, MLP with GELU and
with a ReLU at its kink, GCNN, LogStateVector, autoregressive ARNNDense/ARNNConv1D and
a fermionic Slater determinant) differentiated by jax.grad with respect to the
parameters (real and complex trees), the spin configurations as floats and both, eagerly
and under jit: the real part of the log-amplitude, normalised |psi|^2 over a few
configurations, local energies of Ising, Heisenberg and hand-built ``LocalOperator``
Hamiltonians through ``get_conn_padded`` (also with respect to the matrix elements, and
an ``IsingJax`` built from a traced field), exact energies from dense Hamiltonians (with
respect to a coupling too), NetKet's own ``nk.jax.expect`` estimator (a custom_vjp),
``logsumexp_cplx``/``logdet_cmplx`` and the activations at 0; and the jax.vjp calls
inside ``FullSumState``/``MCState`` (fixed seeds, 64 samples, chunked and not)
``expect_and_grad`` and ``expect_and_forces``, and inside the QGTOnTheFly /
QGTJacobianDense / QGTJacobianPyTree matrix-vector products (also differentiated with
respect to the vector)."""

import jax
import jax.numpy as jnp
import netket as nk
import numpy as np
import pytest

jax.config.update("jax_enable_x64", True)
N = 4
HI = nk.hilbert.Spin(0.5, N=N)
GRAPH = nk.graph.Chain(N)
ALL = jnp.asarray(HI.all_states(), dtype=jnp.float64)
SIGMA = ALL[jnp.array([0, 3, 6, 9, 15])]  # a few +-1 configurations

MODELS = {
    "rbm_real": lambda: nk.models.RBM(alpha=1, param_dtype=float),
    "rbm_complex": lambda: nk.models.RBM(alpha=1, param_dtype=complex),
    "rbm_modphase": lambda: nk.models.RBMModPhase(alpha=1),
    "rbm_symm": lambda: nk.models.RBMSymm(symmetries=GRAPH.translation_group(), alpha=1, param_dtype=complex),
    "jastrow_real": lambda: nk.models.Jastrow(param_dtype=float),
    "jastrow_complex": lambda: nk.models.Jastrow(param_dtype=complex),
    "mlp_gelu": lambda: nk.models.MLP(hidden_dims=(4,), param_dtype=complex),
    # bias initialised to 0: at the input 0 every hidden unit sits on the ReLU's kink
    "mlp_relu": lambda: nk.models.MLP(hidden_dims=(4,), hidden_activations=nk.nn.reim_relu, use_output_bias=True),
    "gcnn": lambda: nk.models.GCNN(symmetries=GRAPH, layers=1, features=2, param_dtype=complex),
    "logstatevector": lambda: nk.models.LogStateVector(HI, param_dtype=complex),
    "arnn_dense": lambda: nk.models.ARNNDense(hilbert=HI, layers=2, features=3),
    "arnn_conv1d": lambda: nk.models.ARNNConv1D(hilbert=HI, layers=2, features=2, kernel_size=2),
}
# models whose input is not a continuous function of the configuration (indices of
# local states, a lookup in a table): differentiated with respect to the parameters only
DISCRETE_INPUT = {"logstatevector", "arnn_dense", "arnn_conv1d"}
INPUTS = {
    "spins": SIGMA,
    "generic": SIGMA * 0.8 + 0.05 * jnp.arange(SIGMA.size).reshape(SIGMA.shape) / SIGMA.size,
    "zero": jnp.zeros_like(SIGMA),
}


ZERO_MODELS = {"rbm_complex", "rbm_modphase", "jastrow_real", "mlp_gelu", "mlp_relu", "gcnn"}


def _init(name, x=SIGMA):
    model = MODELS[name]()
    return model, model.init(jax.random.PRNGKey(1), x)


def _argnums(name):
    return [(0,)] if name in DISCRETE_INPUT else [(0,), (1,), (0, 1)]


def _grad(loss, argnums, jit, *args):
    g = jax.grad(loss, argnums)
    return (jax.jit(g) if jit else g)(*args)


# the input 0 (a kink of the ReLU MLP) only for the models with a continuous input
LOG_AMPLITUDE_CASES = [(m, i) for m in MODELS for i in INPUTS if i != "zero" or m in ZERO_MODELS]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name,inp", LOG_AMPLITUDE_CASES)
def test_log_amplitude(name, inp, jit):
    model, params = _init(name)
    x = SIGMA if name in DISCRETE_INPUT else INPUTS[inp]
    w = jnp.linspace(0.5, 1.5, x.shape[0])

    def loss(params, x):
        logpsi = model.apply(params, x)
        return jnp.sum(w * jnp.real(logpsi)) + 0.3 * jnp.sum(jnp.sin(jnp.imag(logpsi)))

    for argnums in _argnums(name):
        _grad(loss, argnums, jit, params, x)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", list(MODELS))
def test_probability(name, jit):
    model, params = _init(name)
    c = jnp.linspace(-1.0, 2.0, SIGMA.shape[0])

    def loss(params, x):
        logp = 2 * jnp.real(model.apply(params, x))
        p = jnp.exp(logp - jnp.max(logp))
        return jnp.sum(c * p / jnp.sum(p))

    for argnums in _argnums(name):
        _grad(loss, argnums, jit, params, SIGMA)


def _local_operator():
    sx, sz = nk.operator.spin.sigmax, nk.operator.spin.sigmaz
    op = sum(0.8 * sx(HI, i) for i in range(N))
    op += sum(-1.3 * sz(HI, i) @ sz(HI, (i + 1) % N) for i in range(N))
    return op + 0.4 * nk.operator.spin.sigmay(HI, 0) @ nk.operator.spin.sigmay(HI, 2)


HAMILTONIANS = {
    "ising": lambda: nk.operator.Ising(HI, GRAPH, h=0.7, J=-1.1),
    "heisenberg": lambda: nk.operator.Heisenberg(HI, GRAPH, J=0.9),
    "local_operator": _local_operator,
}
LOCAL_MODELS = ["rbm_real", "rbm_complex", "rbm_modphase", "jastrow_complex", "mlp_gelu", "arnn_dense"]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("ham", list(HAMILTONIANS))
@pytest.mark.parametrize("name", LOCAL_MODELS)
def test_local_energy(name, ham, jit):
    model, params = _init(name)
    H = HAMILTONIANS[ham]()
    eta, mels = H.get_conn_padded(np.asarray(SIGMA, dtype=np.int8))
    eta = jnp.asarray(eta, dtype=jnp.float64)
    mels = jnp.asarray(mels)

    def loss(params, mels):
        lp_s = model.apply(params, SIGMA)
        lp_e = model.apply(params, eta.reshape(-1, N)).reshape(eta.shape[:2])
        e_loc = jnp.sum(mels * jnp.exp(lp_e - lp_s[:, None]), axis=1)
        return jnp.mean(jnp.real(e_loc)) + 0.2 * jnp.mean(jnp.imag(e_loc) ** 2)

    for argnums in [(0,), (1,), (0, 1)]:
        _grad(loss, argnums, jit, params, mels)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", ["rbm_complex", "jastrow_real", "mlp_relu"])
def test_local_energy_traced_field(name, jit):
    """IsingJax built inside the loss from a traced field: its connected elements carry it."""
    model, params = _init(name)

    def loss(params, h):
        H = nk.operator.IsingJax(HI, GRAPH, h=h, J=0.5)
        eta, mels = H.get_conn_padded(SIGMA)
        lp_e = model.apply(params, eta.reshape(-1, N)).reshape(eta.shape[:2])
        e_loc = jnp.sum(mels * jnp.exp(lp_e - model.apply(params, SIGMA)[:, None]), axis=1)
        return jnp.mean(jnp.real(e_loc))

    for h in [0.7, 0.0]:
        for argnums in [(0,), (1,), (0, 1)]:
            _grad(loss, argnums, jit, params, jnp.asarray(h))


HZZ = jnp.asarray(nk.operator.Ising(HI, GRAPH, h=0.0, J=1.0).to_dense())
HX = jnp.asarray(sum(nk.operator.spin.sigmax(HI, i) for i in range(N)).to_dense())


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", list(MODELS))
def test_exact_energy(name, jit):
    model, params = _init(name)

    def loss(params, h):
        logpsi = model.apply(params, ALL)
        psi = jnp.exp(logpsi - jnp.max(jnp.real(logpsi)))
        H = HZZ - h * HX
        return jnp.real(jnp.vdot(psi, H @ psi)) / jnp.real(jnp.vdot(psi, psi))

    for argnums in [(0,), (1,), (0, 1)]:
        _grad(loss, argnums, jit, params, jnp.asarray(0.9))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", ["rbm_real", "rbm_complex", "jastrow_complex"])
def test_nk_jax_expect(name, jit):
    """NetKet's Monte-Carlo estimator ``nk.jax.expect`` (a custom_vjp adding the score term)."""
    model, params = _init(name)
    H = nk.operator.Ising(HI, GRAPH, h=0.7)
    eta, mels = H.get_conn_padded(np.asarray(SIGMA, dtype=np.int8))
    eta = jnp.asarray(eta, dtype=jnp.float64)

    def log_pdf(p, x):
        return 2 * jnp.real(model.apply(p, x))

    def e_loc(p, x, eta, mels):
        lp_e = model.apply(p, eta.reshape(-1, N)).reshape(eta.shape[:2])
        return jnp.sum(mels * jnp.exp(lp_e - model.apply(p, x)[:, None]), axis=1)

    def loss(params, mels):
        mean, _ = nk.jax.expect(log_pdf, lambda p, x, e, m: jnp.real(e_loc(p, x, e, m)), params, SIGMA, eta, mels)
        return mean

    for argnums in [(0,), (1,), (0, 1)]:
        _grad(loss, argnums, jit, params, jnp.asarray(mels))


@pytest.mark.parametrize("jit", [False, True])
def test_nk_jax_helpers(jit):
    a = jnp.array([[1.2 + 0.3j, -0.4 + 0.1j, 0.5], [0.2, 0.9 - 0.2j, -0.3j], [0.1j, 0.3, 1.1 + 0.4j]])
    b = jnp.array([0.3, -0.2, 1.1])

    def loss(re, im, b):
        z = re + 1j * im
        l1 = nk.jax.logsumexp_cplx(z, b=b)
        l2 = nk.jax.logdet_cmplx(z)
        return jnp.real(l1) + jnp.sin(jnp.imag(l1)) + jnp.real(l2) + jnp.cos(jnp.imag(l2))

    for argnums in [(0,), (1,), (2,), (0, 1, 2)]:
        _grad(loss, argnums, jit, jnp.real(a), jnp.imag(a), b)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", ["generic", "zero"])
def test_activations(point, jit):
    x = jnp.array([0.7, -1.3, 2.1, 25.0]) if point == "generic" else jnp.zeros(4)
    y = jnp.array([-0.4, 0.2, 1.1, -0.3]) if point == "generic" else jnp.zeros(4)
    acts = [nk.nn.log_cosh, nk.nn.log_tanh, nk.nn.reim_relu, nk.nn.reim_selu]

    def loss(x, y):
        z = x + 1j * y
        out = sum(jnp.sum(jnp.real(f(z)) + 0.5 * jnp.imag(f(z))) for f in acts) + jnp.sum(nk.nn.log_cosh(x))
        return out + jnp.sum(jnp.real(nk.nn.log_sinh(z + 0.3)))

    for argnums in [(0,), (1,), (0, 1)]:
        _grad(loss, argnums, jit, x, y)


@pytest.mark.parametrize("jit", [False, True])
def test_slater(jit):
    hi = nk.hilbert.SpinOrbitalFermions(4, n_fermions=2)
    model = nk.models.Slater2nd(hi, param_dtype=complex)
    x = jnp.asarray(hi.all_states(), dtype=jnp.float64)
    params = model.init(jax.random.PRNGKey(0), x)

    def loss(params):
        logpsi = model.apply(params, x)
        return jnp.sum(jnp.real(logpsi) * jnp.arange(x.shape[0])) + jnp.sum(jnp.cos(jnp.imag(logpsi)))

    _grad(loss, (0,), jit, params)


# Below, NetKet jits its own expect_and_grad / QGT products: the jax.vjp calls the
# probe sees are all inside its traces, so there is no eager/jit parametrization.
VS_MODELS = ["rbm_real", "rbm_complex", "rbm_modphase", "jastrow_complex", "gcnn"]


FULLSUM_CASES = [(m, "ising") for m in VS_MODELS] + [
    ("rbm_complex", "heisenberg"),
    ("jastrow_complex", "local_operator"),
]


@pytest.mark.parametrize("name,ham", FULLSUM_CASES)
def test_fullsum_state(name, ham):
    vs = nk.vqs.FullSumState(HI, MODELS[name](), seed=0)
    H = HAMILTONIANS[ham]()
    vs.expect(H)
    vs.expect_and_grad(H)
    vs.expect_and_forces(H)


MC_CASES = [
    ("rbm_real", "ising", None),
    ("rbm_complex", "heisenberg", None),
    ("rbm_complex", "ising", 16),  # chunked: nk.jax.vjp_chunked
    ("rbm_modphase", "ising", None),
    ("jastrow_complex", "heisenberg", 16),
    ("gcnn", "ising", None),
    ("arnn_dense", "ising", None),  # exact sampling: ARDirectSampler
    ("arnn_dense", "heisenberg", 16),
]


@pytest.mark.parametrize("name,ham,chunk", MC_CASES)
def test_mc_state(name, ham, chunk):
    if name.startswith("arnn"):
        sampler = nk.sampler.ARDirectSampler(HI)
    elif ham == "heisenberg":
        sampler = nk.sampler.MetropolisExchange(HI, graph=GRAPH, n_chains=8)
    else:
        sampler = nk.sampler.MetropolisLocal(HI, n_chains=8)
    vs = nk.vqs.MCState(sampler, MODELS[name](), n_samples=64, n_discard_per_chain=4, seed=0, sampler_seed=1)
    vs.chunk_size = chunk
    H = HAMILTONIANS[ham]()
    vs.expect_and_grad(H)
    vs.expect_and_forces(H)


QGTS = {
    "onthefly": nk.optimizer.qgt.QGTOnTheFly,
    "jacobian_dense": nk.optimizer.qgt.QGTJacobianDense,
    "jacobian_pytree": nk.optimizer.qgt.QGTJacobianPyTree,
}


QGT_CASES = [("rbm_real", q) for q in QGTS] + [("rbm_complex", "onthefly"), ("rbm_complex", "jacobian_dense")]
QGT_CASES += [("rbm_modphase", "jacobian_pytree")]


@pytest.mark.parametrize("name,qgt", QGT_CASES)
def test_qgt(name, qgt):
    sampler = nk.sampler.MetropolisLocal(HI, n_chains=8)
    vs = nk.vqs.MCState(sampler, MODELS[name](), n_samples=64, n_discard_per_chain=4, seed=0, sampler_seed=1)
    S = QGTS[qgt](vs, diag_shift=0.01, holomorphic=name == "rbm_complex")  # the complex RBM is holomorphic
    v = jax.tree_util.tree_map(lambda p: jnp.ones_like(p) * 0.3, vs.parameters)
    S @ v
    S.to_dense()
    S.solve(jax.scipy.sparse.linalg.cg, v)
    c = jax.tree_util.tree_map(lambda p: jnp.linspace(-1.0, 1.0, p.size).reshape(p.shape), vs.parameters)

    def loss(v):  # the matrix-vector product is linear in v: its gradient is S^H c
        return jnp.real(nk.jax.tree_dot(c, S @ v))

    jax.grad(loss)(v)
