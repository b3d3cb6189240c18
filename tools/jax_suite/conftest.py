"""Run jax's (or a library's) test files with every gradient they take also taken on rf's tape.

Loaded as a pytest plugin (``run.sh`` copies it as ``_rf_probe.py`` and runs
``pytest -p _rf_probe``), it patches ``jax.grad``, ``jax.value_and_grad``,
``jax.vjp`` and ``jtu.check_grads`` so that each call on concrete values (outside
any jax trace) also runs ``rf.grad``/``rf.value_and_grad``/``rf.vjp`` of
``rf.lift`` of the same function, compares the two, and appends one JSON line per
comparison to ``$PROBE_LOG``. With ``PROBE_TRACED=1``, a call inside a trace
(under ``jax.jit``, ``vmap``, ``scan``, a library's loop) is probed too: rf's side
is traced beside jax's and a ``jax.debug.callback`` compares the values each time
the program runs (kind ``traced:...``; once per example under vmap, once per
iteration in a loop, and also in the branch of a batched ``cond`` whose result is
discarded). The tests keep their own verdicts; the probe never fails one, though
tests that count traces or inspect jaxprs see rf's extra work.

Statuses: ``ok`` (every leaf within 1e-3 of its scale), ``MISMATCH`` (values,
shapes, dtypes or the finite pattern differ: read these first), a refusal rf
raises by design (``AutogradError``, ``ShapeError``), ``ERROR:<type>`` (any other
exception from rf: a crash to look at), ``jaxfail`` (jax itself raised).
``summarize.py`` groups them. Read MISMATCH lines by hand: jax's tests run
float16/bfloat16 cases, where rf's sums (kept in float32) round differently, and
some pass a Python float as a cotangent, which jax returns as it came.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
from jax._src import core as jcore
from jax._src import public_test_util as ptu
from jax._src import test_util as jtu

import rumus_fx as rf

LOG = os.environ.get("PROBE_LOG", "probe.jsonl")
# PROBE_TRACED=1: gradients taken inside a trace (under jax.jit, vmap, scan, ...) are
# probed too: rf's gradient is traced beside jax's and the two are compared by a
# jax.debug.callback when the compiled program runs (kind "traced:<transform>")
TRACED = os.environ.get("PROBE_TRACED") == "1"
_grad, _value_and_grad, _vjp = jax.grad, jax.value_and_grad, jax.vjp
_busy = [0]  # > 0 while rf runs: jax.grad calls made by the probe itself are not probed
_current = [""]


def pytest_runtest_setup(item: Any) -> None:
    _current[0] = item.nodeid


def _log(**fields: Any) -> None:
    fields["test"] = _current[0]
    with open(LOG, "a") as f:
        f.write(json.dumps(fields, default=str) + "\n")


def _probing(args: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(args)
    return _busy[0] == 0 and not any(isinstance(x, jcore.Tracer) for x in leaves) and jcore.trace_state_clean()


def _difference(got: Any, want: Any) -> float | str:
    """The largest difference of two gradient trees relative to each leaf's scale,
    or what makes them incomparable."""
    la, ta = jax.tree_util.tree_flatten(got)
    lb, tb = jax.tree_util.tree_flatten(want)
    if ta != tb:
        return f"structure {ta} vs {tb}"
    worst = 0.0
    for x, y in zip(la, lb):
        if not all(isinstance(v, (jax.Array, np.ndarray, np.generic, int, float, complex)) for v in (x, y)):
            if x is not y and x != y:  # an auxiliary string or object: compared as it is
                return f"value {x!r} vs {y!r}"
            continue
        # jax's typed literals (a float subclass that carries a dtype) keep their dtype
        x, y = (np.asarray(v, dtype=getattr(v, "dtype", None)) for v in (x, y))
        if x.shape != y.shape:
            return f"shape {x.shape} vs {y.shape}"
        if jax.dtypes.float0 in (x.dtype, y.dtype):
            continue
        if x.dtype != y.dtype:
            return f"dtype {x.dtype} vs {y.dtype}"
        wide = np.complex128 if np.iscomplexobj(x) else np.float64
        x, y = x.astype(wide), y.astype(wide)
        fx, fy = np.isfinite(x), np.isfinite(y)
        if not np.array_equal(fx, fy) or not np.array_equal(x[~fx], y[~fy], equal_nan=True):
            return "finite pattern differs"
        if fx.any():
            scale = max(1.0, float(np.max(np.abs(y[fy]))))
            worst = max(worst, float(np.max(np.abs(x[fx] - y[fy]))) / scale)
    return worst


def _where(fun: Any) -> str:
    code = getattr(fun, "__code__", None)
    if code:
        return f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno}"
    try:  # a partial's repr may read its traced arguments (pytreeclass: float() of a tracer)
        return repr(fun)[:120]
    except Exception:
        return type(fun).__name__


_FAILED = object()
_UNSET = object()


def _run_rf(kind: str, where: str, rf_side: Any) -> Any:
    """rf's side, or ``_FAILED`` after logging what it raised (never raised on)."""
    _busy[0] += 1
    try:
        return rf_side()
    except Exception as e:  # every outcome is logged, none is raised
        refusal = isinstance(e, (rf.AutogradError, rf.ShapeError))
        status = type(e).__name__ if refusal else "ERROR:" + type(e).__name__
        _log(kind=kind, status=status, where=where, err=repr(e)[:500], tb=traceback.format_exc()[-3000:])
        return _FAILED
    finally:
        _busy[0] -= 1


