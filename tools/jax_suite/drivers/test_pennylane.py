"""PennyLane on its JAX interface (``default.qubit`` and ``default.mixed``), float64 /
complex128: QNodes differentiated by jax.grad, eagerly and under jit, with the
backprop, parameter-shift and adjoint differentiation methods (the latter two run
through PennyLane's ``custom_jvp`` and, when traced, ``pure_callback``).

Covered: the single-qubit rotations (RX/RY/RZ, Rot, PhaseShift, U1/U2/U3, with
Hadamard/S/T/SX around them), controlled gates (CNOT, CZ, CY, CRX/CRY/CRZ, CRot,
ControlledPhaseShift, Toffoli, CSWAP), two- and many-qubit rotations (IsingXX/YY/ZZ/XY,
MultiRZ, PauliRot, SingleExcitation(+/-), DoubleExcitation, OrbitalRotation, PSWAP),
``qml.adjoint``/``qml.ctrl`` of rotations, ``GlobalPhase`` and a traced
``QubitUnitary`` (expm of a traced Hermitian); the measurements expval of several
observables (tensor products, a traced Hermitian, a Hamiltonian with traced
coefficients via ``qml.dot``), var, probs (all wires and a subset), state
(fidelity with a target, |amplitude| at its kink), density_matrix, purity,
vn_entropy and mutual_info; the templates AngleEmbedding (X/Y/Z),
AmplitudeEmbedding (normalised, padded), IQPEmbedding, QAOAEmbedding,
BasicEntanglerLayers, StronglyEntanglingLayers (ranges, CZ imprimitive),
SimplifiedTwoDesign and RandomLayers; ``default.mixed`` with depolarising,
amplitude/phase damping and bit-flip channels whose strengths are traced (at 0, at
full strength and generic); ``qml.matrix`` of a circuit; and the ``qml.math`` helpers
(fidelity, trace distance, relative entropy, purity, von Neumann entropy,
reduce_dm, partial_trace, fidelity_statevector) on traced density matrices. Each
loss with respect to the gate parameters, the input features, the classical
weights/coefficients/noise strengths, each alone and all together; at generic
angles and at 0 and pi (gates become the identity or a Pauli, expectations are
extremal, amplitudes vanish, states are pure so entropies sit on log 0)."""

import jax
import jax.numpy as jnp
import numpy as np
import pennylane as qml
import pytest

jax.config.update("jax_enable_x64", True)

JITS = [False, True]
POINTS = {"generic": 0.37, "zero": 0.0, "pi": np.pi}


def _angles(point, n, seed=0):
    """n angles: generic ones, all zero, or all pi."""
    if point == "generic":
        return jnp.asarray(np.random.default_rng(seed).uniform(-2.0, 2.0, n))
    return jnp.full((n,), POINTS[point])


def _grads(loss, args, jit, nargs=None):
    nargs = len(args) if nargs is None else nargs
    argsets = [(i,) for i in range(nargs)] + ([tuple(range(nargs))] if nargs > 1 else [])
    for argnums in argsets:
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*args)


# --------------------------------------------------------------------- gate sets
def _single(w, x):
    for i in range(3):
        qml.RY(x[i], i)
    qml.RX(w[0], 0)
    qml.RY(w[1], 1)
    qml.RZ(w[2], 2)
    qml.Hadamard(2)
    qml.Rot(w[3], w[4], w[5], 0)
    qml.PhaseShift(w[6], 1)
    qml.S(1)
    qml.U1(w[7], 2)
    qml.U2(w[8], w[9], 1)
    qml.T(0)
    qml.U3(w[10], w[11], w[0], 2)
    qml.SX(0)
    qml.CNOT([0, 1])
    qml.CNOT([1, 2])


def _controlled(w, x):
    for i in range(3):
        qml.RX(x[i], i)
    qml.Hadamard(0)
    qml.CRX(w[0], [0, 1])
    qml.CRY(w[1], [1, 2])
    qml.CRZ(w[2], [2, 0])
    qml.CRot(w[3], w[4], w[5], [0, 2])
    qml.ControlledPhaseShift(w[6], [1, 0])
    qml.CY([0, 2])
    qml.CZ([1, 2])
    qml.Toffoli([0, 1, 2])
    qml.CSWAP([2, 0, 1])
    qml.RY(w[7], 1)


