"""Random plain-JAX programs for ``tests/lift/test_random_programs.py``.

A program is a short list of steps drawn from ``CATALOG``: jax.numpy / lax /
jax.nn / jax.scipy calls as users write them (elementwise functions, reductions
along a drawn axis, shape and indexing ops with duplicate, negative and
out-of-range indices, scatters, linear algebra, FFTs, complex intermediates,
control flow, ``jax.checkpoint``, nested ``jax.jit`` and ``jax.vmap``,
``custom_jvp``/``custom_vjp`` functions, ``jax.device_put``, ``jax.shard_map``
on one device). Each step reads values made by earlier
steps (so values are reused: diamonds in the graph) and the program returns a
weighted sum of its last values and its first input. Inputs are drawn so that
every function is smooth at them (logs of ``1 + x^2``, inverse trig of
``0.9 tanh x``, solves of ``a a^T + n I``).

``program(seed)`` is deterministic: the seed fixes the steps, the inputs each
step reads, the weights and the arguments. Step 0 of program ``seed`` is
``CATALOG[seed % len(CATALOG)]``, applied to the first value it accepts, so the
first ``len(CATALOG)`` seeds run every entry at least once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.scipy import linalg as jsl
from jax.scipy import special as jss

# the arguments: a square matrix, a rectangular one, a vector and a scalar
ARG_SHAPES = ((4, 4), (3, 4), (4,), ())
MAX_SIZE = 512  # values larger than this are not kept


def _elementwise() -> dict[str, Callable[[Any], Any]]:
    return {
        "sin": jnp.sin,
        "tanh": jnp.tanh,
        "exp_tanh": lambda a: jnp.exp(jnp.tanh(a)),
        "log1p_sq": lambda a: jnp.log1p(a * a),
        "sqrt": lambda a: jnp.sqrt(a * a + 1.0),
        "abs": jnp.abs,
        "relu": jax.nn.relu,
        "gelu": jax.nn.gelu,
        "gelu_exact": lambda a: jax.nn.gelu(a, approximate=False),
        "sigmoid": jax.nn.sigmoid,
        "softplus": jax.nn.softplus,
        "silu": jax.nn.silu,
        "log_sigmoid": jax.nn.log_sigmoid,
        "elu": jax.nn.elu,
        "celu": jax.nn.celu,
        "selu": jax.nn.selu,
        "mish": lambda a: a * jnp.tanh(jax.nn.softplus(a)),
        "hard_tanh": jax.nn.hard_tanh,
        "relu6": jax.nn.relu6,
        "sparse_plus": jax.nn.sparse_plus,
        "soft_sign": jax.nn.soft_sign,
        "squareplus": jax.nn.squareplus,
        "erf": jss.erf,
        "erfc": jss.erfc,
        "erfinv": lambda a: jss.erfinv(jnp.tanh(a) * 0.9),
        "ndtri": lambda a: jss.ndtri(jax.nn.sigmoid(a)),
        "log_ndtr": jss.log_ndtr,
        "logit": lambda a: jss.logit(jax.nn.sigmoid(a)),
        "gammaln": lambda a: jss.gammaln(a * a + 1.0),
        "digamma": lambda a: jss.digamma(a * a + 1.0),
        "lgamma": lambda a: lax.lgamma(a * a + 0.5),
        "i0e": jss.i0e,
        "i1e": jss.i1e,
        "i1": jss.i1,
        "xlogy": lambda a: jss.xlogy(a, a * a + 1.0),
        "xlog1py": lambda a: jss.xlog1py(a, a * a),
        "expm1": lambda a: jnp.expm1(jnp.tanh(a)),
        "recip": lambda a: 1.0 / (1.0 + a * a),
        "cube": lambda a: a**3,
        "integer_pow": lambda a: lax.integer_pow(a, 4),
        "pow_frac": lambda a: (a * a + 1.0) ** 0.37,
        "rsqrt": lambda a: lax.rsqrt(a * a + 1.0),
        "cbrt": lambda a: jnp.cbrt(a * a + 1.0),
        "log2": lambda a: jnp.log2(a * a + 1.0),
        "exp2": lambda a: jnp.exp2(jnp.tanh(a)),
        "arctan": jnp.arctan,
        "arcsinh": jnp.arcsinh,
        "arccosh": lambda a: jnp.arccosh(a * a + 1.5),
        "arctanh": lambda a: jnp.arctanh(jnp.tanh(a) * 0.9),
        "arcsin": lambda a: jnp.arcsin(jnp.tanh(a) * 0.9),
        "arccos": lambda a: jnp.arccos(jnp.tanh(a) * 0.9),
        "tan": lambda a: jnp.tan(jnp.tanh(a)),
        "sinh": lambda a: jnp.sinh(jnp.tanh(a)),
        "sinc": jnp.sinc,
        "logistic": lax.logistic,
        "logaddexp": lambda a: jnp.logaddexp(a, 0.3),
        "clip": lambda a: jnp.clip(a, -0.5, 0.7),
        "clamp": lambda a: lax.clamp(-0.3, a, 0.8),
        "leaky": lambda a: jnp.where(a > 0, a, 0.1 * a),
        "where_sqrt": lambda a: jnp.where(a > 0.0, jnp.sqrt(jnp.where(a > 0.0, a, 1.0)), 0.0),
        "stop_gradient": lambda a: lax.stop_gradient(a) * a,
        "round": lambda a: jnp.round(a) * a,
        "floor": lambda a: jnp.floor(a) + a,
        "sign": lambda a: jnp.sign(a) * a * a,
        "rem": lambda a: lax.rem(a, 0.7) + jnp.fmod(a, 0.9) + jnp.mod(a, 1.3),
        "nan_to_num": jnp.nan_to_num,
        "float32_round_trip": lambda a: a.astype(jnp.float32).astype(a.dtype),
        "reduce_precision": lambda a: lax.reduce_precision(a, 8, 23) * a,
        "complex_real": lambda a: jnp.real(jnp.exp(1j * a) * (a + 2j)),
        "complex_abs": lambda a: jnp.abs(a + 1j * jnp.sin(a) + 0.3),
        "complex_angle": lambda a: jnp.angle(a + 1j * (a * a + 0.5)),
        "complex_conj": lambda a: jnp.real(jnp.conj(a + 1j) * (a - 2j)),
        "custom_jvp": lambda a: jax.nn.relu(a) + jax.nn.softplus(a) + jnp.logaddexp(a, -a),
        "custom_vjp": lambda a: _sin_clipped_grad(a),
        "checkpoint": lambda a: jax.checkpoint(lambda v: jnp.sin(jnp.sin(v)) * v)(a),
        "checkpoint_policy": lambda a: jax.checkpoint(
            lambda v: jnp.exp(jnp.tanh(v)) * v, policy=jax.checkpoint_policies.nothing_saveable
        )(a),
        "jit": lambda a: jax.jit(lambda v: jnp.cos(v) ** 2 + v)(a),
        "cond": lambda a: lax.cond(jnp.sum(a) > 0, lambda v: jnp.sin(v) * 2.0, lambda v: v * v, a),
        "switch": lambda a: lax.switch(
            jnp.clip(jnp.round(jnp.sum(a)).astype(jnp.int32), 0, 2), [jnp.sin, jnp.cos, jnp.tanh], a
        ),
        "fori": lambda a: lax.fori_loop(0, 3, lambda i, v: jnp.sin(v) * (i + 1.0), a),
        "while_value": lambda a: (
            a * lax.stop_gradient(lax.while_loop(lambda c: c < 3.0, lambda c: c + 1.0, jnp.sum(a) * 0.0))
        ),
    }


@jax.custom_vjp
def _sin_clipped_grad(x):
    return jnp.sin(x)


def _sin_fwd(x):
    return jnp.sin(x), jnp.cos(x)


def _sin_bwd(c, g):
    return (jnp.clip(g * c, -0.5, 0.5),)


_sin_clipped_grad.defvjp(_sin_fwd, _sin_bwd)


def _axis(rng: np.random.Generator, a: Any) -> int:
    return int(rng.integers(0, a.ndim))


def _window(a: Any, fn: Callable[[Any], Any]) -> Any:
    return fn(a) if a.ndim == 2 and min(a.shape) >= 2 else None


def _reduction(name: str) -> Callable[[np.random.Generator, Any], Any]:
    """A reduction or scan along a drawn axis (kept or not)."""

    def apply(rng: np.random.Generator, a: Any) -> Any:
        if a.ndim == 0:
            return None
        ax, keep = _axis(rng, a), bool(rng.integers(0, 2))
        wide = a.shape[ax] > 1
        table = {
            "sum": lambda: jnp.sum(a, axis=ax, keepdims=keep),
            "mean": lambda: jnp.mean(a, axis=ax, keepdims=keep),
            "max": lambda: jnp.max(a, axis=ax, keepdims=keep),
            "min": lambda: jnp.min(a, axis=ax, keepdims=keep),
            "prod": lambda: jnp.prod(1.0 + 0.1 * a, axis=ax, keepdims=keep),
            "logsumexp": lambda: jax.nn.logsumexp(a, axis=ax, keepdims=keep),
            "var": lambda: jnp.var(a, axis=ax, keepdims=keep) if wide else None,
            "std": lambda: jnp.std(a, axis=ax, keepdims=keep) if wide else None,
            "norm": lambda: jnp.linalg.norm(a, axis=ax, keepdims=keep),
            "nansum": lambda: jnp.nansum(a, axis=ax),
            "max_where": lambda: jnp.max(a, axis=ax, where=a > -0.5, initial=-3.0),
            "sum_where": lambda: jnp.sum(a, axis=ax, where=a > 0),
            "median": lambda: jnp.median(a, axis=ax),
            "cumsum": lambda: jnp.cumsum(a, axis=ax),
            "cumsum_reverse": lambda: lax.cumsum(a, axis=ax, reverse=True),
            "cumprod": lambda: jnp.cumprod(1.0 + 0.1 * a, axis=ax),
            "cummax": lambda: lax.cummax(a, axis=ax),
            "cumlogsumexp": lambda: lax.cumlogsumexp(a, axis=ax, reverse=keep),
            "sort": lambda: jnp.sort(a, axis=ax),
            "sort_two_operands": lambda: sum(lax.sort((a * 0.5, jnp.sin(a)), dimension=ax, num_keys=1)),
            "argsort_take": lambda: jnp.take_along_axis(a, jnp.argsort(a, axis=ax), axis=ax),
            "argmax_take": lambda: jnp.take_along_axis(a, jnp.argmax(a, axis=ax, keepdims=True), axis=ax),
            "argmin_one_hot": lambda: a * jax.nn.one_hot(jnp.argmin(a, axis=-1), a.shape[-1]),
            "top_k": lambda: lax.top_k(a, min(2, a.shape[-1]))[0],
            "softmax": lambda: jax.nn.softmax(a, axis=ax),
            "log_softmax": lambda: jax.nn.log_softmax(a, axis=ax),
            "standardize": lambda: jax.nn.standardize(a, axis=ax) if wide else None,
            "max_pool": lambda: _window(a, lambda v: lax.reduce_window(v, -jnp.inf, lax.max, (2, 2), (1, 1), "VALID")),
            "sum_pool": lambda: _window(a, lambda v: lax.reduce_window(v, 0.0, lax.add, (2, 1), (1, 1), "SAME")),
            "scan": lambda: _scan(a, keep),
            "map": lambda: lax.map(lambda r: r * jnp.sum(r), a),
            "vmap": lambda: jax.vmap(lambda r: jnp.tanh(r) * jnp.max(r))(a),
            "fft_power": lambda: jnp.abs(jnp.fft.rfft(a, axis=-1)) ** 2 if a.shape[-1] > 1 else None,
            "fft_round_trip": lambda: jnp.real(jnp.fft.ifft(jnp.fft.fft(a) * jnp.exp(1j * jnp.arange(a.shape[-1])))),
        }
        return table[name]()

    return apply


REDUCTIONS = (
    "sum", "mean", "max", "min", "prod", "logsumexp", "var", "std", "norm", "nansum", "max_where", "sum_where",
    "median", "cumsum", "cumsum_reverse", "cumprod", "cummax", "cumlogsumexp", "sort", "sort_two_operands",
    "argsort_take", "argmax_take", "argmin_one_hot", "top_k", "softmax", "log_softmax", "standardize", "max_pool",
    "sum_pool", "scan", "map", "vmap", "fft_power", "fft_round_trip",
)  # fmt: skip


def _scan(a: Any, reverse: bool) -> Any:
    def body(c: Any, x: Any) -> tuple[Any, Any]:
        c = jnp.tanh(c * 0.9 + x)
        return c, c * x

    c, ys = lax.scan(body, jnp.zeros_like(a[0]), a, reverse=reverse)
    return ys + c


def _structural(name: str) -> Callable[[np.random.Generator, Any], Any]:
    """Shape, slicing and indexing ops: gathers and scatters with duplicate,
    negative and out-of-range indices (clamped, filled or dropped)."""

    def apply(rng: np.random.Generator, a: Any) -> Any:
        small = a.size <= 32
        if a.ndim == 0:
            return None
        n = a.shape[0]
        table = {
            "transpose": lambda: a.T,
            "reshape": lambda: a.reshape(-1) if a.ndim != 1 else (a.reshape(2, -1) if a.size % 2 == 0 else None),
            "swapaxes": lambda: jnp.swapaxes(a, 0, -1) if a.ndim >= 2 else None,
            "expand_squeeze": lambda: jnp.squeeze(a[None], 0) * a[None] if a.ndim < 3 else None,
            "flip": lambda: jnp.flip(a, axis=_axis(rng, a)),
            "roll": lambda: jnp.roll(a, int(rng.integers(-3, 4)), axis=_axis(rng, a)),
            "slice": lambda: (a[1:] if a.ndim == 1 else a[1:, ::2]) if n >= 2 else None,
            "concatenate": lambda: jnp.concatenate([a, a * 2.0], axis=_axis(rng, a)) if small else None,
            "stack": lambda: jnp.stack([a, jnp.sin(a)]) if small and a.ndim < 3 else None,
            "pad": lambda: (
                jnp.pad(a, 1, mode=("constant", "edge", "reflect", "wrap")[int(rng.integers(0, 4))])
                if small and min(a.shape) >= 2
                else None
            ),
            "lax_pad": lambda: lax.pad(a, 0.5, ((1, -1, 1), (0, 2, 0))) if a.ndim == 2 else None,
            "tile": lambda: jnp.tile(a, 2) if small else None,
            "repeat": lambda: jnp.repeat(a, 2, axis=_axis(rng, a)) if small else None,
            "broadcast": lambda: jnp.broadcast_to(a, (2, *a.shape)) if small and a.ndim < 3 else None,
            "tril": lambda: jnp.tril(a) if a.ndim == 2 else None,
            "diagonal": lambda: jnp.diagonal(a) if a.ndim == 2 else (jnp.diag(a) if a.size <= 8 else None),
            "take_duplicates": lambda: jnp.take(a, jnp.array([0, n - 1, 0, n // 2]), axis=0),
            "take_clip": lambda: jnp.take(a, jnp.array([n + 2, -n - 3, 1 % n]), axis=0, mode="clip"),
            "take_fill": lambda: jnp.take(a, jnp.array([n + 2, 0, 1 % n]), axis=0, mode="fill", fill_value=0.25),
            "negative_index": lambda: a[jnp.array([-1, 0, -1])],
            "at_add": lambda: a.at[jnp.array([0, 0, n - 1])].add(a[:1] * 2.0),
            "at_set": lambda: a.at[1].set(a[0] * 3.0) if n >= 2 else None,
            "at_multiply": lambda: a.at[0].multiply(a[-1] + 1.0),
            "at_max": lambda: a.at[jnp.array([0, 1])].max(a[-2:] * 0.7) if n >= 2 else None,
            "at_add_drop": lambda: a.at[jnp.array([n + 1, 0])].add(jnp.concatenate([a, a])[:2], mode="drop"),
            "dynamic_slice": lambda: lax.dynamic_slice_in_dim(a, int(rng.integers(0, n + 3)), 2) if n >= 2 else None,
            "dynamic_slice_traced": lambda: (
                lax.dynamic_slice_in_dim(a, (jnp.sum(a) > 0).astype(jnp.int32) * 5, 2) if n >= 2 else None
            ),
            "dynamic_update_slice": lambda: (
                lax.dynamic_update_slice_in_dim(a, jnp.cos(a[:1]), int(rng.integers(0, n + 2)), axis=0)
                if n >= 2
                else None
            ),
            "segment_sum": lambda: jax.ops.segment_sum(a, jnp.arange(n) % 2, 3),
            "segment_max": lambda: jax.ops.segment_max(a, (jnp.arange(n) * 7) % 3, 3),
            "select_n": lambda: lax.select_n(jnp.arange(a.size).reshape(a.shape) % 3, a, a * a, -a),
            "convolve": lambda: jnp.convolve(a, jnp.array([1.0, -2.0, 0.5]), mode="same") if a.ndim == 1 else None,
            "device_put": lambda: jax.device_put(a, jax.devices()[0]),
            "shard_map": lambda: _one_device_shard_map(a),
        }
        return table[name]()

    return apply


STRUCTURAL = (
    "transpose", "reshape", "swapaxes", "expand_squeeze", "flip", "roll", "slice", "concatenate", "stack", "pad",
    "lax_pad", "tile", "repeat", "broadcast", "tril", "diagonal", "take_duplicates", "take_clip", "take_fill",
    "negative_index", "at_add", "at_set", "at_multiply", "at_max", "at_add_drop", "dynamic_slice",
    "dynamic_slice_traced", "dynamic_update_slice", "segment_sum", "segment_max", "select_n", "convolve",
    "device_put", "shard_map",
)  # fmt: skip


def _one_device_shard_map(a: Any) -> Any:
    """``a``'s rows through ``jax.shard_map`` on a one-device mesh with a ``psum``
    (the collectives' plumbing; tests/lift/test_shard_map.py runs them on eight)."""
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    body = lambda u: jnp.sin(u) * lax.psum(jnp.sum(u * u), "x")  # noqa: E731
    spec = jax.sharding.PartitionSpec("x")
    return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(a)


def _binary(name: str) -> Callable[[np.random.Generator, Any, Any], Any]:
    """Two operands: broadcasting arithmetic, products, solves, two-operand control flow."""

    def apply(rng: np.random.Generator, a: Any, b: Any) -> Any:
        try:
            shape = np.broadcast_shapes(a.shape, b.shape)
        except ValueError:
            shape = None
        square = a.ndim == 2 and a.shape[0] == a.shape[1]
        table = {
            "add": lambda: a + b,
            "subtract": lambda: a - b,
            "multiply": lambda: a * b,
            "divide": lambda: a / (1.0 + b * b),
            "maximum": lambda: jnp.maximum(a, b),
            "minimum": lambda: jnp.minimum(a, b),
            "arctan2": lambda: jnp.arctan2(a, b),
            "hypot": lambda: jnp.hypot(a, b),
            "logaddexp": lambda: jnp.logaddexp(a, b),
            "power": lambda: (jnp.abs(a) + 1.0) ** b,
            "where": lambda: jnp.where(a > b, a, b * 2.0),
            "copysign": lambda: jnp.copysign(a, b),
            "xlogy": lambda: jss.xlogy(a, b * b + 1.0),
            "clip_between": lambda: jnp.clip(a * 1.5, jnp.minimum(a, b) - 0.1, jnp.maximum(a, b) + 0.1),
            "cond": lambda: lax.cond(jnp.sum(a) > jnp.sum(b), lambda u, v: u * v, lambda u, v: u - v, a, b),
            "scan": lambda: _scan2(jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape)) if len(shape) else None,
        }
        products = {
            "matmul": lambda: (
                a @ b if a.ndim >= 1 and b.ndim >= 1 and a.shape[-1] == b.shape[0 if b.ndim == 1 else -2] else None
            ),
            "einsum": lambda: (
                jnp.einsum("ij,ik->jk", a, b) if a.ndim == 2 and b.ndim == 2 and len(a) == len(b) else None
            ),
            "outer": lambda: jnp.outer(a, b) if a.size * b.size <= 64 else None,
            "kron": lambda: jnp.kron(a, b) if a.ndim == 2 and b.ndim == 2 and a.size * b.size <= 256 else None,
            "solve": lambda: (
                jnp.linalg.solve(a @ a.T + 3.0 * jnp.eye(len(a)), b)
                if square and b.ndim in (1, 2) and len(b) == len(a)
                else None
            ),
            "ragged_dot": lambda: (  # two groups of a's rows, each with its own weight
                lax.ragged_dot(a, jnp.stack([b, jnp.sin(b)]), jnp.array([len(a) // 2, len(a) - len(a) // 2]))
                if a.ndim == 2 and b.ndim == 2 and a.shape[1] == b.shape[0]
                else None
            ),
        }
        if name in products:
            return products[name]()
        return None if shape is None else table[name]()

    return apply


BINARY = (
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "arctan2", "hypot", "logaddexp", "power",
    "where", "copysign", "xlogy", "clip_between", "cond", "scan", "matmul", "einsum", "outer", "kron", "solve",
    "ragged_dot",
)  # fmt: skip


def _scan2(a: Any, b: Any) -> Any:
    return lax.scan(lambda c, xy: (c * xy[1] + xy[0], c), jnp.zeros_like(a[0]), (a, b))[1]


def _linalg(name: str) -> Callable[[np.random.Generator, Any], Any]:
    """Decompositions and solves of a square value, at well-conditioned points."""

    def apply(rng: np.random.Generator, a: Any) -> Any:
        if a.ndim != 2 or a.shape[0] != a.shape[1]:
            return None
        n = a.shape[0]
        eye = jnp.eye(n)
        spd = a @ a.T + n * eye
        table = {
            "inv": lambda: jnp.linalg.inv(spd),
            "det": lambda: jnp.linalg.det(eye + 0.2 * a),
            "slogdet": lambda: jnp.linalg.slogdet(eye + 0.2 * a)[1],
            "cholesky": lambda: jnp.linalg.cholesky(spd),
            "eigvalsh": lambda: jnp.linalg.eigh(spd)[0],
            "eigh_vectors": lambda: (jnp.linalg.eigh(spd)[1] ** 2) @ jnp.linalg.eigh(spd)[0],
            "qr": lambda: (lambda r: r * jnp.sign(jnp.diag(r))[:, None])(jnp.linalg.qr(a + 2.0 * eye)[1]),
            "svdvals": lambda: jnp.linalg.svd(a, compute_uv=False),
            "solve_triangular": lambda: jsl.solve_triangular(jnp.tril(a) + 3.0 * eye, a, lower=True),
            "expm": lambda: jsl.expm(0.3 * a),
            "pinv": lambda: jnp.linalg.pinv(spd),
            "trace": lambda: jnp.trace(a) * a,
            "lu_solve": lambda: jsl.lu_solve(jsl.lu_factor(spd), a),
            "cho_solve": lambda: jsl.cho_solve(jsl.cho_factor(spd), a),
            "matrix_power": lambda: jnp.linalg.matrix_power(0.5 * a, 3),
            "lstsq": lambda: jnp.linalg.lstsq(spd, a)[0],
            "eigvals": lambda: jnp.abs(jnp.linalg.eigvals(a + 2.0 * eye)),
        }
        return table[name]()

    return apply


LINALG = (
    "inv", "det", "slogdet", "cholesky", "eigvalsh", "eigh_vectors", "qr", "svdvals", "solve_triangular", "expm",
    "pinv", "trace", "lu_solve", "cho_solve", "matrix_power", "lstsq", "eigvals",
)  # fmt: skip


def _unary(f: Callable[[Any], Any]) -> Callable[[np.random.Generator, Any], Any]:
    return lambda rng, a: f(a)


# (name, number of operands, apply(rng, *operands) -> value or None when the
# operands' shapes do not suit it)
CATALOG: list[tuple[str, int, Callable[..., Any]]] = (
    [(f"elementwise:{k}", 1, _unary(f)) for k, f in _elementwise().items()]
    + [(f"reduction:{k}", 1, _reduction(k)) for k in REDUCTIONS]
    + [(f"structural:{k}", 1, _structural(k)) for k in STRUCTURAL]
    + [(f"binary:{k}", 2, _binary(k)) for k in BINARY]
    + [(f"linalg:{k}", 1, _linalg(k)) for k in LINALG]
)


def _keep(v: Any) -> bool:
    return v is not None and 0 < v.size <= MAX_SIZE and jnp.issubdtype(v.dtype, jnp.floating)


def program(seed: int, steps: int = 6) -> tuple[Callable[..., Any], list[Any]]:
    """A random program of ``len(ARG_SHAPES)`` float arguments and its arguments
    (float64 when x64 is on). ``fun.applied`` lists the catalogue entries that
    ran in its last call (an entry whose operands do not suit it is passed over)."""
    rng = np.random.default_rng(seed)
    plan = [(seed % len(CATALOG), True)] + [(int(rng.integers(0, len(CATALOG))), False) for _ in range(steps - 1)]
    draws = [rng.integers(0, 1 << 30, size=3) for _ in plan]
    weights_seed = int(rng.integers(0, 1 << 30))

    def fun(*args: Any) -> Any:
        pool = list(args)
        applied = []
        for (k, first), (pick, other, sub) in zip(plan, draws):
            name, arity, apply = CATALOG[k]
            # the first operand: a recent value; step 0 tries every value (and every
            # second operand) until one suits it
            if first:
                recent = range(len(pool) - 1, -1, -1)
                tries = (
                    [[pool[i], pool[j]] for i in recent for j in recent] if arity == 2 else [[pool[i]] for i in recent]
                )
            else:
                i = len(pool) - 1 - pick % min(3, len(pool))
                tries = [[pool[i]] + [pool[(other >> (4 * j)) % len(pool)] for j in range(arity - 1)]]
            for operands in tries:
                out = apply(np.random.default_rng(sub), *operands)
                if _keep(out):
                    pool.append(out)
                    applied.append(name)
                    break
        fun.applied = applied
        w = np.random.default_rng(weights_seed)
        total = jnp.zeros(())
        for v in [*pool[len(args) :][-3:], pool[0]]:
            total = total + jnp.sum(v * jnp.asarray(w.standard_normal(v.shape), v.dtype))
        return total

    fun.applied = []
    fun.first = CATALOG[plan[0][0]][0]
    arg_rng = np.random.default_rng(seed + 7)
    args = [jnp.asarray(arg_rng.standard_normal(s)) for s in ARG_SHAPES]
    return fun, args
