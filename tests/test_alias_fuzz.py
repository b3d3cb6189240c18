"""Random programs over views, in-place ops, no_grad, nested tapes and transforms,
checked against a functional re-execution oracle.

A program is a list of steps over a pool of tensors: two parameters ``P0, P1``
(``[a, b]``) and two vectors ``PW, PB`` (``[b]``, also differentiated), two
untracked constants ``C0, C1``, and every tensor a step makes. Steps are
out-of-place ops, views (transpose, reshape, detach), copies (indexing, the
``rf.tensor(t, dtype=...)`` cast), in-place ops (``add_ sub_ mul_ div_ copy_
fill_ zero_``) on tracked and untracked tensors, layer/batch norm, an inner
``rf.grad`` (optionally closing over another pool tensor) and dropping a
tensor (so that bases and views die). Any step may run under ``rf.no_grad()``
or inside a nested ``rf.Tape()``. The program runs under ``rf.value_and_grad``
(eagerly, under ``jax.jit``, or inside an outer ``rf.no_grad()``), ``rf.vjp``,
an explicit ``rf.Tape``, or records on one tape and calls ``backward`` on
another.

The oracle re-executes the program without aliasing or in-place updates: each
storage is a flat ``jnp`` buffer per *history family* (the storage's tensors
and their views; each ``detach()`` starts a new family), each tensor a gather
index into it, and ``jax.grad`` differentiates the result. Its semantics are
PyTorch's: a recorded in-place write gives the writer's family the new history
(PyTorch's rebase: every view of the base sees it), the other families see the
new value as a constant, an unrecorded write (``no_grad``, or nothing tracked)
changes values but no history, untracked tensors are constants, and an inner
transform is differentiated through (``jax.grad`` of ``jax.grad``).

Every program must either match the oracle (value and gradients, float64) or
raise ``rf.AutogradError`` (``rf.VersionMismatch`` included). A program that
returns anything else is a silent mismatch and fails the test.

Profiles: the deterministic CI profile of ``tests/test_fuzz.py``; by hand,
``RUMUS_FX_FUZZ=long RUMUS_FX_FUZZ_EXAMPLES=20000 python -m pytest -s -m fuzz_long
tests/test_alias_fuzz.py`` (prints the outcome counts), or in parallel shards:
``RUMUS_FX_FUZZ=long RUMUS_FX_FUZZ_EXAMPLES=10000 RUMUS_FX_FUZZ_SHARDS=2
RUMUS_FX_FUZZ_REPORT=counts.jsonl python -m pytest -n 2 -m fuzz_long
tests/test_alias_fuzz.py``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import rumus_fx as rf

from .ops.optable import ref_batch_norm, ref_layer_norm
from .test_fuzz import fuzz, long_fuzz

sg = jax.lax.stop_gradient

SHAPES = [(2, 2), (3, 3), (2, 3)]
PARAMS = (0, 1, 4, 5)  # pool slots of P0, P1, PW, PB (C0, C1 are slots 2, 3)
KINDS = {  # kind: weight
    "unary": 4,
    "binary": 4,
    "transpose": 3,
    "reshape": 2,
    "detach": 2,
    "index": 1,
    "cast": 1,
    "inplace": 7,
    "copy_": 1,
    "fill_": 1,
    "layer_norm": 1,
    "batch_norm": 1,
    "inner_grad": 1,
    "drop": 2,
}
PRODUCING = {
    "unary",
    "binary",
    "transpose",
    "reshape",
    "detach",
    "index",
    "cast",
    "layer_norm",
    "batch_norm",
    "inner_grad",
}
MODES = {"grad": 6, "tape": 3, "outer_no_grad": 1, "foreign": 1, "vjp": 1, "jit": 1}
SCALAR = {"add_": 0.5, "sub_": -0.25, "mul_": 1.5, "div_": 2.0}


@dataclasses.dataclass(frozen=True)
class Step:
    kind: str
    args: tuple
    no_grad: bool = False
    inner_tape: bool = False


@dataclasses.dataclass(frozen=True)
class Program:
    shape: tuple[int, int]
    mode: str
    steps: tuple[Step, ...]
    loss: tuple[int, ...]  # pool slots summed (weighted) into the loss
    seed: int

    def data(self) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...], list[np.ndarray]]:
        """(params, constants, loss weights), float64, from the seed."""
        a, b = self.shape
        rng = np.random.default_rng(self.seed)
        params = (rng.standard_normal((a, b)), rng.standard_normal((a, b)), rng.uniform(0.5, 2, b), rng.normal(size=b))
        consts = (rng.standard_normal((a, b)), rng.standard_normal((a, b)))
        shapes = pool_shapes(self)
        weights = [rng.standard_normal(shapes[i]) for i in self.loss]
        return params, consts, weights


# ---------------------------------------------------------------------------
# the generator (hypothesis draws, or a numpy generator for scripts)
# ---------------------------------------------------------------------------


class Draw:
    """Choices from hypothesis (``data``) or from a numpy generator (``rng``)."""

    def __init__(self, data: Any = None, rng: np.random.Generator | None = None):
        self.data, self.rng = data, rng

    def int(self, lo: int, hi: int) -> int:
        if self.data is not None:
            return self.data.draw(st.integers(lo, hi))
        return int(self.rng.integers(lo, hi + 1))

    def chance(self, percent: int) -> bool:
        return self.int(0, 99) < percent

    def pick(self, seq: Sequence[Any]) -> Any:
        return seq[self.int(0, len(seq) - 1)]

    def recent(self, seq: Sequence[Any]) -> Any:
        """Half the time one of the newest three (where views and writes meet)."""
        return self.pick(seq[-3:]) if self.chance(50) else self.pick(seq)

    def weighted(self, table: dict[str, int]) -> str:
        r = self.int(0, sum(table.values()) - 1)
        for name, w in table.items():
            if r < w:
                return name
            r -= w
        raise AssertionError


def _initial_shapes(a: int, b: int) -> list[tuple[int, ...]]:
    return [(a, b), (a, b), (a, b), (a, b), (b,), (b,)]


def pool_shapes(prog: Program) -> list[tuple[int, ...] | None]:
    """The shape of every pool slot after the program (None: dropped)."""
    shapes: list[tuple[int, ...] | None] = list(_initial_shapes(*prog.shape))
    for step in prog.steps:
        k, args = step.kind, step.args
        if k == "drop":
            shapes[args[0]] = None
        elif k == "transpose":
            shapes.append(shapes[args[0]][::-1])
        elif k == "reshape":
            shapes.append(args[1])
        elif k in ("unary", "binary"):
            shapes.append(shapes[args[1]])
        elif k in PRODUCING:
            shapes.append(shapes[args[0]])
    return shapes


def gen_program(d: Draw, max_steps: int = 7) -> Program:
    a, b = d.pick(SHAPES)
    mode = d.weighted(MODES)
    shapes: list[tuple[int, ...] | None] = list(_initial_shapes(a, b))
    steps = []
    for _ in range(d.int(1, max_steps)):
        live = [i for i, s in enumerate(shapes) if s is not None]
        mats = [i for i in live if len(shapes[i]) == 2]
        vecs = [i for i in live if shapes[i] == (b,)]
        kind = d.weighted(KINDS)
        flags = dict(no_grad=d.chance(15), inner_tape=d.chance(5))

        def same(i: int, live: list[int] = live) -> list[int]:
            return [j for j in live if shapes[j] == shapes[i]]

        def vec_or_none(vecs: list[int] = vecs) -> int | None:
            return d.pick(vecs) if vecs and d.chance(75) else None

        if kind in ("unary", "binary", "index", "cast", "detach", "inplace", "copy_", "fill_", "inner_grad", "drop"):
            if not live:
                continue
            i = d.recent(live)
            if kind == "unary":
                steps.append(Step(kind, (d.pick(["tanh", "sigmoid", "neg", "scale"]), i), **flags))
            elif kind == "binary":
                steps.append(Step(kind, (d.pick(["add", "sub", "mul"]), i, d.pick(same(i))), **flags))
            elif kind == "inplace":
                op = d.pick(["add_", "sub_", "mul_", "div_"])
                other = None if op == "div_" or d.chance(25) else d.recent(same(i))
                steps.append(Step(kind, (op, i, other), **flags))
            elif kind == "copy_":
                steps.append(Step(kind, (i, d.pick(same(i))), **flags))
            elif kind == "fill_":
                steps.append(Step(kind, (i, d.pick(["fill", "zero"])), **flags))
            elif kind == "inner_grad":
                steps.append(Step(kind, (i, d.pick(same(i)) if d.chance(50) else None), **flags))
            else:
                steps.append(Step(kind, (i,), **flags))
        elif kind in ("transpose", "reshape"):
            if not mats:
                continue
            i = d.recent(mats)
            if kind == "transpose":
                steps.append(Step(kind, (i,), **flags))
            else:
                s0, s1 = shapes[i]
                steps.append(Step(kind, (i, d.pick([(s1, s0), (1, s0 * s1), (s0 * s1, 1)])), **flags))
        else:  # layer_norm / batch_norm over a [m, b] tensor with optional PW/PB-shaped vectors
            cands = [i for i in mats if shapes[i][1] == b and (kind == "layer_norm" or shapes[i][0] >= 2)]
            if not cands:
                continue
            steps.append(Step(kind, (d.pick(cands), vec_or_none(), vec_or_none()), **flags))
        k, args = steps[-1].kind, steps[-1].args
        if k == "drop":
            shapes[args[0]] = None
        elif k == "transpose":
            shapes.append(shapes[args[0]][::-1])
        elif k == "reshape":
            shapes.append(args[1])
        elif k in ("unary", "binary"):
            shapes.append(shapes[args[1]])
        elif k in PRODUCING:
            shapes.append(shapes[args[0]])
    live = [i for i, s in enumerate(shapes) if s is not None]
    # the loss favours the newest tensors (where aliasing and writes happen)
    loss = sorted({d.pick(live[-4:]) for _ in range(d.int(1, 3))}) if live else []
    return Program((a, b), mode, tuple(steps), tuple(loss), d.int(0, 2**16))


# ---------------------------------------------------------------------------
# running a program on rf
# ---------------------------------------------------------------------------

_UNARY_RF = {"tanh": rf.tanh, "sigmoid": rf.sigmoid, "neg": rf.neg, "scale": lambda t: t * 0.5}
_BINARY_RF = {"add": rf.add, "sub": rf.sub, "mul": rf.mul}


def _rf_step(pool: list, step: Step) -> Any:
    k, args = step.kind, step.args
    if k == "unary":
        return _UNARY_RF[args[0]](pool[args[1]])
    if k == "binary":
        return _BINARY_RF[args[0]](pool[args[1]], pool[args[2]])
    if k == "transpose":
        return pool[args[0]].T
    if k == "reshape":
        return pool[args[0]].reshape(args[1])
    if k == "detach":
        return pool[args[0]].detach()
    if k == "index":
        return pool[args[0]][::-1]
    if k == "cast":
        return rf.tensor(pool[args[0]], dtype=pool[args[0]].dtype)
    if k == "inplace":
        op, i, j = args
        getattr(pool[i], op)(SCALAR[op] if j is None else pool[j])
        return None
    if k == "copy_":
        pool[args[0]].copy_(pool[args[1]])
        return None
    if k == "fill_":
        if args[1] == "zero":
            pool[args[0]].zero_()
        else:
            pool[args[0]].fill_(0.5)
        return None
    if k in ("layer_norm", "batch_norm"):
        i, wi, bi = args
        w = None if wi is None else pool[wi]
        b = None if bi is None else pool[bi]
        if k == "layer_norm":
            return rf.layer_norm(pool[i], w, b)
        m, n = pool[i].shape
        zeros, ones = jnp.zeros(n, pool[i].dtype), jnp.ones(n, pool[i].dtype)
        y = rf.batch_norm_2d(pool[i].reshape(m, n, 1, 1), w, b, zeros, ones, training=True)[0]
        return y.reshape(m, n)
    if k == "inner_grad":
        i, j = args
        g = rf.grad(lambda a: rf.sum(rf.tanh(a) * (0.5 if j is None else pool[j])))(pool[i])
        return rf.tensor(g)
    if k == "drop":
        pool[args[0]] = None
        return None
    raise AssertionError(k)


def rf_body(prog: Program, params: Sequence[Any], consts: Sequence[Any], weights: Sequence[Any]) -> Any:
    pool: list[Any] = [params[0], params[1], rf.tensor(consts[0]), rf.tensor(consts[1]), params[2], params[3]]
    for step in prog.steps:
        with contextlib.ExitStack() as stack:
            if step.no_grad:
                stack.enter_context(rf.no_grad())
            if step.inner_tape:
                stack.enter_context(rf.Tape())
            out = _rf_step(pool, step)
        if step.kind in PRODUCING:
            pool.append(out)
        del out
    total = None
    for i, w in zip(prog.loss, weights):
        term = rf.sum(rf.mul(pool[i], w))
        total = term if total is None else total + term
    return total if total is not None else rf.sum(rf.mul(pool[0], 0.0))


def run_rf(prog: Program) -> tuple[Any, tuple]:
    """(loss value, gradients of the four parameters); raises what rf raises."""
    params, consts, weights = prog.data()
    params = tuple(jnp.asarray(p) for p in params)

    def fun(ps):
        return rf_body(prog, ps, consts, weights)

    if prog.mode in ("grad", "jit", "outer_no_grad"):
        g = rf.value_and_grad(fun)
        if prog.mode == "jit":
            g = jax.jit(g)
        if prog.mode == "outer_no_grad":
            with rf.no_grad():
                return g(params)
        return g(params)
    if prog.mode == "vjp":
        out, vjp_fn = rf.vjp(fun, params)
        return out, vjp_fn(jnp.ones_like(out))[0]
    with rf.Tape() as tape:
        ps = [rf.tensor(p, requires_grad=True) for p in params]
        loss = fun(ps)
    if prog.mode == "foreign":
        tape = rf.Tape()
    grads = tape.backward(loss)
    return loss.value, tuple(grads[p] for p in ps)


# ---------------------------------------------------------------------------
# the oracle: functional re-execution, differentiated by jax.grad
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class OTensor:
    sid: int  # storage
    idx: np.ndarray  # flat positions in the storage, in the tensor's shape
    family: int  # history family within the storage
    tracked: bool


class Oracle:
    def __init__(self) -> None:
        self.buffers: list[dict[int, jax.Array]] = []  # per storage: family -> flat buffer
        self.families = itertools.count(1)

    def new(self, value: jax.Array, tracked: bool) -> OTensor:
        self.buffers.append({0: (value if tracked else sg(value)).reshape(-1)})
        return OTensor(len(self.buffers) - 1, np.arange(value.size).reshape(value.shape), 0, tracked)

    def read(self, t: OTensor) -> jax.Array:
        # every tensor here views a whole storage in some order (transposes and
        # reshapes of it), so a view is a permutation: one small matmul, which
        # dispatches far faster than a gather
        v = (_perm(t.idx) @ self.buffers[t.sid][t.family]).reshape(t.idx.shape)
        return v if t.tracked else sg(v)

    def view(self, t: OTensor, idx: np.ndarray, tracked: bool, family: int | None = None) -> OTensor:
        return OTensor(t.sid, idx, t.family if family is None else family, tracked)

    def write(self, pool: list, t: OTensor, new_value: jax.Array, recorded: bool) -> None:
        bufs = self.buffers[t.sid]
        full = _perm(t.idx).T @ new_value.reshape(-1)  # the write covers the whole storage
        for fam, buf in list(bufs.items()):
            bufs[fam] = full if recorded and fam == t.family else buf + sg(full - buf)
        if recorded:  # PyTorch's rebase: the writer's whole family carries the new history
            for u in pool:
                if u is not None and u.sid == t.sid and u.family == t.family:
                    u.tracked = True


def _perm(idx: np.ndarray) -> np.ndarray:
    """The permutation matrix that reads the view ``idx`` of a flat storage."""
    flat = idx.reshape(-1)
    assert sorted(flat) == list(range(flat.size)), "views cover their storage once"
    return np.eye(flat.size)[flat]


def _strided(idx: np.ndarray) -> bool:
    """Whether ``idx`` (flat positions) is a strided layout: offset + sum(i_d * s_d)."""
    if idx.size <= 1:
        return True
    base = idx.reshape(-1)[0]
    expect = np.full(idx.shape, base)
    for d, size in enumerate(idx.shape):
        if size == 1:
            continue
        e = [0] * idx.ndim
        e[d] = 1
        stride = idx[tuple(e)] - base
        shape = [1] * idx.ndim
        shape[d] = size
        expect = expect + (np.arange(size) * stride).reshape(shape)
    return bool((expect == idx).all())


_UNARY_JNP = {"tanh": jnp.tanh, "sigmoid": jax.nn.sigmoid, "neg": jnp.negative, "scale": lambda x: x * 0.5}
_BINARY_JNP = {"add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply}
_INPLACE_JNP = {"add_": jnp.add, "sub_": jnp.subtract, "mul_": jnp.multiply, "div_": jnp.divide}


def _oracle_step(o: Oracle, pool: list, step: Step) -> OTensor | None:
    k, args = step.kind, step.args
    ng = step.no_grad

    def tracked(*ts: OTensor | None) -> bool:
        return not ng and any(t is not None and t.tracked for t in ts)

    if k == "unary":
        x = pool[args[1]]
        return o.new(_UNARY_JNP[args[0]](o.read(x)), tracked(x))
    if k == "binary":
        x, y = pool[args[1]], pool[args[2]]
        return o.new(_BINARY_JNP[args[0]](o.read(x), o.read(y)), tracked(x, y))
    if k == "transpose":
        x = pool[args[0]]
        return o.view(x, x.idx.T, tracked(x))
    if k == "reshape":
        x = pool[args[0]]
        idx = x.idx.reshape(args[1])
        if _strided(idx):
            return o.view(x, idx, tracked(x))
        return o.new(o.read(x).reshape(args[1]), tracked(x))
    if k == "detach":
        x = pool[args[0]]
        fam = next(o.families)
        bufs = o.buffers[x.sid]
        bufs[fam] = sg(bufs[x.family])
        return o.view(x, x.idx, False, family=fam)
    if k == "index":
        x = pool[args[0]]
        return o.new(o.read(x)[::-1], tracked(x))
    if k == "cast":
        x = pool[args[0]]
        return o.new(o.read(x), tracked(x))
    if k in ("inplace", "copy_", "fill_"):
        if k == "inplace":
            op, i, j = args
            t, other = pool[i], (None if j is None else pool[j])
            rhs = SCALAR[op] if other is None else o.read(other)
            new = _INPLACE_JNP[op](o.read(t), rhs)
        elif k == "copy_":
            t, other = pool[args[0]], pool[args[1]]
            new = o.read(other)
        else:
            t, other = pool[args[0]], None
            new = jnp.full(t.idx.shape, 0.0 if args[1] == "zero" else 0.5)
        o.write(pool, t, new, tracked(t, other))
        return None
    if k in ("layer_norm", "batch_norm"):
        i, wi, bi = args
        x = pool[i]
        w = None if wi is None else pool[wi]
        b = None if bi is None else pool[bi]
        wv = None if w is None else o.read(w)
        bv = None if b is None else o.read(b)
        if k == "layer_norm":
            y = ref_layer_norm(o.read(x), wv, bv)
        else:
            m, n = x.idx.shape
            wv = jnp.ones(n) if wv is None else wv
            bv = jnp.zeros(n) if bv is None else bv
            y = ref_batch_norm(o.read(x).reshape(m, n, 1, 1), wv, bv, jnp.zeros(n), jnp.ones(n), training=True)[0]
            y = y.reshape(m, n)
        return o.new(y, tracked(x, w, b))
    if k == "inner_grad":
        i, j = args
        x = pool[i]
        c = None if j is None else pool[j]
        cv = 0.5 if c is None else o.read(c)
        g = jax.grad(lambda a: jnp.sum(jnp.tanh(a) * cv))(o.read(x))
        return o.new(g, tracked(x, c))
    if k == "drop":
        pool[args[0]] = None
        return None
    raise AssertionError(k)


def run_oracle(prog: Program) -> tuple[Any, tuple]:
    params, consts, weights = prog.data()

    def f(ps):
        o = Oracle()
        pool: list[OTensor | None] = [
            o.new(ps[0], True),
            o.new(ps[1], True),
            o.new(jnp.asarray(consts[0]), False),
            o.new(jnp.asarray(consts[1]), False),
            o.new(ps[2], True),
            o.new(ps[3], True),
        ]
        for step in prog.steps:
            out = _oracle_step(o, pool, step)
            if step.kind in PRODUCING:
                pool.append(out)
        total = jnp.zeros(())
        for i, w in zip(prog.loss, weights):
            total = total + jnp.sum(o.read(pool[i]) * w)
        return total

    return jax.value_and_grad(f)(tuple(jnp.asarray(p) for p in params))


# ---------------------------------------------------------------------------
# the check
# ---------------------------------------------------------------------------

STATS: collections.Counter = collections.Counter()


def outcome(prog: Program) -> tuple[str, str]:
    """("refused", error name) | ("match", mode) | ("mismatch", details)."""
    with jax.enable_x64(True):
        want_value, want = run_oracle(prog)
        try:
            value, got = run_rf(prog)
        except rf.AutogradError as err:
            return "refused", type(err).__name__
        got = tuple(np.asarray(g) for g in got)
        ok = np.allclose(np.asarray(value), np.asarray(want_value), rtol=1e-9, atol=1e-9) and all(
            g.shape == np.shape(w) and np.allclose(g, np.asarray(w), rtol=1e-8, atol=1e-9) for g, w in zip(got, want)
        )
        if ok:
            return "match", prog.mode
        diff = [float(np.max(np.abs(g - np.asarray(w)))) for g, w in zip(got, want)]
        return "mismatch", f"value {float(value)} vs {float(want_value)}; max |grad diff| per parameter {diff}"


def check(prog: Program) -> None:
    kind, detail = outcome(prog)
    STATS[kind] += 1
    STATS[f"{kind}:{detail if kind != 'mismatch' else prog.mode}"] += 1
    assert kind != "mismatch", f"silent mismatch: {detail}\n{format_program(prog)}"


def format_program(prog: Program) -> str:
    lines = [f"Program(shape={prog.shape}, mode={prog.mode!r}, seed={prog.seed}, loss={prog.loss})"]
    for n, s in enumerate(prog.steps):
        flags = "".join([" no_grad" if s.no_grad else "", " inner_tape" if s.inner_tape else ""])
        lines.append(f"  {n}: {s.kind}{s.args}{flags}")
    return "\n".join(lines)


@st.composite
def programs(draw_fn: Any) -> Program:
    return gen_program(Draw(data=_DataAdapter(draw_fn)))


class _DataAdapter:
    """Lets ``Draw`` use a composite strategy's ``draw``."""

    def __init__(self, draw_fn: Any):
        self.draw = draw_fn


