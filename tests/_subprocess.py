"""The environment of a child Python process a test starts (an example, a sharded
case file on eight virtual devices, a script)."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\d+")


def child_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """``os.environ`` and ``extra``, with the repository on ``PYTHONPATH`` and
    ``XLA_FLAGS`` holding the run's compile-time flags (``tests/conftest.py``) but no
    host device count from the caller's environment: ``devices`` asks for that many
    CPU devices, ``None`` leaves the count to the child (the case files set their own)."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    flags = _DEVICE_COUNT.sub("", env.get("XLA_FLAGS", "")).split()
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    return env
