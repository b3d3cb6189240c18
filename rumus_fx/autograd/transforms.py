"""Functional transforms with ``jax.grad``'s calling conventions: grad,
value_and_grad, vjp.

Each call opens its own tape, wraps the differentiated leaves as tracked
``Tensor`` leaves (new storages, version 0, ``requires_grad=True``: an in-place
op on one raises, as on any such leaf), runs ``fun`` and walks the tape. The
tape records even when the call sits inside an outer ``rf.no_grad()`` (as
``torch.func.grad`` and ``jax.grad``); a ``no_grad()`` inside ``fun`` still
stops recording there.
Under ``jax.jit`` all of this runs once, at trace time; the tape and every
storage die with the call, so nothing (no tracer) outlives it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import sharding
from ..eager import ones_like_value
from ..errors import AutogradError
from ..tensor import Tensor, is_leaf_id, next_leaf_id
from .engine import CROSS_TAPE_MESSAGE, gradients
from .tape import Tape, budget_hooks, current_tape, recording


def _is_tensor(x: Any) -> bool:
    return isinstance(x, Tensor)


def _leaf_array(x: Any) -> jax.Array:
    if isinstance(x, Tensor):
        return x.value
    if isinstance(x, jax.Array):  # what ``jnp.asarray`` returns for it, without its Python
        return x
    return jnp.asarray(x)


def _argnums_tuple(argnums: int | Sequence[int], nargs: int, name: str) -> tuple[tuple[int, ...], bool]:
    single = isinstance(argnums, (int, np.integer))
    nums = (int(argnums),) if single else tuple(int(a) for a in argnums)
    if not single and not nums:
        raise TypeError(f"{name}: argnums must not be empty")
    for a in nums:
        if not -nargs <= a < nargs:
            raise TypeError(
                f"{name}: differentiating with respect to argnums={argnums} requires at least "
                f"{max(a + 1, -a)} positional arguments to be passed by the caller, but got only "
                f"{nargs} positional arguments."
            )
    normal = tuple(a % nargs for a in nums)
    repeated = sorted({a for a in normal if normal.count(a) > 1})
    if repeated:
        raise TypeError(
            f"{name}: argnums={argnums} names argument {repeated[0]} more than once; each "
            "positional argument can be differentiated only once (pass each index once)"
        )
    return normal, single


def _check_float_leaf(x: jax.Array, name: str) -> None:
    # complex inputs are differentiated as jax.grad does (holomorphic=False: a real
    # loss's gradient with respect to a complex input is jax.grad's value)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        raise TypeError(
            f"{name} requires real-valued or complex inputs (input dtype that is a sub-dtype of "
            f"np.inexact), but got {np.dtype(x.dtype).name}. Pass integer or boolean "
            "inputs as arguments that are not differentiated (see argnums)."
        )


# rf.lift, registered by the lift package (which builds on this package's tape,
# so it sits above it): Note [Higher order]
_lift: Callable[..., Callable] | None = None


def set_lift(lift: Callable[..., Callable]) -> None:
    """Register ``rf.lift`` for the nested transforms (``rumus_fx.lift`` does,
    when it is imported; ``import rumus_fx`` always imports it)."""
    global _lift
    _lift = lift


def _nested(transform: Callable, name: str) -> Callable:
    """Note [Higher order]: a transform called while an enclosing tape records
    (``rf.grad`` inside ``rf.grad``, ``rf.vjp`` inside a loss) runs as one lifted
    call on that tape: ``rf.lift`` traces the whole transform (its forward and
    its backward walk, with no tape active outside it) to primitives and records
    each with rf's rules, so the gradient is itself differentiable to any order.
    Tracked Tensors the function closes over become inputs of that entry."""
    if _lift is None:  # pragma: no cover - rumus_fx/__init__ imports rumus_fx.lift
        raise AutogradError("a nested rf transform needs rf.lift: import rumus_fx")
    lifted = _lift(transform, name=name)

    @functools.wraps(transform)
    def call(*args: Any, **kwargs: Any) -> Any:
        # untracked results are plain arrays, as from the transform itself
        return jax.tree_util.tree_map(
            lambda x: x.value if isinstance(x, Tensor) and x.grad_id is None else x,
            lifted(*args, **kwargs),
            is_leaf=_is_tensor,
        )

    return call


def _foreign_check(first: int) -> Any:
    """The engine's ``foreign`` hook for a transform whose leaves got ids above
    ``first``: a gradient reached a tensor that the transform's tape did not
    produce and that is not one of its leaves.

    * A recorded result created during the call came from a tape opened inside
      ``fun`` (a nested ``rf.Tape``): the path through it would be missed.
    * A tensor created before the call is a closure of ``fun``: a constant of
      it. (Under an enclosing tape the transform runs lifted, Note [Higher
      order], and such a closure is captured as an input of the lifted entry.)
    * A leaf created inside ``fun`` is a constant of it."""

    def foreign(gid: int) -> None:
        if gid > first and not is_leaf_id(gid):
            raise AutogradError(CROSS_TAPE_MESSAGE.format(gid=gid))

    return foreign


def _track(tree: Any, name: str, check: bool = True) -> tuple[Any, list[Tensor | None], Any]:
    """Replace each leaf of ``tree`` by a tracked leaf Tensor."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_tensor)
    tensors: list[Tensor | None] = []
    new_leaves = []
    for leaf in leaves:
        arr = _leaf_array(leaf)
        if check:
            _check_float_leaf(arr, name)
        elif not jnp.issubdtype(arr.dtype, jnp.inexact):
            tensors.append(None)
            new_leaves.append(arr)
            continue
        t = Tensor._wrap(arr, next_leaf_id())
        t._leaf = True  # a leaf that requires grad, as rf.tensor(..., requires_grad=True)
        tensors.append(t)
        new_leaves.append(t)
    return jax.tree_util.tree_unflatten(treedef, new_leaves), tensors, treedef


