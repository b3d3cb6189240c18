"""jaxwt (with PyWavelets' filter banks): the fast wavelet transforms ``wavedec`` /
``waverec`` (strided ``conv_general_dilated`` and ``conv_transpose`` after ``jnp.pad``)
with Haar, Daubechies, symlet, coiflet and biorthogonal wavelets in the reflect,
symmetric and zero boundary modes, even and odd signal lengths, one, two and the
maximal number of levels, batched and along another axis; ``wavedec2`` / ``waverec2``
(odd shapes, other axes), ``wavedec3`` / ``waverec3``, the stationary transform
``swt`` / ``iswt`` (dilated convolutions), wavelet packets in one and two dimensions
(decomposition and ``reconstruct``) and the continuous transform ``cwt`` (FFTs; real
and complex wavelets; eager only: jaxwt's ``cwt``, like ``wavedec2`` with other axes,
cannot be traced under jit); differentiated by jax.grad with respect to the signal, the
filter bank of a learnable wavelet (a NamedTuple of the four filters that jaxwt
unpacks) and both, eagerly and under jit, at random and constant signals, and at
levels past the maximum, where every coefficient feels the boundary."""

import typing

import jax
import jax.numpy as jnp
import jaxwt
import numpy as np
import pytest
import pywt

jax.config.update("jax_enable_x64", True)


def _run(loss, args, argnums_list, jit):
    for argnums in argnums_list:
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*args)


def _fold(tree):
    """A scalar of every leaf: a weighted sum plus a small square, so that the
    gradient depends on the point."""
    total = 0.0
    for i, leaf in enumerate(jax.tree_util.tree_leaves(tree)):
        w = jnp.cos(0.7 * jnp.arange(leaf.size) + i).reshape(leaf.shape)
        if jnp.iscomplexobj(leaf):
            leaf = jnp.abs(leaf) ** 2 + 0.3 * leaf.real
        total = total + jnp.sum(w * leaf) + 0.1 * jnp.sum(leaf**2)
    return total


def _signal(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape))


class LearnableWavelet(typing.NamedTuple):
    """A wavelet whose filters are arrays (jaxwt unpacks any object that is not a
    string or a pywt.Wavelet into its four filters)."""

    dec_lo: jax.Array
    dec_hi: jax.Array
    rec_lo: jax.Array
    rec_hi: jax.Array

    @property
    def dec_len(self):
        return self.dec_lo.shape[0]

    @property
    def filter_bank(self):
        return tuple(self)


def _learnable(name, seed=1):
    # the pywt filters, perturbed so that the bank is no longer orthogonal
    rng = np.random.default_rng(seed)
    return LearnableWavelet(*[jnp.asarray(f) + 0.05 * rng.normal(size=len(f)) for f in pywt.Wavelet(name).filter_bank])