def _ising(w, x):
    for i in range(3):
        qml.RY(x[i], i)
    qml.Hadamard(1)
    qml.IsingXX(w[0], [0, 1])
    qml.IsingYY(w[1], [1, 2])
    qml.IsingZZ(w[2], [0, 2])
    qml.IsingXY(w[3], [0, 1])
    qml.MultiRZ(w[4], [0, 1, 2])
    qml.PauliRot(w[5], "XYZ", [0, 1, 2])
    qml.SingleExcitation(w[6], [1, 2])
    qml.SingleExcitationPlus(w[7], [0, 1])
    qml.SingleExcitationMinus(w[8], [0, 2])
    qml.PSWAP(w[9], [1, 2])


def _chemistry(w, x):  # four wires
    qml.BasisState(np.array([1, 1, 0, 0]), wires=range(4))
    for i in range(3):
        qml.RY(x[i], i)
    qml.DoubleExcitation(w[0], [0, 1, 2, 3])
    qml.OrbitalRotation(w[1], [0, 1, 2, 3])
    qml.SingleExcitation(w[2], [1, 3])
    qml.FermionicSWAP(w[3], [2, 3])


def _structural(w, x):
    for i in range(3):
        qml.RX(x[i], i)
    qml.adjoint(qml.RX)(w[0], 0)
    qml.ctrl(qml.RY, control=0)(w[1], 1)
    qml.ctrl(qml.RZ, control=[1, 2], control_values=[1, 0])(w[2], 0)
    qml.adjoint(qml.IsingZZ(w[3], [1, 2]))
    qml.GlobalPhase(w[4])
    qml.CNOT([2, 0])


GATES = {
    "single": (_single, 3, 12),
    "controlled": (_controlled, 3, 8),
    "ising": (_ising, 3, 10),
    "chemistry": (_chemistry, 4, 4),
    "structural": (_structural, 3, 5),
}
# Adjoint differentiation needs every parametrised op to have a generator, or
# decomposes it; all of these work with it.
METHODS = ["backprop", "parameter-shift", "adjoint"]


# backprop at every point; parameter-shift at a generic point and at zero; adjoint at a
# generic point (kept small for time).
GATE_CASES = [(g, p, "backprop") for g in GATES for p in POINTS]
GATE_CASES += [(g, p, "parameter-shift") for g in GATES for p in ("generic", "zero")]
GATE_CASES += [(g, "generic", "adjoint") for g in GATES]


@pytest.mark.parametrize("jit", JITS)
@pytest.mark.parametrize("gates,point,method", GATE_CASES)
def test_gates_expvals(gates, point, method, jit):
    body, nw, nparams = GATES[gates]
    dev = qml.device("default.qubit", wires=nw)

    @qml.qnode(dev, interface="jax", diff_method=method)
    def circuit(w, x):
        body(w, x)
        return (
            qml.expval(qml.PauliZ(0)),
            qml.expval(qml.PauliX(1)),
            qml.expval(qml.PauliY(2)),
            qml.expval(qml.PauliZ(0) @ qml.PauliZ(1) @ qml.PauliX(2)),
        )

    w = _angles(point, nparams, 1)
    x = _angles(point, 3, 2)
    c = jnp.array([1.0, -0.5, 0.7, 0.3])

    def loss(w, x, c):
        out = jnp.stack(circuit(w, x))
        return jnp.sum(c * out) + 0.1 * jnp.sum(out**2)

    _grads(loss, (w, x, c), jit)


# ---------------------------------------------------------------- measurements
def _ansatz(w, x):
    qml.AngleEmbedding(x, wires=range(3), rotation="Y")
    qml.RX(w[0], 0)
    qml.RY(w[1], 1)
    qml.CNOT([0, 1])
    qml.CRZ(w[2], [1, 2])
    qml.RY(w[3], 2)
    qml.CNOT([2, 0])


def _herm(h):  # a traced 2x2 Hermitian from four reals
    return jnp.array([[h[0], h[1] - 1j * h[2]], [h[1] + 1j * h[2], h[3]]])


