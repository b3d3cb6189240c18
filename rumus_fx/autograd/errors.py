"""The error types, kept importable from their old place: they live in
``rumus_fx/errors.py``, the package's base (every module may import it)."""

from ..errors import SHARDING_HINT as SHARDING_HINT
from ..errors import VERSION_HINT as VERSION_HINT
from ..errors import AutogradError as AutogradError
from ..errors import ShapeError as ShapeError
from ..errors import ShapeTypeError as ShapeTypeError
from ..errors import ShardingError as ShardingError
from ..errors import VersionMismatch as VersionMismatch
