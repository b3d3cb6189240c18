"""fdtdx: FDTD electromagnetic simulation on a tiny grid (8^3 cells, 13 time steps,
float64) differentiated by jax.grad, eagerly and under jit, with respect to a device's
latent parameters, the inverse permittivities of the whole grid (the part the device
does not overwrite) and both. Gradient paths: fdtdx's reversible method (a
``jax.custom_vjp`` whose backward pass runs the simulation in reverse, with a recorder
replaying the PML interfaces; also with interior checkpoints), the checkpointed method
(equinox's checkpointed ``while_loop``), and the plain forward step (``fdtd.forward``)
in a ``lax.scan`` differentiated by jax itself. Scenes: a point dipole in a PML box, a
Gaussian plane source in a box with PEC sides and PML ends; detectors: energy, fields,
Poynting flux and phasors. Device parameter transforms through ``apply_params``:
Gaussian smoothing, subpixel-smoothed and tanh projections (their steepness ``beta``
differentiated too, at 0, generic and inf: fdtdx's double-where), the inverse
permittivity range and closest-index discretisation (a straight-through estimator),
with latent values at 0, 0.5 (the projection midpoint and a rounding tie) and 1.
Metrics: energy, Poynting flux, integrated power and the normalisations."""

import functools

import fdtdx
import jax
import jax.numpy as jnp
import pytest
from fdtdx.config import GradientConfig, SimulationConfig
from fdtdx.constants import c as c0
from fdtdx.core.grid import UniformGrid
from fdtdx.fdtd.forward import forward

jax.config.update("jax_enable_x64", True)

N = 8
KEY = jax.random.PRNGKey(0)
WAVE = fdtdx.WaveCharacter(frequency=c0 / 800e-9)
MATERIALS = {"air": fdtdx.Material(permittivity=1.0), "si": fdtdx.Material(permittivity=4.0)}
MATERIALS3 = {**MATERIALS, "sin": fdtdx.Material(permittivity=2.5)}


