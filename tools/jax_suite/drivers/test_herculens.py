"""herculens: strong-lensing models differentiated by jax.grad, eagerly and under jit.
Every analytic mass profile (SIE, SIS, NIE, EPL, external shear in both
parametrisations, point mass, Gaussian potential, multipole, PIEMD, dPIE) through
``MassModel``'s ray shooting and Fermat potential (the hessian, convergence, shear and
magnification too for SIE and EPL: a jacfwd inside), with respect to the
profile's parameters, the image-plane coordinates and both, at generic points and at
zero ellipticity / zero shear / zero multipole amplitude with the lens centre on a
coordinate; several profiles at once (the loop and the ``lax.scan`` path); the light
profiles (Sersic, core-Sersic, Gaussian, elliptical Gaussian, multipole, uniform) likewise,
at their centre too, and pixelated light with bilinear and bicubic interpolation (query
points on pixel centres and outside the grid); the ellipticity and shear conversions of
``param_util`` at zero; full ``LensImage`` simulations (lens mass, lensed source, lens
light, Gaussian or pixel PSF convolution, supersampling, a pixelated source) in a
chi-square likelihood with herculens' noise model, and its ``Loss`` wrapper (nan_to_num,
a cap through clip), with respect to the lens, source and lens-light parameters alone and
all together, at generic points and at zero ellipticity and shear.

herculens 0.3.0 still calls ``jnp.clip(x, a_min=..., a_max=...)``, which jax 0.10 no
longer accepts; the driver restores those keywords (as the signax driver restores
``jax.tree_map``). Left out: ``SHAPELETS`` light (needs gigalens), ``fast_bilinear``
interpolation (needs jaxinterp2d), ``normalized_residuals``/``reduced_chi2`` and the
potential of ``SHEAR_GAMMA_PSI`` (numpy inside)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

jax.config.update("jax_enable_x64", True)

_jnp_clip = jnp.clip


def _clip_compat(arr, lo=None, hi=None, *, a_min=None, a_max=None, **bounds):
    """jnp.clip taking herculens' ``a_min``/``a_max`` keywords, which jax 0.10 removed."""
    lo = bounds.pop("min", lo if a_min is None else a_min)
    hi = bounds.pop("max", hi if a_max is None else a_max)
    return _jnp_clip(arr, lo, hi, **bounds)


jnp.clip = _clip_compat

import herculens as hcl  # noqa: E402
from herculens.Util import param_util as prmu  # noqa: E402


def _grads(loss, args, jit):
    n = len(args)
    argnums_list = [(i,) for i in range(n)] + ([tuple(range(n))] if n > 1 else [])

    def all_grads(*args):
        return [jax.grad(loss, a)(*args) for a in argnums_list]

    (jax.jit(all_grads) if jit else all_grads)(*args)


def _arr(d):
    return {k: jnp.asarray(v, dtype=jnp.float64) for k, v in d.items()}


# image-plane coordinates: generic ones, and for the edge points the profile's centre
XY_GENERIC = (jnp.array([0.7, -0.4, 1.3, 0.25]), jnp.array([0.3, 0.9, -0.6, -1.1]))
XY_EDGE = (jnp.array([0.0, 0.6, -0.9, 0.0]), jnp.array([0.0, 0.0, 0.4, 1.2]))

