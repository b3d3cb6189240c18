"""Primitive-table entries for linear algebra and special functions (cholesky, triangular_solve, lu, qr, eigh, svd, igamma, ...)."""

from __future__ import annotations

from .ptable_base import PInfo

ENTRIES: list[PInfo] = []