@functools.cache
def _scene(method="checkpointed", boundary="pml", source="dipole", transforms="none", ckpt=0):
    if method == "reversible":
        gc = GradientConfig(method="reversible", recorder=fdtdx.Recorder(modules=[]), num_checkpoints_reversible=ckpt)
    elif method == "checkpointed":
        gc = GradientConfig(method="checkpointed", num_checkpoints=4)
    else:
        gc = None
    config = SimulationConfig(
        time=1.2e-15,
        grid=UniformGrid(spacing=50e-9),
        backend="cpu",
        dtype=jnp.float64,
        courant_factor=0.99,
        gradient_config=gc,
    )
    objs, cons = [], []
    vol = fdtdx.SimulationVolume(partial_grid_shape=(N, N, N))
    objs.append(vol)
    if boundary == "pml":
        bc = fdtdx.BoundaryConfig.from_uniform_bound(boundary_type="pml", thickness=2)
    elif boundary == "pec_pml":
        bc = fdtdx.BoundaryConfig.from_uniform_bound(boundary_type="pec")
        bc = bc.aset("boundary_type_minz", "pml").aset("boundary_type_maxz", "pml")
        bc = bc.aset("thickness_grid_minz", 2).aset("thickness_grid_maxz", 2)
    else:
        bc = fdtdx.BoundaryConfig.from_uniform_bound(boundary_type=boundary)
    bd, cl = fdtdx.boundary_objects_from_config(bc, vol)
    objs.extend(bd.values())
    cons.extend(cl)
    param_transforms, materials = {
        "none": ([], MATERIALS),
        "smooth_subpixel": ([fdtdx.GaussianSmoothing2D(std_discrete=1), fdtdx.SubpixelSmoothedProjection()], MATERIALS),
        "tanh": ([fdtdx.TanhProjection()], MATERIALS),
        "inv_perm_range": ([fdtdx.StandardToInversePermittivityRange()], MATERIALS),
        "closest_index": ([fdtdx.ClosestIndex()], MATERIALS3),
    }[transforms]
    dev = fdtdx.Device(
        name="dev",
        partial_grid_shape=(4, 4, 2),
        partial_voxel_grid_shape=(1, 1, 2),
        materials=materials,
        param_transforms=param_transforms,
    )
    cons.append(dev.place_at_center(vol))
    objs.append(dev)
    if source == "dipole":
        src = fdtdx.PointDipoleSource(
            name="src", partial_grid_shape=(1, 1, 1), wave_character=WAVE, polarization=0, amplitude=1.0
        )
        cons.append(src.set_grid_coordinates(axes=(0, 1, 2), sides=("-", "-", "-"), coordinates=(3, 3, 2)))
    else:
        src = fdtdx.GaussianPlaneSource(
            name="src",
            partial_grid_shape=(None, None, 1),
            wave_character=WAVE,
            direction="+",
            fixed_E_polarization_vector=(1, 0, 0),
            radius=100e-9,
        )
        cons.extend(
            [
                src.same_size(vol, axes=(0, 1)),
                src.place_at_center(vol, axes=(0, 1)),
                src.set_grid_coordinates(axes=(2,), sides=("-",), coordinates=(2,)),
            ]
        )
    objs.append(src)
    energy = fdtdx.EnergyDetector(name="energy", as_slices=False, switch=fdtdx.OnOffSwitch(fixed_on_time_steps=[-1]))
    cons.extend(energy.same_position_and_size(vol))
    field = fdtdx.FieldDetector(name="field", partial_grid_shape=(2, 2, 1), switch=fdtdx.OnOffSwitch(interval=3))
    cons.append(field.set_grid_coordinates(axes=(0, 1, 2), sides=("-", "-", "-"), coordinates=(3, 3, 5)))
    flux = fdtdx.PoyntingFluxDetector(name="flux", partial_grid_shape=(4, 4, 1), direction="+")
    cons.extend(
        [flux.place_at_center(vol, axes=(0, 1)), flux.set_grid_coordinates(axes=(2,), sides=("-",), coordinates=(5,))]
    )
    phasor = fdtdx.PhasorDetector(name="phasor", partial_grid_shape=(2, 2, 1), wave_characters=(WAVE,))
    cons.append(phasor.set_grid_coordinates(axes=(0, 1, 2), sides=("-", "-", "-"), coordinates=(2, 4, 5)))
    objs += [energy, field, flux, phasor]
    obj, arrays, params, config, _ = fdtdx.place_objects(object_list=objs, config=config, constraints=cons, key=KEY)
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), params)
    return obj, arrays, params, config


def _detector_loss(out):
    ds = out.detector_states
    return (
        jnp.sum(out.fields.E**2)
        + 1e-3 * jnp.sum(out.fields.H**2)
        + jnp.sum(ds["energy"]["energy"])
        + jnp.sum(jnp.sin(3.0 * ds["field"]["fields"]))
        + jnp.sum(ds["flux"]["poynting_flux"])
        + jnp.sum(jnp.abs(ds["phasor"]["phasor"]) ** 2)
    )


def _grads(loss, args, jit):
    n = len(args)
    for argnums in [(i,) for i in range(n)] + [tuple(range(n))]:
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*args)


def _latent(params, point):
    if point == "generic":
        return jax.tree.map(lambda x: 0.1 + 0.8 * jnp.cos(jnp.arange(x.size).reshape(x.shape)) ** 2, params)
    return jax.tree.map(lambda x: jnp.full(x.shape, point, jnp.float64), params)


def _run_loss(obj, arrays, config, run):
    def loss(params, inv_eps):
        arr = arrays.aset("inv_permittivities", inv_eps)
        arr, objects, _ = fdtdx.apply_params(arr, obj, params, KEY)
        return _detector_loss(run(arr, objects, config))

    return loss


def _run_fdtd(arr, objects, config):
    return fdtdx.run_fdtd(arr, objects, config, KEY, show_progress=False)[1]


