"""Primitive rules for ``jax.shard_map`` and the collectives inside it
(``psum``, ``pvary``, ``all_gather``, ``psum_scatter``, ``ppermute``,
``all_to_all``).

Note [shard_map on the tape]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A ``shard_map`` equation's body becomes a nested ``Program`` (as a scan's does,
Note [Control flow on the tape] in ``rules_control.py``). The forward runs that
program under ``jax.shard_map`` with the user's mesh, specs, manual axes and
``check_vma``, and returns the body's residuals as extra outputs; the backward
is a second ``jax.shard_map`` that runs the body program's backward walk on each
device and returns the inputs' gradients with the inputs' specs.

The residuals leave the forward ``shard_map`` each with one new leading axis of
size 1, stacked over the manual axes along which it varies: its spec is
``P((axes it varies over, in mesh order))`` (``P()`` for a value equal on every
device), so that the backward ``shard_map`` takes each device's own residual
back with the same type it had. With ``check_vma=True`` that type is read from
the residual itself (``aval.mat.varying``): a first, abstract run of the
forward (``jax.eval_shape``, once per equation) records it, because the specs
must be known before the real run traces the body. With ``check_vma=False``
every residual is stacked over every manual axis.

Gradients follow jax's typing of values that vary across devices:

- ``check_vma=True``: the body's jaxpr says where an invariant value meets a
  varying one (``pvary``) and where a varying one is summed into an invariant
  one (``psum_invariant``); their rules are each other's transpose, so the
  cotangent of an input with spec ``P()`` comes out summed over the devices.
- ``check_vma=False``: no such types; as jax's transpose does, the cotangent of
  an output is divided by the size of the manual axes its spec does not mention
  (each device holds a copy of it) and the gradient of an input is summed
  (``psum``) over the manual axes its spec does not mention, and ``psum``'s own
  rule is a ``psum`` of the cotangent.

Collectives whose gradient jax does not define (``pmax``, ``pmin``) have no
rule and are refused; so are ``pbroadcast`` (it has no CPU lowering, so no
gradient of it could be checked here), ``psend``/``precv``,
``ragged_all_to_all`` and specs with ``unreduced``/``reduced`` axes.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from ..autograd.registry import BadProgram, Sample, TableEntry
from ..errors import AutogradError
from ..ops._declare import normal
from .jax_versions import closed, vary_over, varying_axes
from .program import ENCLOSING, Program, ReachedInputs
from .rules import COMPLEX_OK, defrule, is_float

# -- what the equation says ---------------------------------------------------------


def _manual_axes(params: Any) -> tuple[str, ...]:
    """The axes the ``shard_map`` makes manual, in mesh order."""
    mesh = params["mesh"]
    named = params.get("newly_manual_axes", params.get("manual_axes"))
    names = tuple(mesh.axis_names)
    return names if named is None else tuple(n for n in names if n in named)


def _axis_sizes(mesh: Any) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.axis_sizes))


def _mentioned(spec: Any) -> set[str]:
    """The mesh axes a ``PartitionSpec`` shards over."""
    if getattr(spec, "unreduced", None) or getattr(spec, "reduced", None):
        raise AutogradError(f"rf.lift: shard_map specs with unreduced or reduced axes ({spec}) have no rule in rf.lift")
    names: set[str] = set()
    for entry in spec:
        if entry is None:
            continue
        names.update(entry if isinstance(entry, tuple) else (entry,))
    return names


def _unmentioned(spec: Any, manual: tuple[str, ...]) -> tuple[str, ...]:
    named = _mentioned(spec)
    return tuple(a for a in manual if a not in named)


def _varying(x: Any) -> frozenset:
    """The manual axes along which ``x`` (inside a ``shard_map`` body) varies."""
    mat = jax.typeof(x).mat
    if getattr(mat, "unreduced", None) or getattr(mat, "reduced", None):
        raise AutogradError("rf.lift: a shard_map residual with unreduced or reduced axes has no rule in rf.lift")
    return varying_axes(x)


# -- shard_map ------------------------------------------------------------------


class _Body:
    """The body program of a ``shard_map`` step and its residuals' layout (their
    pytree and one spec per leaf), recorded by the first forward.

    The program is built on first use, inside the forward's ``shard_map`` trace:
    some rules trace code of their own when their program is built (a
    ``custom_jvp`` rule traces the user's JVP rule, e.g. ``jax.nn.relu``'s), and
    inside a body that code needs the manual mesh and its axis names."""

    def __init__(self, step: Any):
        self.jaxpr = closed(step.params["jaxpr"])
        self.needs = list(step.needs)
        self.enclosing = (step.program, step)
        self._prog: Program | None = None
        self.layout: tuple[Any, tuple[Any, ...]] | None = None

    @property
    def prog(self) -> Program:
        if self._prog is None:
            token = ENCLOSING.set(self.enclosing)
            try:
                self._prog = Program(self.jaxpr, self.needs, "shard_map body")
            finally:
                ENCLOSING.reset(token)
        return self._prog


def _shard_map_prepare(step: Any) -> _Body:
    p = step.params
    for spec in (*p["in_specs"], *p["out_specs"]):
        _mentioned(spec)
    return _Body(step)


def _smap(fun: Any, params: Any, in_specs: Any, out_specs: Any) -> Any:
    return jax.shard_map(
        fun,
        mesh=params["mesh"],
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=set(_manual_axes(params)),
        check_vma=params["check_vma"],
    )


def _residual_spec(x: Any, params: Any) -> Any:
    manual = _manual_axes(params)
    if params["check_vma"]:
        varying = _varying(x)
        manual = tuple(a for a in manual if a in varying)
    return P(manual) if manual else P()


def _shard_map_forward(step: Any, vals: list) -> tuple[list, Any]:
    p = step.params
    body: _Body = step.sub
    in_specs, out_specs = tuple(p["in_specs"]), tuple(p["out_specs"])

    def run(*xs: Any) -> tuple[tuple, list, Any]:
        outs, res = body.prog.run(list(xs))
        leaves, tree = jax.tree.flatten(res)
        return tuple(outs), [jnp.asarray(x) for x in leaves], tree

    if body.layout is None:
        seen: dict[str, Any] = {}

        def probe(*xs: Any) -> tuple:
            outs, leaves, tree = run(*xs)
            seen["layout"] = (tree, tuple(_residual_spec(x, p) for x in leaves))
            return outs

        jax.eval_shape(_smap(probe, p, in_specs, out_specs), *vals)
        body.layout = seen["layout"]
    _, res_specs = body.layout

    def forward(*xs: Any) -> tuple[tuple, list]:
        outs, leaves, _ = run(*xs)
        return outs, [x[None] for x in leaves]

    outs, res = _smap(forward, p, in_specs, (out_specs, list(res_specs)))(*vals)
    return list(outs), res


def _shard_map_vjp(r: Any, g: tuple) -> tuple:
    p = r.params
    body: _Body = r._step.sub
    prog = body.prog
    tree, res_specs = body.layout
    in_specs, out_specs = tuple(p["in_specs"]), tuple(p["out_specs"])
    manual, check = _manual_axes(p), p["check_vma"]
    sizes = _axis_sizes(p["mesh"])
    want = [k for k, n in enumerate(r.needs) if n and is_float(r.in_avals[k])]
    if not want:
        return (None,) * len(r.in_avals)
    g = list(g)
    if not check:  # each device holds a copy of an output along the axes its spec omits
        for k, (spec, ct) in enumerate(zip(out_specs, g)):
            n = math.prod(sizes[a] for a in _unmentioned(spec, manual))
            if n != 1 and ct is not None and is_float(r.out_avals[k]):
                g[k] = ct / n
    # an output without a cotangent stays missing in the body (Note [An unused output
    # adds nothing] in program.py): only the others enter the body's shard_map
    present = [k for k, ct in enumerate(g) if ct is not None]

    reached = ReachedInputs(len(r.in_avals))

    def backward(leaves: list, cts: tuple) -> tuple:
        res = jax.tree.unflatten(tree, [x[0] for x in leaves])
        full: list = [None] * len(g)
        for k, ct in zip(present, cts):
            full[k] = ct
        grads = prog.backward(res, full)
        reached.note(grads)
        out = []
        for k in want:
            gk = grads[k]
            if gk is None:
                a = prog.in_avals[k]
                gk = jnp.zeros(a.shape, a.dtype)
            elif not check and (axes := _unmentioned(in_specs[k], manual)):
                gk = lax.psum(gk, axes)
            out.append(gk)
        return tuple(out)

    ct_specs = tuple(out_specs[k] for k in present)
    grads = _smap(backward, p, (list(res_specs), ct_specs), tuple(in_specs[k] for k in want))(
        list(r.extra), tuple(g[k] for k in present)
    )
    out: list = [None] * len(r.in_avals)
    for k, gk in zip(want, grads):
        # an input the body never reached gets None, not the zeros the body returned
        # (Note [An unused output adds nothing] in program.py)
        out[k] = gk if reached.hit[k] else None
    return tuple(out)


_shard_map_vjp.prepare = _shard_map_prepare
_shard_map_vjp.unused_as_none = True  # Note [An unused output adds nothing] in program.py


def _mesh() -> Any:
    """A one-device mesh with an Auto axis ``"x"`` (the primitive table runs on one
    device; ``tests/lift/test_shard_map.py`` runs the rules on eight)."""
    return jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])


def _psum_program(w: Any, x: Any) -> Any:
    def body(w, x):
        return lax.psum(jnp.sum(jnp.tanh(x @ w) ** 2), "x")

    return jax.shard_map(body, mesh=_mesh(), in_specs=(P(), P("x")), out_specs=P())(w, x)


def _unchecked_program(w: Any, x: Any) -> Any:
    def body(w, x):
        return jnp.sin(x * w[None]), lax.psum(jnp.sum(x * w[None]), "x")

    y, s = jax.shard_map(body, mesh=_mesh(), in_specs=(P(), P("x")), out_specs=(P("x"), P()), check_vma=False)(w, x)
    return jnp.sum(y**2) + s


def _shard_map_errors() -> list[BadProgram]:
    def pmax(x):
        body = lambda x: lax.pmax(jnp.sum(x), "x")  # noqa: E731
        return jax.shard_map(body, mesh=_mesh(), in_specs=P("x"), out_specs=P())(x)

    return [BadProgram("pmax", pmax, (np.ones((2, 3)),), AutogradError, ("pmax",), jax_too=True)]


defrule(
    "shard_map",
    _shard_map_vjp,
    forward=_shard_map_forward,
    multiple_results=True,
    table=(
        TableEntry(
            "shard_map",
            _psum_program,
            lambda r: [Sample((normal(r, 3, 2), normal(r, 4, 3)), diff=(0, 1))],
            prims=("shard_map", "psum_invariant", "pvary"),
            vmap=True,
        ),
        TableEntry(
            "shard_map_unchecked",
            _unchecked_program,
            lambda r: [Sample((normal(r, 3), normal(r, 4, 3)), diff=(0, 1))],
            prims=("shard_map", "psum"),
        ),
    ),
    errors=_shard_map_errors,
)


# -- collectives --------------------------------------------------------------------


def _named(axes: Any) -> tuple:
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def _positional_back(g: Any, r: Any, axes: tuple) -> Any:
    """The cotangent of a sum over positional axes, broadcast back to the operand."""
    pos = sorted(a % len(r.in_avals[0].shape) for a in axes if isinstance(a, int))
    if not pos:
        return g
    return jnp.broadcast_to(jnp.expand_dims(g, pos), r.in_avals[0].shape)


def _psum_vjp(r: Any, g: Any) -> tuple:
    """``psum`` without value types (``check_vma=False``): a sum over devices
    that every device then holds, so its transpose sums the cotangents again
    (Note [shard_map on the tape])."""
    axes = _named(r.params["axes"])
    g = _positional_back(g, r, axes)
    named = tuple(a for a in axes if not isinstance(a, int))
    if named:
        g = r._step.prim.bind(g, axes=named, axis_index_groups=r.params["axis_index_groups"])
    return (g,)


def _psum_invariant_vjp(r: Any, g: Any) -> tuple:
    """A sum of a value that varies over ``axes`` into one that does not: the
    cotangent is handed to every device unchanged (``pcast`` to varying)."""
    axes = _named(r.params["axes"])
    g = _positional_back(g, r, axes)
    return (vary_over(g, [a for a in axes if not isinstance(a, int)]),)


def _pvary_vjp(r: Any, g: Any) -> tuple:
    """An invariant value made varying over ``axes``: each device used it, so
    its gradient is the sum of the devices' cotangents."""
    return (lax.psum(g, tuple(r.params["axes"])),)


