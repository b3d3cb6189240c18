"""Primitive rules: complex numbers (``complex``, ``real``, ``imag``, ``conj``,
``abs``) and which rules accept complex operands at all.

Note [Complex gradients]
~~~~~~~~~~~~~~~~~~~~~~~~
rf follows ``jax.grad``'s convention exactly (``holomorphic=False``): the
gradient of a real loss ``L`` with respect to a complex input ``z = x + iy`` is
``dL/dx - i dL/dy``, which is what a walk of *transposes* (not conjugate
transposes) of the linearised program gives when it starts from a real
cotangent. So a rule for a holomorphic primitive ``w = f(z)`` returns
``g * f'(z)`` with no conjugation (``sin``, ``exp``, ``mul``, ``dot_general``
already do, their formulas are the real ones), and the non-holomorphic
primitives are transposed as the linear maps they are on R^2:

* ``real``: ``g -> g + 0i``; ``imag``: ``g -> -i g``; ``complex(x, y)``:
  ``g -> (re g, -im g)``; ``conj``: ``g -> conj(g)`` (``re g`` for a real operand);
* ``abs`` of a complex ``z``: ``g * conj(z) / |z|`` (``0`` at ``z = 0``); of a real
  ``x``: ``g`` where ``x >= 0`` and ``-g`` elsewhere (``jax.grad(jnp.abs)(0.) == 1``).

A gradient through max and min of complex values (``max``, ``reduce_max``,
``cummax`` and their min twins) stays refused although jax differentiates them:
their rules find the chosen operand by comparing values, and XLA:CPU computes a
complex product in different fusions with different rounding. Measured (jax
0.10.2): for ``max(concatenate([z, z]) * w[:1], axis=0)`` of complex ``z``, ``w``, a
derivative along a random direction is -48.601 by finite differences and by
``jax.grad`` eagerly, -48.776 by ``jax.jit(jax.grad)``; rf's rule gave 0/0 under
``jax.jit``, and with the output recomputed from the saved operand -49.526 (one
gradient entry silently zero). Real values are computed the same way in every
fusion (checked on 30 random cases of such programs).

A rule whose formula has not been checked against ``jax.grad`` on complex
operands is refused when the gradient of a complex value reaches it
(``COMPLEX_OK`` lists those that are; ``tests/lift/test_complex.py`` checks each
of them), with an ``AutogradError`` naming the primitive — never a silently wrong
gradient. A step no gradient reaches does not stop the program: the maximum
``jax.nn.softmax`` subtracts under ``stop_gradient`` (``_refusing_complex`` in
``program.py``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..autograd.registry import Sample, TableEntry
from ..ops._declare import far_from_zero, normal, unary_samples
from .rules import COMPLEX_OK, defrule, saves_inputs
from .rules_elementwise import as_dtype, unbroadcast


def _complex_dtype(dtype):
    return jnp.result_type(dtype, np.complex64)


def _real_vjp(r, g):
    return (lax.complex(g, jnp.zeros_like(g)).astype(r.in_avals[0].dtype),)


def _imag_vjp(r, g):
    return (lax.complex(jnp.zeros_like(g), -g).astype(r.in_avals[0].dtype),)


def _conj_vjp(r, g):
    dtype = r.in_avals[0].dtype
    return (as_dtype(jnp.conj(g) if jnp.issubdtype(dtype, jnp.complexfloating) else g, dtype),)


def _complex_vjp(r, g):
    a, b = r.in_avals
    return (
        unbroadcast(jnp.real(g), a, r.in_sharding(0)) if r.needs[0] else None,
        unbroadcast(-jnp.imag(g), b, r.in_sharding(1)) if r.needs[1] else None,
    )


def _abs_vjp(r, g):
    x = r.ins[0]
    if jnp.iscomplexobj(x):
        mag = lax.abs(x)
        safe = jnp.where(mag == 0, jnp.ones_like(mag), mag)
        return (g.astype(x.dtype) * (jnp.conj(x) / safe.astype(x.dtype)),)
    return (lax.select(x >= 0, g, -g),)


def _pair(r, *shape):
    return normal(r, *shape) + 1j * normal(r, *shape)


def _on_complex(f):
    """A real program through complex values: ``f`` of ``x + i y``."""
    return lambda x, y: f(lax.complex(x, y))


def _two(shape=(3, 4), gen=normal):
    return lambda r: [Sample((gen(r, *shape), gen(r, *shape)), diff=(0, 1))]


def _to_complex(x):
    return x.astype(jnp.complex64 if x.dtype == jnp.float32 else jnp.complex128)


def _abs_with_zeros(rng, *shape):
    x = far_from_zero(rng, *shape)
    x.flat[::3] = 0.0
    return x


defrule(
    "real",
    _real_vjp,
    table=(TableEntry("real", _on_complex(lambda z: jnp.real(z * z) * 2.0), _two()),),
)
defrule(
    "imag",
    _imag_vjp,
    table=(TableEntry("imag", _on_complex(lambda z: jnp.imag(z * z) + jnp.imag(z) ** 2), _two()),),
)
defrule(
    "conj",
    _conj_vjp,
    table=(
        TableEntry("conj", _on_complex(lambda z: jnp.imag(jnp.conj(z) * (1.0 + 2.0j)) * jnp.real(z)), _two()),
        TableEntry("conj_of_real", lambda x: lax.conj(x).real * x, unary_samples([(3, 4)]), prims=("conj",)),
    ),
)
defrule(
    "complex",
    _complex_vjp,
    table=(
        TableEntry("complex", _on_complex(lambda z: jnp.real(jnp.sin(z) * jnp.exp(z))), _two()),
        TableEntry(
            "complex_broadcast",  # a rank-0 imaginary part
            lambda x, y: jnp.imag(jnp.exp(lax.complex(x, jnp.broadcast_to(y, x.shape)))),
            lambda r: [Sample((normal(r, 3, 4), normal(r)), diff=(0, 1))],
        ),
    ),
)
defrule(
    "abs",
    _abs_vjp,
    saves_inputs(0),
    table=(
        TableEntry("abs", jnp.abs, unary_samples(gen=far_from_zero)),
        TableEntry("abs_at_zero", lambda x: jnp.abs(x) * 2.0, unary_samples([(3, 4)], _abs_with_zeros), fd=False),
        TableEntry("abs_complex", _on_complex(lambda z: jnp.abs(z * (1.0 + 2.0j))), _two(gen=far_from_zero)),
        TableEntry(
            "abs_complex_of_real",  # sum(abs(v * (1 + 2j))): sqrt(5) sign(v)
            lambda x: jnp.abs(_to_complex(x) * (1.0 + 2.0j)) ** 2 + jnp.abs(_to_complex(x) * (1.0 + 2.0j)),
            unary_samples([(3, 4)], far_from_zero),
        ),
    ),
)

# rules checked against jax.grad with complex operands (tests/lift/test_complex.py)
COMPLEX_OK.update(
    {
        "real", "imag", "conj", "complex", "abs",
        # holomorphic elementwise math: g * f'(z), no conjugation
        "neg", "add", "add_any", "sub", "mul", "div", "pow", "integer_pow", "square", "sqrt", "rsqrt",
        "exp", "exp2", "expm1", "log", "log1p", "logistic", "sin", "cos", "tan", "tanh", "sinh", "cosh",
        "asin", "acos", "atan", "asinh", "acosh", "atanh", "convert_element_type", "copy", "copy_p", "name",
        "select_n", "atan2", "cumlogsumexp",
        # linear maps: transposed, not conjugated
        "dot_general", "conv_general_dilated", "reduce_sum", "reduce_prod", "cumsum", "cumprod",
        "broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims",
        "concatenate", "pad", "slice", "dynamic_slice", "dynamic_update_slice", "rev", "split", "stack", "unstack",
        "tile", "gather", "scatter", "scatter-add", "scatter-sub", "scatter-mul", "sort", "lu", "cholesky", "qr", "svd", "triangular_solve", "tridiagonal_solve", "custom_linear_solve",
        # Hermitian eigendecomposition (its rule conjugates V: rules_linalg._eigh_vjp)
        "eigh",
        # general eigendecomposition: complex outputs of a real or complex matrix (rules_linalg._eig_vjp)
        "eig",
        # calls and control flow (their bodies' rules are checked one by one)
        "scan", "cond", "remat2", "checkpoint", "custom_vjp_call", "custom_vjp_call_jaxpr",
        "compute_on", "xla_metadata_call",
        # the user's transpose function, bound as given (a transpose, not an adjoint)
        "linear_call",
        # a custom JVP rule's reverse walk: every step of it is checked as above
        "custom_jvp_call",
        "optimization_barrier", "sharding_constraint", "reshard", "device_put", "shard_alike",
        # jax.experimental.sparse: linear in the values (and the dense operand), each rule the
        # plain transpose (rules_sparse.py)
        "bcoo_todense", "bcoo_extract", "bcoo_fromdense", "bcoo_transpose", "bcoo_dot_general",
        "bcoo_dot_general_sampled", "coo_todense", "coo_fromdense", "coo_matvec", "coo_matmat",
        "csr_todense", "csr_fromdense", "csr_matvec", "csr_matmat",
        "bcsr_todense", "bcsr_extract", "bcsr_fromdense", "bcsr_dot_general",
    }
)  # fmt: skip