# name: (generic parameters, edge parameters, static (non-differentiated) parameters)
MASS = {
    "SIE": (
        {"theta_E": 1.1, "e1": 0.1, "e2": -0.05, "center_x": 0.02, "center_y": -0.01},
        {"theta_E": 1.1, "e1": 0.0, "e2": 0.0, "center_x": 0.0, "center_y": 0.0},
        {},
    ),
    "SIS": (
        {"theta_E": 1.1, "center_x": 0.02, "center_y": -0.01},
        {"theta_E": 1.1, "center_x": 0.0, "center_y": 0.0},
        {},
    ),
    "NIE": (
        {"theta_E": 1.1, "e1": 0.1, "e2": -0.05, "r_core": 0.1, "center_x": 0.02, "center_y": -0.01},
        {"theta_E": 1.1, "e1": 0.0, "e2": 0.0, "r_core": 0.1, "center_x": 0.0, "center_y": 0.0},
        {},
    ),
    "EPL": (
        {"theta_E": 1.1, "gamma": 2.1, "e1": 0.1, "e2": -0.05, "center_x": 0.02, "center_y": -0.01},
        {"theta_E": 1.1, "gamma": 2.0, "e1": 0.0, "e2": 0.0, "center_x": 0.0, "center_y": 0.0},
        {},
    ),
    "SHEAR": (
        {"gamma1": 0.03, "gamma2": -0.02, "ra_0": 0.1, "dec_0": -0.1},
        {"gamma1": 0.0, "gamma2": 0.0, "ra_0": 0.0, "dec_0": 0.0},
        {},
    ),
    "SHEAR_GAMMA_PSI": (
        {"gamma_ext": 0.04, "psi_ext": 0.3, "ra_0": 0.1, "dec_0": -0.1},
        {"gamma_ext": 0.0, "psi_ext": 0.0, "ra_0": 0.0, "dec_0": 0.0},
        {},
    ),
    "POINT_MASS": (
        {"theta_E": 0.8, "center_x": 0.02, "center_y": -0.01},
        {"theta_E": 0.8, "center_x": 0.0, "center_y": 0.0},
        {},
    ),
    "GAUSSIAN": (
        {"amp": 1.2, "sigma_x": 0.7, "sigma_y": 0.5, "center_x": 0.02, "center_y": -0.01},
        {"amp": 1.2, "sigma_x": 0.6, "sigma_y": 0.6, "center_x": 0.0, "center_y": 0.0},
        {},
    ),
    "MULTIPOLE": (
        {"a_m": 0.05, "phi_m": 0.4, "center_x": 0.02, "center_y": -0.01},
        {"a_m": 0.0, "phi_m": 0.0, "center_x": 0.0, "center_y": 0.0},
        {"m": 4},
    ),
    "PIEMD": (
        {"theta_E": 1.1, "r_core": 0.1, "q": 0.8, "phi": 0.3, "center_x": 0.02, "center_y": -0.01},
        {"theta_E": 1.1, "r_core": 0.1, "q": 1.0, "phi": 0.0, "center_x": 0.0, "center_y": 0.0},
        {},
    ),
    "DPIE": (
        {"theta_E": 1.1, "r_core": 0.1, "r_trunc": 3.0, "q": 0.8, "phi": 0.3, "center_x": 0.02, "center_y": -0.01},
        {"theta_E": 1.1, "r_core": 0.1, "r_trunc": 3.0, "q": 1.0, "phi": 0.0, "center_x": 0.0, "center_y": 0.0},
        {},
    ),
}


DERIVED = ("SIE", "EPL")
# EPL's deflection and PIEMD's hessian are nan at the lens centre itself (values, not
# gradients): their edge point keeps zero ellipticity but leaves the centre out
NAN_AT_CENTRE = ("EPL", "PIEMD")


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", ["generic", "edge"])
@pytest.mark.parametrize("profile", list(MASS))
def test_mass_profile(profile, point, jit):
    generic, edge, static = MASS[profile]
    params = _arr(generic if point == "generic" else edge)
    x, y = XY_GENERIC if point == "generic" or profile in NAN_AT_CENTRE else XY_EDGE
    model = hcl.MassModel([profile])

    def loss(params, xy):
        kw = [{**params, **static}]
        bx, by = model.ray_shooting(xy[0], xy[1], kw)
        out = jnp.sum(bx**2 + 0.5 * by)
        if profile not in ("SHEAR_GAMMA_PSI", "POINT_MASS"):  # their potentials go through numpy
            out = out + jnp.sum(model.fermat_potential(xy[0], xy[1], kw))
        if profile in DERIVED:  # the hessian-based quantities (a jacfwd inside), for a few
            fxx, fxy, fyx, fyy = model.hessian(xy[0], xy[1], kw)
            g1, g2 = model.gamma(xy[0], xy[1], kw)
            out = out + jnp.sum(fxx - 0.3 * fxy + 0.2 * fyx + 0.7 * fyy + g1 * 0.4 + g2 * 0.6)
            out = out + jnp.sum(model.kappa(xy[0], xy[1], kw) + jnp.tanh(model.magnification(xy[0], xy[1], kw)))
        return out

    _grads(loss, (params, jnp.stack([x, y])), jit)


