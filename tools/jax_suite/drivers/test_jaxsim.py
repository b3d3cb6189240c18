"""jaxsim: rigid-body dynamics of a tiny floating-base robot (a box base carrying a
two-link pendulum, joints about different axes, an SDF string parsed by rod; a frame on
the tip) differentiated by jax.grad, eagerly and under jit, with respect to each
argument alone and all: forward kinematics (link and frame transforms, velocities and
Jacobians, the centre of mass and its velocity, collidable points) in the mixed
velocity representation (the inertial one in the dynamics and the steps); the mass matrix (CRBA) and its inverse, Coriolis matrix,
bias and gravity forces, momentum, locked inertia and energies; free-floating inverse
dynamics (RNEA); forward dynamics by ABA (serial and parallel) and by CRBA, with
external link forces; ``js.model.step`` with the semi-implicit Euler and RK4 integrators
and the soft (Hunt/Crossley, with its tangential deformation state) and relaxed
rigid (L-BFGS inside ``custom_linear_solve``) contact models for a step, the base resting on the ground; with respect
to the model's parameters (link masses, centres of mass, inertias, joint friction and
limit springs, contact parameters). Edge points: joints at rest and at zero, exactly at
their position limits (the limit spring's clip), zero joint velocity with static
friction (``sign``), a zero base angular velocity (jaxsim's ``safe_norm`` custom_jvp),
collidable points exactly on the ground. Kept small (a few arguments per loss, one
velocity representation per function): each gradient of these programs takes about a
minute to compile on two shared cores."""

import jax
import jax.numpy as jnp
import jaxsim.api as js
import pytest
from jaxsim import VelRepr
from jaxsim.rbda.contacts import RelaxedRigidContacts, RigidContacts, SoftContacts

jax.config.update("jax_enable_x64", True)


def _inertial(pose, mass, ixx, iyy, izz):
    return (
        f"<inertial><pose>{pose}</pose><mass>{mass}</mass><inertia><ixx>{ixx}</ixx>"
        f"<ixy>0.001</ixy><ixz>0</ixz><iyy>{iyy}</iyy><iyz>0.0005</iyz><izz>{izz}</izz>"
        "</inertia></inertial>"
    )


SDF = f"""<?xml version="1.0"?>
<sdf version="1.10">
<model name="pendulum_on_box">
  <link name="base">
    <pose>0 0 0 0 0 0</pose>
    {_inertial("0.01 0 0 0 0 0", 2.0, 0.1, 0.12, 0.08)}
    <collision name="base_col"><geometry><box><size>0.2 0.16 0.1</size></box></geometry></collision>
  </link>
  <link name="l1">
    <pose>0 0 0.05 0 0 0</pose>
    {_inertial("0 0.01 0.25 0 0 0", 1.0, 0.02, 0.021, 0.001)}
  </link>
  <link name="l2">
    <pose>0 0 0.55 0 0 0</pose>
    {_inertial("0.02 0 0.2 0 0 0", 0.5, 0.01, 0.011, 0.0005)}
    <collision name="l2_col"><pose>0 0 0.4 0 0 0</pose><geometry><box><size>0.04 0.04 0.04</size></box></geometry></collision>
  </link>
  <joint name="j1" type="revolute"><parent>base</parent><child>l1</child>
    <axis><xyz>0 1 0</xyz><limit><lower>-2</lower><upper>2</upper></limit></axis></joint>
  <joint name="j2" type="revolute"><parent>l1</parent><child>l2</child>
    <axis><xyz>1 0 0</xyz><limit><lower>-1.5</lower><upper>1.5</upper></limit></axis></joint>
  <frame name="tip" attached_to="l2"><pose>0.01 0 0.42 0 0 0</pose></frame>
</model>
</sdf>
"""

_MODELS = {}


def _model(contact="soft", integrator="SemiImplicitEuler"):
    key = (contact, integrator)
    if key not in _MODELS:
        cm = {"soft": SoftContacts, "rigid": RigidContacts, "relaxed": RelaxedRigidContacts}[contact]
        _MODELS[key] = js.model.JaxSimModel.build_from_model_description(
            SDF,
            time_step=0.001,
            contact_model=cm.build(),
            integrator=js.model.IntegratorType[integrator],
        )
    return _MODELS[key]


