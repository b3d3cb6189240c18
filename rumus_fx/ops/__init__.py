"""All differentiable ops. Each module holds forward functions, their records and
their declarations (Note [Declaring an op] in ``autograd/registry.py``). The
names below are the package's exports, one line per op (``dropout`` and
``embedding`` name the ops, not their modules); ``tests/test_imports.py``
checks they are exactly the declared ops."""

from ..autograd.registry import exports as _exports
from . import activation as activation
from . import attention as attention
from . import cast as cast
from . import conv as conv
from . import elementwise as elementwise
from . import inplace as inplace
from . import linalg as linalg
from . import loss as loss
from . import norm as norm
from . import reduce as reduce
from . import shape as shape
from .activation import gelu as gelu
from .activation import leaky_relu as leaky_relu
from .activation import relu as relu
from .activation import sigmoid as sigmoid
from .activation import softmax as softmax
from .activation import softplus as softplus
from .activation import tanh as tanh
from .attention import scaled_dot_product_attention as scaled_dot_product_attention
from .cast import cast_to as cast_to
from .conv import adaptive_avg_pool2d as adaptive_avg_pool2d
from .conv import add_channel_bias as add_channel_bias
from .conv import conv2d as conv2d
from .conv import im2col as im2col
from .conv import max_pool2d as max_pool2d
from .dropout import dropout as dropout
from .elementwise import add as add
from .elementwise import add_bias as add_bias
from .elementwise import div as div
from .elementwise import exp as exp
from .elementwise import log as log
from .elementwise import mul as mul
from .elementwise import neg as neg
from .elementwise import sub as sub
from .embedding import embedding as embedding
from .linalg import bmm as bmm
from .linalg import matmul as matmul
from .linalg import matmul_or_bmm as matmul_or_bmm
from .loss import cross_entropy as cross_entropy
from .loss import mse_loss as mse_loss
from .norm import batch_norm_2d as batch_norm_2d
from .norm import layer_norm as layer_norm
from .reduce import mean as mean
from .reduce import sum as sum  # noqa: A004
from .shape import flatten as flatten
from .shape import index as index
from .shape import reshape as reshape
from .shape import reshard as reshard
from .shape import slice_batch as slice_batch
from .shape import stack as stack
from .shape import transpose as transpose

__all__ = sorted(_exports())  # the declared ops: the same names as the imports above
