"""Primitive-table entries for convolutions and windowed reductions (conv_general_dilated, reduce_window_*)."""

from __future__ import annotations

from .ptable_base import PInfo

ENTRIES: list[PInfo] = []