@fuzz(80)
@given(prog=programs())
def test_alias_programs_match_the_oracle_or_raise(prog):
    check(prog)


@pytest.fixture(scope="module")
def report():
    """Prints the outcome counts (run with -s) and appends them as one JSON line
    to ``$RUMUS_FX_FUZZ_REPORT`` when set (one line per xdist worker)."""
    STATS.clear()
    yield STATS
    total = STATS["match"] + STATS["refused"] + STATS["mismatch"]
    if total:
        lines = [f"alias fuzz: {total} programs: {STATS['match']} match, {STATS['refused']} refused, "]
        lines[0] += f"{STATS['mismatch']} silent mismatches"
        lines += [f"  {k}: {v}" for k, v in sorted(STATS.items()) if ":" in k]
        print("\n" + "\n".join(lines))
        path = os.environ.get("RUMUS_FX_FUZZ_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(dict(STATS)) + "\n")


@pytest.mark.fuzz_long
@pytest.mark.parametrize("shard", range(int(os.environ.get("RUMUS_FX_FUZZ_SHARDS", "1"))))
@long_fuzz()
@given(prog=programs())
def test_alias_programs_long(report, shard, prog):
    """``RUMUS_FX_FUZZ_EXAMPLES`` programs per shard (``RUMUS_FX_FUZZ_SHARDS``,
    default 1; run shards in parallel with ``-n``)."""
    check(prog)


# ---------------------------------------------------------------------------
# the oracle and the generator, checked on the six known programs
# ---------------------------------------------------------------------------


def _p(mode: str, steps: list[Step], loss: tuple[int, ...], shape=(2, 2)) -> Program:
    return Program(shape, mode, tuple(steps), loss, 0)


KNOWN = {
    # 1. in-place on a differentiated argument: functional value, as PyTorch's
    #    clone-then-modify (PyTorch itself refuses the leaf write)
    "inplace_on_argument": _p("grad", [Step("unary", ("scale", 0)), Step("inplace", ("add_", 0, None))], (6, 0)),
    # 2. a write through a view of an untracked base reaches the base (PyTorch: ones)
    "view_of_untracked_base": _p("grad", [Step("transpose", (2,)), Step("inplace", ("mul_", 6, 0))], (2,)),
    # 3. the base written after an untracked view was taken (PyTorch: [15.] in its example)
    "base_after_view": _p("grad", [Step("transpose", (2,)), Step("inplace", ("add_", 2, 1))], (6,)),
    # 4. a transform inside an outer no_grad differentiates (torch.func.grad, jax.grad)
    "outer_no_grad": _p("outer_no_grad", [Step("binary", ("mul", 0, 1))], (6,)),
    # 5. backward on a tape that did not record the loss
    "foreign_tape": _p("foreign", [Step("binary", ("mul", 0, 1))], (6,)),
    # 6. layer norm / batch norm of an untracked input: the parameters get gradients
    "layer_norm_untracked_x": _p("grad", [Step("layer_norm", (2, 4, 5))], (6,)),
    "batch_norm_untracked_x": _p("grad", [Step("batch_norm", (2, 4, 5))], (6,)),
    # and the silently detaching rf.tensor(t, dtype=...)
    "cast_of_tracked": _p("grad", [Step("binary", ("mul", 0, 1)), Step("cast", (6,))], (7,)),
}


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_known_programs_match_the_oracle_or_raise(name):
    check(KNOWN[name])


def test_oracle_gives_pytorchs_values_on_the_known_programs():
    with jax.enable_x64(True):
        # base written after a view: d/dr of sum(3 * (1 + r)) over the [5, 1] example is 15;
        # here every element of P1 is added once into C0 and read back with its weight
        prog = KNOWN["base_after_view"]
        _, grads = run_oracle(prog)
        weight = prog.data()[2][0]
        np.testing.assert_allclose(grads[1], weight.T)
        # a write through the transpose of an untracked base: d sum(w * C0^T * P0) / dP0
        prog = KNOWN["view_of_untracked_base"]
        _, grads = run_oracle(prog)
        consts, weight = prog.data()[1][0], prog.data()[2][0]
        np.testing.assert_allclose(grads[0], (weight * consts).T)
        # in-place on an argument: y = 0.5 * P0 saved before P0 += 0.5: loss weights both
        prog = KNOWN["inplace_on_argument"]
        _, grads = run_oracle(prog)
        w_y, w_p = prog.data()[2]
        np.testing.assert_allclose(grads[0], 0.5 * w_y + w_p)


def test_generator_reaches_every_feature():
    """The deterministic programs of a fixed seed range exercise every step kind,
    flag and mode, and the constellations behind the six known programs."""
    seen: collections.Counter = collections.Counter()
    for seed in range(400):
        prog = gen_program(Draw(rng=np.random.default_rng(seed)))
        seen[prog.mode] += 1
        for s in prog.steps:
            seen[s.kind] += 1
            seen["no_grad"] += s.no_grad
            seen["inner_tape"] += s.inner_tape
            if s.kind == "inplace" and s.args[1] in PARAMS:
                seen["inplace_on_param"] += 1
            if s.kind in ("layer_norm", "batch_norm") and s.args[0] in (2, 3):
                seen["norm_of_constant"] += 1
    for name in [*KINDS, *MODES, "no_grad", "inner_tape", "inplace_on_param", "norm_of_constant"]:
        assert seen[name] > 0, name


def main(argv: Sequence[str]) -> None:
    """``python -m tests.test_alias_fuzz COUNT [FIRST_SEED]``: the long profile
    with numpy-drawn programs (seeds FIRST_SEED...), printing the outcome counts
    every 500 programs, so that a run cut short still reports what it checked."""
    count, first = int(argv[0]), int(argv[1]) if len(argv) > 1 else 0
    for n, seed in enumerate(range(first, first + count), 1):
        check(gen_program(Draw(rng=np.random.default_rng(seed))))
        if n % 500 == 0 or n == count:
            print(json.dumps({"programs": n, "first_seed": first, **STATS}), flush=True)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
