"""rf's gradient against jax.grad at special values: every function of jax.numpy,
jax.nn, jax.lax, jax.scipy.special and jax.scipy.stats that takes one or two float
arrays (the sweep of ``tests/lift/test_namespaces.py``), at 0, -0, +-1, +-0.5, 2,
+-inf, nan, +-1e-300, +-1e300, 710 and -745 (every pair of them for two arguments),
the nan pattern included; with ``--values ties``, at equal values instead (``TIES``
and every pair of ``TIE_PAIRS``: where a max, sort, median or clip must choose).

    python tools/special_values.py [--dtype float64|float32] [--values special|ties]
                                   [--mode eager|jit|complex|second|complex-second]
                                   [--only SUBSTRING] [--skip NAME,PREFIX*,...]

``complex`` takes complex operands (real and imaginary parts from the same values)
and a loss weighing both parts of the output; ``second`` differentiates
``sum(jax.grad(f))`` (rf's rules run on jax's own backward program), and
``complex-second`` both (the real part of the gradient plus half its imaginary
part). A line ``DIFF name argK: ...`` is printed where rf's gradient differs, at
some element, from both jax.grad run eagerly and jax.grad under ``jax.jit`` (XLA's
fusions alone change results at such values, so one of the two can differ from the
other: complex ``sqrt``'s second derivative near 0 has the wrong sign eagerly, the
right one under jit); ``ERR`` where rf raised and
jax did not. Known differences are listed in docs/testing.md ("What still differs").
Some of jax's own functions never return at such values (``igamma`` at infinite
arguments, ``exp1`` at 1e-300 beside another value, complex ``loggamma`` at infinite
ones): the default ``--skip`` leaves them out.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np

SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, np.inf, -np.inf, np.nan, 1e-300, -1e-300, 1e300, -1e300, 710.0, -745.0]
# --values ties: equal values (reductions, sorts and extremes choosing among them),
# zeros of both signs and kinks, no infinity or nan to hide them
TIES = [[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, -0.0, -1.0, 5.0], [-1.0, -1.0, 0.5, 0.5]]
TIE_PAIRS = [-1.0, -0.0, 0.0, 0.5, 1.0, 2.0]  # every pair, equal ones included
COMPLEX_PARTS = [0.0, -0.0, 1.0, -1.0, 0.5, 2.0, np.inf, -np.inf, np.nan, 1e300, 1e-300, -3.0]
# jax's own functions that do not return at these values (checked with jax 0.10.2)
NEVER_RETURN = (
    "jax.lax.igamma,jax.lax.igammac,jax.lax.random_gamma_grad,jax.scipy.special.gammainc,"
    "jax.scipy.special.gammaincc,jax.scipy.special.exp1,jax.scipy.special.expn,jax.scipy.special.expi,"
    "jax.scipy.special.logit,jax.scipy.stats.chi2*,jax.scipy.stats.gamma*,jax.scipy.stats.poisson*,"
    "jax.scipy.stats.logistic*,jax.scipy.stats.wrapcauchy*"
)
# and with complex operands (the complex modes' default adds them): ``loggamma``'s
# complex while loop never ends at infinite or huge values (jax's forward itself)
NEVER_RETURN_COMPLEX = "jax.scipy.special.loggamma"


def operands(arity: int, dtype, mode: str, values: str = "special") -> tuple[np.ndarray, ...]:
    """The special values as one [4, 4] operand, or every pair of them as two
    (``values="ties"``: ``TIES`` as one, every pair of ``TIE_PAIRS`` as two)."""
    with np.errstate(all="ignore"), warnings.catch_warnings():  # 1e300 is inf in float32
        warnings.simplefilter("ignore")
        return _operands(arity, dtype, mode, values)


def _pairs(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every pair of the values ``v`` as two square operands."""
    n = len(v)
    return np.repeat(v, n).reshape(n, n), np.tile(v, n).reshape(n, n)


def _operands(arity, dtype, mode, values_set="special"):
    complex_dtype = np.result_type(dtype, np.complex64)
    if values_set == "ties":
        ops = (np.array(TIES, dtype),) if arity == 1 else _pairs(np.array(TIE_PAIRS, dtype))
        if mode.startswith("complex"):
            ops = tuple(o.astype(complex_dtype) * (1 + 0.5j) for o in ops)
        return ops
    if mode.startswith("complex"):
        parts = np.array(COMPLEX_PARTS, dtype)
        z = (parts[:, None] + 1j * parts[None, :]).astype(complex_dtype)
        return (z,) if arity == 1 else _pairs(z.ravel()[::5])
    values = np.array(SPECIAL, dtype)
    return (values.reshape(4, 4),) if arity == 1 else _pairs(values)


