"""dLux (differentiable optics on equinox/zodiax): jax.grad of scalar losses built from
its wavefronts (OPD and phase, tilts, power and peak normalisation, flips, complex and
polar interpolated scaling and rotation, resizing, MFT propagation angular and to a focal
length, FFT propagation with padding and centring), its soft-edged dynamic apertures
(circle, square, rectangle, regular polygon, spiders; transmissive and occulting; every
coordinate transform: translation, rotation, compression, shear; distorted coordinates;
aberrated apertures with Zernike and polike bases; compound and multi apertures), optical
layers (Optic, BasisOptic, FourierBasis, Tilt, Rotate, Flip, Resize, Normalise, MFT/FFT
layers, the ABCD MFT/FFT/ASM propagators), optical systems (angular, Cartesian, layered,
oversampled, polychromatic with weights and offsets), sources (point, point sources,
binary, resolved, point-resolved, scenes, spectra and polynomial spectra), detectors
(pixel response, jitter, saturation, constants, downsampling), telescopes and dithers,
and the utilities (MFT/FFT, Zernike bases, norms, interpolation, soft binarisation).
The losses are weighted pixel sums, Poisson log-likelihoods and chi-squares of the PSFs.
Each differentiable argument alone and all together, float64, eagerly and under jit;
the edge points are zero aberrations, zero offsets and rotations, aperture edges on the
pixel grid (the soft edges' clip), saturation thresholds met by pixels, and full
occultation (the soft edge's constant branch)."""

import dLux as dl
import dLux.utils as dlu
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.stats as jss
import numpy as onp
import pytest

jax.config.update("jax_enable_x64", True)

JIT = [False, True]
WL = 1e-6
NPIX = 16  # wavefront pixels
PSF_NPIX = 8


def run(loss, args, jit, argsets=None):
    """Take jax.grad of loss wrt each argument alone and all together."""
    n = len(args)
    if argsets is None:
        argsets = [(i,) for i in range(n)] + ([tuple(range(n))] if n > 1 else [])
    for argnums in argsets:
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*args)


def weights(shape, seed=0):
    return jnp.asarray(onp.random.default_rng(seed).uniform(0.5, 1.5, shape))


def poisson_loss(psf, seed=1):
    data = jnp.asarray(onp.random.default_rng(seed).poisson(50.0, psf.shape), float)
    return -jss.poisson.logpmf(data, 1e3 * psf + 1e-3).sum()


# --------------------------------------------------------------------------- wavefronts


WF_OPS = [
    "opd_mft",
    "phase_mft_focal",
    "peak_normalise",
    "flip_resize",
    "scale_complex",
    "scale_polar",
    "rotate_complex",
    "rotate_polar",
    "fft",
    "inverse",
]
WF_POINTS = {
    "generic": (1.1e-6, 0.3, jnp.array([2e-7, -1e-7])),
    "zero": (1e-6, 0.0, jnp.zeros(2)),
}


