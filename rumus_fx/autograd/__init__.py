"""The autograd core: records, snapshots, tape, engine, transforms, errors."""

from typing import Any, Union

from .engine import GradientStore as GradientStore
from .errors import AutogradError as AutogradError
from .errors import ShapeError as ShapeError
from .errors import ShardingError as ShardingError
from .errors import VersionMismatch as VersionMismatch
from .record import Aval as Aval
from .record import Record as Record
from .record import VersionSnapshot as VersionSnapshot
from .record import record_types as record_types
from .tape import Tape as Tape
from .tape import TapeEntry as TapeEntry
from .tape import no_grad as no_grad
from .transforms import grad as grad
from .transforms import value_and_grad as value_and_grad
from .transforms import vjp as vjp


def __getattr__(name: str) -> Any:
    # BackwardOp: the union of every declared record type (Note [Declaring an op]
    # in registry.py), known once the ops and the primitive rules are imported
    if name == "BackwardOp":
        from .. import lift, ops  # noqa: F401  (declare the ops)
        from .registry import declared_records

        return Union[declared_records()]  # noqa: UP007
    raise AttributeError(name)
