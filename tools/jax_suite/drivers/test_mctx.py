"""mctx: Monte-Carlo tree search. jax.grad goes through the search only with respect
to the root's prior logits (``search.backward`` updates the tree's values in a
``lax.while_loop`` with a dynamic trip count, which jax does not reverse-differentiate;
the root value, the embedding and the recurrent network's parameters all reach those
values). So the driver differentiates the policies' outputs (``action_weights``, the
tree's prior logits, node values and root Q-values) with respect to the root logits
(nine variants of ``muzero_policy``, ``gumbel_muzero_policy`` and
``stochastic_muzero_policy``: Q-transforms, depth limits, invalid actions, temperature,
considered actions, no Gumbel noise, no Dirichlet noise), and runs ``muzero_policy``
(also with a depth limit and invalid actions), ``gumbel_muzero_policy`` (2 and 4
considered actions, invalid actions) and ``stochastic_muzero_policy`` with a tiny
recurrent network (seeded keys, batch 2, 6 simulations, 4 actions, 2 chance outcomes),
at generic roots and where everything ties (equal logits, zero value and embedding), and
differentiates by jax.grad, eagerly and under jit, what mctx computes from a searched
tree, with respect to each of the tree's value arrays alone and all (node, raw and
children values, rewards, discounts, prior logits): ``qtransform_by_parent_and_siblings``
(also a large epsilon), ``qtransform_by_min_max`` and ``qtransform_completed_by_mix_value``
(mixed or raw value, rescaled or not) at the root and at a child, ``Tree.summary``'s
Q-values and value; the Gumbel policy's ``action_weights``
(softmax(mask(prior logits + completed Q))) and its root score
(``seq_halving.score_considered``: a max with -1e9 and a -inf penalty) with respect to the
root logits, the Gumbel noise and the values; and the policies' helpers: visit
probabilities to logits (a max with ``tiny`` where actions are unvisited), the
temperature (0 included), Dirichlet noise (with respect to alpha and the fraction) and
the Gumbel interior selection's argmax input. muzero's ``action_weights`` are visit
frequencies (piecewise constant): their gradients, like those of the tree's values with
respect to the logits, are expected to be zero."""

import functools

import jax
import jax.numpy as jnp
import mctx
import pytest
from mctx._src import action_selection as mctx_action_selection
from mctx._src import policies as mctx_policies
from mctx._src import seq_halving

jax.config.update("jax_enable_x64", True)
B, E = 2, 3
KEY = jax.random.PRNGKey(42)


def _params(num_actions, num_chance=2):
    k = jax.random.split(jax.random.PRNGKey(0), 6)
    return {
        "W": 0.8 * jax.random.normal(k[0], (num_actions, E, E)),
        "r": jax.random.normal(k[1], (E,)),
        "v": jax.random.normal(k[2], (E,)),
        "P": jax.random.normal(k[3], (E, num_actions)),
        "C": jax.random.normal(k[4], (E, num_chance)),
        "U": 0.8 * jax.random.normal(k[5], (num_chance, E, E)),
    }


def _step(params, action, embedding):
    w = params["W"][action]  # [B, E, E]
    return jnp.tanh(jnp.einsum("be,bef->bf", embedding, w) + 0.1)


def recurrent_fn(params, rng_key, action, embedding):
    del rng_key
    new = _step(params, action, embedding)
    out = mctx.RecurrentFnOutput(
        reward=new @ params["r"] + 0.05 * action,
        discount=jnp.full(action.shape, 0.95),
        prior_logits=new @ params["P"],
        value=jnp.tanh(new @ params["v"]),
    )
    return out, new


def decision_recurrent_fn(params, rng_key, action, embedding):
    del rng_key
    after = _step(params, action, embedding)
    out = mctx.DecisionRecurrentFnOutput(
        chance_logits=after @ params["C"], afterstate_value=jnp.tanh(after @ params["v"])
    )
    return out, after


def chance_recurrent_fn(params, rng_key, outcome, afterstate):
    del rng_key
    new = jnp.tanh(jnp.einsum("be,bef->bf", afterstate, params["U"][outcome]) - 0.2)
    out = mctx.ChanceRecurrentFnOutput(
        action_logits=new @ params["P"],
        value=jnp.tanh(new @ params["v"]),
        reward=new @ params["r"],
        discount=jnp.full(outcome.shape, 0.9),
    )
    return out, new


def _root(num_actions, point):
    if point == "ties":  # equal logits, zero values and embedding: ties everywhere
        return jnp.zeros((B, num_actions)), jnp.zeros(B), jnp.zeros((B, E))
    k = jax.random.split(jax.random.PRNGKey(7), 3)
    return jax.random.normal(k[0], (B, num_actions)), jnp.array([0.3, -0.6]), jax.random.normal(k[2], (B, E))


