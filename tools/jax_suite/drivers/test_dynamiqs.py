"""dynamiqs: closed and open quantum dynamics on tiny Hilbert spaces (a cavity of
dimension 4, a qubit coupled to a cavity of dimension 3) differentiated by jax.grad,
eagerly and under jit. ``sesolve`` and ``mesolve`` (Lindblad) with the default adaptive
solver (diffrax Tsit5 through ``RecursiveCheckpointAdjoint``), the fixed-step Euler
and Rouchon1 and exact exponentiation (``Expm``), both reverse-mode
gradient options (``dq.gradient.Direct``: diffrax's ``DirectAdjoint``;
``dq.gradient.BackwardCheckpointed``: ``RecursiveCheckpointAdjoint`` with a given
number of checkpoints), ``sepropagator``/``mepropagator`` (gate fidelities), time
dependent Hamiltonians (``dq.modulated`` with a traced drive, ``dq.pwc`` with traced
piecewise-constant values), expectation values through ``exp_ops``, ``dq.expect``,
``fidelity``, ``purity``, ``entropy_vn`` of a partial trace (``ptrace``), ``dq.expm``,
``displace``/``squeeze``/``cat``/``thermal_dm`` states. Losses with respect to the
Hamiltonian's parameters (a frequency, a drive amplitude, a coupling), the initial
state's parameters (a complex coherent amplitude), a jump operator's rate and the save
times, each alone and all together; at generic points and at the edges alpha = 0 (the
vacuum), eps = 0 (no drive), rate = 0 (a closed system inside ``mesolve``, where the
jump operator's sqrt(rate) has an infinite derivative: the loss uses the rate itself
as the jump operator's amplitude there) and a save time equal to t0."""

import dynamiqs as dq
import jax
import jax.numpy as jnp
import pytest

jax.config.update("jax_enable_x64", True)
dq.set_progress_meter(False)

N = 4
A = dq.destroy(N)
NUM = dq.number(N)
X = A + A.dag()
TSAVE = jnp.array([0.0, 0.4, 1.0])
TARGET = dq.coherent(N, 0.3 + 0.2j)

# qubit (2) x cavity (3), Jaynes-Cummings
SM = dq.tensor(dq.sigmam(), dq.eye(3))
AC = dq.tensor(dq.eye(2), dq.destroy(3))


def _h(hp):
    """H = w a^dag a + eps (a + a^dag) from hp = (w, eps)."""
    return hp[0] * NUM + hp[1] * X


def _alpha(ap):
    return ap[0] + 1j * ap[1]


def _run(argnums, jit, loss, *args):
    for a in argnums:
        g = jax.grad(loss, a)
        (jax.jit(g) if jit else g)(*args)