Q = jnp.array([0.3, -0.2])
QD = jnp.array([0.1, 0.4])
TAU = jnp.array([0.5, -0.3])
# base position and quaternion (w, x, y, z), slightly tilted
BASE = jnp.array([0.05, -0.02, 1.0, 0.995, 0.05, -0.08, 0.03])
BASE_V = jnp.array([0.1, -0.2, 0.05, 0.3, -0.1, 0.2])
# resting on the ground: the box's lowest corners 1 mm into it
BASE_GROUND = jnp.array([0.0, 0.0, 0.049, 1.0, 0.0, 0.0, 0.0])
VRS = {"inertial": VelRepr.Inertial, "body": VelRepr.Body, "mixed": VelRepr.Mixed}


def _data(model, q, qd, base, base_v=BASE_V, vr=VelRepr.Inertial):
    return js.data.JaxSimModelData.build(
        model=model,
        joint_positions=q,
        joint_velocities=qd,
        base_position=base[:3],
        base_quaternion=base[3:],
        base_linear_velocity=base_v[:3],
        base_angular_velocity=base_v[3:],
        velocity_representation=vr,
    )


def _grads(loss, args, jit):
    n = len(args)
    for argnums in [(i,) for i in range(n)] + ([tuple(range(n))] if n > 1 else []):
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*args)


def _w(x):
    # a fixed, generic weighting so that no gradient is a plain sum
    x = jnp.ravel(x)
    return jnp.sum(x * jnp.cos(0.7 * jnp.arange(x.size) + 0.3))


# The rigid contact model is left out: its qpax.solve_qp runs a lax.while_loop, which
# jax.grad itself cannot reverse ("Reverse-mode differentiation does not work for
# lax.while_loop").
STEP_CASES = [
    ("relaxed", "SemiImplicitEuler"),
    ("soft", "SemiImplicitEuler"),
    ("soft", "RungeKutta4"),
]


def _rollout(model, data, tau, n=1):
    for _ in range(n):
        data = js.model.step(model, data, joint_force_references=tau)
    return data


def _state_loss(data):
    return (
        _w(data.joint_positions)
        + _w(data.joint_velocities)
        + _w(data.base_position)
        + _w(data.base_orientation)
        + 0.1 * _w(data.base_velocity)
    )


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("contact,integrator", STEP_CASES)
def test_step(contact, integrator, jit):
    # one step of js.model.step, the base's lowest corners 1 mm into the ground
    model = _model(contact, integrator)

    def loss(q, tau):
        data = _data(model, q, QD, BASE_GROUND, BASE_V * 0.1, VelRepr.Inertial)
        return _state_loss(_rollout(model, data, tau))

    _grads(loss, (Q, TAU), jit)


# Edge points: joint 1 exactly at its upper limit and joint 2 exactly at its lower one
# (the clip of the limit spring), zero joint and base velocities (static friction's
# sign, safe_norm at zero), the base's lowest corners exactly on the ground.
EDGES = {
    "at_limits": (jnp.array([2.0, -1.5]), QD, BASE_GROUND),
    "zero_velocity": (Q, jnp.zeros(2), BASE_GROUND),
    "on_ground": (Q, QD, jnp.array([0.0, 0.0, 0.05, 1.0, 0.0, 0.0, 0.0])),
}
EDGE_ARGS = {"at_limits": (0, 1), "zero_velocity": (1,), "on_ground": (1, 2)}


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("edge", list(EDGES))
def test_edges(edge, jit):
    model = _model()
    model = _with_params(model, *_params(model))
    point = EDGES[edge]
    which = EDGE_ARGS[edge]
    bv = jnp.zeros(6) if edge == "zero_velocity" else BASE_V * 0.1

    def loss(*differentiated):
        args = list(point)
        for i, a in zip(which, differentiated):
            args[i] = a
        data = _data(model, *args, bv, VelRepr.Inertial)
        torques = js.actuation_model.compute_resultant_torques(model, data, joint_force_references=TAU)
        return _state_loss(_rollout(model, data, TAU)) + _w(torques)

    _grads(loss, tuple(point[i] for i in which), jit)


def _with_params(model, links, joints, contact):
    kdp = model.kin_dyn_parameters
    lp = kdp.link_parameters.replace(mass=links["mass"], center_of_mass=links["com"], inertia_elements=links["inertia"])
    jp = kdp.joint_parameters.replace(
        friction_static=joints["kc"],
        friction_viscous=joints["kv"],
        position_limit_spring=joints["k"],
        position_limit_damper=joints["d"],
    )
    kdp = kdp.replace(link_parameters=lp, joint_parameters=jp)
    return model.replace(kin_dyn_parameters=kdp, contact_params=model.contact_params.replace(**contact))