INVALID = jnp.array([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 1.0]])
POLICIES = {
    "muzero": lambda r, n: mctx.muzero_policy(_params(n), KEY, r, recurrent_fn, num_simulations=6),
    "muzero_depth2_invalid": lambda r, n: mctx.muzero_policy(
        _params(n), KEY, r, recurrent_fn, num_simulations=6, max_depth=2, invalid_actions=INVALID
    ),
    "gumbel": lambda r, n: mctx.gumbel_muzero_policy(_params(n), KEY, r, recurrent_fn, num_simulations=6),
    "gumbel_considered2_invalid": lambda r, n: mctx.gumbel_muzero_policy(
        _params(n), KEY, r, recurrent_fn, num_simulations=6, max_num_considered_actions=2, invalid_actions=INVALID
    ),
    "stochastic": lambda r, n: mctx.stochastic_muzero_policy(
        _params(n), KEY, r, decision_recurrent_fn, chance_recurrent_fn, num_simulations=6
    ),
}


@functools.cache
def _search(policy, point, num_actions=4):
    """A searched tree (outside any gradient: jax.grad cannot go through the search)."""
    logits, value, embedding = _root(num_actions, point)
    root = mctx.RootFnOutput(prior_logits=logits, value=value, embedding=embedding)
    return jax.jit(lambda root: POLICIES[policy](root, num_actions).search_tree)(root)


