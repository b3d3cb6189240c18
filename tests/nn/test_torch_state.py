"""rf.nn.load_torch_state_dict: PyTorch names and layouts mapped for every rf.nn layer (a
square Linear weight transposed, never loaded as is), safetensors read without torch,
every refusal; and, where torch is installed, the loaded model against torch's own."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rumus_fx as rf
from rumus_fx.nn import StateDictError

HAS_TORCH = importlib.util.find_spec("torch") is not None


def _r(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_square_linear_weight_is_transposed(rng):
    """A square [out, in] weight has the shape of its transpose: the layer decides, and the
    output is PyTorch's ``x @ W.T + b`` (loading it as is would give ``x @ W + b``)."""
    w, b, x = _r(rng, 4, 4), _r(rng, 4), _r(rng, 3, 4)
    lin = rf.nn.Linear(4, 4)
    params, state = rf.nn.load_torch_state_dict(lin, {"weight": w, "bias": b})
    assert state == {}
    y = np.asarray(lin(params, x).value)
    np.testing.assert_allclose(y, x @ w.T + b, rtol=1e-5, atol=1e-5)
    assert not np.allclose(y, x @ w + b, atol=1e-3)


def _cnn_model():
    return {
        "conv": rf.nn.Conv2d(1, 3, 3, padding=1),
        "bn": rf.nn.BatchNorm2d(3),
        "head": rf.nn.Sequential([rf.nn.MaxPool2d(2), rf.nn.Flatten(), rf.nn.Linear(3 * 2 * 2, 5)]),
        "emb": rf.nn.Embedding(7, 2),
        "ln": rf.nn.LayerNorm(2),
        "act": rf.relu,
    }


def _cnn_state_dict(rng):
    return {
        "conv.weight": _r(rng, 3, 1, 3, 3),
        "conv.bias": _r(rng, 3),
        "bn.weight": _r(rng, 3),
        "bn.bias": _r(rng, 3),
        "bn.running_mean": _r(rng, 3),
        "bn.running_var": np.abs(_r(rng, 3)) + 0.5,
        "bn.num_batches_tracked": np.array(5, np.int64),
        "head.2.weight": _r(rng, 5, 12),
        "head.2.bias": _r(rng, 5),
        "emb.weight": _r(rng, 7, 2),
        "ln.weight": _r(rng, 2),
        "ln.bias": _r(rng, 2),
    }


def test_every_layer_maps_names_and_layouts(rng):
    model, sd = _cnn_model(), _cnn_state_dict(rng)
    params, state = rf.nn.load_torch_state_dict(model, sd)
    init = jax.tree.map(
        lambda a: (a.shape, a.dtype),
        {k: m.init(jax.random.key(0)) if isinstance(m, rf.nn.Module) else {} for k, m in model.items()},
    )
    assert jax.tree.map(lambda a: (a.shape, a.dtype), params) == init
    np.testing.assert_array_equal(params["conv"]["weight"], sd["conv.weight"])
    np.testing.assert_array_equal(params["head"]["2"]["weight"], sd["head.2.weight"].T)
    np.testing.assert_array_equal(params["emb"]["weight"], sd["emb.weight"])
    np.testing.assert_array_equal(state["bn"]["mean"], sd["bn.running_mean"])
    np.testing.assert_array_equal(state["bn"]["var"], sd["bn.running_var"])
    assert set(state) == {"bn", "conv", "head", "emb", "ln", "act"} and state["conv"] == {}


