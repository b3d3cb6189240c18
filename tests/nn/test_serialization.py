"""rf.nn.save / rf.nn.load: safetensors round trips, every error case, atomic writes."""

from __future__ import annotations

import json
import os
import struct
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf

safetensors = pytest.importorskip("safetensors")
st_numpy = pytest.importorskip("safetensors.numpy")


class Pair(NamedTuple):
    first: jax.Array
    second: jax.Array


def _tree():
    return {
        "embed": {"weight": jnp.arange(12.0).reshape(3, 4)},
        "blocks": [
            {"qkv": {"weight": jnp.ones((4, 12)), "bias": jnp.zeros(12)}},
            {"qkv": {"weight": 2 * jnp.ones((4, 12)), "bias": jnp.ones(12)}},
        ],
        "pair": Pair(jnp.asarray([1.5, -2.0], jnp.bfloat16), jnp.asarray(3, jnp.int32)),
        "head": (jnp.full((2, 2), 0.25, jnp.float16), jnp.asarray([True, False])),
    }


def _header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def test_round_trip_with_like_restores_structure_and_dtypes(tmp_path):
    tree = _tree()
    path = tmp_path / "ckpt.safetensors"
    rf.nn.save(path, tree)
    back = rf.nn.load(path, like=tree)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tree)
    assert isinstance(back["pair"], Pair) and isinstance(back["blocks"], list) and isinstance(back["head"], tuple)
    chex.assert_trees_all_equal_shapes_and_dtypes(back, tree)
    chex.assert_trees_all_equal(back, tree)
    assert back["pair"].first.dtype == jnp.bfloat16


