"""jax-fdm: the force density method for tension/compression networks and meshes,
differentiated by jax.grad eagerly and under jit, each differentiable argument alone
and all together.

Covers the linear FDM step of ``EquilibriumModel`` (dense ``jnp.linalg.solve``) and
``EquilibriumModelSparse`` (its ``custom_vjp`` sparse solve) on a small cable net with
respect to the force densities q, the support positions and the node loads, reading
every field of the equilibrium state (coordinates, residuals/reactions, lengths,
forces, loads, edge vectors); at generic q, with slack edges (q = 0), with compressed
edges (q < 0), at zero loads (where a hanging edge collapses to length 0, the kink of
the edge-length norm) and with supports that coincide with a free node's position. The
iterative, shape-dependent equilibrium of a 2x2-face mesh with face and edge loads
(follower loads and fixed ones) with the forward fixed point, jaxopt's Anderson,
optimistix's Newton and Levenberg-Marquardt solvers, with and without implicit
differentiation, with respect to q, supports and the face/edge loads (jaxopt's fixed
point, Gauss-Newton and dogleg solvers were left out for time: each iterative case takes
minutes on two shared cores).
Goals and error terms: node, edge, network and mesh goals in the squared, RMS, mean
prediction, absolute, mean absolute and log-max error terms and
the L2 regularizer, with respect to the parameters and to the goals' own targets and
weights, also with targets equal to the predictions (the kinks of abs and of log-max's
max). Constraints (edge length/force/angle, node coordinates, network-wide length and
force, vertex curvature) evaluated as the optimizer's vmapped collections. And the
optimizer's parametrisation: ``Optimizer.problem`` (whose own ``value_and_grad`` of the
flat parameter vector the probe sees too) with force-density, load, support and group
parameters, and jax.grad of ``Optimizer.loss`` at that vector.

compas 2.15.1 and jaxopt (jax-fdm's dependencies) had to be installed next to it.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax_fdm.constraints import (
    EdgeAngleConstraint,
    EdgeForceConstraint,
    EdgeLengthConstraint,
    NetworkEdgesForceConstraint,
    NetworkEdgesLengthConstraint,
    NodeZCoordinateConstraint,
    VertexCurvatureConstraint,
)
from jax_fdm.datastructures import FDMesh, FDNetwork
from jax_fdm.equilibrium import (
    EquilibriumParametersState,
    LoadState,
    model_from_sparsity,
    solver_anderson,
    solver_dogleg,
    solver_fixedpoint,
    solver_forward,
    solver_gauss_newton,
    solver_levenberg_marquardt,
    solver_newton,
    structure_from_datastructure,
)
from jax_fdm.goals import (
    EdgeAngleGoal,
    EdgeDirectionGoal,
    EdgeForceGoal,
    EdgeLengthGoal,
    EdgeLoadPathGoal,
    EdgesForceEqualGoal,
    EdgesLengthEqualGoal,
    FaceRectangularGoal,
    MeshAreaGoal,
    MeshFacesAreaEqualizeGoal,
    MeshLoadPathGoal,
    MeshPlanarityGoal,
    MeshSmoothGoal,
    MeshXYZFaceLaplacianGoal,
    MeshXYZLaplacianGoal,
    NetworkLoadPathGoal,
    NetworkSmoothGoal,
    NetworkXYZLaplacianGoal,
    NodeLineGoal,
    NodePlaneGoal,
    NodePointGoal,
    NodeResidualDirectionGoal,
    NodeResidualForceGoal,
    NodeResidualVectorGoal,
    NodesColinearGoal,
    NodeSegmentGoal,
    NodeXCoordinateGoal,
    NodeZCoordinateGoal,
    VertexNormalAngleGoal,
    VertexTangentAngleGoal,
    VertexZCoordinateGoal,
)
from jax_fdm.losses import (
    AbsoluteError,
    L2Regularizer,
    LogMaxError,
    Loss,
    MeanAbsoluteError,
    MeanPredictionError,
    MeanSquaredError,
    PredictionError,
    RootMeanSquaredError,
    SquaredError,
)
from jax_fdm.optimization import LBFGSB, SLSQP
from jax_fdm.optimization.collections import collect_constraints, collect_goals
from jax_fdm.parameters import (
    EdgeForceDensityParameter,
    EdgeGroupForceDensityParameter,
    NodeGroupLoadZParameter,
    NodeLoadZParameter,
    NodeSupportXParameter,
    NodeSupportZParameter,
)

jax.config.update("jax_enable_x64", True)


def _grads(loss, args, jit, argnums_list=None):
    if argnums_list is None:
        n = len(args)
        argnums_list = [(i,) for i in range(n)] + ([tuple(range(n))] if n > 1 else [])
    for argnums in argnums_list:
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*args)


# ----------------------------------------------------------------------- the network
# a 4x4 grid of nodes, the 12 boundary nodes supported, the 4 interior ones free, edges
# along the grid lines; node 16 hangs from support 0 by one edge (with no load it sits
# on its support: a zero-length edge)
def _network(case):
    net = FDNetwork()
    for i in range(4):
        for j in range(4):
            z = 0.3 * ((i + j) % 2) if case == "supports_raised" else 0.0
            net.add_node(4 * i + j, x=float(j), y=float(i), z=z)
    net.add_node(16, x=0.0, y=-0.5, z=-0.5)
    for i in range(4):
        for j in range(3):
            net.add_edge(4 * i + j, 4 * i + j + 1)
            net.add_edge(4 * j + i, 4 * (j + 1) + i)
    net.add_edge(0, 16)
    supports = [k for k in range(16) if k // 4 in (0, 3) or k % 4 in (0, 3)]
    net.nodes_supports(supports)
    if case == "supports_coincide":  # support 1 moved onto free node 5's plan position
        net.node_attributes(1, ["x", "y"], [1.0, 1.0])
    edges = list(net.edges())
    for n, e in enumerate(edges):
        q = 1.0 + 0.15 * n
        if case == "slack" and e in [(5, 6), (9, 10), (0, 16)]:
            q = 0.0
        if case == "compression" and e in [(5, 6), (6, 10)]:
            q = -0.4
        net.edge_forcedensity(e, q)
    if case != "zero_loads":
        for k in [5, 6, 9, 10, 16]:
            net.node_load(k, [0.1 * (k % 3), -0.05, -1.0 - 0.1 * k])
    return net


NETWORK_CASES = ["generic", "slack", "compression", "zero_loads", "supports_raised", "supports_coincide"]


def _state(model, structure, q, xyz_fixed, loads_nodes, edges=0.0, faces=0.0):
    params = EquilibriumParametersState(q, xyz_fixed, LoadState(loads_nodes, edges, faces))
    return model(params, structure)


def _state_loss(eq):
    n, m = eq.xyz.shape[0], eq.lengths.shape[0]
    wn = jnp.linspace(0.5, 1.5, 3 * n).reshape(n, 3)
    wm = jnp.linspace(0.7, 1.3, m)
    return (
        jnp.sum(wn * eq.xyz)
        + jnp.sum(wn * eq.residuals)
        + jnp.sum(wm * eq.lengths.ravel())
        + jnp.sum(wm * eq.forces.ravel())
        + 0.1 * jnp.sum(eq.loads * wn)
        + jnp.sum(eq.vectors**2)
    )


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("case", NETWORK_CASES)
def test_fdm_network(case, sparse, jit):
    net = _network(case)
    structure = structure_from_datastructure(net, sparse)
    model = model_from_sparsity(sparse=sparse, tmax=1, eta=1e-6)
    p = EquilibriumParametersState.from_datastructure(net)

    def loss(q, xyz_fixed, loads):
        return _state_loss(_state(model, structure, q, xyz_fixed, loads))

    _grads(loss, (p.q, p.xyz_fixed, p.loads.nodes), jit)


# -------------------------------------------------------------------------- the mesh
def _mesh(edge_loads=True, nx=2):
    mesh = FDMesh.from_meshgrid(dx=2.0, nx=nx)
    for v in mesh.vertices():
        if mesh.is_vertex_on_boundary(v):
            mesh.vertex_support(v)
    mesh.faces_loads([0.0, 0.0, -0.4])
    mesh.face_load(nx * nx - 1, [0.1, 0.0, -0.8])
    for n, e in enumerate(mesh.edges()):
        mesh.edge_forcedensity(e, 1.0 + 0.1 * n)
        if edge_loads and n % 5 == 0:
            mesh.edge_load(e, [0.0, 0.05, -0.2])
    for v in mesh.vertices():
        if not mesh.is_vertex_support(v):
            mesh.vertex_load(v, [0.0, 0.0, -0.1])
    return mesh


SOLVERS = {
    "forward": solver_forward,
    "fixedpoint": solver_fixedpoint,
    "anderson": solver_anderson,
    "newton": solver_newton,
    "gauss_newton": solver_gauss_newton,
    "levenberg_marquardt": solver_levenberg_marquardt,
    "dogleg": solver_dogleg,
}


MESH_CASES = {  # solver, follower loads, implicit differentiation
    "forward-local-implicit": ("forward", True, True),
    "forward-local-unrolled": ("forward", True, False),
    "forward-fixed-implicit": ("forward", False, True),
    "anderson-local-implicit": ("anderson", True, True),
    "newton-local-implicit": ("newton", True, True),
    "levenberg_marquardt-local-unrolled": ("levenberg_marquardt", True, False),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("case", list(MESH_CASES))
def test_fdm_mesh_iterative(case, jit):
    solver, local, implicit = MESH_CASES[case]
    mesh = _mesh()
    structure = structure_from_datastructure(mesh, False)
    model = model_from_sparsity(
        sparse=False, tmax=4, eta=1e-10, is_load_local=local, itersolve_fn=SOLVERS[solver], implicit_diff=implicit
    )
    p = EquilibriumParametersState.from_datastructure(mesh)

    def loss(q, xyz_fixed, faces, edges):
        return _state_loss(_state(model, structure, q, xyz_fixed, p.loads.nodes, edges, faces))

    args = (p.q, p.xyz_fixed, p.loads.faces, p.loads.edges)
    _grads(loss, args, jit, [(0,), (1,), (2,), (3,), (0, 1, 2, 3)])


@pytest.mark.parametrize("jit", [False, True])
def test_fdm_mesh_sparse_forward(jit):
    """The sparse model in the iterative solve (forward fixed point; jax-fdm's Newton
    solvers batch the sparse matrix product, which jax cannot)."""
    mesh = _mesh(edge_loads=False)
    structure = structure_from_datastructure(mesh, True)
    model = model_from_sparsity(sparse=True, tmax=3, eta=1e-10, is_load_local=True)
    p = EquilibriumParametersState.from_datastructure(mesh)

    def loss(q, xyz_fixed, faces):
        return _state_loss(_state(model, structure, q, xyz_fixed, p.loads.nodes, 0.0, faces))

    _grads(loss, (p.q, p.xyz_fixed, p.loads.faces), jit)


# ------------------------------------------------------------------- goals and errors
ERRORS = {
    "squared": SquaredError,
    "mean_squared": MeanSquaredError,
    "rms": RootMeanSquaredError,
    "prediction": PredictionError,
    "mean_prediction": MeanPredictionError,
    "absolute": AbsoluteError,
    "mean_absolute": MeanAbsoluteError,
    "logmax": LogMaxError,
}


def _network_goals(net, exact):
    """Goals on the generic network; with ``exact`` the scalar and point goals' targets
    are the equilibrium's own values (errors at the kinks of abs and max)."""
    eq = None
    if exact:
        structure = structure_from_datastructure(net, False)
        model = model_from_sparsity(sparse=False, tmax=1, eta=1e-6)
        eq = model(EquilibriumParametersState.from_datastructure(net), structure)
        nidx = {k: i for i, k in enumerate(net.nodes())}
        eidx = {e: i for i, e in enumerate(net.edges())}

    def tgt(default, fn):
        return fn() if exact else default

    return [
        NodePointGoal(5, target=tgt([1.0, 1.0, -0.5], lambda: eq.xyz[nidx[5]])),
        NodeZCoordinateGoal(6, target=tgt(-0.7, lambda: eq.xyz[nidx[6], 2])),
        NodeXCoordinateGoal(9, target=tgt(1.1, lambda: eq.xyz[nidx[9], 0])),
        NodeLineGoal(10, target=[[0.0, 0.0, -1.0], [3.0, 3.0, -0.2]]),
        NodePlaneGoal(9, target=[[0.0, 0.0, -0.6], [0.1, 0.2, 1.0]]),
        NodeSegmentGoal(6, target=[[0.0, 3.0, -1.0], [3.0, 0.0, 0.0]]),
        NodeResidualForceGoal(0, target=tgt(0.5, lambda: jnp.linalg.norm(eq.residuals[nidx[0]]))),
        NodeResidualVectorGoal(3, target=[0.0, 0.1, 0.3]),
        NodeResidualDirectionGoal(12, target=[0.0, 0.0, 1.0]),
        EdgeLengthGoal((5, 6), target=tgt(1.2, lambda: eq.lengths.ravel()[eidx[(5, 6)]])),
        EdgeForceGoal((6, 10), target=tgt(2.0, lambda: eq.forces.ravel()[eidx[(6, 10)]])),
        EdgeLoadPathGoal((9, 10), target=1.5),
        EdgeDirectionGoal((1, 5), target=[0.0, 1.0, -1.0]),
        EdgeAngleGoal((2, 6), target=0.4, vector=[0.0, 0.0, 1.0]),
        EdgesLengthEqualGoal([(5, 6), (9, 10), (5, 9)]),
        EdgesForceEqualGoal([(5, 6), (6, 10)]),
        NodesColinearGoal([4, 5, 6, 7]),
        NetworkLoadPathGoal(target=10.0),
        NetworkSmoothGoal(),
        NetworkXYZLaplacianGoal(weight=0.3),
    ]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("error", ["squared", "rms", "mean_prediction", "absolute", "logmax"])
