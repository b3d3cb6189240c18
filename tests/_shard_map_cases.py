"""``jax.shard_map`` and its collectives on the tape, run in a subprocess with 8
host CPU devices (see tests/lift/test_shard_map.py):
``python -m tests._shard_map_cases [CASE ...]``.

Every case is a scalar loss of plain jax code around one ``jax.shard_map`` on a
2x4 ("data", "model") mesh, its arguments and a ``PartitionSpec`` per argument.
Each case runs on a mesh with Auto axes and one with Explicit axes, each argument
alone and all together, eagerly and under ``jax.jit``, in float64, and checks
``rf.grad(rf.lift(loss))``

* against ``jax.grad(loss)`` (to 1e-10), except where jax.grad itself fails on
  that program: there against finite differences alone, and only where the case
  declares it (``jax_fails``, with jax's error; an undeclared failure of jax.grad
  fails the case);
* against float64 central differences along a random direction per argument;
* and that each gradient has its argument's sharding (Explicit mesh).

The same bodies run with ``check_vma=True`` (jax's default: the body's types
say which values vary across devices) and ``check_vma=False`` (the
transposition divides and sums, Note [shard_map on the tape] in
rumus_fx/lift/rules_parallel.py). One case also checks second order
(``jax.jvp`` over ``rf.grad``), one ``jax.pmap``, and one float32 under ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import rumus_fx as rf

D, M = "data", "model"
RNG = np.random.default_rng(0)


def arr(*shape: int, scale: float = 1.0) -> np.ndarray:
    return RNG.standard_normal(shape) * scale


@dataclasses.dataclass
class Case:
    name: str
    make: Callable[[Any, bool], Callable[..., Any]]  # (mesh, check_vma) -> loss
    args: tuple[np.ndarray, ...]
    specs: tuple[P, ...]
    checks: tuple[bool, ...] = (True, False)
    jax_fails: tuple[tuple[bool, str], ...] = ()  # (check_vma, mesh kind) where jax.grad raises


EVERYWHERE = tuple((c, k) for c in (True, False) for k in ("Auto", "Explicit"))


def _smap(mesh: Any, check: bool, in_specs: Any, out_specs: Any, **kw: Any) -> Callable:
    return lambda body: jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check, **kw)


def cases() -> list[Case]:
    out = []

    def psum(mesh, check):  # data parallel: replicated weight, batch over both axes
        def body(w, x):
            return lax.psum(jnp.sum(jnp.tanh(x @ w) ** 2), (D, M))

        return lambda w, x: _smap(mesh, check, (P(), P((D, M))), P())(body)(w, x)

    out.append(Case("psum", psum, (arr(3, 2), arr(16, 3)), (P(), P((D, M)))))

    def megatron(mesh, check):  # column- then row-parallel MLP, psum over "model"
        def body(w1, w2, x):
            return jnp.sin(lax.psum(jax.nn.gelu(x @ w1) @ w2, M))

        def loss(w1, w2, x):
            return jnp.sum(_smap(mesh, check, (P(None, M), P(M, None), P(D)), P(D))(body)(w1, w2, x) ** 2)

        return loss

    out.append(Case("megatron", megatron, (arr(3, 8), arr(8, 3), arr(4, 3)), (P(None, M), P(M, None), P(D))))

    def fsdp(mesh, check):  # weights sharded, gathered where used
        def body(w, x):
            return jnp.tanh(x @ lax.all_gather(w, M, axis=0, tiled=True))

        return lambda w, x: jnp.sum(_smap(mesh, check, (P(M), P(D)), P((D, M)))(body)(w, x) ** 2)

    out.append(Case("all_gather", fsdp, (arr(8, 3), arr(4, 8)), (P(M), P(D))))

    def gather_untiled(mesh, check):
        def body(w, x):
            return jnp.cos(x) * jnp.sum(lax.all_gather(w, M, axis=0) ** 2, axis=(0, 1))[None]

        return lambda w, x: jnp.sum(_smap(mesh, check, (P(M), P(D)), P(D))(body)(w, x) ** 2)

    out.append(Case("all_gather_untiled", gather_untiled, (arr(4, 3), arr(4, 3)), (P(M), P(D)), checks=(False,)))

    def gather_invariant(mesh, check):  # every device holds the whole gathered weight
        def body(w, x):
            wf = lax.all_gather(w, M, axis=1, tiled=True, to="invarying")
            return jnp.cos(x) @ wf**2 + jnp.sum(lax.all_gather(w, M, axis=0, to="invarying") ** 3)

        return lambda w, x: jnp.sum(_smap(mesh, check, (P(None, M), P(D)), P(D))(body)(w, x) ** 2)

    out.append(
        Case("all_gather_invariant", gather_invariant, (arr(3, 4), arr(4, 3)), (P(None, M), P(D)), checks=(True,))
    )

    def scatter(mesh, check):  # reduce-scatter of a partial product
        def body(w, x):
            return jnp.sin(lax.psum_scatter(x @ w, M, scatter_dimension=1, tiled=True))

        return lambda w, x: jnp.sum(_smap(mesh, check, (P(), P(D)), P(D, M))(body)(w, x) ** 3)

    out.append(Case("psum_scatter", scatter, (arr(3, 8), arr(4, 3)), (P(), P(D))))

    def ring(mesh, check):  # a one-step shift around the "model" ring
        n = mesh.shape[M]

        def body(w, x):
            shifted = lax.ppermute(jnp.tanh(x * w), M, perm=[(i, (i + 1) % n) for i in range(n)])
            return shifted * x

        return lambda w, x: jnp.sum(_smap(mesh, check, (P(M), P(M)), P(M))(body)(w, x) ** 2)

    out.append(Case("ppermute", ring, (arr(8, 3), arr(8, 3)), (P(M), P(M))))

    def a2a(mesh, check):
        def body(w, x):
            return lax.all_to_all(jnp.sin(x * w), M, split_axis=1, concat_axis=0, tiled=True) ** 2

        def loss(w, x):
            y = _smap(mesh, check, (P(M), P(M)), P(None, M))(body)(w, x)
            return jnp.sum(y * jnp.arange(y.size, dtype=y.dtype).reshape(y.shape))

        return loss

    out.append(Case("all_to_all", a2a, (arr(8, 4), arr(8, 4)), (P(M), P(M))))

    def a2a_untiled(mesh, check):
        def body(x):
            return lax.all_to_all(jnp.sin(x), M, split_axis=0, concat_axis=1, tiled=False)

        def loss(x):
            y = _smap(mesh, check, P(None, M), P(None, M))(body)(x)
            return jnp.sum(y * jnp.arange(y.size, dtype=y.dtype).reshape(y.shape))

        return loss

    # jax.grad: "Expected cotangent type float64[4,2,1] but got float64[4,1,2]"
    out.append(Case("all_to_all_untiled", a2a_untiled, (arr(4, 8),), (P(None, M),), jax_fails=EVERYWHERE))

    def pmean_index(mesh, check):  # axis_index (not differentiable) scales each device's part
        def body(w, x):
            scale = (lax.axis_index(M) + 1).astype(x.dtype)
            return lax.pmean(jnp.mean(jnp.tanh(x @ w) ** 2) * scale, (D, M))

        return lambda w, x: _smap(mesh, check, (P(), P((D, M))), P())(body)(w, x)

    out.append(Case("pmean_axis_index", pmean_index, (arr(3, 2), arr(16, 3)), (P(), P((D, M)))))

    def scan_body(mesh, check):  # a scan inside the body, "data" manual, "model" left to the partitioner
        def body(w, x):
            def step(h, xi):
                h = jnp.tanh(h @ w + xi)
                return h, jnp.sum(h)

            h, ys = lax.scan(step, jnp.zeros_like(x[0]), x)
            return lax.psum(jnp.sum(h**2) + jnp.sum(ys), D)

        return lambda w, x: _smap(mesh, check, (P(), P(None, D)), P(), axis_names={D})(body)(w, x)

    out.append(Case("scan_partial_manual", scan_body, (arr(3, 3, scale=0.5), arr(5, 4, 3)), (P(), P(None, D))))

    def custom_rules(mesh, check):  # jax.custom_jvp functions in the body (relu, logsumexp, softmax)
        def body(w, x):
            h = jax.nn.relu(x @ w)
            z = jax.nn.logsumexp(h, axis=1) + jnp.sum(jax.nn.softmax(h, axis=1) * h, axis=1)
            return lax.pmean(jnp.mean(z), (D, M))

        return lambda w, x: _smap(mesh, check, (P(), P((D, M))), P())(body)(w, x)

    out.append(Case("custom_jvp_in_body", custom_rules, (arr(3, 4), arr(16, 3)), (P(), P((D, M)))))

    def unused(mesh, check):  # primitives with several outputs, some unused (zero cotangents)
        def body(w, x):
            a, _, c = jnp.split(jnp.tanh(x @ w), 3, axis=1)
            keys, vals = lax.sort((a[:, 0], c[:, 0] * 2.0), num_keys=1)
            _, vecs = jnp.linalg.eigh(x.T @ x)
            return lax.psum(jnp.sum(vals**2) + jnp.sum(vecs[:, -1] ** 4), (D, M))

        return lambda w, x: _smap(mesh, check, (P(), P((D, M))), P())(body)(w, x)

    out.append(Case("unused_outputs", unused, (arr(3, 6), arr(16, 3)), (P(), P((D, M)))))

    def control(mesh, check):  # lax.cond, a custom_vjp function and fori_loop in the body
        @jax.custom_vjp
        def square(x):
            return x**2

        square.defvjp(lambda x: (x**2, x), lambda x, g: (2.0 * x * g,))

        def body(w, x):
            h = jnp.tanh(x @ w)
            h = lax.cond(jnp.sum(x) > 0, lambda h: jnp.sin(h) * 2.0, lambda h: h**3, h)
            # the branches' gradients for x vary over the devices in one branch and are zeros in the other
            h = lax.cond(jnp.sum(w) > 0, lambda h, x: h * x, lambda h, x: h * 2.0, h, x)
            h = lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w.T @ w), h)
            return lax.psum(jnp.sum(square(h)), (D, M))

        return lambda w, x: _smap(mesh, check, (P(), P((D, M))), P())(body)(w, x)

    out.append(Case("control_in_body", control, (arr(3, 3, scale=0.5), arr(16, 3)), (P(), P((D, M)))))

    def scan_varying(mesh, check):  # a scan whose constant varies and whose final carry is unused
        def body(w, x):
            c = jnp.sin(x[0])  # varies over "data" and "model"

            def step(h, xi):
                h = jnp.tanh(h * c + xi @ w)
                return h, jnp.sum(h**2)

            _, ys = lax.scan(step, jnp.zeros_like(x[0]), x)
            return lax.psum(jnp.sum(ys), (D, M))

        return lambda w, x: _smap(mesh, check, (P(), P(None, (D, M))), P())(body)(w, x)

    out.append(
        Case("scan_varying_constant", scan_varying, (arr(3, 3, scale=0.5), arr(5, 16, 3)), (P(), P(None, (D, M))))
    )

    def spectral(mesh, check):  # complex values through the collectives: a sharded FFT-like mix
        n = mesh.shape[M]

        def body(w, x):
            z = jnp.fft.fft(x * w, axis=1)  # complex, varies over both axes
            z = lax.all_to_all(z, M, split_axis=1, concat_axis=0, tiled=True)
            z = lax.ppermute(z, M, perm=[(i, (i + 1) % n) for i in range(n)]) * (1 - 0.5j)
            z = lax.psum_scatter(lax.all_gather(z, D, axis=0, tiled=True), D, scatter_dimension=0, tiled=True)
            return lax.psum(jnp.sum(jnp.abs(z) ** 2 + jnp.real(z) * jnp.imag(z)), (D, M))

        return lambda w, x: _smap(mesh, check, (P(M), P((D, M))), P())(body)(w, x)

    out.append(Case("complex_intermediates", spectral, (arr(16, 8), arr(32, 8)), (P(M), P((D, M)))))

    def several(mesh, check):  # several outputs, one of them integer
        def body(w, x):
            y = x * w[None]
            return jnp.sin(y), lax.psum(jnp.sum(y), M), jnp.argmax(y, axis=1)

        def loss(w, x):
            a, b, c = _smap(mesh, check, (P(), P(M)), (P(M), P(), P(M)))(body)(w, x)
            return jnp.sum(a**2) * b + jnp.sum(c).astype(a.dtype)

        return loss

    out.append(Case("several_outputs", several, (arr(3), arr(8, 3)), (P(), P(M))))

    def remat(mesh, check):  # jax.checkpoint inside the body
        def body(w, x):
            y = jax.checkpoint(lambda w, x: jnp.sin(x @ w) ** 2)(w, x)
            return lax.psum(jnp.sum(y), (D, M))

        return lambda w, x: _smap(mesh, check, (P(), P((D, M))), P())(body)(w, x)

    out.append(Case("checkpoint_in_body", remat, (arr(3, 2), arr(16, 3)), (P(), P((D, M)))))

    def nested(mesh, check):  # "data" manual outside, "model" inside
        def inner(w, x):
            return lax.psum(jnp.sum(jnp.tanh(x @ w) ** 2), M)

        def outer(w, x):
            here = jax.sharding.get_abstract_mesh()
            s = _smap(here, check, (P(), P(None, M)), P(), axis_names={M})(inner)(w, x)
            return lax.psum(s, D)

        return lambda w, x: _smap(mesh, check, (P(), P(D)), P(), axis_names={D})(outer)(w, x)

    # jax.grad with check_vma=True: "'sdy.manual_computation' op operand 1 - operates on axis "data" which is
    # already bound by a parent sdy.manual_computation op" (its lowering fails)
    # and with check_vma=False on Explicit axes: "Expected cotangent type float64[2,8,3] but got
    # float64[2,8@model,3]"
    fails = ((True, "Auto"), (True, "Explicit"), (False, "Explicit"))
    out.append(Case("nested", nested, (arr(3, 2), arr(4, 8, 3)), (P(), P(D)), jax_fails=fails))

    def around(mesh, check):  # jnp before and after, a jit inside the body, an unused input
        def body(w, b, x, unused):
            return jax.jit(lambda h: jnp.tanh(h @ w + b[None]))(x) * 2.0

        def loss(w, b, x):
            y = _smap(mesh, check, (P(), P(), P(D), P()), P(D))(body)(w * 1.5, b, jnp.exp(x), jnp.ones(3))
            return jnp.sum(jnp.sin(y))

        return loss

    out.append(Case("around_and_inside", around, (arr(3, 4), arr(4), arr(8, 3, scale=0.3)), (P(), P(), P(D))))
    return out


def _mesh(kind: AxisType) -> Any:
    return jax.make_mesh((2, 4), (D, M), axis_types=(kind, kind))


def _close(got: Any, want: Any, tol: float, what: str) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol, err_msg=what)


def _fd(loss: Callable, args: tuple, grads: tuple, what: str, positions: tuple[int, ...]) -> None:
    """``<grad, d>`` against central differences of ``loss`` along ``d``, for the
    arguments at ``positions``, whose gradients ``grads`` are."""
    rng = np.random.default_rng(1)
    eps = 1e-6
    for k, g in zip(positions, grads, strict=True):
        d = rng.standard_normal(np.shape(args[k]))
        plus, minus = list(args), list(args)
        sh = args[k].sharding if isinstance(args[k].sharding, NamedSharding) else None  # else uncommitted
        plus[k] = jax.device_put(np.asarray(args[k]) + eps * d, sh)
        minus[k] = jax.device_put(np.asarray(args[k]) - eps * d, sh)
        fd = (float(jax.jit(loss)(*plus)) - float(jax.jit(loss)(*minus))) / (2 * eps)
        got = float(np.sum(np.asarray(g) * d))
        assert abs(fd - got) <= 1e-6 * max(1.0, abs(fd)), f"{what}: argument {k}: {got} != finite difference {fd}"


KINDS = (AxisType.Auto, AxisType.Explicit)
# the -m slow run: every case on both axis types, each argument alone in every setting
EVERY_SETTING = bool(os.environ.get("SHARD_MAP_EVERY_SUBSET"))


def run_case(case: Case, kind: AxisType, kinds: tuple[AxisType, ...] = KINDS) -> None:
    """On ``kind``, all arguments together in every ``check_vma`` setting; each
    argument alone in one of the (axis type, ``check_vma``) settings of the case's
    ``kinds``, taken in turn from one argument to the next (in all of them with
    ``SHARD_MAP_EVERY_SUBSET=1``, the ``-m slow`` run)."""
    mesh = _mesh(kind)
    settings = [(k, c) for k in kinds for c in case.checks]
    for check in case.checks:
        loss = case.make(mesh, check)
        args = tuple(jax.device_put(jnp.asarray(a), NamedSharding(mesh, s)) for a, s in zip(case.args, case.specs))
        n = len(args)
        what = f"{case.name} check_vma={check} {kind.name}"
        alone = [(i,) for i in range(n) if EVERY_SETTING or settings[i % len(settings)] == (kind, check)]
        subsets = [tuple(range(n))] + (alone if n > 1 else [])
        for sub in subsets:
            got = rf.grad(rf.lift(loss), argnums=sub)(*args)
            got_jit = jax.jit(rf.grad(rf.lift(loss), argnums=sub))(*args)
            _close(got_jit, got, 1e-12, f"{what} {sub}: jit against eager")
            with_fd = sub == subsets[0]  # and every subset jax.grad cannot differentiate
            try:
                want = jax.jit(jax.grad(loss, argnums=sub))(*args)
            except Exception:
                # jax.grad cannot differentiate this program: finite differences alone
                assert (check, kind.name) in case.jax_fails, f"{what} {sub}: jax.grad raises"
                with_fd = True
            else:  # (a jax that has learnt a program declared in jax_fails is compared with too)
                _close(got, want, 1e-10, f"{what} {sub}")
            if kind == AxisType.Explicit:
                for i, g in zip(sub, got):
                    assert g.sharding.is_equivalent_to(args[i].sharding, g.ndim), (
                        what,
                        sub,
                        i,
                        g.sharding,
                        args[i].sharding,
                    )
            if with_fd:
                _fd(loss, args, got, f"{what} {sub}", sub)


def second_order() -> None:
    """``jax.jvp`` over ``rf.grad`` and ``rf.grad`` over ``rf.grad``: Hessian-vector
    products through a shard_map with a psum and an all_gather. The products under
    ``jax.jit`` (eagerly, jax's jvp runs a shard_map's program op by op: 3 s for one
    product here); rf.grad over rf.grad eagerly and under ``jax.jit``."""
    mesh = _mesh(AxisType.Auto)
    for check in (True, False):

        def loss(w, x, check=check):
            def body(w, x):
                h = jnp.tanh(x @ lax.all_gather(w, M, axis=0, tiled=True))
                return lax.psum(jnp.sum(h**2), (D, M))

            return _smap(mesh, check, (P(M), P((D, M))), P())(body)(w, x)

        w, x, v = jnp.asarray(arr(8, 3)), jnp.asarray(arr(16, 8)), jnp.asarray(arr(8, 3))
        want = jax.jit(lambda w, x, v: jax.jvp(jax.grad(loss), (w, x), (v, jnp.zeros_like(x)))[1])(w, x, v)
        got = jax.jit(lambda w, x, v: jax.jvp(rf.grad(rf.lift(loss)), (w, x), (v, jnp.zeros_like(x)))[1])(w, x, v)
        _close(got, want, 1e-10, f"jvp over rf.grad, check_vma={check}")
        rr_loss = rf.lift(lambda w, x, v=v: jnp.sum(rf.grad(rf.lift(loss))(w, x) * v))
        _close(rf.grad(rr_loss)(w, x), want, 1e-10, f"rf.grad over rf.grad, check_vma={check}")
        _close(jax.jit(rf.grad(rr_loss))(w, x), want, 1e-10, f"rf.grad over rf.grad under jit, check_vma={check}")


def pmap() -> None:
    """``jax.pmap`` (which jax now traces as a ``shard_map``) with a ``psum``."""

    def loss(w, x):
        per_device = jax.pmap(
            lambda w, x: lax.psum(jnp.sum(jnp.tanh(x @ w) ** 2), "i"), axis_name="i", in_axes=(None, 0)
        )
        return per_device(w, x)[0]

    w, x = jnp.asarray(arr(3, 2)), jnp.asarray(arr(8, 2, 3))
    got = rf.grad(rf.lift(loss), argnums=(0, 1))(w, x)
    _close(got, rf.testing.jax_oracle_grad(loss, (w, x), (0, 1)), 1e-10, "pmap")
    _fd(loss, (w, x), got, "pmap", (0, 1))


def float32_jit() -> None:
    mesh = _mesh(AxisType.Explicit)
    case = cases()[1]  # megatron
    loss = case.make(mesh, True)
    args = tuple(
        jax.device_put(jnp.asarray(a, jnp.float32), NamedSharding(mesh, s)) for a, s in zip(case.args, case.specs)
    )
    got = jax.jit(rf.grad(rf.lift(loss), argnums=(0, 1, 2)))(*args)
    _close(got, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args), 2e-5, "float32 jit")


def main(names: list[str]) -> int:
    """Run the cases and checks named (all by default); ``--part=K/N`` runs every
    N-th of them from the K-th (so N processes share the work)."""
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_numpy_rank_promotion", "raise")
    part, parts = 0, 1
    if names and names[0].startswith("--part="):
        part, parts = (int(v) for v in names[0].removeprefix("--part=").split("/"))
        names = names[1:]
    checks = (second_order, pmap, float32_jit)
    all_names = [c.name for c in cases()] + [c.__name__ for c in checks]
    mine = {n for i, n in enumerate(all_names) if i % parts == part}
    names = [n for n in (names or all_names) if n in mine]
    failures = []
    for index, case in enumerate(cases()):
        if case.name not in names:
            continue
        # one axis type per case, in turn from case to case (both with -m slow)
        kinds = KINDS if EVERY_SETTING else (KINDS[index % len(KINDS)],)
        for kind in kinds:
            try:
                run_case(case, kind, kinds)
            except Exception:
                failures.append(f"{case.name} {kind.name}:\n{traceback.format_exc()}")
    for check in checks:
        if check.__name__ not in names:
            continue
        try:
            with jax.enable_x64(check is not float32_jit):
                check()
        except Exception:
            failures.append(f"{check.__name__}:\n{traceback.format_exc()}")
    for f in failures:
        print("FAILED", f)
    print("FAILED" if failures else "OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