def _wf_loss(op):
    basis = weights((NPIX, NPIX), 3) - 1.0

    def loss(wl, amp, tilt):
        wf = dl.Wavefront(wl, NPIX, diameter=1.0)
        wf = wf.multiply("phasor", dlu.soft_circle(wf.coordinates(), 0.45, 0.05))
        if op == "opd_mft":
            wf = wf.add_opd(amp * 1e-7 * basis).tilt(tilt)
            wf = wf.propagate(PSF_NPIX, 2 * wl / wf.diameter)
        elif op == "phase_mft_focal":
            wf = wf.add_phase(amp * basis).tilt(tilt * 1e6, unit="urad").normalise("power", 2.0)
            wf = wf.propagate(PSF_NPIX, 1e-6, focal_length=2.0)
        elif op == "peak_normalise":
            wf = wf.add_phase(amp * basis).tilt(tilt)
            wf = wf.propagate(PSF_NPIX, wl / wf.diameter).normalise("peak")
        elif op == "flip_resize":
            wf = wf.add_phase(amp * basis).flip(0).flip((0, 1)).resize(NPIX + 4)
            wf = wf.tilt(tilt).resize(NPIX - 2)
            wf2 = dl.Wavefront(wl, NPIX - 2, diameter=wf.diameter).add_phase(amp * basis[1:-1, 1:-1])
            wf = ((wf + wf2) * jnp.exp(1j * amp) - wf2 * 0.5) / (2.0 + 0.5j * amp)
            wf = wf.propagate(PSF_NPIX, wl / wf.diameter)
        elif op in ("scale_complex", "scale_polar"):
            wf = wf.add_phase(amp * basis).tilt(tilt)
            wf = wf.scale_to(NPIX - 4, wf.pixel_scale * (1.1 + amp), op == "scale_complex")
            wf = wf.propagate(PSF_NPIX, wl / wf.diameter)
        elif op in ("rotate_complex", "rotate_polar"):
            wf = wf.add_phase(amp * basis).tilt(tilt)
            wf = wf.rotate(amp + 0.2, complex=op == "rotate_complex")
            wf = wf.propagate(PSF_NPIX, wl / wf.diameter)
        elif op == "fft":
            wf = wf.add_phase(amp * basis).tilt(tilt)
            wf = dl.FFT(pad=2)(wf).multiply("phasor", 0.5) + dl.FFT(pad=2, crop=1, center=False)(wf)
        elif op == "inverse":
            wf = wf.add_opd(amp * 1e-7 * basis).tilt(tilt)
            wf = dl.FFT(focal_length=3.0, pad=2)(wf)
            wf = dl.FFT(focal_length=3.0, inverse=True)(wf)
            wf = dl.MFT(PSF_NPIX * 2, 2e-6, focal_length=2.0)(wf)
            wf = dl.MFT(NPIX, 1.0 / NPIX, focal_length=2.0, inverse=True)(wf)
        psf = wf.psf
        return jnp.sum(psf * weights(psf.shape)) + 0.1 * wf.power + jnp.sum(wf.real * wf.imaginary)

    return loss


# the generic point eagerly, the zero point (no aberration, no tilt) under jit
@pytest.mark.parametrize("point, jit", [("generic", False), ("zero", True)])
@pytest.mark.parametrize("op", WF_OPS)
def test_wavefront(op, point, jit):
    run(_wf_loss(op), WF_POINTS[point], jit)


def test_wavefront_phase_amplitude():
    # amplitude/phase/polar of a field without zeros (angle is fine there)
    basis = weights((NPIX, NPIX), 4) - 1.0

    def loss(wl, amp):
        wf = dl.Wavefront(wl, NPIX, diameter=1.0).add_opd(amp * 1e-7 * basis)
        wf = wf.tilt(jnp.array([1e-7, 0.0]))
        return jnp.sum(wf.phase * wf.amplitude) + jnp.sum(wf.polar[1] ** 2) + wf.wavenumber * 1e-6

    for jit in JIT:
        run(loss, (1e-6, 0.4), jit)


# --------------------------------------------------------------------------- apertures
# dLux's layers check their arguments with Python comparisons when constructed, so the
# models are built with concrete values outside the losses and the losses put the
# differentiated values in with eqx.tree_at (as dLux's own fitting does with zodiax).


def _transform(kind):
    if kind == "none":
        return None
    if kind == "translate":
        return dl.CoordTransform(translation=jnp.zeros(2))
    if kind == "rotate":
        return dl.CoordTransform(rotation=0.0)
    return dl.CoordTransform(translation=jnp.zeros(2), rotation=0.0, compression=jnp.ones(2), shear=jnp.zeros(2))


def _set_transform(ap, kind, shift, rot):
    if kind in ("translate", "all"):
        ap = eqx.tree_at(lambda a: a.transformation.translation, ap, shift)
    if kind in ("rotate", "all"):
        ap = eqx.tree_at(lambda a: a.transformation.rotation, ap, rot)
    if kind == "all":
        ap = eqx.tree_at(
            lambda a: (a.transformation.compression, a.transformation.shear),
            ap,
            (1.0 + rot * jnp.array([0.5, -0.3]), 0.5 * shift[::-1]),
        )
    return ap


