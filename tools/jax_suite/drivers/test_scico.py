"""scico: functionals, proximal operators, losses, linear operators and a few optimizer
iterations differentiated by jax.grad, eagerly and under jit (float64). The norms and
functionals (L1, squared L2, L2, L2,1 over an axis, over all and over BlockArray
blocks, L1 - L2, separable and non-separable Huber, nuclear, anisotropic and isotropic
TV with circular and zero boundaries, scaled, summed, composed with a linear operator,
separable over a BlockArray, proximal averages, set distances) with respect to the
point and to their continuous parameters (beta, delta, scale, radius); their proximal
operators (those and L0, the non-negative and L2-ball indicators, TV's Haar-shrinkage
approximation) with respect to the point, lam and the parameter, at generic points, at
entries on the threshold |v| = lam and at zero, with norm(v) = lam and with lam large
enough to zero everything; losses (weighted squared L2 with identity, diagonal and
matrix operators, Poisson, squared L2 of |Ax| and |Ax|^2) and their proxes (diagonal,
closed-form and cubic-root proxes, conjugate gradient) with respect to the point, the
data and the weights; linear operators (finite differences with each boundary option,
circular and direct convolutions with the kernel traced, DFT, diagonal, matrix,
pad/crop/slice/sum/reshape/transpose, stacks, gradients in cartesian, polar and
cylindrical coordinates, compositions, adjoints, operators from functions, Jacobian
operators, biconvolution, Abs/Exp operators) with respect to the input and the
operator's array; and a few iterations of PGM and accelerated PGM (fixed, BB, adaptive
BB and line-search step sizes), ADMM (linear-CG, matrix and circular-convolution
subproblem solvers), linearized ADMM, PDHG and proximal ADMM with respect to the data
and the regularisation weight. Conjugate-gradient paths use a Python while loop on the
residual (jax cannot jit them), so they run eagerly only."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scico.functional as fn
import scico.linop as lo
import scico.loss as L
import scico.numpy as snp
import scico.operator as op
from scico.optimize import ADMM, PDHG, PGM, AcceleratedPGM, LinearizedADMM, ProximalADMM
from scico.optimize.admm import CircularConvolveSolver, LinearSubproblemSolver, MatrixSubproblemSolver
from scico.optimize.pgm import AdaptiveBBStepSize, BBStepSize, LineSearchStepSize, RobustLineSearchStepSize

jax.config.update("jax_enable_x64", True)
warnings.filterwarnings("ignore")
F64 = np.float64
_rng = np.random.default_rng(1)
SHAPE = (4, 5)
X = jnp.asarray(_rng.normal(size=SHAPE))
WT = jnp.asarray(_rng.normal(size=SHAPE))
_xz = np.array(X)
_xz[0, :] = 0.0  # a zero column-free row: kinks of |x|, a zero row for L2,1 over axis 1
_xz[1, 1] = 0.0
_xz[2, 2] = -_xz[2, 3]  # |x| tie
X_ZEROS = jnp.asarray(_xz)
_xt = np.array(X)
_xt[0, 0], _xt[1, 2], _xt[3, 4] = 1.0, -1.0, 1.0  # on Huber's delta = 1
_xt[2, :] = 0.7  # tied maxima for L1 - L2's argmax
X_TIES = jnp.asarray(_xt)
POINTS = {"generic": X, "zeros": X_ZEROS, "ties": X_TIES}


def _run(loss, args, argnums_list, jit):
    for argnums in argnums_list:
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*args)


def _argnums(n):
    """Each argument alone and all together."""
    alone = [(i,) for i in range(n)]
    return alone if n == 1 else alone + [tuple(range(n))]


def _tv(cls, circular, **kw):
    return cls(circular=circular, input_shape=SHAPE, input_dtype=F64, **kw)


# name -> (constructor of the functional from a traced parameter, parameter or None)
FUNCTIONALS = {
    "l1": (lambda p: fn.L1Norm(), None),
    "squared_l2": (lambda p: fn.SquaredL2Norm(), None),
    "l2": (lambda p: fn.L2Norm(), None),
    "l21_axis0": (lambda p: fn.L21Norm(l2_axis=0), None),
    "l21_axis1": (lambda p: fn.L21Norm(l2_axis=1), None),
    "l1_minus_l2": (lambda p: fn.L1MinusL2Norm(beta=p), 0.6),
    "huber_sep": (lambda p: fn.HuberNorm(delta=p, separable=True), 1.0),
    "huber_nonsep": (lambda p: fn.HuberNorm(delta=p, separable=False), 3.0),
    "nuclear": (lambda p: fn.NuclearNorm(), None),
    "scaled_l1": (lambda p: p * fn.L1Norm(), 2.5),
    "sum": (lambda p: fn.L1Norm() + p * fn.SquaredL2Norm(), 0.7),  # no prox
    "proximal_average": (
        lambda p: fn.ProximalAverage([fn.L1Norm(), fn.SquaredL2Norm()], [0.3, 0.9], no_inf_eval=False),
        None,
    ),
    "set_distance": (lambda p: fn.SetDistance(fn.NonNegativeIndicator().prox), None),
    "squared_set_distance": (lambda p: fn.SquaredSetDistance(fn.L2BallIndicator(p).prox), 1.5),
    "anisotropic_tv": (lambda p: _tv(fn.AnisotropicTVNorm, True), None),
    "anisotropic_tv_zero": (lambda p: _tv(fn.AnisotropicTVNorm, False), None),
    "isotropic_tv": (lambda p: _tv(fn.IsotropicTVNorm, True), None),
    "isotropic_tv_zero_axis": (lambda p: _tv(fn.IsotropicTVNorm, False, axes=(1,)), None),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", list(POINTS))
@pytest.mark.parametrize("name", list(FUNCTIONALS))
def test_functional(name, point, jit):
    make, p = FUNCTIONALS[name]
    if p is None:  # built outside the trace (scico builds TV's operators from concrete shapes)
        f = make(None)
        _run(lambda x: f(x), (POINTS[point],), _argnums(1), jit)
    else:
        _run(lambda x, p: make(p)(x), (POINTS[point], jnp.asarray(p)), _argnums(2), jit)


@pytest.mark.parametrize("jit", [False, True])
def test_functional_composed_separable(jit):
    D = lo.FiniteDifference(input_shape=SHAPE, input_dtype=F64, append=0)

    def loss(x, y):
        composed = fn.ComposedFunctional(fn.L21Norm(l2_axis=0), D)  # isotropic TV by hand
        sep = fn.SeparableFunctional([fn.L1Norm(), fn.HuberNorm(0.5)])
        b = snp.blockarray([x, y])
        return composed(x) + sep(b) + fn.L21Norm(l2_axis=None)(b) + fn.L2Norm()(b)

    _run(loss, (X, X_ZEROS[:, :3]), _argnums(2), jit)


# prox points: (v, lam); entries on |v| = lam and at 0, norm(v) = lam, lam above everything
_vt = np.array(X)
_vt[0, :3] = (0.4, -0.4, 0.0)
_vt[1, 0] = 0.4
_vt[2, :] = 0.0
PROX_POINTS = {
    "generic": (X, 0.4),
    "threshold": (jnp.asarray(_vt), 0.4),
    "norm_eq_lam": (X, float(jnp.linalg.norm(X))),
    "large_lam": (X, 50.0),
}
PROXES = dict(FUNCTIONALS)
del PROXES["set_distance"], PROXES["squared_set_distance"], PROXES["sum"]
PROXES.update(
    {
        "l0": (lambda p: fn.L0Norm(), None),
        "nonnegative": (lambda p: fn.NonNegativeIndicator(), None),
        "l2_ball": (lambda p: fn.L2BallIndicator(radius=p), 1.2),
        "set_distance": (lambda p: fn.SetDistance(fn.L2BallIndicator(p).prox), 1.5),
        "squared_set_distance": (lambda p: fn.SquaredSetDistance(fn.NonNegativeIndicator().prox), None),
        "squared_l2_loss": (lambda p: L.SquaredL2Loss(y=p * jnp.ones(SHAPE)), 0.3),
    }
)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", list(PROX_POINTS))
@pytest.mark.parametrize("name", list(PROXES))
def test_prox(name, point, jit):
    if name == "set_distance" and jit:
        pytest.skip("SetDistance.prox branches in Python on the distance")
    make, p = PROXES[name]
    v, lam = PROX_POINTS[point]
    fixed = make(None) if p is None else None

    def loss(v, lam, *p):
        out = (fixed if p == () else make(p[0])).prox(v, lam)
        return jnp.sum(jnp.sin(out) * WT)

    args = (v, jnp.asarray(lam)) + (() if p is None else (jnp.asarray(p),))
    _run(loss, args, _argnums(len(args)), jit)


@pytest.mark.parametrize("jit", [False, True])
def test_prox_blockarray(jit):
    def loss(x, y, lam):
        b = snp.blockarray([x, y])
        sep = fn.SeparableFunctional([fn.L1Norm(), fn.L2Norm()])
        out = sep.prox(b, lam)
        out2 = fn.L21Norm(l2_axis=None).prox(b, lam)
        return jnp.sum(jnp.sin(out[0]) * WT) + jnp.sum(out[1] ** 3) + jnp.sum(jnp.cos(out2[0])) + jnp.sum(out2[1])

    _run(loss, (X_ZEROS, X[:2], jnp.asarray(0.4)), _argnums(3), jit)


def _y(shape, seed, positive=False):
    r = np.random.default_rng(seed).normal(size=shape)
    return jnp.asarray(np.abs(r) + 0.5 if positive else r)


MAT = _y((6, 5), 2)


def _loss_case(name, y, d, w):
    """A loss with data y, operator array d (diagonal or matrix entries), weights w (None:
    unweighted; scico checks the weights in Python, so none under jit)."""
    W = None if w is None else lo.Diagonal(w)
    if name == "squared_l2_identity":
        return L.SquaredL2Loss(y=y, W=W)
    if name == "squared_l2_diagonal":
        return L.SquaredL2Loss(y=y, A=lo.Diagonal(d), W=W, scale=0.7)
    if name == "squared_l2_matrix":
        return L.SquaredL2Loss(y=y, A=lo.MatrixOperator(d), W=W)
    if name == "poisson":
        return L.PoissonLoss(y=y, A=lo.Diagonal(d))
    if name == "squared_l2_abs":
        return L.SquaredL2AbsLoss(y=y, W=W)
    if name == "squared_l2_squared_abs":
        return L.SquaredL2SquaredAbsLoss(y=y, W=W)
    raise KeyError(name)


LOSSES = [
    "squared_l2_identity",
    "squared_l2_diagonal",
    "squared_l2_matrix",
    "poisson",
    "squared_l2_abs",
    "squared_l2_squared_abs",
]


def _loss_args(name):
    if name == "squared_l2_matrix":
        return _y(6, 3), MAT, _y(6, 4, positive=True), _y(5, 5)
    # x with a zero entry (|x| kinks; the abs-losses' prox branches at 0)
    x = _y(5, 5, positive=True) if name == "poisson" else _y(5, 5).at[1].set(0.0)
    return _y(5, 3, positive=True), _y(5, 6, positive=True), _y(5, 4, positive=True), x


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", LOSSES)
def test_loss_eval(name, jit):
    """Weighted eagerly only: scico checks the weights (snp.all(w >= 0)) in Python."""
    if name.endswith("abs") and jit:
        pytest.skip("the |Ax| losses check y >= 0 in Python")
    y, d, w0, x = _loss_args(name)
    w0 = None if jit else w0
    uses_d = name in ("squared_l2_diagonal", "squared_l2_matrix", "poisson")

    def loss(x, y, *rest):
        rest = list(rest)
        d_ = rest.pop(0) if uses_d else d
        w_ = rest.pop(0) if rest else w0
        return _loss_case(name, y, d_, w_)(x)

    args = (x, y) + ((d,) if uses_d else ()) + (() if jit or name == "poisson" else (w0,))
    _run(loss, args, _argnums(len(args)), jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", [n for n in LOSSES if n != "poisson"])
def test_loss_prox(name, jit):
    if name == "squared_l2_matrix" and jit:
        pytest.skip("its prox runs scico's CG, a Python while loop on the residual")
    if name.endswith("abs") and jit:
        pytest.skip("the |Ax| losses check y >= 0 in Python")
    y, d, w0, x = _loss_args(name)
    w0 = None if jit else w0

    def loss(v, lam, y, *w):
        out = _loss_case(name, y, d, w[0] if w else w0).prox(v, lam)
        return jnp.sum(jnp.sin(out))

    args = (x, jnp.asarray(0.6), y) + (() if jit else (w0,))
    _run(loss, args, _argnums(len(args)), jit)


IMG = jnp.asarray(_rng.normal(size=(6, 7)))
KERNEL = jnp.asarray(_rng.normal(size=(3, 3)))

# name -> (operator from its traced array, that array or None, input)
LINOPS = {
    "fd_all": (lambda h: lo.FiniteDifference(IMG.shape, F64), None, IMG),
    "fd_circular": (lambda h: lo.FiniteDifference(IMG.shape, F64, circular=True), None, IMG),
    "fd_prepend_append": (lambda h: lo.FiniteDifference(IMG.shape, F64, axes=(1,), prepend=0, append=1), None, IMG),
    "single_axis_fd": (lambda h: lo.SingleAxisFiniteDifference(IMG.shape, F64, axis=0, append=0), None, IMG),
    "circular_convolve": (lambda h: lo.CircularConvolve(h, IMG.shape, input_dtype=F64), KERNEL, IMG),
    "circular_convolve_centered": (
        lambda h: lo.CircularConvolve(h, IMG.shape, input_dtype=F64, h_center=(1, 1)),
        KERNEL,
        IMG,
    ),
    "convolve_full": (lambda h: lo.Convolve(h, IMG.shape, F64, mode="full"), KERNEL, IMG),
    "convolve_same": (lambda h: lo.Convolve(h, IMG.shape, F64, mode="same"), KERNEL, IMG),
    "convolve_by_x": (lambda h: lo.ConvolveByX(h, (4, 4), F64, mode="valid"), KERNEL, IMG[:4, :4]),
    # DFT's input dtype is complex64 whatever x64 says: its input is cast below
    "dft": (lambda h: lo.DFT(IMG.shape, norm="ortho"), None, IMG),
    "dft_axes": (lambda h: lo.DFT(IMG.shape, axes=(1,), axes_shape=(9,)), None, IMG),
    "diagonal": (lambda h: lo.Diagonal(h), IMG * 0.5 + 1.0, IMG),
    "scaled_identity": (lambda h: lo.ScaledIdentity(h, IMG.shape, F64), jnp.asarray(1.7), IMG),
    "matrix": (lambda h: lo.MatrixOperator(h, input_cols=7), _y((6, 6), 7), IMG),
    "pad_zero": (lambda h: lo.Pad(IMG.shape, input_dtype=F64, pad_width=2), None, IMG),
    "pad": (lambda h: lo.Pad(IMG.shape, input_dtype=F64, pad_width=((1, 2), (0, 1)), mode="edge"), None, IMG),
    "crop": (lambda h: lo.Crop(((1, 1), (2, 0)), IMG.shape, F64), None, IMG),
    "slice": (lambda h: lo.Slice(np.s_[1:5:2, 3:], IMG.shape, F64), None, IMG),
    "sum": (lambda h: lo.Sum(IMG.shape, input_dtype=F64, axis=1), None, IMG),
    "reshape": (lambda h: lo.Reshape(IMG.shape, (3, 14), input_dtype=F64), None, IMG),
    "transpose": (lambda h: lo.Transpose(IMG.shape, (1, 0), input_dtype=F64), None, IMG),
    "vertical_stack": (
        lambda h: lo.VerticalStack([lo.Diagonal(h), lo.FiniteDifference(IMG.shape, F64, axes=(0,))]),
        IMG * 0.3,
        IMG,
    ),
    "vertical_stack_collapse": (
        lambda h: lo.VerticalStack([lo.Diagonal(h), lo.Identity(IMG.shape, F64)], collapse_output=True),
        IMG * 0.3,
        IMG,
    ),
    "projected_gradient": (lambda h: lo.ProjectedGradient(IMG.shape, input_dtype=F64), None, IMG),
    "polar_gradient": (lambda h: lo.PolarGradient(IMG.shape, input_dtype=F64), None, IMG),
    "polar_gradient_cdiff": (
        lambda h: lo.PolarGradient(IMG.shape, center=(2.5, 3.0), cdiff=True, input_dtype=F64),
        None,
        IMG,
    ),
    "composed": (
        lambda h: lo.FiniteDifference(IMG.shape, F64, circular=True) @ lo.Diagonal(h) @ lo.Identity(IMG.shape, F64),
        IMG + 2.0,
        IMG,
    ),
    "sum_of_operators": (
        lambda h: (
            0.5 * lo.Diagonal(h) - lo.CircularConvolve(KERNEL, IMG.shape, input_dtype=F64) + lo.Identity(IMG.shape, F64)
        ),
        IMG,
        IMG,
    ),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", list(LINOPS))
def test_linop(name, jit):
    if name == "crop" and jit:
        pytest.skip("Crop's output_shape holds jax scalars: its adjoint's shape check fails under jit")
    make, h, x = LINOPS[name]
    fixed = make(None) if h is None else None  # built outside the trace

    def loss(x, *h):
        A = fixed if h == () else make(h[0])
        out = A(x.astype(jnp.complex64) if name.startswith("dft") else x)
        back = A.adj(out * 0.5) if not name.startswith("vertical") else A.adj(out)
        tot = snp.sum(snp.real(snp.sin(out) * snp.conj(out)))
        return tot + snp.sum(snp.real(back) * x) + snp.sum(snp.abs(A.H(out)) ** 2) * 0.1

    args = (x,) + (() if h is None else (h,))
    _run(loss, args, _argnums(len(args)), jit)


@pytest.mark.parametrize("jit", [False, True])
def test_diagonal_stack_blockarray(jit):
    def loss(x, y, d):
        A = lo.DiagonalStack([lo.Diagonal(d), lo.FiniteDifference((3,), F64)])
        out = A(snp.blockarray([x, y]))
        back = A.T(out)
        R = lo.DiagonalReplicated(lo.Diagonal(d), replicates=2, input_axis=0)
        return snp.sum(snp.sin(out)) + snp.sum(back * back) + jnp.sum(R(jnp.stack([x, 2 * x])) ** 2)

    _run(loss, (X[0], X[1, :3], X[2] + 2.0), _argnums(3), jit)


@pytest.mark.parametrize("jit", [False, True])
def test_linop_from_function_and_jacobian(jit):
    Transposer = lo.linop_from_function(jnp.transpose, "Transposer")
    Rot = lo.linop_from_function(lambda x, k: jnp.rot90(x, k), "Rot")

    def loss(x, u):
        A = Transposer(x.shape[::-1], input_dtype=F64) @ Rot(x.shape, 1, input_dtype=F64)
        F = op.Exp(u.shape, input_dtype=F64) * 1.5
        J = lo.jacobian(op.Abs(u.shape, input_dtype=F64) + F, u)  # a LinearOperator at u
        return jnp.sum(jnp.sin(A(x)) * A.adj(A(x))) + jnp.sum(J(jnp.cos(u)) * J.adj(u))

    _run(loss, (IMG, X_ZEROS[1] + 0.3), _argnums(2), jit)


@pytest.mark.parametrize("jit", [False, True])
def test_operators(jit):
    def loss(x, h):
        B = op.BiConvolve(input_shape=((4, 4), (3, 3)), input_dtype=F64, mode="same")
        out = B(snp.blockarray([x, h]))
        E = op.Exp(x.shape, input_dtype=F64)
        A = op.Abs(x.shape, input_dtype=F64)
        return jnp.sum(jnp.sin(out)) + jnp.sum(E(x * 0.3)) + jnp.sum(A(x - 0.1) * x) + jnp.sum((2.0 * A)(x))

    _run(loss, (IMG[:4, :4], KERNEL), _argnums(2), jit)


Y_DATA = jnp.asarray(_rng.normal(size=6))
OPT = jnp.asarray(_rng.normal(size=(6, 5)))


def _pgm(y, lam, cls, step):
    f = L.SquaredL2Loss(y=y, A=lo.MatrixOperator(OPT))
    g = lam * fn.L1Norm()
    kwargs = {} if step is None else {"step_size": step()}
    s = cls(f=f, g=g, L0=30.0, x0=jnp.full(5, 0.1), maxiter=4, itstat_options={"display": False}, **kwargs)
    return s.solve()


PGMS = {
    "pgm": (PGM, None),
    "pgm_bb": (PGM, BBStepSize),
    "pgm_adaptive_bb": (PGM, AdaptiveBBStepSize),
    "apgm": (AcceleratedPGM, None),
    "apgm_line_search": (AcceleratedPGM, LineSearchStepSize),
    "apgm_robust_line_search": (AcceleratedPGM, RobustLineSearchStepSize),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", list(PGMS))
def test_pgm(name, jit):
    cls, step = PGMS[name]
    if step is not None and jit:
        pytest.skip("the BB and line-search step sizes branch in Python on values")

    def loss(y, lam):
        return jnp.sum(jnp.sin(_pgm(y, lam, cls, step)))

    _run(loss, (Y_DATA, jnp.asarray(0.3)), _argnums(2), jit)


def _admm(y, lam, solver):
    if solver == "circular":
        h = jnp.asarray([[0.1, 0.7, 0.2]])
        A = lo.CircularConvolve(h, (1, 6), input_dtype=F64)
        f = L.SquaredL2Loss(y=y.reshape(1, 6), A=A)
        C = lo.CircularConvolve(jnp.asarray([[1.0, -1.0]]), (1, 6), input_dtype=F64)
        x0 = jnp.full((1, 6), 0.2)
        sub = CircularConvolveSolver()
    else:
        f = L.SquaredL2Loss(y=y, A=lo.MatrixOperator(OPT))
        C = lo.FiniteDifference(input_shape=(5,), input_dtype=F64, append=0)
        if solver == "matrix":
            C = lo.MatrixOperator(np.eye(5, k=1)[:4] - np.eye(5)[:4])  # needs a matrix C
        x0 = jnp.linspace(0.1, 0.5, 5)
        sub = (
            LinearSubproblemSolver(cg_kwargs={"tol": 1e-10, "maxiter": 30})
            if solver == "cg"
            else MatrixSubproblemSolver()
        )
    s = ADMM(
        f=f,
        g_list=[lam * fn.L1Norm()],
        C_list=[C],
        rho_list=[1.0],
        x0=x0,
        maxiter=3,
        subproblem_solver=sub,
        itstat_options={"display": False},
    )
    return s.solve()


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("solver", ["cg", "matrix", "circular"])
def test_admm(solver, jit):
    if solver == "cg" and jit:
        pytest.skip("scico's CG is a Python while loop on the residual")
    if solver == "circular" and jit:
        pytest.skip("CircularConvolveSolver converts the data to numpy")

    def loss(y, lam):
        return jnp.sum(jnp.sin(_admm(y, lam, solver)))

    _run(loss, (Y_DATA, jnp.asarray(0.3)), _argnums(2), jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("method", ["ladmm", "pdhg", "padmm"])
def test_primal_dual(method, jit):
    def loss(y, lam):
        f = L.SquaredL2Loss(y=y)  # an identity operator: a closed-form prox
        D = lo.FiniteDifference(input_shape=y.shape, input_dtype=F64, append=0)
        g = lam * fn.L1Norm()
        x0 = jnp.linspace(0.1, 0.5, D.input_shape[0])
        common = dict(x0=x0, maxiter=4, itstat_options={"display": False})
        if method == "ladmm":
            s = LinearizedADMM(f=f, g=g, C=D, mu=1.0, nu=0.1, **common)
        elif method == "pdhg":
            s = PDHG(f=f, g=g, C=D, tau=0.1, sigma=0.1, **common)
        else:
            s = ProximalADMM(f=f, g=g, A=D, rho=1.0, mu=5.0, nu=1.0, **common)
        return jnp.sum(jnp.sin(s.solve()))

    _run(loss, (Y_DATA, jnp.asarray(0.3)), _argnums(2), jit)
