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
from .autograd.errors import AutogradError as AutogradError
from .autograd.errors import ShapeError as ShapeError
from .autograd.errors import ShardingError as ShardingError
from .autograd.errors import VersionMismatch as VersionMismatch
from .autograd.record import VersionSnapshot as VersionSnapshot
from .autograd.tape import Tape as Tape
from .autograd.tape import TapeEntry as TapeEntry
from .autograd.tape import no_grad as no_grad
from .autograd.transforms import grad as grad
from .autograd.transforms import value_and_grad as value_and_grad
from .autograd.transforms import vjp as vjp
from .compiler import CPU_COMPILER_OPTIONS as CPU_COMPILER_OPTIONS
from .lift import checkpoint as checkpoint
from .lift import lift as lift
from .ops import adaptive_avg_pool2d as adaptive_avg_pool2d
from .ops import add as add
from .ops import add_bias as add_bias
from .ops import add_channel_bias as add_channel_bias
from .ops import batch_norm_2d as batch_norm_2d
from .ops import bmm as bmm
from .ops import conv2d as conv2d
from .ops import cross_entropy as cross_entropy
from .ops import div as div
from .ops import dropout as dropout
from .ops import embedding as embedding
from .ops import exp as exp
from .ops import flatten as flatten
from .ops import gelu as gelu
from .ops import im2col as im2col
from .ops import index as index
from .ops import layer_norm as layer_norm
from .ops import leaky_relu as leaky_relu
from .ops import log as log
from .ops import matmul as matmul
from .ops import max_pool2d as max_pool2d
from .ops import mean as mean
from .ops import mse_loss as mse_loss
from .ops import mul as mul
from .ops import neg as neg
from .ops import relu as relu
from .ops import reshape as reshape
from .ops import reshard as reshard
from .ops import scaled_dot_product_attention as scaled_dot_product_attention
from .ops import sigmoid as sigmoid
from .ops import slice_batch as slice_batch
from .ops import softmax as softmax
from .ops import stack as stack
from .ops import sub as sub
from .ops import sum as sum  # noqa: A004
from .ops import tanh as tanh
from .ops import transpose as transpose
from .storage import Layout as Layout
from .storage import StorageHandle as StorageHandle
from .storage import WeakStorageHandle as WeakStorageHandle
from .tensor import Tensor as Tensor
from .tensor import tensor as tensor

__version__ = "0.1.0"

_tensor_methods.install()


def __getattr__(name: str):
    # rumus_fx.testing imports chex: load it on first use only
    if name == "testing":
        import importlib

        return importlib.import_module(".testing", __name__)
    raise AttributeError(f"module 'rumus_fx' has no attribute {name!r}")
