"""dm-pix and interpax differentiated by jax.grad, each argument alone and all,
eagerly and under jit: image augmentations, colour spaces and image metrics
(dm-pix's own tests need TensorFlow; its elastic_deformation is left out: with
float64 enabled it convolves a float64 field with a float32 kernel, which jax
refuses), and interpolation in 1, 2 and 3 dimensions
with query points on the knots, between them and outside the grid, where the
interval lookups clamp their indices."""

import itertools

import dm_pix as pix
import interpax
import jax
import jax.numpy as jnp
import pytest

jax.config.update("jax_enable_x64", True)
K = jax.random.PRNGKey
IMG = jax.random.uniform(K(0), (8, 8, 3), minval=0.05, maxval=0.95)
IMG2 = jax.random.uniform(K(1), (8, 8, 3), minval=0.05, maxval=0.95)
TIES = jnp.round(IMG * 4) / 4  # equal channels and values on thresholds
F32 = IMG.astype(jnp.float32)  # gaussian_blur builds its kernel in float32


def _w(out):
    out = jnp.where(jnp.isfinite(out), out, 0.0)
    return jnp.sum(jnp.sin(out) * jnp.arange(1.0, 1.0 + out.size).reshape(out.shape) / out.size)


def _each(fun, args, jit):
    """jax.grad of ``_w(fun(*args))`` for each argument alone and all together."""
    n = len(args)
    subsets = [(i,) for i in range(n)] + ([tuple(range(n))] if n > 1 else [])
    for argnums in subsets:
        g = jax.grad(lambda *a: _w(fun(*a)), argnums)
        (jax.jit(g) if jit else g)(*args)


ROT = jnp.array([[0.9, -0.3, 0.1], [0.35, 0.95, 0.0], [0.0, 0.0, 1.0]])
OFF = jnp.array([0.7, -1.2, 0.0])