MEAS = {
    # name: (measurement builder (c) -> measurement(s), loss of the output and c,
    #        differentiation methods besides backprop)
    "hermitian": (
        lambda c: qml.expval(qml.Hermitian(_herm(c), wires=1)),
        lambda out, c: out,
        [],
    ),
    "hamiltonian": (
        lambda c: qml.expval(
            qml.dot(c, [qml.PauliZ(0), qml.PauliX(1) @ qml.PauliX(2), qml.PauliY(0) @ qml.PauliZ(2), qml.Identity(1)])
        ),
        lambda out, c: out,
        ["parameter-shift"],
    ),
    "var": (
        lambda c: (qml.var(qml.PauliZ(0)), qml.var(qml.PauliX(1) @ qml.PauliY(2))),
        lambda out, c: c[0] * out[0] + c[1] * out[1],
        ["parameter-shift"],
    ),
    "probs": (
        lambda c: qml.probs(wires=range(3)),
        lambda out, c: jnp.sum(jnp.tile(c, 2) * out) + jnp.sum(jnp.sqrt(out + 1e-3)),
        ["parameter-shift"],
    ),
    "probs_subset": (
        lambda c: qml.probs(wires=[2, 0]),
        lambda out, c: jnp.sum(c * out * jnp.log(out + 1e-6)),
        ["parameter-shift"],
    ),
    "state_fidelity": (
        lambda c: qml.state(),
        lambda out, c: jnp.abs(jnp.vdot(jnp.ones(8) / np.sqrt(8), out)) ** 2 * c[0],
        [],
    ),
    "state_abs": (  # |amplitude| has a kink where the amplitude vanishes
        lambda c: qml.state(),
        lambda out, c: jnp.sum(jnp.abs(out) * jnp.tile(c, 2)),
        [],
    ),
    "density_matrix": (
        lambda c: qml.density_matrix(wires=[0, 2]),
        lambda out, c: jnp.real(jnp.trace(out @ jnp.kron(_herm(c), _herm(c[::-1])))),
        [],
    ),
    "purity": (
        lambda c: qml.purity(wires=[0, 1]),
        lambda out, c: out * c[0],
        [],
    ),
    "vn_entropy": (
        lambda c: qml.vn_entropy(wires=[0]),
        lambda out, c: out * c[1],
        [],
    ),
    "mutual_info": (
        lambda c: qml.mutual_info(wires0=[0], wires1=[2]),
        lambda out, c: out * c[2],
        [],
    ),
}


# backprop at every point; parameter-shift, where PennyLane supports the measurement's
# gradient with it, at a generic point.
MEAS_CASES = [(m, p, "backprop") for m in MEAS for p in POINTS]
MEAS_CASES += [(m, "generic", "parameter-shift") for m in MEAS if "parameter-shift" in MEAS[m][2]]


@pytest.mark.parametrize("jit", JITS)
@pytest.mark.parametrize("meas,point,method", MEAS_CASES)
def test_measurements(meas, point, method, jit):
    build, post, _ = MEAS[meas]
    dev = qml.device("default.qubit", wires=3)

    @qml.qnode(dev, interface="jax", diff_method=method)
    def circuit(w, x, c):
        _ansatz(w, x)
        return build(c)

    w = _angles(point, 4, 3)
    x = _angles(point, 3, 4)
    c = jnp.array([0.8, -0.3, 0.5, 1.2])

    def loss(w, x, c):
        return jnp.real(post(circuit(w, x, c), c))

    _grads(loss, (w, x, c), jit)


# ------------------------------------------------------------------- templates
def _t_angle(w, x):
    qml.AngleEmbedding(x, wires=range(3), rotation="X")
    qml.AngleEmbedding(w[:3], wires=range(3), rotation="Z")
    qml.AngleEmbedding(w[3:6], wires=range(3), rotation="Y")


def _t_amplitude(w, x):
    qml.AmplitudeEmbedding(jnp.concatenate([x, w[:4]]), wires=range(3), normalize=True, pad_with=0.0)
    qml.RY(w[4], 0)


def _t_iqp(w, x):
    qml.IQPEmbedding(x, wires=range(3), n_repeats=2)
    qml.BasicEntanglerLayers(w[:6].reshape(2, 3), wires=range(3), rotation=qml.RX)


def _t_qaoa(w, x):
    qml.QAOAEmbedding(features=x, weights=w[:12].reshape(2, 6), wires=range(3), local_field="Y")


def _t_strong(w, x):
    qml.AngleEmbedding(x, wires=range(3))
    qml.StronglyEntanglingLayers(w[:18].reshape(2, 3, 3), wires=range(3), ranges=[1, 2], imprimitive=qml.CZ)


def _t_two_design(w, x):
    qml.SimplifiedTwoDesign(initial_layer_weights=x, weights=w[:8].reshape(2, 2, 2), wires=range(3))