def test_network_goals(error, exact, jit):
    net = _network("generic")
    structure = structure_from_datastructure(net, False)
    model = model_from_sparsity(sparse=False, tmax=1, eta=1e-6)
    p = EquilibriumParametersState.from_datastructure(net)
    collections = collect_goals(_network_goals(net, exact))
    dyn, static = eqx.partition(collections, eqx.is_inexact_array)
    term = ERRORS[error](goals=_network_goals(net, exact), alpha=0.7)
    loss_fn = Loss(term, L2Regularizer(alpha=0.01))

    def loss(q, xyz_fixed, loads, dyn):
        term.collections = eqx.combine(dyn, static)
        params = EquilibriumParametersState(q, xyz_fixed, LoadState(loads, 0.0, 0.0))
        return loss_fn(params, model, structure)

    _grads(loss, (p.q, p.xyz_fixed, p.loads.nodes, dyn), jit, [(0,), (1,), (2,), (3,), (0, 1, 2, 3)])


def _mesh_goals(mesh):
    free = [v for v in mesh.vertices() if not mesh.is_vertex_support(v)]
    return [
        MeshPlanarityGoal(),
        MeshAreaGoal(target=30.0),
        MeshFacesAreaEqualizeGoal(),
        MeshLoadPathGoal(target=5.0),
        MeshSmoothGoal(),
        MeshXYZLaplacianGoal(),
        MeshXYZFaceLaplacianGoal(),
        FaceRectangularGoal(4),
        FaceRectangularGoal(0, weight=0.5),
        VertexNormalAngleGoal(free[0], target=0.2, vector=[0.0, 0.0, 1.0]),
        VertexTangentAngleGoal(free[1], target=0.3, vector=[0.0, 0.0, 1.0]),
        VertexZCoordinateGoal(free[2], target=-1.0),
    ]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("error", ["mean_absolute"])
