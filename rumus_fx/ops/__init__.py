"""All differentiable ops. Each module holds forward functions, their records and
their declarations (Note [Declaring an op] in ``autograd/registry.py``); this
package's names are derived from those declarations."""

from ..autograd.registry import exports as _exports
from . import activation as activation
from . import attention as attention
from . import cast as cast
from . import conv as conv
from . import dropout as dropout
from . import elementwise as elementwise
from . import embedding as embedding
from . import inplace as inplace
from . import linalg as linalg
from . import loss as loss
from . import norm as norm
from . import reduce as reduce
from . import shape as shape

globals().update(_exports())
__all__ = sorted(_exports())  # derived from the op declarations