def _to_arrays(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: x.value if isinstance(x, Tensor) else x, tree, is_leaf=_is_tensor)


def _scalar_output(out: Any, name: str) -> tuple[jax.Array, Tensor | None]:
    if isinstance(out, Tensor):
        value = out.value
        tracked = out if out.grad_id is not None else None
    else:
        try:
            if out is None:
                raise TypeError
            value = jnp.asarray(out)
        except (TypeError, ValueError):
            raise TypeError(
                f"{name}: the function must return a scalar (an rf.Tensor or array of size 1), got {type(out).__name__}"
            ) from None
        tracked = None
    if value.size != 1:
        raise TypeError(f"Gradient only defined for scalar-output functions. Output had shape: {tuple(value.shape)}.")
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(
            f"{name} requires real-valued outputs (output dtype that is a sub-dtype of "
            f"np.floating), but got {np.dtype(value.dtype).name}."
        )
    return value, tracked


def value_and_grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    memory_budget: int | float | None = None,
) -> Callable:
    """Like ``jax.value_and_grad``, computed by recording ``fun`` on a tape.

    Returns ``g(*args, **kwargs) -> (value, grads)`` (``((value, aux), grads)``
    with ``has_aux=True``). ``grads`` has the pytree structure, shapes and dtypes
    of the differentiated arguments; unused leaves get zeros.

    ``memory_budget``: bytes (``int``) or a fraction in (0, 1] (``float``) of the
    bytes ``fun``'s records would save for backward; segments of ``fun`` are
    then rematerialised (as ``rf.checkpoint`` does) so that the saved
    activations fit, recomputing cheap elementwise work first (Note [Memory
    budget] in rumus_fx/lift/budget.py). The gradients are unchanged; a budget
    that cannot be met warns (``MemoryBudgetWarning``) with what is achieved.

    >>> import jax.numpy as jnp, rumus_fx as rf
    >>> f = lambda w, x: rf.sum(rf.relu(x @ w))
    >>> value, gw = rf.value_and_grad(f)(jnp.ones((3, 2)), jnp.ones((4, 3)))
    >>> gw.shape
    (3, 2)
    """
    return _value_and_grad(fun, argnums, has_aux, "value_and_grad", memory_budget)


