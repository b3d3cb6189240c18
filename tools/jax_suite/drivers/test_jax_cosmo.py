"""jax-cosmo: cosmological observables differentiated by jax.grad with respect to
the cosmological parameters, the scale factors or wavenumbers, and both, eagerly and
under jit: background distances (its own RK4 ODE solver and interpolation), growth
factor and rate (ODE and gamma parametrisations), linear and halofit power spectra,
angular power spectra of weak lensing and galaxy clustering (Limber integrals, vmap,
lax.map; the linear power spectrum there), a Gaussian likelihood. Flat, open and
closed cosmologies; w0/wa dark energy. The scale factors include a = 1, where the
growth factor sits on its clip at 1 (a tie decided by rounding: docs/testing.md)."""

import jax
import jax.numpy as jnp
import jax_cosmo as jc
import pytest

jax.config.update("jax_enable_x64", True)
BASE = {"Omega_c": 0.26, "Omega_b": 0.049, "h": 0.68, "n_s": 0.965, "sigma8": 0.81, "w0": -1.0, "wa": 0.0}
CURVATURE = {"flat": 0.0, "open": 0.05, "closed": -0.05}
A = jnp.array([0.25, 0.5, 0.8, 1.0])


def _cosmo(p, omega_k, gamma=None):
    return jc.Cosmology(Omega_k=omega_k, gamma=gamma, **p)


def _grads(fn, *args, jit):
    for argnums in [(0,), (1,), (0, 1)]:
        g = jax.grad(fn, argnums)
        (jax.jit(g) if jit else g)(*args)


def _params(curvature):
    p = dict(BASE)
    if curvature != "flat":
        p.update(w0=-0.9, wa=0.1)
    return {k: jnp.asarray(v) for k, v in p.items()}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("curvature", list(CURVATURE))
def test_distances(curvature, jit):
    def fn(p, a):
        c = _cosmo(p, CURVATURE[curvature])
        bg = jc.background
        return jnp.sum(
            jnp.log(bg.angular_diameter_distance(c, a) + 1.0)
            + bg.transverse_comoving_distance(c, a) / 1000
            + bg.H(c, a) / 100
            + bg.Omega_m_a(c, a)
            + bg.dchioverda(c, a) / 1000
        )

    _grads(fn, _params(curvature), A, jit=jit)


@pytest.mark.parametrize("jit", [False, True])
def test_a_of_chi(jit):
    def fn(p, chi):
        return jnp.sum(jc.background.a_of_chi(_cosmo(p, 0.0), chi))

    _grads(fn, _params("flat"), jnp.array([100.0, 800.0, 2500.0]), jit=jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("gamma", [None, 0.55])
def test_growth(gamma, jit):
    def fn(p, a):
        c = _cosmo(p, 0.0, gamma)
        return jnp.sum(jc.background.growth_factor(c, a) * 2 + jc.background.growth_rate(c, a))

    _grads(fn, _params("flat"), A, jit=jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("transfer", ["eisenhu", "eisenhu_osc"])
def test_power(transfer, jit):
    def tf(cosmo, k):
        return jc.transfer.Eisenstein_Hu(cosmo, k, type=transfer)

    def fn(p, k):
        c = _cosmo(p, 0.0)
        lin = jc.power.linear_matter_power(c, k, a=0.7, transfer_fn=tf)
        nl = jc.power.nonlinear_matter_power(c, k, a=0.7, transfer_fn=tf)
        return jnp.sum(jnp.log(lin) + jnp.log(nl))

    _grads(fn, _params("flat"), jnp.array([0.01, 0.1, 0.5, 2.0]), jit=jit)


def _probes(z0):
    # one redshift bin each, one multipole: the Limber integrals are 512-point Simpson
    # sums nested in the lensing kernel's own, slow on two cores
    nz = [jc.redshift.smail_nz(1.0, 2.0, z0, zmax=3.0)]
    return [jc.probes.WeakLensing(nz, sigma_e=0.26), jc.probes.NumberCounts(nz, jc.bias.constant_linear_bias(1.2))]


ELL = jnp.array([200.0])
LINEAR = jc.power.linear  # halofit (test_power) inside these integrals compiles for minutes


@pytest.mark.parametrize("jit", [False, True])
def test_angular_cl(jit):
    def fn(p, z0):
        cl = jc.angular_cl.angular_cl(_cosmo(p, 0.0), ELL, _probes(z0), nonlinear_fn=LINEAR)
        return jnp.sum(jnp.log(cl**2 + 1e-30))

    _grads(fn, _params("flat"), jnp.asarray(0.9), jit=jit)


@pytest.mark.parametrize("jit", [False, True])
def test_likelihood(jit):
    probes = _probes(1.0)
    fid = _cosmo(_params("flat"), 0.0)
    ell = jnp.array([100.0, 300.0])  # the covariance's bin widths need two multipoles
    mu_fid, cov = jc.angular_cl.gaussian_cl_covariance_and_mean(fid, ell, probes, nonlinear_fn=LINEAR, sparse=False)
    data = mu_fid * 1.02

    def fn(p, d):
        mu = jc.angular_cl.angular_cl(_cosmo(p, 0.0), ell, probes, nonlinear_fn=LINEAR).flatten()
        return jc.likelihood.gaussian_log_likelihood(d, mu, cov)

    _grads(fn, _params("flat"), data, jit=jit)
