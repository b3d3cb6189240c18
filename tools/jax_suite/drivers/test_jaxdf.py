"""jaxdf: its differential operators on Fourier-series, finite-difference and
continuous (parametrised function) fields differentiated by jax.grad with respect
to the field's parameters, in one and two dimensions, eagerly and under jit. A
continuous field's operators take jax's own derivatives inside the loss."""

import jax
import jax.numpy as jnp
import pytest
from jaxdf import Continuous, Domain, FiniteDifferences, FourierSeries
from jaxdf.operators import diag_jacobian, gradient, laplacian

jax.config.update("jax_enable_x64", True)
D1, D2 = Domain((16,), (0.5,)), Domain((12, 10), (0.5, 0.3))
P1 = jnp.sin(jnp.linspace(0, 3, 16))[:, None]
P2 = jax.random.normal(jax.random.key(0), (12, 10, 1))
OPS = {
    "laplacian": lambda u: jnp.sin(laplacian(u).on_grid),
    "gradient": lambda u: jnp.tanh(gradient(u).on_grid),
    "diag_jacobian": lambda u: jnp.cos(diag_jacobian(gradient(u)).on_grid),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dims", [1, 2])
@pytest.mark.parametrize("field", [FourierSeries, FiniteDifferences])
@pytest.mark.parametrize("op", list(OPS))
def test_on_grid(op, field, dims, jit):
    dom, p = (D1, P1) if dims == 1 else (D2, P2)
    g = jax.grad(lambda p: jnp.sum(OPS[op](field(p, dom))))
    (jax.jit(g) if jit else g)(p)


@pytest.mark.parametrize("jit", [False, True])
def test_continuous(jit):
    def loss(w):
        u = Continuous(w, D2, lambda p, x: jnp.atleast_1d(jnp.tanh(jnp.dot(x, p[:2]) + p[2])))
        return jnp.sum(laplacian(u).on_grid) + jnp.sum(gradient(u).on_grid ** 2)

    g = jax.grad(loss)
    (jax.jit(g) if jit else g)(jnp.array([0.3, -0.7, 0.2]))
