"""tensorcircuit-ng (module ``tensorcircuit``) on its jax backend in complex128:
parametrised circuits on three or four qubits differentiated by jax.grad, eagerly and
under jit. ``tc.Circuit`` with the single-qubit rotations (rx/ry/rz, r, u, phase),
the two-qubit rotations (rxx/ryy/rzz, exp1 with a fixed generator, exp, iswap and
cphase with an angle, crx/cry/crz), ``any`` with a traced ``expm`` generator,
``unitary`` with a traced gate, ``multicontrol`` (control on 1 and on 0), toffoli,
swap and cz, and the ``example_block``/``qft`` templates; losses: Pauli expectations
(``expectation_ps``), ``expectation`` with a traced complex Hermitian two-qubit
observable and traced single-qubit ones, ``templates.measurements.operator_expectation``
of a Pauli sum with traced coefficients, |amplitude|^2 (``amplitude``), basis
probabilities (``probability``), |state entry| (``state``, the kink of |z| at 0) and
``sample_expectation_ps`` without shots; ``tc.quantum`` entanglement entropies,
Renyi entropy, mutual information, trace distance, fidelity and negativity of reduced
states. ``tc.DMCircuit`` with depolarizing, amplitude damping, phase damping and
``general_kraus`` (a channel from ``tc.channels`` and one built from traced Kraus
operators) on a traced input density matrix. ``tc.MPSCircuit`` exactly and truncated
to bond dimension 2 (SVD inside). ``tc.backend.value_and_grad``/``grad`` and
``vectorized_value_and_grad`` (jax.value_and_grad under vmap). Each with respect to
the circuit parameters, the input state, the observable's coefficients and noise
strengths, alone and all together; at generic angles and at angles 0 and pi (gates
become the identity or a Pauli, amplitudes vanish, |z| at its kink), noise strengths
at 0 and at full damping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorcircuit as tc

jax.config.update("jax_enable_x64", True)
K = tc.set_backend("jax")
tc.set_dtype("complex128")

N = 3
XM, YM, ZM = (
    jnp.asarray(m, dtype=jnp.complex128) for m in (tc.gates._x_matrix, tc.gates._y_matrix, tc.gates._z_matrix)
)


def _rotations(c, th):
    c.h(0)
    c.rx(0, theta=th[0])
    c.ry(1, theta=th[1])
    c.rz(2, theta=th[2])
    c.r(1, theta=th[3], alpha=th[4], phi=th[5])
    c.u(2, theta=th[0], phi=th[1], lbd=th[2])
    c.phase(0, theta=th[3])
    c.cnot(0, 1)
    c.cnot(1, 2)


def _two_qubit(c, th):
    c.h(1)
    c.rxx(0, 1, theta=th[0])
    c.ryy(1, 2, theta=th[1])
    c.rzz(0, 2, theta=th[2])
    c.exp1(0, 1, unitary=tc.gates._zz_matrix, theta=th[3])
    c.exp(1, 2, unitary=tc.gates._xx_matrix, theta=th[4])
    c.iswap(0, 2, theta=th[5])
    c.cphase(1, 0, theta=th[0])
    c.crx(0, 1, theta=th[1])
    c.cry(1, 2, theta=th[2])
    c.crz(2, 0, theta=th[3])
    c.cz(0, 1)
    c.swap(1, 2)


def _general(c, th):
    c.h(0)
    c.ry(2, theta=th[5])
    gen = th[0] * jnp.kron(XM, YM) + th[1] * jnp.kron(ZM, ZM)
    c.any(0, 1, unitary=jax.scipy.linalg.expm(-1j * gen))
    c.unitary(2, unitary=tc.gates.ry(th[2]).tensor)
    c.multicontrol(0, 1, 2, ctrl=[1, 0], unitary=tc.gates.rx(th[3]))
    c.multicontrol(2, 0, ctrl=[1], unitary=tc.gates.ry(th[4]))
    c.toffoli(0, 2, 1)


def _templates(c, th):
    tc.templates.blocks.example_block(c, th.reshape(2, 3), nlayers=1)
    tc.templates.blocks.qft(c, 0, 1, 2)
    c.rx(1, theta=th[0])


CIRCUITS = {"rotations": _rotations, "two_qubit": _two_qubit, "general": _general, "templates": _templates}
ANGLES = {
    "generic": np.array([0.3, -0.7, 1.1, 0.45, 2.2, -1.6]),
    "zero": np.zeros(6),
    "pi": np.full(6, np.pi),
}
PSI_GENERIC = np.array([0.3 + 0.1j, -0.2 + 0.4j, 0.5, 0.1 - 0.3j, 0.2j, -0.4 + 0.1j, 0.25, 0.3 - 0.2j])
PSI_GENERIC = PSI_GENERIC / np.linalg.norm(PSI_GENERIC)
PSI_BASIS = np.eye(8, dtype=np.complex128)[0]  # |000>: at angles 0 and pi amplitudes vanish


def _point(point):
    psi = PSI_GENERIC if point == "generic" else PSI_BASIS
    return jnp.asarray(ANGLES[point]), jnp.asarray(psi)


def _run(argnums, jit, loss, *args):
    for a in argnums:
        g = jax.grad(loss, a)
        (jax.jit(g) if jit else g)(*args)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", list(ANGLES))
@pytest.mark.parametrize("circuit", list(CIRCUITS))
def test_statevector(circuit, point, jit):
    th, psi = _point(point)

    def loss(th, psi, coef):
        c = tc.Circuit(N, inputs=psi)
        CIRCUITS[circuit](c, th)
        e = coef[0] * K.real(c.expectation_ps(z=[0, 1])) + coef[1] * K.real(c.expectation_ps(x=[2], y=[0]))
        e = e + coef[2] * jnp.abs(c.amplitude("010")) ** 2 + coef[3] * c.probability()[3]
        e = e + jnp.abs(c.state()[5]) + jnp.abs(c.amplitude("111"))
        return e + 0.5 * K.real(c.sample_expectation_ps(y=[1], z=[2]))

    coef = jnp.array([1.0, -0.5, 0.7, 0.3])
    _run([(0,), (1,), (2,), (0, 1, 2)], jit, loss, th, psi, coef)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", list(ANGLES))
@pytest.mark.parametrize("circuit", ["two_qubit", "general"])
def test_traced_observables(circuit, point, jit):
    th, psi = _point(point)
    strings = [[3, 0, 0], [0, 1, 1], [1, 2, 3], [0, 0, 3]]
    paulis = [jnp.asarray(tc.quantum.PauliStringSum2Dense([s])) for s in strings]

    def loss(th, ob, w):
        c = tc.Circuit(N, inputs=psi)
        CIRCUITS[circuit](c, th)
        h2 = ob + ob.conj().T
        e = K.real(c.expectation((tc.gates.Gate(h2.reshape(2, 2, 2, 2)), [0, 2])))
        s1 = ob[:2, :2] + ob[:2, :2].conj().T
        e = e + K.real(c.expectation((tc.gates.Gate(s1), [1]), (tc.gates.Gate(ZM * w[0]), [2])))
        h = sum(w[i] * paulis[i] for i in range(len(strings)))  # traced Pauli-sum coefficients
        return e + K.real(tc.templates.measurements.operator_expectation(c, h))

    ob = jnp.asarray(np.arange(16.0).reshape(4, 4) * (0.1 + 0.05j) - 0.4)
    _run([(0,), (1,), (2,), (0, 1, 2)], jit, loss, th, ob, jnp.array([1.0, 0.5, -0.3, 0.8]))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", ["generic", "pi"])
def test_quantum_info(point, jit):
    """Entropies and distances of reduced states. At angle 0 on |000> every reduced
    state is pure and the entropies' eigenvalue derivatives are infinite (log 0), so
    that point is left out; at pi the rotations-circuit still entangles through cnots."""
    th, _ = _point(point)

    def loss(th, psi):
        c = tc.Circuit(N, inputs=psi / jnp.linalg.norm(psi))
        _rotations(c, th)
        c.ry(2, theta=0.4)
        s = c.state()
        rho01 = tc.quantum.reduced_density_matrix(s, cut=[2])
        rho0 = tc.quantum.reduced_density_matrix(s, cut=[1, 2])
        rho1 = tc.quantum.reduced_density_matrix(s, cut=[0, 2])
        out = tc.quantum.entanglement_entropy(s, [0]) + K.real(tc.quantum.renyi_entropy(rho01, 2))
        out = out + K.real(tc.quantum.mutual_information(s, [0]))
        out = out + K.real(tc.quantum.trace_distance(rho0, rho1)) + K.real(tc.quantum.fidelity(rho0, rho1))
        return out + K.real(tc.quantum.entanglement_negativity(rho01, [0]))

    _run([(0,), (1,), (0, 1)], jit, loss, th, jnp.asarray(PSI_GENERIC))


NOISE = {  # depolarizing px, py, pz; amplitude damping gamma; phase damping gamma; kraus p
    "generic": np.array([0.1, 0.05, 0.02, 0.3, 0.2, 0.25]),
    "noiseless": np.zeros(6),  # sqrt(gamma) of the Kraus operators at 0
    "full_damping": np.array([0.1, 0.05, 0.02, 1.0, 1.0, 1.0]),  # sqrt(1 - gamma) at 0
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("noise", list(NOISE))
def test_dmcircuit(noise, jit):
    th = jnp.asarray(ANGLES["generic"])

    def loss(th, p, m):
        rho_in = m @ m.conj().T
        rho_in = rho_in / jnp.trace(rho_in)
        c = tc.DMCircuit(N, dminputs=rho_in)
        _rotations(c, th)
        c.depolarizing(0, px=p[0], py=p[1], pz=p[2])
        c.amplitudedamping(1, gamma=p[3], p=1.0)
        c.phasedamping(2, gamma=p[4])
        c.general_kraus(tc.channels.amplitudedampingchannel(p[5], 0.5), 0)
        k0 = jnp.sqrt(1.0 - p[5]) * jnp.eye(2, dtype=jnp.complex128)
        c.general_kraus([tc.gates.Gate(k0), tc.gates.Gate(jnp.sqrt(p[5]) * XM)], 1)
        c.rzz(0, 2, theta=th[2])
        rho = c.state()
        e = K.real(c.expectation_ps(z=[0]) + c.expectation_ps(x=[1], z=[2]))
        e = e + K.real(c.expectation((tc.gates.Gate(YM), [2])))
        return e + K.real(jnp.trace(rho @ rho)) + c.probability()[6]

    m = jnp.asarray(np.arange(64.0).reshape(8, 8) % 7 * (0.2 - 0.1j) + np.eye(8))
    _run([(0,), (1,), (2,), (0, 1, 2)], jit, loss, th, jnp.asarray(NOISE[noise]), m)


# truncation to bond dimension 2 (an SVD per two-qubit gate) compiles for over a minute
# at the edge angles on two cores: it runs at the generic angles only
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("split_point", ["exact-generic", "exact-zero", "exact-pi", "bond2-generic"])
def test_mpscircuit(split_point, jit):
    split, point = split_point.split("-")
    th, _ = _point(point)

    def loss(th, w):
        c = tc.MPSCircuit(4)
        if split == "bond2":
            c.set_split_rules({"max_singular_values": 2})
        for i in range(4):
            c.ry(i, theta=th[i])
        for i in range(3):
            c.cnot(i, i + 1)
            c.rx(i + 1, theta=th[i + 1])
        c.rxx(0, 1, theta=th[4])
        c.exp1(1, 2, unitary=tc.gates._zz_matrix, theta=th[5])
        c.rzz(2, 3, theta=th[0])
        c.cnot(0, 3)  # long-range: swaps inside the MPS
        e = K.real(c.expectation((tc.gates.Gate(w[0] * ZM), [0]), (tc.gates.Gate(ZM), [3])))
        return e + w[1] * K.real(c.expectation_ps(x=[1], y=[2])) + jnp.abs(c.amplitude("0110")) ** 2

    _run([(0,), (1,), (0, 1)], jit, loss, th, jnp.array([0.8, -0.6]))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", ["generic", "zero"])
def test_backend_gradients(point, jit):
    """tc.backend.value_and_grad/grad (jax.value_and_grad/jax.grad underneath) and
    vectorized_value_and_grad: jax.value_and_grad under vmap over a batch of angles,
    the non-batched argument's gradient summed over the batch."""
    th, _ = _point(point)

    def energy(th, w):
        c = tc.Circuit(N)
        _two_qubit(c, th)
        return w * K.real(c.expectation_ps(z=[1])) + K.real(c.expectation_ps(x=[0]))

    batch = jnp.stack([th, th + 0.25, -th])
    fns = [
        (K.value_and_grad(energy, argnums=(0, 1)), (th, 0.7)),
        (K.grad(energy, argnums=1), (th, 0.7)),
        (K.vectorized_value_and_grad(energy, argnums=0), (batch, 0.7)),
        (K.vectorized_value_and_grad(energy, argnums=1), (batch, 0.7)),
        (K.vectorized_value_and_grad(energy, argnums=(0, 1)), (batch, 0.7)),
    ]
    for f, args in fns:
        (jax.jit(f) if jit else f)(*args)
