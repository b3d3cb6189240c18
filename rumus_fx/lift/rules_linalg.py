"""Primitive rules: linear algebra and special functions (cholesky, triangular_solve, lu, qr, eigh, svd, igamma, ...)."""

from __future__ import annotations
