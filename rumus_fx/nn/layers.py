"""Layers as small static config objects; parameters are plain dicts of arrays.

Every layer is a frozen (hashable) dataclass holding only its configuration:

* ``params = layer.init(key)`` draws a fresh dict of jax arrays with PyTorch's
  parameter names (``"weight"``, ``"bias"``) and default initialisers
  (see ``rumus_fx.nn.init``);
* ``y = layer(params, x)`` runs the layer with rumus_fx ops only, so inside
  ``rf.grad`` / ``rf.value_and_grad`` (where the params arrive as tracked
  ``rf.Tensor``s) every op records on the tape and gradients flow;
* parameter-free layers (``MaxPool2d``, ``AdaptiveAvgPool2d``, ``Flatten``,
  ``Dropout``) are called as ``layer(x)``; ``layer({}, x)`` works too, so a
  loop over mixed layers may pass params uniformly.

Because layers are hashable they can be closed over or passed as static
arguments to ``jax.jit``; parameters stay ordinary pytrees for optax.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from .. import ops
from ..ops._core import static_int
from ..tensor import Tensor
from . import init as _init

Params = dict[str, Any]

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
    "Params",
    "Sequential",
]


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _check_int(layer: str, name: str, value: Any, minimum: int) -> None:
    static_int(layer, name, value, minimum)  # a ValueError (IntArgumentError is one too)


def _check_float(layer: str, name: str, value: Any, lo: float, hi: float, hi_open: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    ok = ok and lo <= value and (value < hi if hi_open else value <= hi)
    if not ok:
        interval = f"[{lo}, {hi})" if hi_open else f"[{lo}, {hi}]"
        raise ValueError(f"{layer}: {name} must be a float in {interval}, got {value!r}")


def _param(params: Any, name: str, layer: str) -> Any:
    """``params[name]`` with an error that says which layer wanted what."""
    if not isinstance(params, Mapping):
        raise TypeError(f"{layer}: params must be the dict returned by {layer}.init(key), got {type(params).__name__}")
    try:
        return params[name]
    except KeyError:
        raise KeyError(
            f"{layer}: params has no {name!r} (has {sorted(params)}); pass the dict returned by {layer}.init(key)"
        ) from None


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape) if hasattr(x, "shape") else tuple(jnp.shape(x))


def _no_params_input(layer: str, args: tuple[Any, ...]) -> Any:
    """``x`` from ``layer(x)`` or ``layer(params, x)`` (params must be empty)."""
    if len(args) == 1:
        return args[0]
    if len(args) == 2:
        params, x = args
        if params is not None and not (isinstance(params, Mapping) and not params):
            raise TypeError(f"{layer} has no parameters: call it as {layer}(x) or with empty params, {layer}({{}}, x)")
        return x
    raise TypeError(f"{layer} takes x (or params, x), got {len(args)} positional arguments")


# ---------------------------------------------------------------------------
# base
# ---------------------------------------------------------------------------


class Module:
    """Base of the layers: static config, ``init(key) -> params``, call on params.

    Subclasses are frozen dataclasses. ``has_params`` tells whether ``init``
    returns a non-empty dict (``Sequential`` stores only those)."""

    has_params: ClassVar[bool] = True

    def init(self, key: jax.Array) -> Params:
        """Fresh parameters (a dict of jax arrays; empty for parameter-free layers)."""
        return {}


# ---------------------------------------------------------------------------
# layers with parameters
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Linear(Module):
    """``y = x @ weight + bias`` with ``weight:[in, out]`` (rumus's layout) and
    ``bias:[out]``; ``x:[..., in]`` -> ``[..., out]``.

    Init (PyTorch's default): ``weight, bias ~ U(-1/sqrt(in), 1/sqrt(in))``.

    >>> import jax, jax.numpy as jnp, rumus_fx as rf
    >>> lin = rf.nn.Linear(3, 2)
    >>> params = lin.init(jax.random.key(0))
    >>> lin(params, jnp.ones((4, 3))).shape
    (4, 2)
    """

    in_features: int
    out_features: int
    bias: bool = True
    dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        _check_int("Linear", "in_features", self.in_features, 1)
        _check_int("Linear", "out_features", self.out_features, 1)

    def init(self, key: jax.Array) -> Params:
        kw, kb = jax.random.split(key)
        fan_in = self.in_features
        params = {"weight": _init.kaiming_uniform(kw, (fan_in, self.out_features), fan_in, dtype=self.dtype)}
        if self.bias:
            params["bias"] = _init.uniform(kb, (self.out_features,), 1.0 / math.sqrt(fan_in), self.dtype)
        return params

    def __call__(self, params: Params, x: Any) -> Tensor:
        w = _param(params, "weight", "Linear")
        vector = len(_shape(x)) == 1
        if vector:  # [in] -> [1, in]: matmul wants a matrix on the left
            x = ops.reshape(x, (1, -1))
        y = ops.matmul(x, w)
        if self.bias:
            y = ops.add_bias(y, _param(params, "bias", "Linear"))
        return ops.reshape(y, (self.out_features,)) if vector else y


@dataclasses.dataclass(frozen=True)
class Conv2d(Module):
    """2-D convolution (cross-correlation) of ``x:[B, in, H, W]`` with
    ``weight:[out, in, k, k]`` and ``bias:[out]`` -> ``[B, out, OH, OW]``.

    Init (PyTorch's default): ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` with
    ``fan_in = in * k * k`` for weight and bias.

    >>> import jax, jax.numpy as jnp, rumus_fx as rf
    >>> conv = rf.nn.Conv2d(1, 8, 3, padding=1)
    >>> conv(conv.init(jax.random.key(0)), jnp.ones((2, 1, 8, 8))).shape
    (2, 8, 8, 8)
    """

    in_channels: int
    out_channels: int
    kernel_size: int
    stride: int = 1
    padding: int = 0
    bias: bool = True
    dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        _check_int("Conv2d", "in_channels", self.in_channels, 1)
        _check_int("Conv2d", "out_channels", self.out_channels, 1)
        _check_int("Conv2d", "kernel_size", self.kernel_size, 1)
        _check_int("Conv2d", "stride", self.stride, 1)
        _check_int("Conv2d", "padding", self.padding, 0)

    def init(self, key: jax.Array) -> Params:
        kw, kb = jax.random.split(key)
        k = self.kernel_size
        fan_in = self.in_channels * k * k
        shape = (self.out_channels, self.in_channels, k, k)
        params = {"weight": _init.kaiming_uniform(kw, shape, fan_in, dtype=self.dtype)}
        if self.bias:
            params["bias"] = _init.uniform(kb, (self.out_channels,), 1.0 / math.sqrt(fan_in), self.dtype)
        return params

    def __call__(self, params: Params, x: Any) -> Tensor:
        w = _param(params, "weight", "Conv2d")
        b = _param(params, "bias", "Conv2d") if self.bias else None
        return ops.conv2d(x, w, b, stride=self.stride, padding=self.padding)


@dataclasses.dataclass(frozen=True)
class BatchNorm2d(Module):
    """Batch norm over ``x:[B, C, H, W]`` per channel, with running statistics
    carried explicitly as state (no hidden mutation, so it jits).

    ``params = bn.init(key)`` -> ``{"weight": ones, "bias": zeros}``;
    ``state = bn.init_state()`` -> ``{"mean": zeros, "var": ones}``;
    ``y, state = bn(params, x, state, training=True)``. Training normalises with
    the batch statistics and returns updated running statistics
    (``(1 - momentum) * running + momentum * batch``, biased variance, as
    rumus); ``training=False`` uses the running statistics and returns them
    unchanged. ``training`` must be a python bool (static under ``jax.jit``).

    >>> import jax, jax.numpy as jnp, rumus_fx as rf
    >>> bn = rf.nn.BatchNorm2d(3)
    >>> params, state = bn.init(jax.random.key(0)), bn.init_state()
    >>> y, state = bn(params, jnp.ones((2, 3, 4, 4)), state, training=True)
    >>> y.shape, state["mean"].shape
    ((2, 3, 4, 4), (3,))
    """

    num_features: int
    eps: float = 1e-5
    momentum: float = 0.1
    dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        _check_int("BatchNorm2d", "num_features", self.num_features, 1)
        _check_float("BatchNorm2d", "momentum", self.momentum, 0.0, 1.0)
        _check_float("BatchNorm2d", "eps", self.eps, 0.0, math.inf)

    def init(self, key: jax.Array) -> Params:
        return {
            "weight": _init.ones((self.num_features,), self.dtype),
            "bias": _init.zeros((self.num_features,), self.dtype),
        }

    def init_state(self) -> Params:
        """Running statistics before any batch: ``{"mean": zeros, "var": ones}`` (float32)."""
        return {
            "mean": jnp.zeros((self.num_features,), jnp.float32),
            "var": jnp.ones((self.num_features,), jnp.float32),
        }

    def __call__(self, params: Params, x: Any, state: Params, training: bool = True) -> tuple[Tensor, Params]:
        w = _param(params, "weight", "BatchNorm2d")
        b = _param(params, "bias", "BatchNorm2d")
        mean = _param(state, "mean", "BatchNorm2d state")
        var = _param(state, "var", "BatchNorm2d state")
        y, new_mean, new_var = ops.batch_norm_2d(
            x, w, b, mean, var, training=training, momentum=self.momentum, eps=self.eps
        )
        return y, {"mean": new_mean.value, "var": new_var.value}


@dataclasses.dataclass(frozen=True)
class LayerNorm(Module):
    """Layer norm over the last axis (size ``dim``), biased variance, with
    ``weight`` (ones) and ``bias`` (zeros) of shape ``[dim]``.

    >>> import jax, jax.numpy as jnp, rumus_fx as rf
    >>> ln = rf.nn.LayerNorm(4)
    >>> ln(ln.init(jax.random.key(0)), jnp.arange(8.0).reshape(2, 4)).shape
    (2, 4)
    """

    dim: int
    eps: float = 1e-5
    dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        _check_int("LayerNorm", "dim", self.dim, 1)
        _check_float("LayerNorm", "eps", self.eps, 0.0, math.inf)

    def init(self, key: jax.Array) -> Params:
        return {"weight": _init.ones((self.dim,), self.dtype), "bias": _init.zeros((self.dim,), self.dtype)}

    def __call__(self, params: Params, x: Any) -> Tensor:
        w = _param(params, "weight", "LayerNorm")
        b = _param(params, "bias", "LayerNorm")
        return ops.layer_norm(x, w, b, eps=self.eps)


@dataclasses.dataclass(frozen=True)
class Embedding(Module):
    """Lookup table ``weight:[num, dim]``: integer ``indices`` of any shape ->
    ``indices.shape + (dim,)``. Init (PyTorch's default): ``N(0, 1)``.

    >>> import jax, jax.numpy as jnp, rumus_fx as rf
    >>> emb = rf.nn.Embedding(10, 4)
    >>> emb(emb.init(jax.random.key(0)), jnp.array([[1, 2, 3]])).shape
    (1, 3, 4)
    """

    num_embeddings: int
    embedding_dim: int
    dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        _check_int("Embedding", "num_embeddings", self.num_embeddings, 1)
        _check_int("Embedding", "embedding_dim", self.embedding_dim, 1)

    def init(self, key: jax.Array) -> Params:
        return {"weight": _init.normal(key, (self.num_embeddings, self.embedding_dim), 1.0, self.dtype)}

    def __call__(self, params: Params, indices: Any) -> Tensor:
        return ops.embedding(indices, _param(params, "weight", "Embedding"))


# ---------------------------------------------------------------------------
# parameter-free layers
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Dropout(Module):
    """Inverted dropout: zero each element with probability ``p`` and scale the
    rest by ``1 / (1 - p)`` while training; identity with ``training=False``.
    The mask comes from an explicit ``jax.random`` key (reproducible).

    >>> import jax, jax.numpy as jnp, rumus_fx as rf
    >>> y = rf.nn.Dropout(0.5)(jnp.ones(8), key=jax.random.key(0), training=True)
    >>> sorted(set(y.value.tolist())) in ([0.0, 2.0], [2.0], [0.0])
    True
    """

    p: float = 0.5
    has_params: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check_float("Dropout", "p", self.p, 0.0, 1.0, hi_open=True)

    def __call__(self, *args: Any, key: jax.Array | None = None, training: bool = True) -> Tensor:
        x = _no_params_input("Dropout", args)
        if not isinstance(training, bool):
            raise TypeError(f"Dropout: training must be a python bool, got {training!r}")
        if not training or self.p == 0:
            return x if isinstance(x, Tensor) else Tensor._wrap(jnp.asarray(x))
        if key is None:
            raise ValueError("Dropout: training=True needs key= (a jax.random key); pass training=False for eval")
        return ops.dropout(x, self.p, key, training=True)


@dataclasses.dataclass(frozen=True)
class MaxPool2d(Module):
    """Max over ``kernel_size`` windows of ``x:[..., C, H, W]``; ``stride``
    defaults to ``kernel_size``.

    >>> import jax.numpy as jnp, rumus_fx as rf
    >>> rf.nn.MaxPool2d(2)(jnp.ones((1, 3, 8, 8))).shape
    (1, 3, 4, 4)
    """

    kernel_size: int
    stride: int | None = None
    padding: int = 0
    has_params: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check_int("MaxPool2d", "kernel_size", self.kernel_size, 1)
        if self.stride is not None:
            _check_int("MaxPool2d", "stride", self.stride, 1)
        _check_int("MaxPool2d", "padding", self.padding, 0)

    def __call__(self, *args: Any) -> Tensor:
        x = _no_params_input("MaxPool2d", args)
        return ops.max_pool2d(x, self.kernel_size, self.stride, self.padding)


@dataclasses.dataclass(frozen=True)
class AdaptiveAvgPool2d(Module):
    """Average of ``x:[..., C, H, W]`` over ``output_size`` bins per spatial
    axis (an int or an ``(OH, OW)`` pair), as ``torch.nn.AdaptiveAvgPool2d``.

    >>> import jax.numpy as jnp, rumus_fx as rf
    >>> rf.nn.AdaptiveAvgPool2d(1)(jnp.ones((2, 3, 5, 5))).shape
    (2, 3, 1, 1)
    """

    output_size: int | tuple[int, int]
    has_params: ClassVar[bool] = False

    def __post_init__(self) -> None:
        size = self.output_size
        if isinstance(size, (list, tuple)):
            if len(size) != 2:
                raise ValueError(f"AdaptiveAvgPool2d: output_size must be an int or a pair, got {size!r}")
            for s in size:
                _check_int("AdaptiveAvgPool2d", "output_size", s, 1)
            object.__setattr__(self, "output_size", tuple(size))  # hashable
        else:
            _check_int("AdaptiveAvgPool2d", "output_size", size, 1)

    def __call__(self, *args: Any) -> Tensor:
        x = _no_params_input("AdaptiveAvgPool2d", args)
        return ops.adaptive_avg_pool2d(x, self.output_size)


@dataclasses.dataclass(frozen=True)
class Flatten(Module):
    """``[B, d1, d2, ...] -> [B, d1 * d2 * ...]`` (keeps axis 0).

    >>> import jax.numpy as jnp, rumus_fx as rf
    >>> rf.nn.Flatten()(jnp.ones((2, 3, 4, 4))).shape
    (2, 48)
    """

    has_params: ClassVar[bool] = False

    def __call__(self, *args: Any) -> Tensor:
        return ops.flatten(_no_params_input("Flatten", args))


# ---------------------------------------------------------------------------
# Sequential
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, init=False)
class Sequential(Module):
    """A chain of layers without state: ``rf.nn`` layers and plain callables
    of one argument (``rf.relu``, ``rf.gelu``, a lambda...).

    ``init`` returns ``{"0": params_of_layer_0, "3": ...}``, keyed by position
    and holding only the layers that have parameters (the key names of a
    PyTorch ``nn.Sequential`` state dict). ``seq(params, x, key=None,
    training=True)`` threads ``x`` through; each ``Dropout`` gets
    ``jax.random.fold_in(key, position)``. ``BatchNorm2d`` carries state and
    cannot be chained here: call it explicitly.

    >>> import jax, jax.numpy as jnp, rumus_fx as rf
    >>> mlp = rf.nn.Sequential([rf.nn.Linear(4, 8), rf.relu, rf.nn.Linear(8, 2)])
    >>> params = mlp.init(jax.random.key(0))
    >>> sorted(params), mlp(params, jnp.ones((5, 4))).shape
    (['0', '2'], (5, 2))
    """

    layers: tuple[Any, ...]

    def __init__(self, *layers: Any) -> None:
        if len(layers) == 1 and isinstance(layers[0], (list, tuple)):
            layers = tuple(layers[0])
        for i, layer in enumerate(layers):
            if isinstance(layer, BatchNorm2d):
                raise TypeError(
                    f"Sequential: layer {i} is a BatchNorm2d, which carries running statistics "
                    "(y, state = bn(params, x, state, training=...)); call it explicitly instead"
                )
            if not callable(layer):
                raise TypeError(f"Sequential: layer {i} is not callable: {layer!r}")
        object.__setattr__(self, "layers", tuple(layers))

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> Any:
        return self.layers[i]

    def init(self, key: jax.Array) -> Params:
        params: Params = {}
        keys = jax.random.split(key, max(len(self.layers), 1))
        for i, layer in enumerate(self.layers):
            if isinstance(layer, Module) and layer.has_params:
                p = layer.init(keys[i])
                if p:
                    params[str(i)] = p
        return params

    def __call__(self, params: Params, x: Any, *, key: jax.Array | None = None, training: bool = True) -> Tensor:
        if not isinstance(params, Mapping):
            raise TypeError(f"Sequential: params must be the dict returned by init(key), got {type(params).__name__}")
        for i, layer in enumerate(self.layers):
            x = self._apply(i, layer, params, x, key, training)
        return x if isinstance(x, Tensor) else Tensor._wrap(jnp.asarray(x))

    @staticmethod
    def _apply(i: int, layer: Any, params: Mapping[str, Any], x: Any, key: Any, training: bool) -> Any:
        if isinstance(layer, Dropout):
            sub = None if key is None else jax.random.fold_in(key, i)
            return layer(x, key=sub, training=training)
        if isinstance(layer, Module) and layer.has_params:
            if str(i) not in params:
                raise KeyError(f"Sequential: params has no entry {str(i)!r} for layer {i} ({type(layer).__name__})")
            return layer(params[str(i)], x)
        return layer(x)