def test_attention_and_transformer_block_names(rng):
    d = 4
    mha = rf.nn.MultiheadAttention(d, 2)
    sd = {"in_proj_weight": _r(rng, 3 * d, d), "in_proj_bias": _r(rng, 3 * d)}
    sd |= {"out_proj.weight": _r(rng, d, d), "out_proj.bias": _r(rng, d)}
    params, _ = rf.nn.load_torch_state_dict(mha, sd)
    np.testing.assert_array_equal(params["qkv"]["weight"], sd["in_proj_weight"].T)
    np.testing.assert_array_equal(params["proj"]["weight"], sd["out_proj.weight"].T)
    block = rf.nn.TransformerBlock(d, 2)
    sd = {f"{ln}.{p}": _r(rng, d) for ln in ("ln1", "ln2") for p in ("weight", "bias")}
    sd |= {"attn.qkv.weight": _r(rng, 3 * d, d), "attn.qkv.bias": _r(rng, 3 * d)}
    sd |= {"attn.proj.weight": _r(rng, d, d), "attn.proj.bias": _r(rng, d)}
    sd |= {
        "fc1.weight": _r(rng, 4 * d, d),
        "fc1.bias": _r(rng, 4 * d),
        "fc2.weight": _r(rng, d, 4 * d),
        "fc2.bias": _r(rng, d),
    }
    params, _ = rf.nn.load_torch_state_dict(block, sd)
    np.testing.assert_array_equal(params["fc1"]["weight"], sd["fc1.weight"].T)
    np.testing.assert_array_equal(params["attn"]["qkv"]["weight"], sd["attn.qkv.weight"].T)
    assert block(params, jnp.ones((1, 3, d))).shape == (1, 3, d)


def test_prefix_and_dtype(rng):
    lin = rf.nn.Linear(2, 3, dtype=jnp.bfloat16)
    sd = {"enc.weight": _r(rng, 3, 2).astype(np.float64), "enc.bias": _r(rng, 3)}
    params, _ = rf.nn.load_torch_state_dict(lin, sd, prefix="enc.")
    assert params["weight"].dtype == jnp.bfloat16 and params["weight"].shape == (2, 3)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda sd: sd.pop("head.2.bias"), r"missing key\(s\) \['head.2.bias'\]"),
        (lambda sd: sd.update({"fc.weight": np.zeros((2, 2), np.float32)}), r"unexpected key\(s\) \['fc.weight'\]"),
        (
            lambda sd: sd.update({"head.2.weight": np.zeros((12, 5), np.float32)}),
            r"'head.2.weight' has shape \(12, 5\).*\(5, 12\)",
        ),
        (lambda sd: sd.update({"emb.weight": np.zeros((7, 2), np.int32)}), "not floating"),
    ],
    ids=["missing", "extra", "shape", "dtype"],
)
def test_mismatches_are_refused(rng, edit, match):
    sd = _cnn_state_dict(rng)
    edit(sd)
    with pytest.raises(StateDictError, match=match):
        rf.nn.load_torch_state_dict(_cnn_model(), sd)


def test_extra_keys_allowed_when_not_strict(rng):
    sd = _cnn_state_dict(rng) | {"fc.weight": np.zeros((2, 2), np.float32)}
    params, _ = rf.nn.load_torch_state_dict(_cnn_model(), sd, strict=False)
    assert "fc" not in params


def test_unknown_layer_is_refused():
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Mine(rf.nn.Module):
        def init(self, key):
            return {"w": jnp.zeros(2)}

    with pytest.raises(StateDictError, match="no PyTorch mapping for the layer Mine at 'mine'"):
        rf.nn.load_torch_state_dict({"mine": Mine()}, {"mine.w": np.zeros(2, np.float32)})
    assert issubclass(StateDictError, rf.ShapeError) and issubclass(StateDictError, ValueError)


