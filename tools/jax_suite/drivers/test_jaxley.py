"""Jaxley: biophysical neuron simulations (``jx.integrate``, a ``lax.scan`` over time
steps with a branched cable's voltage solve in each) differentiated by jax.grad with
respect to the trainable parameters (channel conductances, a radius), the injected
current (``data_stimulate``) and both, eagerly and under jit: Hodgkin-Huxley cells with
each ODE solver and both voltage solvers, multi-level checkpointing, a network of two
cells joined by an ionotropic synapse."""

import jax
import jax.numpy as jnp
import jaxley as jx
import pytest
from jaxley.channels import HH
from jaxley.connect import connect
from jaxley.synapses import IonotropicSynapse

jax.config.update("jax_enable_x64", True)
DT, T_MAX = 0.025, 2.5
CURRENT = jx.step_current(i_delay=0.25, i_dur=1.5, i_amp=0.3, delta_t=DT, t_max=T_MAX)


def _cell():
    cell = jx.Cell(jx.Branch(jx.Compartment(), ncomp=3), parents=[-1, 0, 0])
    cell.insert(HH())
    cell.branch(2).comp(2).record("v", verbose=False)
    cell.make_trainable("HH_gNa", verbose=False)
    cell.branch(1).make_trainable("radius", verbose=False)
    cell.branch(0).make_trainable("HH_gK", verbose=False)
    return cell


def _network():
    net = jx.Network([_cell(), _cell()])
    connect(net.cell(0).branch(0).comp(0), net.cell(1).branch(1).comp(1), IonotropicSynapse())
    net.make_trainable("IonotropicSynapse_gS", verbose=False)
    net.delete_recordings()
    net.cell(1).branch(2).comp(2).record("v", verbose=False)
    return net


def _grads(module, jit, **kwargs):
    params = module.get_parameters()
    stim_at = module.cell(0).branch(0).comp(0) if isinstance(module, jx.Network) else module.branch(0).comp(0)

    def loss(params, current):
        stimuli = stim_at.data_stimulate(current)
        v = jx.integrate(module, params=params, data_stimuli=stimuli, delta_t=DT, **kwargs)
        return jnp.mean(jnp.tanh((v + 55.0) / 20.0))

    for argnums in [(0,), (1,), (0, 1)]:
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(params, CURRENT)


SOLVERS = {
    "bwd_euler-dhs": {"solver": "bwd_euler", "voltage_solver": "jaxley.dhs"},
    "bwd_euler-sparse": {"solver": "bwd_euler", "voltage_solver": "jax.sparse"},
    "crank_nicolson": {"solver": "crank_nicolson"},
    "fwd_euler": {"solver": "fwd_euler"},
    "checkpointed": {"checkpoint_lengths": [10, 11]},
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("solver", list(SOLVERS))
def test_cell(solver, jit):
    _grads(_cell(), jit, **SOLVERS[solver])


@pytest.mark.parametrize("jit", [False, True])
def test_network(jit):
    _grads(_network(), jit)
