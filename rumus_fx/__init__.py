"""rumus_fx: tape-based reverse-mode autodiff on JAX, built like the rumus engine.

Every public name is imported below by name. The fused ops among them (``from
.ops.<family> import <op>``, Note [Declaring an op] in
``autograd/registry.py``) are checked by ``tests/test_imports.py`` to be
exactly the ops declared for the top level."""

from . import autograd as autograd
from . import debug as debug
from . import kernels as kernels
from . import lax as lax
from . import nn as nn
from . import numpy as numpy
from . import ops as ops
from . import tensor_methods as _tensor_methods
from ._version import __version__ as __version__
from .autograd.engine import GradientStore as GradientStore
from .autograd.record import VersionSnapshot as VersionSnapshot
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
from .lift import defrule as defrule
from .lift import lift as lift
from .lift import undefrule as undefrule
from .ops.activation import gelu as gelu
from .ops.activation import leaky_relu as leaky_relu
from .ops.activation import relu as relu
from .ops.activation import sigmoid as sigmoid
from .ops.activation import softmax as softmax
from .ops.activation import softplus as softplus
from .ops.activation import tanh as tanh
from .ops.attention import scaled_dot_product_attention as scaled_dot_product_attention
from .ops.cast import tensor as tensor
from .ops.conv import adaptive_avg_pool2d as adaptive_avg_pool2d
from .ops.conv import add_channel_bias as add_channel_bias
from .ops.conv import conv2d as conv2d
from .ops.conv import im2col as im2col
from .ops.conv import max_pool2d as max_pool2d
from .ops.dropout import dropout as dropout
from .ops.elementwise import add as add
from .ops.elementwise import add_bias as add_bias
from .ops.elementwise import div as div
from .ops.elementwise import exp as exp
from .ops.elementwise import log as log
from .ops.elementwise import mul as mul
from .ops.elementwise import neg as neg
from .ops.elementwise import sub as sub
from .ops.embedding import embedding as embedding
from .ops.linalg import bmm as bmm
from .ops.linalg import matmul as matmul
from .ops.loss import cross_entropy as cross_entropy
from .ops.loss import mse_loss as mse_loss
from .ops.norm import batch_norm_2d as batch_norm_2d
from .ops.norm import layer_norm as layer_norm
from .ops.reduce import mean as mean
from .ops.reduce import sum as sum  # noqa: A004
from .ops.shape import flatten as flatten
from .ops.shape import index as index
from .ops.shape import reshape as reshape
from .ops.shape import reshard as reshard
from .ops.shape import slice_batch as slice_batch
from .ops.shape import stack as stack
from .ops.shape import transpose as transpose
from .storage import Layout as Layout
from .storage import StorageHandle as StorageHandle
from .storage import WeakStorageHandle as WeakStorageHandle
from .tensor import Tensor as Tensor

_tensor_methods.install()


def __getattr__(name: str):
    # rumus_fx.testing imports chex: load it on first use only
    if name == "testing":
        import importlib

        return importlib.import_module(".testing", __name__)
    raise AttributeError(f"module 'rumus_fx' has no attribute {name!r}")