PIX = {
    # (function, arguments)
    "adjust_brightness": (pix.adjust_brightness, (IMG, 0.1)),
    "adjust_contrast": (pix.adjust_contrast, (IMG, 1.3)),
    "adjust_gamma": (pix.adjust_gamma, (IMG, 0.8)),
    "adjust_gamma_gain": (lambda x, g, k: pix.adjust_gamma(x, g, gain=k), (IMG, 1.2, 0.9)),
    "adjust_hue": (pix.adjust_hue, (IMG, 0.2)),
    "adjust_hue_ties": (pix.adjust_hue, (TIES, 0.2)),
    "adjust_saturation": (pix.adjust_saturation, (IMG, 0.6)),
    "adjust_saturation_ties": (pix.adjust_saturation, (TIES, 1.4)),
    "rgb_to_hsv": (pix.rgb_to_hsv, (IMG,)),
    "rgb_to_hsv_ties": (pix.rgb_to_hsv, (TIES,)),
    "hsv_to_rgb": (pix.hsv_to_rgb, (IMG,)),
    "rgb_to_hsl": (pix.rgb_to_hsl, (IMG,)),
    "rgb_to_hsl_ties": (pix.rgb_to_hsl, (TIES,)),
    "hsl_to_rgb": (pix.hsl_to_rgb, (IMG,)),
    "rgb_to_grayscale": (pix.rgb_to_grayscale, (IMG,)),
    "solarize": (pix.solarize, (IMG, 0.5)),
    "solarize_ties": (pix.solarize, (TIES, 0.5)),
    "gaussian_blur": (lambda x, s: pix.gaussian_blur(x, s, 5), (F32, jnp.float32(1.3))),
    "gaussian_blur_valid": (lambda x, s: pix.gaussian_blur(x, s, 3, padding="VALID"), (F32, jnp.float32(0.8))),
    "affine_nearest": (lambda x, m: pix.affine_transform(x, m, order=1, mode="nearest"), (IMG, ROT)),
    "affine_offset": (lambda x, m, o: pix.affine_transform(x, m, offset=o), (IMG, ROT, OFF)),
    "affine_constant": (lambda x, m: pix.affine_transform(x, m, mode="constant", cval=0.3), (IMG, ROT)),
    "affine_wrap": (lambda x, m: pix.affine_transform(x, m, mode="wrap"), (IMG, ROT)),
    "affine_mirror": (lambda x, m: pix.affine_transform(x, m, mode="mirror"), (IMG, ROT)),
    "affine_reflect": (lambda x, m: pix.affine_transform(x, m, mode="reflect"), (IMG, ROT)),
    "affine_order0": (lambda x, m: pix.affine_transform(x, m, order=0), (IMG, ROT)),
    "affine_vector": (lambda x, v: pix.affine_transform(x, v, offset=OFF), (IMG, jnp.array([1.1, 0.9, 1.0]))),
    "affine_shift_on_grid": (
        lambda x, o: pix.affine_transform(x, jnp.eye(3), offset=o),
        (IMG, jnp.array([1.0, -2.0, 0.0])),
    ),
    "rotate": (lambda x, a: pix.rotate(x, a), (IMG, 0.4)),
    "rotate_constant": (lambda x, a: pix.rotate(x, a, mode="constant"), (IMG, 1.1)),
    "rotate_order0": (lambda x, a: pix.rotate(x, a, order=0), (IMG, 0.4)),
    "flat_nd_linear_interpolate": (
        lambda v, c: pix.flat_nd_linear_interpolate(v, c),
        (IMG[..., 0], jnp.array([[0.5, 3.2, 7.0, -0.5, 6.99], [1.0, 2.5, 7.5, 4.0, 0.0]])),
    ),
    "flat_nd_linear_interpolate_constant": (
        lambda v, c: pix.flat_nd_linear_interpolate_constant(v, c, cval=0.2),
        (IMG[..., 0], jnp.array([[0.5, 3.2, 7.0, -0.5, 8.5], [1.0, 2.5, 7.5, 4.0, 0.0]])),
    ),
    "depth_to_space": (lambda x: pix.depth_to_space(jnp.tile(x, (1, 1, 4)), 2), (IMG,)),
    "space_to_depth": (lambda x: pix.space_to_depth(x, 2), (IMG,)),
    "extract_patches": (lambda x: pix.extract_patches(x[None], (1, 3, 3, 1), (1, 2, 2, 1), (1, 1, 1, 1)), (IMG,)),
    "extract_patches_rates_same": (
        lambda x: pix.extract_patches(x[None], (1, 2, 2, 1), (1, 3, 3, 1), (1, 2, 2, 1), padding="SAME"),
        (IMG,),
    ),
    "flip_rot90_crop": (
        lambda x: pix.center_crop(pix.rot90(pix.flip_left_right(pix.flip_up_down(x)), 3), 5, 6),
        (IMG,),
    ),
    "pad_to_size_constant": (lambda x: pix.pad_to_size(x, 11, 10), (IMG,)),
    "pad_to_size_reflect": (lambda x: pix.pad_to_size(x, 11, 10, mode="reflect"), (IMG,)),
    "pad_to_size_edge": (lambda x: pix.pad_to_size(x, 11, 10, mode="edge"), (IMG,)),
    "resize_with_crop_or_pad": (lambda x: pix.resize_with_crop_or_pad(x, 5, 11), (IMG,)),
    "random_crop": (lambda x: pix.random_crop(K(3), x, (5, 6, 3)), (IMG,)),
    "random_ops": (
        lambda x: pix.random_saturation(
            K(4),
            pix.random_hue(K(5), pix.random_contrast(K(6), pix.random_brightness(K(7), x, 0.2), 0.5, 1.5), 0.1),
            0.5,
            1.5,
        ),
        (IMG,),
    ),
    "random_gamma": (lambda x: pix.random_gamma(K(8), x, 0.5, 1.5), (IMG,)),
    "random_flips": (lambda x: pix.random_flip_up_down(K(9), pix.random_flip_left_right(K(10), x)), (IMG,)),
    "ssim": (lambda a, b: pix.ssim(a, b, filter_size=5), (IMG, IMG2)),
    "ssim_map": (lambda a, b: pix.ssim(a, b, filter_size=3, return_map=True), (IMG, IMG2)),
    "ssim_same": (lambda a, b: pix.ssim(a, b, filter_size=3), (IMG, IMG)),
    "psnr": (pix.psnr, (IMG, IMG2)),
    "mse_mae_rmse": (lambda a, b: pix.mse(a, b) + pix.mae(a, b) + pix.rmse(a, b), (IMG, IMG2)),
    "mae_ties": (pix.mae, (TIES, jnp.round(IMG2 * 4) / 4)),
    "simse": (pix.simse, (IMG, IMG2)),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", list(PIX))
def test_pix(name, jit):
    fun, args = PIX[name]
    _each(fun, args, jit)


X = jnp.linspace(0.0, 2.0, 7)
Y = jnp.linspace(-1.0, 1.0, 6)
Z = jnp.linspace(0.0, 1.0, 5)
F1 = jnp.sin(2 * X) + X**2 / 3
F2 = jnp.cos(X[:, None] + 2 * Y[None, :]) + X[:, None] * Y[None, :]
F3 = F2[:, :, None] * jnp.exp(-Z)[None, None, :]
# on a knot, between knots, at both ends, outside on each side
XQ = jnp.array([0.0, 0.2, 1 / 3, 0.9, 1.0, 1.7, 2.0, -0.3, 2.4])
YQ = jnp.array([-1.0, -0.55, 0.2, 0.6, 1.0, 0.0, 0.33, 1.2, -1.5])
ZQ = jnp.array([0.0, 0.1, 0.25, 0.5, 0.7, 1.0, 0.9, -0.2, 1.1])
M1 = ["nearest", "linear", "cubic", "cubic2", "catmull-rom", "cardinal", "monotonic", "monotonic-0", "akima"]
M23 = ["nearest", "linear", "cubic", "cubic2", "catmull-rom", "cardinal"]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    ("method", "derivative", "extrap"),
    [(m, d, e) for m, d, e in itertools.product(M1, [0, 1], [True, False, 0.5]) if not (m == "nearest" and d)],
)
def test_interp1d(method, derivative, extrap, jit):
    fun = lambda xq, x, f: interpax.interp1d(xq, x, f, method=method, derivative=derivative, extrap=extrap)  # noqa: E731
    _each(fun, (XQ, X, F1), jit)


