"""rumus_fx: tape-based reverse-mode autodiff on JAX, built like the rumus engine."""

from . import autograd as autograd
from . import debug as debug
from . import kernels as kernels
from . import lax as lax
from . import nn as nn
from . import numpy as numpy
from . import ops as ops
from . import tensor_methods as _tensor_methods
from .autograd.engine import GradientStore as GradientStore
from .autograd.record import VersionSnapshot as VersionSnapshot
from .autograd.registry import exports as _op_exports
from .autograd.tape import Tape as Tape
from .autograd.tape import TapeEntry as TapeEntry
from .autograd.tape import no_grad as no_grad
from .autograd.transforms import grad as grad
from .autograd.transforms import value_and_grad as value_and_grad
from .autograd.transforms import vjp as vjp
from .compiler import CPU_COMPILER_OPTIONS as CPU_COMPILER_OPTIONS
from .errors import AutogradError as AutogradError
from .errors import ShapeError as ShapeError
from .errors import ShardingError as ShardingError
from .errors import VersionMismatch as VersionMismatch
from .lift import checkpoint as checkpoint
from .lift import lift as lift
from .ops.cast import tensor as tensor
from .storage import Layout as Layout
from .storage import StorageHandle as StorageHandle
from .storage import WeakStorageHandle as WeakStorageHandle
from .tensor import Tensor as Tensor

# every fused op declared with rf.ops' @op (Note [Declaring an op] in autograd/registry.py)
globals().update(_op_exports(toplevel=True))

__version__ = "0.1.0"

_tensor_methods.install()


def __getattr__(name: str):
    # rumus_fx.testing imports chex: load it on first use only
    if name == "testing":
        import importlib

        return importlib.import_module(".testing", __name__)
    raise AttributeError(f"module 'rumus_fx' has no attribute {name!r}")