def _params(model):
    lp = model.kin_dyn_parameters.link_parameters
    links = {"mass": lp.mass, "com": lp.center_of_mass, "inertia": lp.inertia_elements}
    joints = {
        "kc": jnp.array([0.05, 0.02]),
        "kv": jnp.array([0.1, 0.2]),
        "k": jnp.array([50.0, 80.0]),
        "d": jnp.array([0.5, 1.0]),
    }
    cp = model.contact_params
    return links, joints, {"K": cp.K, "D": cp.D, "mu": cp.mu}


@pytest.mark.parametrize("jit", [True, False])
def test_model_parameters(jit):
    # link masses, centres of mass and inertias, joint friction and limit springs,
    # soft-contact stiffness, damping and friction coefficient; joint 1 past its limit
    model = _model()
    q = jnp.array([2.1, -0.2])

    def loss(links, joints_and_contact):
        m = _with_params(model, links, *joints_and_contact)
        data = _data(m, q, QD, BASE_GROUND, BASE_V * 0.1, VelRepr.Inertial)
        return _state_loss(_rollout(m, data, TAU)) + _w(js.model.free_floating_mass_matrix(m, data))

    links, joints, contact = _params(model)
    _grads(loss, (links, (joints, contact)), jit)


FORCES = jnp.array([[0.0, 0.0, 1.0, 0.1, 0.0, 0.0], [0.3, 0.0, 0.0, 0.0, 0.0, 0.2], [0.0, -0.4, 0.0, 0.0, 0.05, 0.0]])


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("vr", ["inertial"])
def test_dynamics(vr, jit):
    # forward dynamics by ABA (serial and parallel) and by CRBA, then RNEA
    # (free-floating inverse dynamics) of the accelerations found, external link forces
    model = _model()

    def loss(q, tau):
        data = _data(model, q, QD, BASE, BASE_V, VRS[vr])
        acc_b, qdd = js.model.forward_dynamics_aba(model, data, joint_forces=tau, link_forces=FORCES)
        acc_p, qdd_p = js.model.forward_dynamics_aba(model, data, joint_forces=tau, parallel=True)
        acc_c, qdd_c = js.model.forward_dynamics_crb(model, data, joint_forces=tau, link_forces=FORCES)
        f_base, tau_id = js.model.inverse_dynamics(
            model, data, joint_accelerations=qdd_p * 0.5, base_acceleration=acc_p * 0.5, link_forces=FORCES
        )
        return _w(acc_b) + _w(qdd) + _w(acc_c) + _w(qdd_c) + _w(f_base) + _w(tau_id)

    _grads(loss, (Q, TAU), jit)


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("vr", ["mixed"])
def test_kinematics(vr, jit):
    model = _model()
    tip = js.frame.name_to_idx(model, frame_name="tip")

    def loss(q, base):
        data = _data(model, q, QD, base, BASE_V, VRS[vr])
        return (
            _w(js.model.forward_kinematics(model, data))
            + _w(js.link.velocity(model, data, link_index=2))
            + _w(js.link.jacobian(model, data, link_index=1))
            + _w(js.frame.transform(model, data, frame_index=tip))
            + _w(js.frame.velocity(model, data, frame_index=tip))
            + _w(js.com.com_position(model, data))
            + _w(js.com.com_linear_velocity(model, data))
            + _w(js.contact.collidable_point_velocities(model, data))
        )

    _grads(loss, (Q, BASE), jit)


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("point", ["zero"])
def test_mass_matrix_and_forces(point, jit):
    # "zero": joints at zero, base at the origin with the identity orientation, at rest
    model = _model()
    q = Q if point == "generic" else jnp.zeros(2)
    qd = QD if point == "generic" else jnp.zeros(2)
    bv = BASE_V if point == "generic" else jnp.zeros(6)
    base = BASE if point == "generic" else jnp.array([0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])

    def loss(q, base):
        data = _data(model, q, qd, base, bv, VelRepr.Mixed)
        return (
            _w(js.model.free_floating_mass_matrix(model, data))
            + _w(js.model.free_floating_mass_matrix_inverse(model, data))
            + _w(js.model.free_floating_coriolis_matrix(model, data))
            + _w(js.model.free_floating_bias_forces(model, data))
            + _w(js.model.free_floating_gravity_forces(model, data))
            + _w(js.model.locked_spatial_inertia(model, data))
            + _w(js.model.total_momentum(model, data))
            + js.model.mechanical_energy(model, data)
        )

    _grads(loss, (q, base), jit)
