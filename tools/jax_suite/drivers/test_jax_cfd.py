"""jax-cfd: finite-volume and pseudospectral fluid solvers on tiny grids, differentiated
by jax.grad eagerly and under jit, each differentiable argument alone and all together.

Covers jax_cfd.base: finite differences (central/forward/backward differences,
Laplacian, divergence, centred divergence, gradient tensor, 2D curl) under periodic,
Dirichlet and channel-flow boundary conditions; interpolation (linear, upwind,
Lax-Wendroff, the van Leer TVD limiter, point interpolation of order 0 and 1 in the
nearest, wrap and constant modes, on grid nodes, between them and outside); advection (linear, upwind, van Leer with
its explicit limiter and via limiters, Lax-Wendroff and TVD through ``advect_general``,
semi-Lagrangian, ``convect_linear``) with respect to the scalar, the velocity and dt, at
generic fields, at plateaus where the limiter's gradient ratios are 0/0 and the
velocity is exactly zero (the kinks of ``where(u > 0)``, ``sign`` and ``abs``), and van
Leer with Dirichlet boundaries (mirror and extend padding; jax-cfd has no
constant padding); explicit diffusion and the
implicit CG and fast-diagonalisation diffusion solves (periodic, Dirichlet, channel)
with respect to the field, the viscosity and dt; pressure projection with the FFT, RFFT,
matmul and CG solvers (periodic, Dirichlet, channel flow); Navier-Stokes time stepping
(``semi_implicit_navier_stokes`` with forward Euler, midpoint, Heun and RK4;
``implicit_diffusion_navier_stokes`` with both diffusion solvers; Kolmogorov and linear
forcing and their sum; explicit Smagorinsky LES; ``funcutils.repeated`` and
``trajectory``) with kinetic-energy losses with respect to the initial velocity, the
viscosity, dt and the forcing scale; the Smagorinsky eddy-viscosity model (at a zero
velocity too, where its sqrt sits at 0); the collocated solver. And jax_cfd.spectral:
Kuramoto-Sivashinsky, Burgers, 2D Navier-Stokes (vorticity form, with drag and
Kolmogorov forcing) and nonlinear Schrodinger equations with each IMEX time stepper
(backward/forward Euler, Crank-Nicolson RK2/RK3/RK4, IMEX-RK SIL3, not all with every
equation) with respect to the
initial state, the viscosity and dt; the spectral utilities (3/2- and 2x-rule
truncations, filters, vorticity-to-velocity).

jax-cfd 0.2.1 still calls ``jax.tree_map``/``jax.tree_unflatten``, which jax 0.10 no
longer has: the driver restores them.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if not hasattr(jax, "tree_map"):
    jax.tree_map = jax.tree.map
if not hasattr(jax, "tree_unflatten"):
    jax.tree_unflatten = jax.tree_util.tree_unflatten
if not hasattr(jax, "tree_leaves"):
    jax.tree_leaves = jax.tree_util.tree_leaves

import jax_cfd.collocated as collocated
from jax_cfd.base import (
    advection,
    boundaries,
    diffusion,
    equations,
    forcings,
    funcutils,
    grids,
    interpolation,
    pressure,
    subgrid_models,
    time_stepping,
)
from jax_cfd.base import finite_differences as fd
from jax_cfd.spectral import equations as spectral_equations
from jax_cfd.spectral import time_stepping as spectral_ts
from jax_cfd.spectral import utils as spectral_utils

jax.config.update("jax_enable_x64", True)

N = 8
GRID = grids.Grid((N, N), domain=((0.0, 2 * np.pi), (0.0, 2 * np.pi)))
GRID1 = grids.Grid((12,), domain=((-1.0, 1.0),))
PERIODIC = boundaries.periodic_boundary_conditions(2)
RNG = np.random.default_rng(0)


def _rand(*shape, scale=1.0):
    return jnp.asarray(RNG.normal(size=shape) * scale)


def _grads(loss, args, jit, argnums_list=None):
    if argnums_list is None:
        n = len(args)
        argnums_list = [(i,) for i in range(n)] + ([tuple(range(n))] if n > 1 else [])
    for argnums in argnums_list:
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*args)


def _gv(data, offset, bc=PERIODIC, grid=GRID):
    return grids.GridVariable(grids.GridArray(data, offset, grid), bc)


def _velocity(vdata, bc=PERIODIC, grid=GRID, impose=False):
    v = tuple(_gv(vdata[i], grid.cell_faces[i], bc, grid) for i in range(grid.ndim))
    if impose:
        v = tuple(u.impose_bc() for u in v)
    return v


def _weights(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).uniform(0.5, 1.5, size=shape))


W = _weights((N, N), 1)


def _wsum(*arrays):
    return sum(jnp.sum(W[: a.shape[0], : a.shape[1]] * jnp.asarray(a) ** 2) for a in arrays)


# ----------------------------------------------------------------------------- fields
V_GENERIC = _rand(2, N, N, scale=0.7)
C_GENERIC = _rand(N, N)
# plateaus: blocks of equal values (limiter ratios 0/0) and velocities exactly zero on
# every other face (the kinks of where(u > 0))
C_TIES = jnp.asarray(np.kron(np.array([[1.0, 0.0], [0.0, 2.0]]), np.ones((N // 2, N // 2))))
V_TIES = jnp.asarray(
    np.stack(
        [
            np.where(np.arange(N)[None, :] % 2 == 0, 0.0, 0.5) * np.ones((N, N)),
            np.where(np.arange(N)[:, None] % 3 == 0, 0.0, -0.4) * np.ones((N, N)),
        ]
    )
)
FIELDS = {
    "generic": (C_GENERIC, V_GENERIC),
    "ties": (C_TIES, V_TIES),
    "zero_velocity": (C_GENERIC, jnp.zeros((2, N, N))),
}

BCS = {
    "periodic": boundaries.periodic_boundary_conditions(2),
    "dirichlet": boundaries.dirichlet_boundary_conditions(2, ((0.3, -0.2), (0.1, 0.4))),
    "channel": boundaries.channel_flow_boundary_conditions(2),
}


# ------------------------------------------------------------------ finite differences
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("bc", list(BCS))
def test_finite_differences(bc, jit):
    bc_ = BCS[bc]

    def loss(cdata, vdata):
        c = _gv(cdata, GRID.cell_center, bc_)
        v = tuple(_gv(vdata[i], GRID.cell_faces[i], bc_) for i in range(2))
        terms = [
            fd.laplacian(c).data,
            fd.central_difference(c, 0).data,
            fd.backward_difference(c, 1).data,
            fd.forward_difference(c, 0).data,
            fd.divergence(v).data,
            fd.curl_2d(v).data,
        ]
        terms += [t.data for t in fd.central_difference(c)]
        terms += [t.data for t in fd.gradient_tensor(v).ravel()]
        if bc == "periodic":
            vc = tuple(_gv(vdata[i], GRID.cell_center, bc_) for i in range(2))
            terms.append(fd.centered_divergence(vc).data)
        return _wsum(*terms)

    _grads(loss, (C_GENERIC, V_GENERIC), jit)


# -------------------------------------------------------------------- interpolation
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("field", list(FIELDS))
@pytest.mark.parametrize("method", ["linear", "upwind", "lax_wendroff", "tvd_van_leer"])
def test_interpolation(method, field, jit):
    cdata, vdata = FIELDS[field]
    fn = {
        "linear": interpolation.linear,
        "upwind": interpolation.upwind,
        "lax_wendroff": interpolation.lax_wendroff,
        "tvd_van_leer": interpolation.apply_tvd_limiter(interpolation.lax_wendroff),
    }[method]

    def loss(cdata, vdata, dt):
        c = _gv(cdata, GRID.cell_center)
        v = _velocity(vdata)
        outs = [fn(c, GRID.cell_faces[i], v, dt).data for i in range(2)]
        return _wsum(*outs)

    _grads(loss, (cdata, vdata, jnp.asarray(0.1)), jit)


@pytest.mark.parametrize("jit", [False, True])
def test_van_leer_limiter(jit):
    r = jnp.array([-1.0, -0.0, 0.0, 0.3, 1.0, 4.0, -1.0 + 1e-3])

    def loss(r):
        return jnp.sum(interpolation.van_leer_limiter(r) * jnp.arange(1.0, 8.0))

    _grads(loss, (r,), jit)


POINTS = {
    "between": jnp.array([1.3, 4.1]),
    "on_node": jnp.array([3.5, 2.5]) * GRID.step[0],  # a cell centre: a data point
    "outside": jnp.array([-0.4, 7.0]),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("mode", ["nearest", "wrap", "constant"])
@pytest.mark.parametrize("order", [0, 1])
@pytest.mark.parametrize("point", list(POINTS))
def test_point_interpolation(point, order, mode, jit):
    def loss(p, cdata):
        c = grids.GridArray(cdata, GRID.cell_center, GRID)
        return interpolation.point_interpolation(p, c, order=order, mode=mode, cval=0.3) ** 2

    _grads(loss, (POINTS[point], C_GENERIC), jit)


# ------------------------------------------------------------------------- advection
def _advect_general(interp):
    def f(c, v, dt):
        return advection.advect_general(c, v, interpolation.linear, interp, dt)

    return f


ADVECT = {
    "linear": lambda c, v, dt: advection.advect_linear(c, v, dt),
    "upwind": lambda c, v, dt: advection.advect_upwind(c, v, dt),
    "van_leer": advection.advect_van_leer,
    "van_leer_using_limiters": advection.advect_van_leer_using_limiters,
    "lax_wendroff": _advect_general(interpolation.lax_wendroff),
    "tvd_lax_wendroff": _advect_general(interpolation.apply_tvd_limiter(interpolation.lax_wendroff)),
    "semilagrangian": lambda c, v, dt: advection.advect_step_semilagrangian(c, v, dt).array,
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("field", list(FIELDS))
@pytest.mark.parametrize("scheme", list(ADVECT))
def test_advection(scheme, field, jit):
    cdata, vdata = FIELDS[field]

    def loss(cdata, vdata, dt):
        out = ADVECT[scheme](_gv(cdata, GRID.cell_center), _velocity(vdata), dt)
        return _wsum(out.data)

    _grads(loss, (cdata, vdata, jnp.asarray(0.05)), jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("mode", ["mirror", "extend"])
@pytest.mark.parametrize("sign", [1.0, -1.0, 0.0])
def test_van_leer_dirichlet_1d(sign, mode, jit):
    """The mass-conservation set-up of jax-cfd's own test: Dirichlet velocity and
    scalar (non-zero boundary values), a few explicit Euler steps."""
    bc = boundaries.dirichlet_boundary_conditions(1)
    c_bc = boundaries.dirichlet_boundary_conditions(1, ((-1.0, 1.0),))
    x1 = GRID1.mesh((1.0,))[0]
    x5 = GRID1.mesh((0.5,))[0]
    u0 = -sign * jnp.sin(jnp.pi * x1)
    c0 = jnp.where(x5 < 0.1, x5, 0.1)  # a plateau on the right: 0/0 ratios

    def loss(cdata, udata, dt):
        v = (bc.impose_bc(grids.GridArray(udata, (1.0,), GRID1)),)
        c = c_bc.impose_bc(grids.GridArray(cdata, (0.5,), GRID1))
        for _ in range(3):
            dc = advection.advect_van_leer(c, v, dt, mode=mode)
            c = c_bc.impose_bc(c.array + dt * dc)
        return jnp.sum(c.data**2 * jnp.linspace(0.5, 1.5, 12))

    _grads(loss, (c0, u0, jnp.asarray(0.01)), jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("field", ["generic", "ties", "zero_velocity"])
def test_convect_linear(field, jit):
    def loss(vdata):
        return _wsum(*[a.data for a in advection.convect_linear(_velocity(vdata))])

    _grads(loss, (FIELDS[field][1],), jit)


# ------------------------------------------------------------------------- diffusion
@pytest.mark.parametrize("jit", [False, True])
def test_diffuse_explicit(jit):
    def loss(cdata, nu):
        return _wsum(diffusion.diffuse(_gv(cdata, GRID.cell_center), nu).data)

    _grads(loss, (C_GENERIC, jnp.asarray(0.07)), jit)


DIFFUSION_SOLVES = {
    "cg": (diffusion.solve_cg, "periodic"),
    "fast_diag": (diffusion.solve_fast_diag, "periodic"),
    "fast_diag_matmul": (functools.partial(diffusion.solve_fast_diag, implementation="matmul"), "periodic"),
    "fast_diag_fft": (functools.partial(diffusion.solve_fast_diag, implementation="fft"), "periodic"),
    "fast_diag_dirichlet": (diffusion.solve_fast_diag, "dirichlet0"),
    "fast_diag_channel": (diffusion.solve_fast_diag, "channel"),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("solve", list(DIFFUSION_SOLVES))
def test_diffusion_solve(solve, jit):
    fn, bcname = DIFFUSION_SOLVES[solve]
    bc = boundaries.dirichlet_boundary_conditions(2) if bcname == "dirichlet0" else BCS[bcname]

    def loss(vdata, nu, dt):
        v = _velocity(vdata, bc, impose=bcname != "periodic")
        return _wsum(*[u.data for u in fn(v, nu, dt)])

    _grads(loss, (V_GENERIC, jnp.asarray(0.3), jnp.asarray(0.2)), jit)


# -------------------------------------------------------------------------- pressure
PRESSURE_SOLVES = {
    "fast_diag": (pressure.solve_fast_diag, "periodic"),
    "fast_diag_matmul": (functools.partial(pressure.solve_fast_diag, implementation="matmul"), "periodic"),
    "fast_diag_fft": (functools.partial(pressure.solve_fast_diag, implementation="fft"), "periodic"),
    "fast_diag_rfft": (functools.partial(pressure.solve_fast_diag, implementation="rfft"), "periodic"),
    "cg": (functools.partial(pressure.solve_cg, maxiter=30), "periodic"),
    "cg_dirichlet": (functools.partial(pressure.solve_cg, maxiter=30), "dirichlet0"),
    "fast_diag_dirichlet": (pressure.solve_fast_diag, "dirichlet0"),
    "fast_diag_channel": (pressure.solve_fast_diag_channel_flow, "channel"),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("solve", list(PRESSURE_SOLVES))
def test_projection(solve, jit):
    fn, bcname = PRESSURE_SOLVES[solve]
    bc = boundaries.dirichlet_boundary_conditions(2) if bcname == "dirichlet0" else BCS[bcname]

    def loss(vdata):
        v = _velocity(vdata, bc, impose=bcname != "periodic")
        return _wsum(*[u.data for u in pressure.projection(v, fn)])

    _grads(loss, (V_GENERIC,), jit)


# ------------------------------------------------------------------- Navier-Stokes
def _kinetic_energy(v):
    return 0.5 * sum(jnp.sum(u.data**2) for u in v)


STEPPERS = {
    "forward_euler": time_stepping.forward_euler,
    "midpoint_rk2": time_stepping.midpoint_rk2,
    "heun_rk2": time_stepping.heun_rk2,
    "classic_rk4": time_stepping.classic_rk4,
}
FORCINGS = {
    "none": lambda grid, s: None,
    "kolmogorov": lambda grid, s: forcings.kolmogorov_forcing(grid, scale=s, k=2),
    "taylor_green": lambda grid, s: forcings.taylor_green_forcing(grid, scale=s, k=1),
    "linear": lambda grid, s: forcings.linear_forcing(grid, s),
    "sum": lambda grid, s: forcings.sum_forcings(
        forcings.kolmogorov_forcing(grid, scale=s), forcings.linear_forcing(grid, -0.1 * s)
    ),
}
NS_CASES = {
    "euler_kolmogorov": ("forward_euler", "kolmogorov"),
    "midpoint_linear": ("midpoint_rk2", "linear"),
    "rk4_sum": ("classic_rk4", "sum"),
}


def _v0():
    """A divergence-free initial velocity (projected random field)."""
    return V_GENERIC


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("case", list(NS_CASES))
def test_semi_implicit_navier_stokes(case, jit):
    stepper, forcing = NS_CASES[case]

    def loss(vdata, nu, dt, scale):
        step = equations.semi_implicit_navier_stokes(
            density=1.0,
            viscosity=nu,
            dt=dt,
            grid=GRID,
            forcing=FORCINGS[forcing](GRID, scale),
            time_stepper=STEPPERS[stepper],
        )
        v = funcutils.repeated(step, 2 if stepper == "forward_euler" else 1)(_velocity(vdata))
        return _kinetic_energy(v)

    args = (V_GENERIC, jnp.asarray(0.05), jnp.asarray(0.02), jnp.asarray(0.8))
    argnums = [(0,), (1,), (2,), (0, 1, 2)] + ([(3,), (0, 1, 2, 3)] if forcing != "none" else [])
    _grads(loss, args, jit, argnums)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("convect", ["linear", "van_leer"])
def test_navier_stokes_convection(convect, jit):
    """``semi_implicit_navier_stokes`` with other convection terms, the pressure solve
    by CG, and ``funcutils.trajectory`` with a post-processed energy per frame."""

    def conv(v, dt):
        if convect == "van_leer_limiters":
            return None
        if convect == "linear":
            return advection.convect_linear
        if convect == "upwind_general":
            return lambda v: tuple(advection.advect_upwind(u, v) for u in v)
        return lambda v: tuple(advection.advect_van_leer(u, v, dt) for u in v)

    def loss(vdata, nu, dt):
        step = equations.semi_implicit_navier_stokes(
            density=1.3,
            viscosity=nu,
            dt=dt,
            grid=GRID,
            convect=conv(None, dt),
            pressure_solve=functools.partial(pressure.solve_cg, maxiter=20),
        )
        _, frames = funcutils.trajectory(step, 2, _kinetic_energy)(_velocity(vdata))
        return jnp.sum(frames * jnp.array([1.0, 2.0]))

    _grads(loss, (V_GENERIC, jnp.asarray(0.05), jnp.asarray(0.02)), jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("solve", ["fast_diag", "cg"])
def test_implicit_diffusion_navier_stokes(solve, jit):
    dsolve = {"fast_diag": diffusion.solve_fast_diag, "cg": functools.partial(diffusion.solve_cg, maxiter=20)}[solve]

    def loss(vdata, nu, dt, scale):
        step = equations.implicit_diffusion_navier_stokes(
            density=1.0,
            viscosity=nu,
            dt=dt,
            grid=GRID,
            diffusion_solve=dsolve,
            forcing=forcings.kolmogorov_forcing(GRID, scale=scale),
        )
        return _kinetic_energy(funcutils.repeated(step, 2)(_velocity(vdata)))

    _grads(loss, (V_GENERIC, jnp.asarray(0.1), jnp.asarray(0.02), jnp.asarray(0.5)), jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("field", ["generic", "zero_velocity"])
def test_smagorinsky(field, jit):
    vdata = FIELDS[field][1]

    def loss(vdata, cs):
        visc = functools.partial(subgrid_models.smagorinsky_viscosity, cs=cs)
        acc = subgrid_models.evm_model(_velocity(vdata), visc)
        return _wsum(*[a.data for a in acc])

    _grads(loss, (vdata, jnp.asarray(0.2)), jit)


@pytest.mark.parametrize("jit", [False, True])
def test_smagorinsky_navier_stokes(jit):
    def loss(vdata, cs, dt):
        step = subgrid_models.explicit_smagorinsky_navier_stokes(
            dt=dt, cs=cs, forcing=None, density=1.0, viscosity=0.01, grid=GRID
        )
        return _kinetic_energy(funcutils.repeated(step, 2)(_velocity(vdata)))

    _grads(loss, (V_GENERIC, jnp.asarray(0.2), jnp.asarray(0.02)), jit)


@pytest.mark.parametrize("jit", [False, True])
def test_collocated_navier_stokes(jit):
    def loss(vdata, nu, dt):
        v = tuple(_gv(vdata[i], GRID.cell_center) for i in range(2))
        step = collocated.equations.semi_implicit_navier_stokes(
            density=1.0,
            viscosity=nu,
            dt=dt,
            grid=GRID,
            convect=collocated.advection.convect_linear,
            diffuse=collocated.diffusion.diffuse,
            pressure_solve=functools.partial(collocated.pressure.solve_cg, maxiter=20),
        )
        return _kinetic_energy(funcutils.repeated(step, 2)(v))

    _grads(loss, (V_GENERIC, jnp.asarray(0.05), jnp.asarray(0.02)), jit)


# -------------------------------------------------------------------------- spectral
SPECTRAL_STEPPERS = {
    "bf_euler": spectral_ts.backward_forward_euler,
    "cn_rk2": spectral_ts.crank_nicolson_rk2,
    "cn_rk3": spectral_ts.crank_nicolson_rk3,
    "cn_rk4": spectral_ts.crank_nicolson_rk4,
    "imex_sil3": spectral_ts.imex_rk_sil3,
}
GRID_1D = grids.Grid((16,), domain=((0.0, 2 * np.pi),))
X1D = GRID_1D.mesh()[0]
U1D = jnp.sin(X1D) + 0.3 * jnp.cos(2 * X1D) + 0.1


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("stepper", ["bf_euler", "cn_rk4", "imex_sil3"])
@pytest.mark.parametrize("smooth", [True, False])
def test_kuramoto_sivashinsky(smooth, stepper, jit):
    def loss(u0, dt):
        eq = spectral_equations.KuramotoSivashinsky(GRID_1D, smooth=smooth)
        step = SPECTRAL_STEPPERS[stepper](eq, dt)
        uhat = funcutils.repeated(step, 3)(jnp.fft.rfft(u0))
        return jnp.sum(jnp.fft.irfft(uhat, n=16) ** 2)

    _grads(loss, (U1D, jnp.asarray(0.01)), jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("stepper", ["cn_rk2"])
def test_burgers(stepper, jit):
    def loss(u0, nu, dt):
        eq = spectral_equations.BurgersEquation(viscosity=nu, grid=GRID_1D)
        step = SPECTRAL_STEPPERS[stepper](eq, dt)
        uhat, t = funcutils.repeated(step, 3)((jnp.fft.rfft(u0), jnp.asarray(0.0)))
        return jnp.sum(jnp.fft.irfft(uhat, n=16) ** 2) + 0.1 * t

    _grads(loss, (U1D, jnp.asarray(0.05), jnp.asarray(0.01)), jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("stepper", ["bf_euler", "cn_rk3"])
@pytest.mark.parametrize("forced", [False, True])
def test_spectral_navier_stokes(forced, stepper, jit):
    x, y = GRID.mesh()
    w0 = jnp.sin(x) * jnp.cos(2 * y) + 0.2 * jnp.cos(x + y) + 0.05 * C_GENERIC

    def loss(w0, nu, dt, drag):
        if forced:
            eq = spectral_equations.NavierStokes2D(
                nu,
                GRID,
                drag=drag,
                smooth=True,
                forcing_fn=lambda g: forcings.kolmogorov_forcing(g, k=2, offsets=((0, 0), (0, 0))),
            )
        else:
            eq = spectral_equations.NavierStokes2D(nu, GRID, drag=drag, smooth=True)
        step = SPECTRAL_STEPPERS[stepper](eq, dt)
        what = funcutils.repeated(step, 2)(jnp.fft.rfftn(w0))
        vx, vy = spectral_utils.vorticity_to_velocity(GRID)(what)
        return jnp.sum(jnp.fft.irfftn(vx) ** 2 + jnp.fft.irfftn(vy) ** 2) + jnp.sum(jnp.fft.irfftn(what) ** 2)

    _grads(loss, (w0, jnp.asarray(0.01), jnp.asarray(0.05), jnp.asarray(0.1)), jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("smooth", [True])
def test_forced_navier_stokes_2d(smooth, jit):
    x, y = GRID.mesh()
    w0 = jnp.sin(x) * jnp.cos(2 * y) + 0.05 * C_GENERIC

    def loss(w0, nu, dt):
        eq = spectral_equations.ForcedNavierStokes2D(nu, GRID, smooth)
        step = spectral_ts.crank_nicolson_rk4(eq, dt)
        return jnp.sum(jnp.fft.irfftn(funcutils.repeated(step, 2)(jnp.fft.rfftn(w0))) ** 2)

    _grads(loss, (w0, jnp.asarray(0.01), jnp.asarray(0.05)), jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("smooth", [True, False])
def test_nonlinear_schrodinger(smooth, jit):
    def loss(re, im, dt):
        eq = spectral_equations.NonlinearSchrodinger(GRID_1D, smooth=smooth)
        step = spectral_ts.crank_nicolson_rk4(eq, dt)
        psihat = funcutils.repeated(step, 3)(jnp.fft.fft(re + 1j * im))
        return jnp.sum(jnp.abs(jnp.fft.ifft(psihat)) ** 4) + jnp.sum(jnp.real(psihat) * jnp.linspace(0, 1, 16))

    _grads(loss, (U1D, jnp.cos(X1D), jnp.asarray(0.01)), jit)


@pytest.mark.parametrize("jit", [False, True])
def test_spectral_utils(jit):
    def loss(u1, w2, alpha):
        a = jnp.sum(spectral_utils.padded_irfft(spectral_utils.truncated_rfft(u1**2)) ** 2)
        z = u1 + 1j * jnp.cos(u1)
        b = jnp.sum(jnp.abs(spectral_utils.padded_ifft_2x(spectral_utils.truncated_fft_2x(z))) ** 2)
        c = jnp.sum(spectral_utils.exponential_filter(w2, alpha=alpha, order=2) ** 2)
        d = jnp.sum(jnp.fft.irfft2(spectral_utils.circular_filter_2d(GRID) * jnp.fft.rfft2(w2)) ** 2)
        e = jnp.sum(jnp.fft.irfft2(spectral_utils.brick_wall_filter_2d(GRID) * jnp.fft.rfft2(w2**3)))
        return a + b + c + d + e

    _grads(loss, (U1D, C_GENERIC, jnp.asarray(0.5)), jit)
