"""jax-galsim: jax.grad of scalar losses (weighted pixel sums and chi-squares, no noise)
of drawn images: the Gaussian (sigma, half-light radius, FWHM), Exponential (both
radii), Moffat (half-light radius, FWHM), Spergel (positive and negative nu), Box and
Pixel profiles and DeltaFunctions, drawn with the fft, no_pixel and sb methods and with offsets, centres and WCSs (pixel scale, Jacobian, offset
shear); sheared (g1/g2 and e1/e2, eta, magnitude-angle), shifted, dilated,
expanded, magnified, lensed, rotated and generally transformed; convolved, deconvolved, summed; interpolated images in five interpolants; xValue and
kValue at the centre, on box edges and off-centre; drawKImage; the Bessel functions and
`si`. (jax-galsim has no Sersic profile, rejects truncated Moffats and raises
NotImplementedError for real-space convolution, so those are left out.) Differentiated with respect to flux, size, shear, shift (each alone and all),
eagerly and under jit, at generic points, at zero shear and zero shift, with shifts of
whole and half pixels (the interpolants' and boxes' kinks), with tied g1 = g2."""

import jax
import jax.numpy as jnp
import jax_galsim as galsim
import numpy as onp
import pytest

jax.config.update("jax_enable_x64", True)

JIT = [False, True]
# fixed FFT sizes keep drawing static under jit
GSP = galsim.GSParams(minimum_fft_size=64, maximum_fft_size=64)
N = 12  # image side
SCALE = 0.25


def run(loss, args, jit, argsets=None):
    """jax.grad of loss wrt each argument alone and all together."""
    n = len(args)
    if argsets is None:
        argsets = [(i,) for i in range(n)] + ([tuple(range(n))] if n > 1 else [])
    for argnums in argsets:
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*args)


def weights(shape, seed=0):
    return jnp.asarray(onp.random.default_rng(seed).uniform(0.5, 1.5, shape))


def img_loss(img, seed=0):
    arr = img.array
    data = weights(arr.shape, seed + 10) * 0.01
    return jnp.sum(arr * weights(arr.shape, seed)) + 100.0 * jnp.sum((arr - data) ** 2)


PROFILES = {
    "gaussian_hlr": lambda f, s: galsim.Gaussian(half_light_radius=s, flux=f, gsparams=GSP),
    "gaussian_sigma": lambda f, s: galsim.Gaussian(sigma=s, flux=f, gsparams=GSP),
    "gaussian_fwhm": lambda f, s: galsim.Gaussian(fwhm=2 * s, flux=f, gsparams=GSP),
    "exponential_hlr": lambda f, s: galsim.Exponential(half_light_radius=s, flux=f, gsparams=GSP),
    "exponential_scale": lambda f, s: galsim.Exponential(scale_radius=s / 2, flux=f, gsparams=GSP),
    "moffat": lambda f, s: galsim.Moffat(beta=3.0, half_light_radius=s, flux=f, gsparams=GSP),
    "moffat_fwhm": lambda f, s: galsim.Moffat(beta=2.5, fwhm=s, flux=f, gsparams=GSP),
    "spergel": lambda f, s: galsim.Spergel(nu=0.5, half_light_radius=s, flux=f, gsparams=GSP),
    "spergel_neg": lambda f, s: galsim.Spergel(nu=-0.3, scale_radius=s / 2, flux=f, gsparams=GSP),
    "box": lambda f, s: galsim.Box(2 * s, 3 * s, flux=f, gsparams=GSP),
    "pixel": lambda f, s: galsim.Pixel(2 * s, flux=f, gsparams=GSP),
}
# flux, size, shear (g1, g2), shift (dx, dy)
POINTS = {
    "generic": (1.3, 0.6, jnp.array([0.13, -0.07]), jnp.array([0.11, -0.06])),
    "zero": (1.0, 0.5, jnp.zeros(2), jnp.zeros(2)),
    # g1 = g2; shift by a whole pixel in x and half a pixel in y
    "grid": (1.0, 0.625, jnp.array([0.1, 0.1]), jnp.array([SCALE, SCALE / 2])),
}


def _sheared_shifted(obj, g, d):
    return obj.shear(g1=g[0], g2=g[1]).shift(d[0], d[1])


# method="real_space" is left out: jax-galsim raises NotImplementedError for it here
DRAWS = [(p, m, pt, j) for p in PROFILES for (m, pt, j) in [("fft", "generic", False), ("no_pixel", "zero", True)]]
DRAWS += [(p, "sb", "grid", False) for p in ("gaussian_hlr", "exponential_hlr", "spergel", "box")]


@pytest.mark.parametrize("profile, method, point, jit", DRAWS)
def test_profile_draw(profile, method, point, jit):

    def loss(flux, size, g, d):
        obj = _sheared_shifted(PROFILES[profile](flux, size), g, d)
        return img_loss(obj.drawImage(nx=N, ny=N, scale=SCALE, method=method))

    run(loss, POINTS[point], jit)


