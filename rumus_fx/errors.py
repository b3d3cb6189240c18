"""Exceptions raised by rumus_fx, and the long messages that explain the fix."""

from __future__ import annotations


class AutogradError(RuntimeError):
    """Base class of every autograd error raised by rumus_fx."""


class ShapeError(ValueError):
    """An op got operands whose shapes or ranks it cannot take.

    Raised at call time, before anything is recorded; the message names the op
    and the offending shapes.
    """


class ShapeTypeError(ShapeError, TypeError):
    """A ShapeError that is also the TypeError JAX raised for it (a lifted jax
    function given operands of incompatible shapes)."""


class ShardingError(ShapeError):
    """An op (or its backward rule) got operands whose shardings over a device
    mesh it cannot combine without being told how (JAX's ``ShardingTypeError``
    on Explicit mesh axes). The message names the op, the operands' sharded
    types and the fix."""


class KernelUnavailable(RuntimeError):
    """A Pallas kernel cannot be built for the running jax and backend (Pallas'
    Triton backend removed from this jax, a Mosaic GPU rule its blocks would
    break). ``rf.kernels.use("pallas")`` raises it; ``"auto"`` runs the
    reference instead, with one :class:`KernelFallbackWarning`."""

    def __init__(self, kernel: str, reason: str) -> None:
        super().__init__(
            f"rumus_fx kernel {kernel!r} cannot be built here: {reason}. "
            'Use rf.kernels.use("auto") to run the jax.numpy reference in its place, '
            'or rf.kernels.use("reference") everywhere.'
        )
        self.kernel = kernel
        self.reason = reason


class KernelFallbackWarning(UserWarning):
    """``auto`` dispatch ran the jax.numpy reference in place of a kernel that
    cannot be built here (given once per kernel and reason)."""


SHARDING_HINT = (
    "Fix: shard the operands compatibly (each mesh axis on one array axis, e.g. only the batch "
    "axis on 'data'), gather a sharded parameter where it is used with rf.reshard(w, P()) (its "
    "gradient goes back to w's sharding), or use Auto mesh axes "
    "(jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))) so that XLA chooses."
)


VERSION_HINT = (
    "Hint: a tensor that this record saved for the backward pass was modified in "
    "place (add_, mul_, copy_, ... or an optimizer update) after the forward op "
    "used it. Use the out-of-place op instead (y = y + x rather than y.add_(x)), or "
    "make the in-place change before the op that reads the tensor."
)


class VersionMismatch(AutogradError):
    """A storage saved for backward was written in place after it was recorded.

    Attributes:
      grad_id: id of the tensor whose storage changed.
      expected: the storage version when the record saved it.
      found: the version at backward time.
      op: name of the record whose saved data is stale (e.g. ``"MulBackward"``).
    """

    def __init__(self, grad_id: int | None, expected: int, found: int, op: str | None = None):
        self.grad_id = grad_id
        self.expected = expected
        self.found = found
        self.op = op
        where = op if op is not None else "a backward record"
        tensor = f"tensor grad_id={grad_id}" if grad_id is not None else "an untracked tensor (no grad_id)"
        super().__init__(
            f"VersionMismatch in {where}: the storage of {tensor} that {where} saved for "
            f"backward is at version {found}, but it was recorded at version {expected}. "
            f"{VERSION_HINT}"
        )

    def __reduce__(self):  # keep pickling (e.g. across processes) lossless
        return (type(self), (self.grad_id, self.expected, self.found, self.op))