def test_mesh_goals(error, jit):
    mesh = _mesh(nx=3)
    structure = structure_from_datastructure(mesh, False)
    model = model_from_sparsity(sparse=False, tmax=1, eta=1e-10)
    p = EquilibriumParametersState.from_datastructure(mesh)
    collections = collect_goals(_mesh_goals(mesh))
    dyn, static = eqx.partition(collections, eqx.is_inexact_array)
    term = ERRORS[error](goals=_mesh_goals(mesh))
    loss_fn = Loss(term)

    def loss(q, xyz_fixed, faces, dyn):
        term.collections = eqx.combine(dyn, static)
        params = EquilibriumParametersState(q, xyz_fixed, LoadState(p.loads.nodes, p.loads.edges, faces))
        return loss_fn(params, model, structure)

    _grads(loss, (p.q, p.xyz_fixed, p.loads.faces, dyn), jit)


# ------------------------------------------------------------------------ constraints
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("case", ["generic", "slack", "zero_loads"])
def test_network_constraints(case, jit):
    net = _network(case)
    structure = structure_from_datastructure(net, False)
    model = model_from_sparsity(sparse=False, tmax=1, eta=1e-6)
    p = EquilibriumParametersState.from_datastructure(net)
    constraints = [
        EdgeLengthConstraint((5, 6), bound_low=0.5, bound_up=2.0),
        EdgeLengthConstraint((0, 16), bound_low=0.0, bound_up=2.0),
        EdgeForceConstraint((6, 10), bound_low=0.0, bound_up=5.0),
        EdgeAngleConstraint((1, 5), vector=[0.0, 0.0, 1.0], bound_low=0.0, bound_up=1.0),
        NodeZCoordinateConstraint(5, bound_low=-2.0, bound_up=0.0),
        NetworkEdgesLengthConstraint(bound_low=0.0, bound_up=3.0),
        NetworkEdgesForceConstraint(bound_low=-1.0, bound_up=9.0),
    ]
    collections = collect_constraints(constraints)

    def loss(q, xyz_fixed, loads):
        eq = _state(model, structure, q, xyz_fixed, loads)
        total = 0.0
        for c in collections:
            vals = jax.vmap(lambda k: k(eq, structure))(c)
            total = total + jnp.sum(vals * jnp.linspace(0.5, 1.5, vals.size).reshape(vals.shape))
        return total

    _grads(loss, (p.q, p.xyz_fixed, p.loads.nodes), jit)


