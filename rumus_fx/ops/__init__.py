"""All differentiable ops. Each module holds forward functions and their records."""

from . import inplace as inplace
from .activation import relu as relu
from .elementwise import add as add
from .elementwise import add_bias as add_bias
from .elementwise import div as div
from .elementwise import exp as exp
from .elementwise import log as log
from .elementwise import mul as mul
from .elementwise import neg as neg
from .elementwise import sub as sub
from .linalg import bmm as bmm
from .linalg import matmul as matmul
from .linalg import matmul_any as matmul_any
from .loss import mse_loss as mse_loss
from .reduce import mean as mean
from .reduce import sum as sum  # noqa: A004
from .shape import flatten as flatten
from .shape import reshape as reshape
from .shape import transpose as transpose
