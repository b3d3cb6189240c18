"""Simulating a jax whose Pallas Triton backend is gone (as after its removal)."""

from __future__ import annotations

import sys
from typing import Any

import jax
from jax.experimental import pallas as _pallas  # noqa: F401 - loaded before the Triton module is hidden

from rumus_fx.kernels import dispatch


def hide_triton(monkeypatch: Any) -> None:
    """Make ``import jax.experimental.pallas.triton`` fail for this test, drop the
    traces jitted while it was present, and forget which fallbacks warned."""
    for name in [m for m in sys.modules if m.startswith("jax.experimental.pallas.triton")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.triton", None)
    monkeypatch.delattr(jax.experimental.pallas, "triton", raising=False)
    jax.clear_caches()  # kernels jitted with Triton present keep their traces
    monkeypatch.setattr(dispatch, "_WARNED", set())
