"""Primitive rules: convolutions and windowed reductions (conv_general_dilated, reduce_window_*)."""

from __future__ import annotations