SHEARS = ["g", "e", "eta", "magnitude_beta", "shear_object", "lens", "jacobian"]


@pytest.mark.parametrize(
    "kind, point, jit", [(k, "zero", False) for k in SHEARS] + [("g", "generic", True), ("eta", "generic", True)]
)
def test_shear_forms(kind, point, jit):
    flux, size, g, d = POINTS[point]

    def loss(size, g):
        obj = galsim.Exponential(half_light_radius=size, gsparams=GSP)
        if kind == "g":
            obj = obj.shear(g1=g[0], g2=g[1])
        elif kind == "e":
            obj = obj.shear(e1=g[0], e2=g[1])
        elif kind == "eta":
            obj = obj.shear(eta1=g[0], eta2=g[1])
        elif kind == "magnitude_beta":
            obj = obj.shear(g=g[0], beta=g[1] * galsim.radians)
        elif kind == "shear_object":
            s = galsim.Shear(g1=g[0], g2=g[1]) + galsim.Shear(g1=0.05, g2=g[0])
            obj = obj.shear(s)
            size = size + s.g + s.e1 + s.eta2 + s.beta.rad * 0.01
        elif kind == "lens":
            obj = obj.lens(g[0], g[1], 1.0 + g[0])
        elif kind == "jacobian":
            obj = obj.transform(1.0 + g[0], g[1], -g[1], 1.0 - g[0])
        img = obj.drawImage(nx=N, ny=N, scale=SCALE, method="no_pixel")
        return img_loss(img) + size

    run(loss, (size, g), jit)


TRANSFORMS = ["dilate", "expand", "magnify", "rotate", "with_flux", "scaled_flux", "transformation", "offset_center"]


@pytest.mark.parametrize(
    "kind, point, jit", [(k, "generic", False) for k in TRANSFORMS] + [(k, "zero", True) for k in TRANSFORMS[::4]]
)
def test_transforms(kind, point, jit):
    flux, size, g, d = POINTS[point]

    def loss(flux, size, g, d):
        obj = galsim.Gaussian(sigma=0.5, gsparams=GSP).shear(g1=g[0] + 0.1, g2=g[1])
        offset = None
        if kind == "dilate":
            obj = obj.dilate(size)
        elif kind == "expand":
            obj = obj.expand(size)
        elif kind == "magnify":
            obj = obj.magnify(size + 0.5)
        elif kind == "rotate":
            obj = obj.rotate((size - 0.5 + g[0]) * galsim.radians)
        elif kind == "with_flux":
            obj = obj.withFlux(flux * size)
        elif kind == "scaled_flux":
            obj = obj.withScaledFlux(flux) * size
        elif kind == "transformation":
            obj = galsim.Transformation(
                obj, jac=(size, g[0], g[1], size), offset=galsim.PositionD(d[0], d[1]), flux_ratio=flux
            )
        elif kind == "offset_center":
            offset = galsim.PositionD(d[0] / SCALE, d[1] / SCALE)
            obj = obj.withFlux(flux).dilate(size)
        obj = obj.shift(d[0], d[1])
        img = obj.drawImage(nx=N, ny=N, scale=SCALE, offset=offset)
        return img_loss(img)

    run(loss, (flux, size, g, d), jit)


COMPOSITES = ["convolve_fft", "convolve_delta", "deconvolve", "sum", "add_sub"]


@pytest.mark.parametrize(
    "kind, point, jit",
    [(k, "grid", True) for k in COMPOSITES] + [("convolve_fft", "zero", False), ("sum", "generic", False)],
)
def test_composites(kind, point, jit):
    def loss(flux, size, g, d):
        gal = _sheared_shifted(galsim.Exponential(half_light_radius=size, flux=flux, gsparams=GSP), g, d)
        psf = galsim.Moffat(beta=3.0, fwhm=0.7, gsparams=GSP).shear(g1=0.02, g2=g[1])
        method = "auto"
        if kind == "convolve_fft":
            obj = galsim.Convolve(gal, psf, galsim.Pixel(SCALE, gsparams=GSP))
            method = "no_pixel"
        elif kind == "convolve_delta":
            obj = galsim.Convolve(galsim.DeltaFunction(flux=flux, gsparams=GSP).shift(d[0], d[1]), psf.dilate(size))
        elif kind == "deconvolve":
            wide = galsim.Gaussian(sigma=size + 0.3, flux=flux, gsparams=GSP).shear(g1=g[0], g2=g[1])
            obj = galsim.Convolve(wide, galsim.Deconvolve(galsim.Gaussian(sigma=0.3, gsparams=GSP)))
        elif kind == "sum":
            obj = galsim.Sum([gal, psf.withFlux(0.3 * flux)])
        elif kind == "add_sub":
            obj = galsim.Add(gal, psf * 0.5) + gal.dilate(1.5) * 0.2
        img = obj.drawImage(nx=N, ny=N, scale=SCALE, method=method)
        return img_loss(img)

    run(loss, POINTS[point], jit)


