"""dynamax, tinygp, flowjax and MuJoCo MJX: likelihoods, flows and a physics rollout,
differentiated by jax.grad (each argument alone and all), eagerly and under jit."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

jax.config.update("jax_enable_x64", True)
K = jr.key


def _w(out):
    leaves = [
        x for x in jax.tree_util.tree_leaves(out) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
    ]
    return sum(jnp.sum(jnp.sin(x) * jnp.arange(1.0, 1.0 + x.size).reshape(x.shape)) for x in leaves)


def _both(f, args, argsets, jit=True):
    for argnums in argsets:
        g = jax.grad(f, argnums)
        g(*args)
        if jit:
            jax.jit(g)(*args)


# -- dynamax ------------------------------------------------------------------------
from dynamax.hidden_markov_model import (  # noqa: E402
    GaussianHMM,
    hmm_filter,
    hmm_fixed_lag_smoother,
    hmm_posterior_mode,
    hmm_smoother,
    hmm_two_filter_smoother,
    parallel_hmm_filter,
    parallel_hmm_smoother,
)
from dynamax.linear_gaussian_ssm import (  # noqa: E402
    LinearGaussianSSM,
    lgssm_filter,
    lgssm_info_filter,
    lgssm_smoother,
    parallel_lgssm_filter,
    parallel_lgssm_smoother,
)
from dynamax.nonlinear_gaussian_ssm import (  # noqa: E402
    ParamsNLGSSM,
    UKFHyperParams,
    extended_kalman_filter,
    extended_kalman_smoother,
    unscented_kalman_filter,
    unscented_kalman_smoother,
)

T, S, D = 12, 3, 2
LG = LinearGaussianSSM(state_dim=S, emission_dim=D)
LG_PARAMS, _ = LG.initialize(K(0))
_, LG_Y = LG.sample(LG_PARAMS, K(1), T)


def _lg_params(F, Q, H, R):
    p = LG_PARAMS
    return p._replace(
        dynamics=p.dynamics._replace(weights=F, cov=Q @ Q.T + 0.1 * jnp.eye(S)),
        emissions=p.emissions._replace(weights=H, cov=R @ R.T + 0.1 * jnp.eye(D)),
    )


LG_ARGS = (LG_PARAMS.dynamics.weights, jnp.eye(S) * 0.5, LG_PARAMS.emissions.weights, jnp.eye(D) * 0.4, LG_Y)
LGFUNS = {
    "lgssm_filter": lambda *a: lgssm_filter(_lg_params(*a[:4]), a[4]),
    "lgssm_smoother": lambda *a: lgssm_smoother(_lg_params(*a[:4]), a[4]),
    "parallel_lgssm_filter": lambda *a: parallel_lgssm_filter(_lg_params(*a[:4]), a[4]),
    "parallel_lgssm_smoother": lambda *a: parallel_lgssm_smoother(_lg_params(*a[:4]), a[4]),
    "lgssm_marginal_log_prob": lambda *a: LG.marginal_log_prob(_lg_params(*a[:4]), a[4]),
}


@pytest.mark.parametrize("name", list(LGFUNS))
def test_lgssm(name):
    f = LGFUNS[name]
    _both(lambda *a: _w(f(*a)), LG_ARGS, [(0,), (1,), (2,), (3,), (4,), (0, 1, 2, 3, 4)])


K_HMM = 3
HMM = GaussianHMM(K_HMM, D)
H_PARAMS, _ = HMM.initialize(K(2))
_, H_Y = HMM.sample(H_PARAMS, K(3), T)


def _hmm_inputs(logits0, logitsA, means, y):
    p = H_PARAMS
    params = p._replace(
        initial=p.initial._replace(probs=jax.nn.softmax(logits0)),
        transitions=p.transitions._replace(transition_matrix=jax.nn.softmax(logitsA, axis=-1)),
        emissions=p.emissions._replace(means=means),
    )
    return params, y


H_ARGS = (jnp.array([0.1, -0.3, 0.2]), jr.normal(K(4), (K_HMM, K_HMM)), H_PARAMS.emissions.means, H_Y)


def _hmm_lls(params, y):
    return jax.vmap(lambda e: HMM.emission_distribution(params, e).log_prob(y))(jnp.arange(K_HMM)).T


def _hmm_args(*a):
    """(initial probabilities, transition matrix, emission log-likelihoods), the
    arguments of dynamax's HMM inference functions."""
    params, y = _hmm_inputs(*a)
    return params.initial.probs, params.transitions.transition_matrix, _hmm_lls(params, y)