# constructor, sizes (attribute, value at size factor 1)
APERTURES = {
    "circle": (lambda t, occ, soft: dl.CircularAperture(0.35, t, occ, soft), {"radius": 0.35}),
    "square": (lambda t, occ, soft: dl.SquareAperture(0.625, t, occ, soft), {"width": 0.625}),
    "rectangle": (
        lambda t, occ, soft: dl.RectangularAperture(0.5, 0.75, t, occ, soft),
        {"height": 0.5, "width": 0.75},
    ),
    "hexagon": (lambda t, occ, soft: dl.RegPolyAperture(6, 0.4, t, occ, soft * 1.5), {"rmax": 0.4}),
    "triangle": (lambda t, occ, soft: dl.RegPolyAperture(3, 0.45, t, occ, soft), {"rmax": 0.45}),
    "spider": (
        lambda t, occ, soft: dl.Spider(0.0625, jnp.array([0.0, 90.0, 225.0]), t, not occ, soft),
        {"width": 0.0625},
    ),
}
# size factor, shift, rotation
AP_POINTS = {
    "generic": (1.03, jnp.array([0.013, -0.021]), 0.17),
    # zero shift and rotation; the square's and the spider's edges on pixel edges
    "zero": (1.0, jnp.zeros(2), 0.0),
    # shifted by one pixel; the circle's edge through pixel centres (15/32 = 0.46875)
    "on_grid": (15 / 32 / 0.35, jnp.array([1 / 16, 0.0]), 0.0),
}


@pytest.mark.parametrize(
    "point, occulting, jit",
    [("generic", False, False), ("generic", True, True), ("zero", False, True), ("on_grid", True, False)],
)
@pytest.mark.parametrize("aperture", list(APERTURES))
def test_aperture(aperture, occulting, point, jit):
    # translation, rotation, compression and shear (the identity at the zero point)
    transform = "all" if aperture != "circle" else "translate"
    argsets = [(0,), (1,), (2,), (0, 1, 2)] if transform == "all" else [(0,), (1,), (0, 1)]
    make, sizes = APERTURES[aperture]
    base = make(_transform(transform), occulting, 1.0)

    def loss(size, shift, rot):
        ap = base
        for attr, value in sizes.items():
            ap = eqx.tree_at(lambda a, attr=attr: getattr(a, attr), ap, value * size)
        ap = _set_transform(ap, transform, shift, rot)
        wf = dl.Wavefront(WL, NPIX, diameter=1.0)
        trans = ap.transmission(wf.coordinates(), wf.pixel_scale)
        wf = ap(wf).propagate(PSF_NPIX, WL)
        return jnp.sum(wf.psf * weights(wf.psf.shape)) * 1e3 + jnp.sum(trans * weights(trans.shape, 2))

    run(loss, AP_POINTS[point], jit, argsets)


@pytest.mark.parametrize(
    "softening, radius, jit", [(s, r, False) for s in (0.5, 1.0, 40.0) for r in (0.3, 2.0)] + [(40.0, 2.0, True)]
)
def test_aperture_softening(softening, radius, jit):
    # softening 40 pixels clips nothing on a 16-pixel grid, small softenings clip most
    # of it; radius 2 puts every pixel at the clip (the soft edge's constant branch)
    base = dl.CircularAperture(0.3, normalise=True)

    def loss(radius, softness):
        ap = eqx.tree_at(lambda a: (a.radius, a.softness), base, (radius, softness))
        wf = dl.Wavefront(WL, NPIX, diameter=1.0)
        return jnp.sum(ap(wf).psf * weights((NPIX, NPIX))) * 1e3

    run(loss, (radius, softening), jit)


ABERRATED = ["circle_zernike", "hexagon_polike", "circle_phase", "compound", "multi"]
JS = [2, 3, 4, 5, 6, 7, 8]