# a lens made of several profiles at once (the MassModel loop and its lax.scan)
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("use_jax_scan", [False, True])
def test_mass_model_combined(use_jax_scan, jit):
    names = ["SIE", "SHEAR", "NIE"]
    model = hcl.MassModel(names, use_jax_scan=use_jax_scan)
    params = [_arr(MASS[n][0]) for n in names]

    def loss(params, xy):
        bx, by = model.ray_shooting(xy[0], xy[1], params)
        return jnp.sum(bx * by + bx**2) + jnp.sum(model.fermat_potential(xy[0], xy[1], params))

    _grads(loss, (params, jnp.stack(XY_GENERIC)), jit)


LIGHT = {
    "SERSIC_ELLIPSE": (
        {"amp": 5.0, "R_sersic": 0.3, "n_sersic": 1.5, "e1": 0.05, "e2": 0.02, "center_x": 0.05, "center_y": 0.1},
        {"amp": 5.0, "R_sersic": 0.3, "n_sersic": 1.0, "e1": 0.0, "e2": 0.0, "center_x": 0.0, "center_y": 0.0},
        {},
    ),
    "CORE_SERSIC": (
        {
            "amp": 5.0,
            "R_sersic": 0.5,
            "R_break": 0.1,
            "n_sersic": 2.5,
            "gamma_in": 0.3,
            "alpha": 3.0,
            "e1": 0.05,
            "e2": -0.02,
            "center_x": 0.05,
            "center_y": 0.1,
        },
        {
            "amp": 5.0,
            "R_sersic": 0.5,
            "R_break": 0.1,
            "n_sersic": 2.5,
            "gamma_in": 0.0,
            "alpha": 3.0,
            "e1": 0.0,
            "e2": 0.0,
            "center_x": 0.0,
            "center_y": 0.0,
        },
        {},
    ),
    "GAUSSIAN": (
        {"amp": 2.0, "sigma": 0.4, "center_x": 0.05, "center_y": 0.1},
        {"amp": 2.0, "sigma": 0.4, "center_x": 0.0, "center_y": 0.0},
        {},
    ),
    "GAUSSIAN_ELLIPSE": (
        {"amp": 2.0, "sigma": 0.4, "e1": 0.1, "e2": -0.1, "center_x": 0.05, "center_y": 0.1},
        {"amp": 2.0, "sigma": 0.4, "e1": 0.0, "e2": 0.0, "center_x": 0.0, "center_y": 0.0},
        {},
    ),
    "MULTIPOLE": (
        {"amp_m": 0.3, "phi_m": 0.4, "center_x": 0.05, "center_y": 0.1},
        {"amp_m": 0.0, "phi_m": 0.0, "center_x": 0.0, "center_y": 0.0},
        {"m": 3},
    ),
    "UNIFORM": ({"amp": 0.7}, {"amp": 0.0}, {}),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", ["generic", "edge"])
@pytest.mark.parametrize("profile", list(LIGHT))
def test_light_profile(profile, point, jit):
    generic, edge, static = LIGHT[profile]
    params = _arr(generic if point == "generic" else edge)
    x, y = XY_GENERIC if point == "generic" else XY_EDGE
    model = hcl.LightModel([profile])

    def loss(params, xy):
        sb = model.surface_brightness(xy[0], xy[1], [{**params, **static}])
        return jnp.sum(sb * jnp.array([1.0, -0.5, 0.3, 2.0]))

    _grads(loss, (params, jnp.stack([x, y])), jit)


def _pixel_grid(npix, pix):
    half = npix * pix / 2
    return hcl.PixelGrid(
        nx=npix, ny=npix, transform_pix2angle=pix * np.eye(2), ra_at_xy_0=-half + pix / 2, dec_at_xy_0=-half + pix / 2
    )


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])  # fast_bilinear needs jaxinterp2d
def test_pixelated_light(interpolation, jit):
    model = hcl.LightModel([hcl.PixelatedLight(interpolation_type=interpolation)])
    grid = _pixel_grid(6, 0.3)
    model.set_pixel_grid(grid.create_model_grid(pixel_scale_factor=1.0), grid.pixel_area)
    pixels = jnp.asarray(np.random.default_rng(0).uniform(0.5, 1.5, (6, 6)))
    # query points between pixels, on pixel centres (the interpolation's kinks) and outside
    x = jnp.array([0.13, -0.15, 0.45, 1.4, -0.61])
    y = jnp.array([-0.22, 0.15, 0.45, 0.1, -0.2])

    def loss(pixels, xy):
        return jnp.sum(model.surface_brightness(xy[0], xy[1], [{"pixels": pixels}]) * jnp.arange(1.0, 6.0))

    _grads(loss, (pixels, jnp.stack([x, y])), jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", ["generic", "zero"])
def test_param_util(point, jit):
    e = jnp.array([0.1, -0.07]) if point == "generic" else jnp.zeros(2)
    shear = jnp.array([0.03, 0.02]) if point == "generic" else jnp.zeros(2)
    phi_q = jnp.array([0.3, 0.8]) if point == "generic" else jnp.array([0.0, 1.0])

    def loss(e, shear, phi_q):
        phi, q = prmu.ellipticity2phi_q(e[0], e[1])
        e1, e2 = prmu.phi_q2_ellipticity(phi_q[0], phi_q[1])
        psi, g = prmu.shear_cartesian2polar(shear[0], shear[1])
        g1, g2 = prmu.shear_polar2cartesian(phi_q[0], shear[0])
        r, th = prmu.cart2polar(e[0], e[1], center_x=shear[0], center_y=shear[1])
        return jnp.cos(phi) + q + e1 - e2 + jnp.sin(psi) + g + g1 * g2 + r + jnp.cos(th)

    _grads(loss, (e, shear, phi_q), jit)


# ---------------------------------------------------------------------------
# full lens image simulations
# ---------------------------------------------------------------------------
NPIX, PIX = 10, 0.24


def _lens_image(setup):
    grid = _pixel_grid(NPIX, PIX)
    noise = hcl.Noise(NPIX, NPIX, background_rms=0.01, exposure_time=1000.0, verbose=False)
    if setup == "sie_sersic_gaussian_psf":
        psf = hcl.PSF(psf_type="GAUSSIAN", fwhm=0.3, pixel_size=PIX)
        mass = hcl.MassModel(["SIE", "SHEAR"])
        src = hcl.LightModel(["SERSIC_ELLIPSE"])
        numerics = {"supersampling_factor": 1}
    else:  # "epl_pixelated_pixel_psf"
        kernel = np.outer([0.2, 0.6, 0.2], [0.25, 0.5, 0.25])
        psf = hcl.PSF(psf_type="PIXEL", kernel_point_source=kernel / kernel.sum())
        mass = hcl.MassModel(["EPL", "SHEAR_GAMMA_PSI"])
        src = hcl.LightModel([hcl.PixelatedLight(interpolation_type="bicubic")], kwargs_pixelated={"num_pixels": 8})
        numerics = {"supersampling_factor": 2}
    ll = hcl.LightModel(["SERSIC_ELLIPSE"])
    return hcl.LensImage(
        grid,
        psf,
        noise_class=noise,
        lens_mass_model_class=mass,
        source_model_class=src,
        lens_light_model_class=ll,
        kwargs_numerics=numerics,
    )


def _image_params(setup, point):
    zero = point == "zero"
    e = (0.0, 0.0) if zero else (0.1, -0.05)
    lens_light = _arr(
        {
            "amp": 8.0,
            "R_sersic": 0.8,
            "n_sersic": 3.0,
            "e1": 0.0 if zero else 0.05,
            "e2": 0.0 if zero else -0.03,
            "center_x": 0.0,
            "center_y": 0.0,
        }
    )
    if setup == "sie_sersic_gaussian_psf":
        lens = [
            _arr(
                {
                    "theta_E": 1.1,
                    "e1": e[0],
                    "e2": e[1],
                    "center_x": 0.0 if zero else 0.02,
                    "center_y": 0.0 if zero else -0.01,
                }
            ),
            _arr({"gamma1": 0.0 if zero else 0.03, "gamma2": 0.0 if zero else -0.02, "ra_0": 0.0, "dec_0": 0.0}),
        ]
        source = [
            _arr(
                {
                    "amp": 5.0,
                    "R_sersic": 0.3,
                    "n_sersic": 1.5,
                    "e1": 0.05,
                    "e2": 0.02,
                    "center_x": 0.05,
                    "center_y": 0.1,
                }
            )
        ]
    else:
        lens = [
            _arr(
                {
                    "theta_E": 1.1,
                    "gamma": 2.0 if zero else 2.1,
                    "e1": e[0],
                    "e2": e[1],
                    "center_x": 0.0 if zero else 0.02,
                    "center_y": 0.0 if zero else -0.01,
                }
            ),
            _arr({"gamma_ext": 0.0 if zero else 0.04, "psi_ext": 0.3, "ra_0": 0.0, "dec_0": 0.0}),
        ]
        xs, ys = np.meshgrid(np.linspace(-1, 1, 8), np.linspace(-1, 1, 8))
        source = [{"pixels": jnp.asarray(3.0 * np.exp(-((xs - 0.1) ** 2 + (ys + 0.2) ** 2) / 0.3))}]
    return lens, source, [lens_light]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    "setup,point",
    [
        ("sie_sersic_gaussian_psf", "generic"),
        ("sie_sersic_gaussian_psf", "zero"),
        ("epl_pixelated_pixel_psf", "generic"),
    ],
)
def test_lens_image(setup, point, jit):
    li = _lens_image(setup)
    lens, source, lens_light = _image_params(setup, "generic")
    data = li.model(kwargs_lens=lens, kwargs_source=source, kwargs_lens_light=lens_light) + 0.02
    lens, source, lens_light = _image_params(setup, point)

    def loss(lens, source, lens_light):
        model = li.model(kwargs_lens=lens, kwargs_source=source, kwargs_lens_light=lens_light)
        # (normalized_residuals and reduced_chi2 go through numpy)
        return jnp.sum((data - model) ** 2 / li.C_D_model(model)) + 0.1 * jnp.sum(model**2)

    _grads(loss, (lens, source, lens_light), jit)


# herculens' Loss wrapper (nan_to_num and a cap through clip) around a log-likelihood
# (jit only: the same model is differentiated eagerly in test_lens_image)
@pytest.mark.parametrize("cap", [None, 1e3])
def test_loss_wrapper(cap):
    jit = True
    setup = "sie_sersic_gaussian_psf"
    li = _lens_image(setup)
    lens, source, lens_light = _image_params(setup, "generic")
    data = li.model(kwargs_lens=lens, kwargs_source=source, kwargs_lens_light=lens_light) * 1.05

    def log_prob(args):
        model = li.model(kwargs_lens=args[0], kwargs_source=args[1], kwargs_lens_light=args[2], unconvolved=False)
        return -0.5 * jnp.sum((data - model) ** 2 / li.Noise.C_D_model(model))

    hloss = hcl.Loss(log_prob, cap_value=cap)

    def loss(lens, source, lens_light):
        return hloss._func([lens, source, lens_light])

    _grads(loss, (lens, source, lens_light), jit)