def test_safetensors_without_torch(tmp_path, rng):
    """A .safetensors file loads with numpy alone (torch never imported), bfloat16 included."""
    st = pytest.importorskip("safetensors.numpy")
    import ml_dtypes

    sd = {"weight": _r(rng, 3, 2).astype(ml_dtypes.bfloat16), "bias": _r(rng, 3)}
    path = tmp_path / "lin.safetensors"
    st.save_file(sd, str(path))
    code = (
        "import sys, rumus_fx as rf; p, _ = rf.nn.load_torch_state_dict(rf.nn.Linear(2, 3), sys.argv[1]); "
        "print(p['weight'].shape, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "(2, 3) False"
    params, _ = rf.nn.load_torch_state_dict(rf.nn.Linear(2, 3), path)
    np.testing.assert_array_equal(params["weight"], sd["weight"].astype(np.float32).T)
    np.testing.assert_array_equal(params["bias"], sd["bias"])


def test_rf_checkpoint_and_corrupt_files_are_refused(tmp_path):
    lin = rf.nn.Linear(2, 2)
    rf.nn.save(tmp_path / "rf.safetensors", lin.init(jax.random.key(0)))
    with pytest.raises(StateDictError, match=r"rf\.nn\.save wrote this file"):
        rf.nn.load_torch_state_dict(lin, tmp_path / "rf.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(StateDictError, match="truncated"):
        rf.nn.load_torch_state_dict(lin, tmp_path / "bad.safetensors")
    if not HAS_TORCH:
        (tmp_path / "m.pt").write_bytes(b"")
        with pytest.raises(StateDictError, match="needs torch installed"):
            rf.nn.load_torch_state_dict(lin, tmp_path / "m.pt")


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed: the live comparison with PyTorch needs it")
def test_against_torch_live(tmp_path):
    """A PyTorch CNN's state dict (module, .pt file and safetensors) gives rf the same
    outputs in eval mode, and the same loss and gradients in a training step."""
    import torch

    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(4)
            self.head = torch.nn.Sequential(torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 4))
            self.attn = torch.nn.MultiheadAttention(4, 2, batch_first=True)

        def forward(self, x):
            h = self.head(torch.relu(self.bn(self.conv(x))))[:, None, :]  # [B, 1, 4]
            h = h.expand(-1, 3, -1)
            return self.attn(h, h, h, need_weights=False)[0].sum(1)

    net = Net()
    with torch.no_grad():  # non-trivial running statistics
        net.bn.running_mean.uniform_(-0.5, 0.5)
        net.bn.running_var.uniform_(0.5, 1.5)
    model = {
        "conv": rf.nn.Conv2d(1, 4, 3, padding=1),
        "bn": rf.nn.BatchNorm2d(4),
        "head": rf.nn.Sequential([rf.nn.MaxPool2d(2), rf.nn.Flatten(), rf.nn.Linear(4 * 4 * 4, 4)]),
        "attn": rf.nn.MultiheadAttention(4, 2),
    }

    def rf_forward(params, state, x, training):
        h, new = model["bn"](params["bn"], model["conv"](params["conv"], x), state["bn"], training=training)
        h = model["head"](params["head"], rf.relu(h))
        h = rf.numpy.broadcast_to(rf.reshape(h, (h.shape[0], 1, 4)), (h.shape[0], 3, 4))
        return rf.sum(model["attn"](params["attn"], h), axis=1), new

    x = np.random.default_rng(0).standard_normal((2, 1, 8, 8)).astype(np.float32)
    torch.save(net.state_dict(), tmp_path / "net.pt")
    from safetensors.torch import save_file

    save_file(net.state_dict(), str(tmp_path / "net.safetensors"))
    net.eval()
    want = net(torch.from_numpy(x)).detach().numpy()
    for source in (net, net.state_dict(), tmp_path / "net.pt", tmp_path / "net.safetensors"):
        params, state = rf.nn.load_torch_state_dict(model, source)
        got, _ = rf_forward(params, state, x, training=False)
        np.testing.assert_allclose(np.asarray(got.value), want, rtol=1e-4, atol=1e-5)

    # one training step: loss and every parameter's gradient
    net.train()
    y = torch.tensor([1, 3])
    loss_t = torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), y)
    loss_t.backward()

    def loss_fn(params, state):
        logits, new = rf_forward(params, state, x, training=True)
        return rf.cross_entropy(logits, jnp.asarray(y.numpy()))

    loss, grads = rf.value_and_grad(loss_fn)(params, state)
    np.testing.assert_allclose(float(loss), loss_t.detach().item(), rtol=1e-5)
    torch_grads = {k: v.numpy() for k, v in net.state_dict().items()}  # buffers, for the mapping
    torch_grads |= {k: v.grad.numpy() for k, v in net.named_parameters()}
    rf_grads, _ = rf.nn.load_torch_state_dict(model, torch_grads)  # the same mapping for the gradients
    for (path, g), (_, want_g) in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves_with_path(rf_grads)
    ):
        np.testing.assert_allclose(np.asarray(g), np.asarray(want_g), rtol=1e-4, atol=1e-5, err_msg=str(path))