POINTS = {  # (w, eps), (re alpha, im alpha)
    "generic": ([1.1, 0.35], [0.5, -0.2]),
    "vacuum_nodrive": ([0.7, 0.0], [0.0, 0.0]),
}
# (method, gradient, point): each ODE solve compiles for seconds, so the methods, the
# gradient options and the points are combined rather than crossed
SE_CASES = {
    "tsit5-default-generic": (dq.method.Tsit5(), None, "generic"),
    "euler-checkpointed3-vacuum": (
        dq.method.Euler(dt=0.1),
        dq.gradient.BackwardCheckpointed(ncheckpoints=3),
        "vacuum_nodrive",
    ),
    "expm-default-vacuum": (dq.method.Expm(), None, "vacuum_nodrive"),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("case", list(SE_CASES))
def test_sesolve(case, jit):
    method, gradient, point = SE_CASES[case]
    hp, ap = (jnp.array(v) for v in POINTS[point])

    def loss(hp, ap):
        psi0 = dq.coherent(N, _alpha(ap))
        r = dq.sesolve(_h(hp), psi0, TSAVE, exp_ops=[NUM, X], method=method, gradient=gradient)
        e = r.expects.real
        return e[0, -1] + 0.3 * jnp.sum(e[1] * jnp.array([0.2, 0.5, 1.0])) + dq.fidelity(r.final_state, TARGET)

    _run([(0,), (1,), (0, 1)], jit, loss, hp, ap)


ME_CASES = {  # method, gradient, (w, eps), (re alpha, im alpha), kappa
    "rouchon1-direct-generic": (dq.method.Rouchon1(dt=0.1), dq.gradient.Direct(), [1.1, 0.35], [0.5, -0.2], 0.3),
    "tsit5-default-closed": (dq.method.Tsit5(), None, [0.9, 0.2], [0.4, 0.3], 0.0),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("case", list(ME_CASES))
def test_mesolve(case, jit):
    method, gradient, hp, ap, kappa = ME_CASES[case]
    hp, ap, kappa = jnp.array(hp), jnp.array(ap), jnp.asarray(kappa)

    def loss(hp, ap, kappa):
        rho0 = dq.coherent_dm(N, _alpha(ap))
        # kappa * a (rate kappa^2): differentiable at kappa = 0 too
        jumps = [kappa * A, 0.1 * NUM]
        r = dq.mesolve(_h(hp), jumps, rho0, TSAVE, exp_ops=[NUM, X], method=method, gradient=gradient)
        e = r.expects.real
        rho = r.final_state
        return e[0, -1] + 0.2 * e[1, 1] + dq.purity(rho) + 0.5 * dq.fidelity(rho, TARGET)

    _run([(0,), (1,), (2,), (0, 1, 2)], jit, loss, hp, ap, kappa)


@pytest.mark.parametrize("jit", [False, True])
def test_save_times(jit):
    m = dq.method.Tsit5()

    def loss(ts, hp):
        r = dq.sesolve(_h(hp), dq.coherent(N, 0.5), ts, exp_ops=[NUM, X], method=m)
        return jnp.sum(r.expects.real * jnp.array([[1.0], [0.3]]))

    # the first save time is t0: moving it moves the initial time too
    _run([(0,), (1,), (0, 1)], jit, loss, jnp.array([0.0, 0.4, 1.0]), jnp.array([1.1, 0.35]))


@pytest.mark.parametrize("jit", [False, True])
def test_time_dependent(jit):
    psi0 = dq.tensor(dq.excited(), dq.fock(3, 0))

    def loss(p, drive):
        g, delta = p[0], p[1]
        h0 = delta * SM.dag() @ SM + g * (SM.dag() @ AC + SM @ AC.dag())
        hd = dq.modulated(lambda t: drive[0] * jnp.cos(drive[1] * t), AC + AC.dag())
        hp = dq.pwc(jnp.array([0.0, 0.3, 0.7, 1.0]), drive[2:], SM + SM.dag())
        r = dq.sesolve(h0 + hd + hp, psi0, TSAVE, method=dq.method.Tsit5(), exp_ops=[AC.dag() @ AC])
        qubit = dq.ptrace(r.final_state, 0, (2, 3))
        return r.expects[0, -1].real + dq.entropy_vn(qubit) + dq.purity(qubit)

    drive = jnp.array([0.4, 2.0, 0.4, -0.2, 0.3])  # modulated amplitude, frequency; pwc values
    _run([(0,), (1,), (0, 1)], jit, loss, jnp.array([0.8, 0.3]), drive)


@pytest.mark.parametrize("jit", [False, True])
def test_propagators(jit):
    target = dq.displace(N, 0.2)

    def loss(hp, rate):
        u = dq.sepropagator(_h(hp), TSAVE, method=dq.method.Expm()).propagators[-1]
        gate = jnp.abs(dq.tracemm(target.dag(), u)) ** 2 / N**2
        s = dq.mepropagator(_h(hp), [jnp.sqrt(rate) * A], TSAVE[:2], method=dq.method.Expm()).propagators[-1]
        return gate + 0.1 * jnp.abs(s.to_jax()[0, 5]) + 0.2 * jnp.real(jnp.trace(s.to_jax()))

    _run([(0,), (1,), (0, 1)], jit, loss, jnp.array([1.1, 0.35]), jnp.asarray(0.3))


STATE_POINTS = {"generic": [0.6, -0.3, 0.4, 0.2], "zero": [0.0, 0.0, 0.0, 0.0]}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", list(STATE_POINTS))
def test_states_and_utilities(point, jit):
    """States and functions without a solver: displace, squeeze, cat, thermal_dm (nth
    > 0: at nth = 0 jax's own gradient is nan), dq.expm, dq.expect, overlap, fidelity
    of kets and of density matrices, purity, entropy_vn of a full-rank state."""

    def loss(p, w):
        alpha = p[0] + 1j * p[1]
        z = p[2] + 1j * p[3]
        psi = dq.squeeze(N, z) @ dq.displace(N, alpha) @ dq.basis(N, 0)
        cat = dq.cat(N, alpha + 0.5)
        u = dq.expm(-1j * (w[0] * NUM + w[1] * X))
        phi = u @ psi
        rho = 0.5 * dq.thermal_dm(N, 0.3 + w[0] ** 2) + 0.5 * phi.todm()
        out = dq.expect(NUM, phi).real + dq.expect(X, rho).real
        out = out + jnp.abs(dq.overlap(cat, phi)) ** 2 + dq.fidelity(phi, cat) + dq.fidelity(rho, cat)
        return out + dq.purity(rho) + dq.entropy_vn(rho)

    _run([(0,), (1,), (0, 1)], jit, loss, jnp.array(STATE_POINTS[point]), jnp.array([0.7, 0.25]))