def _aberrated(kind):
    """The model and a function putting (coefficients, radius, shift) into it."""

    def t():
        return dl.CoordTransform(translation=jnp.zeros(2))

    if kind == "circle_zernike":
        m = dl.AberratedAperture(dl.CircularAperture(0.45, t()), JS, jnp.zeros(7))

        def get(m):
            return (m.coefficients, m.aperture.radius, m.aperture.transformation.translation)

        return m, lambda m, c, r, s: eqx.tree_at(get, m, (c * 1e-8, r, s))
    if kind == "hexagon_polike":
        m = dl.AberratedAperture(dl.RegPolyAperture(6, 0.45, t()), JS, jnp.zeros(7))

        def get(m):
            return (m.coefficients, m.aperture.rmax, m.aperture.transformation.translation)

        return m, lambda m, c, r, s: eqx.tree_at(get, m, (c * 1e-8, r, s))
    if kind == "circle_phase":
        m = dl.AberratedAperture(dl.CircularAperture(0.45, t()), JS, jnp.zeros(7), as_phase=True)

        def get(m):
            return (m.coefficients, m.aperture.radius, m.aperture.transformation.translation)

        return m, lambda m, c, r, s: eqx.tree_at(get, m, (c * 0.1, r, s))
    if kind == "compound":
        ab = dl.AberratedAperture(dl.CircularAperture(0.45), JS, jnp.zeros(7))
        obs = dl.CircularAperture(0.1, t(), occulting=True)
        spider = dl.Spider(0.04, jnp.array([45.0, 135.0]))
        m = dl.CompoundAperture([("ab", ab), ("obs", obs), ("spider", spider)], normalise=True)

        def get(m):
            return (
                m.apertures["ab"].coefficients,
                m.apertures["ab"].aperture.radius,
                m.apertures["obs"].transformation.translation,
            )

        return m, lambda m, c, r, s: eqx.tree_at(get, m, (c * 1e-8, r, s))
    if kind == "multi":
        a1 = dl.AberratedAperture(dl.CircularAperture(0.15, t()), JS[:3], jnp.zeros(3))
        a2 = dl.AberratedAperture(dl.CircularAperture(0.15, t()), JS[:3], jnp.zeros(3))
        m = dl.MultiAperture([("a1", a1), ("a2", a2)], normalise=True)

        def get(m):
            return (
                m.apertures["a1"].coefficients,
                m.apertures["a2"].coefficients,
                m.apertures["a1"].aperture.radius,
                m.apertures["a2"].aperture.radius,
                m.apertures["a1"].aperture.transformation.translation,
                m.apertures["a2"].aperture.transformation.translation,
            )

        return m, lambda m, c, r, s: eqx.tree_at(get, m, (c[:3] * 1e-8, c[3:6] * 1e-8, r / 3, r / 3, s + 0.2, -s - 0.2))


@pytest.mark.parametrize("zero, jit", [(False, False), (True, True)])
@pytest.mark.parametrize("kind", ABERRATED)
def test_aberrated_aperture(kind, zero, jit):
    coeffs = jnp.zeros(7) if zero else jnp.linspace(-1.0, 1.2, 7)
    shift = jnp.zeros(2) if zero else jnp.array([0.02, -0.01])
    base, put = _aberrated(kind)

    def loss(coeffs, radius, shift):
        ap = put(base, coeffs, radius, shift)
        wf = dl.Wavefront(WL, NPIX, diameter=1.0)
        wf = ap(wf).propagate(PSF_NPIX, WL)
        return poisson_loss(wf.psf)

    run(loss, (coeffs, 0.45, shift), jit)


# --------------------------------------------------------------------------- systems


LAYER_SETS = ["optic", "basis_optic", "fourier", "tilt_rotate_flip", "resize_normalise", "distorted"]
BASIS = jnp.stack([weights((NPIX, NPIX), k) - 1.0 for k in range(3)])


def _layers(kind):
    """Layers and a function putting three coefficients into them."""
    ap = ("ap", dl.CircularAperture(0.45))
    if kind == "optic":
        layers = [ap, ("o", dl.Optic(opd=BASIS[0], transmission=weights((NPIX, NPIX)) / 1.5, normalise=True))]
        return layers, lambda o, c: eqx.tree_at(lambda o: o.layers["o"].opd, o, c[0] * 1e-7 * BASIS[0])
    if kind == "basis_optic":
        layers = [ap, ("o", dl.BasisOptic(BASIS * 1e-7, coefficients=jnp.zeros(3), normalise=True))]
        return layers, lambda o, c: o.set("o.coefficients", c)
    if kind == "fourier":
        layers = [ap, ("o", dl.FourierBasis(NPIX, 3, coefficients=jnp.zeros((3, 3)))), dl.Normalise()]
        return layers, lambda o, c: o.set("o.coefficients", jnp.outer(c, c + 1.0) * 1e-8)
    if kind == "tilt_rotate_flip":
        layers = [
            ap,
            ("ab", dl.AberratedLayer(phase=BASIS[1])),
            ("tilt", dl.Tilt(jnp.zeros(2))),
            ("rot", dl.Rotate(0.0)),
            ("rotc", dl.Rotate(0.0, complex=True)),
            dl.Flip(1),
            dl.Normalise(),
        ]

        def put(o, c):
            def get(o):
                return (o.layers["ab"].phase, o.layers["tilt"].angles, o.layers["rot"].angle, o.layers["rotc"].angle)

            return eqx.tree_at(get, o, (c[1] * BASIS[1], c[:2] * 1e-7, c[2] * 0.3, 0.2 + c[2]))

        return layers, put
    if kind == "resize_normalise":
        layers = [ap, ("o", dl.Optic(phase=BASIS[0])), dl.Resize(NPIX + 4), dl.Normalise(), dl.Resize(NPIX)]
        return layers, lambda o, c: eqx.tree_at(lambda o: o.layers["o"].phase, o, c[0] * BASIS[0])
    if kind == "distorted":
        dist = dl.DistortedCoords(order=2, distortion=jnp.zeros((2, 5)))
        layers = [("ap", dl.CircularAperture(0.4, dist)), ("ab", dl.AberratedLayer(opd=BASIS[2])), dl.Normalise()]

        def put(o, c):
            def get(o):
                return (o.layers["ap"].transformation.distortion, o.layers["ab"].opd)

            return eqx.tree_at(get, o, (jnp.tile(c, 4)[:10].reshape(2, 5) * 0.01, c[2] * 1e-7 * BASIS[2]))

        return layers, put