def differences(got, wants, dtype) -> str | None:
    """Where a gradient differs from every one of ``wants`` (nan against a number, or
    numbers not close), element by element: rf agreeing with jax.grad run eagerly at
    one element and under jit at another differs from neither."""
    got = np.asarray(got)
    bad = np.ones(got.shape, bool)
    for want in map(np.asarray, wants):
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"shape/dtype {got.shape} {got.dtype} against {want.shape} {want.dtype}"
        got_nan, want_nan = np.isnan(got), np.isnan(want)
        tol = 1e-5 if np.finfo(dtype).bits == 32 else 1e-9
        with np.errstate(all="ignore"):
            close = np.isclose(got, want, rtol=tol, atol=tol) | (got == want)
        bad &= (got_nan != want_nan) | (~got_nan & ~want_nan & ~close)
    if not bad.any():
        return None
    at = [tuple(int(i) for i in ix) for ix in np.argwhere(bad)[:4]]
    want = np.asarray(wants[0])
    return f"{int(bad.sum())} differ, e.g. " + "; ".join(f"{ix} rf={got[ix]} jax={want[ix]}" for ix in at)


def _real(out):
    """A real loss of a real or complex array: its sum, or the real part's sum plus
    half the imaginary part's."""
    if jnp.iscomplexobj(out):
        return jnp.sum(jnp.real(out)) + 0.5 * jnp.sum(jnp.imag(out))
    return jnp.sum(out)


def compare(fn, arity: int, dtype=np.float64, mode: str = "eager", values: str = "special") -> list[str]:
    """The lines this sweep prints for one function (none where rf agrees)."""
    with np.errstate(all="ignore"), warnings.catch_warnings():  # the values warn by design
        warnings.simplefilter("ignore")
        return _compare(fn, arity, dtype, mode, values)


def _compare(fn, arity, dtype, mode, values):
    import rumus_fx as rf

    def loss(*a):
        with jax.numpy_rank_promotion("allow"):
            out = jax.tree.leaves(fn(*a))[0]
        return _real(out)

    nums = tuple(range(arity))
    if mode.endswith("second"):
        first = loss

        def loss(*a):
            return sum(_real(g) for g in jax.grad(first, argnums=nums)(*a))

    args = tuple(jnp.asarray(a) for a in operands(arity, dtype, mode, values))
    wants = []
    for how in (lambda: jax.jit(jax.grad(loss, argnums=nums))(*args), lambda: jax.grad(loss, argnums=nums)(*args)):
        try:
            wants.append(how())
        except Exception:  # jax cannot differentiate it this way
            wants.append(None)
    if mode == "jit" and wants[0] is None:
        return []  # jax.jit(jax.grad(f)) fails too (a value-dependent shape): rf must trace it as well
    wants = [w for w in wants if w is not None]
    if not wants:
        return []
    try:
        grad = rf.grad(rf.lift(loss), argnums=nums)
        got = jax.jit(grad)(*args) if mode == "jit" else grad(*args)
    except Exception as e:  # reported, the sweep goes on
        return [f"ERR {type(e).__name__}: {str(e)[:200]}"]
    lines = []
    for k in nums:
        found = differences(got[k], [want[k] for want in wants], dtype)
        if found:
            lines.append(f"DIFF arg{k}: {found}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    p.add_argument("--mode", default="eager", choices=["eager", "jit", "complex", "second", "complex-second"])
    p.add_argument("--values", default="special", choices=["special", "ties"])
    p.add_argument("--only", default="", help="only the functions whose full name holds this")
    p.add_argument("--skip", default=None, help="full names, or prefixes ending in *, to leave out")
    a = p.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from tests.lift.test_namespaces import _ALL_CASES

    if a.skip is None:  # the default: what never returns in this mode
        a.skip = NEVER_RETURN + ("," + NEVER_RETURN_COMPLEX if a.mode.startswith("complex") else "")
    skip = [s for s in a.skip.split(",") if s]
    dtype = np.dtype(a.dtype).type
    found = 0
    for mod, name, arity in _ALL_CASES:
        full = f"{mod.__name__}.{name}"
        if a.only not in full or any(full == s or (s.endswith("*") and full.startswith(s[:-1])) for s in skip):
            continue
        for line in compare(getattr(mod, name), arity, dtype, a.mode, a.values):
            print(f"{line.split(' ', 1)[0]} {full} {line.split(' ', 1)[1]}", flush=True)
            found += 1
    print(f"{found} lines", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
