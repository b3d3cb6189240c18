"""jwave (acoustic simulation on jaxdf fields), float64: its solvers and helpers
differentiated by jax.grad, eagerly and under jit, on tiny grids.

Covered: the time-domain PSTD solver ``simulate_wave_propagation`` on
FourierSeries media (an initial pressure with the default smoothing and without,
checkpointed and not, a reference sound speed at the maximum and at the minimum,
point sources with a traced signal, point sensors, band-limited off-grid sensors, a
2-D grid) and on FiniteDifferences media (the generic on-grid code), with respect to
the sound speed, the density and the source/initial-pressure amplitude, each alone
and all; heterogeneous media and homogeneous ones (every sound speed tied, where the
reference speed's max/min has a kink; a scalar sound speed). The Helmholtz solver
(GMRES and BiCGStab through ``custom_linear_solve``, FourierSeries and
FiniteDifferences, attenuation) with respect to the sound speed, density,
attenuation and source; the Helmholtz operator itself with respect to the field and
the medium; the angular spectrum (with respect to the plane's pressure, the
distance and the sound speed; with the angular restriction, and without it with
padding); ``bli_function`` with sensor positions on and between grid nodes; the signal
helpers (analytic_signal, fourier_downsample/upsample, apply_ramp at the ramp's
end, gaussian_window, smooth) and db2neper. ``rayleigh_integral`` is left out: with
jaxdf 0.3.0 it fails before any gradient is taken."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxdf import Domain, FiniteDifferences, FourierSeries
from jwave import geometry as G
from jwave import signal_processing as sp
from jwave.acoustics import operators as ops
from jwave.acoustics import time_harmonic as th
from jwave.acoustics.conversion import db2neper
from jwave.acoustics.time_varying import TimeWavePropagationSettings, simulate_wave_propagation

jax.config.update("jax_enable_x64", True)
JITS = [False, True]


def _grads(loss, args, jit):
    n = len(args)
    for argnums in [(i,) for i in range(n)] + ([tuple(range(n))] if n > 1 else []):
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*args)


N = 20
DOM = Domain((N,), (1e-3,))
X = jnp.arange(N, dtype=jnp.float64)
MEDIA = {
    "heterogeneous": (
        (1500.0 + 80.0 * jnp.exp(-((X - 11.0) ** 2) / 8.0))[:, None],
        (1000.0 + 100.0 * jnp.tanh(X - 13.0))[:, None],
    ),
    # every sound speed equal: the reference speed (max or min over the grid) ties
    "homogeneous": (jnp.full((N, 1), 1500.0), jnp.full((N, 1), 1000.0)),
}
P0 = jnp.exp(-((X - 7.0) ** 2) / 2.0)[:, None]
TA = G.TimeAxis(dt=1.2e-7, t_end=1.2e-6)  # 10 steps


def _td_case(case, field, c, rho, amp):
    """The time-domain loss of a case."""
    settings = TimeWavePropagationSettings(
        checkpoint=case != "no_checkpoint",
        smooth_initial=case != "no_smoothing",
        **({"c_ref": lambda m: m.min_sound_speed} if case == "c_ref_min" else {}),
    )
    med = G.Medium(DOM, sound_speed=field(c, DOM), density=field(rho, DOM), pml_size=4)
    kw = {}
    if case == "sources":
        t = jnp.arange(int(TA.Nt)) * TA.dt
        sig = amp * jnp.sin(2 * jnp.pi * 1.5e6 * t) * jnp.exp(-((t - 5e-7) ** 2) / 1e-13)
        kw["sources"] = G.Sources(
            positions=(np.array([6, 12]),), signals=jnp.stack([sig, -0.5 * sig]), dt=TA.dt, domain=DOM
        )
    else:
        kw["p0"] = field(amp * P0, DOM)
    if case == "bli_sensors":
        kw["sensors"] = G.BLISensors(positions=(jnp.array([4.5, 13.0, 15.25]),), n=(N,))
    elif case != "sources":
        kw["sensors"] = G.Sensors(positions=(np.array([3, 14, 17]),))
    out = simulate_wave_propagation(med, TA, settings=settings, **kw)
    out = out.on_grid if hasattr(out, "on_grid") else out
    return jnp.sum(out**2) * 1e3 + jnp.sum(out[-1])


# (case, field, medium, jit); eager runs take tens of seconds each here, so only some
# cases run eagerly as well as under jit.
FIELDS = {"FourierSeries": FourierSeries, "FiniteDifferences": FiniteDifferences}

TD_PARAMS = [
    ("default", "FourierSeries", "heterogeneous", False),
    ("default", "FourierSeries", "heterogeneous", True),
    ("default", "FourierSeries", "homogeneous", False),
    ("default", "FourierSeries", "homogeneous", True),
    ("c_ref_min", "FourierSeries", "homogeneous", True),
    ("c_ref_min", "FourierSeries", "heterogeneous", True),
    ("no_smoothing", "FourierSeries", "heterogeneous", True),
    ("no_checkpoint", "FourierSeries", "heterogeneous", True),
    ("sources", "FourierSeries", "heterogeneous", False),
    ("sources", "FourierSeries", "heterogeneous", True),
    ("bli_sensors", "FourierSeries", "heterogeneous", True),
    ("default", "FiniteDifferences", "heterogeneous", False),
    ("default", "FiniteDifferences", "heterogeneous", True),
    ("sources", "FiniteDifferences", "homogeneous", True),
]


@pytest.mark.parametrize("case,field,medium,jit", TD_PARAMS)
def test_time_domain(case, field, medium, jit):
    fld = FIELDS[field]
    c, rho = MEDIA[medium]

    def loss(c, rho, amp):
        return _td_case(case, fld, c, rho, amp)

    _grads(loss, (c, rho, jnp.asarray(1.3)), jit)


@pytest.mark.parametrize("jit", JITS)
def test_time_domain_scalar_medium(jit):
    """A scalar (traced) sound speed and density."""
    ta = G.TimeAxis(dt=1.2e-7, t_end=1.2e-6)

    def loss(c, rho, amp):
        med = G.Medium(DOM, sound_speed=c, density=rho, pml_size=4)
        out = simulate_wave_propagation(med, ta, p0=FourierSeries(amp * P0, DOM))
        return jnp.sum(out.on_grid[:, 5:9] ** 2)

    _grads(loss, (jnp.asarray(1500.0), jnp.asarray(1000.0), jnp.asarray(0.8)), jit)


@pytest.mark.parametrize("jit", [True])  # eagerly: over a minute on two cores
def test_time_domain_2d(jit):
    dom = Domain((12, 10), (1e-3, 1e-3))
    ii, jj = jnp.meshgrid(jnp.arange(12.0), jnp.arange(10.0), indexing="ij")
    c = (1500.0 + 60.0 * jnp.exp(-((ii - 6) ** 2 + (jj - 5) ** 2) / 6.0))[..., None]
    rho = (1000.0 + 50.0 * jnp.tanh(jj - 5.0))[..., None]
    p0 = jnp.exp(-((ii - 4) ** 2 + (jj - 4) ** 2) / 2.0)[..., None]
    ta = G.TimeAxis(dt=1.2e-7, t_end=0.6e-6)
    sensors = G.Sensors(positions=(np.array([2, 9]), np.array([7, 3])))

    def loss(c, rho, amp):
        med = G.Medium(dom, sound_speed=FourierSeries(c, dom), density=FourierSeries(rho, dom), pml_size=3)
        out = simulate_wave_propagation(med, ta, p0=FourierSeries(amp * p0, dom), sensors=sensors)
        return jnp.sum(out**2) + jnp.sum(out)

    _grads(loss, (c, rho, jnp.asarray(0.9)), jit)


# ------------------------------------------------------------------- Helmholtz
SRC = jnp.zeros((N, 1), jnp.complex128).at[6, 0].set(1.0).at[15, 0].set(-0.4j)
OMEGA = 2 * jnp.pi * 3e5
ATT = jnp.full((N, 1), 0.3)


# (method, field, medium, jit); an eager GMRES solve's gradients take over a minute
# here, so only one case runs eagerly.
HELMHOLTZ_PARAMS = [
    ("gmres", "FourierSeries", "heterogeneous", False),
    ("gmres", "FourierSeries", "heterogeneous", True),
    ("gmres", "FourierSeries", "homogeneous", True),
    ("bicgstab", "FourierSeries", "heterogeneous", True),
    ("bicgstab", "FourierSeries", "homogeneous", False),
    ("gmres", "FiniteDifferences", "heterogeneous", True),
]


@pytest.mark.parametrize("method,field,medium,jit", HELMHOLTZ_PARAMS)
def test_helmholtz_solver(method, field, medium, jit):
    fld = FIELDS[field]
    c, rho = MEDIA[medium]

    def loss(c, rho, att, amp):
        med = G.Medium(DOM, sound_speed=fld(c, DOM), density=fld(rho, DOM), attenuation=fld(att, DOM), pml_size=4)
        u = th.helmholtz_solver(med, OMEGA, fld(SRC * amp, DOM), method=method, tol=1e-13, maxiter=100, restart=20)
        return jnp.sum(jnp.abs(u.on_grid[3:17]) ** 2) + jnp.real(u.on_grid[10, 0])

    _grads(loss, (c, rho, ATT, jnp.asarray(1.1)), jit)


@pytest.mark.parametrize("jit", JITS)
@pytest.mark.parametrize("field", ["FourierSeries", "FiniteDifferences"])
def test_helmholtz_operator(field, jit):
    fld = FIELDS[field]
    c, rho = MEDIA["heterogeneous"]
    u0 = (jnp.sin(X / 3.0) + 1j * jnp.cos(X / 5.0))[:, None]

    def loss(u, c, rho):
        med = G.Medium(DOM, sound_speed=fld(c, DOM), density=fld(rho, DOM), attenuation=fld(ATT, DOM), pml_size=4)
        out = ops.helmholtz(fld(u, DOM), med, omega=OMEGA)
        return jnp.sum(jnp.abs(out.on_grid) ** 2) * 1e-8 + jnp.sum(
            jnp.real(ops.scale_source_helmholtz(fld(u, DOM), med).on_grid)
        )

    _grads(loss, (u0, c, rho), jit)


# --------------------------------------------------- angular spectrum, Rayleigh
PDOM = Domain((10, 10), (1e-4, 1e-4))
II, JJ = jnp.meshgrid(jnp.arange(10.0), jnp.arange(10.0), indexing="ij")
PLANE = (jnp.exp(-((II - 4.5) ** 2 + (JJ - 5.0) ** 2) / 4.0) * jnp.exp(0.3j * II))[..., None]


@pytest.mark.parametrize("jit", JITS)
@pytest.mark.parametrize("restrict,padding", [(True, 0), (False, 2)])
def test_angular_spectrum(restrict, padding, jit):
    def loss(p, z, c):
        med = G.Medium(PDOM, sound_speed=c)
        out = th.angular_spectrum(
            FourierSeries(p, PDOM), z_pos=z, f0=5e6, medium=med, padding=padding, angular_restriction=restrict
        )
        return jnp.sum(jnp.abs(out.on_grid) ** 2) + jnp.real(jnp.sum(out.on_grid * jnp.conj(PLANE)))

    _grads(loss, (PLANE, jnp.asarray(3e-4), jnp.asarray(1500.0)), jit)


# rayleigh_integral is left out: with jaxdf 0.3.0 it fails before any gradient
# (it asks the FourierSeries for ``ndim``, which jaxdf's fields no longer have).


# ---------------------------------------------------------------- BLI sensors
@pytest.mark.parametrize("jit", JITS)
@pytest.mark.parametrize("n", [12, 11])  # even and odd grids: two formulas
@pytest.mark.parametrize("where", ["between", "on_nodes", "mixed"])
def test_bli_function(where, n, jit):
    x0 = {"between": [2.3, 7.71], "on_nodes": [3.0, 8.0], "mixed": [3.0, 5.5]}[where]
    w = jnp.cos(jnp.arange(n) / 2.0)

    def loss(x0, w):
        y = G.bli_function(x0, jnp.arange(n)[None], n)
        return jnp.sum((y @ w) ** 2) + jnp.sum(y[:, 0])

    _grads(loss, (jnp.asarray(x0), w), jit)


# ------------------------------------------------------------ signal helpers
SIG = jnp.sin(jnp.linspace(0.0, 9.0, 24)) * jnp.exp(-(jnp.linspace(-2.0, 2.0, 24) ** 2))


@pytest.mark.parametrize("jit", JITS)
@pytest.mark.parametrize(
    "fn", ["analytic_signal", "downsample", "upsample", "ramp", "gaussian_window", "smooth", "db2neper"]
)
def test_signal_processing(fn, jit):
    if fn == "analytic_signal":
        loss, args = (lambda s: jnp.sum(jnp.abs(sp.analytic_signal(s)))), (SIG,)
    elif fn == "downsample":
        loss, args = (
            (lambda s: jnp.sum(jnp.abs(sp.fourier_downsample(s.reshape(4, 6), 2, discard_last=True)) ** 2)),
            (SIG,),
        )
    elif fn == "upsample":
        loss, args = (
            (lambda s: jnp.sum(jnp.sin(jnp.real(sp.fourier_upsample(s.reshape(4, 6), 2, discard_last=True))))),
            (SIG,),
        )
    elif fn == "ramp":
        # dt = 0.25, f0 = 1, three cycles: t = 3 at index 12 is exactly the ramp's end
        loss, args = (lambda s, dt: jnp.sum(sp.apply_ramp(s, dt, 1.0) ** 2)), (SIG, jnp.asarray(0.25))
    elif fn == "gaussian_window":
        t = jnp.linspace(0.0, 1.0, 24)
        loss, args = (
            (lambda s, mu, sig: jnp.sum(sp.gaussian_window(s, t, mu, sig))),
            (SIG, jnp.asarray(t[7]), jnp.asarray(0.2)),
        )
    elif fn == "smooth":
        loss, args = (lambda s, e: jnp.sum(sp.smooth(s.reshape(4, 6), e) ** 2)), (SIG, jnp.asarray(1.5))
    else:
        loss, args = (lambda a, y: db2neper(a, y) * 1e3), (jnp.asarray(0.75), jnp.asarray(1.5))
    _grads(loss, args, jit)
