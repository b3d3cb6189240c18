"""jraph: segment reductions and the model zoo differentiated by jax.grad, each
argument alone and all, eagerly and under jit, on padded graphs."""

import jax
import jax.numpy as jnp
import jraph
import pytest

jax.config.update("jax_enable_x64", True)
K = jax.random.PRNGKey
SEG = jnp.array([0, 0, 1, 3, 3, 3, 1, 0])  # segment 2 empty
X = jax.random.normal(K(0), (8, 3))
XT = jnp.round(jax.random.normal(K(1), (8, 3)) * 2) / 2  # ties


def _w(out):
    out = jnp.where(jnp.isfinite(out), out, 0.0)
    return jnp.sum(jnp.sin(out) * jnp.arange(1.0, 1.0 + out.size).reshape(out.shape))


SEGS = {
    "segment_sum": lambda x: jraph.segment_sum(x, SEG, 4),
    "segment_mean": lambda x: jraph.segment_mean(x, SEG, 4),
    "segment_max": lambda x: jraph.segment_max(x, SEG, 4),
    "segment_min": lambda x: jraph.segment_min(x, SEG, 4),
    "segment_max_sorted": lambda x: jraph.segment_max(x, jnp.sort(SEG), 4, indices_are_sorted=True),
    "segment_variance": lambda x: jraph.segment_variance(x, SEG, 4),
    "segment_normalize": lambda x: jraph.segment_normalize(x, SEG, 4),
    "segment_softmax": lambda x: jraph.segment_softmax(x, SEG, 4),
    "segment_max_or_zero": lambda x: (
        jraph.segment_max(x, SEG, 4) * 0 + jnp.nan_to_num(jraph.segment_max(x, SEG, 4), neginf=0.0)
    ),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("name", list(SEGS))
def test_segment(name, ties, jit):
    g = jax.grad(lambda x: _w(SEGS[name](x)))
    (jax.jit(g) if jit else g)(XT if ties else X)


def _graph():
    g = jraph.GraphsTuple(
        nodes=jax.random.normal(K(2), (5, 4)),
        edges=jax.random.normal(K(3), (6, 2)),
        senders=jnp.array([0, 1, 2, 3, 4, 0]),
        receivers=jnp.array([1, 2, 3, 4, 0, 2]),
        n_node=jnp.array([3, 2]),
        n_edge=jnp.array([4, 2]),
        globals=jax.random.normal(K(4), (2, 3)),
    )
    return jraph.pad_with_graphs(g, n_node=8, n_edge=10, n_graph=3)


def _lin(w, x):
    return jnp.tanh(x @ w[: x.shape[-1]])


def _nets():
    W = {k: jax.random.normal(K(10 + i), (16, 4)) * 0.5 for i, k in enumerate("abcdef")}

    def gn(w, nodes, edges, glob):
        net = jraph.GraphNetwork(
            update_edge_fn=lambda e, s, r, g: _lin(w["a"], jnp.concatenate([e, s, r, g], -1)),
            update_node_fn=lambda n, s, r, g: _lin(w["b"], jnp.concatenate([n, s, r, g], -1)),
            update_global_fn=lambda n, e, g: _lin(w["c"], jnp.concatenate([n, e, g], -1)),
            aggregate_edges_for_nodes_fn=jraph.segment_max,
            aggregate_nodes_for_globals_fn=jraph.segment_mean,
            attention_logit_fn=lambda e, s, r, g: jnp.sum(e, -1),
            attention_reduce_fn=lambda e, a: e * a[:, None],
        )
        return net

    def gat(w):
        return jraph.GAT(
            attention_query_fn=lambda n: _lin(w["d"], n),
            attention_logit_fn=lambda s, r, e: jnp.sum(s * r, -1, keepdims=True),
            node_update_fn=lambda n: jax.nn.relu(n),
        )

    def gcn(w):
        return jraph.GraphConvolution(
            update_node_fn=lambda n: _lin(w["e"], n), add_self_edges=True, symmetric_normalization=True
        )

    def inter(w):
        return jraph.InteractionNetwork(
            update_edge_fn=lambda e, s, r: _lin(w["a"], jnp.concatenate([e, s, r], -1)),
            update_node_fn=lambda n, e: _lin(w["b"], jnp.concatenate([n, e], -1)),
            aggregate_edges_for_nodes_fn=jraph.segment_min,
        )

    def deepsets(w):
        return jraph.DeepSets(
            update_node_fn=lambda n, g: _lin(w["b"], jnp.concatenate([n, g], -1)),
            update_global_fn=lambda n: _lin(w["c"], n),
            aggregate_nodes_for_globals_fn=jraph.segment_max,
        )

    def relation(w):
        return jraph.RelationNetwork(
            update_edge_fn=lambda s, r: _lin(w["a"], jnp.concatenate([s, r], -1)),
            update_global_fn=lambda e: _lin(w["c"], e),
        )

    def gnn_attn(w):
        return jraph.GraphNetGAT(
            update_edge_fn=lambda e, s, r, g: _lin(w["a"], jnp.concatenate([e, s, r, g], -1)),
            update_node_fn=lambda n, s, r, g: _lin(w["b"], jnp.concatenate([n, s, r, g], -1)),
            attention_logit_fn=lambda e, s, r, g: jnp.sum(e, -1),
            attention_reduce_fn=lambda e, a: e * a[:, None],
            update_global_fn=lambda n, e, g: _lin(w["c"], jnp.concatenate([n, e, g], -1)),
        )

    return W, {
        "graph_network": lambda w: gn(w, None, None, None),
        "gat": gat,
        "gcn": gcn,
        "interaction": inter,
        "deepsets": deepsets,
        "relation": relation,
        "graph_net_gat": gnn_attn,
    }


W, NETS = _nets()


@pytest.mark.parametrize("name", list(NETS))
def test_net(name):
    """Eager only: jraph's models repeat by n_node, which needs its values (under
    jax.jit they fail with jax.grad too)."""
    g0 = _graph()

    def loss(w, nodes, edges, glob):
        g = NETS[name](w)(g0._replace(nodes=nodes, edges=edges, globals=glob))
        outs = [x for x in (g.nodes, g.edges, g.globals) if x is not None]
        mask = jraph.get_node_padding_mask(g)
        return sum(_w(o) for o in outs) + _w(jnp.where(mask[:, None], g.nodes, 0.0))

    args = (W, g0.nodes, g0.edges, g0.globals)
    for argnums in [(0,), (1,), (2,), (3,), (0, 1, 2, 3)]:
        jax.grad(loss, argnums)(*args)
