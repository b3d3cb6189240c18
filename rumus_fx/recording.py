"""The recording context: which tape records ops (per thread and per asyncio
task), ``no_grad``, and the switches rf.lift and the transforms use.

It sits below ``tensor.py`` (a tracked Tensor refuses silent conversion while a
tape records) and below the autograd package, whose ``Tape`` enters itself
here; ``rumus_fx.autograd.tape`` re-exports these names."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # typing only: the tape sits above this module
    from .autograd.tape import Tape

_TAPE: contextvars.ContextVar[Tape | None] = contextvars.ContextVar("rumus_fx_tape", default=None)
_NO_GRAD: contextvars.ContextVar[bool] = contextvars.ContextVar("rumus_fx_no_grad", default=False)


def current_tape() -> Tape | None:
    """The innermost active tape of this thread/task, or None (also under no_grad)."""
    if _NO_GRAD.get():
        return None
    return _TAPE.get()


def enter_tape(tape: Tape) -> contextvars.Token:
    """Make ``tape`` the active tape (``Tape.__enter__``); undo with ``exit_tape``."""
    return _TAPE.set(tape)


def exit_tape(token: contextvars.Token) -> None:
    """Restore the tape that was active before ``enter_tape`` returned ``token``."""
    _TAPE.reset(token)


@contextlib.contextmanager
def suspend_recording() -> Iterator[None]:
    """No tape is active inside (rf.lift traces functions this way; a tape
    opened inside, e.g. by a nested rf.grad, records as usual)."""
    token = _TAPE.set(None)
    try:
        yield
    finally:
        _TAPE.reset(token)


@contextlib.contextmanager
def recording(tape: Tape) -> Iterator[Tape]:
    """Record on ``tape`` even inside an outer ``no_grad()``: what the transforms
    do, as ``torch.func.grad`` and ``jax.grad``; a ``no_grad()`` entered inside
    still stops recording there."""
    tape_token = _TAPE.set(tape)
    grad_token = _NO_GRAD.set(False)
    try:
        yield tape
    finally:
        _NO_GRAD.reset(grad_token)
        _TAPE.reset(tape_token)


class no_grad(contextlib.ContextDecorator):
    """Context manager (and decorator) inside which no op records.

    Nestable; per thread and per asyncio task. In-place ops inside only mutate.
    """

    def __init__(self) -> None:
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> no_grad:
        self._tokens.append(_NO_GRAD.set(True))
        return self

    def __exit__(self, *exc: Any) -> None:
        _NO_GRAD.reset(self._tokens.pop())