def _all_gather_vjp(r: Any, g: Any) -> tuple:
    p = r.params
    return (
        lax.psum_scatter(
            g,
            p["axis_name"],
            scatter_dimension=p["all_gather_dimension"],
            axis_index_groups=p.get("axis_index_groups"),
            tiled=p["tiled"],
        ),
    )


def _all_gather_invariant_vjp(r: Any, g: Any) -> tuple:
    """Every device holds the whole gathered value: each takes back its own
    block of the (invariant) cotangent."""
    p = r.params
    dim, size = p["all_gather_dimension"], p["axis_size"]
    block = g.shape[dim] // size
    piece = lax.dynamic_slice_in_dim(g, lax.axis_index(p["axis_name"]) * block, block, axis=dim)
    return (piece if p["tiled"] else jnp.squeeze(piece, dim),)


def _reduce_scatter_vjp(r: Any, g: Any) -> tuple:
    p = r.params
    return (
        lax.all_gather(
            g, p["axis_name"], axis_index_groups=p["axis_index_groups"], axis=p["scatter_dimension"], tiled=p["tiled"]
        ),
    )


def _ppermute_vjp(r: Any, g: Any) -> tuple:
    p = r.params
    return (lax.ppermute(g, p["axis_name"], perm=[(d, s) for s, d in p["perm"]]),)


