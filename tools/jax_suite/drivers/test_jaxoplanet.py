"""jaxoplanet: Kepler's equation (``core.kepler``, a custom_jvp around a fixed
non-iterative solver; mean anomalies at 0, pi, 2 pi, negative and past 2 pi, circular
and very eccentric orbits), the limb-darkened occultation flux (``core.light_curve``:
closed forms, a quadrature with its own custom_jvp, uniform, quadratic and fourth-order
laws; the centre b = 0, inner and outer contact, b = 1, no overlap, an occultor larger
than the star, negative b and r = 0), light curves of transit orbits
(given the duration or the speed) and of Keplerian systems (eccentric and circular,
impact parameter or inclination, ascending node), their positions, velocities and
radial velocities, exposure-time integration (resampling and Simpson), the interpolated
light curve, TTV orbits from transit times, the polynomial fit of a limb-darkening
profile and an occulted spherical-harmonic starry surface; differentiated by jax.grad
with respect to each argument alone and all together, eagerly and under jit."""

import jax
import jax.numpy as jnp
import pytest
from jaxoplanet.core import kepler
from jaxoplanet.core.limb_dark import light_curve as core_light_curve
from jaxoplanet.experimental import calc_poly_coeffs
from jaxoplanet.light_curves import limb_dark_light_curve, transforms
from jaxoplanet.orbits import TransitOrbit, TTVOrbit
from jaxoplanet.orbits.keplerian import Central, System
from jaxoplanet.starry import Surface, Ylm
from jaxoplanet.starry.light_curves import surface_light_curve

jax.config.update("jax_enable_x64", True)


def _run(loss, args, argnums_list, jit):
    for argnums in argnums_list:
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*args)


def _weights(n):
    return jnp.linspace(0.7, 1.3, n)


# --- Kepler's equation ----------------------------------------------------------------

M_POINTS = {
    "generic": jnp.array([0.3, 1.7, 2.9, 4.4, 5.9]),
    "edges": jnp.array([0.0, jnp.pi, 2 * jnp.pi, -0.4, 7.5]),  # wrap and fold points
}
ECC = {"circular": 0.0, "mild": 0.3, "high": 0.95}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("ecc", list(ECC))
@pytest.mark.parametrize("m", list(M_POINTS))
def test_kepler(m, ecc, jit):
    def loss(M, e):
        sinf, cosf = kepler(M, e)
        return jnp.sum(_weights(5) * sinf) + jnp.sum(jnp.cos(M) * cosf**2)

    _run(loss, (M_POINTS[m], jnp.asarray(ECC[ecc])), [(0,), (1,), (0, 1)], jit)


# --- the limb-darkened occultation flux -----------------------------------------------