@pytest.mark.parametrize("method", ["linear", "cubic", "monotonic"])
def test_interp1d_periodic_and_even(method):
    xp = jnp.linspace(0.0, 2 * jnp.pi, 9)[:-1]
    fp = jnp.sin(xp) + 0.3 * jnp.cos(2 * xp)
    xq = jnp.array([-1.0, 0.0, 0.4, 3.0, 2 * jnp.pi, 7.5])
    _each(lambda q, f: interpax.interp1d(q, xp, f, method=method, period=2 * jnp.pi), (xq, fp), jit=False)
    _each(
        lambda q, x, f: interpax.interp1d(q, x, f, method=method, extrap=True, even_spacing=True), (XQ, X, F1), jit=True
    )


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(("method", "extrap"), list(itertools.product(M23, [True, False])))
def test_interp2d(method, extrap, jit):
    fun = lambda xq, yq, x, y, f: interpax.interp2d(xq, yq, x, y, f, method=method, extrap=extrap)  # noqa: E731
    _each(fun, (XQ, YQ, X, Y, F2), jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("method", M23)
def test_interp3d(method, jit):
    fun = lambda xq, yq, zq, f: interpax.interp3d(xq, yq, zq, X, Y, Z, f, method=method, extrap=True)  # noqa: E731
    _each(fun, (XQ, YQ, ZQ, F3), jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("deriv", [0, 1, (1, 1)])
def test_interpolator2d_derivative(deriv, jit):
    def fun(xq, yq, f):
        return interpax.Interpolator2D(X, Y, f, method="cubic", extrap=True)(
            xq, yq, dx=0 if deriv == 0 else 1, dy=0 if deriv != (1, 1) else 1
        )

    _each(fun, (XQ, YQ, F2), jit)


SPLINES = {
    "cubic_not_a_knot": lambda x, y: interpax.CubicSpline(x, y, check=False),
    "cubic_natural": lambda x, y: interpax.CubicSpline(x, y, bc_type="natural", check=False),
    "cubic_clamped": lambda x, y: interpax.CubicSpline(x, y, bc_type="clamped", check=False),
    "cubic_periodic": lambda x, y: interpax.CubicSpline(x, y.at[-1].set(y[0]), bc_type="periodic", check=False),
    "pchip": lambda x, y: interpax.PchipInterpolator(x, y, check=False),
    "akima": lambda x, y: interpax.Akima1DInterpolator(x, y, check=False),
    "hermite": lambda x, y: interpax.CubicHermiteSpline(x, y, jnp.cos(y), check=False),
    "smoothing": lambda x, y: interpax.CubicSmoothingSpline(x, y, p=0.7, check=False),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("nu", [0, 1, 2])
@pytest.mark.parametrize("name", list(SPLINES))
def test_spline(name, nu, jit):
    def fun(xq, x, y):
        s = SPLINES[name](x, y)
        return s(xq, nu) + s.integrate(0.1, 1.7) + s.derivative()(xq)

    _each(fun, (XQ[:-2], X, F1), jit)


@pytest.mark.parametrize("jit", [False, True])
def test_ppoly_and_fft(jit):
    c = jax.random.normal(K(11), (4, 6))

    def ppoly(xq, c, x):
        p = interpax.PPoly(c, x, check=False)
        return p(xq) + p.antiderivative()(xq) + p.integrate(0.2, 1.9)

    _each(ppoly, (XQ[:-2], c, X), jit)
    _each(lambda f: interpax.fft_interp1d(f, 12, sx=jnp.array([0.0, 0.3]), dx=0.5), (F1[:6],), jit)
    _each(lambda f: interpax.fft_interp2d(f, 9, 7, sx=jnp.array([0.1]), sy=jnp.array([0.2])), (F2[:6],), jit)
    _each(lambda x, f: interpax.approx_df(x, f, method="cubic2", axis=0), (X, F1), jit)


@pytest.mark.parametrize("kernel", ["thin_plate_spline", "gaussian", "multiquadric", "cubic"])
def test_rbf(kernel):
    pts = jax.random.uniform(K(12), (10, 2))
    vals = jnp.sin(3 * pts[:, 0]) + pts[:, 1] ** 2
    q = jax.random.uniform(K(13), (4, 2))
    eps = None if kernel in ("thin_plate_spline", "cubic") else 1.5

    def fun(y, d, q):
        return interpax.RBFInterpolator(y, d, kernel=kernel, epsilon=eps, smoothing=1e-3)(q)

    _each(fun, (pts, vals, q), jit=False)
