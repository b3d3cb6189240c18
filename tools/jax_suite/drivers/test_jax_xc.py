"""jax_xc: Libxc's exchange-correlation functionals in JAX (LDA, GGA, meta-GGA and their
hybrids' semilocal parts, generated from Libxc's Maple code), each unpolarized,
polarized and fully spin-polarized (the second spin channel's density exactly 0); the
energy ``sum_r rho(r) eps_xc(rho, r)`` of a Gaussian density (meta-GGAs: two
Gaussian orbitals) on six grid points, two of them far in the tail where the density
underflows to exactly 0 (each functional's density thresholds), differentiated by
jax.grad with respect to the density's amplitude, width and centre under jit (the
gradient of the density a GGA reads is ``jax.jacfwd`` inside the functional).

jax_xc 0.0.11 imports ``autofd`` for its experimental functional-derivative API, and
autofd 0.0.9 fails to import under jax 0.10 (``jax.core.raise_to_shaped_mappings``):
the driver stands empty modules in for it, which the functionals do not use."""

import sys
import types

for _m in ("autofd", "autofd.operators"):
    sys.modules.setdefault(_m, types.ModuleType(_m))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax_xc  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", True)

# left out: the range-separated functionals built on an erfc-screened exchange
# (wPBEh, HSE, HJS, LC-wPBE, CAM, wB97): polarized gga_x_wpbeh and hyb_gga_xc_hse06
# had not finished compiling after ten minutes on two cores. 30 more fail inside
# jax_xc 0.0.11 before any gradient (its generated code names functions it does not
# define: br89_x, int1, mbrxc_x, fd_int0, my_dilog, xbspline; am05 and the prhg07 pair
# need tensorflow_probability's JAX substrate; the M06 correlations refuse a
# polarized density of this shape): those tests fail on jax's side
_LEFT_OUT = ("wpbeh", "hse", "hjs", "lc_wpbe", "lrc_wpbe", "wb97", "camy", "cam_")
NAMES = sorted(
    n for n in dir(jax_xc) if n.split("_")[0] in ("lda", "gga", "mgga", "hyb") and not any(h in n for h in _LEFT_OUT)
)
_RNG = np.random.default_rng(0)
# four points near the density's centre, two where it underflows to 0
R = jnp.asarray(np.concatenate([_RNG.normal(size=(4, 3)), [[40.0, 0.0, 0.0], [0.0, 30.0, 0.0]]]))
PARAMS = (jnp.array(1.3), jnp.array(0.7), jnp.array([0.1, -0.2, 0.3]))
SPINS = {"unpolarized": (False, 0.6), "polarized": (True, 0.6), "one_spin": (True, 0.0)}


def _energy(name, polarized, second):
    fn = getattr(jax_xc, name)(polarized=polarized)
    meta = name.startswith(("mgga", "hyb_mgga"))

    def energy(params):
        c, a, centre = params

        def rho(r):
            v = c * jnp.exp(-a * jnp.sum((r - centre) ** 2))
            return jnp.stack([v, second * v]) if polarized else v

        def mo(r):
            v = jnp.sqrt(c) * jnp.exp(-0.5 * a * jnp.sum((r - centre) ** 2))
            o = jnp.stack([v, v * (r[0] - centre[0])])
            return jnp.stack([o, second * o]) if polarized else o

        eps = jax.vmap(lambda r: fn(rho, r, mo=mo) if meta else fn(rho, r))(R)
        return jnp.sum(eps * jax.vmap(lambda r: jnp.sum(rho(r)))(R))

    return energy


@pytest.mark.parametrize("spin", list(SPINS))
@pytest.mark.parametrize("name", NAMES)
def test_functional(name, spin):
    polarized, second = SPINS[spin]
    jax.jit(jax.grad(_energy(name, polarized, second)))(PARAMS)
