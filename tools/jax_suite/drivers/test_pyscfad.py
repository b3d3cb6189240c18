"""pyscfad: differentiable quantum chemistry (pyscf's integrals and methods on JAX),
differentiated by jax.grad eagerly and under jit.

Covers the molecular integrals (``Mole.intor``: overlap, kinetic, nuclear attraction,
position, 1/|r - R|, two-electron repulsion; pyscfad computes them with pyscf's C
library through ``jax.pure_callback`` under a ``custom_jvp`` whose rule calls the
integrals' derivatives the same way) and the nuclear repulsion energy, on H2 and LiH
(STO-3G) and water (6-31G), each with respect to what a ``Mole`` traces: the nuclear
coordinates alone, the basis exponents alone, the contraction coefficients alone, and
all three (the ``Mole`` is a pytree; ``build(trace_coords=..., trace_exp=...,
trace_ctr_coeff=...)`` picks its differentiable leaves). Also, eagerly only, a
Hartree-Fock energy and a libxc functional: rf refuses both by name (pyscfad's own
``eigh_gen`` primitive has no rf rule; pyscfad's libxc ``custom_jvp`` converts its
traced input to NumPy, which jax.grad accepts only eagerly and ``jax.jit`` refuses too).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pyscfad import gto, scf
from pyscfad.dft import libxc

jax.config.update("jax_enable_x64", True)

MOLECULES = {
    "h2": ("H 0 0 0; H 0 0 0.74", "sto3g"),
    "lih": ("Li 0 0 0; H 0 0.1 1.6", "sto3g"),
    "water": ("O 0 0 0; H 0 0.76 0.59; H 0 -0.76 0.59", "6-31g"),
}
TRACES = {
    "coords": dict(trace_coords=True, trace_exp=False, trace_ctr_coeff=False),
    "exp": dict(trace_coords=False, trace_exp=True, trace_ctr_coeff=False),
    "ctr_coeff": dict(trace_coords=False, trace_exp=False, trace_ctr_coeff=True),
    "all": dict(trace_coords=True, trace_exp=True, trace_ctr_coeff=True),
}


def _mole(name, trace):
    atom, basis = MOLECULES[name]
    mol = gto.Mole()
    mol.atom = atom
    mol.basis = basis
    mol.verbose = 0
    mol.build(**TRACES[trace])
    return mol


def _weights(shape):
    return jnp.asarray(np.random.default_rng(sum(shape)).uniform(0.5, 1.5, size=shape))


INTEGRALS = {
    "ovlp": lambda m: jnp.sum(_weights((m.nao, m.nao)) * m.intor("int1e_ovlp") ** 2),
    "kin": lambda m: jnp.sum(_weights((m.nao, m.nao)) * m.intor("int1e_kin")),
    "nuc": lambda m: jnp.sum(_weights((m.nao, m.nao)) * m.intor("int1e_nuc")),
    "r": lambda m: jnp.sum(_weights((3, m.nao, m.nao)) * m.intor("int1e_r")),
    "rinv": lambda m: jnp.sum(jnp.sin(m.intor("int1e_rinv"))),
    "eri": lambda m: jnp.sum(_weights((m.nao,) * 4) * m.intor("int2e") ** 2),
    "energy_nuc": lambda m: m.energy_nuc(),
}


# the nuclear repulsion reads the coordinates only: no basis leaf to differentiate
CASES = [
    (integral, trace)
    for integral in INTEGRALS
    for trace in TRACES
    if not (integral == "energy_nuc" and trace in ("exp", "ctr_coeff"))
]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("integral,trace", CASES)
@pytest.mark.parametrize("name", list(MOLECULES))
def test_integrals(name, integral, trace, jit):
    loss = INTEGRALS[integral]
    g = jax.grad(loss)
    (jax.jit(g) if jit else g)(_mole(name, trace))


# the two refusals (eager only: neither traces under jax.jit either)
def test_hartree_fock_energy():
    jax.grad(lambda m: scf.RHF(m).kernel())(_mole("h2", "coords"))


@pytest.mark.parametrize("xc", ["lda,vwn", "pbe"])
def test_libxc(xc):
    rho = jnp.asarray([[0.3, 0.5, 0.7], [0.1, -0.2, 0.3], [0.2, 0.1, -0.1], [0.05, 0.3, 0.2]])
    if xc == "lda,vwn":
        rho = rho[0]
    jax.grad(lambda r: jnp.sum(libxc.eval_xc(xc, r)[0] * (r[0] if r.ndim == 2 else r)))(rho)