SYS_POINTS = {"generic": jnp.array([0.4, -0.7, 0.25]), "zero": jnp.zeros(3)}


@pytest.mark.parametrize(
    "system, point, jit", [("angular", "generic", False), ("angular", "zero", True), ("cartesian", "generic", True)]
)
@pytest.mark.parametrize("layers", LAYER_SETS)
def test_optical_system(layers, system, point, jit):
    coeffs = SYS_POINTS[point]
    lays, put = _layers(layers)
    if system == "angular":
        base = dl.AngularOpticalSystem(NPIX, 1.0, lays, PSF_NPIX, 0.1, oversample=2)
    else:
        base = dl.CartesianOpticalSystem(NPIX, 1.0, lays, 5.0, PSF_NPIX, 2.0)

    def loss(coeffs, wavelengths, offset, pixel_scale):
        optics = put(base, coeffs).set("psf_pixel_scale", pixel_scale)
        psf = optics.propagate(wavelengths, offset, weights=jnp.array([0.3, 0.7]))
        return poisson_loss(psf)

    offset = jnp.zeros(2) if point == "zero" else jnp.array([1e-7, -2e-7])
    scale = 0.1 if system == "angular" else 2.0
    run(loss, (coeffs, jnp.array([0.9e-6, 1.1e-6]), offset, scale), jit)


@pytest.mark.parametrize("jit", JIT)
@pytest.mark.parametrize("prop", ["mft_layer", "fft_layer", "abcd_mft", "abcd_fft", "asm"])
def test_layered_system(prop, jit):
    basis = weights((NPIX, NPIX), 7) - 1.0
    layers = [dl.CircularAperture(0.45), ("ab", dl.AberratedLayer(opd=basis))]
    if prop == "mft_layer":
        layers.append(("p", dl.MFT(PSF_NPIX, 1e-6, focal_length=2.0)))

        def get(o):
            return o.layers["p"].focal_length
    elif prop == "fft_layer":
        layers.append(("p", dl.FFT(focal_length=2.0, pad=2, crop=2)))

        def get(o):
            return o.layers["p"].focal_length
    elif prop == "abcd_mft":
        spec = dl.CoordSpec(n=PSF_NPIX, d=2e-6, c=1e-6)
        layers.append(("p", dl.MFTPropagator([("cp", dl.ABCDConjugatePlane(2.0))], spec)))

        def get(o):
            return o.layers["p"].ABCDs["cp"].focal_length
    elif prop == "abcd_fft":
        elems = [("f1", dl.ABCDFreeSpace(2.0)), ("lens", dl.ABCDLens(2.0)), ("f2", dl.ABCDFreeSpace(2.02))]
        layers.append(("p", dl.FFTPropagator(elems, dl.PadSpec(pad=2, crop=2))))

        def get(o):
            return o.layers["p"].ABCDs["lens"].focal_length
    elif prop == "asm":
        layers.append(("p", dl.ASMPropagator(2e-3, dl.PadSpec(pad=2, crop=2))))

        def get(o):
            return o.layers["p"].distance

    base = dl.LayeredOpticalSystem(NPIX, 1.0, layers)
    scale = 1e-3 if prop == "asm" else 1.0

    def loss(coeff, wavelength, dist):
        optics = eqx.tree_at(lambda o: (o.layers["ab"].opd, get(o)), base, (coeff * 1e-7 * basis, dist * scale))
        psf = optics.propagate_mono(wavelength, jnp.array([1e-7, 0.0]))
        return jnp.sum(psf * weights(psf.shape)) * 1e2

    run(loss, (0.3, 1e-6, 2.0), jit)


