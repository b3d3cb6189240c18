"""ripplegw: gravitational-wave waveforms differentiated by jax.grad, eagerly and under
jit. The mass conversions (``ms_to_Mc_eta``, ``Mc_eta_to_ms``, the tidal-deformability
conversions from masses and from q) at generic and equal masses (eta = 1/4, where
``sqrt(max(1 - 4 eta, 0))`` has its kink); the NRTidal quadrupole/octupole fits on both
sides of and at their switch points (lax.cond), kappa, the spin-weighted spherical
harmonics; the SineGaussian burst at generic, zero and unit eccentricity; TaylorF2 and
IMRPhenomD through their functional entry points (which take tc), with respect to the
masses (M_c, eta), the spins, the tidal parameters and the extrinsic parameters (d_L, tc,
phase_c, iota) alone and all together, at generic points, equal masses, zero spins and
face-on; the registry's IMRPhenomXAS, IMRPhenomPv2, IMRPhenomD_NRTidalv2,
IMRPhenomXAS_NRTidalv3 models and IMRPhenomD's ``amplitude``/``phase``/
``at_unit_distance``, eagerly only (their gradients take minutes to compile on two
cores). Losses: sum |h|^2 of a detector projection weighted by a PSD, and a normalised
matched-filter overlap with fixed data."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ripplegw
from ripplegw import conversions as conv
from ripplegw.utils import spherical_harmonics as sh
from ripplegw.utils import tidal
from ripplegw.waveforms.cbc.IMRPhenomD.IMRPhenomD import gen_IMRPhenomD_hphc
from ripplegw.waveforms.cbc.Taylor.TaylorF2 import gen_TaylorF2_hphc

jax.config.update("jax_enable_x64", True)

F = jnp.linspace(20.0, 800.0, 14)  # inspiral to ringdown for M_c = 20, below the cutoff
PSD = 1.0 + (F / 150.0) ** 2 + (40.0 / F) ** 4
DATA = jnp.asarray((F / 100.0) ** (-7 / 6) * np.exp(-2j * np.pi * F * 0.004 + 0.3j))
FP, FC = 0.6, -0.35  # fixed antenna pattern


def _loss_from(hp, hc):
    h = (FP * hp + FC * hc) * 1e21
    power = jnp.sum(jnp.abs(h) ** 2 / PSD)
    overlap = jnp.real(jnp.sum(jnp.conj(DATA) * h / PSD)) / jnp.sqrt(power)
    return 1e-3 * power + overlap


def _grads(loss, args, jit):
    n = len(args)
    argnums_list = [(i,) for i in range(n)] + ([tuple(range(n))] if n > 1 else [])

    def all_grads(*args):
        return [jax.grad(loss, a)(*args) for a in argnums_list]

    (jax.jit(all_grads) if jit else all_grads)(*args)


# ---------------------------------------------------------------------------
# conversions and small utilities
# ---------------------------------------------------------------------------
MASS_POINTS = {"generic": (1.6, 1.2), "equal": (1.4, 1.4)}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", list(MASS_POINTS))
def test_mass_conversions(point, jit):
    m1, m2 = (jnp.asarray(v) for v in MASS_POINTS[point])

    def loss(m1, m2):
        mc, eta = conv.ms_to_Mc_eta(jnp.stack([m1, m2]))
        a, b = conv.Mc_eta_to_ms(jnp.stack([mc, eta]))
        return mc + 3.0 * eta + 0.5 * a - 0.7 * b

    _grads(loss, (m1, m2), jit)

    mc, eta = conv.ms_to_Mc_eta(jnp.stack([m1, m2]))
    # Mc_eta_to_ms on its own at eta exactly 1/4 (sqrt(max(0, 0)))
    eta = jnp.asarray(0.25) if point == "equal" else eta

    def loss_inv(mc, eta):
        a, b = conv.Mc_eta_to_ms(jnp.stack([mc, eta]))
        return a**2 + 2.0 * b

    _grads(loss_inv, (mc, eta), jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", list(MASS_POINTS))
def test_tidal_conversions(point, jit):
    m1, m2 = (jnp.asarray(v) for v in MASS_POINTS[point])
    lams = jnp.array([400.0, 650.0])

    def loss(lams, m1, m2):
        lt, dlt = conv.lambdas_to_lambda_tildes(jnp.stack([lams[0], lams[1], m1, m2]))
        l1, l2 = conv.lambda_tildes_to_lambdas(jnp.stack([lt, dlt, m1, m2]))
        return 1e-3 * lt + 1e-2 * dlt + 1e-3 * (l1 * 0.3 + l2)

    _grads(loss, (lams, m1, m2), jit)
    q = m2 / m1

    def loss_q(lams, q):
        lt, dlt = conv.lambdas_to_lambda_tildes_from_q(jnp.stack([lams[0], lams[1], q]))
        l1, l2 = conv.lambda_tildes_to_lambdas_from_q(jnp.stack([lams[0], lams[1], q]))
        return 1e-3 * lt + 1e-2 * dlt + 1e-3 * (l1 + 0.5 * l2)

    _grads(loss_q, (lams, q), jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("lam", [0.3, 0.5, 1.0, 250.0])  # fits switch at 0.5 and at 1
def test_tidal_utils(lam, jit):
    def loss(lam, masses):
        q, o = tidal.get_quadparam_octparam(lam)
        qe, oe = tidal.get_quadparam_octparam_eos(lam)
        kappa = tidal.get_kappa(jnp.stack([masses[0], masses[1], 0.1, 0.0, lam, 1.5 * lam]))
        return q + 0.3 * o + qe + 0.2 * oe + 1e-2 * kappa

    _grads(loss, (jnp.asarray(lam), jnp.array([1.5, 1.3])), jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("theta", [0.0, 0.7, np.pi / 2, np.pi])
def test_spherical_harmonics(theta, jit):
    def loss(theta):
        tot = 0.0
        for ell, fn in ((2, sh.compute_sminus2_l2), (3, sh.compute_sminus2_l3), (4, sh.compute_sminus2_l4)):
            for m in range(-ell, ell + 1):
                tot = tot + (0.1 * m + 1.0) * fn(theta, m)
        return tot

    _grads(loss, (jnp.asarray(theta),), jit)


# ---------------------------------------------------------------------------
# SineGaussian burst
# ---------------------------------------------------------------------------
T = jnp.linspace(-0.05, 0.05, 21)
SG = ripplegw.waveform("SineGaussian")


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("e", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("phase", [0.0, 0.9])
def test_sine_gaussian(e, phase, jit):
    def loss(shape, amp_phase, e):
        h = SG(T, {"Q": shape[0], "f_0": shape[1], "hrss": amp_phase[0], "phase": amp_phase[1], "e": e})
        return jnp.sum(h["p"] ** 2 + 0.5 * h["c"] ** 2 + h["p"] * jnp.cos(90.0 * T))

    _grads(loss, (jnp.array([8.0, 60.0]), jnp.array([1.3, phase]), jnp.asarray(e)), jit)


# ---------------------------------------------------------------------------
# TaylorF2 and IMRPhenomD, functional entry points (with tc)
# ---------------------------------------------------------------------------
CBC_POINTS = {
    # (M_c, eta), (chi1, chi2), (d_L, tc, phase_c, iota)
    "generic": ((20.0, 0.21), (0.3, -0.2), (400.0, 0.003, 0.4, 0.6)),
    "equal_mass": ((20.0, 0.25), (0.3, -0.2), (400.0, 0.003, 0.4, 0.6)),
    "zero_spin": ((20.0, 0.21), (0.0, 0.0), (400.0, 0.0, 0.0, 0.6)),
    "face_on": ((20.0, 0.21), (0.3, 0.3), (400.0, 0.003, 0.4, 0.0)),
}


def _cbc_args(point):
    return tuple(jnp.array(v) for v in CBC_POINTS[point])


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("lambda_tildes", [False, True])
@pytest.mark.parametrize("point", list(CBC_POINTS))
def test_taylorf2(point, lambda_tildes, jit):
    mass, spins, ext = _cbc_args(point)
    mass = mass.at[0].set(2.5)  # a lighter binary, with tides
    lams = jnp.array([300.0, 20.0]) if lambda_tildes else jnp.array([250.0, 420.0])

    def loss(mass, spins, lams, ext):
        theta = jnp.concatenate([mass, spins, lams, ext])
        hp, hc = gen_TaylorF2_hphc(F, theta, 20.0, use_lambda_tildes=lambda_tildes)
        return _loss_from(hp, hc)

    _grads(loss, (mass, spins, lams, ext), jit)


# IMRPhenomD's gradient compiles in about 30 s here: jit at two points only.
@pytest.mark.parametrize("point,jit", [(p, False) for p in CBC_POINTS] + [("generic", True), ("equal_mass", True)])
def test_phenomd(point, jit):
    mass, spins, ext = _cbc_args(point)

    def loss(mass, spins, ext):
        hp, hc = gen_IMRPhenomD_hphc(F, jnp.concatenate([mass, spins, ext]), 20.0)
        return _loss_from(hp, hc)

    _grads(loss, (mass, spins, ext), jit)


# ---------------------------------------------------------------------------
# registry models (eagerly only: under jit their gradients compile for minutes here,
# IMRPhenomXAS's for 3.5 min)
# ---------------------------------------------------------------------------
BASE = dict(
    M_c=20.0,
    eta=0.21,
    s1_x=0.1,
    s1_y=0.05,
    s1_z=0.3,
    s2_x=-0.1,
    s2_y=0.1,
    s2_z=-0.2,
    lambda_1=300.0,
    lambda_2=400.0,
    d_L=400.0,
    phase_c=0.4,
    iota=0.6,
)
EXTRINSIC = ("d_L", "phase_c", "iota")
MODELS = {
    "IMRPhenomXAS-generic": ("IMRPhenomXAS", {}),
    "IMRPhenomXAS-equal_zero_spin": ("IMRPhenomXAS", {"eta": 0.25, "s1_z": 0.0, "s2_z": 0.0}),
    "IMRPhenomPv2-generic": ("IMRPhenomPv2", {}),
    "IMRPhenomD_NRTidalv2-generic": ("IMRPhenomD_NRTidalv2", {"M_c": 1.2}),
    "IMRPhenomXAS_NRTidalv3-generic": ("IMRPhenomXAS_NRTidalv3", {"M_c": 1.2}),
}


@pytest.mark.parametrize("model", list(MODELS))
def test_registry_model(model):
    name, over = MODELS[model]
    wf = ripplegw.waveform(name, f_ref=20.0)
    vals = {**BASE, **over}
    intr = {k: jnp.asarray(vals[k]) for k in wf.parameter_names if k not in EXTRINSIC}
    extr = {k: jnp.asarray(vals[k]) for k in EXTRINSIC}

    def loss(intr, extr):
        h = wf(F, {**intr, **extr})
        return _loss_from(h["p"], h["c"])

    _grads(loss, (intr, extr), False)


def test_phenomd_amplitude_phase():
    wf = ripplegw.waveform("IMRPhenomD", f_ref=30.0)
    intr = {k: jnp.asarray(BASE[k]) for k in ("M_c", "eta", "s1_z", "s2_z")}
    extr = {k: jnp.asarray(BASE[k]) for k in EXTRINSIC}

    def loss(intr, extr):
        p = {**intr, **extr}
        amp = wf.amplitude(F, p) * 1e21
        ph = wf.phase(F, p)
        h0 = wf.strain(F, p) * 1e21
        unit = wf.at_unit_distance(F, p)
        return (
            jnp.sum(amp * jnp.cos(ph) / PSD)
            + jnp.sum(jnp.real(h0 * jnp.conj(DATA)) / PSD)
            + 1e-4 * jnp.sum(jnp.abs(unit["c"] * 1e21) / PSD)
        )

    _grads(loss, (intr, extr), False)
