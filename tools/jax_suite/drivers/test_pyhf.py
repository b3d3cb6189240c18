"""pyhf with its jax backend: the log-likelihoods of HistFactory models
differentiated by jax.grad with respect to the parameters, the observed data and
both, eagerly and under jit: uncorrelated and correlated background
uncertainties (shapesys, histosys with its piecewise-polynomial interpolation,
normsys), a luminosity and a staterror modifier; parameters inside, at and outside
the interpolation's ±1 kinks."""

import jax
import jax.numpy as jnp
import pyhf
import pytest

jax.config.update("jax_enable_x64", True)
pyhf.set_backend("jax")

SPEC = {
    "channels": [
        {
            "name": "sr",
            "samples": [
                {
                    "name": "signal",
                    "data": [5.0, 10.0, 3.0],
                    "modifiers": [
                        {"name": "mu", "type": "normfactor", "data": None},
                        {"name": "lumi", "type": "lumi", "data": None},
                    ],
                },
                {
                    "name": "bkg",
                    "data": [50.0, 60.0, 20.0],
                    "modifiers": [
                        {
                            "name": "hsys",
                            "type": "histosys",
                            "data": {"hi_data": [54.0, 65.0, 21.0], "lo_data": [47.0, 56.0, 18.5]},
                        },
                        {"name": "nsys", "type": "normsys", "data": {"hi": 1.1, "lo": 0.92}},
                        {"name": "stat", "type": "staterror", "data": [2.0, 3.0, 1.5]},
                        {"name": "shape", "type": "shapesys", "data": [5.0, 7.0, 3.0]},
                    ],
                },
            ],
        }
    ],
    "parameters": [{"name": "lumi", "auxdata": [1.0], "sigmas": [0.02], "bounds": [[0.5, 1.5]], "inits": [1.0]}],
}
MODELS = {
    "uncorrelated": pyhf.simplemodels.uncorrelated_background(
        signal=[5.0, 10.0], bkg=[50.0, 60.0], bkg_uncertainty=[5.0, 12.0]
    ),
    "correlated": pyhf.simplemodels.correlated_background(
        signal=[12.0, 11.0], bkg=[50.0, 52.0], bkg_up=[45.0, 57.0], bkg_down=[55.0, 47.0]
    ),
    "full": pyhf.Model(SPEC),
}
DATA = {"uncorrelated": [62.0, 63.0], "correlated": [51.0, 48.0], "full": [60.0, 72.0, 24.0]}


def _pars(model, shift):
    init = jnp.asarray(model.config.suggested_init(), jnp.float64)
    names = model.config.par_order
    out = init
    for name in names:  # the nuisance parameters whose interpolation has kinks at 0 and ±1
        if name in ("hsys", "nsys", "correlated_bkg_uncertainty"):
            out = out.at[model.config.par_slice(name)].set(shift)
    return out.at[model.config.par_slice(names[0])].add(0.3)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("shift", [0.4, 0.0, 1.0, -1.0, -1.7])
@pytest.mark.parametrize("name", list(MODELS))
def test_logpdf(name, shift, jit):
    model = MODELS[name]
    data = jnp.concatenate([jnp.asarray(DATA[name], jnp.float64), jnp.asarray(model.config.auxdata, jnp.float64)])
    pars = _pars(model, shift)
    for argnums in [(0,), (1,), (0, 1)]:
        g = jax.grad(lambda p, d: model.logpdf(p, d)[0], argnums)
        (jax.jit(g) if jit else g)(pars, data)
