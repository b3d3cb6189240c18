"""qujax: parametrised quantum circuits on complex statevectors and density matrices,
differentiated by jax.grad, eagerly and under jit. Statetensor circuits with every
parametrised gate in ``qujax.gates`` (rotations, controlled rotations, U1/U2/U3 and
their controlled forms, (Phased)ISWAP, XX/YY/ZZ phases, PhasedX), the fixed gates
(H, CX, CZ, CCX, ECR, SWAP, CSWAP, S, T, V, SX, ZZMax), a custom gate function, a
custom unitary array and a parameter shared by two gates; losses: Hamiltonian
expectation values (``get_statetensor_to_expectation_func``, Pauli strings and a traced
Hermitian matrix through ``statetensor_to_single_expectation``), basis-state
probabilities |amplitude|^2, the moduli |amplitude| (the kink of |z| at 0), the phase
of an amplitude, fidelities with a target state, gate fidelities of the circuit's
unitary (``get_params_to_unitarytensor_func``), ``apply_gate`` with a traced complex
gate, ``repeat_circuit`` (a scan over layers) and the importance-sampled expectation
at a fixed key. Density tensors: ``get_params_to_densitytensor_func`` with unitary
gates, a parametrised Kraus channel and a fixed depolarising channel, ``kraus`` with
traced complex Kraus operators, expectation values, measurement probabilities,
``partial_trace`` purity, the post-measurement state, the sampled expectation and
``statetensor_to_densitytensor``. Each with respect to the circuit parameters, the
complex input state, the observable's coefficients (or operator) and all together; at
generic angles and at angles 0 (gates become the identity, amplitudes of |000> vanish
elsewhere), 1 (rotations by pi: amplitudes vanish, |amplitude| at its kink) and 0.5."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qujax

jax.config.update("jax_enable_x64", True)

# circuits on three qubits: (gate, qubits, parameter indices)
CIRCUITS = {
    "single": [
        ("H", [0], []),
        ("Rx", [0], [0]),
        ("Ry", [1], [1]),
        ("Rz", [2], [2]),
        ("U1", [0], [3]),
        ("U2", [1], [4, 5]),
        ("U3", [2], [6, 7, 8]),
        ("PhasedX", [0], [9, 10]),
        ("Rx", [2], [1]),  # parameter 1 shared with the Ry above
        ("S", [1], []),
        ("T", [2], []),
        ("V", [0], []),
        ("SX", [1], []),
    ],
    "controlled": [
        ("Ry", [0], [0]),
        ("H", [1], []),
        ("CRx", [0, 1], [1]),
        ("CRy", [1, 2], [2]),
        ("CRz", [0, 2], [3]),
        ("CU1", [2, 0], [4]),
        ("CU2", [0, 1], [5, 6]),
        ("CU3", [1, 2], [7, 8, 0]),
        ("CX", [0, 2], []),
        ("CZ", [1, 0], []),
        ("CCX", [0, 1, 2], []),
    ],
    "two_qubit": [
        ("Rx", [0], [0]),
        ("Ry", [1], [1]),
        ("ISWAP", [0, 1], [2]),
        ("PhasedISWAP", [1, 2], [3, 4]),
        ("XXPhase", [0, 2], [5]),
        ("YYPhase", [0, 1], [6]),
        ("ZZPhase", [1, 2], [7]),
        ("ECR", [0, 1], []),
        ("SWAP", [1, 2], []),
        ("CSWAP", [2, 0, 1], []),
        ("ZZMax", [0, 2], []),
    ],
    "custom": [
        ("H", [0], []),
        (lambda a, b: qujax.gates.U3(a, b, 0.3) @ qujax.gates.Rz(a * b), [1], [0, 1]),
        (np.kron(np.array(qujax.gates.H), np.array(qujax.gates.S)), [2, 0], []),
        (lambda a: jnp.kron(qujax.gates.Rx(a), qujax.gates.Ry(2 * a)), [0, 1], [2]),
        ("CX", [1, 2], []),
    ],
}
N_PARAMS = {"single": 11, "controlled": 9, "two_qubit": 8, "custom": 3}
POINTS = ["generic", "zero", "one"]  # "half" (0.5) in the smaller tests below
POINTS_ALL = POINTS + ["half"]


def _params(circuit, point):
    n = N_PARAMS[circuit]
    if point == "generic":
        return jnp.asarray(np.random.default_rng(1).uniform(-1.7, 1.7, n))
    return jnp.full(n, {"zero": 0.0, "one": 1.0, "half": 0.5}[point])


def _state(point, n_qubits=3):
    """A generic normalised complex state, or |0...0> at the edge points (where with
    angle-0 gates most amplitudes are exactly 0)."""
    if point != "generic":
        return qujax.all_zeros_statetensor(n_qubits)
    rng = np.random.default_rng(2)
    v = rng.normal(size=2**n_qubits) + 1j * rng.normal(size=2**n_qubits)
    return jnp.asarray((v / np.linalg.norm(v)).reshape((2,) * n_qubits))


def _build(circuit, unitary=False):
    gates, qubits, pinds = zip(*CIRCUITS[circuit])
    make = qujax.get_params_to_unitarytensor_func if unitary else qujax.get_params_to_statetensor_func
    return make(list(gates), list(qubits), list(pinds), 3)


# (no three-qubit Pauli string: qujax reshapes their 8x8 product by int(log2(64)) = 5)
HAMILTONIAN = ([["Z"], ["X", "X"], ["Y", "Z"], ["X", "Y"]], [[0], [0, 1], [1, 2], [2, 0]])
TARGET = _state("generic")[::-1]


# observables are built once, outside any trace (qujax reshapes them by
# int(jnp.log2(size)), which fails on a tracer under jit); one function per term, so
# the traced coefficients weight them, and the whole Hamiltonian with fixed ones
TERMS = [qujax.get_statetensor_to_expectation_func([h], [q], [1.0]) for h, q in zip(*HAMILTONIAN)]
FULL = qujax.get_statetensor_to_expectation_func(*HAMILTONIAN, [0.5, -0.25, 1.5, 0.75])


def _loss_expectation(st, coeffs):
    return sum(c * term(st) for c, term in zip(coeffs, TERMS)) + FULL(st)


def _loss_probability(st, coeffs):
    probs = jnp.abs(st) ** 2
    return (
        coeffs[0] * probs[0, 0, 0]
        + coeffs[1] * probs[1, 0, 1]
        + coeffs[2] * probs[0, 1, 1]
        + coeffs[3] * probs[1, 1, 1]
    )


def _loss_modulus(st, coeffs):
    return jnp.sum(jnp.abs(st).ravel()[:4] * coeffs) + jnp.sum(jnp.abs(st))


def _loss_fidelity(st, coeffs):
    return coeffs[0] * jnp.abs(jnp.vdot(TARGET, st)) ** 2 + coeffs[1] * jnp.abs(jnp.vdot(st, st))


def _loss_phase(st, coeffs):  # generic points only: the phase of a vanishing amplitude is undefined
    return coeffs[0] * jnp.angle(st[0, 0, 0]) + coeffs[1] * jnp.angle(st[1, 1, 0])


LOSSES = {
    "expectation": _loss_expectation,
    "probability": _loss_probability,
    "modulus": _loss_modulus,
    "fidelity": _loss_fidelity,
    "phase": _loss_phase,
}
COEFFS = jnp.array([0.7, -1.3, 0.4, 2.1])


def _run(loss, args, argnums_list, jit):
    for argnums in argnums_list:
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*args)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("circuit", list(CIRCUITS))
def test_statetensor(circuit, loss, point, jit):
    if loss == "phase" and point != "generic":
        return  # the angle of a vanishing amplitude has no derivative (not a test of rf)
    f = _build(circuit)

    def objective(params, st_in, coeffs):
        return LOSSES[loss](f(params, st_in), coeffs)

    args = (_params(circuit, point), _state(point), COEFFS)
    _run(objective, args, [(0,), (1,), (2,), (0, 1, 2)], jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", POINTS_ALL)
@pytest.mark.parametrize("circuit", ["single", "two_qubit"])
def test_default_input_and_hermitian(circuit, point, jit):
    """The circuit from |000> (no input state), observed with a traced Hermitian
    matrix on two qubits through ``statetensor_to_single_expectation``."""
    f = _build(circuit)
    rng = np.random.default_rng(3)
    a = rng.normal(size=(4, 4)) + 1j * rng.normal(size=(4, 4))
    herm = jnp.asarray((a + a.conj().T).reshape(2, 2, 2, 2))

    def objective(params, hermitian):
        st = f(params)
        return qujax.statetensor_to_single_expectation(st, hermitian, [2, 0]) + jnp.abs(st[0, 0, 0])

    _run(objective, (_params(circuit, point), herm), [(0,), (1,), (0, 1)], jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", POINTS_ALL)
@pytest.mark.parametrize("circuit", ["controlled", "custom"])
def test_unitarytensor(circuit, point, jit):
    """Gate fidelity |Tr(V^dagger U)|^2 / d^2 of the circuit's unitary against a target."""
    u = _build(circuit, unitary=True)
    target = u(_params(circuit, "generic") * 0.7).reshape(8, 8)

    def objective(params, target):
        m = u(params).reshape(8, 8)
        return jnp.abs(jnp.trace(target.conj().T @ m)) ** 2 / 64 + jnp.abs(m[0, 7])

    _run(objective, (_params(circuit, point), target), [(0,), (1,), (0, 1)], jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", ["generic", "zero", "one"])
def test_apply_gate(point, jit):
    """``apply_gate`` with a traced complex gate (a generic unitary, the identity, X)."""
    rng = np.random.default_rng(4)
    if point == "generic":
        q, _ = np.linalg.qr(rng.normal(size=(4, 4)) + 1j * rng.normal(size=(4, 4)))
    elif point == "zero":
        q = np.eye(4, dtype=complex)
    else:
        q = np.kron(np.array(qujax.gates.X), np.array(qujax.gates.X)).astype(complex)
    gate = jnp.asarray(q.reshape(2, 2, 2, 2))

    def objective(gate, st_in):
        st = qujax.apply_gate(st_in, gate, [1, 2])
        st = qujax.apply_gate(st, qujax.gates.CX, [0, 2])
        return jnp.sum(jnp.abs(st[1]) ** 2) + jnp.abs(st[0, 0, 0]) + _loss_expectation(st, COEFFS)

    _run(objective, (gate, _state(point)), [(0,), (1,), (0, 1)], jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", POINTS_ALL)
def test_repeat_circuit(point, jit):
    """``repeat_circuit``: a layer of Rx, Ry, CZ and ZZPhase applied three times by a scan."""
    layer = qujax.get_params_to_statetensor_func(
        ["Rx", "Ry", "CZ", "ZZPhase", "Rz"], [[0], [1], [0, 1], [1, 2], [2]], [[0], [1], [], [2], [0]], 3
    )
    repeated = qujax.repeat_circuit(layer, 3)
    params = jnp.concatenate([_params("controlled", point)])  # 9 = 3 layers x 3

    def objective(params, st_in):
        st = repeated(params, st_in)
        return _loss_expectation(st, COEFFS) + _loss_probability(st, COEFFS)

    _run(objective, (params, _state(point)), [(0,), (1,), (0, 1)], jit)


@pytest.mark.parametrize("jit", [False, True])
def test_sampled_expectation(jit):
    """Importance-sampled expectation at a fixed key, generic angles (every basis state
    sampled: an unsampled one gives sqrt(0 / p) and a nan gradient)."""
    f = qujax.get_params_to_statetensor_func(["Ry", "Rx", "CX", "Rz"], [[0], [1], [0, 1], [1]], [[0], [1], [], [2]], 2)
    sampled = qujax.get_statetensor_to_sampled_expectation_func([["Z"], ["Z", "Z"]], [[0], [0, 1]], [0.8, -0.6])
    key = jax.random.PRNGKey(0)

    def objective(params, st_in):
        return sampled(f(params, st_in), key, 200)

    params = jnp.array([0.6, -0.45, 0.3])
    _run(objective, (params, _state("generic", 2)), [(0,), (1,), (0, 1)], jit)


# density tensors on two qubits: Kraus operators as functions of the parameters
def _flip_k0(t):
    return jnp.cos(t * jnp.pi / 2) * qujax.gates.I


def _flip_k1(t):
    return jnp.sin(t * jnp.pi / 2) * qujax.gates.X


_P_DEP = 0.1
DEPOLARISING = [np.sqrt(1 - 3 * _P_DEP / 4) * np.eye(2)] + [
    np.sqrt(_P_DEP / 4) * np.array(qujax.gates.__dict__[p]) for p in ("X", "Y", "Z")
]


def _dt_func():
    return qujax.get_params_to_densitytensor_func(
        ["Rx", [_flip_k0, _flip_k1], "ZZPhase", DEPOLARISING, "CRz"],
        [[1], [0], [0, 1], [1], [1, 0]],
        [[0], [[1], [1]], [2], [[]] * 4, [3]],
        2,
    )


def _dt_in(point):
    if point != "generic":
        return qujax.all_zeros_densitytensor(2)
    return qujax.statetensor_to_densitytensor(_state("generic", 2))


DT_TERMS = [
    qujax.get_densitytensor_to_expectation_func([h], [q], [1.0])
    for h, q in zip([["Z"], ["X", "Y"], ["Z", "Z"]], [[0], [0, 1], [0, 1]])
]
DT_MEASURED = qujax.get_densitytensor_to_expectation_func([["X"], ["Z"]], [[1], [0]], [0.6, -1.1])


def _dt_expectation(dt, c):
    return sum(ci * term(dt) for ci, term in zip(c, DT_TERMS))


def _dt_probabilities_purity(dt, c):
    return (
        jnp.sum(qujax.densitytensor_to_measurement_probabilities(dt, [1]) * c[:2])
        + jnp.sum(qujax.densitytensor_to_measurement_probabilities(dt, [0, 1]) * c)
        + c[0] * jnp.real(jnp.trace(jnp.linalg.matrix_power(qujax.partial_trace(dt, [1]), 2)))
        + c[1] * jnp.real(jnp.trace(dt.reshape(4, 4) @ dt.reshape(4, 4)))
    )


def _dt_measured(dt, c):
    """The post-measurement state (outcome 1 of qubit 0; bitstring [0] of qubit 1)."""
    return c[0] * DT_MEASURED(qujax.densitytensor_to_measured_densitytensor(dt, [0], 1)) + c[2] * jnp.abs(
        qujax.densitytensor_to_measured_densitytensor(dt, [1], jnp.array([0]))[0, 1, 0, 1]
    )


DT_LOSSES = {
    "expectation": _dt_expectation,
    "probabilities_purity": _dt_probabilities_purity,
    "measured": _dt_measured,
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("loss", list(DT_LOSSES))
def test_densitytensor(loss, point, jit):
    f = _dt_func()

    def objective(params, dt_in, coeffs):
        return DT_LOSSES[loss](f(params, dt_in), coeffs)

    args = (_params("two_qubit", point)[:4], _dt_in(point), COEFFS)
    _run(objective, args, [(0,), (1,), (2,), (0, 1, 2)], jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", POINTS)
def test_statetensor_to_densitytensor(point, jit):
    """A pure state's density tensor through the parametrised channel and back to
    the statetensor circuit's observable."""
    f = qujax.get_params_to_statetensor_func(["Ry", "CX", "Rz"], [[0], [0, 1], [1]], [[0], [], [1]], 2)
    g = _dt_func()

    def objective(params, st_in):
        dt = qujax.statetensor_to_densitytensor(f(params[:2], st_in))
        dt = g(params, dt)
        return DT_LOSSES["expectation"](dt, COEFFS) + DT_LOSSES["probabilities_purity"](dt, COEFFS)

    _run(objective, (_params("two_qubit", point)[:4], _state(point, 2)), [(0,), (1,), (0, 1)], jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", ["generic", "zero", "one"])
def test_kraus(point, jit):
    """``kraus`` with traced complex Kraus operators (amplitude damping with gamma
    0.3, 0 (K1 = 0: the identity channel) and 1 (K0 a projector))."""
    gamma = {"generic": 0.3, "zero": 0.0, "one": 1.0}[point]
    ops = jnp.asarray([[[1.0, 0.0], [0.0, np.sqrt(1 - gamma)]], [[0.0, np.sqrt(gamma)], [0.0, 0.0]]], dtype=complex)

    def objective(ops, dt_in):
        dt = qujax.kraus(dt_in, ops, [1])
        dt = qujax.kraus(dt, ops[0], [0])  # a single operator (not trace preserving)
        return DT_LOSSES["expectation"](dt, COEFFS) + DT_LOSSES["probabilities_purity"](dt, COEFFS)

    _run(objective, (ops, qujax.statetensor_to_densitytensor(_state("generic", 2))), [(0,), (1,), (0, 1)], jit)


@pytest.mark.parametrize("jit", [False, True])
def test_densitytensor_sampled_expectation(jit):
    f = _dt_func()
    sampled = qujax.get_densitytensor_to_sampled_expectation_func([["Z"], ["Z", "Z"]], [[1], [0, 1]], [0.8, -0.6])
    key = jax.random.PRNGKey(1)

    def objective(params, dt_in):
        return sampled(f(params, dt_in), key, 200)

    _run(objective, (_params("two_qubit", "generic")[:4], _dt_in("generic")), [(0,), (1,), (0, 1)], jit)
