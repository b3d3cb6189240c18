"""Command-line and device set-up shared by the sharded examples (plain python:
imported before jax, which must not be imported yet when devices are forced)."""

from __future__ import annotations

import argparse
import os
import re
import sys


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    """``--distributed`` and the three flags that name the cluster by hand."""
    p.add_argument(
        "--distributed",
        action="store_true",
        help="multi-host: call jax.distributed.initialize() first, in every process (the cluster is read "
        "from the environment: SLURM, Open MPI, Cloud TPU, ...; or give the three flags below)",
    )
    p.add_argument("--coordinator", default=None, help="with --distributed: HOST:PORT of process 0")
    p.add_argument("--num-processes", type=int, default=None, help="with --distributed: how many processes")
    p.add_argument("--process-id", type=int, default=None, help="with --distributed: this process's index")


def force_host_devices(n: int) -> None:
    """Ask XLA for ``n`` CPU devices; only effective before jax is imported."""
    if "jax" in sys.modules:
        raise RuntimeError("set XLA_FLAGS before importing jax")
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
