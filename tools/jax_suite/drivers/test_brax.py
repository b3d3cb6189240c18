"""brax: rigid-body physics pipelines and environments, differentiated by jax.grad
eagerly and under jit, each differentiable argument alone and all together.

Covers the three maximal- and generalized-coordinate pipelines (``brax.generalized``,
``brax.spring``, ``brax.positional``) stepped over a ``lax.scan`` of actions, on a
pendulum with a damped, armatured hinge and a motor, a double pendulum whose hinges hit
their joint limits (the limit forces' kinks), a slider, and a ball on a free joint
dropped onto a plane (contact forces, elasticity and friction), with respect to the
initial positions, the initial velocities, the actions and all together; a system's
parameters (link masses, joint damping, actuator gear, elasticity, gravity, the time
step) through ``sys.replace``; fluid forces (the medium's viscosity and density); the
forward kinematics (``brax.kinematics.forward``); two of brax's environments
(``inverted_pendulum`` and ``reacher``, each backend) with respect to the actions; and
``brax.math`` (quaternion products and rotations, ``normalize`` and ``safe_norm`` at a
zero vector, ``safe_arccos``/``safe_arcsin`` at +-1, ``signed_angle``,
``quat_to_euler`` at gimbal lock, ``relative_quat``, ``inv_3x3``, ``from_to`` for
parallel vectors, ``ang_to_quat`` at zero, ``quat_to_3x3``, ``orthogonals``) at generic
and edge points.

brax 0.14 prints that mujoco_warp is missing (no ``warp`` package): not used here. Its
fluid forces still call ``jnp.clip(x, a_min=...)``, which jax 0.10 no longer accepts;
the driver restores that keyword (as the herculens driver does).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from brax import envs, kinematics
from brax import math as bmath
from brax.generalized import pipeline as generalized
from brax.io import mjcf
from brax.positional import pipeline as positional
from brax.spring import pipeline as spring

jax.config.update("jax_enable_x64", True)

_jnp_clip = jnp.clip


def _clip_compat(arr, lo=None, hi=None, *, a_min=None, a_max=None, **bounds):
    """jnp.clip taking brax's ``a_min``/``a_max`` keywords, which jax 0.10 removed."""
    lo = bounds.pop("min", lo if a_min is None else a_min)
    hi = bounds.pop("max", hi if a_max is None else a_max)
    return _jnp_clip(arr, lo, hi, **bounds)


jnp.clip = _clip_compat

PIPELINES = {"generalized": generalized, "spring": spring, "positional": positional}
STEPS = 4

PENDULUM = """
<mujoco>
  <option timestep="0.01"/>
  <worldbody>
    <body pos="0 0 1">
      <joint name="h" type="hinge" axis="0 1 0" damping="0.3" armature="0.05"/>
      <geom type="capsule" size="0.05" fromto="0 0 0 0.2 0 -0.5" mass="1"/>
    </body>
  </worldbody>
  <actuator><motor joint="h" gear="2"/></actuator>
</mujoco>
"""

DOUBLE = """
<mujoco>
  <option timestep="0.01"/>
  <worldbody>
    <body pos="0 0 1">
      <joint name="a" type="hinge" axis="0 1 0" limited="true" range="-20 20" damping="0.1"/>
      <geom type="capsule" size="0.05" fromto="0 0 0 0.4 0 0" mass="1"/>
      <body pos="0.4 0 0">
        <joint name="b" type="hinge" axis="0 1 0" limited="true" range="-10 10"/>
        <geom type="capsule" size="0.05" fromto="0 0 0 0.3 0 0" mass="0.5"/>
      </body>
    </body>
  </worldbody>
  <actuator><motor joint="a" gear="1"/><motor joint="b" gear="1"/></actuator>
</mujoco>
"""

SLIDER = """
<mujoco>
  <option timestep="0.01"/>
  <worldbody>
    <body pos="0 0 1">
      <joint name="s" type="slide" axis="1 0 0" damping="0.2"/>
      <geom type="sphere" size="0.1" mass="2"/>
    </body>
  </worldbody>
  <actuator><motor joint="s" gear="1"/></actuator>
</mujoco>
"""