def _t_random(w, x):
    qml.AngleEmbedding(x, wires=range(3))
    qml.RandomLayers(w[:6].reshape(2, 3), wires=range(3), seed=7)


TEMPLATES = {
    "angle": (_t_angle, 6),
    "amplitude": (_t_amplitude, 5),
    "iqp_basic": (_t_iqp, 6),
    "qaoa": (_t_qaoa, 12),
    "strongly_entangling": (_t_strong, 18),
    "two_design": (_t_two_design, 8),
    "random_layers": (_t_random, 6),
}


# backprop at a generic point and at zero; parameter-shift at a generic point
# (AmplitudeEmbedding's state preparation has no parameter-shift rule).
TEMPLATE_CASES = [(t, p, "backprop") for t in TEMPLATES for p in ("generic", "zero")]
TEMPLATE_CASES += [(t, "generic", "parameter-shift") for t in TEMPLATES if t != "amplitude"]


@pytest.mark.parametrize("jit", JITS)
@pytest.mark.parametrize("template,point,method", TEMPLATE_CASES)
def test_templates(template, point, method, jit):
    body, nparams = TEMPLATES[template]
    dev = qml.device("default.qubit", wires=3)

    @qml.qnode(dev, interface="jax", diff_method=method)
    def circuit(w, x):
        body(w, x)
        return [qml.expval(qml.PauliZ(i)) for i in range(3)]

    w = _angles(point, nparams, 5)
    x = _angles(point, 3, 6) if point == "generic" else jnp.array([0.0, 0.5, 0.0])
    c = jnp.array([0.6, -1.1, 0.4])

    def loss(w, x, c):
        return jnp.sum(c * jnp.stack(circuit(w, x)) ** 2)

    _grads(loss, (w, x, c), jit)


# ------------------------------------------------------------------ noisy device
NOISE_POINTS = {"generic": 0.23, "zero": 0.0, "full": 1.0}


@pytest.mark.parametrize("jit", JITS)
@pytest.mark.parametrize("noise", list(NOISE_POINTS))
@pytest.mark.parametrize("point", ["generic", "pi"])
def test_mixed_device(point, noise, jit):
    dev = qml.device("default.mixed", wires=2)

    @qml.qnode(dev, interface="jax", diff_method="backprop")
    def circuit(w, p):
        qml.RX(w[0], 0)
        qml.RY(w[1], 1)
        qml.CNOT([0, 1])
        qml.DepolarizingChannel(p[0] * 0.75, wires=0)  # 3/4: the completely depolarising point
        qml.AmplitudeDamping(p[1], wires=1)
        qml.RZ(w[2], 1)
        qml.PhaseDamping(p[2], wires=0)
        qml.BitFlip(p[3] * 0.5, wires=1)
        qml.CRX(w[3], [1, 0])
        return qml.expval(qml.PauliZ(0)), qml.expval(qml.PauliX(1) @ qml.PauliY(0)), qml.purity(wires=[0, 1])

    w = _angles(point, 4, 7)
    p = jnp.full((4,), NOISE_POINTS[noise]) * jnp.array([1.0, 1.0, 1.0, 1.0])

    def loss(w, p):
        a, b, pur = circuit(w, p)
        return a - 0.7 * b + 0.4 * pur

    _grads(loss, (w, p), jit)

    @qml.qnode(dev, interface="jax", diff_method="backprop")
    def dm_circuit(w, p):
        qml.RY(w[0], 0)
        qml.CNOT([0, 1])
        qml.AmplitudeDamping(p[0], wires=0)
        return qml.density_matrix(wires=[0, 1])

    def loss_dm(w, p):
        rho = dm_circuit(w, p)
        return qml.math.vn_entropy(rho, indices=[0], c_dtype=jnp.complex128) + jnp.real(rho[1, 1])

    _grads(loss_dm, (w, p), jit)


