"""Pallas kernels and their jax.numpy references, behind one dispatch."""

from ..errors import KernelFallbackWarning as KernelFallbackWarning
from ..errors import KernelUnavailable as KernelUnavailable
from .dispatch import MODES as MODES
from .dispatch import backend as backend
from .dispatch import mode as mode
from .dispatch import use as use