def _all_to_all_vjp(r: Any, g: Any) -> tuple:
    p = dict(r.params)
    p["split_axis"], p["concat_axis"] = p["concat_axis"], p["split_axis"]
    return (r._step.prim.bind(g, **p),)


def _on(out_specs: Any) -> Any:
    """``fun`` of two arrays sharded on ``"x"`` under ``shard_map`` on the
    one-device mesh (for the table)."""

    def wrap(fun: Any) -> Any:
        def program(*xs: Any) -> Any:
            out = jax.shard_map(fun, mesh=_mesh(), in_specs=(P("x"), P("x")), out_specs=out_specs)(*xs)
            return sum(jnp.sum(jnp.sin(o)) for o in jax.tree.leaves(out))

        return program

    return wrap


def _two(r: Any) -> list[Sample]:
    return [Sample((normal(r, 4, 3), normal(r, 4, 3)), diff=(0, 1))]


defrule("psum", _psum_vjp, table=())
defrule("psum_invariant", _psum_invariant_vjp, table=())
defrule("pvary", _pvary_vjp, table=())
defrule(
    "all_gather",
    _all_gather_vjp,
    table=(
        TableEntry(
            "all_gather",
            _on(P("x"))(lambda a, b: lax.all_gather(a * b, "x", axis=1, tiled=True)),
            _two,
        ),
    ),
)
defrule(
    "all_gather_invariant",
    _all_gather_invariant_vjp,
    table=(
        TableEntry(
            "all_gather_invariant",
            _on(P())(lambda a, b: lax.all_gather(a * b, "x", axis=0, to="invarying")),
            _two,
        ),
        TableEntry(
            "all_gather_invariant_tiled",
            _on(P())(lambda a, b: lax.all_gather(a * b, "x", axis=1, tiled=True, to="invarying")),
            _two,
        ),
    ),
)
defrule(
    "reduce_scatter",
    _reduce_scatter_vjp,
    table=(
        TableEntry(
            "reduce_scatter",
            _on(P("x"))(lambda a, b: lax.psum_scatter(a * b, "x", scatter_dimension=1, tiled=True)),
            _two,
        ),
    ),
)
defrule(
    "ppermute",
    _ppermute_vjp,
    table=(
        TableEntry(
            "ppermute",
            _on(P("x"))(lambda a, b: lax.ppermute(a, "x", perm=[(0, 0)]) * b),
            _two,
        ),
    ),
)
defrule(
    "all_to_all",
    _all_to_all_vjp,
    table=(
        TableEntry(
            "all_to_all",
            _on(P("x"))(lambda a, b: lax.all_to_all(a * b, "x", split_axis=1, concat_axis=0, tiled=True)),
            _two,
        ),
    ),
)

# linear maps and a call: their rules hold for complex values as written (transposed,
# not conjugated); tests/lift/test_complex.py and tests/_shard_map_cases.py check them
COMPLEX_OK.update(
    {"shard_map", "psum", "psum_invariant", "pvary", "all_gather", "all_gather_invariant", "reduce_scatter"}
    | {"ppermute", "all_to_all"}
)
