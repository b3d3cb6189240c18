"""sympy2jax: ``SymbolicModule``s of sympy expressions (every function in its lookup
table that has a derivative: powers, roots, logs, trigonometric and hyperbolic functions
and their inverses, erf, Abs, sign, Max/Min of several arguments, a determinant, shared
subexpressions) differentiated by jax.grad with respect to the module's floating
constants, the symbols' values and both, eagerly and under jit; inputs where Abs, Max and
Min tie."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
import sympy
import sympy2jax

jax.config.update("jax_enable_x64", True)
x, y, z = sympy.symbols("x_sym y_sym z_sym")
shared = sympy.sin(1.3 * x) * y  # used twice below
EXPRS = {
    "powers": 2.5 * x**3 + 0.7 * sympy.sqrt(y**2 + 1.5) - 1.1 * x / (y**2 + 2.0) + sympy.exp(0.3 * z) * z**-2,
    "logs": 0.8 * sympy.log(x**2 + 0.5) + sympy.erf(0.6 * y) * sympy.Abs(z) + sympy.sign(x) * y,
    "trig": (
        sympy.cos(0.9 * x) * sympy.tan(0.4 * y)
        + sympy.asin(0.3 * sympy.tanh(z))
        + sympy.acos(0.2 * x / (1 + x**2))
        + sympy.atan(1.7 * y)
        + sympy.atan2(y, 0.5 + x**2)
    ),
    "hyperbolic": (
        sympy.sinh(0.5 * x)
        + sympy.cosh(0.3 * y) * sympy.asinh(z)
        + sympy.acosh(2.0 + x**2)
        + sympy.atanh(0.4 * sympy.sin(y))
    ),
    "max_min": sympy.Max(x, y, 0.5 * z) + 2.0 * sympy.Min(x, y**2, z) + sympy.Max(x * y, 0.2),
    "shared": shared**2 + 3.1 * shared + sympy.exp(-shared),
    "determinant": sympy.Matrix([[x, 1.2 * y], [0.4 * z, x * z + 2.0]]).det(),
}
POINTS = {
    "generic": (0.7, -0.4, 1.3),
    "ties": (0.5, 0.5, 0.5),  # Max/Min of x and y tie; max(x*y, 0.2) is near
    "negative": (-1.1, 0.25, -0.8),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", list(POINTS))
@pytest.mark.parametrize("expr", list(EXPRS))
def test_symbolic_module(expr, point, jit):
    module = sympy2jax.SymbolicModule([EXPRS[expr], EXPRS[expr] ** 2 * 0.1])
    params, static = eqx.partition(module, eqx.is_inexact_array)
    vals = {k: jnp.asarray(v) for k, v in zip(("x_sym", "y_sym", "z_sym"), POINTS[point])}

    def loss(params, vals):
        out = eqx.combine(params, static)(**vals)
        return jnp.sum(jnp.stack(out) * jnp.array([1.0, 0.5]))

    for argnums in [(0,), (1,), (0, 1)]:
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(params, vals)
