"""``rumus_fx.numpy``: jax.numpy's namespace, every function recorded on the tape.

``import rumus_fx.numpy as rnp``: each name is jax.numpy's, run through
``rf.lift`` (so its primitives are recorded with rf's hand-written rules), or the
fused rf op of the same meaning where one exists and the call fits it
(``rnp.matmul`` records ``MatmulBackward``, ``rnp.sum`` records ``SumBackward``).
Submodules ``rnp.linalg`` and ``rnp.fft`` mirror jax's. Generated from the
installed jax at import time.

>>> import jax.numpy as jnp, rumus_fx as rf, rumus_fx.numpy as rnp
>>> rf.grad(lambda x: rnp.sum(rnp.sin(x) * x))(jnp.ones(2)).shape
(2,)
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from ._mirror import NUMPY_FUSED, fill, mirror

# (this module's globals become jax.numpy's names: keep code out of it)
fill(sys.modules[__name__], jnp, "jax.numpy", NUMPY_FUSED, skip=("ndarray",))
linalg = mirror(f"{__name__}.linalg", jnp.linalg)
fft = mirror(f"{__name__}.fft", jnp.fft)
ndarray = jax.Array
