"""``rf.lax``: jax.lax's namespace, every function recorded on the tape.

Each name is jax.lax's run through ``rf.lift``. The control-flow functions
(``scan``, ``cond``, ``switch``, ``fori_loop``, ``map``, ``while_loop``) take
bodies written with rf ops, ``rumus_fx.numpy`` or ``jax.numpy``; a body may close
over tracked Tensors. Functions that take a computation (``reduce_window``,
``reduce``, ...) accept ``rf.lax.add``/``rf.lax.max`` and ``jax.lax``'s alike.
Generated from the installed jax at import time.
"""

from __future__ import annotations

import sys

from jax import lax as _lax

from ._mirror import fill

fill(sys.modules[__name__], _lax, "jax.lax", {})
