"""sax: photonic (and RF) circuit simulation with complex S-matrices, differentiated
by jax.grad, eagerly and under jit. Every built-in model in ``sax.models`` (straight,
bend, attenuator, phase shifter, ideal and dispersive couplers, grating coupler,
MMIs, reflector, mirror, isolator, circulator, terminator, splitter, crossing; RF:
capacitor, inductor, resistor, complex impedance and admittance, the LC shunt (a
circuit of its own), coplanar waveguide and microstrip with thickness corrections)
with respect to each of its float settings alone and all together, at generic
settings and at edges: zero loss (``abs(loss_dB)`` at its kink), zero length, the
centre wavelength, couplings and reflections 0 and 1 (``sqrt`` at 0), a microstrip with
w = h (the narrow/wide formulas' switch), zero thickness and tan delta (the ``where``
branches), a matched resistor (S11 = 0). Losses: |S|^2 transmissions and reflections,
|S| (the kink at S = 0), real and imaginary parts and the phase of a transmission.
``sax.circuit`` with the default non-klu backends: Mach-Zehnder interferometers with
the Filipsson-Gunnar and forward backends returning SDict, SDense and SCoo (a generic
and a balanced MZI whose bar port is exactly 0), a ring resonator (feedback, FG), a
recursive netlist of two MZIs, and the additive backend's path lengths; the S-type
conversions (``sdense``, ``scoo``, ``sdict``, ``multimode``/``singlemode``,
``rename_ports``); ``grouped_interp`` (on its knots, between them, phases at +-pi), the
normalisation helpers, ``cartesian_product``, the losses ``mse``/``huber_loss``/``l2_reg``
on complex arrays (also where x = y), and sax.fit's network (``create_network``'s
forward pass, and ``train_network``, whose own jax.grad is probed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sax

jax.config.update("jax_enable_x64", True)
WL = jnp.array([1.53, 1.55, 1.571])

# name: (model, generic settings, {edge: overrides}, {setting: scale}); a scale makes the
# differentiated variable O(1) (frequencies in GHz, capacitances in pF, ...)
MODELS = {
    "straight": (
        sax.models.straight,
        dict(wl=WL, wl0=1.55, neff=2.34, ng=3.4, length=10.0, loss_dB_cm=3.0),
        {"lossless_zero_length": dict(length=0.0, loss_dB_cm=0.0), "at_wl0": dict(wl=1.55)},
        {},
    ),
    "bend": (
        sax.models.bend,
        dict(wl=WL, wl0=1.55, neff=2.34, ng=3.4, length=7.0, loss_dB_cm=0.1),
        {"lossless": dict(loss_dB_cm=0.0)},
        {},
    ),
    "attenuator": (sax.models.attenuator, dict(wl=WL, loss=3.0), {"zero": dict(loss=0.0)}, {}),
    "phase_shifter": (
        sax.models.phase_shifter,
        dict(wl=WL, neff=2.34, voltage=0.3, length=10.0, loss=0.01),
        {"zero_voltage": dict(voltage=0.0, loss=0.0), "pi": dict(voltage=1.0)},
        {},
    ),
    "coupler_ideal": (
        sax.models.coupler_ideal,
        dict(wl=WL, coupling=0.3),
        {"zero": dict(coupling=0.0), "one": dict(coupling=1.0), "half": dict(coupling=0.5)},
        {},
    ),
    "coupler": (
        sax.models.coupler,
        dict(wl=WL, wl0=1.55, length=12.0, coupling0=0.2, dk1=1.2435, dk2=5.3022, dn=0.02, dn1=0.1169, dn2=0.4821),
        {"at_wl0_no_length": dict(wl=1.55, length=0.0), "full_cross": dict(wl=1.55, length=0.0, coupling0=np.pi / 2)},
        {},
    ),
    "grating_coupler": (
        sax.models.grating_coupler,
        dict(wl=WL, wl0=1.55, loss=1.0, reflection=0.05, reflection_fiber=0.02, bandwidth=0.04),
        {"peak_no_loss": dict(wl=1.55, loss=0.0, reflection=0.0, reflection_fiber=0.0)},
        {},
    ),
    "mmi1x2": (
        sax.models.mmi1x2,
        dict(wl=WL, wl0=1.55, fwhm=0.2, loss_dB=0.3),
        {"lossless_peak": dict(wl=1.55, loss_dB=0.0), "lossless": dict(loss_dB=0.0)},
        {},
    ),
    "mmi2x2": (
        sax.models.mmi2x2,
        dict(wl=WL, wl0=1.55, fwhm=0.2, loss_dB=0.3, shift=0.005, splitting_ratio_cross=0.4, splitting_ratio_thru=0.6),
        {
            "lossless_even": dict(loss_dB=0.0, shift=0.0, splitting_ratio_cross=0.5, splitting_ratio_thru=0.5),
            "all_cross": dict(splitting_ratio_cross=1.0, splitting_ratio_thru=0.0),
        },
        {},
    ),
    "reflector": (
        sax.models.reflector,
        dict(wl=WL, reflection=0.3, loss_dB=0.5),
        {"zero": dict(reflection=0.0, loss_dB=0.0), "one": dict(reflection=1.0)},
        {},
    ),
    "mirror": (
        sax.models.mirror,
        dict(wl=WL, reflection=0.9, loss_dB=0.2),
        {"one": dict(reflection=1.0, loss_dB=0.0)},
        {},
    ),
    "isolator": (
        sax.models.isolator,
        dict(wl=WL, insertion_loss_dB=0.5, isolation_dB=30.0),
        {"zero": dict(insertion_loss_dB=0.0, isolation_dB=0.0)},
        {},
    ),
    "circulator": (
        sax.models.circulator,
        dict(wl=WL, insertion_loss_dB=0.5, isolation_dB=30.0),
        {"zero": dict(insertion_loss_dB=0.0)},
        {},
    ),
    "terminator": (sax.models.terminator, dict(wl=WL, reflection=0.01), {"zero": dict(reflection=0.0)}, {}),
    "splitter_ideal": (
        sax.models.splitter_ideal,
        dict(wl=WL, coupling=0.3),
        {"zero": dict(coupling=0.0), "half": dict(coupling=0.5)},
        {},
    ),
    "mmi2x2_ideal": (sax.models.mmi2x2_ideal, dict(wl=WL), {}, {}),
    "crossing_ideal": (sax.models.crossing_ideal, dict(wl=WL), {}, {}),
    # RF models (frequencies in Hz)
    "capacitor": (
        sax.models.capacitor,
        dict(f=jnp.array([1.0, 5.0, 20.0]), capacitance=0.1, z0=50.0),
        {},
        dict(f=1e9, capacitance=1e-12),
    ),
    "inductor": (
        sax.models.inductor,
        dict(f=jnp.array([1.0, 5.0, 20.0]), inductance=1.0, z0=50.0),
        {},
        dict(f=1e9, inductance=1e-9),
    ),
    "resistor": (
        sax.models.resistor,
        dict(f=5.0, resistance=30.0, z0=50.0),
        {"short": dict(resistance=0.0)},
        dict(f=1e9),
    ),
    "impedance": (
        sax.models.impedance,
        dict(f=5.0, z=30.0 + 20.0j, z0=50.0),
        {"zero": dict(z=0.0 + 0.0j), "real": dict(z=25.0 + 0.0j)},
        dict(f=1e9),
    ),
    "admittance": (sax.models.admittance, dict(f=5.0, y=0.02 + 0.01j), {"zero": dict(y=0.0 + 0.0j)}, dict(f=1e9)),
    "lc_shunt_component": (
        sax.models.lc_shunt_component,
        dict(f=jnp.array([1.0, 5.0]), inductance=1.0, capacitance=1.0),  # z0 left out (slow to compile)
        {},
        dict(f=1e9, inductance=1e-9, capacitance=1e-12),
    ),
    "coplanar_waveguide": (
        sax.models.coplanar_waveguide,
        dict(
            f=jnp.array([1.0, 5.0]),
            length=1000.0,
            width=10.0,
            gap=5.0,
            thickness=0.2,
            substrate_thickness=500.0,
            ep_r=11.45,
            tand=0.001,
        ),
        {"thin_lossless": dict(thickness=0.0, tand=0.0)},
        dict(f=1e9),
    ),
    "microstrip": (
        sax.models.microstrip,
        dict(
            f=jnp.array([1.0, 5.0]),
            length=1000.0,
            width=10.0,
            substrate_thickness=500.0,
            thickness=0.2,
            ep_r=11.45,
            tand=0.001,
        ),
        {"w_eq_h": dict(width=500.0), "thin": dict(thickness=0.0, tand=0.0), "ep_r_1": dict(ep_r=1.0)},
        dict(f=1e9),
    ),
}
MODEL_CASES = [(m, p) for m, spec in MODELS.items() for p in ["generic", *spec[2]]]


def _s_loss(S, phase=True):
    """|S|^2 and |S| of every entry, real and imaginary parts, and (unless a
    transmission may vanish) the phase of the first transmission."""
    out = 0.0
    keys = sorted(S)
    for i, k in enumerate(keys):
        s = jnp.asarray(S[k])
        w = 0.3 + 0.17 * i
        out = out + jnp.sum(w * jnp.abs(s) ** 2 + 0.5 * jnp.abs(s) + 0.2 * s.real - 0.1 * w * s.imag)
    off = [k for k in keys if k[0] != k[1]]
    if phase and off:
        out = out + 0.3 * jnp.sum(jnp.angle(jnp.asarray(S[off[0]])))
    return out


def _argnums(n):
    return [(i,) for i in range(n)] + ([tuple(range(n))] if n > 1 else [])


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("model,point", MODEL_CASES)
def test_model(model, point, jit):
    fn, generic, edges, scales = MODELS[model]
    settings = {**generic, **edges.get(point, {})}
    names = list(settings)

    def loss(*vals):
        kwargs = {n: v * scales.get(n, 1.0) for n, v in zip(names, vals)}
        return _s_loss(fn(**kwargs), phase=point == "generic")

    vals = [jnp.asarray(settings[n]) for n in names]
    for argnums in _argnums(len(names)):
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*vals)


MZI = {
    "instances": {"lft": "coupler", "top": "straight", "btm": "straight", "rgt": "coupler"},
    "connections": {"lft,out0": "btm,in0", "btm,out0": "rgt,in0", "lft,out1": "top,in0", "top,out0": "rgt,in1"},
    "ports": {"in0": "lft,in0", "in1": "lft,in1", "out0": "rgt,out0", "out1": "rgt,out1"},
}
MZI_MODELS = {"coupler": sax.models.coupler_ideal, "straight": sax.models.straight}
# (wl, top length, coupling) and the bottom arm's length: generic, and balanced
# (equal arms, a 50:50 coupler: the bar port is exactly 0)
MZI_POINTS = {
    "generic": ((WL, 15.0, 0.3), 10.0),
    "balanced": ((jnp.array([1.55]), 10.0, 0.5), 10.0),
}


def _mzi_settings(wl, l_top, coupling, neff=2.34, l_btm=10.0):
    return dict(
        wl=wl,
        lft={"coupling": coupling},
        rgt={"coupling": coupling},
        top={"length": l_top, "neff": neff},
        btm={"length": l_btm, "neff": neff, "loss_dB_cm": 0.0},
    )


def _port_loss(s_in0_out0, s_in0_out1, phase):
    out = jnp.sum(jnp.abs(s_in0_out0) ** 2 + 0.7 * jnp.abs(s_in0_out0) + 0.4 * jnp.abs(s_in0_out1) ** 2)
    if phase:
        out = out + 0.2 * jnp.sum(jnp.angle(s_in0_out1)) + jnp.sum(jnp.real(s_in0_out0))
    return out


MZI_CASES = [
    ("filipsson_gunnar", "SDict", "generic"),
    ("filipsson_gunnar", "SDict", "balanced"),
    ("filipsson_gunnar", "SDense", "generic"),
    ("filipsson_gunnar", "SCoo", "balanced"),
    ("forward", "SDict", "generic"),
    ("forward", "SDict", "balanced"),
]


# an SCoo result eagerly only: sax.sdict converts its indices with int(), which a
# jax.jit trace cannot do (jax.jit(jax.grad(loss)) fails in sax's code)
@pytest.mark.parametrize(
    "backend,return_type,point,jit", [(*c, j) for c in MZI_CASES for j in (False, True) if not (c[1] == "SCoo" and j)]
)
def test_mzi(backend, return_type, point, jit):
    mzi, _ = sax.circuit(MZI, MZI_MODELS, backend=backend, return_type=return_type)
    phase = point == "generic"
    vals, l_btm = MZI_POINTS[point]

    def loss(*vals):
        S = mzi(**_mzi_settings(*vals, l_btm=l_btm))
        if return_type == "SDict":
            return _port_loss(S["in0", "out0"], S["in0", "out1"], phase)
        if return_type == "SDense":
            m, pm = S
            return _port_loss(m[..., pm["in0"], pm["out0"]], m[..., pm["in0"], pm["out1"]], phase)
        Si, Sj, Sx, pm = S
        d = sax.sdict((Si, Sj, Sx, pm))
        return _port_loss(d["in0", "out0"], d["in0", "out1"], phase) + jnp.sum(jnp.abs(Sx) ** 2)

    vals = [jnp.asarray(v) for v in vals]
    for argnums in _argnums(len(vals)):
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*vals)


RING = {
    "instances": {"dc": "coupler", "ring": "straight"},
    "connections": {"dc,out1": "ring,in0", "ring,out0": "dc,in1"},
    "ports": {"in0": "dc,in0", "out0": "dc,out0"},
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", ["generic", "lossless", "uncoupled"])
def test_ring(point, jit):
    """An all-pass ring (a feedback loop: Filipsson-Gunnar only), with loss, lossless
    (|S21| = 1) and uncoupled (coupling 0: the ring is cut off, sqrt(0) inside)."""
    ring, _ = sax.circuit(
        RING, {"coupler": sax.models.coupler_ideal, "straight": sax.models.straight}, backend="filipsson_gunnar"
    )
    wl, length, coupling, loss_db = {
        "generic": (WL, 40.0, 0.1, 20.0),
        "lossless": (WL, 40.0, 0.1, 0.0),
        "uncoupled": (WL, 40.0, 0.0, 20.0),
    }[point]

    def loss(wl, length, coupling, loss_db):
        S = ring(wl=wl, dc={"coupling": coupling}, ring={"length": length, "loss_dB_cm": loss_db})
        t = S["in0", "out0"]
        return jnp.sum(jnp.abs(t) ** 2) + (0.3 * jnp.sum(jnp.angle(t)) if point == "generic" else 0.0)

    vals = [jnp.asarray(v) for v in (wl, length, coupling, loss_db)]
    for argnums in _argnums(4):
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*vals)


@pytest.mark.parametrize("jit", [False, True])
def test_recursive_netlist(jit):
    """Two MZIs in series through a recursive netlist (FG backend)."""
    netlist = {
        "top": {
            "instances": {"m1": "mzi", "m2": "mzi", "ps": "phase_shifter"},
            "connections": {"m1,out0": "ps,in0", "ps,out0": "m2,in0", "m1,out1": "m2,in1"},
            "ports": {"in0": "m1,in0", "in1": "m1,in1", "out0": "m2,out0", "out1": "m2,out1"},
        },
        "mzi": MZI,
    }
    models = {**MZI_MODELS, "phase_shifter": sax.models.phase_shifter}
    circ, _ = sax.circuit(netlist, models, backend="filipsson_gunnar")

    def loss(wl, l_top, voltage, coupling):
        S = circ(
            wl=wl, m1=_mzi_settings(wl, l_top, coupling, 2.34), m2={"top": {"length": 12.0}}, ps={"voltage": voltage}
        )
        return _port_loss(S["in0", "out0"], S["in1", "out1"], True)

    vals = [WL, jnp.asarray(15.0), jnp.asarray(0.25), jnp.asarray(0.4)]
    for argnums in _argnums(4):
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*vals)


def _delay(*, wl=1.55, length=1.0, ng=4.0):
    """A model for the additive backend: its 'S-matrix' holds path lengths (delays)."""
    t = jnp.ones_like(jnp.asarray(wl)) * length * ng
    return sax.reciprocal({("in0", "out0"): t})


def _split(*, wl=1.55, offset=0.0):
    z = jnp.ones_like(jnp.asarray(wl)) * offset
    return sax.reciprocal({("in0", "out0"): z, ("in0", "out1"): 2.0 * z})


@pytest.mark.parametrize("jit", [False, True])
def test_additive(jit):
    netlist = {
        "instances": {"a": "split", "top": "delay", "btm": "delay", "b": "split"},
        "connections": {"a,out0": "btm,in0", "btm,out0": "b,out0", "a,out1": "top,in0", "top,out0": "b,out1"},
        "ports": {"in0": "a,in0", "out0": "b,in0"},
    }
    circ, _ = sax.circuit(netlist, {"split": _split, "delay": _delay}, backend="additive")

    def loss(l_top, l_btm, offset):
        S = circ(wl=1.55, top={"length": l_top}, btm={"length": l_btm}, a={"offset": offset}, b={"offset": offset})
        return sum(jnp.sum(p**2) + jnp.sum(p) for v in S.values() for p in v)

    vals = [jnp.asarray(3.0), jnp.asarray(2.0), jnp.asarray(0.1)]
    for argnums in _argnums(3):
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*vals)


@pytest.mark.parametrize("jit", [False, True])
def test_s_conversions(jit):
    """sdense/scoo/sdict round trips, multimode/singlemode and rename_ports on a
    coupler's S-matrix."""

    def loss(wl, length, dn):
        s = sax.models.coupler(wl=wl, length=length, dn=dn)
        m, pm = sax.sdense(s)
        Si, Sj, Sx, pm2 = sax.scoo(s)
        back = sax.sdict((m, pm))
        mm = sax.multimode(s, ("TE", "TM"))
        sm = sax.singlemode(mm, "TE")
        renamed = sax.rename_ports(s, {"in0": "a", "in1": "b", "out0": "c", "out1": "d"})
        dense_mm, _ = sax.sdense(mm)
        return (
            jnp.sum(jnp.abs(m) ** 2 * jnp.arange(m.shape[-1]))
            + jnp.sum(jnp.abs(Sx) * jnp.arange(Sx.shape[-1]))
            + jnp.sum(jnp.real(back["in0", "out1"]))
            + jnp.sum(jnp.imag(sm["in0", "out1"]))
            + jnp.sum(jnp.abs(renamed["a", "d"]) ** 2)
            + jnp.sum(jnp.abs(dense_mm))
        )

    vals = [WL, jnp.asarray(12.0), jnp.asarray(0.02)]
    for argnums in _argnums(3):
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*vals)


