"""Serialization of parameter pytrees to safetensors files: atomic ``save``, checked ``load``.

A pytree (nested dicts / lists / tuples / NamedTuples of arrays) is stored as a
flat safetensors file whose keys are the dotted paths to the leaves
(``{"blocks": [{"qkv": {"weight": w}}]}`` -> ``"blocks.0.qkv.weight"``), the
format rumus (and PyTorch state dicts) use. The file is written next to its
destination and renamed over it, so a crash leaves either the old or the new
checkpoint, never a mix. A SHA-256 of the tensor data in the header metadata
lets ``load`` detect a corrupted file.

Requires the optional ``safetensors`` package
(``pip install 'rumus-fx[examples]'`` or ``pip install safetensors``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import uuid
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ..tensor import Tensor

__all__ = ["load", "save"]

_CHECKSUM_KEY = "rumus_fx.sha256"
_FORMAT_KEY = "format"

# safetensors dtype tags -> numpy dtypes (the numpy API of safetensors lacks BF16 on load)
_DTYPES: dict[str, Any] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "C64": np.dtype(np.complex64),
}
_SAVABLE = {dt.name for dt in _DTYPES.values()}


def _safetensors() -> Any:
    try:
        import safetensors
        import safetensors.numpy
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError(
            "rumus_fx.nn.save/load need the optional 'safetensors' package: "
            "pip install safetensors (or pip install 'rumus-fx[examples]')"
        ) from None
    return safetensors


# ---------------------------------------------------------------------------
# pytree <-> dotted keys
# ---------------------------------------------------------------------------


def _key_part(k: Any) -> str:
    tu = jax.tree_util
    if isinstance(k, tu.DictKey):
        key = k.key
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise ValueError(f"save: dict keys must be str or int to become checkpoint keys, got {key!r}")
        return str(key)
    if isinstance(k, tu.SequenceKey):
        return str(k.idx)
    if isinstance(k, tu.GetAttrKey):
        return k.name
    if isinstance(k, tu.FlattenedIndexKey):
        return str(k.key)
    return str(k)


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(_key_part(k) for k in path)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, Tensor)


def _flatten_with_keys(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_tensor)
    return [(_dotted(path), leaf) for path, leaf in leaves], treedef


def _check_keys(keys: list[str], what: str, nesting: bool = True) -> None:
    """Unique keys and, with ``nesting``, none is a dotted prefix of another (so
    that ``load`` without ``like=`` can nest them unambiguously)."""
    seen: set[str] = set()
    for k in keys:
        if k in seen:
            raise ValueError(f"{what}: two leaves map to the same checkpoint key {k!r}")
        seen.add(k)
    if not nesting:
        return
    for k in keys:
        parts = k.split(".")
        for i in range(1, len(parts)):
            prefix = ".".join(parts[:i])
            if prefix in seen:
                raise ValueError(f"{what}: key {prefix!r} is both a leaf and the parent of {k!r}")


def _to_numpy(key: str, leaf: Any) -> np.ndarray:
    if isinstance(leaf, Tensor):
        leaf = leaf.value
    if isinstance(leaf, jax.core.Tracer):
        raise TypeError(f"save: leaf {key!r} is a traced value; save concrete arrays outside jax.jit / vmap")
    arr = leaf if isinstance(leaf, np.ndarray) else np.asarray(jnp.asarray(leaf))
    if arr.dtype.name not in _SAVABLE:
        raise ValueError(f"save: leaf {key!r} has dtype {arr.dtype}, which safetensors cannot store")
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    # (np.ascontiguousarray would turn a 0-d array into shape (1,))
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def _digest(arrays: Mapping[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for k in sorted(arrays):
        a = arrays[k]
        h.update(f"{k}\0{a.dtype.name}\0{a.shape}\0".encode())
        h.update(a.tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------


def save(path: str | os.PathLike[str], tree: Any, *, metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tree`` to ``path`` as a safetensors file, atomically.

    Keys are the dotted paths to the leaves (dict keys, list/tuple indices,
    NamedTuple field names). Leaves may be jax/numpy arrays, ``rf.Tensor`` or
    python scalars; any dtype safetensors knows (bfloat16 included). The bytes
    go to a temporary file in the destination's folder, are flushed and
    fsync'ed, then ``os.replace`` d over ``path``: if anything fails, an
    existing ``path`` is untouched and the temporary file is removed.
    ``metadata`` (str -> str) is stored in the header.

    >>> import os, tempfile, jax.numpy as jnp, rumus_fx as rf
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.safetensors")
    >>> rf.nn.save(path, {"fc": {"weight": jnp.ones((2, 3)), "bias": jnp.zeros(3)}})
    >>> sorted(rf.nn.load(path)["fc"])
    ['bias', 'weight']
    """
    st = _safetensors()
    items, _ = _flatten_with_keys(tree)
    _check_keys([k for k, _ in items], "save")
    arrays = {k: _to_numpy(k, leaf) for k, leaf in items}
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    meta[_FORMAT_KEY] = meta.get(_FORMAT_KEY, "np")
    meta[_CHECKSUM_KEY] = _digest(arrays)
    data = st.numpy.save(arrays, metadata=meta)
    _atomic_write(os.fspath(path), data)