RUNS = {
    "reversible-pml": ("reversible", "pml", "dipole", 0),
    "reversible-pml-2checkpoints": ("reversible", "pml", "dipole", 2),
    "checkpointed-pec-gaussian": ("checkpointed", "pec_pml", "gaussian", 0),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("case", list(RUNS))
def test_run_fdtd(case, jit):
    method, boundary, source, ckpt = RUNS[case]
    obj, arrays, params, config = _scene(method, boundary, source, ckpt=ckpt)
    loss = _run_loss(obj, arrays, config, _run_fdtd)
    _grads(loss, (_latent(params, "generic"), arrays.inv_permittivities * 0.9), jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("boundary", ["pml"])
def test_plain_forward(boundary, jit):
    # fdtdx's single time step in a lax.scan, differentiated by jax itself (no custom_vjp)
    obj, arrays, params, config = _scene(None, boundary)

    def run(arr, objects, config):
        def body(state, _):
            return forward(
                state, config, objects, KEY, record_detectors=True, record_boundaries=False, simulate_boundaries=True
            ), None

        state, _ = jax.lax.scan(body, (jnp.asarray(0, jnp.int32), arr.reset()), None, length=config.time_steps_total)
        return state[1]

    loss = _run_loss(obj, arrays, config, run)
    _grads(loss, (_latent(params, "generic"), arrays.inv_permittivities * 0.9), jit)


TRANSFORM_POINTS = [
    ("smooth_subpixel", "generic", 3.0),
    ("smooth_subpixel", 0.5, 0.0),
    ("tanh", 0.5, 2.0),
    ("tanh", 1.0, 0.0),
    ("tanh", "generic", float("inf")),
    ("inv_perm_range", 0.0, 1.0),
    ("closest_index", 0.5, 1.0),
]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("transforms,point,beta", TRANSFORM_POINTS)
def test_param_transforms(transforms, point, beta, jit):
    # apply_params alone: the latent parameters through the device's transforms into
    # the grid's inverse permittivities
    obj, arrays, params, config = _scene("checkpointed", "pml", transforms=transforms)
    w = jnp.cos(jnp.arange(arrays.inv_permittivities.size).reshape(arrays.inv_permittivities.shape))

    def loss(params, beta):
        arr, _, _ = fdtdx.apply_params(arrays, obj, params, KEY, beta=beta)
        return jnp.sum(w * arr.inv_permittivities) + jnp.sum(arr.inv_permittivities**2)

    _grads(loss, (_latent(params, point), jnp.asarray(beta)), jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("transforms", ["smooth_subpixel"])
def test_transforms_through_fdtd(transforms, jit):
    obj, arrays, params, config = _scene("reversible", "pml", transforms=transforms)

    def loss(params, beta):
        arr, objects, _ = fdtdx.apply_params(arrays, obj, params, KEY, beta=beta)
        return _detector_loss(_run_fdtd(arr, objects, config))

    _grads(loss, (_latent(params, "generic"), jnp.asarray(4.0)), jit)


FIELDS = {
    "generic": (
        jnp.sin(jnp.arange(3 * 3 * 4 * 2.0).reshape(3, 3, 4, 2)),
        jnp.cos(1.3 * jnp.arange(3 * 3 * 4 * 2.0).reshape(3, 3, 4, 2)),
    ),
    "zero": (jnp.zeros((3, 3, 4, 2)), jnp.zeros((3, 3, 4, 2))),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", list(FIELDS))
def test_metrics(point, jit):
    E, H = FIELDS[point]
    inv_eps = 0.5 + 0.1 * jnp.arange(3 * 4 * 2.0).reshape(1, 3, 4, 2) / 24

    def loss(E, H, inv_eps):
        ne, nh = fdtdx.normalize_by_energy(E + 0.1, H, inv_eps, 1.0)
        pe, ph = fdtdx.normalize_by_poynting_flux(E + 0.1, H + 0.2, axis=2)
        return (
            jnp.sum(fdtdx.compute_energy(E, H, inv_eps, 1.0))
            + jnp.sum(fdtdx.compute_poynting_flux(E, H, axis=0) ** 2)
            + fdtdx.compute_integrated_power(E, H, axis=2) ** 2
            + jnp.sum(ne * nh)
            + jnp.sum(pe * ph)
        )

    _grads(loss, (E, H, inv_eps), jit)
