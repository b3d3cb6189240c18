"""Neural-network layers and their safetensors serialization for rumus_fx: parameters are plain pytrees.

Each layer is a small static (hashable) config object; ``layer.init(key)``
returns a dict of jax arrays with PyTorch's parameter names and
``layer(params, x)`` runs it with rumus_fx ops, so ``rf.grad`` differentiates
through it. Optimisers are optax's.

>>> import jax, jax.numpy as jnp, optax, rumus_fx as rf
>>> model = rf.nn.Sequential([rf.nn.Linear(4, 16), rf.relu, rf.nn.Linear(16, 3)])
>>> params = model.init(jax.random.key(0))
>>> x, y = jnp.ones((8, 4)), jnp.zeros(8, jnp.int32)
>>> loss_fn = lambda p: rf.cross_entropy(model(p, x), y)
>>> opt = optax.adam(1e-2)
>>> opt_state = opt.init(params)
>>> loss, grads = rf.value_and_grad(loss_fn)(params)
>>> updates, opt_state = opt.update(grads, opt_state)
>>> params = optax.apply_updates(params, updates)
"""

from . import init as init
from .layers import AdaptiveAvgPool2d as AdaptiveAvgPool2d
from .layers import BatchNorm2d as BatchNorm2d
from .layers import Conv2d as Conv2d
from .layers import Dropout as Dropout
from .layers import Embedding as Embedding
from .layers import Flatten as Flatten
from .layers import LayerNorm as LayerNorm
from .layers import Linear as Linear
from .layers import MaxPool2d as MaxPool2d
from .layers import Module as Module
from .layers import Params as Params
from .layers import Sequential as Sequential
from .serialization import load as load
from .serialization import save as save
from .torch_state import StateDictError as StateDictError
from .torch_state import load_torch_state_dict as load_torch_state_dict
from .transformer import MultiheadAttention as MultiheadAttention
from .transformer import TransformerBlock as TransformerBlock

__all__ = [
    "AdaptiveAvgPool2d",
    "BatchNorm2d",
    "Conv2d",
    "Dropout",
    "Embedding",
    "Flatten",
    "LayerNorm",
    "Linear",
    "MaxPool2d",
    "Module",
    "MultiheadAttention",
    "Params",
    "Sequential",
    "StateDictError",
    "TransformerBlock",
    "init",
    "load",
    "load_torch_state_dict",
    "save",
]

from . import functional as _functional

_functional.install(__name__)
