"""augmax: image augmentations at fixed PRNG keys differentiated by jax.grad, eagerly and
under jit. Geometric transformations (flips, 90-degree and arbitrary rotations,
translations and crops whose offsets are traced, centre/random/random-sized crops,
resizes, a warp whose strength is traced, an affine/perspective transformation of our
own through ``push_transform``, ``GeometricChain``/``Chain``/``OptimizedChain`` and their
inverses) of images, dense fields, masks, keypoints and contours, with respect to the
image, the keypoints and the traced parameters, alone and together; sampling points on
the pixel grid (identity transformations, integer translations: the kinks of linear
interpolation) and off it, and partly outside the image. The colour transformations
(gamma, brightness, contrast, colour jitter, greyscale, per-channel gamma,
solarisation, channel shuffle and drop, normalisation with traced mean and std) at
p=1 and p=0, on float32 images (augmax refuses others) with pixels at 0, at 1, at
Solarization's threshold and with tied channels; augmax's functional brightness and
contrast, its RGB/HSV conversions and ``log_uniform`` in float64 with respect to each
argument, at the brightness sign change, the contrast curve's joints, grey and black
pixels and hues on the sextant boundaries; blurs and grid shuffling."""

import math

import augmax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from augmax import utils
from augmax.functional import colorspace as F
from augmax.geometric import GeometricTransformation

jax.config.update("jax_enable_x64", True)
KEY = jax.random.PRNGKey(3)
H, W = 8, 6
_rng = np.random.default_rng(0)
IMG = jnp.asarray(_rng.uniform(0.05, 0.95, (H, W, 3)))
# float32 image with edge pixels: 0, 1, at 0.5 (Solarization's threshold), tied channels
_img32 = _rng.uniform(0.05, 0.95, (H, W, 3))
_img32[0, 0] = 0.0
_img32[0, 1] = 1.0
_img32[0, 2] = 0.5
_img32[1, 0] = (0.3, 0.3, 0.7)
_img32[1, 1] = (0.6, 0.6, 0.6)
_img32[1, 2] = (0.8, 0.2, 0.8)
IMG32 = jnp.asarray(_img32, jnp.float32)
KEYPOINTS = jnp.asarray([[1.5, 2.25], [3.0, 4.0], [6.2, 0.7]])
WEIGHTS_BIG = jnp.asarray(_rng.normal(size=(16, 16, 3)))
WEIGHTS = WEIGHTS_BIG[:H, :W]


def _run(loss, args, argnums_list, jit):
    for argnums in argnums_list:
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*args)


def _wsum(out):
    return jnp.sum(jnp.sin(3.0 * out) * WEIGHTS_BIG[tuple(slice(0, s) for s in out.shape)])