HMMFUNS = {
    "hmm_filter": lambda *a: hmm_filter(*_hmm_args(*a)),
    "parallel_hmm_filter": lambda *a: parallel_hmm_filter(*_hmm_args(*a)),
    "hmm_smoother": lambda *a: hmm_smoother(*_hmm_args(*a)),
    "parallel_hmm_smoother": lambda *a: parallel_hmm_smoother(*_hmm_args(*a)),
    "hmm_two_filter_smoother": lambda *a: hmm_two_filter_smoother(*_hmm_args(*a)),
    "hmm_fixed_lag_smoother": lambda *a: hmm_fixed_lag_smoother(*_hmm_args(*a), 3),
    "hmm_marginal_log_prob": lambda *a: HMM.marginal_log_prob(*_hmm_inputs(*a)),
    "hmm_posterior_mode_lp": lambda *a: _viterbi_log_likelihood(*_hmm_args(*a)),
}


def _viterbi_log_likelihood(probs, trans, lls):
    """The emission log-likelihoods along the most likely path."""
    return jnp.sum(lls * jax.nn.one_hot(hmm_posterior_mode(probs, trans, lls), K_HMM))


@pytest.mark.parametrize("name", list(HMMFUNS))
def test_hmm(name):
    f = HMMFUNS[name]
    _both(lambda *a: _w(f(*a)), H_ARGS, [(0,), (1,), (2,), (3,), (0, 1, 2, 3)])


def _nl_params(q, r, m0):
    return ParamsNLGSSM(
        initial_mean=m0,
        initial_covariance=jnp.eye(2) * 0.5,
        dynamics_function=lambda x: jnp.array([x[0] + 0.1 * x[1], x[1] - 0.1 * jnp.sin(x[0])]),
        dynamics_covariance=jnp.eye(2) * q,
        emission_function=lambda x: jnp.array([jnp.sin(x[0]), x[1] ** 2 * 0.5]),
        emission_covariance=jnp.eye(2) * r,
    )


NL_Y = jr.normal(K(5), (T, 2)) * 0.3
NL_ARGS = (jnp.array(0.05), jnp.array(0.2), jnp.array([0.3, -0.1]), NL_Y)
NLFUNS = {
    "ekf": lambda q, r, m0, y: extended_kalman_filter(_nl_params(q, r, m0), y),
    "eks": lambda q, r, m0, y: extended_kalman_smoother(_nl_params(q, r, m0), y),
    "ukf": lambda q, r, m0, y: unscented_kalman_filter(_nl_params(q, r, m0), y, UKFHyperParams()),
    "uks": lambda q, r, m0, y: unscented_kalman_smoother(_nl_params(q, r, m0), y, UKFHyperParams()),
}


@pytest.mark.parametrize("name", list(NLFUNS))
def test_nonlinear(name):
    f = NLFUNS[name]
    _both(lambda *a: _w(f(*a)), NL_ARGS, [(0,), (1,), (2,), (3,), (0, 1, 2, 3)])


def test_lgssm_info_filter():
    from dynamax.linear_gaussian_ssm import ParamsLGSSMInfo

    def f(F, Lq, H, y):
        p = ParamsLGSSMInfo(
            initial_mean=jnp.zeros(S),
            initial_precision=jnp.eye(S),
            dynamics_weights=F,
            dynamics_bias=jnp.zeros(S),
            dynamics_input_weights=jnp.zeros((S, 0)),
            dynamics_precision=Lq @ Lq.T + jnp.eye(S),
            emission_weights=H,
            emission_bias=jnp.zeros(D),
            emission_input_weights=jnp.zeros((D, 0)),
            emission_precision=jnp.eye(D) * 2.0,
        )
        return _w(lgssm_info_filter(p, y))

    _both(f, (LG_ARGS[0], LG_ARGS[1], LG_ARGS[2], LG_Y), [(0,), (1,), (2,), (3,), (0, 1, 2, 3)])


# -- tinygp ---------------------------------------------------------------------------
from tinygp import GaussianProcess, kernels, transforms  # noqa: E402
from tinygp.kernels import quasisep  # noqa: E402

X = jnp.sort(jr.uniform(K(6), (15,)) * 5)
Y = jnp.sin(X) + 0.1 * jr.normal(K(7), (15,))

KERNELS = {
    "exp_squared": lambda a, s: a * kernels.ExpSquared(scale=s),
    "matern32": lambda a, s: a * kernels.Matern32(s),
    "matern52_plus_cos": lambda a, s: a * kernels.Matern52(s) + 0.3 * kernels.Cosine(s * 2),
    "rational_quadratic": lambda a, s: a * kernels.RationalQuadratic(alpha=1.5, scale=s),
    "exp_sine_squared": lambda a, s: a * kernels.ExpSineSquared(scale=s, gamma=1.2),
    "qs_matern32": lambda a, s: a * quasisep.Matern32(scale=s),
    "qs_matern52": lambda a, s: quasisep.Matern52(scale=s, sigma=a),
    "qs_celerite": lambda a, s: quasisep.Celerite(a, 0.1, s, 0.2),
    "qs_sho": lambda a, s: quasisep.SHO(omega=s, quality=a + 0.5, sigma=1.0),
    "qs_exp_sum": lambda a, s: quasisep.Exp(scale=s, sigma=a) + quasisep.Matern32(scale=s * 2),
    "qs_carma": lambda a, s: quasisep.CARMA.init(alpha=jnp.stack([a, s]), beta=jnp.array([1.0, 0.5])),
}