@pytest.mark.parametrize("jit", [False, True])
def test_vertex_curvature_constraint(jit):
    mesh = _mesh(edge_loads=False, nx=3)
    structure = structure_from_datastructure(mesh, False)
    model = model_from_sparsity(sparse=False, tmax=1, eta=1e-6)
    p = EquilibriumParametersState.from_datastructure(mesh)
    free = [v for v in mesh.vertices() if not mesh.is_vertex_support(v)]
    constraints = [
        VertexCurvatureConstraint(v, polygon=mesh.vertex_neighbors(v, ordered=True), bound_low=-1.0, bound_up=1.0)
        for v in free
    ]
    collections = collect_constraints(constraints)

    def loss(q, xyz_fixed, loads):
        eq = _state(model, structure, q, xyz_fixed, loads)
        return sum(jnp.sum(jax.vmap(lambda k: k(eq, structure))(c) ** 2) for c in collections)

    _grads(loss, (p.q, p.xyz_fixed, p.loads.nodes), jit)


# --------------------------------------------------------------- the parametrisation
PARAMETERS = {
    "force_densities": lambda net: [EdgeForceDensityParameter(e, -5.0, 10.0) for e in net.edges()],
    "mixed": lambda net: (
        [EdgeForceDensityParameter(e, 0.0, 10.0) for e in [(5, 6), (6, 10), (0, 16)]]
        + [
            NodeLoadZParameter(5, -3.0, 0.0),
            NodeLoadZParameter(16, -3.0, 0.0),
            NodeSupportXParameter(3, 2.0, 4.0),
            NodeSupportZParameter(12, -1.0, 1.0),
        ]
    ),
    "groups": lambda net: [
        EdgeGroupForceDensityParameter([(5, 6), (9, 10)], 0.0, 10.0),
        EdgeGroupForceDensityParameter([(5, 9), (6, 10)], 0.0, 10.0),
        NodeGroupLoadZParameter([5, 6, 9, 10], -3.0, 0.0),
    ],
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("params", list(PARAMETERS))
def test_optimizer_parametrization(params, jit):
    net = _network("generic")
    structure = structure_from_datastructure(net, False)
    model = model_from_sparsity(sparse=False, tmax=1, eta=1e-6)
    goals = [
        NodePointGoal(5, target=[1.0, 1.0, -0.5]),
        EdgeLengthGoal((5, 6), target=1.2),
        NetworkLoadPathGoal(target=10.0),
    ]
    loss = Loss(SquaredError(goals), L2Regularizer(alpha=0.01))
    opt = LBFGSB()
    problem = opt.problem(
        model, structure, net, loss, PARAMETERS[params](net), None, 1, 1e-6, None, jit
    )  # takes its own value_and_grad
    x0 = problem.x0

    def f(x):
        return opt.loss(x, loss, model, structure)

    _grads(f, (x0,), jit)
    _grads(f, (jnp.clip(x0 * 0.0, opt.pm.bounds_low, opt.pm.bounds_up),), jit)  # at q = 0 (slack)


@pytest.mark.parametrize("jit", [False, True])
def test_slsqp_constraints_problem(jit):
    net = _network("generic")
    structure = structure_from_datastructure(net, False)
    model = model_from_sparsity(sparse=False, tmax=1, eta=1e-6)
    loss = Loss(MeanSquaredError([NodeZCoordinateGoal(5, target=-0.8)]))
    opt = SLSQP()
    constraints = [
        EdgeLengthConstraint((5, 6), bound_low=0.5, bound_up=2.0),
        NodeZCoordinateConstraint(6, bound_low=-2.0, bound_up=0.0),
    ]
    problem = opt.problem(model, structure, net, loss, None, constraints, 1, 1e-6, None, jit)

    def f(x):
        return opt.loss(x, loss, model, structure)

    _grads(f, (problem.x0,), jit)
