"""Primitive rules: indexing, sorting and cumulative ops (gather, scatter, sort, top_k, cumsum, ...)."""

from __future__ import annotations