INTERPOLANTS = {
    "quintic": lambda: galsim.Quintic(),
    "lanczos3": lambda: galsim.Lanczos(3),
    "linear": lambda: galsim.Linear(),
    "cubic": lambda: galsim.Cubic(),
    "nearest": lambda: galsim.Nearest(),
}


@pytest.mark.parametrize(
    "interp, point, jit",
    [(k, "grid", False) for k in INTERPOLANTS] + [("quintic", "generic", True), ("linear", "zero", True)],
)
def test_interpolated_image(interp, point, jit):
    _, _, g, d = POINTS[point]
    pix = weights((8, 8), 3) * jnp.outer(jnp.hanning(8), jnp.hanning(8)) + 0.01

    def loss(pix, g, d):
        im = galsim.ImageD(pix, scale=SCALE)
        obj = galsim.InterpolatedImage(
            im, x_interpolant=INTERPOLANTS[interp](), gsparams=GSP, calculate_stepk=False, calculate_maxk=False
        )
        obj = _sheared_shifted(obj, g, d)
        return img_loss(obj.drawImage(nx=N, ny=N, scale=SCALE, method="no_pixel"))

    run(loss, (pix, g, d), jit)


VALUE_POINTS = {
    "centre": jnp.zeros(2),
    "off": jnp.array([0.3, -0.17]),
    "box_edge": jnp.array([0.6, 0.2]),  # the box's edge at width 2 * 0.6 / 2
}


@pytest.mark.parametrize(
    "profile, where, jit",
    [(p, "centre", False) for p in PROFILES][::2]
    + [(p, "off", True) for p in PROFILES][1::3]
    + [("box", "box_edge", False), ("pixel", "box_edge", True)],
)
def test_values(profile, where, jit):
    def loss(flux, size, pos):
        obj = PROFILES[profile](flux, size)
        x = obj.xValue(galsim.PositionD(pos[0], pos[1]))
        k = obj.kValue(galsim.PositionD(3 * pos[0], 3 * pos[1] + 0.1))
        return x + jnp.real(k) + jnp.imag(k) + obj.max_sb * 0.1

    run(loss, (1.2, 0.6, VALUE_POINTS[where]), jit)


@pytest.mark.parametrize(
    "profile, jit",
    [("exponential_hlr", True), ("spergel", False), ("box", False)],
)
def test_kimage(profile, jit):
    def loss(flux, size, g):
        obj = PROFILES[profile](flux, size).shear(g1=g[0], g2=g[1])
        kim = obj.drawKImage(nx=8, ny=8, scale=0.5)
        return jnp.sum(jnp.abs(kim.array) ** 2 * weights(kim.array.shape)) + jnp.sum(jnp.real(kim.array))

    run(loss, (1.1, 0.6, jnp.array([0.1, -0.2])), jit)


WCS = ["pixel_scale", "jacobian", "offset_shear", "center"]


@pytest.mark.parametrize("kind, jit", [("pixel_scale", False), ("offset_shear", False), ("jacobian", True)])
def test_wcs(kind, jit):
    def loss(size, jac, d):
        obj = galsim.Gaussian(sigma=size, gsparams=GSP).shift(d[0], d[1])
        if kind == "pixel_scale":
            wcs = galsim.PixelScale(jac[0])
            img = obj.drawImage(nx=N, ny=N, wcs=wcs)
        elif kind == "jacobian":
            wcs = galsim.JacobianWCS(jac[0], jac[1], jac[2], jac[3])
            img = obj.drawImage(nx=N, ny=N, wcs=wcs)
        elif kind == "offset_shear":
            wcs = galsim.OffsetShearWCS(jac[0], galsim.Shear(g1=jac[1], g2=jac[2]), galsim.PositionD(d[1], d[0]))
            img = obj.drawImage(nx=N, ny=N, wcs=wcs)
        elif kind == "center":
            img = obj.drawImage(nx=N, ny=N, scale=jac[0], center=galsim.PositionD(6.5, 6.0), use_true_center=False)
        return img_loss(img)

    run(loss, (0.5, jnp.array([SCALE, 0.02, -0.01, SCALE * 1.1]), jnp.array([0.05, 0.1])), jit)


@pytest.mark.parametrize("where, jit", [("zero", False), ("branches", True)])
def test_bessel(where, jit):
    x = {
        "generic": jnp.array([0.3, 1.7, 5.2, 9.5]),
        "zero": jnp.array([1e-3, 1e-8, 2.0, 4.0]),
        # j0's rational-approximation branches meet at 4 and 8
        "branches": jnp.array([4.0, 8.0, 0.5, 12.0]),
    }[where]

    def loss(x, nu):
        return (
            jnp.sum(galsim.bessel.j0(x) * weights(x.shape))
            + jnp.sum(galsim.bessel.kv(nu, x))
            + jnp.sum(galsim.bessel.si(x) ** 2)
        )

    run(loss, (x, 0.7), jit)