def _log_difference(kind: str, where: str, got: Any, want: Any) -> None:
    try:
        d = _difference(got, want)
    except Exception as e:  # the probe never fails a test
        d = f"incomparable: {e!r}"[:300]
    ok = not isinstance(d, str) and d < 1e-3
    _log(kind=kind, status="ok" if ok else "MISMATCH", where=where, err=d)


def _compare(kind: str, want: Any, rf_side: Any, fun: Any) -> None:
    where = _where(fun)
    got = _run_rf(kind, where, rf_side)
    if got is not _FAILED:
        _log_difference(kind, where, got, want)


def _compare_traced(kind: str, want: Any, rf_side: Any, fun: Any) -> None:
    """Like ``_compare`` for a gradient taken inside a trace: rf's side is traced
    now, its values compared with jax's by a debug callback at run time."""
    where, kind, test = _where(fun), "traced:" + kind, _current[0]
    got = _run_rf(kind, where, rf_side)
    if got is _FAILED:
        return
    try:
        _check_at_run_time(kind, where, test, got, want)
    except Exception as e:  # the probe never fails a test
        _log(kind=kind, status="ERROR:probe", where=where, err=repr(e)[:300])


def _arrayish(v: Any) -> bool:
    return isinstance(v, (jax.Array, np.ndarray, np.generic, int, float, complex)) and (
        getattr(v, "dtype", None) != jax.dtypes.float0
    )


def _check_at_run_time(kind: str, where: str, test: str, got: Any, want: Any) -> None:
    """Compare what can be compared now (the trees, static leaves) and the traced
    leaves in a debug callback when the program runs."""
    lg, tg = jax.tree_util.tree_flatten(got)
    lw, tw = jax.tree_util.tree_flatten(want)
    if tg != tw:
        _log(kind=kind, status="MISMATCH", where=where, err=f"structure {tg} vs {tw}")
        return
    traced = [
        i
        for i, (x, y) in enumerate(zip(lg, lw))
        if _arrayish(x) and _arrayish(y) and (isinstance(x, jax.Array) or isinstance(y, jax.Array))
    ]
    float0 = jax.dtypes.float0
    skip = {
        i for i, (x, y) in enumerate(zip(lg, lw)) if float0 in (getattr(x, "dtype", None), getattr(y, "dtype", None))
    }
    traced = [i for i in traced if i not in skip]  # float0 cotangents (a tracer inside jit, a NumPy array outside)
    rest = [i for i in range(len(lg)) if i not in traced and i not in skip]
    if any(isinstance(v, jcore.Tracer) for i in rest for v in (lg[i], lw[i])):
        _log(kind=kind, status="MISMATCH", where=where, err="a traced leaf against a non-array")
        return
    d = _difference([lg[i] for i in rest], [lw[i] for i in rest])
    if isinstance(d, str) or d >= 1e-3:
        _log(kind=kind, status="MISMATCH", where=where, err=d)
        return
    if [np.shape(lg[i]) for i in traced] != [np.shape(lw[i]) for i in traced]:
        _log(kind=kind, status="MISMATCH", where=where, err="shapes differ")
        return

    def check(*pairs: Any) -> None:
        _current[0], saved = test, _current[0]  # the test that traced it, not the one running
        _log_difference(kind, where, list(pairs[0::2]), list(pairs[1::2]))
        _current[0] = saved

    jax.debug.callback(check, *[v for i in traced for v in (lg[i], lw[i])])


