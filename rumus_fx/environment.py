"""The environment report for bug reports: ``python -m rumus_fx`` prints it.

It names the versions (rumus_fx, jax, jaxlib, numpy, python), the platform, JAX's
default backend and devices, and the kernel mode (``rf.kernels.mode()``, set by
``RUMUS_FX_KERNELS`` or ``rf.kernels.use``) with the implementation it runs here
(``rf.kernels.backend()``).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

import jax

from . import kernels
from ._version import __version__


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report() -> dict[str, str]:
    """The environment as ordered ``{name: value}`` strings."""
    devices = jax.devices()
    kinds: dict[str, int] = {}
    for d in devices:
        kinds[d.device_kind] = kinds.get(d.device_kind, 0) + 1
    return {
        "rumus_fx": f"{__version__} ({os.path.dirname(os.path.abspath(__file__))})",
        "jax": jax.__version__,
        "jaxlib": _dist_version("jaxlib"),
        "numpy": _dist_version("numpy"),
        "python": sys.version.split()[0] + f" ({platform.python_implementation()})",
        "platform": platform.platform(),
        "backend": jax.default_backend(),
        "devices": f"{len(devices)}: " + ", ".join(f"{n} x {k}" for k, n in kinds.items()),
        "processes": f"{jax.process_count()} (this one: {jax.process_index()})",
        "kernel mode": f"{kernels.mode()} (runs: {kernels.backend()}; RUMUS_FX_KERNELS="
        f"{os.environ.get('RUMUS_FX_KERNELS', 'unset')})",
        "x64": str(bool(jax.config.jax_enable_x64)),
        "torch": _dist_version("torch"),
    }


def format_report(info: dict[str, str] | None = None) -> str:
    """The report as aligned ``name: value`` lines."""
    info = report() if info is None else info
    width = max(len(k) for k in info)
    return "\n".join(f"{k + ':':<{width + 1}} {v}" for k, v in info.items())


def main() -> None:
    """Print the environment report."""
    print(format_report())