# grouped_interp: doubled points carry the local phase slope
WLS = jnp.array([1.50, 1.501, 1.55, 1.551, 1.60, 1.601, 1.65, 1.651])
PHIS = jnp.array([0.1, 0.11, 0.5, 0.52, 3.1, 3.13, -2.9, -2.95])
INTERP_POINTS = {
    "between": jnp.array([1.51, 1.57, 1.62]),
    "knots": jnp.array([1.50, 1.55, 1.60]),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", list(INTERP_POINTS) + ["near_pi"])
def test_grouped_interp(point, jit):
    """Phases wrapped by ``% 2 pi`` and shifted above pi (a jump), queried between the
    knots, on them, and with a phase at pi + 1e-3 (just past the shift)."""
    phis = PHIS.at[4].set(np.pi + 1e-3) if point == "near_pi" else PHIS
    wl = INTERP_POINTS.get(point, INTERP_POINTS["between"])

    def loss(wl, wls, phis):
        return jnp.sum(jnp.sin(sax.grouped_interp(wl, wls, phis)) * jnp.array([1.0, -0.5, 0.3]))

    for argnums in _argnums(3):
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(wl, WLS, phis)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", ["generic", "equal"])
def test_losses_and_normalization(point, jit):
    """mse, huber_loss and l2_reg on complex arrays (x = y: |x - y| at 0), and the
    normalisation helpers and cartesian_product."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=4) + 1j * rng.normal(size=4))
    y = x if point == "equal" else jnp.asarray(rng.normal(size=4) + 1j * rng.normal(size=4))
    r = jnp.asarray(rng.normal(size=(3, 2)))

    def loss(x, y, r):
        nrm = sax.normalization(r, axis=0)
        z = sax.normalize(r, nrm)
        back = sax.denormalize(z * 0.5, sax.normalization(r))
        prod = sax.cartesian_product(r[:, 0], r[:2, 1])
        return (
            sax.mse(x, y)
            + sax.huber_loss(x, y, delta=0.3)
            + sax.l2_reg({"w0": x, "b0": r, "other": y})
            + jnp.sum(z**3)
            + jnp.sum(back * prod[:3])
            + jnp.sum(jnp.prod(prod, axis=1))
        )

    for argnums in _argnums(3):
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(x, y, r)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_fit_network(activation, jit):
    """sax.fit's network: the forward pass's mse against targets, with respect to the
    parameters, the inputs and both (relu at 0 for one input row)."""
    act = {"tanh": jnp.tanh, "relu": jax.nn.relu}[activation]
    init_fn, forward_fn = sax.fit.create_network(2, (4, 3), 1, act)
    params = init_fn(jax.random.PRNGKey(0))
    x = jnp.array([[0.3, -0.2], [0.0, 0.0], [1.1, 0.4], [-0.7, 0.9]])
    y = jnp.array([[0.1], [0.0], [0.5], [-0.2]])

    def loss(params, x):
        return sax.fit._compute_loss(params, forward_fn, x, y, sax.huber_loss if activation == "relu" else sax.mse)

    for argnums in [(0,), (1,), (0, 1)]:
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(params, x)


def test_train_network():
    """``train_network`` takes jax.grad of its own jitted loss each epoch (probed as
    it is; no jit parametrisation: the gradient is the library's)."""
    init_fn, forward_fn = sax.fit.create_network(2, (3,), 1, jnp.tanh)
    x = jnp.array([[0.3, -0.2], [0.5, 0.1], [1.1, 0.4], [-0.7, 0.9]])
    y = jnp.array([[0.1], [0.3], [0.5], [-0.2]])
    sax.fit.train_network(x, y, init_fn, forward_fn, jax.random.PRNGKey(1), num_epochs=3, progress_bar=False)