def _budget(memory_budget: Any) -> int | float | None:
    return None if memory_budget is None else budget_hooks()[0](memory_budget)


def _call(fun: Callable, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``fun(*args, **kwargs)``; JAX refusing an rf op's shardings becomes an
    ``rf.ShardingError`` that names the op (rumus_fx/sharding.py)."""
    try:
        return fun(*args, **kwargs)
    except Exception as e:
        err = sharding.forward_error(e)
        if err is None:
            raise
        raise err from e


def _value_and_grad(
    fun: Callable, argnums: int | Sequence[int], has_aux: bool, name: str, memory_budget: Any = None
) -> Callable:
    budget = _budget(memory_budget)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if current_tape() is not None:  # Note [Higher order]
            return _nested(plain, f"rf.{name}({getattr(fun, '__name__', 'fun')})")(*args, **kwargs)
        return plain(*args, **kwargs)

    def plain(*args: Any, **kwargs: Any) -> Any:
        nums, single = _argnums_tuple(argnums, len(args), name)
        first = next_leaf_id()  # every id this call creates is larger
        tape = Tape()
        new_args = list(args)
        tracked: list[tuple[list[Tensor | None], Any]] = []
        for i in nums:
            new_args[i], tensors, treedef = _track(args[i], "grad")
            tracked.append((tensors, treedef))
        with recording(tape):
            if budget is None:
                out = _call(fun, new_args, kwargs)
            else:  # Note [Memory budget] in rumus_fx/lift/budget.py
                out = budget_hooks()[1](fun, tuple(new_args), kwargs, budget, getattr(fun, "__name__", "fun"))
        if has_aux:
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise TypeError(
                    f"has_aux=True requires the function to return a pair (output, aux), got {type(out).__name__}"
                )
            out, aux = out
        value, loss = _scalar_output(out, name)
        seeds = [(loss.grad_id, ones_like_value(loss.value))] if loss is not None else []
        wrt = [(t, t.value) for tensors, _ in tracked for t in tensors]
        flat = gradients(tape._entries, seeds, wrt, _foreign_check(first))
        tape._entries = []
        results = []
        it = iter(flat)
        for tensors, treedef in tracked:
            results.append(jax.tree_util.tree_unflatten(treedef, [next(it) for _ in tensors]))
        g = results[0] if single else tuple(results)
        if has_aux:
            return (value, _to_arrays(aux)), g
        return value, g

    return wrapped


def grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    memory_budget: int | float | None = None,
) -> Callable:
    """Like ``jax.grad``, computed by recording ``fun`` on a tape.

    ``fun`` receives each leaf of the differentiated arguments as a tracked
    ``rf.Tensor`` and must return a scalar (``rf.Tensor`` or array of size 1).
    Works eagerly and under ``jax.jit``, ``jax.vmap`` and ``jax.jvp``.
    ``memory_budget``: as in ``rf.value_and_grad``.

    >>> import jax.numpy as jnp, rumus_fx as rf
    >>> rf.grad(lambda x: rf.sum(x * x))(jnp.arange(3.0))
    Array([0., 2., 4.], dtype=float32)
    """
    vg = _value_and_grad(fun, argnums, has_aux, "grad", memory_budget)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if has_aux:
            (_, aux), g = vg(*args, **kwargs)
            return g, aux
        _, g = vg(*args, **kwargs)
        return g

    return wrapped


def vjp(fun: Callable, *primals: Any, has_aux: bool = False) -> Any:
    """Like ``jax.vjp``: returns ``(out, vjp_fn)`` (and ``aux`` with ``has_aux``).

    ``out`` may be any pytree of Tensors/arrays (returned as arrays);
    ``vjp_fn(cotangent)`` returns one gradient pytree per primal and may be
    called more than once. Integer primals get ``float0`` cotangents, as in JAX.
    """
    if current_tape() is not None:  # Note [Higher order]: forward and vjp_fn lifted
        return _nested_vjp(fun, primals, has_aux)
    return _plain_vjp(fun, primals, has_aux)


def _nested_vjp(fun: Callable, primals: tuple, has_aux: bool) -> Any:
    def forward(*ps: Any) -> Any:
        return _plain_vjp(fun, ps, has_aux)[0 if not has_aux else slice(0, None, 2)]

    name = getattr(fun, "__name__", "fun")
    out = _nested(forward, f"rf.vjp({name}).forward")(*primals)
    aux = None
    if has_aux:
        out, aux = out

    def pullback(ps: tuple, ct: Any) -> Any:
        return _plain_vjp(fun, ps, has_aux)[1](ct)

    lifted_pullback = _nested(pullback, f"rf.vjp({name}).backward")

    def vjp_fn(cotangent: Any) -> tuple:
        return lifted_pullback(tuple(primals), cotangent)

    return (out, vjp_fn, aux) if has_aux else (out, vjp_fn)


def _plain_vjp(fun: Callable, primals: tuple, has_aux: bool) -> Any:
    first = next_leaf_id()  # every id this call creates is larger
    tape = Tape()
    new_primals = []
    tracked = []
    for p in primals:
        new_p, tensors, treedef = _track(p, "vjp", check=False)
        new_primals.append(new_p)
        tracked.append((tensors, treedef, [_leaf_array(x) for x in jax.tree_util.tree_leaves(p, is_leaf=_is_tensor)]))
    with recording(tape):
        out = _call(fun, new_primals, {})
    if has_aux:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError("has_aux=True requires the function to return a pair (output, aux)")
        out, aux = out
    out_leaves, out_tree = jax.tree_util.tree_flatten(out, is_leaf=_is_tensor)
    out_arrays = [x.value if isinstance(x, Tensor) else jnp.asarray(x) for x in out_leaves]
    out_ids = [x.grad_id if isinstance(x, Tensor) else None for x in out_leaves]
    entries = tape._entries

    def vjp_fn(cotangent: Any) -> tuple:
        ct_leaves, ct_tree = jax.tree_util.tree_flatten(cotangent)
        if ct_tree != out_tree:
            raise TypeError(f"vjp: cotangent tree structure {ct_tree} does not match the output structure {out_tree}")
        seeds = []
        for gid, arr, ct in zip(out_ids, out_arrays, ct_leaves):
            if getattr(ct, "dtype", None) == jax.dtypes.float0:  # jax's cotangent of an integer output
                if jnp.issubdtype(arr.dtype, jnp.inexact) or tuple(ct.shape) != tuple(arr.shape):
                    raise ValueError(
                        f"vjp: a float0{list(ct.shape)} cotangent for an output of type "
                        f"{arr.dtype}{list(arr.shape)}: float0 is the cotangent of integer and boolean outputs only"
                    )
                continue  # such an output carries no gradient
            ct = jnp.asarray(ct)
            if tuple(ct.shape) != tuple(arr.shape):
                raise ValueError(f"vjp: cotangent of shape {tuple(ct.shape)} for an output of shape {tuple(arr.shape)}")
            seeds.append((gid, ct.astype(arr.dtype)))
        wrt = [(t, like) for tensors, _, likes in tracked for t, like in zip(tensors, likes)]
        it = iter(gradients(entries, seeds, wrt, _foreign_check(first)))
        return tuple(
            jax.tree_util.tree_unflatten(treedef, [next(it) for _ in tensors]) for tensors, treedef, _ in tracked
        )

    out_tree_arrays = jax.tree_util.tree_unflatten(out_tree, out_arrays)
    if has_aux:
        return out_tree_arrays, vjp_fn, _to_arrays(aux)
    return out_tree_arrays, vjp_fn
