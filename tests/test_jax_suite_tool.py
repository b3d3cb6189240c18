"""``tools/jax_suite``: jax-style test files run with every gradient also taken on
rf's tape. A small test file stands in for jax's: a gradient both agree on, a
``jtu.check_grads`` call, a vjp, a program rf refuses, one where jax itself fails and
a gradient taken under ``jax.jit`` (not probed: its values are traced)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

TOOL = pathlib.Path(__file__).resolve().parents[1] / "tools" / "jax_suite"

FAKE_TEST = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax._src import test_util as jtu


    def test_agree():
        # the replacements keep jax's docstrings and names (scico copies them at import)
        assert "gradient" in jax.grad.__doc__ and "gradient" in jax.value_and_grad.__doc__ and jax.vjp.__doc__
        assert jax.grad(test_refused).__name__ == "test_refused"
        assert jax.grad(lambda x: jnp.sum(jnp.sin(x) * x))(jnp.arange(3.0)).shape == (3,)
        jtu.check_grads(lambda x, y: jnp.tanh(x) * y, (jnp.ones(2), jnp.arange(2.0)), order=1)
        out, vjp = jax.vjp(lambda x: x ** 3, jnp.arange(4.0))
        vjp(jnp.ones(4))
        # every option by name, as jaxlie's manifold gradients pass them
        jax.value_and_grad(fun=lambda x: jnp.sum(x ** 2), argnums=0, has_aux=False, holomorphic=False,
                           allow_int=False, reduce_axes=())(jnp.ones(2))


    def test_refused():
        # complex max: rf refuses, jax differentiates
        jax.grad(lambda z: jnp.real(jnp.max(z * (1 + 2j))))(jnp.arange(3.0) + 0j)


    def test_jax_fails():
        jtu.check_grads(lambda x: lax.while_loop(lambda c: c < 3.0, lambda c: c + x, 0.0), (1.0,), order=1)


    def test_under_jit():
        jax.jit(jax.grad(lambda x: jnp.sum(x ** 2)))(jnp.ones(2))
    """
)


def _probe(tmp_path, name: str, text: str, **env: str):
    """Run the tool on one test file ``name`` holding ``text``: (the run, its log's rows, the log)."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / name).write_text(text)
    out = tmp_path / "out"
    run = subprocess.run(
        ["bash", str(TOOL / "run.sh"), str(tests), str(out), name],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    log = out / name.replace(".py", ".jsonl")
    return run, [json.loads(line) for line in log.read_text().splitlines()], log


def test_probe_logs_each_gradient_and_summarizes(tmp_path):
    run, rows, log = _probe(tmp_path, "fake_test.py", FAKE_TEST)
    by_test = {}
    for r in rows:
        by_test.setdefault(r["test"].rsplit("::", 1)[-1], []).append(r["status"])
    assert by_test.pop("test_agree") == ["ok", "ok", "ok", "ok"], rows
    assert by_test.pop("test_refused") == ["AutogradError"], rows
    assert by_test.pop("test_jax_fails") == ["jaxfail"], rows
    assert not by_test, by_test  # nothing probed under jax.jit
    # the summary: the counts, then one line per outcome that is not ok
    assert "'ok': 4" in run.stdout and "AutogradError" in run.stdout and "jaxfail" in run.stdout, run.stdout
    summary = subprocess.run([sys.executable, str(TOOL / "summarize.py"), str(log)], capture_output=True, text=True)
    assert summary.returncode == 0 and summary.stdout.count("\n") == 3, summary.stdout


TRACED_TEST = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.extend.core import Primitive
    from jax.interpreters import ad, mlir

    import rumus_fx as rf

    # a primitive whose rf rule is wrong on purpose (3x where its JVP says 2x)
    twice = Primitive("twice_probe_test")
    twice.def_impl(lambda x: 2 * x)
    twice.def_abstract_eval(lambda x: x)
    mlir.register_lowering(twice, mlir.lower_fun(lambda x: 2 * x, multiple_results=False))
    ad.defjvp(twice, lambda t, x: 2 * t)
    rf.defrule(twice, lambda r, g: (3 * g,), saves=((), ()))


    def test_under_jit():
        jax.jit(jax.grad(lambda x: jnp.sum(x ** 2)))(jnp.ones(2))


    def test_vmap_and_scan():
        jax.vmap(jax.grad(lambda x: jnp.sin(x) * x))(jnp.arange(2.0))
        lax.scan(lambda c, x: (c + jax.grad(lambda y: y ** 3)(x), None), 0.0, jnp.arange(3.0))


    def test_vjp_under_jit():
        @jax.jit
        def f(x):
            y, pull = jax.vjp(jnp.tanh, x)
            return pull(jnp.ones_like(y))

        f(jnp.ones(3))


    def test_wrong_rule_under_jit():
        jax.jit(jax.grad(lambda x: jnp.sum(twice.bind(x))))(jnp.ones(2))
    """
)


def test_probe_compares_gradients_taken_inside_traces(tmp_path):
    """PROBE_TRACED=1: a gradient taken under jax.jit, vmap or scan is traced on
    the tape beside jax's and compared when the program runs, once per example
    under vmap and once per iteration in a loop; a wrong rule shows as MISMATCH."""
    _, rows, _ = _probe(tmp_path, "traced_test.py", TRACED_TEST, PROBE_TRACED="1")
    by_test = {}
    for r in rows:
        by_test.setdefault(r["test"].rsplit("::", 1)[-1], []).append((r["kind"], r["status"]))
    assert by_test.pop("test_under_jit") == [("traced:grad", "ok")], rows
    assert by_test.pop("test_vmap_and_scan") == [("traced:grad", "ok")] * 5, rows
    assert by_test.pop("test_vjp_under_jit") == [("traced:vjp", "ok")], rows
    assert by_test.pop("test_wrong_rule_under_jit") == [("traced:grad", "MISMATCH")], rows
    assert not by_test, by_test


STATEFUL_TEST = textwrap.dedent(
    """
    import collections

    import jax
    import jax.numpy as jnp


    class PopsOnEachCall:
        # like flax nnx's GradFn: each call takes its state from a queue
        def __init__(self):
            self.states = collections.deque([3.0])

        def __call__(self, x):
            return jnp.sum(x * self.states.popleft())


    def test_queue():
        jax.grad(PopsOnEachCall())(jnp.ones(2))


    def test_typed_literal_aux():
        # jax hands the differentiated Python float back as its typed float literal (float32)
        jax.grad(lambda x: (x * 2.0, x), has_aux=True)(1.0)
    """
)


def test_probe_refills_a_callables_queue_and_keeps_typed_literals_dtype(tmp_path):
    """A callable that consumes a queue on each call (flax nnx's ``GradFn``) gets
    back what jax's call consumed before rf's call (it crashed: "pop from an empty
    deque"), and jax's typed float literals compare by their own dtype (a float32 one
    read as float64 was a MISMATCH: "dtype float32 vs float64")."""
    _, rows, _ = _probe(tmp_path, "stateful_test.py", STATEFUL_TEST)
    by_test = {r["test"].rsplit("::", 1)[-1]: r["status"] for r in rows}
    assert by_test == {"test_queue": "ok", "test_typed_literal_aux": "ok"}, rows