@pytest.mark.parametrize("name", list(KERNELS))
def test_gp_log_likelihood(name):
    def f(a, s, d, y):
        gp = GaussianProcess(KERNELS[name](a, s), X, diag=d)
        return gp.log_probability(y) + _w(gp.condition(y, X[::3] + 0.05).gp.loc)

    _both(f, (jnp.array(1.3), jnp.array(0.8), jnp.array(0.05), Y), [(0,), (1,), (2,), (3,), (0, 1, 2, 3)])


def test_gp_transform_and_mean():
    X2 = jr.normal(K(8), (10, 2))
    Y2 = jr.normal(K(9), (10,))

    def f(ls, m, y):
        k = transforms.Linear(1 / ls, kernels.ExpSquared())
        gp = GaussianProcess(k, X2, diag=0.1, mean=m)
        return gp.log_probability(y)

    _both(f, (jnp.array([0.7, 1.4]), jnp.array(0.2), Y2), [(0,), (1,), (2,), (0, 1, 2)])


# -- flowjax -------------------------------------------------------------------------
from flowjax.bijections import RationalQuadraticSpline  # noqa: E402
from flowjax.distributions import Normal  # noqa: E402
from flowjax.flows import (  # noqa: E402
    block_neural_autoregressive_flow,
    coupling_flow,
    masked_autoregressive_flow,
    planar_flow,
    triangular_spline_flow,
)

FLOWS = {
    "maf": lambda: masked_autoregressive_flow(K(10), base_dist=Normal(jnp.zeros(3))),
    "coupling_spline": lambda: coupling_flow(
        K(11), base_dist=Normal(jnp.zeros(3)), transformer=RationalQuadraticSpline(knots=4, interval=3)
    ),
    "bnaf": lambda: block_neural_autoregressive_flow(K(12), base_dist=Normal(jnp.zeros(3)), invert=False),
    "planar": lambda: planar_flow(K(13), base_dist=Normal(jnp.zeros(3))),
    "triangular_spline": lambda: triangular_spline_flow(K(14), base_dist=Normal(jnp.zeros(3))),
}
XF = jr.normal(K(15), (6, 3))


@pytest.mark.parametrize("name", list(FLOWS))
def test_flow(name):
    flow = FLOWS[name]()
    params, static = eqx.partition(flow, eqx.is_inexact_array)

    def lp(p, x):
        return jnp.sum(eqx.combine(p, static).log_prob(x))

    def sample_loss(p):
        return _w(eqx.combine(p, static).sample(K(16), (4,)))

    _both(lp, (params, XF), [(0,), (1,), (0, 1)])
    if name not in ("bnaf", "planar"):
        _both(sample_loss, (params,), [(0,)])


# -- MuJoCo MJX ----------------------------------------------------------------------
import mujoco  # noqa: E402
from mujoco import mjx  # noqa: E402

PENDULUM = """
<mujoco>
  <option timestep="0.01"/>
  <worldbody>
    <body name="arm" pos="0 0 1">
      <joint name="hinge" type="hinge" axis="0 1 0" damping="0.1"/>
      <geom type="capsule" fromto="0 0 0 0 0 -0.5" size="0.05" mass="1"/>
      <body pos="0 0 -0.5">
        <joint name="hinge2" type="hinge" axis="0 1 0" damping="0.05"/>
        <geom type="capsule" fromto="0 0 0 0 0 -0.4" size="0.04" mass="0.5"/>
      </body>
    </body>
  </worldbody>
  <actuator><motor joint="hinge" gear="1"/></actuator>
</mujoco>
"""


def _rollout(xml, n):
    m = mujoco.MjModel.from_xml_string(xml)
    mx = mjx.put_model(m)
    d0 = mjx.make_data(mx)

    def loss(qpos, qvel, ctrl):
        d = d0.replace(qpos=qpos, qvel=qvel, ctrl=ctrl)

        def body(d, _):
            d = mjx.step(mx, d)
            return d, d.qpos

        d, qs = jax.lax.scan(body, d, None, length=n)
        return jnp.sum(qs**2) + jnp.sum(d.qvel**2)

    return loss, d0


def test_mjx_rollout():
    """A double pendulum: no contacts (a contact model's solver is a while_loop,
    which jax.grad cannot differentiate either)."""
    loss, d0 = _rollout(PENDULUM, 20)
    qpos = d0.qpos + 0.1 * jnp.arange(1.0, 1.0 + d0.qpos.size) / d0.qpos.size
    qvel = 0.2 * jnp.ones_like(d0.qvel)
    ctrl = 0.5 * jnp.ones_like(d0.ctrl)
    _both(loss, (qpos, qvel, ctrl), [(0,), (1,), (2,), (0, 1, 2)])