# --------------------------------------------------------------------------- sources


SOURCES = ["point", "point_sources", "binary", "binary_zero_sep", "resolved", "point_resolved", "scene", "poly"]


def _source(kind):
    """A source and a function putting (flux, position, param, wavelengths) into it."""
    wls = jnp.array([0.95e-6, 1.05e-6])
    if kind == "point":
        src = dl.PointSource(wls, jnp.zeros(2), 1.0, weights=jnp.array([1.0, 2.0]))

        def get(s):
            return (s.flux, s.position, s.spectrum.wavelengths)

        return src, lambda s, f, p, q, w: eqx.tree_at(get, s, (f * q, p, w))
    if kind == "point_sources":
        src = dl.PointSources(wls, jnp.zeros((3, 2)), jnp.ones(3))

        def get(s):
            return (s.flux, s.position, s.spectrum.wavelengths)

        return src, lambda s, f, p, q, w: eqx.tree_at(
            get, s, (f * jnp.array([1.0, q, 0.25]), jnp.stack([p, -p, 2 * p]), w)
        )
    if kind in ("binary", "binary_zero_sep"):
        src = dl.BinarySource(wls, jnp.zeros(2), 1.0, 1e-7, 0.5, 2.0)

        def get(s):
            return (s.mean_flux, s.position, s.separation, s.position_angle, s.contrast, s.spectrum.wavelengths)

        if kind == "binary":
            return src, lambda s, f, p, q, w: eqx.tree_at(get, s, (f, p, 2e-7 * q, 0.5 + q, 2.0 + q, w))
        # zero separation: the two stars coincide; contrast 1: equal fluxes
        return src, lambda s, f, p, q, w: eqx.tree_at(get, s, (f, p, 0.0 * q, 0.5 * q, q / 0.8, w))
    if kind in ("resolved", "point_resolved"):
        if kind == "resolved":
            src = dl.ResolvedSource(wls, jnp.zeros(2), 1.0, jnp.ones((3, 3)))

            def get(s):
                return (s.flux, s.position, s.distribution, s.spectrum.wavelengths)

            return src, lambda s, f, p, q, w: eqx.tree_at(get, s, (f, p, weights((3, 3), 5) + q, w))
        src = dl.PointResolvedSource(wls, jnp.zeros(2), 1.0, jnp.ones((3, 3)), contrast=2.0)

        def get(s):
            return (s.flux, s.position, s.distribution, s.contrast, s.spectrum.wavelengths)

        return src, lambda s, f, p, q, w: eqx.tree_at(get, s, (f, p, weights((3, 3), 5) + q, 2.0 * q, w))
    if kind == "scene":
        src = dl.Scene([("a", dl.PointSource(wls, jnp.zeros(2), 1.0)), ("b", dl.PointSource(wls, jnp.zeros(2), 1.0))])

        def get(s):
            return (
                s.sources["a"].flux,
                s.sources["a"].position,
                s.sources["b"].flux,
                s.sources["b"].position,
                s.sources["a"].spectrum.wavelengths,
                s.sources["b"].spectrum.wavelengths,
            )

        return src, lambda s, f, p, q, w: eqx.tree_at(get, s, (f, p, q, -p, w, w * 1.01))
    if kind == "poly":
        src = dl.PointSource(position=jnp.zeros(2), flux=1.0, spectrum=dl.PolySpectrum(wls, jnp.array([1.0, 0.0, 0.1])))

        def get(s):
            return (s.flux, s.position, s.spectrum.coefficients, s.spectrum.wavelengths)

        return src, lambda s, f, p, q, w: eqx.tree_at(get, s, (f, p, jnp.array([1.0, q, 0.1]), w))


OPTICS = dl.AngularOpticalSystem(NPIX, 1.0, [dl.CircularAperture(0.45)], PSF_NPIX, 0.05)


