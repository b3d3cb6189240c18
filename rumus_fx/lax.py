"""``rf.lax``: jax.lax's namespace, every function recorded on the tape.

Each name is jax.lax's run through ``rf.lift``. The control-flow functions
(``scan``, ``cond``, ``switch``, ``fori_loop``, ``map``, ``while_loop``,
``associative_scan``) take bodies written with rf ops, ``rumus_fx.numpy`` or
``jax.numpy``; a body may close over tracked Tensors and is recorded once (a
scan's tape entry does not grow with its length). Functions that take a
computation (``reduce_window``, ``reduce``, ...) accept ``rf.lax.add`` /
``rf.lax.max`` and ``jax.lax``'s alike. Generated from the installed jax at
import time.
"""

from __future__ import annotations

import sys

from jax import lax as _lax

from ._mirror import fill
from .lift.control import CONTROL

# (this module's globals become jax.lax's names: keep code out of it)
fill(sys.modules[__name__], _lax, "jax.lax", {}, skip=tuple(CONTROL))
for _name, _fn in CONTROL.items():
    setattr(sys.modules[__name__], _name, _fn)
