"""Primitive-table entries for indexing, sorting and cumulative ops (gather, scatter, sort, top_k, cumsum, ...)."""

from __future__ import annotations

from .ptable_base import PInfo

ENTRIES: list[PInfo] = []