@pytest.mark.parametrize(
    "kind, jit", [(k, False) for k in SOURCES] + [("binary_zero_sep", True), ("point_resolved", True)]
)
def test_source(kind, jit):
    base, put = _source(kind)

    def loss(flux, position, param, wavelengths):
        src = put(base, flux, position, param, wavelengths)
        psf = OPTICS.model(src)
        return poisson_loss(psf * 0.01) + jnp.sum(OPTICS.model(src.normalise()) ** 2)

    position = jnp.array([1e-7, -5e-8]) if kind != "binary_zero_sep" else jnp.zeros(2)
    run(loss, (2.0, position, 0.8, jnp.array([0.95e-6, 1.05e-6])), jit)


# --------------------------------------------------------------------------- detectors


DETECTORS = ["pixel_response", "jitter", "saturation", "saturation_tie", "constant_downsample", "all"]


def _detector(kind):
    """Detector layers and a function putting (param, response) into them."""
    if kind == "pixel_response":
        return [("r", dl.ApplyPixelResponse(jnp.ones((PSF_NPIX, PSF_NPIX))))], lambda d, p, r: d.set(
            "r.pixel_response", r * p
        )
    if kind == "jitter":
        return [("j", dl.ApplyJitter(1.0, kernel_size=5))], lambda d, p, r: d.set("j.sigma", p)
    if kind in ("saturation", "saturation_tie"):
        return [("s", dl.ApplySaturation(1.0))], lambda d, p, r: d.set("s.threshold", p * 1e-2)
    if kind == "constant_downsample":
        return [("c", dl.AddConstant(0.0)), dl.Downsample(2)], lambda d, p, r: d.set("c.value", p)
    layers = [
        ("r", dl.ApplyPixelResponse(jnp.ones((PSF_NPIX, PSF_NPIX)))),
        ("j", dl.ApplyJitter(1.0, kernel_size=3)),
        ("s", dl.ApplySaturation(1.0)),
        ("c", dl.AddConstant(0.0)),
        dl.Downsample(2),
        dl.Flip((0, 1)),
        ("rot", dl.Rotate(0.0)),
        dl.Resize(2),
    ]

    def put(d, p, r):
        return d.set(
            ["r.pixel_response", "j.sigma", "s.threshold", "c.value", "rot.angle"], [r, p, p * 1e-2, p, 0.1 * p]
        )

    return layers, put


@pytest.mark.parametrize("dither, jit", [(False, False), (True, True)])
@pytest.mark.parametrize("kind", DETECTORS)
def test_telescope(kind, dither, jit):
    layers = [("ab", dl.AberratedAperture(dl.CircularAperture(0.45), [4, 5, 6], jnp.zeros(3)))]
    optics = dl.AngularOpticalSystem(NPIX, 1.0, layers, PSF_NPIX, 0.05)
    src = dl.PointSource(jnp.array([1e-6]), jnp.zeros(2), 1.0)
    det_layers, put = _detector(kind)
    det = dl.LayeredDetector(det_layers)
    if dither:
        base = dl.Dither(jnp.array([[0.0, 0.0], [1e-7, -1e-7]]), optics, src, det)
    else:
        base = dl.Telescope(optics, src, det)
    coeffs = jnp.array([0.5, -0.3, 0.2])
    param = 0.7
    if kind == "saturation_tie":
        # the threshold is the image's own peak: the clip is met exactly there
        ab = base.set(["optics.ab.coefficients", "source.flux"], [coeffs * 1e-8, 1.5])
        param = float(dl.Telescope(ab.optics, ab.source, None).model().max()) * 100

    def loss(flux, param, response, coeffs):
        tel = base.set(["optics.ab.coefficients", "source.flux"], [coeffs * 1e-8, flux])
        tel = tel.set("detector", put(tel.detector, param, response))
        img = tel.model()
        return jnp.sum(img * weights(img.shape)) + jnp.sum(img**2)

    run(loss, (1.5, param, weights((PSF_NPIX, PSF_NPIX), 9), coeffs), jit)


# --------------------------------------------------------------------------- utilities


UTILS = ["mft", "fft", "norms", "interp", "misc", "psf_ops"]


