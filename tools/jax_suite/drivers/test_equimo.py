"""equimo: vision layers and models in equinox (attention variants, linear and angular
attention, Mamba2's selective scan, wavelet downsampling, RoPE, gated norms, ghost and
partial convolutions, squeeze-excite, patch embedding and merging, a small ViT and
ConvNeXt). Each layer is built with tiny sizes (dim 8, 2 heads, 4x4 images, sequences
of 6 or 9 tokens) and jax.grad differentiates a scalar loss of its output with respect to
its parameters alone, its input alone and both, eagerly and under jax.jit, at a generic
input and (eagerly) at an all-zero input, where norms see zero variance and ReLU-like
activations sit at their kinks. Modules that take a key get a fixed one (dropout rates
are 0; drop-path, where set, draws the same mask for jax and rf)."""

import inspect
import warnings

import equimo.layers.attention as A
import equimo.layers.convolution as C
import equimo.layers.ffn as F
import equimo.layers.mamba as MB
import equimo.layers.norm as N
import equimo.layers.patch as PA
import equimo.layers.posemb as P
import equimo.layers.squeeze_excite as S
import equimo.layers.wavelet as W
import equimo.models as M
import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

jax.config.update("jax_enable_x64", True)
warnings.filterwarnings("ignore", module="equimo")

D_, H, L = 8, 2, 6  # dim, heads, sequence length
SEQ, SQ, IMG = (L, D_), (9, D_), (D_, 4, 4)
CASES = {
    "Attention": (lambda k: A.Attention(D_, H, key=k), SEQ, {}),
    "Attention_qknorm": (lambda k: A.Attention(D_, H, key=k, qk_norm=True), SEQ, {}),
    "AttentionBlock": (lambda k: A.AttentionBlock(D_, H, key=k), SEQ, {}),
    "LinearAttention": (lambda k: A.LinearAttention((3, 3), D_, H, key=k), (9, D_), {}),
    "MllaBlock": (lambda k: A.MllaBlock(D_, key=k, num_heads=H, input_resolution=(3, 3)), (9, D_), {}),
    "MMSA": (lambda k: A.MMSA(D_, H, key=k), SEQ, {}),
    "LinearAngularAttention": (lambda k: A.LinearAngularAttention(D_, H, key=k), SEQ, {}),
    "LinearAngularAttention_sparse": (lambda k: A.LinearAngularAttention(D_, H, True, key=k), SEQ, {}),
    "SHSA": (lambda k: A.SHSA(D_, 4, 4, key=k), IMG, {}),
    "SHMABlock": (lambda k: A.SHMABlock(D_, key=k), IMG, {}),
    "RFAttention": (lambda k: A.RFAttention(D_, D_, key=k, head_dim=4), IMG, {}),
    "RFAttentionBlock": (lambda k: A.RFAttentionBlock(D_, key=k, head_dim=4), IMG, {}),
    "ConvAttentionBlock": (lambda k: A.ConvAttentionBlock(D_, key=k), IMG, {}),
    "ConvAttentionBlock_sigmoid": (lambda k: A.ConvAttentionBlock(D_, key=k, attention_type="sigmoid"), IMG, {}),
    "LowFormerBlock": (lambda k: A.LowFormerBlock(D_, key=k), IMG, {}),
    "Mamba2Mixer": (lambda k: MB.Mamba2Mixer(D_, key=k, head_dim=4, d_state=4), SEQ, {}),
    "HWDConv": (lambda k: W.HWDConv(D_, D_, key=k), IMG, {}),
    "RMSNorm2d": (lambda k: N.RMSNorm2d(D_), IMG, {}),
    "LayerNorm2d": (lambda k: N.LayerNorm2d(D_), IMG, {}),
    "DyT": (lambda k: N.DyT(D_), (D_,), {}),
    "LayerScale": (lambda k: N.LayerScale(D_, init_values=0.5), (D_, 3), {}),
    "RoPE": (lambda k: P.RoPE((L, D_)), SEQ, {}),
    "PosCNN": (lambda k: P.PosCNN(D_, D_, key=k), (9, D_), {}),
    "PosCNN2D": (lambda k: P.PosCNN2D(D_, key=k, norm_layer=None), IMG, {}),
    "WeightNormLinear": (lambda k: F.WeightNormLinear(D_, 5, key=k), SEQ, {}),
    "Mlp": (lambda k: F.Mlp(D_, key=k), SEQ, {}),
    "SwiGlu": (lambda k: F.SwiGlu(D_, key=k), SEQ, {}),
    "SwiGluFused": (lambda k: F.SwiGluFused(D_, key=k), SEQ, {}),
    "DINOHead": (lambda k: F.DINOHead(D_, 5, key=k, hidden_features=8, bottleneck_features=4), SEQ, {}),
    "SingleConvBlock": (lambda k: C.SingleConvBlock(D_, D_, key=k), IMG, {}),
    "ConvNeXtBlock": (lambda k: C.ConvNeXtBlock(D_, key=k), IMG, {}),
    "MBConv": (lambda k: C.MBConv(D_, D_, key=k), IMG, {}),
    "UIB": (lambda k: C.UIB(D_, D_, key=k, start_dw_kernel_size=3, middle_dw_kernel_size=3), IMG, {}),
    "GhostBottleneck": (lambda k: C.GhostBottleneck(D_, 8, D_, key=k), IMG, {}),
    "PartialConv2d": (lambda k: C.PartialConv2d(D_, 2, key=k), IMG, {}),
    "FasterNetBlock": (lambda k: C.FasterNetBlock(D_, key=k), IMG, {}),
    "GLUConv": (lambda k: C.GLUConv(D_, D_, key=k), IMG, {}),
    "ATConvBlock": (lambda k: C.ATConvBlock(D_, key=k), IMG, {}),
    "S2Mixer": (lambda k: C.S2Mixer(D_, key=k), IMG, {}),
    "ShiftFFN": (lambda k: C.ShiftFFN(D_, key=k), IMG, {}),
    "FreeNetBlock": (lambda k: C.FreeNetBlock(D_, key=k), IMG, {}),
    "C2f": (lambda k: C.C2f(D_, D_, key=k), IMG, {}),
    "C3k2": (lambda k: C.C3k2(D_, D_, key=k), IMG, {}),
    "SEModule": (lambda k: S.SEModule(D_, key=k), IMG, {}),
    "EffectiveSEModule": (lambda k: S.EffectiveSEModule(D_, key=k), IMG, {}),
    "PatchEmbedding": (lambda k: PA.PatchEmbedding(3, D_, 2, img_size=4, key=k), (3, 4, 4), {}),
    "PatchMerging": (lambda k: PA.PatchMerging(D_, key=k), (16, D_), {}),
    "SEPatchMerging": (lambda k: PA.SEPatchMerging(D_, D_, key=k), IMG, {}),
    "ViT": (
        lambda k: M.VisionTransformer(
            img_size=8, in_channels=3, dim=D_, patch_size=4, num_heads=H, depths=[1], num_classes=3, key=k
        ),
        (3, 8, 8),
        {},
    ),
    "ViT_regs": (
        lambda k: M.VisionTransformer(
            img_size=8,
            in_channels=3,
            dim=D_,
            patch_size=4,
            num_heads=H,
            depths=[2],
            reg_tokens=2,
            qk_norm=True,
            num_classes=3,
            drop_path_rate=0.1,
            key=k,
        ),
        (3, 8, 8),
        {},
    ),
    "ConvNeXt": (
        lambda k: M.ConvNeXt(
            in_channels=3, depths=[1, 1], dims=[8, 8], num_classes=3, layer_scale_init_value=0.5, key=k
        ),
        (3, 16, 16),
        {},
    ),
}