def test_file_is_real_safetensors_with_dotted_keys(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    rf.nn.save(path, _tree(), metadata={"step": 7})
    header = _header(path)
    keys = set(header) - {"__metadata__"}
    assert keys == {
        "embed.weight",
        "blocks.0.qkv.weight",
        "blocks.0.qkv.bias",
        "blocks.1.qkv.weight",
        "blocks.1.qkv.bias",
        "pair.first",
        "pair.second",
        "head.0",
        "head.1",
    }
    assert header["pair.first"]["dtype"] == "BF16"
    assert header["pair.second"]["dtype"] == "I32"
    assert header["head.0"]["dtype"] == "F16"
    assert header["embed.weight"] == {**header["embed.weight"], "dtype": "F32", "shape": [3, 4]}
    assert header["__metadata__"]["step"] == "7"
    # the official reader opens it too
    with safetensors.safe_open(str(path), framework="np") as f:
        np.testing.assert_array_equal(f.get_tensor("blocks.1.qkv.bias"), np.ones(12, np.float32))


def test_load_without_like_gives_nested_dicts(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    rf.nn.save(path, _tree())
    back = rf.nn.load(path)
    assert set(back) == {"embed", "blocks", "pair", "head"}
    assert set(back["blocks"]) == {"0", "1"}
    np.testing.assert_array_equal(back["blocks"]["1"]["qkv"]["weight"], 2 * np.ones((4, 12)))
    assert back["pair"]["first"].dtype == jnp.bfloat16
    assert isinstance(back["embed"]["weight"], jax.Array)


def test_layer_params_round_trip_without_like(tmp_path):
    model = rf.nn.Sequential([rf.nn.Linear(3, 4), rf.relu, rf.nn.Linear(4, 2)])
    params = model.init(jax.random.key(0))
    rf.nn.save(tmp_path / "m.safetensors", params)
    back = rf.nn.load(tmp_path / "m.safetensors")  # Sequential params are dicts: same structure
    chex.assert_trees_all_equal(back, params)
    x = jnp.ones((2, 3))
    np.testing.assert_array_equal(model(back, x).value, model(params, x).value)


def test_optax_state_round_trip(tmp_path):
    optax = pytest.importorskip("optax")
    params = rf.nn.Linear(3, 2).init(jax.random.key(0))
    opt = optax.adam(1e-3)
    state = opt.init(params)
    # optax's adam mixes a python float with its int32 step count (not strict-clean)
    with jax.numpy_dtype_promotion("standard"):
        _, state = opt.update(jax.tree_util.tree_map(jnp.ones_like, params), state, params)
    rf.nn.save(tmp_path / "opt.safetensors", state)
    back = rf.nn.load(tmp_path / "opt.safetensors", like=opt.init(params))
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(state)
    chex.assert_trees_all_equal(back, state)


def test_like_accepts_shape_dtype_structs_and_casts_within_kind(tmp_path):
    rf.nn.save(tmp_path / "a.safetensors", {"w": jnp.ones((2, 3)), "n": jnp.asarray(5, jnp.int32)})
    like = {"w": jax.ShapeDtypeStruct((2, 3), jnp.bfloat16), "n": jax.ShapeDtypeStruct((), jnp.int64)}
    back = rf.nn.load(tmp_path / "a.safetensors", like=like)
    assert back["w"].dtype == jnp.bfloat16
    assert back["n"].dtype == jnp.int32  # int64 is canonicalised to int32 without x64
    assert int(back["n"]) == 5


def test_leaves_may_be_tensors_numpy_and_scalars(tmp_path):
    tree = {"t": rf.tensor(jnp.ones(3)), "np": np.arange(4, dtype=np.int64), "s": 2.5}
    rf.nn.save(tmp_path / "a.safetensors", tree)
    back = rf.nn.load(tmp_path / "a.safetensors")
    np.testing.assert_array_equal(back["t"], np.ones(3))
    assert _header(tmp_path / "a.safetensors")["np"]["dtype"] == "I64"
    assert float(back["s"]) == 2.5


def test_bfloat16_round_trip_is_bit_exact(tmp_path):
    x = jax.random.normal(jax.random.key(1), (64,), jnp.float32).astype(jnp.bfloat16)
    rf.nn.save(tmp_path / "bf.safetensors", {"x": x})
    back = rf.nn.load(tmp_path / "bf.safetensors")["x"]
    assert back.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(back).view(np.uint16), np.asarray(x).view(np.uint16))


# ---------------------------------------------------------------------------
# errors: mismatches
# ---------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    tree = {"a": {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}, "c": jnp.ones(4)}
    rf.nn.save(path, tree)
    return path, tree


def test_missing_key(saved):
    path, tree = saved
    like = {**tree, "d": jnp.ones(2)}
    with pytest.raises(ValueError, match=r"missing key\(s\) 'd'"):
        rf.nn.load(path, like=like)


def test_unexpected_key(saved):
    path, tree = saved
    like = {"a": tree["a"]}
    with pytest.raises(ValueError, match=r"unexpected key\(s\) 'c'"):
        rf.nn.load(path, like=like)


def test_renamed_key_reports_both(saved):
    path, tree = saved
    like = {"a": {"weight": tree["a"]["w"], "b": tree["a"]["b"]}, "c": tree["c"]}
    with pytest.raises(ValueError, match=r"missing key\(s\) 'a\.weight'.*unexpected key\(s\) 'a\.w'"):
        rf.nn.load(path, like=like)


def test_shape_mismatch(saved):
    path, tree = saved
    like = {**tree, "c": jnp.ones(5)}
    with pytest.raises(ValueError, match=r"key 'c': shape \(4,\) in the file, \(5,\) expected"):
        rf.nn.load(path, like=like)


def test_dtype_kind_mismatch(saved):
    path, tree = saved
    like = {**tree, "c": jnp.ones(4, jnp.int32)}
    with pytest.raises(ValueError, match="key 'c': dtype float32"):
        rf.nn.load(path, like=like)


def test_structure_conflict_without_like(tmp_path):
    # a flat dict whose keys nest ambiguously cannot be saved
    with pytest.raises(ValueError, match="both a leaf and the parent"):
        rf.nn.save(tmp_path / "x.safetensors", {"a": jnp.ones(1), "a.b": jnp.ones(1)})
    with pytest.raises(ValueError, match="same checkpoint key"):
        rf.nn.save(tmp_path / "x.safetensors", {"a.b": jnp.ones(1), "a": {"b": jnp.ones(1)}})
    assert not (tmp_path / "x.safetensors").exists()
    # a foreign file with such keys loads only with like=
    data = st_numpy.save({"a": np.ones(1, np.float32), "a.b": np.ones(1, np.float32)})
    (tmp_path / "foreign.safetensors").write_bytes(data)
    with pytest.raises(ValueError, match="like="):
        rf.nn.load(tmp_path / "foreign.safetensors")
    back = rf.nn.load(tmp_path / "foreign.safetensors", like={"a": jnp.zeros(1), "a.b": jnp.zeros(1)})
    assert set(back) == {"a", "a.b"}


def test_save_rejects_traced_and_bad_keys(tmp_path):
    with pytest.raises(TypeError, match="traced"):
        jax.jit(lambda x: rf.nn.save(tmp_path / "t.safetensors", {"x": x}))(jnp.ones(2))
    with pytest.raises(ValueError, match="dict keys"):
        rf.nn.save(tmp_path / "t.safetensors", {("a", 1): jnp.ones(2)})
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------
# errors: damaged files
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [0, 5, 8, 20, -4, -1])
def test_truncated_file(saved, keep):
    path, tree = saved
    data = path.read_bytes()
    cut = keep if keep >= 0 else len(data) + keep
    path.write_bytes(data[:cut])
    with pytest.raises(ValueError, match=r"truncated|not a safetensors|corrupt"):
        rf.nn.load(path)
    with pytest.raises(ValueError):
        rf.nn.load(path, like=tree)