# zernike/polike: dlu.noll_indices calls int() on jnp values, so these two are eager only
@pytest.mark.parametrize(
    "fn, jit",
    [(f, False) for f in UTILS]
    + [("mft", True), ("norms", True), ("interp", True), ("zernike", False), ("polike", False)],
)
def test_utils(fn, jit):
    coords = dlu.pixel_coords(NPIX, 2.0)

    if fn == "mft":

        def loss(field, wl, scale):
            out = dlu.MFT(
                field, wl, 1.0 / NPIX, PSF_NPIX, scale, focal_length=2.0, shift=jnp.array([0.5, -1.0]), pixel=True
            )
            out2 = dlu.MFT(field, wl, 1.0 / NPIX, PSF_NPIX, scale * 1e-6, inverse=True)
            return jnp.sum(jnp.abs(out) ** 2) + jnp.sum(jnp.abs(out2) ** 2)

        args = (weights((NPIX, NPIX)) * jnp.exp(1j * weights((NPIX, NPIX), 4)), 1e-6, 2e-6)
    elif fn == "fft":

        def loss(field, wl):
            out, scale = dlu.FFT(field, wl, 1.0 / NPIX, focal_length=2.0, pad=2)
            out2, _ = dlu.FFT(field, wl, 1.0 / NPIX, inverse=True)
            return jnp.sum(jnp.abs(out) ** 2 * weights(out.shape)) + scale * 1e5 + jnp.sum(jnp.abs(out2))

        args = (weights((NPIX, NPIX)) * jnp.exp(1j * weights((NPIX, NPIX), 4)), 1e-6)
    elif fn == "zernike":

        def loss(coeffs, diameter):
            basis = dlu.zernike_basis(list(range(1, 12)), coords, diameter)
            z = dlu.zernike(7, coords, diameter) + dlu.zernike_fast(
                *dlu.noll_indices(9), *dlu.zernike_factors(9), coords, diameter
            )
            return jnp.sum(dlu.eval_basis(basis, coeffs) ** 2) + jnp.sum(z**2)

        args = (jnp.linspace(-1, 1, 11), 2.0)
    elif fn == "polike":

        def loss(coeffs, diameter):
            basis = dlu.polike_basis(5, list(range(1, 8)), coords, diameter)
            return jnp.sum(jnp.nan_to_num(dlu.eval_basis(basis, coeffs)) ** 2)

        args = (jnp.linspace(-1, 1, 7), 2.0)
    elif fn == "norms":

        def loss(arr, mask_level):
            mask = arr > mask_level
            return (
                dlu.l1_norm(arr)
                + dlu.l2_norm(arr, mask)
                + dlu.max_norm(arr)
                + dlu.rms_norm(arr)
                + dlu.p2v_norm(arr)
                + dlu.rms_norm(arr * mask_level)
            )

        arr = jnp.array([[0.3, -0.5, 0.5], [0.5, -0.5, 0.1], [0.0, 0.2, -0.1]])  # ties in max/min/abs
        args = (arr, 0.2)
    elif fn == "interp":

        def loss(arr, ratio, angle):
            a = dlu.scale(arr, 6, ratio)
            b = dlu.rotate(arr, angle)
            c = dlu.rotate(arr, angle, method="cubic")
            return (
                jnp.sum(a**2) + jnp.sum(b * weights(b.shape)) + jnp.sum(c**2) + jnp.sum(dlu.downsample(arr, 2, False))
            )

        args = (weights((8, 8)), 1.3, 0.3)
    elif fn == "misc":

        def loss(arr, sigma):
            g = dlu.gaussian(0.2, sigma, 8, 3.0)
            sb = dlu.soft_binarise(arr)
            return (
                jnp.sum(g**2)
                + jnp.sum(sb * weights(sb.shape))
                + jnp.sum(dlu.nandiv(arr, arr - 1.0, fill=0.0))
                + jnp.sum(dlu.opd2phase(arr, 1e-6 * sigma))
                + jnp.sum(dlu.soft_square(coords, sigma, 0.1))
                + jnp.sum(dlu.soft_reg_polygon(coords, sigma, 5, 0.1, invert=True))
            )

        args = (jnp.linspace(0.0, 2.0, 36).reshape(6, 6), 0.5)
    elif fn == "psf_ops":

        def loss(data, angle):
            psf = dl.PSF(data, 0.1)
            psf = psf.convolve(weights((3, 3))).rotate(angle).flip(0).resize(6).downsample(2)
            return jnp.sum(psf.data * weights(psf.data.shape)) + jnp.sum(psf.data**2)

        args = (weights((8, 8)), 0.2)

    run(loss, args, jit)