POLICY_VARIANTS = {
    "muzero": (mctx.muzero_policy, {}),
    "muzero_min_max": (
        mctx.muzero_policy,
        {"qtransform": functools.partial(mctx.qtransform_by_min_max, min_value=-2.0, max_value=2.0)},
    ),
    "muzero_depth2_invalid_temp": (
        mctx.muzero_policy,
        {"max_depth": 2, "invalid_actions": INVALID, "temperature": 0.5},
    ),
    "gumbel": (mctx.gumbel_muzero_policy, {}),
    "gumbel_considered2": (mctx.gumbel_muzero_policy, {"max_num_considered_actions": 2}),
    "gumbel_invalid_depth2": (mctx.gumbel_muzero_policy, {"invalid_actions": INVALID, "max_depth": 2}),
    "gumbel_no_noise_raw_value": (
        mctx.gumbel_muzero_policy,
        {
            "gumbel_scale": 0.0,
            "qtransform": functools.partial(mctx.qtransform_completed_by_mix_value, use_mixed_value=False),
        },
    ),
    "stochastic": (mctx.stochastic_muzero_policy, {}),
    "stochastic_no_noise_depth3": (mctx.stochastic_muzero_policy, {"dirichlet_fraction": 0.0, "max_depth": 3}),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", ["generic", "ties"])
@pytest.mark.parametrize("variant", list(POLICY_VARIANTS))
def test_policy_wrt_root_logits(variant, point, jit):
    """The whole search differentiated with respect to the root's prior logits: they are
    written into the tree once and carried unchanged through the backward pass's
    while_loop, so jax can reverse-differentiate them (the root value, the embedding
    and the network's parameters reach the values that loop updates: jax.grad refuses
    them). Gumbel's action_weights (softmax of logits + completed Q, whose mixed value
    weighs Q by the prior) and the tree's prior logits have gradients; muzero's and
    stochastic muzero's action_weights (visit frequencies) and the tree's values have
    zero gradients."""
    num_actions = 4
    policy, kwargs = POLICY_VARIANTS[variant]
    logits, value, embedding = _root(num_actions, point)
    params = _params(num_actions)
    if policy is mctx.stochastic_muzero_policy:
        kwargs = dict(kwargs, decision_recurrent_fn=decision_recurrent_fn, chance_recurrent_fn=chance_recurrent_fn)
    else:
        kwargs = dict(kwargs, recurrent_fn=recurrent_fn)
    c = jnp.linspace(-1.0, 1.0, B * num_actions).reshape(B, num_actions)

    def loss(logits):
        root = mctx.RootFnOutput(prior_logits=logits, value=value, embedding=embedding)
        out = policy(params, KEY, root, num_simulations=6, **kwargs)
        tree = out.search_tree
        d = jnp.linspace(0.5, 1.5, tree.children_prior_logits[:, :, 0].size).reshape(
            tree.children_prior_logits.shape[:2]
        )
        prior = jnp.where(tree.children_prior_logits > -1e30, tree.children_prior_logits, 0.0)
        return (
            jnp.sum(out.action_weights * c)
            + jnp.sum(jnp.tanh(prior) * d[..., None])
            + jnp.sum(tree.node_values)
            + jnp.sum(tree.summary().qvalues * c)
        )

    g = jax.grad(loss)
    (jax.jit(g) if jit else g)(logits)


QTRANSFORMS = {
    "parent_and_siblings": mctx.qtransform_by_parent_and_siblings,
    "parent_and_siblings_big_eps": functools.partial(mctx.qtransform_by_parent_and_siblings, epsilon=0.5),
    "min_max": functools.partial(mctx.qtransform_by_min_max, min_value=-1.0, max_value=1.5),
    "mix_value": mctx.qtransform_completed_by_mix_value,
    "mix_no_rescale": functools.partial(mctx.qtransform_completed_by_mix_value, rescale_values=False),
    "raw_value": functools.partial(mctx.qtransform_completed_by_mix_value, use_mixed_value=False, maxvisit_init=5.0),
}


FIELDS = (
    "node_values",
    "children_values",
    "children_rewards",
    "children_discounts",
    "raw_values",
    "children_prior_logits",
)
FIELD_ARGNUMS = [(i,) for i in range(len(FIELDS))] + [tuple(range(len(FIELDS)))]


def _grads(loss, argnums_list, jit, *args):
    for argnums in argnums_list:
        g = jax.grad(loss, argnums)
        (jax.jit(g) if jit else g)(*args)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", ["generic", "ties"])
@pytest.mark.parametrize("policy", ["muzero_depth2_invalid", "gumbel", "stochastic"])
@pytest.mark.parametrize("qtransform", list(QTRANSFORMS))
def test_qtransform(qtransform, policy, point, jit):
    tree = _search(policy, point)
    q = QTRANSFORMS[qtransform]
    c = jnp.linspace(-1.0, 2.0, tree.num_actions)

    def loss(*arrays):
        t = tree.replace(**dict(zip(FIELDS, arrays)))
        # the root and its first child (unvisited actions there); the summary's Q-values
        at_root = jax.vmap(q, in_axes=(0, None))(t, t.ROOT_INDEX)
        at_child = jax.vmap(q, in_axes=(0, None))(t, jnp.asarray(1, jnp.int32))
        summary = t.summary()
        return (
            jnp.sum(at_root * c)
            + jnp.sum(jnp.tanh(at_child) * c[::-1])
            + jnp.sum(summary.qvalues * c)
            + jnp.sum(summary.value)
        )

    _grads(loss, FIELD_ARGNUMS, jit, *(getattr(tree, f) for f in FIELDS))


GUMBEL_QTRANSFORMS = ["mix_value", "mix_no_rescale", "raw_value", "parent_and_siblings"]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", ["generic", "ties"])
@pytest.mark.parametrize("policy", ["gumbel", "gumbel_considered2_invalid"])
@pytest.mark.parametrize("qtransform", GUMBEL_QTRANSFORMS)
def test_gumbel_action_weights(qtransform, policy, point, jit):
    """gumbel_muzero_policy's action_weights, softmax(mask(prior_logits + completed Q)), and
    its root score (seq_halving.score_considered: a max with -1e9, a -inf penalty for
    actions not considered), with respect to the root logits, the Gumbel noise and the
    tree's values."""
    tree = _search(policy, point)
    q = QTRANSFORMS[qtransform]
    invalid = INVALID if policy.endswith("invalid") else None
    logits = tree.children_prior_logits[:, 0]
    gumbel = tree.extra_data.root_gumbel
    c = jnp.linspace(-1.0, 2.0, tree.num_actions)

    def loss(logits, gumbel, node_values, children_values, raw_values):
        t = tree.replace(node_values=node_values, children_values=children_values, raw_values=raw_values)
        completed = jax.vmap(q, in_axes=(0, None))(t, t.ROOT_INDEX)
        weights = jax.nn.softmax(mctx_policies._mask_invalid_actions(logits + completed, invalid))
        visits = t.summary().visit_counts
        considered = jnp.max(visits, axis=-1, keepdims=True)
        score = seq_halving.score_considered(considered, gumbel, logits, completed, visits)
        return jnp.sum(weights * c) + jnp.sum(jax.nn.softmax(score) * c[::-1])

    args = (logits, gumbel, tree.node_values, tree.children_values, tree.raw_values)
    _grads(loss, [(0,), (1,), (2,), (3,), (4,), (0, 1, 2, 3, 4)], jit, *args)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("point", ["generic", "ties"])
@pytest.mark.parametrize("policy", ["muzero", "muzero_depth2_invalid", "stochastic"])
def test_policy_helpers(policy, point, jit):
    """The pieces around the search: visit probabilities to logits (log of max(p, tiny):
    unvisited actions sit at the max), the temperature (0 included), Dirichlet noise
    (differentiated with respect to alpha: jax.random.dirichlet's implicit gamma
    gradient) and the Gumbel interior selection's argmax input."""
    tree = _search(policy, point)
    probs = tree.summary().visit_probs
    c = jnp.linspace(-1.0, 2.0, tree.num_actions)

    def loss(probs, temperature, alpha, fraction, prior_logits):
        logits = mctx_policies._get_logits_from_probs(probs)
        out = jnp.sum(jnp.tanh(mctx_policies._apply_temperature(logits, temperature)) * c)
        out += jnp.sum(jnp.maximum(logits, -5.0))
        noisy = mctx_policies._add_dirichlet_noise(KEY, probs, dirichlet_alpha=alpha, dirichlet_fraction=fraction)
        out += jnp.sum(noisy * c)
        p = jax.nn.softmax(prior_logits)
        out += jnp.sum(mctx_action_selection._prepare_argmax_input(p, tree.children_visits[:, 0]) * c)
        return out

    for temperature in [1.0, 0.25, 0.0]:
        args = (probs, jnp.asarray(temperature), jnp.asarray(0.3), jnp.asarray(0.25), tree.children_prior_logits[:, 0])
        argnums = [(0,), (1,), (2,), (3,), (4,)] if temperature == 1.0 else []
        _grads(loss, argnums + [(0, 1, 2, 3, 4)], jit, *args)