BALL = """
<mujoco>
  <option timestep="0.005"/>
  <worldbody>
    <geom name="floor" type="plane" size="2 2 0.1"/>
    <body pos="0 0 0.12">
      <joint type="free"/>
      <geom type="sphere" size="0.1" mass="1" friction="0.8"/>
    </body>
  </worldbody>
</mujoco>
"""

FLUID = """
<mujoco>
  <option timestep="0.01" viscosity="0.2" density="1.5"/>
  <worldbody>
    <body pos="0 0 1">
      <joint name="h" type="hinge" axis="0 1 0"/>
      <geom type="box" size="0.05 0.1 0.3" pos="0 0 -0.3" mass="1"/>
    </body>
  </worldbody>
  <actuator><motor joint="h" gear="1"/></actuator>
</mujoco>
"""

SYSTEMS = {
    name: mjcf.loads(xml)
    for name, xml in {
        "pendulum": PENDULUM,
        "double": DOUBLE,
        "slider": SLIDER,
        "ball": BALL,
    }.items()
}

RNG = np.random.default_rng(0)


def _grads(loss, args, jit, argnums_list=None):
    if argnums_list is None:
        n = len(args)
        argnums_list = [(i,) for i in range(n)] + ([tuple(range(n))] if n > 1 else [])
    for argnums in argnums_list:
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*args)


def _rollout(pipeline, sys, q0, qd0, actions):
    state = pipeline.init(sys, q0, qd0)

    def step(s, a):
        s = pipeline.step(sys, s, a)
        return s, (s.x.pos, s.qd)

    _, (pos, qd) = jax.lax.scan(step, state, actions)
    w = jnp.linspace(0.5, 1.5, pos.size).reshape(pos.shape)
    return jnp.sum(w * pos) + 0.1 * jnp.sum(qd**2)


def _start(name, edge):
    sys = SYSTEMS[name]
    q0 = jnp.asarray(sys.init_q, dtype=jnp.float64)
    qd0 = jnp.zeros(sys.qd_size())
    if name == "ball":
        # generic: falling with a spin; edge: resting exactly on the plane at rest
        if not edge:
            q0 = q0.at[2].set(0.105)
            qd0 = jnp.asarray([0.3, -0.2, -0.5, 0.4, 0.1, -0.3])
        else:
            q0 = q0.at[2].set(0.1)
    elif name == "double":
        # edge: the first hinge exactly at its limit (20 degrees), the second past its own
        if edge:
            q0 = jnp.asarray([np.deg2rad(20.0), np.deg2rad(12.0)])
            qd0 = jnp.asarray([0.5, 0.0])
        else:
            q0 = jnp.asarray([0.1, -0.05])
            qd0 = jnp.asarray([0.3, -0.4])
    else:
        if edge:
            q0 = jnp.zeros_like(q0)
        else:
            q0 = q0 + 0.3
            qd0 = qd0 + 0.2
    actions = jnp.asarray(RNG.uniform(-1.0, 1.0, size=(STEPS, sys.act_size())))
    if edge:
        actions = jnp.zeros_like(actions)
    return sys, q0, qd0, actions


# each pipeline on each system under jit (the system's parameters, the contact's and
# the environments under jit only); eagerly only the generic starts (an eager
# gradient of these rollouts compiles the same scan body and costs the same)
ROLLOUTS = [
    (name, pipeline, edge, jit)
    for name in SYSTEMS
    for pipeline in PIPELINES
    for edge in ([False, True] if name in ("double", "ball") else [False])
    for jit in ([False, True] if not edge else [True])
]


@pytest.mark.parametrize("name,pipeline,edge,jit", ROLLOUTS)
def test_rollout(name, pipeline, edge, jit):
    sys, q0, qd0, actions = _start(name, edge)
    loss = functools.partial(_rollout, PIPELINES[pipeline], sys)
    if sys.act_size() == 0:
        _grads(lambda q, qd: loss(q, qd, actions), (q0, qd0), jit)
    else:
        _grads(loss, (q0, qd0, actions), jit)