def test_corrupt_header(saved):
    path, _ = saved
    data = bytearray(path.read_bytes())
    data[9] = ord("#")  # break the JSON
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupt"):
        rf.nn.load(path)


def test_corrupt_data_is_caught_by_the_checksum(saved):
    path, tree = saved
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # flip bits inside a tensor
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        rf.nn.load(path, like=tree)


def test_not_a_safetensors_file(tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"\x00" * 3 + os.urandom(64))
    with pytest.raises(ValueError):
        rf.nn.load(path)


def test_missing_file_is_an_oserror(tmp_path):
    with pytest.raises(FileNotFoundError):
        rf.nn.load(tmp_path / "nope.safetensors")


# ---------------------------------------------------------------------------
# atomic writes
# ---------------------------------------------------------------------------


def test_failed_rename_keeps_the_old_file_and_removes_the_temp(saved, monkeypatch):
    path, tree = saved
    before = path.read_bytes()

    def boom(src, dst):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk on fire"):
        rf.nn.save(path, {"other": jnp.ones(7)})
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(path.parent) == [path.name]  # no temp file left behind
    chex.assert_trees_all_equal(rf.nn.load(path, like=tree), tree)


def test_failed_write_keeps_the_old_file_and_removes_the_temp(saved, monkeypatch):
    path, _ = saved
    before = path.read_bytes()

    def boom(fd):
        raise OSError("fsync failed")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="fsync failed"):
        rf.nn.save(path, {"other": jnp.ones(7)})
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(path.parent) == [path.name]


def test_interrupt_during_save_keeps_the_old_file(saved, monkeypatch):
    path, _ = saved
    before = path.read_bytes()

    def interrupt(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupt)
    with pytest.raises(KeyboardInterrupt):
        rf.nn.save(path, {"other": jnp.ones(7)})
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(path.parent) == [path.name]


def test_temp_file_is_written_in_the_destination_folder(saved, monkeypatch):
    path, _ = saved
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append((os.fspath(src), os.fspath(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    rf.nn.save(path, {"x": jnp.ones(2)})
    ((src, dst),) = seen
    assert os.path.dirname(os.path.abspath(src)) == str(path.parent)
    assert dst == str(path)
    assert rf.nn.load(path)["x"].shape == (2,)


def test_overwrite_replaces_content(saved):
    path, _ = saved
    rf.nn.save(path, {"x": jnp.full(3, 4.0)})
    assert set(rf.nn.load(path)) == {"x"}


def test_missing_safetensors_gives_a_clear_error(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "safetensors" or name.startswith("safetensors."):
            raise ImportError("No module named 'safetensors'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match="pip install safetensors"):
        rf.nn.save(tmp_path / "x.safetensors", {"x": jnp.ones(1)})