# ------------------------------------------------------- matrices and unitaries
@pytest.mark.parametrize("jit", JITS)
@pytest.mark.parametrize("point", list(POINTS))
def test_matrix_and_unitary(point, jit):
    def ops(w):
        qml.RX(w[0], 0)
        qml.CRY(w[1], [0, 1])
        qml.IsingZZ(w[2], [0, 1])

    target = jnp.asarray(qml.matrix(qml.CNOT([0, 1])), dtype=jnp.complex128)

    def loss_matrix(w, c):
        u = qml.matrix(ops, wire_order=[0, 1])(w)
        return c[0] * jnp.abs(jnp.trace(target.conj().T @ u)) ** 2 + c[1] * jnp.sum(
            jnp.real(u) ** 2 * jnp.arange(16.0).reshape(4, 4)
        )

    w = _angles(point, 3, 8)
    c = jnp.array([0.5, -0.2])
    _grads(loss_matrix, (w, c), jit)

    dev = qml.device("default.qubit", wires=2)
    paulis = [
        np.kron(a, b) for a, b in [(qml.matrix(qml.X(0)), np.eye(2)), (qml.matrix(qml.Z(0)), qml.matrix(qml.Y(0)))]
    ]

    @qml.qnode(dev, interface="jax", diff_method="backprop")
    def circuit(h, w):
        gen = h[0] * paulis[0] + h[1] * paulis[1]
        qml.Hadamard(0)
        qml.QubitUnitary(jax.scipy.linalg.expm(-1j * gen), wires=[0, 1])
        qml.RY(w[0], 1)
        return qml.expval(qml.PauliZ(0) @ qml.PauliZ(1)), qml.expval(qml.PauliX(1))

    h = jnp.array([0.3, -0.8]) if point == "generic" else jnp.full((2,), POINTS[point])

    def loss_unitary(h, w):
        a, b = circuit(h, w)
        return a + 0.5 * b

    _grads(loss_unitary, (h, w), jit)


# ----------------------------------------------------------------- qml.math
def _rho(theta):
    """A traced two-qubit density matrix: a mixture of two product pure states."""

    def pure(a, b):
        s = jnp.kron(jnp.array([jnp.cos(a / 2), jnp.sin(a / 2)]), jnp.array([jnp.cos(b / 2), 1j * jnp.sin(b / 2)]))
        return jnp.outer(s, s.conj())

    lam = jax.nn.sigmoid(theta[4])
    return lam * pure(theta[0], theta[1]) + (1 - lam) * pure(theta[2], theta[3])


MATH = {
    "fidelity": lambda r, s: qml.math.fidelity(r, s),
    "trace_distance": lambda r, s: qml.math.trace_distance(r, s),
    # (sigma made full rank with distinct added eigenvalues: a multiple of the identity
    # leaves its null space degenerate, where the eigenvectors' gradient is ill-conditioned)
    "relative_entropy": lambda r, s: qml.math.relative_entropy(
        r, s + 0.05 * jnp.diag(jnp.array([1.0, 2.0, 3.0, 4.0])), check_state=False
    ),
    "purity": lambda r, s: qml.math.purity(r, indices=[0]) + qml.math.purity(s, indices=[0, 1]),
    "vn_entropy": lambda r, s: qml.math.vn_entropy(r, indices=[0]) + qml.math.vn_entropy(s, indices=[0, 1], base=2),
    "reduce_dm": lambda r, s: (
        jnp.sum(jnp.abs(qml.math.reduce_dm(r, indices=[1])) ** 2)
        + jnp.real(qml.math.partial_trace(s, indices=[0])[0, 0])
    ),
    "fidelity_statevector": lambda r, s: qml.math.fidelity_statevector(
        r[:, 0] / jnp.linalg.norm(r[:, 0]), s[:, 1] / jnp.linalg.norm(s[:, 1])
    ),
}
MATH_POINTS = {
    "generic": ([0.4, 1.1, -0.7, 0.3, 0.2], [1.3, -0.5, 0.9, 2.0, -0.6]),
    "pure": ([0.4, 1.1, 0.4, 1.1, 0.0], [0.4, 1.1, 0.4, 1.1, 0.0]),  # one pure state twice: rank one, r == s
    "mixed_equal": ([0.0, 0.0, np.pi, 0.0, 0.0], [0.0, np.pi, np.pi, 0.0, 0.0]),  # degenerate spectra
}


@pytest.mark.parametrize("jit", JITS)
@pytest.mark.parametrize("point", list(MATH_POINTS))
@pytest.mark.parametrize("fn", list(MATH))
def test_math(fn, point, jit):
    a, b = (jnp.asarray(v) for v in MATH_POINTS[point])

    def loss(a, b):
        return jnp.real(MATH[fn](_rho(a), _rho(b)))

    _grads(loss, (a, b), jit)
