"""vbjax: neural-mass models integrated by vbjax's loops and differentiated by jax.grad
with respect to the model parameters (namedtuples of scalars), the initial state and
both, eagerly and under jit (float64). The single steps (Euler, Heun, RK4 on arrays and
pytrees, with an additive term and an ad hoc correction); ``make_ode`` with each method
for the Jansen-Rit, Montbrio-Pazo-Roxin (its rate clamp ``r * (r > 0)``, started at
r = 0 and below), Epileptor-2D (BVEP), bilinear DCM, Balloon-Windkessel BOLD and
dopamine QIF models; ``make_sde`` with a fixed noise sample (constant, additive and
multiplicative diffusion, the MPR/dopamine positivity corrections, ``return_euler``),
with respect to the noise amplitude too; ``make_sdde``/``make_dde`` with a delay buffer
and ``delay_apply`` couplings (weights traced), the initial history differentiated;
linear and difference couplings, a network of dopamine nodes; the monitors (time
average, gain, BOLD, covariance and FC, ``make_offline``); vbjax's sparse
matrix-vector products (scatter-gather and, eagerly, its scipy ``custom_vjp``), the
Hilbert transform and ``shrinkage_zscore``. (``make_implicit_sde`` is left out: its
Newton-Jacobi iterations are ``lax.while_loop``s, which jax.grad cannot reverse.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse
import vbjax as vb

jax.config.update("jax_enable_x64", True)
KEY = jax.random.PRNGKey(7)


def _run(loss, args, argnums_list, jit):
    for argnums in argnums_list:
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*args)


def _args3():
    return [(0,), (1,), (0, 1)]


def _theta(t, **over):
    """A namedtuple of float64 scalars (the parameters to differentiate)."""
    return t._replace(**{k: jnp.asarray(float(v)) for k, v in t._asdict().items()})._replace(
        **{k: jnp.asarray(v) for k, v in over.items()}
    )


# ---- single steps --------------------------------------------------------------------


def _lin(x, p):
    return jax.tree.map(lambda v: -p * v + jnp.sin(v), x)


STEPS = {"euler": vb.loops.euler_step, "heun": vb.heun_step, "rk4": vb.loops.rk4_step}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("pytree", [False, True])
@pytest.mark.parametrize("method", list(STEPS))
def test_step(method, pytree, jit):
    step = STEPS[method]

    def loss(x, p):
        add = jax.tree.map(lambda v: 0.01 * jnp.cos(v), x)

        def adhoc(y, p):  # a clamp
            return jax.tree.map(lambda v: jnp.maximum(v, -0.5), y)

        y = step(x, _lin, 0.1, p, add=add, adhoc=adhoc)
        return sum(jnp.sum(jnp.sin(v)) for v in jax.tree.leaves(y))

    x = jnp.asarray([0.3, -0.5, 1.2])  # -0.5: on the clamp
    x = {"a": x, "b": x[:2] * 2.0} if pytree else x
    _run(loss, (x, jnp.asarray(0.7)), _args3(), jit)


# ---- ODEs ----------------------------------------------------------------------------

NODES = 3


def _jr(x, p):
    return vb.jr_dfun(x, 0.1 * jnp.sum(x[1]), p)


def _mpr(x, p):
    c = jnp.stack([jnp.mean(x[0]) * jnp.ones(NODES), jnp.mean(x[1]) * jnp.ones(NODES)])
    return vb.mpr_dfun(x, c, p)


def _bvep(x, p):
    return vb.bvep_dfun(x, 0.05 * (jnp.mean(x[0]) - x[0]), p)


def _dcm(x, p):
    u = jnp.asarray([0.5, -0.2])
    return vb.dcm_dfun(x, u, p)


def _bold(x, p):
    return vb.bold_dfun(x, 0.3 * jnp.ones(NODES), p)


def _dopa(x, p):
    cy = (jnp.full(NODES, 0.01), jnp.full(NODES, 0.02), jnp.full(NODES, 0.005))
    return vb.dopa_dfun(x, cy, p)


def _dopa1(x, p):
    """One dopamine node (dopa_gfun_mulr's diffusion is written for one)."""
    return vb.dopa_dfun(x, (0.01, 0.02, 0.005), p)


def _dcm_theta():
    rng = np.random.default_rng(3)
    A = jnp.asarray(-np.eye(3) + 0.1 * rng.normal(size=(3, 3)))
    B = jnp.asarray(0.05 * rng.normal(size=(3, 3, 2)))
    C = jnp.asarray(rng.normal(size=(3, 2)))
    return vb.DCMTheta(A=A, B=B, C=C)


def _x0(shape, center, scale, seed):
    return jnp.asarray(center + scale * np.random.default_rng(seed).normal(size=shape))


ODES = {
    # name: (dfun, theta, initial state, dt, steps)
    "jansen_rit": (_jr, lambda: _theta(vb.jr_default_theta, I=0.1), lambda: _x0((6, NODES), 0.0, 0.01, 1), 1.0, 20),
    "mpr": (_mpr, lambda: _theta(vb.mpr_default_theta), lambda: _x0((2, NODES), [[0.5], [-1.5]], 0.1, 2), 0.01, 20),
    "mpr_r_zero": (
        _mpr,
        lambda: _theta(vb.mpr_default_theta, eta=-4.6),
        lambda: jnp.asarray([[0.0, -0.1, 0.3], [-2.0, -1.0, 0.5]]),
        0.01,
        20,
    ),
    "bvep": (_bvep, lambda: _theta(vb.bvep_default_theta), lambda: _x0((2, NODES), [[-1.5], [3.0]], 0.2, 3), 0.05, 20),
    "dcm": (_dcm, _dcm_theta, lambda: _x0((3,), 0.0, 1.0, 4), 0.05, 20),
    "bold": (
        _bold,
        lambda: _theta(vb.bold_default_theta),
        lambda: jnp.stack([jnp.zeros(NODES), jnp.ones(NODES), jnp.ones(NODES), jnp.ones(NODES)]),
        0.05,
        20,
    ),
    "dopa": (
        _dopa,
        lambda: _theta(vb.dopa_default_theta),
        lambda: jnp.asarray(np.array(vb.dopa_default_initial_state))[:, None] * jnp.ones(NODES),
        0.01,
        20,
    ),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("method", ["euler", "heun", "rk4"])
@pytest.mark.parametrize("model", list(ODES))
def test_ode(model, method, jit):
    dfun, theta, x0, dt, n = ODES[model]
    adhoc = vb.mpr_r_positive if model.startswith("mpr") else None
    _, loop = vb.make_ode(dt, dfun, adhoc=adhoc, method=method)
    ts = jnp.arange(n)

    def loss(x0, p):
        xs = loop(x0, ts, p)
        return jnp.mean(jnp.tanh(xs[-5:])) + 0.1 * jnp.mean(xs[::7] ** 2)

    _run(loss, (x0(), theta()), _args3(), jit)


# ---- SDEs with a fixed noise sample -------------------------------------------------

SDES = {
    # name: (dfun, gfun(sigma) -> gfun, theta, x0, dt, steps, adhoc)
    "additive_constant": (
        _mpr,
        lambda s: s,
        lambda: _theta(vb.mpr_default_theta),
        lambda: _x0((2, NODES), [[0.5], [-1.5]], 0.1, 5),
        0.01,
        20,
        vb.mpr_r_positive,
    ),
    "additive_function": (
        _bvep,
        lambda s: lambda x, p: s * jnp.ones_like(x),
        lambda: _theta(vb.bvep_default_theta),
        lambda: _x0((2, NODES), [[-1.5], [3.0]], 0.2, 6),
        0.05,
        20,
        None,
    ),
    "multiplicative": (
        _jr,
        lambda s: lambda x, p: s * jnp.tanh(x),
        lambda: _theta(vb.jr_default_theta),
        lambda: _x0((6, NODES), 0.0, 0.01, 7),
        1.0,
        20,
        None,
    ),
    "dopa_mulr": (
        _dopa1,
        lambda s: lambda x, p: vb.dopa_gfun_mulr(x, p._replace(sigma=s)),
        lambda: _theta(vb.dopa_default_theta),
        lambda: jnp.asarray(np.array(vb.dopa_default_initial_state)),
        0.01,
        20,
        vb.dopa_r_positive,
    ),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("return_euler", [False, True])
@pytest.mark.parametrize("name", list(SDES))
def test_sde(name, return_euler, jit):
    dfun, gfun, theta, x0, dt, n, adhoc = SDES[name]
    x0 = x0()
    zs = jax.random.normal(KEY, (n,) + x0.shape)
    # sigma travels with the parameters, so that the jitted loop is built (and compiled) once
    _, loop = vb.make_sde(
        dt,
        lambda x, ps: dfun(x, ps[0]),
        lambda x, ps: (lambda g: g(x, ps[0]) if callable(g) else g)(gfun(ps[1])),
        adhoc=None if adhoc is None else (lambda x, ps: adhoc(x, ps[0])),
        return_euler=return_euler,
        unroll=2,
    )

    def loss(x0, p, sigma):
        out = loop(x0, zs, (p, sigma))
        if return_euler:
            ex, xs = out
            return jnp.mean(jnp.tanh(xs)) + 0.3 * jnp.mean(jnp.sin(ex))
        return jnp.mean(jnp.tanh(out)) + 0.1 * jnp.mean(out[-5:] ** 2)

    _run(loss, (x0, theta(), jnp.asarray(0.05)), [(0,), (1,), (2,), (0, 1, 2)], jit)


@pytest.mark.parametrize("jit", [False, True])
def test_sde_pytree_state(jit):
    """A pytree state (a dict of arrays) with per-leaf diffusion coefficients."""

    def dfun(x, p):
        return {"u": -p * x["u"] + x["v"], "v": jnp.sin(x["u"]) - x["v"]}

    zs = {"u": jax.random.normal(KEY, (20, 2)), "v": jax.random.normal(jax.random.PRNGKey(1), (20, 2))}

    def loss(x0, p):
        _, loop = vb.make_sde(0.1, dfun, lambda x, p: {"u": 0.1 * jnp.ones(2), "v": 0.2 * jnp.abs(x["v"])})
        xs = loop(x0, zs, p)
        return jnp.sum(jnp.tanh(xs["u"])) + jnp.sum(xs["v"][-3:] ** 2)

    x0 = {"u": jnp.asarray([0.3, -0.2]), "v": jnp.asarray([0.0, 0.5])}  # |v| at 0
    _run(loss, (x0, jnp.asarray(0.8)), _args3(), jit)


# ---- delays ---------------------------------------------------------------------------

_rng = np.random.default_rng(11)
SC = jnp.asarray(_rng.uniform(0.0, 1.0, (NODES, NODES)) * (1 - np.eye(NODES)))
LENGTHS = jnp.asarray(_rng.uniform(1.0, 4.0, (NODES, NODES)))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("noise,zero_delays", [(0.0, False), (0.02, False), (0.02, True)])
def test_sdde_delays(noise, zero_delays, jit):
    dh0 = vb.make_delay_helper(SC, LENGTHS, dt=0.1, v_c=10.0)
    nh = int(dh0.max_lag)
    n_steps = 15

    def dfun(buf, rv, t, ps):
        p, weights = ps
        dh = vb.make_delay_helper(weights, LENGTHS, dt=0.1, v_c=10.0)  # the weights traced
        c = vb.delay_apply(dh, t, buf)  # (2, NODES): coupling of r and V
        return vb.mpr_dfun(rv, c * jnp.asarray([[0.1], [0.0]]), p)

    def adhoc(x, ps):
        return vb.mpr_r_positive(x, ps[0])

    if noise == 0.0:
        _, loop = vb.make_dde(0.1, nh, dfun, unroll=1, adhoc=adhoc)
    else:
        _, loop = vb.make_sdde(0.1, nh, dfun, noise, zero_delays=zero_delays, adhoc=adhoc)

    def loss(buf0, p, weights):
        buf, rvs = loop(buf0, (p, weights))
        return jnp.mean(jnp.tanh(rvs)) + 0.01 * jnp.mean(buf[-3:] ** 2)

    hist = jnp.asarray([[0.4], [-1.8]]) + 0.05 * jax.random.normal(KEY, (nh + 1, 2, NODES))
    zs = jax.random.normal(jax.random.PRNGKey(2), (n_steps, 2, NODES))
    buf0 = jnp.concatenate([hist, zs], axis=0)
    _run(loss, (buf0, _theta(vb.mpr_default_theta), SC), [(0,), (1,), (2,), (0, 1, 2)], jit)


# ---- couplings and networks ---------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("kind", ["linear", "diff"])
def test_cfun(kind, jit):
    def loss(sc, x, a):
        make = vb.coupling.make_linear_cfun if kind == "linear" else vb.coupling.make_diff_cfun
        cfun = make(sc, a=a, b=0.1)
        delayed = jnp.stack([x, x**2, jnp.cos(x)])  # (NODES, NODES): delayed states x_j(t - d_ij)
        return jnp.sum(jnp.sin(cfun(x))) + jnp.sum(cfun(delayed) ** 2)

    x = jnp.asarray([0.3, -0.2, 0.9])
    _run(loss, (SC, x, jnp.asarray(1.3)), [(0,), (1,), (2,), (0, 1, 2)], jit)


@pytest.mark.parametrize("jit", [False, True])
def test_dopa_network(jit):
    theta = _theta(vb.dopa_default_theta, wi=1e-2, we=1e-2, wd=1e-2)
    x0 = jnp.asarray(np.array(vb.dopa_default_initial_state))[:, None] * jnp.ones(NODES)
    zs = jax.random.normal(KEY, (20, 6, NODES))
    _, loop = vb.make_sde(
        0.01, vb.dopa_net_dfun, lambda y, p: vb.dopa_gfun_add(y, p[3]), adhoc=vb.dopa_r_positive, unroll=1
    )

    def loss(x0, sc, node_params):
        xs = loop(x0, zs, (sc, sc * 0.5, sc.T, node_params))
        return jnp.mean(jnp.tanh(xs[:, 0])) + jnp.mean(xs[:, 1]) * 0.01

    _run(loss, (x0, SC, theta), [(0,), (1,), (2,), (0, 1, 2)], jit)


# ---- monitors ------------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True])
def test_monitors(jit):
    _, ode = vb.make_ode(0.01, _mpr, adhoc=vb.mpr_r_positive)
    ts = jnp.arange(60)
    gain = jnp.asarray(_rng.normal(size=(2, NODES)))

    def loss(x0, p, gain, bold_p):
        xs = ode(x0, ts, p)  # (T, 2, NODES)
        r = xs[:, 0]
        tavg_buf, tavg_step, tavg_sample = vb.make_timeavg((NODES,))
        g_buf, g_step, g_sample = vb.make_gain(gain)
        b_buf, b_step, b_sample = vb.make_bold((NODES,), 0.01, bold_p)
        c_buf, c_step, c_sample = vb.monitor.make_cov((NODES,))
        f_buf, f_step, f_sample = vb.make_fc((NODES,))
        _, tavg = vb.make_offline(tavg_step, tavg_sample)(tavg_buf, r)
        _, eeg = vb.make_offline(g_step, g_sample)(g_buf, r)
        _, bold = vb.make_offline(b_step, b_sample)(b_buf, r)
        _, cov = vb.make_offline(c_step, c_sample)(c_buf, xs[:, 1])
        _, fc = vb.make_offline(f_step, f_sample)(f_buf, xs[:, 1])
        return (
            jnp.sum(tavg**2) + jnp.sum(jnp.sin(eeg)) + jnp.sum(bold) + jnp.sum(cov) + jnp.sum(fc * jnp.eye(NODES, k=1))
        )

    x0 = _x0((2, NODES), [[0.5], [-1.5]], 0.1, 9)
    args = (x0, _theta(vb.mpr_default_theta), gain, _theta(vb.bold_default_theta))
    _run(loss, args, [(0,), (1,), (2,), (3,), (0, 1, 2, 3)], jit)


# ---- sparse products, signal tools ---------------------------------------------------

_A = scipy.sparse.random(6, 6, density=0.4, random_state=3, format="csr")


@pytest.mark.parametrize("jit", [False, True])
def test_sg_spmv(jit):
    spmv = vb.make_sg_spmv(_A)

    def loss(x):
        return jnp.sum(jnp.sin(spmv(x))) + jnp.sum(spmv(spmv(x)) ** 2)

    _run(loss, (jnp.asarray(_rng.normal(size=6)),), [(0,)], jit)


@pytest.mark.parametrize("symmetric", [False, True])
def test_scipy_spmv_eager(symmetric):
    """vbjax's scipy product: a custom_vjp that goes through numpy (eager only)."""
    A = (_A + _A.T).tocsr() if symmetric else _A
    spmv = vb.make_spmv(A, is_symmetric=symmetric)

    def loss(x):
        return jnp.sum(jnp.sin(spmv(x))) + jnp.sum(spmv(x * x))

    _run(loss, (jnp.asarray(_rng.normal(size=6)),), [(0,)], False)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("n", [None, 9])
def test_hilbert(n, jit):
    def loss(x):
        z = vb.hilbert(x, N=n)
        return jnp.sum(jnp.abs(z) ** 2) + jnp.sum(jnp.angle(z[1:4]))

    _run(loss, (jnp.sin(jnp.linspace(0.1, 6.0, 8)) + 0.1,), [(0,)], jit)


@pytest.mark.parametrize("jit", [False, True])
def test_shrinkage_zscore(jit):
    def loss(x, x_hat, prior):
        s, z = vb.shrinkage_zscore(x, x_hat, prior)
        return jnp.sum(s**2) + jnp.sum(jnp.tanh(z))

    x_hat = jnp.asarray(_rng.normal(size=(10, 3)))
    _run(loss, (jnp.asarray([0.1, -0.3, 0.5]), x_hat, jnp.asarray([1.0, 2.0, 0.5])), [(0,), (1,), (2,), (0, 1, 2)], jit)