def _atomic_write(path: str, data: bytes) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    tmp = os.path.join(folder, f".{base}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
    # O_EXCL: never clobber another writer's file; mode 0o666 lets the umask decide, as open() does
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(folder)


def _fsync_dir(folder: str) -> None:
    """Persist the rename itself (POSIX); best effort elsewhere."""
    try:
        dfd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


# ---------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------


def _read(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    st = _safetensors()
    with open(path, "rb") as f:
        data = f.read()
    where = f"load({path!r})"
    if len(data) < 8:
        raise ValueError(f"{where}: not a safetensors file: {len(data)} bytes is shorter than the 8-byte header size")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise ValueError(f"{where}: truncated file: the header claims {n} bytes but only {len(data) - 8} follow")
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
        if not isinstance(header, dict):
            raise TypeError("the header is not a JSON object")
    except (UnicodeDecodeError, ValueError, TypeError) as e:
        raise ValueError(f"{where}: corrupt safetensors header: {e}") from None
    metadata = header.get("__metadata__") or {}
    try:
        views = st.deserialize(data)
    except Exception as e:  # SafetensorError: truncated buffer, bad offsets, ...
        raise ValueError(f"{where}: corrupt or truncated safetensors file: {e}") from None
    arrays: dict[str, np.ndarray] = {}
    for key, view in views:
        dtype = _DTYPES.get(view["dtype"])
        if dtype is None:
            raise ValueError(f"{where}: tensor {key!r} has unsupported dtype {view['dtype']!r}")
        shape = tuple(view["shape"])
        buf = np.frombuffer(view["data"], dtype=dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype)
        if buf.size != int(np.prod(shape, dtype=np.int64)):
            raise ValueError(f"{where}: tensor {key!r} holds {buf.size} values, its shape {shape} needs more")
        arrays[key] = buf.astype(dtype, copy=False).reshape(shape)
    expected = metadata.get(_CHECKSUM_KEY) if isinstance(metadata, dict) else None
    if expected is not None and _digest(arrays) != expected:
        raise ValueError(f"{where}: checksum mismatch: the tensor data is corrupt")
    return arrays, metadata


def _nest(arrays: Mapping[str, np.ndarray], where: str) -> dict[str, Any]:
    try:
        _check_keys(list(arrays), where)
    except ValueError as e:
        raise ValueError(f"{e}; pass like= to load it into an explicit structure") from None
    root: dict[str, Any] = {}
    for key in sorted(arrays):
        node = root
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = jnp.asarray(arrays[key])
    return root


def _like_aval(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    if isinstance(leaf, Tensor):
        leaf = leaf.value
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return tuple(leaf.shape), np.dtype(leaf.dtype)
    arr = jnp.asarray(leaf)
    return tuple(arr.shape), np.dtype(arr.dtype)


def _kind(dtype: np.dtype) -> str:
    if dtype == np.bool_:
        return "bool"
    if jnp.issubdtype(dtype, jnp.floating):
        return "float"
    if jnp.issubdtype(dtype, jnp.integer):
        return "int"
    return dtype.kind


def load(path: str | os.PathLike[str], like: Any = None) -> Any:
    """Read a safetensors checkpoint written by ``save`` (or any safetensors file).

    Without ``like``: nested dicts of jax arrays, split at the dots of the keys
    (list indices come back as dict keys ``"0"``, ``"1"``...).

    With ``like`` (a pytree of arrays, ``jax.ShapeDtypeStruct`` or ``rf.Tensor``
    leaves, e.g. freshly initialised params or an optax state): the result has
    exactly ``like``'s structure (dicts, lists, tuples, NamedTuples), each leaf
    cast to ``like``'s dtype (float to float, int to int).

    Raises ``ValueError`` (before building anything) for a truncated or corrupt
    file and, with ``like``, for missing or unexpected keys and mismatched
    shapes or dtype kinds, naming every offending key.

    >>> import os, tempfile, jax, jax.numpy as jnp, rumus_fx as rf
    >>> lin = rf.nn.Linear(3, 2)
    >>> params = lin.init(jax.random.key(0))
    >>> path = os.path.join(tempfile.mkdtemp(), "lin.safetensors")
    >>> rf.nn.save(path, params)
    >>> back = rf.nn.load(path, like=params)
    >>> bool((back["weight"] == params["weight"]).all())
    True
    """
    where = f"load({os.fspath(path)!r})"
    arrays, _ = _read(os.fspath(path))
    if like is None:
        return _nest(arrays, where)
    items, treedef = _flatten_with_keys(like)
    _check_keys([k for k, _ in items], f"{where}: like=", nesting=False)
    wanted = {k for k, _ in items}
    problems: list[str] = []
    missing = [k for k, _ in items if k not in arrays]
    unexpected = sorted(k for k in arrays if k not in wanted)
    if missing:
        problems.append("missing key(s) " + ", ".join(repr(k) for k in missing))
    if unexpected:
        problems.append("unexpected key(s) " + ", ".join(repr(k) for k in unexpected))
    leaves = []
    for key, leaf in items:
        if key not in arrays:
            continue
        shape, dtype = _like_aval(leaf)
        arr = arrays[key]
        if tuple(arr.shape) != shape:
            problems.append(f"key {key!r}: shape {tuple(arr.shape)} in the file, {shape} expected")
            continue
        if _kind(arr.dtype) != _kind(dtype):
            problems.append(f"key {key!r}: dtype {arr.dtype} in the file cannot become {dtype}")
            continue
        # jax arrays cannot hold 64-bit types unless x64 is on: ask for what jax can make
        leaves.append(jnp.asarray(arr, dtype=jax.dtypes.canonicalize_dtype(dtype)))
    if problems:
        raise ValueError(f"{where}: the checkpoint does not match like=: " + "; ".join(problems))
    return jax.tree_util.tree_unflatten(treedef, leaves)