def _module(name):
    build, shape, kw = CASES[name]
    m = build(jax.random.PRNGKey(0))
    params, static = eqx.partition(m, eqx.is_inexact_array)
    takes_key = "key" in inspect.signature(type(m).__call__).parameters
    return params, static, shape, kw, takes_key


def _loss(static, kw, takes_key):
    def loss(params, x):
        m = eqx.combine(params, static)
        y = m(x, key=jax.random.PRNGKey(2), **kw) if takes_key else m(x, **kw)
        w = jnp.cos(jnp.arange(y.size, dtype=y.dtype)).reshape(y.shape)
        return jnp.sum(jnp.tanh(y) * w) + 0.5 * jnp.sum(y**2)

    return loss


# a generic input eagerly and under jit, the all-zero input eagerly (keeps the run short)
@pytest.mark.parametrize(
    ("jit", "point"), [(False, "generic"), (True, "generic"), (False, "zero")], ids=["eager", "jit", "eager-zero"]
)
@pytest.mark.parametrize("argnums", [(0,), (1,), (0, 1)], ids=["params", "input", "both"])
@pytest.mark.parametrize("name", list(CASES))
def test_layer_gradient(name, jit, point, argnums):
    params, static, shape, kw, takes_key = _module(name)
    x = jax.random.normal(jax.random.PRNGKey(1), shape) if point == "generic" else jnp.zeros(shape)
    g = jax.grad(_loss(static, kw, takes_key), argnums=argnums)
    out = (jax.jit(g) if jit else g)(params, x)
    want = tuple(jax.tree_util.tree_structure((params, x)[i]) for i in argnums)
    assert tuple(jax.tree_util.tree_structure(o) for o in out) == want
