"""Load a PyTorch ``state_dict`` into ``rf.nn`` parameters: names and layouts mapped, mismatches refused.

``load_torch_state_dict(model, source)`` walks ``model`` (an ``rf.nn`` layer, or a
nested dict/list of them, named as the PyTorch module's attributes) and builds the
``params`` pytree that ``model.init(key)`` would return, and the ``state`` of its
batch norms, from PyTorch's tensors:

============================  ==============================  =====================================
rf.nn layer                   PyTorch key                      mapping
============================  ==============================  =====================================
``Linear``                    ``weight [out, in]``, ``bias``   weight transposed to rf's ``[in, out]``
``Conv2d``                    ``weight [out, in, k, k]``       as is
``BatchNorm2d``               ``weight``, ``bias``             params
                              ``running_mean/running_var``     ``state["mean"]/state["var"]``
                              ``num_batches_tracked``          read and dropped (rf keeps no count)
``LayerNorm``, ``Embedding``  ``weight``, ``bias``             as is
``MultiheadAttention``        ``in_proj_weight [3D, D]``,      ``qkv`` (transposed), ``proj``
                              ``out_proj.*`` (or ``qkv.*``,
                              ``proj.*`` Linear submodules)
``TransformerBlock``          ``ln1 attn ln2 fc1 fc2``         each part as above
``Sequential``                ``"<position>.<name>"``          as ``nn.Sequential``
============================  ==============================  =====================================

The mapping is decided by the layer, never guessed from shapes: a square
``Linear`` weight is transposed like any other (its shape cannot tell the two
layouts apart, so looking at it would load it silently wrong half of the time).
Anything that does not fit raises :class:`StateDictError` naming the key: a shape
that differs from the layer's, a key the model needs and the dict lacks, a key
the dict has and no layer reads (``strict=False`` ignores those), a layer this
module has no mapping for, a non-floating tensor, a file ``rf.nn.save`` wrote (it
holds rf's layouts already: read it with ``rf.nn.load``).

``source`` is a mapping of names to arrays (numpy, jax or torch tensors), a
PyTorch module (its ``state_dict()``), or a path: ``.safetensors`` files are read
with numpy alone (no torch import, no safetensors package); other files
(``.pt``/``.pth``/``.bin``) go through ``torch.load(..., weights_only=True)`` and
need torch installed.

>>> import numpy as np, jax.numpy as jnp, rumus_fx as rf
>>> lin = rf.nn.Linear(3, 2)
>>> sd = {"weight": np.arange(6.0).reshape(2, 3), "bias": np.zeros(2)}   # torch's [out, in]
>>> params, state = rf.nn.load_torch_state_dict(lin, sd)
>>> params["weight"].shape, state
((3, 2), {})
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ShapeError
from .layers import BatchNorm2d, Conv2d, Embedding, LayerNorm, Linear, Module, Params, Sequential
from .serialization import _CHECKSUM_KEY, _DTYPES
from .transformer import MultiheadAttention, TransformerBlock

__all__ = ["StateDictError", "load_torch_state_dict", "read_safetensors"]


class StateDictError(ShapeError):
    """A PyTorch state dict that does not fit an ``rf.nn`` model: a shape mismatch, a
    missing or extra key, a layer without a mapping, or an unreadable source. A
    ``ValueError`` (through ``rf.ShapeError``); the message names the key and the fix."""


@dataclasses.dataclass(frozen=True)
class _Entry:
    key: str  # PyTorch's dotted name
    path: tuple[str, ...]  # where it goes in rf's params (or state)
    layer: str  # the rf layer that reads it, for messages
    transpose: bool = False  # PyTorch [out, in] -> rf [in, out]
    state: bool = False  # batch norm running statistics


def _linear(m: Linear, prefix: str, path: tuple[str, ...], name: str = "Linear") -> Iterator[_Entry]:
    yield _Entry(prefix + "weight", (*path, "weight"), name, transpose=True)
    if m.bias:
        yield _Entry(prefix + "bias", (*path, "bias"), name)


def _entries(model: Any, prefix: str, path: tuple[str, ...], keys: frozenset[str]) -> Iterator[_Entry]:
    """The keys ``model`` reads from a state dict, where each goes, and how."""
    name = type(model).__name__
    if isinstance(model, Linear):
        yield from _linear(model, prefix, path)
    elif isinstance(model, Conv2d):
        yield _Entry(prefix + "weight", (*path, "weight"), name)
        if model.bias:
            yield _Entry(prefix + "bias", (*path, "bias"), name)
    elif isinstance(model, BatchNorm2d):
        yield _Entry(prefix + "weight", (*path, "weight"), name)
        yield _Entry(prefix + "bias", (*path, "bias"), name)
        yield _Entry(prefix + "running_mean", (*path, "mean"), name, state=True)
        yield _Entry(prefix + "running_var", (*path, "var"), name, state=True)
    elif isinstance(model, LayerNorm):
        yield _Entry(prefix + "weight", (*path, "weight"), name)
        yield _Entry(prefix + "bias", (*path, "bias"), name)
    elif isinstance(model, Embedding):
        yield _Entry(prefix + "weight", (*path, "weight"), name)
    elif isinstance(model, MultiheadAttention):
        if prefix + "in_proj_weight" in keys:  # torch.nn.MultiheadAttention's names
            yield _Entry(prefix + "in_proj_weight", (*path, "qkv", "weight"), name, transpose=True)
            if model.bias:
                yield _Entry(prefix + "in_proj_bias", (*path, "qkv", "bias"), name)
            yield from _linear(model._proj, prefix + "out_proj.", (*path, "proj"), name)
        else:  # a fused qkv Linear and a proj Linear, as GPT-style code names them
            yield from _linear(model._qkv, prefix + "qkv.", (*path, "qkv"), name)
            yield from _linear(model._proj, prefix + "proj.", (*path, "proj"), name)
    elif isinstance(model, TransformerBlock):
        for part, layer in model._parts.items():
            yield from _entries(layer, f"{prefix}{part}.", (*path, part), keys)
    elif isinstance(model, Sequential):
        for i, layer in enumerate(model.layers):
            if isinstance(layer, Module) and layer.has_params:
                yield from _entries(layer, f"{prefix}{i}.", (*path, str(i)), keys)
    elif isinstance(model, Mapping):
        for k, layer in model.items():
            yield from _entries(layer, f"{prefix}{k}.", (*path, str(k)), keys)
    elif isinstance(model, (list, tuple)):
        for i, layer in enumerate(model):
            yield from _entries(layer, f"{prefix}{i}.", (*path, str(i)), keys)
    elif isinstance(model, Module):
        if model.has_params:
            raise StateDictError(
                f"load_torch_state_dict: no PyTorch mapping for the layer {name} at {prefix.rstrip('.') or 'the root'!r}"
                " (known: Linear, Conv2d, BatchNorm2d, LayerNorm, Embedding, MultiheadAttention, TransformerBlock,"
                " Sequential and parameter-free layers); load its parameters by hand"
            )
    elif not callable(model):
        raise StateDictError(
            f"load_torch_state_dict: {prefix.rstrip('.') or 'the model'!r} is a {name}, not an rf.nn layer, "
            "a dict or list of layers, or a parameter-free callable"
        )


# ---------------------------------------------------------------------------
# sources
# ---------------------------------------------------------------------------


def read_safetensors(path: str | os.PathLike[str]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The arrays and metadata of a ``.safetensors`` file, read with numpy alone.

    The format: an 8-byte little-endian header size, a JSON header mapping each name
    to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the data
    after the header) and an optional ``"__metadata__"`` of strings, then the data.
    Raises :class:`StateDictError` for a truncated or malformed file."""
    where = f"load_torch_state_dict({os.fspath(path)!r})"
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise StateDictError(f"{where}: not a safetensors file ({len(data)} bytes)")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise StateDictError(f"{where}: truncated: the header claims {n} bytes, {len(data) - 8} follow")
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise StateDictError(f"{where}: corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise StateDictError(f"{where}: corrupt safetensors header: not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    body = memoryview(data)[8 + n :]
    arrays: dict[str, np.ndarray] = {}
    for key, info in header.items():
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise StateDictError(
                f"{where}: tensor {key!r} has a malformed or unsupported header entry {info!r}"
            ) from None
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if not 0 <= begin <= end <= len(body) or end - begin != size:
            raise StateDictError(f"{where}: tensor {key!r}: offsets {begin}..{end} do not hold {shape} {dtype}")
        le = dtype.newbyteorder("<") if dtype.itemsize > 1 and dtype.kind != "V" else dtype
        arrays[key] = np.frombuffer(body[begin:end], dtype=le).astype(dtype, copy=False).reshape(shape)
    return arrays, metadata


def _to_numpy(key: str, value: Any) -> np.ndarray:
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch.Tensor, without importing torch
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        value = value.numpy()
    try:
        return np.asarray(value)
    except Exception as e:
        raise StateDictError(f"load_torch_state_dict: {key!r} is a {type(value).__name__}, not an array: {e}") from None


def _read_source(source: Any) -> dict[str, np.ndarray]:
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if path.endswith(".safetensors"):
            arrays, metadata = read_safetensors(path)
            if isinstance(metadata, Mapping) and _CHECKSUM_KEY in metadata:
                raise StateDictError(
                    f"load_torch_state_dict({path!r}): rf.nn.save wrote this file, in rf's layouts "
                    "(a Linear weight is [in, out] there); read it with rf.nn.load(path, like=params)"
                )
            return arrays
        try:
            import torch
        except ImportError:
            raise StateDictError(
                f"load_torch_state_dict({path!r}): reading a PyTorch pickle needs torch installed; or save it "
                "as safetensors (safetensors.torch.save_file(model.state_dict(), 'model.safetensors')), "
                "which loads without torch"
            ) from None
        source = torch.load(path, map_location="cpu", weights_only=True)
    if hasattr(source, "state_dict") and callable(source.state_dict):
        source = source.state_dict()
    if not isinstance(source, Mapping):
        raise StateDictError(
            f"load_torch_state_dict: expected a state dict (a mapping of names to arrays), a torch module or a "
            f"path, got {type(source).__name__}"
        )
    return {str(k): _to_numpy(str(k), v) for k, v in source.items()}


# ---------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------


def _expected(model: Any) -> tuple[Any, Any]:
    """The shapes and dtypes of ``model``'s params and state, without computing them."""

    def build(key: jax.Array) -> tuple[Any, Any]:
        return _init_tree(model, key), _state_tree(model)

    return jax.eval_shape(build, jax.random.key(0))


def _init_tree(model: Any, key: jax.Array) -> Any:
    if isinstance(model, Module):
        return model.init(key)
    if isinstance(model, Mapping):
        return {str(k): _init_tree(v, key) for k, v in model.items()}
    if isinstance(model, (list, tuple)):
        return {str(i): _init_tree(v, key) for i, v in enumerate(model)}
    return {}


def _state_tree(model: Any) -> Any:
    if isinstance(model, BatchNorm2d):
        return model.init_state()
    if isinstance(model, Mapping):
        return {str(k): _state_tree(v) for k, v in model.items()}
    if isinstance(model, (list, tuple)):
        return {str(i): _state_tree(v) for i, v in enumerate(model)}
    return {}


def _get(tree: Any, path: Sequence[str]) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _set(tree: dict[str, Any], path: Sequence[str], value: Any) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def load_torch_state_dict(
    model: Any,
    source: Mapping[str, Any] | str | os.PathLike[str] | Any,
    *,
    strict: bool = True,
    prefix: str = "",
) -> tuple[Params, Params]:
    """``(params, state)`` for ``model`` from a PyTorch ``state_dict``.

    Args:
      model: an ``rf.nn`` layer, or a nested dict/list of layers keyed like the
        PyTorch module's attributes (``{"conv": rf.nn.Conv2d(...), "bn": ...}`` for a
        module with ``self.conv``, ``self.bn``); parameter-free layers and plain
        callables (``rf.relu``) read nothing.
      source: a mapping of names to arrays (numpy, jax or torch tensors), a torch
        module, or a path (``.safetensors`` read without torch; a pickle through
        ``torch.load(weights_only=True)``).
      strict: refuse keys that no layer reads (``num_batches_tracked`` is always
        read and dropped). With ``strict=False`` they are ignored; missing keys
        and shape mismatches always raise.
      prefix: a prefix of every key to read (``"encoder."``); keys without it are
        extra.

    Returns:
      ``params`` with the structure and dtypes ``model.init(key)`` gives (a dict
      of layers gives a dict of their params), and ``state``: the batch norms'
      ``{"mean", "var"}`` where ``model`` has any, at their places, else ``{}``.

    Raises:
      StateDictError: a shape differs from the layer's, a key is missing or extra,
        a layer has no mapping, or the source cannot be read.
    """
    arrays = _read_source(source)
    keys = frozenset(arrays)
    entries = list(_entries(model, prefix, (), keys))
    want_params, want_state = _expected(model)
    params: dict[str, Any] = jax.tree.map(lambda _: None, want_params)
    state: dict[str, Any] = jax.tree.map(lambda _: None, want_state)
    missing = [e for e in entries if e.key not in arrays]
    if missing:
        raise StateDictError(
            f"load_torch_state_dict: missing key(s) {[e.key for e in missing]} (read by the {missing[0].layer} at "
            f"{'.'.join(missing[0].path[:-1]) or 'the root'!r}); the state dict has "
            f"{sorted(keys)[:12]}{' ...' if len(keys) > 12 else ''}"
        )
    used = {e.key for e in entries}
    ignored = {k for k in keys if k.startswith(prefix) and k[len(prefix) :].rsplit(".", 1)[-1] == "num_batches_tracked"}
    extra = sorted(keys - used - ignored)
    if strict and extra:
        raise StateDictError(
            f"load_torch_state_dict: unexpected key(s) {extra[:12]}{' ...' if len(extra) > 12 else ''}: no layer of the "
            "model reads them (a layer missing from the model, or named differently?); strict=False ignores them"
        )
    for e in entries:
        value = arrays[e.key]
        want = _get(want_state if e.state else want_params, e.path)
        if not (jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.complexfloating)):
            raise StateDictError(f"load_torch_state_dict: {e.key!r} ({e.layer}) has dtype {value.dtype}, not floating")
        torch_shape = tuple(want.shape[::-1]) if e.transpose else tuple(want.shape)
        if tuple(value.shape) != torch_shape:
            layout = " (PyTorch's [out, in]; rf stores its transpose)" if e.transpose else ""
            raise StateDictError(
                f"load_torch_state_dict: {e.key!r} has shape {tuple(value.shape)}, but the {e.layer} at "
                f"{'.'.join(e.path[:-1]) or 'the root'!r} needs {torch_shape}{layout}"
            )
        if e.transpose:
            value = value.T
        _set(state if e.state else params, e.path, jnp.asarray(value, dtype=want.dtype))
    return params, state