U = {
    "uniform": jnp.zeros((0,)),
    "quadratic": jnp.array([0.3, 0.2]),
    "quartic": jnp.array([0.2, 0.15, 0.1, 0.05]),
}
B_R = {
    # generic overlap, centre, inner contact 1 - r, b = 1, outer contact 1 + r, outside
    "small_r": (jnp.array([0.45, 0.0, 0.9, 1.0, 1.05, 1.1, 1.3, -0.6]), 0.1),  # 1.05: grazing
    "large_r": (jnp.array([0.1, 0.2, 0.5, 1.0, 2.2, 0.0, 1.7, 1.9]), 1.2),  # full occultation too
    "zero_r": (jnp.array([0.3, 0.0, 1.0, 0.5, 1.2, 0.7, -0.2, 1.05]), 0.0),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("br", list(B_R))
@pytest.mark.parametrize("u", list(U))
def test_core_light_curve(u, br, jit):
    b, r = B_R[br]

    def loss(u, b, r):
        return jnp.sum(_weights(b.shape[0]) * core_light_curve(u, b, r))

    argnums = [(1,), (2,), (1, 2)] if u == "uniform" else [(0,), (1,), (2,), (0, 1, 2)]
    _run(loss, (U[u], b, jnp.asarray(r)), argnums, jit)


# --- transit orbits -------------------------------------------------------------------

DURATION = dict(period=3.0, duration=0.2, time_transit=0.01, impact_param=0.3, radius_ratio=0.1)
TIMES = jnp.array([-0.2, -0.09, -0.03, 0.0, 0.04, 0.1, 0.12, 2.95, 3.02])
TRANSIT = {
    "speed": dict(period=3.0, speed=11.0, time_transit=0.01, impact_param=0.5, radius_ratio=0.12),
    "central": dict(period=3.0, duration=0.2, time_transit=0.04, impact_param=0.0, radius_ratio=0.1),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("orbit", list(TRANSIT))  # "duration" in test_integrate
def test_transit_orbit(orbit, jit):
    params = {k: jnp.asarray(v) for k, v in TRANSIT[orbit].items()}
    u = (jnp.asarray(0.3), jnp.asarray(0.2))

    def loss(params, u, t):
        lc = limb_dark_light_curve(TransitOrbit(**params), *u)(t)
        return jnp.sum(_weights(t.shape[0]) * lc)

    _run(loss, (params, u, TIMES), [(0,), (1,), (2,), (0, 1, 2)], jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("order", [0, 2])  # resampling and Simpson (1, the trapezoid, is alike)
def test_integrate(order, jit):
    params = {k: jnp.asarray(v) for k, v in DURATION.items()}

    def loss(params, u, exposure):
        lc_fn = limb_dark_light_curve(TransitOrbit(**params), u)
        lc = transforms.integrate(lc_fn, exposure_time=exposure, order=order, num_samples=5)(TIMES)
        return jnp.sum(_weights(TIMES.shape[0]) * lc)

    _run(loss, (params, jnp.array([0.3, 0.2]), jnp.asarray(0.02)), [(0,), (1,), (2,), (0, 1, 2)], jit)


@pytest.mark.parametrize("jit", [False, True])
def test_interpolate(jit):
    def loss(params, u, t):
        lc_fn = limb_dark_light_curve(TransitOrbit(**params), u)
        lc = transforms.interpolate(
            lc_fn, period=params["period"], time_transit=params["time_transit"], duration=0.4, num_samples=30
        )(t)
        return jnp.sum(_weights(t.shape[0]) * lc)

    params = {k: jnp.asarray(v) for k, v in DURATION.items()}
    t = jnp.array([-0.07, 0.0, 0.03, 0.06, 3.05, -2.98, 0.5])
    _run(loss, (params, jnp.array([0.3, 0.2]), t), [(0,), (1,), (2,), (0, 1, 2)], jit)


@pytest.mark.parametrize("jit", [False, True])
def test_ttv_orbit(jit):
    def loss(tt, shape, t):
        orbit = TTVOrbit(transit_times=(tt,), **shape)
        lc = limb_dark_light_curve(orbit, jnp.array([0.4, 0.1]))(t)
        return jnp.sum(_weights(t.shape[0]) * lc)

    tt = jnp.array([0.0, 3.01, 5.99, 9.02])
    shape = {"duration": jnp.array([0.2]), "impact_param": jnp.array([0.3]), "radius_ratio": jnp.array([0.1])}
    t = jnp.array([-0.05, 0.02, 2.95, 3.0, 3.06, 6.03, 8.99, 9.1])
    _run(loss, (tt, shape, t), [(0,), (1,), (2,), (0, 1, 2)], jit)


# --- Keplerian systems ----------------------------------------------------------------

BODIES = {
    "eccentric": dict(
        period=3.0, time_transit=0.1, impact_param=0.3, radius=0.1, eccentricity=0.2, omega_peri=0.5, mass=0.01
    ),
    "circular_incl": dict(period=2.0, time_transit=0.0, inclination=1.55, radius=0.08, mass=0.002, asc_node=0.3),
}
KTIMES = jnp.array([-0.1, -0.03, 0.0, 0.05, 0.1, 0.8, 1.5])


def _system(central, body):
    return System(Central(**central)).add_body(**body)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("body", list(BODIES))
def test_keplerian_system(body, jit):
    central = {"mass": jnp.asarray(0.9), "radius": jnp.asarray(1.1)}
    params = {k: jnp.asarray(v) for k, v in BODIES[body].items()}

    def loss(central, body, t):
        sys = _system(central, body)
        x, y, z = sys.relative_position(t)
        vx, vy, vz = sys.relative_velocity(t)
        px, py, pz = sys.central_position(t) if "mass" in body else (0.0, 0.0, 0.0)
        rv = sys.radial_velocity(t) if "mass" in body else 0.0
        lc = limb_dark_light_curve(sys, jnp.array([0.3, 0.2]))(t)
        return (
            jnp.sum(0.1 * x + 0.2 * y + 0.3 * z)
            + jnp.sum(0.05 * vx - 0.02 * vy + 0.01 * vz)
            + jnp.sum(px + py + pz)
            + jnp.sum(rv)
            + 50.0 * jnp.sum(_weights(t.shape[0]) * lc[:, 0])
        )

    _run(loss, (central, params, KTIMES), [(0,), (1,), (2,), (0, 1, 2)], jit)


@pytest.mark.parametrize("jit", [False, True])
def test_keplerian_from_orbital_properties(jit):
    def loss(p, t):
        central = Central.from_orbital_properties(period=p["period"], semimajor=p["a"], radius=p["r"])
        sys = System(central).add_body(
            semimajor=p["a"], radius=0.05, eccentricity=p["e"], omega_peri=p["w"], time_peri=0.0, impact_param=0.2
        )
        x, y, z = sys.relative_position(t)
        return jnp.sum(x * y - z) + jnp.sum(sys.relative_velocity(t)[0])

    p = {k: jnp.asarray(v) for k, v in dict(period=5.0, a=12.0, r=0.9, e=0.4, w=-1.0).items()}
    _run(loss, (p, KTIMES), [(0,), (1,), (0, 1)], jit)


# --- limb-darkening profile fit -------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True])
def test_calc_poly_coeffs(jit):
    def loss(mu, intensity):
        c = calc_poly_coeffs(mu, intensity, poly_degree=3)
        return jnp.sum(c * jnp.array([1.0, -0.5, 0.25]))

    mu = jnp.array([0.9, 0.1, 0.5, 0.3, 0.7, 1.0, 0.05, 0.6])  # unsorted: argsort inside
    intensity = 1 - 0.5 * (1 - mu) - 0.2 * (1 - mu) ** 2 + 0.01 * jnp.sin(7 * mu)
    _run(loss, (mu, intensity), [(0,), (1,), (0, 1)], jit)


# --- starry surfaces ------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True])
def test_starry_surface(jit):
    def loss(ydata, u, pos):
        surface = Surface(y=Ylm.from_dense(ydata), u=(u[0], u[1]), inc=1.2, obl=0.3)
        f = surface_light_curve(surface, r=pos[0], x=pos[1], y=pos[2], z=1.0, theta=pos[3])
        return f

    ydata = jnp.array([1.0, 0.1, 0.2, 0.05])
    _run(loss, (ydata, jnp.array([0.3, 0.1]), jnp.array([0.1, 0.2, 0.3, 0.4])), [(0,), (1,), (2,), (0, 1, 2)], jit)
