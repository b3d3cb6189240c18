"""penzai: its transformer variants and layers differentiated by jax.grad, eagerly
and under jit, in float64: llamalike (GeGLU and SwiGLU feed-forwards, global and
sliding-window causal attention, soft caps, post-norms, grouped queries, a layer
stack) and GPT-NeoX models with respect to their parameters; penzai's layers on
named arrays with respect to their parameters, their input and both."""

import jax
import jax.numpy as jnp
import pytest
from penzai import pz
from penzai.models.transformer.variants import gpt_neox
from penzai.models.transformer.variants import llamalike_common as L

jax.config.update("jax_enable_x64", True)
F64 = jnp.float64
TOKENS = pz.nx.wrap(jnp.array([[1, 4, 2, 7, 3, 9], [0, 0, 5, 5, 10, 2]]), "batch", "seq")
# what both families' configs share: sizes and float64 throughout
COMMON = dict(
    embedding_dim=16,
    projection_dim=8,
    mlp_hidden_dim=24,
    num_decoder_blocks=2,
    vocab_size=11,
    parameter_dtype=F64,
    activation_dtype=F64,
)


def _llamalike(mlp, stack, caps):
    return L.LlamalikeTransformerConfig(
        num_kv_heads=2,
        query_head_multiplier=2,
        mlp_variant=mlp,
        tie_embedder_and_logits=not stack,
        attention_type=L.AttentionTypeGlobalCausal()
        if stack
        else (
            L.AttentionTypeGlobalCausal(),
            L.AttentionTypeSlidingWindowCausal(3),
        ),
        use_post_attn_norm=caps,
        use_post_ffw_norm=caps,
        final_logit_softcap=5.0 if caps else None,
        attn_logits_soft_cap=8.0 if caps else None,
        use_layer_stack=stack,
        **COMMON,
    )


MODELS = {
    "llamalike_geglu_caps": lambda: L.build_llamalike_transformer(
        _llamalike("geglu_approx", False, True), jax.random.key(0)
    ),
    "llamalike_swiglu": lambda: L.build_llamalike_transformer(_llamalike("swiglu", False, False), jax.random.key(1)),
    "llamalike_layer_stack": lambda: L.build_llamalike_transformer(_llamalike("swiglu", True, True), jax.random.key(2)),
    **{
        f"gpt_neox_{act}_{stack}": (
            lambda act=act, stack=stack: gpt_neox.build_gpt_neox_transformer(
                gpt_neox.GPTNeoXTransformerConfig(
                    num_attention_heads=2,
                    activation_fn=act,
                    rope_subset_size=4,
                    rope_wavelength=10000.0,
                    layernorm_epsilon=1e-5,
                    use_layer_stack=stack,
                    **COMMON,
                ),
                jax.random.key(3),
            )
        )
        for act, stack in [("gelu_exact", False), ("relu", False), ("gelu_approx", True)]
    },
}


def _nll(logits):
    lp = pz.nx.nmap(jax.nn.log_softmax)(logits.untag("vocabulary")).tag("vocabulary")
    return -jnp.mean(lp.untag("vocabulary")[..., 3].unwrap("batch", "seq"))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", list(MODELS))
def test_transformer(name, jit):
    unbound, params = pz.unbind_params(MODELS[name]())
    frozen = [p.freeze() for p in params]

    def loss(values):
        return _nll(pz.bind_variables(unbound, values)(TOKENS))

    g = jax.grad(loss)
    (jax.jit(g) if jit else g)(frozen)


X = pz.nx.wrap(jax.random.normal(jax.random.key(4), (2, 5, 6), F64), "batch", "seq", "embedding")


def _linear(name, out):
    return pz.nn.Linear.from_config(
        name=name, init_base_rng=jax.random.key(5), input_axes={"embedding": 6}, output_axes={out: 4}, dtype=F64
    )


LAYERS = {
    "linear_bias_tanhcap": lambda: pz.nn.Sequential(
        [
            pz.nn.Affine.from_config(
                name="a",
                init_base_rng=jax.random.key(6),
                input_axes={"embedding": 6},
                output_axes={"hidden": 4},
                dtype=F64,
            ),
            pz.nn.TanhSoftCap(soft_cap=0.7),
        ]
    ),
    "layernorm_rms": lambda: pz.nn.Sequential(
        [
            pz.nn.LayerNorm.from_config(
                name="ln", init_base_rng=jax.random.key(8), across_axes={"embedding": 6}, dtype=F64
            ),
            pz.nn.RMSLayerNorm.from_config(
                name="rms", init_base_rng=jax.random.key(9), across_axes={"embedding": 6}, dtype=F64
            ),
            pz.nn.Standardize(across="embedding"),
        ]
    ),
    "residual_branch_multiply": lambda: pz.nn.Residual(
        pz.nn.Sequential(
            [
                pz.nn.BranchAndMultiplyTogether(
                    [
                        pz.nn.Sequential([_linear("l1", "hidden"), pz.nn.Elementwise(jax.nn.gelu)]),
                        _linear("l2", "hidden"),
                    ]
                ),
                pz.nn.Linear.from_config(
                    name="l3",
                    init_base_rng=jax.random.key(7),
                    input_axes={"hidden": 4},
                    output_axes={"embedding": 6},
                    dtype=F64,
                ),
            ]
        )
    ),
    "softmax_einsum": lambda: pz.nn.Sequential(
        [
            _linear("q", "kv"),
            pz.nn.Elementwise(lambda x: x * 3.0),
            pz.nn.Softmax(axes="kv"),
        ]
    ),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", list(LAYERS))
def test_layer(name, jit):
    unbound, params = pz.unbind_params(LAYERS[name]())
    frozen = [p.freeze() for p in params]

    def loss(values, x):
        y = pz.bind_variables(unbound, values)(x)
        return jnp.sum(jnp.sin(y.unwrap(*sorted(y.named_shape))) * 1.3)

    for argnums in [(0,), (1,), (0, 1)] if frozen else [(1,)]:
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(frozen, X)


@pytest.mark.parametrize("jit", [False, True])
def test_named_ops(jit):
    """nmap'd jnp functions over named axes: the batching rules rf's lift sees."""

    def loss(x):
        s = pz.nx.nmap(jnp.linalg.norm)(x.untag("embedding"))
        m = pz.nx.nmap(jnp.max)(x.untag("seq"))
        c = pz.nx.nmap(jnp.cumsum)(x.untag("seq")).tag("seq")
        srt = pz.nx.nmap(jnp.sort)(x.untag("embedding")).tag("embedding")
        o = pz.nx.nmap(jnp.outer)(x.untag("seq"), x.untag("seq")).tag("a", "b")
        total = s.unwrap("batch", "seq").sum() + m.unwrap("batch", "embedding").sum()
        total += (c * srt).unwrap("batch", "seq", "embedding").sum() + jnp.tanh(
            o.unwrap("batch", "embedding", "a", "b")
        ).sum()
        return total

    g = jax.grad(loss)
    (jax.jit(g) if jit else g)(X)