class Affine(GeometricTransformation):
    """A fixed (traced) 3x3 matrix pushed onto the coordinates, as augmax's own do."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def transform_coordinates(self, rng, coordinates, invert=False):
        coordinates.push_transform(jnp.linalg.inv(self.m) if invert else self.m)


GEOMETRIC = {
    "hflip": lambda: augmax.HorizontalFlip(p=1.0),
    "vflip": lambda: augmax.VerticalFlip(p=1.0),
    "noflip": lambda: augmax.HorizontalFlip(p=0.0),  # identity: sampling on the grid
    "rotate90": lambda: augmax.Rotate90(),
    "rotate": lambda: augmax.Rotate(angle_range=(10, 40), p=1.0),
    "center_crop": lambda: augmax.CenterCrop(4, 6),
    "random_crop": lambda: augmax.RandomCrop(4, 5),
    "resize": lambda: augmax.Resize(5, 11),
    "random_sized_crop": lambda: augmax.RandomSizedCrop(5, 4, zoom_range=(0.7, 1.4)),
    "random_sized_crop_underzoom": lambda: augmax.RandomSizedCrop(4, 4, prevent_underzoom=False),
    "warp": lambda: augmax.Warp(strength=1.5, coarseness=2),
    "geometric_chain": lambda: augmax.GeometricChain(
        augmax.Rotate(20), augmax.HorizontalFlip(), augmax.RandomCrop(5, 6)
    ),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", list(GEOMETRIC))
def test_geometric_image(name, jit):
    t = GEOMETRIC[name]()

    def loss(img):
        return _wsum(t(KEY, img))

    _run(loss, (IMG,), [(0,)], jit)


TRANSLATIONS = {"generic": (0.37, -1.21), "integer": (1.0, -2.0), "zero": (0.0, 0.0), "outside": (4.6, 7.3)}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", list(TRANSLATIONS))
def test_translate(point, jit):
    dx, dy = TRANSLATIONS[point]

    def loss(img, shift):
        out = augmax.Translate(*shift)(KEY, img)
        return _wsum(out)

    _run(loss, (IMG, (jnp.asarray(dx), jnp.asarray(dy))), [(0,), (1,), (0, 1)], jit)


CROPS = {"generic": (0.6, 1.3), "integer": (1.0, 2.0), "corner": (0.0, 0.0)}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", list(CROPS))
def test_crop(point, jit):
    x0, y0 = CROPS[point]

    def loss(img, corner):
        out = augmax.Crop(*corner, 4, 5)(KEY, img)
        return _wsum(out)

    _run(loss, (IMG, (jnp.asarray(x0), jnp.asarray(y0))), [(0,), (1,), (0, 1)], jit)


AFFINES = {
    "rotation_scale": [[0.9, 0.3, 0.2], [-0.25, 1.1, -0.4], [0.0, 0.0, 1.0]],
    "perspective": [[1.0, 0.1, 0.3], [0.05, 0.95, 0.1], [0.02, -0.03, 1.0]],
    "identity": [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]],
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    "matrix,invert",
    [
        ("rotation_scale", False),
        ("rotation_scale", True),
        ("perspective", False),
        ("perspective", True),
        ("identity", False),
    ],
)
def test_affine_inputs(matrix, invert, jit):
    """Image, dense field, mask, keypoints and contour through one traced matrix."""
    types = [
        augmax.InputType.IMAGE,
        augmax.InputType.DENSE,
        augmax.InputType.MASK,
        augmax.InputType.KEYPOINTS,
        augmax.InputType.CONTOUR,
    ]
    mask = (IMG[..., :1] > 0.5).astype(jnp.float64)

    def loss(img, m, kp):
        dense = img[..., :2] * 2.0 - 1.0
        t = augmax.Chain(Affine(m), augmax.CenterCrop(5, 7), input_types=types)
        fn = t.invert if invert else t
        if invert:
            t(KEY, [img, dense, mask, kp, kp])  # invert needs a forward pass first
        out_img, out_dense, out_mask, out_kp, out_ct = fn(KEY, [img, dense, mask, kp, kp])
        return (
            _wsum(out_img)
            + jnp.sum(jnp.cos(out_dense)) * 0.3
            + jnp.sum(out_mask * out_img[..., :1])
            + jnp.sum(jnp.sin(out_kp))
            + 0.2 * jnp.sum(out_ct[0] * out_ct[-1])
        )

    args = (IMG, jnp.asarray(AFFINES[matrix]), KEYPOINTS)
    _run(loss, args, [(0,), (1,), (2,), (0, 1, 2)], jit)


@pytest.mark.parametrize("jit", [False, True])
def test_warp_keypoints(jit):
    """Warp's pixelwise offsets (strength traced) move keypoints by fixed-point iteration."""
    types = [augmax.InputType.IMAGE, augmax.InputType.KEYPOINTS]

    def loss(img, kp, strength):
        t = augmax.Chain(augmax.Rotate(15), augmax.Warp(strength=strength, coarseness=2), input_types=types)
        out_img, out_kp = t(KEY, [img, kp])
        return _wsum(out_img) + jnp.sum(out_kp**2) * 0.1

    _run(loss, (IMG, KEYPOINTS, jnp.asarray(1.3)), [(0,), (1,), (2,), (0, 1, 2)], jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("chain", ["Chain", "OptimizedChain"])
def test_chains(chain, jit):
    """Geometric, colour (Normalize with traced mean/std) and image-level steps."""

    def loss(img, stats):
        mean, std = stats
        cls = getattr(augmax, chain)
        t = cls(
            augmax.RandomSizedCrop(6, 5, zoom_range=(0.8, 1.2)),
            augmax.Normalize(mean, std),
            augmax.Blur(3, p=1.0),
            augmax.Rotate(25),
            augmax.ChannelShuffle(p=1.0),
            augmax.GaussianBlur(1.5, p=1.0),
        )
        return _wsum(t(KEY, img))

    args = (IMG, (jnp.asarray([0.4, 0.5, 0.45]), jnp.asarray([0.2, 0.25, 0.3])))
    _run(loss, args, [(0,), (1,), (0, 1)], jit)


@pytest.mark.parametrize("jit", [False, True])
def test_chain_invert(jit):
    def loss(img, stats):
        mean, std = stats
        t = augmax.Chain(augmax.Rotate(30), augmax.Normalize(mean, std), augmax.Translate(0.5, 1.5))
        return _wsum(t.invert(KEY, t(KEY, img)))

    args = (IMG, (jnp.asarray([0.4, 0.5, 0.45]), jnp.asarray([0.2, 0.25, 0.3])))
    _run(loss, args, [(0,), (1,), (0, 1)], jit)


IMAGELEVEL = {
    "blur": lambda: augmax.Blur(3, p=1.0),
    "blur_even": lambda: augmax.Blur(4, p=1.0),
    "gaussian_blur": lambda: augmax.GaussianBlur(2, p=1.0),
    "gaussian_blur_off": lambda: augmax.GaussianBlur(2, p=0.0),
    "grid_shuffle": lambda: augmax.GridShuffle((2, 2), p=1.0),
    "channel_shuffle": lambda: augmax.ChannelShuffle(p=1.0),
    "channel_drop": lambda: augmax.ChannelDrop(p=1.0),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", list(IMAGELEVEL))
def test_imagelevel(name, jit):
    t = IMAGELEVEL[name]()

    def loss(img):
        # the blurs' default input_types is a one-element list
        out = t(KEY, [img])[0] if "blur" in name else t(KEY, img)
        return _wsum(out)

    _run(loss, (IMG,), [(0,)], jit)


COLOUR32 = {
    "gamma": lambda p: augmax.RandomGamma((0.5, 2.0), p=p),
    "brightness": lambda p: augmax.RandomBrightness((-0.6, 0.6), p=p),
    "contrast": lambda p: augmax.RandomContrast((-0.6, 0.6), p=p),
    "color_jitter": lambda p: augmax.ColorJitter(0.2, 0.2, 0.2, 0.1, p=p),
    "grayscale": lambda p: augmax.RandomGrayscale(p=p),
    "channel_gamma": lambda p: augmax.RandomChannelGamma((0.5, 2.0), p=p),
    "solarization": lambda p: augmax.Solarization(0.5, p=p),
    # with x64 on, a random amount makes the pixel float64, so only one dtype-checking step
    "chain": lambda p: augmax.ColorspaceChain(
        augmax.ChannelShuffle(p=p), augmax.RandomContrast(p=p), augmax.ChannelDrop(p=p)
    ),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("p,invert", [(1.0, False), (1.0, True), (0.0, False)])
@pytest.mark.parametrize("name", list(COLOUR32))
def test_colour_float32(name, p, invert, jit):
    t = COLOUR32[name](p)
    img = IMG32 if name not in ("gamma", "channel_gamma") else jnp.clip(IMG32, 0.05, 1.0)

    def loss(img):
        out = t.invert(KEY, img) if invert else t(KEY, img)
        return jnp.sum(jnp.sin(3.0 * out) * WEIGHTS.astype(jnp.float32))

    _run(loss, (img,), [(0,)], jit)


VALUES = jnp.asarray([0.0, 0.1, 0.37, 0.5, 0.81, 1.0])


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("invert", [False, True])
@pytest.mark.parametrize("b", [0.3, -0.25, 0.0])
def test_functional_brightness(b, invert, jit):
    def loss(v, b):
        return jnp.sum(jnp.sin(2.0 * F.adjust_brightness(v, b, invert=invert)))

    _run(loss, (VALUES, jnp.asarray(b)), [(0,), (1,), (0, 1)], jit)


def _contrast_joints(c):
    slant = math.tan((c + 1.0) * (math.pi / 4))
    p1 = (slant - slant**2) / (2 * (1 - slant**2))
    return [p1, 1 - p1]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("invert", [False, True])
@pytest.mark.parametrize("c", [0.3, -0.4, 0.05])
def test_functional_contrast(c, invert, jit):
    cc = -c if invert else c
    v = jnp.concatenate([VALUES, jnp.asarray(_contrast_joints(cc))])  # on the joints too

    def loss(v, c):
        return jnp.sum(jnp.sin(2.0 * F.adjust_contrast(v, c, invert=invert)))

    _run(loss, (v, jnp.asarray(c)), [(0,), (1,), (0, 1)], jit)


PIXELS = {
    "generic": (0.7, 0.2, 0.45),
    "green_max": (0.1, 0.8, 0.3),
    "blue_max": (0.25, 0.35, 0.9),
    "tie_max": (0.6, 0.6, 0.1),
    "tie_min": (0.2, 0.9, 0.2),
    "grey": (0.4, 0.4, 0.4),
    "black": (0.0, 0.0, 0.0),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("pixel", list(PIXELS))
def test_rgb_hsv_roundtrip(pixel, jit):
    def loss(px):
        h, s, v = utils.rgb_to_hsv(px)
        rgb = utils.hsv_to_rgb(h + 0.05, s * 0.9, v)
        return jnp.sum(jnp.sin(2.0 * rgb)) + jnp.sin(h) + s * v

    _run(loss, (jnp.asarray(PIXELS[pixel]),), [(0,)], jit)


HSV = {
    "generic": (0.13, 0.6, 0.8),
    "sextant": (1.0 / 6.0, 0.5, 0.7),  # k = n + 1: the min/max kinks
    "hue_zero": (0.0, 0.4, 0.9),
    "hue_half": (0.5, 0.3, 0.6),
    "grey": (0.3, 0.0, 0.5),
    "wrapped": (1.2, 0.7, 0.4),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", list(HSV))
def test_hsv_to_rgb(point, jit):
    def loss(h, s, v):
        return jnp.sum(jnp.sin(2.0 * utils.hsv_to_rgb(h, s, v)) * jnp.asarray([1.0, -0.7, 0.4]))

    args = tuple(jnp.asarray(a) for a in HSV[point])
    _run(loss, args, [(0,), (1,), (2,), (0, 1, 2)], jit)


@pytest.mark.parametrize("jit", [False, True])
def test_log_uniform(jit):
    def loss(lo, hi):
        x = utils.log_uniform(KEY, shape=(5,), minval=lo, maxval=hi)
        return jnp.sum(jnp.sin(x))

    _run(loss, (jnp.asarray(0.3), jnp.asarray(2.5)), [(0,), (1,), (0, 1)], jit)


@pytest.mark.parametrize("jit", [False, True])
def test_grayscale_normalize(jit):
    def loss(px, stats):
        mean, std = stats
        out = augmax.Normalize(mean, std)(KEY, px)
        return jnp.sum(jnp.sin(out) * WEIGHTS) + jnp.sum(F.to_grayscale(px) ** 2)

    args = (IMG, (jnp.asarray([0.4, 0.5, 0.45]), jnp.asarray([0.2, 0.25, 0.3])))
    _run(loss, args, [(0,), (1,), (0, 1)], jit)