SIGNALS = {"even": (2, 16), "odd": (2, 13)}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("length", list(SIGNALS))
@pytest.mark.parametrize("mode", ["reflect", "symmetric", "zero"])
@pytest.mark.parametrize("wavelet", ["haar", "db2", "sym4", "coif1", "bior2.2"])
def test_wavedec_waverec(wavelet, mode, length, jit):
    shape = SIGNALS[length]
    level = 2  # past pywt's maximum for sym4: every coefficient feels the boundary

    def loss(x):
        coeffs = jaxwt.wavedec(x, wavelet, mode=mode, level=level)
        scaled = [c * (1.0 + 0.2 * i) for i, c in enumerate(coeffs)]
        rec = jaxwt.waverec(scaled, wavelet)[..., : shape[-1]]
        return _fold(coeffs) + _fold(rec)

    _run(loss, (_signal(shape),), [(0,)], jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("case", ["max_level", "constant", "axis0", "batch3d"])
def test_wavedec_options(case, jit):
    kwargs, x = {}, _signal((2, 16), 2)
    if case == "constant":
        x = jnp.full((2, 16), 0.7)
        kwargs = {"mode": "reflect", "level": 2}
    elif case == "axis0":
        x = _signal((12, 3), 3)
        kwargs = {"axis": 0, "level": 2}
    elif case == "batch3d":
        x = _signal((2, 3, 12), 4)
        kwargs = {"level": 2}

    def loss(x):
        coeffs = jaxwt.wavedec(x, "db2", **kwargs)
        rec = jaxwt.waverec(coeffs, "db2", axis=kwargs.get("axis", -1))
        return _fold(coeffs) + _fold(rec)

    _run(loss, (x,), [(0,)], jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("transform", ["wavedec", "wavedec2", "swt"])
def test_learnable_wavelet(transform, jit):
    wavelet = _learnable("db2")

    def loss(x, wavelet):
        if transform == "wavedec":
            coeffs = jaxwt.wavedec(x, wavelet, mode="symmetric", level=2)
            rec = jaxwt.waverec(coeffs, wavelet)
        elif transform == "wavedec2":
            coeffs = jaxwt.wavedec2(x.reshape(2, 4, 4), wavelet, mode="reflect", level=1)
            rec = jaxwt.waverec2(coeffs, wavelet)
        else:
            coeffs = jaxwt.swt(x, wavelet, level=2)
            rec = jaxwt.iswt(coeffs, wavelet)
        return _fold(coeffs) + _fold(rec)

    _run(loss, (_signal((2, 16), 5), wavelet), [(0,), (1,), (0, 1)], jit)


# swapped axes run eagerly only: jaxwt argsorts them with jnp (_undo_swap_axes), which
# cannot be traced under jit
@pytest.mark.parametrize("mode", ["reflect", "symmetric", "zero"])
@pytest.mark.parametrize(
    "case, jit",
    [("haar-odd", False), ("haar-odd", True), ("db2-even", False), ("db2-even", True), ("db2-axes", False)],
)
def test_wavedec2(case, mode, jit):
    wavelet, which = case.split("-")
    x = _signal((2, 9, 7) if which == "odd" else (2, 8, 10), 6)
    axes = (-1, -2) if which == "axes" else (-2, -1)

    def loss(x):
        coeffs = jaxwt.wavedec2(x, wavelet, mode=mode, level=2, axes=axes)
        rec = jaxwt.waverec2(coeffs, wavelet, axes=axes)
        return _fold(coeffs) + _fold(rec)

    _run(loss, (x,), [(0,)], jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("wavelet", ["haar", "db2"])
def test_wavedec3(wavelet, jit):
    def loss(x):
        coeffs = jaxwt.wavedec3(x, wavelet, mode="symmetric", level=1)
        return _fold(coeffs) + _fold(jaxwt.waverec3(coeffs, wavelet))

    _run(loss, (_signal((1, 4, 6, 5), 7),), [(0,)], jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("wavelet", ["haar", "db2", "sym3"])
def test_swt(wavelet, jit):
    def loss(x):
        coeffs = jaxwt.swt(x, wavelet, level=2)
        return _fold(coeffs) + _fold(jaxwt.iswt([c * 1.1 for c in coeffs], wavelet))

    _run(loss, (_signal((2, 16), 8),), [(0,)], jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dims", [1, 2])
def test_packets(dims, jit):
    def loss(x):
        if dims == 1:
            wp = jaxwt.WaveletPacket(x, "db2", mode="reflect", max_level=2)
            leaves = [wp[n] for n in wp.get_level(2)]
            wp["ad"] = wp["ad"] * 0.5
        else:
            wp = jaxwt.WaveletPacket2D(x.reshape(2, 4, 4), "haar", mode="symmetric", max_level=1)
            leaves = [wp[n] for n in ("a", "h", "v", "d")]
            wp["h"] = wp["h"] * 0.5
        wp.reconstruct()
        return _fold(leaves) + _fold(wp[""])

    _run(loss, (_signal((2, 16), 9),), [(0,)], jit)


@pytest.mark.parametrize("jit", [False])  # cwt computes its index grids with jnp: not traceable under jit
@pytest.mark.parametrize("wavelet", ["mexh", "morl", "gaus1", "cmor1.5-1.0", "shan1-1"])
def test_cwt(wavelet, jit):
    def loss(x):
        coeffs, _ = jaxwt.cwt(x, np.arange(1, 5), wavelet, sampling_period=0.5)
        return _fold(coeffs)

    _run(loss, (_signal((2, 20), 10),), [(0,)], jit)
