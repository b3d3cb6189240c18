"""The autograd core: records, snapshots, tape, engine, transforms (and the
errors of ``rumus_fx/errors.py``, re-exported)."""

from typing import Any, Union

from ..errors import AutogradError as AutogradError
from ..errors import ShapeError as ShapeError
from ..errors import ShardingError as ShardingError
from ..errors import VersionMismatch as VersionMismatch
from . import display as _display
from .engine import GradientStore as GradientStore
from .record import Aval as Aval
from .record import Record as Record
from .record import VersionSnapshot as VersionSnapshot
from .record import record_types as record_types
from .registry import declared_records
from .tape import Tape as Tape
from .tape import TapeEntry as TapeEntry
from .tape import no_grad as no_grad
from .transforms import grad as grad
from .transforms import value_and_grad as value_and_grad
from .transforms import vjp as vjp

_display.install()  # _repr_html_ of Tape, TapeEntry and Tensor for notebooks


def __getattr__(name: str) -> Any:
    # BackwardOp: the union of every declared record type (Note [Declaring an
    # op] in registry.py), computed on access: the ops (and rf.lift) declare
    # theirs above this package, and importing rumus_fx.autograd imports
    # rumus_fx, hence all of them, first
    if name == "BackwardOp":
        return Union[declared_records()]  # noqa: UP007
    raise AttributeError(name)
