"""Rules for kfac-jax's tag primitives, so a loss written for K-FAC (with
``kfac_jax.register_dense``, ``register_normal_predictive_distribution``, ...)
differentiates on the tape.

Declared with the public ``rf.defrule`` for kfac-jax's own ``Primitive`` objects
and imported the first time a program holds one (``LIBRARY_RULES`` in
``lift/rules.py``), so ``import rumus_fx`` never imports kfac-jax.

kfac-jax marks a model's layers and losses with two identity primitives that its
optimizer finds in the traced program; under ``jax.grad`` they pass the gradient
through unchanged:

* ``layer_tag(*operands, meta)``: returns the operand at ``meta.outputs_index``
  (the layer's output; its inputs and parameters ride along for kfac-jax to
  read). The gradient goes to that operand whole and to no other: the layer's
  inputs and parameters get theirs through the computation that made the output.
  (kfac-jax's own transpose gives it to the first operand, which is where every
  ``register_*`` function puts the output; rf follows ``outputs_index``, the
  operand the forward returns.)
* ``loss_tag(*arguments, meta)``: returns the arguments ``meta.parameter_dependants``
  names (the predictions), by name from ``meta.argument_names``; each output's
  gradient goes to its argument, and the other arguments (targets, weights, the
  variance) get none through the tag, as kfac-jax's JVP gives. The
  ``register_*_loss`` and ``register_*_predictive_distribution`` functions drop
  these outputs, so in a user's loss the tag usually carries no gradient at all.

Neither saves anything.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp

with warnings.catch_warnings():  # kfac-jax 0.0.8's own import reads names jax deprecates (jax.core.Effects)
    warnings.simplefilter("ignore", DeprecationWarning)
    import kfac_jax
    from kfac_jax import layers_and_loss_tags as tags

from ..autograd.registry import Sample, TableEntry
from ..errors import AutogradError
from ..ops._declare import normal
from .library import defrule


def _layer_tag_vjp(r: Any, g: Any) -> tuple:
    out_index = r.params["meta"].outputs_index
    if len(out_index) != 1:
        raise AutogradError(
            f"rf.lift: kfac-jax's layer_tag with {len(out_index)} outputs (outputs_index={out_index}): "
            "kfac-jax's tag has one output; rf's rule is written for that one."
        )
    out: list[Any] = [None] * len(r.needs)
    if r.needs[out_index[0]]:
        out[out_index[0]] = g
    return tuple(out)


def _loss_tag_vjp(r: Any, g: tuple) -> tuple:
    meta = r.params["meta"]
    out: list[Any] = [None] * len(r.needs)
    for name, gi in zip(meta.parameter_dependants, g):
        k = meta.argument_names.index(name)
        if r.needs[k]:
            out[k] = gi if out[k] is None else out[k] + gi
    return tuple(out)


def _dense_program(w: Any, b: Any, x: Any) -> Any:
    """A dense layer and a loss registered for K-FAC, as a user writes them."""
    y = tags.register_dense(x @ w + b[None], x, w, b)
    h = tags.register_dense(jnp.tanh(y) @ w.T, jnp.tanh(y), w.T)  # a second layer, its weight shared
    kfac_jax.register_normal_predictive_distribution(h, jnp.zeros_like(h))
    return jnp.sum(h**2) + jnp.sum(jnp.sin(y))


def _conv_scale_program(x: Any, w: Any, s: Any) -> Any:
    """A conv2d layer and a scale-and-shift layer registered for K-FAC."""
    y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    y = tags.register_conv2d(y, x, w, padding="SAME", window_strides=(1, 1), dimension_numbers=None)
    z = tags.register_scale_and_shift(y * s[None, None, None], y, s)
    return jnp.sum(jnp.cos(z))


def _loss_tag_program(mean: Any, targets: Any, variance: Any) -> Any:
    """The loss tag bound as kfac-jax's ``register_*`` functions bind it, with two
    parameter-dependent arguments whose outputs the program uses."""
    m, v = tags.loss_tag.bind(
        mean,
        targets,
        variance,
        meta=tags.LossMetaData(
            loss_class=kfac_jax.NormalMeanVarianceNegativeLogProbLoss,
            parameter_dependants=("mean", "variance"),
            parameter_independants=("targets",),
            argument_names=("mean", "targets", "variance"),
        ),
    )
    return jnp.sum(jnp.sin(m) * targets + v**2 * mean)


defrule(
    tags.layer_tag,
    _layer_tag_vjp,
    saves=((), ()),
    doc="Backward record of kfac-jax's ``layer_tag`` primitive (the identity on a layer's output).",
    table=(
        TableEntry(
            "kfac_layer_tag_dense",
            _dense_program,
            lambda rng: [Sample((normal(rng, 3, 4), normal(rng, 4), normal(rng, 5, 3)), diff=(0, 1, 2))],
            prims=("layer_tag", "loss_tag"),
            vmap=True,
        ),
        TableEntry(
            "kfac_layer_tag_conv_scale",
            _conv_scale_program,
            lambda rng: [Sample((normal(rng, 2, 5, 5, 3), normal(rng, 3, 3, 3, 4), normal(rng, 4)), diff=(0, 1, 2))],
            prims=("layer_tag",),
        ),
    ),
)

defrule(
    tags.loss_tag,
    _loss_tag_vjp,
    saves=((), ()),
    doc="Backward record of kfac-jax's ``loss_tag`` primitive (the identity on a loss's predictions).",
    table=(
        TableEntry(
            "kfac_loss_tag",
            _loss_tag_program,
            lambda rng: [Sample((normal(rng, 4, 3), normal(rng, 4, 3), normal(rng, 4, 3) ** 2 + 0.5), diff=(0, 1, 2))],
            # not under vmap: kfac-jax's batching rule for the tag gives one batch axis for
            # any number of outputs, so jax.vmap fails on a tag with two (the dense entry
            # checks the one-output tag under vmap)
        ),
    ),
)