def check_grads(f, args, order, modes=("fwd", "rev"), atol=None, rtol=None, eps=None) -> None:
    """jtu.check_grads: the first-order reverse mode against rf.vjp."""
    args = tuple(args)
    if "rev" not in modes or not _probing(args):
        return
    try:
        out, vjp_fn = _vjp(f, *args)
        rng = np.random.RandomState(0)
        ct = jax.tree_util.tree_map(
            lambda o: jnp.asarray(
                rng.standard_normal(np.shape(o))
                + (1j * rng.standard_normal(np.shape(o)) if jnp.iscomplexobj(o) else 0),
                dtype=o.dtype,
            ),
            out,
        )
        want = vjp_fn(ct)
    except Exception as e:
        _log(kind="check_grads", status="jaxfail", where="", err=repr(e)[:300])
        return
    _compare("check_grads", want, lambda: rf.vjp(rf.lift(f), *args)[1](ct), f)


def _queues(fun: Any) -> list[tuple[collections.deque, list]]:
    """The queues a callable object consumes as it runs (flax nnx's ``GradFn`` pops
    one entry per argument from ``nondiff_states``), with their contents, so that rf's
    call can be given what jax's call consumed."""
    attrs = getattr(fun, "__dict__", None) or {}
    return [(q, list(q)) for q in attrs.values() if isinstance(q, collections.deque)]


def _refill(queues: list[tuple[collections.deque, list]]) -> None:
    for q, items in queues:
        q.clear()
        q.extend(items)


def _transform(jax_transform: Any, rf_transform: Any, kind: str) -> Any:
    @functools.wraps(jax_transform)  # libraries copy jax.grad's docstring at import (scico)
    def transform(fun, argnums=0, has_aux=False, holomorphic=False, allow_int=False, reduce_axes=_UNSET, **kw):
        if reduce_axes is not _UNSET:  # passed on as given (jaxlie's manifold gradients pass reduce_axes=())
            kw["reduce_axes"] = reduce_axes
        g = jax_transform(fun, argnums=argnums, has_aux=has_aux, holomorphic=holomorphic, allow_int=allow_int, **kw)
        if holomorphic or allow_int or set(kw) - {"reduce_axes"} or tuple(kw.get("reduce_axes", ())):
            return g

        @functools.wraps(g)
        def probed(*args, **kwargs):
            queues = _queues(fun)
            want = g(*args, **kwargs)
            _refill(queues)
            if _probing((args, kwargs)):
                lifted = rf_transform(rf.lift(fun), argnums=argnums, has_aux=has_aux)
                _compare(kind, want, lambda: lifted(*args, **kwargs), fun)
            elif TRACED and _busy[0] == 0:
                lifted = rf_transform(rf.lift(fun), argnums=argnums, has_aux=has_aux)
                _compare_traced(kind, want, lambda: lifted(*args, **kwargs), fun)
            return want

        return probed

    return transform


@functools.wraps(_vjp)
def vjp(fun, *primals, has_aux=False, **kw):
    res = _vjp(fun, *primals, has_aux=has_aux, **kw)
    if kw or _busy[0] or not (TRACED or _probing(primals)):
        return res

    def vjp_fn(ct):
        want = res[1](ct)
        side = lambda: rf.vjp(rf.lift(fun), *primals, has_aux=has_aux)[1](ct)  # noqa: E731
        if _probing((primals, ct)):
            _compare("vjp", want, side, fun)
        elif TRACED and _busy[0] == 0:
            _compare_traced("vjp", want, side, fun)
        return want

    return (res[0], vjp_fn, *res[2:])


ptu.check_grads = jtu.check_grads = jax.test_util.check_grads = check_grads
jax.grad = _transform(_grad, rf.grad, "grad")
jax.value_and_grad = _transform(_value_and_grad, rf.value_and_grad, "value_and_grad")
jax.vjp = vjp
