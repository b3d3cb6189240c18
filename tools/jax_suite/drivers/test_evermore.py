"""evermore: binned likelihood fits differentiated by jax.grad with respect to the
parameters (flax nnx state), the templates and both, eagerly and under jit:
scale, symmetric and asymmetric log-normal and vertical-template-morphing modifiers
(parameters on both sides of 0 and exactly at 0, where the morphing's polynomial
meets its linear extrapolation at |x| = 1 too), continuous Poisson and normal
constraints, a bounded parameter. Statistical errors (``StatErrors``) are left
out: on flax 0.12.8 their modifier fails under jax.grad itself."""

from typing import NamedTuple

import evermore as evm
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

jax.config.update("jax_enable_x64", True)
HISTS = {
    "signal": jnp.array([3.0, 5.0, 2.0, 0.5]),
    "bkg": jnp.array([10.0, 8.0, 6.0, 4.0]),
    "up": jnp.array([11.0, 8.5, 6.6, 4.1]),
    "down": jnp.array([9.2, 7.7, 5.5, 3.8]),
}
OBS = jnp.array([15.0, 12.0, 9.0, 4.0])


class Params(NamedTuple):
    mu: evm.Parameter
    lnsym: evm.NormalParameter
    lnasym: evm.NormalParameter
    morph: evm.NormalParameter


def _params(syst):
    return Params(
        mu=evm.Parameter(1.2, lower=0.0, upper=10.0),
        lnsym=evm.NormalParameter(syst[0]),
        lnasym=evm.NormalParameter(syst[1]),
        morph=evm.NormalParameter(syst[2]),
    )


def _expectation(p, h):
    sig = p.mu.scale()(h["signal"])
    bkg = p.lnsym.scale_log_symmetric(1.2)(h["bkg"])
    bkg = p.lnasym.scale_log_asymmetric(up=1.1, down=0.85)(bkg)
    bkg = p.morph.morphing(up_template=h["up"], down_template=h["down"])(bkg)
    return sig + bkg


def _loss(dynamic, hists, graphdef, static):
    params = nnx.merge(graphdef, dynamic, static)
    lam = _expectation(params, hists)
    ll = evm.pdf.PoissonContinuous(lamb=lam).log_prob(OBS).sum()
    ll += evm.util.sum_over_leaves(evm.loss.get_log_probs(params))
    return -jnp.sum(ll)


SYSTS = {"inside": (0.3, -0.4, 0.5), "zero": (0.0, 0.0, 0.0), "edge": (1.0, -1.0, -1.0), "outside": (1.7, 2.1, -1.6)}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("syst", list(SYSTS))
def test_fit_gradient(syst, jit):
    graphdef, dynamic, static = nnx.split(_params(SYSTS[syst]), evm.filter.is_dynamic_parameter, ...)
    for argnums in [(0,), (1,), (0, 1)]:
        g = jax.grad(lambda d, h: _loss(d, h, graphdef, static), argnums)
        (jax.jit(g) if jit else g)(dynamic, HISTS)