def _with_parameters(sys, mass, damping, gear, elasticity, gravity, dt):
    link = sys.link.replace(inertia=sys.link.inertia.replace(mass=sys.link.inertia.mass * mass))
    dof = sys.dof.replace(damping=sys.dof.damping + damping)
    actuator = sys.actuator.replace(gear=sys.actuator.gear * gear)
    opt = sys.opt.replace(timestep=dt, gravity=jnp.asarray([0.0, 0.0, -9.81]) * gravity)
    return sys.replace(link=link, dof=dof, actuator=actuator, elasticity=sys.elasticity + elasticity, opt=opt)


@pytest.mark.parametrize("jit", [True])
@pytest.mark.parametrize("pipeline", list(PIPELINES))
@pytest.mark.parametrize("name", ["pendulum", "double"])
def test_system_parameters(name, pipeline, jit):
    sys, q0, qd0, actions = _start(name, False)
    p = PIPELINES[pipeline]

    def loss(mass, damping, gear, gravity, dt):
        s = _with_parameters(sys, mass, damping, gear, 0.0, gravity, dt)
        return _rollout(p, s, q0, qd0, actions)

    _grads(loss, (1.3, 0.2, 1.5, 1.1, 0.01), jit)


@pytest.mark.parametrize("jit", [True])
@pytest.mark.parametrize("pipeline", list(PIPELINES))
def test_contact_parameters(pipeline, jit):
    sys, q0, qd0, actions = _start("ball", False)
    p = PIPELINES[pipeline]

    def loss(mass, elasticity, gravity, qd):
        s = _with_parameters(sys, mass, 0.0, 1.0, elasticity, gravity, 0.005)
        return _rollout(p, s, q0, qd, actions)

    _grads(loss, (1.2, 0.1, 1.0, qd0), jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("pipeline", ["generalized"])
def test_fluid(pipeline, jit):
    sys = mjcf.loads(FLUID)
    q0 = jnp.asarray([0.4])
    qd0 = jnp.asarray([1.5])
    actions = jnp.asarray(RNG.uniform(-1.0, 1.0, size=(STEPS, 1)))
    p = PIPELINES[pipeline]

    def loss(viscosity, density, q, qd):
        s = sys.replace(opt=sys.opt.replace(viscosity=viscosity, density=density))
        return _rollout(p, s, q, qd, actions)

    _grads(loss, (0.2, 1.5, q0, qd0), jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", list(SYSTEMS))
def test_forward_kinematics(name, jit):
    sys, q0, qd0, _ = _start(name, False)

    def loss(q, qd):
        x, xd = kinematics.forward(sys, q, qd)
        return jnp.sum(jnp.sin(x.pos)) + jnp.sum(x.rot**2 * 0.3) + jnp.sum(xd.vel * xd.ang)

    _grads(loss, (q0, qd0 + 0.1), jit)


@pytest.mark.parametrize("jit", [True])
@pytest.mark.parametrize("backend", ["generalized", "positional", "spring"])
@pytest.mark.parametrize("env_name", ["inverted_pendulum", "reacher"])
def test_environment(env_name, backend, jit):
    env = envs.get_environment(env_name, backend=backend)
    state0 = env.reset(jax.random.PRNGKey(0))
    actions = jnp.asarray(RNG.uniform(-0.5, 0.5, size=(3, env.action_size)))

    def loss(actions, q0):
        s = state0.replace(pipeline_state=env.pipeline_init(q0, state0.pipeline_state.qd))

        def step(s, a):
            s = env.step(s, a)
            return s, (s.reward, s.obs)

        _, (reward, obs) = jax.lax.scan(step, s, actions)
        return jnp.sum(reward) + 0.1 * jnp.sum(obs**2)

    _grads(loss, (actions, state0.pipeline_state.q), jit)


# ------------------------------------------------------------------------- brax.math
V = jnp.asarray([0.3, -0.5, 0.8])
W = jnp.asarray([-0.2, 0.7, 0.4])
Q = bmath.normalize(jnp.asarray([0.9, 0.1, -0.3, 0.2]))[0]
R = bmath.normalize(jnp.asarray([0.2, -0.6, 0.5, 0.4]))[0]
M = jnp.asarray([[2.0, 0.3, -0.1], [0.2, 1.5, 0.4], [-0.3, 0.1, 1.8]])

MATH = {
    "quat_mul": (lambda q, r: jnp.sum(bmath.quat_mul(q, r) * jnp.arange(1.0, 5.0)), (Q, R)),
    "rotate": (lambda v, q: jnp.sum(bmath.rotate(v, q) * W), (V, Q)),
    "inv_rotate": (lambda v, q: jnp.sum(bmath.inv_rotate(v, q) * W), (V, Q)),
    "vec_quat_mul": (lambda v, q: jnp.sum(bmath.vec_quat_mul(v, q) ** 2), (V, Q)),
    "quat_inv": (lambda q: jnp.sum(bmath.quat_inv(q) * jnp.arange(1.0, 5.0)), (Q,)),
    "quat_rot_axis": (lambda a, t: jnp.sum(bmath.quat_rot_axis(a, t) ** 3), (V, 0.7)),
    "quat_to_3x3": (lambda q: jnp.sum(bmath.quat_to_3x3(q) * M), (Q,)),
    "quat_to_euler": (lambda q: jnp.sum(bmath.quat_to_euler(q)), (Q,)),
    "euler_to_quat": (lambda v: jnp.sum(bmath.euler_to_quat(v * 57.0) ** 3), (V,)),
    "ang_to_quat": (lambda v: jnp.sum(bmath.ang_to_quat(v) * jnp.arange(1.0, 5.0)), (V,)),
    "quat_mul_ang": (lambda q, v: jnp.sum(bmath.quat_mul_ang(q, v) ** 2), (Q, V)),
    "relative_quat": (lambda q, r: jnp.sum(bmath.relative_quat(q, r) ** 3), (Q, R)),
    "signed_angle": (lambda a, v, w: bmath.signed_angle(a, v, w), (jnp.asarray([0.0, 0.0, 1.0]), V, W)),
    "normalize": (lambda v: jnp.sum(bmath.normalize(v)[0] * W) + bmath.normalize(v)[1], (V,)),
    "safe_norm": (lambda v: bmath.safe_norm(v), (V,)),
    "safe_arccos": (lambda x: bmath.safe_arccos(x), (0.3,)),
    "safe_arcsin": (lambda x: bmath.safe_arcsin(x), (-0.4,)),
    "inv_3x3": (lambda m: jnp.sum(bmath.inv_3x3(m) * M), (M,)),
    "from_to": (lambda v, w: jnp.sum(bmath.from_to(v, w) * jnp.arange(1.0, 5.0)), (V, W)),
    "orthogonals": (lambda v: jnp.sum(jnp.stack(bmath.orthogonals(v)) * M[:2]), (V / jnp.linalg.norm(V),)),
}

EDGE = {
    "normalize": (jnp.zeros(3),),
    "safe_norm": (jnp.zeros(3),),
    "safe_arccos": (1.0,),
    "safe_arcsin": (-1.0,),
    # gimbal lock: a rotation by pi/2 about y
    "quat_to_euler": (jnp.asarray([np.cos(np.pi / 4), 0.0, np.sin(np.pi / 4), 0.0]),),
    "ang_to_quat": (jnp.zeros(3),),
    "from_to": (V, 2.0 * V),
    "relative_quat": (Q, Q),
    "signed_angle": (jnp.asarray([0.0, 0.0, 1.0]), V, V),
    "quat_rot_axis": (V, 0.0),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name,edge", [(n, False) for n in MATH] + [(n, True) for n in EDGE])
def test_math(name, edge, jit):
    fun, args = MATH[name]
    _grads(fun, EDGE[name] if edge else args, jit)
