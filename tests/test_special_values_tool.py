"""``tools/special_values.py``: rf's gradient against jax.grad at zeros, infinities,
nan, huge and tiny values. It must report a difference where one exists (``0 ** 0``,
where rf gives the partial derivative 0 and jax.grad nan: docs/testing.md, "What
still differs"), stay quiet where rf agrees, and run from the command line."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

TOOL = pathlib.Path(__file__).resolve().parents[1] / "tools" / "special_values.py"


def _tool():
    spec = importlib.util.spec_from_file_location("special_values", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_reports_a_difference_and_only_there():
    tool = _tool()
    with jax.enable_x64(True):
        power = tool.compare(jnp.power, 2)
        assert len(power) == 1 and power[0].startswith("DIFF arg0: 6 differ"), power  # x ** 0 at x = +-0, nan
        assert "rf=0.0 jax=nan" in power[0]
        assert tool.compare(jnp.tanh, 1) == []
        assert tool.compare(jnp.sin, 1, mode="complex") == []
        assert tool.compare(jax.nn.softplus, 1, np.float32, mode="jit") == []
        assert tool.compare(jnp.arctan2, 2, mode="second") == []
        assert tool.compare(jnp.tanh, 1, mode="complex-second") == []
        # second order through a complex operand: x ** 0 again, now inside jax's gradient
        assert tool.compare(jnp.power, 2, mode="complex-second")[0].startswith("DIFF arg0")


def test_operands_hold_every_special_value_and_every_pair():
    tool = _tool()
    (one,) = tool.operands(1, np.float64, "eager")
    a, b = tool.operands(2, np.float64, "eager")
    n = len(tool.SPECIAL)
    assert one.shape == (4, 4) and a.shape == b.shape == (n, n)
    pairs = {(repr(x), repr(y)) for x, y in zip(a.ravel(), b.ravel(), strict=True)}
    assert len(pairs) == n * n  # -0.0 and 0.0 apart
    (z,) = tool.operands(1, np.float32, "complex")
    assert z.dtype == np.complex64 and np.signbit(z.imag).any() and np.isnan(z).any()


def test_complex_modes_leave_out_what_never_returns_with_complex_values():
    """Complex ``loggamma``'s while loop never ends at infinite values (jax's own
    forward): the complex modes' default ``--skip`` leaves it out (the run hung
    there), the real modes take it."""
    tool = _tool()
    assert "jax.scipy.special.loggamma" in tool.NEVER_RETURN_COMPLEX
    assert "loggamma" not in tool.NEVER_RETURN
    _command_line_finds_nothing("jax.scipy.special.loggamma", "complex-second")


def _command_line_finds_nothing(only: str, mode: str) -> None:
    """The tool run as a command on the functions ``only`` selects prints no line
    but its count, "0 lines"."""
    run = subprocess.run(
        [sys.executable, str(TOOL), "--only", only, "--mode", mode],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "0 lines", run.stdout


def test_command_line():
    _command_line_finds_nothing("jax.numpy.sinh", "complex")
    # complex asin: rf takes the side of the branch cut the value is on, jax.grad the other
    # (Note [Derivatives on a branch cut]), and rf is finite where jax.grad is nan
    assert _tool().compare(jnp.arcsin, 1, mode="complex")[0].startswith("DIFF arg0")


def test_a_difference_is_where_rf_differs_from_every_oracle_at_one_element():
    """jax.grad run eagerly and under jit can disagree at such values (complex sqrt's
    second derivative at 1e-300+1e-300j: the wrong sign eagerly); rf agreeing with
    one of them at every element is no difference, even where the two oracles
    disagree at different elements."""
    tool = _tool()
    got = np.array([1.0, 2.0, np.nan])
    assert tool.differences(got, [np.array([1.0, 5.0, np.nan]), np.array([7.0, 2.0, np.nan])], np.float64) is None
    found = tool.differences(got, [np.array([1.0, 5.0, 0.0]), np.array([7.0, 2.0, 1.0])], np.float64)
    assert found.startswith("1 differ, e.g. (2,) rf=nan jax=0.0"), found


def test_tie_values():
    """``--values ties``: equal values in rows and columns, and every pair (equal ones
    included) for two arguments; rf's choices among them are jax.grad's, ``0 ** 0``
    still the one difference."""
    tool = _tool()
    (one,) = tool.operands(1, np.float64, "eager", "ties")
    a, b = tool.operands(2, np.float64, "eager", "ties")
    assert np.isfinite(one).all() and len(np.unique(one)) < one.size
    assert (a == b).sum() >= len(tool.TIE_PAIRS)
    with jax.enable_x64(True):
        for f, arity in [(jnp.max, 1), (jnp.median, 1), (jnp.sort, 1), (jnp.maximum, 2), (jnp.fmin, 2)]:
            assert tool.compare(f, arity, values="ties") == [], f
        assert tool.compare(jnp.power, 2, values="ties")[0].startswith("DIFF arg0")
