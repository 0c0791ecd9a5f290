"""Capture state that belongs to one forward pass, never to the model.

The hooks an adapter installs on a model hold no state: each asks ``active(adapter)`` for the
trace of the forward pass running in its own thread (a ``contextvars.ContextVar``, so two threads
capturing on one model, e.g. two shards on one multi-threaded Dask worker, each see only their
own) and does nothing when there is none. A trace carries what to record (a ``Recording``), how
to edit q, k, v, after which layer to stop the pass, and what one pass hands from one hook to a later one (``held``).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field, replace

from .recording import Recording

EditFn = Callable
"""fn(layer, q, k, v) -> (q, k, v): q (batch, pos, head, d_head), k and v (batch, pos, kv_head, d_head)."""


@dataclass(frozen=True)
class Trace:
    """What the forward passes of this thread do for one adapter's model."""

    owner: object
    recording: Recording | None = None
    edit: EditFn | None = None
    stop_after: int | None = None
    """The layer after which the forward pass stops (``adapters.base.StopForward``), or None."""
    held: dict = field(default_factory=dict)


_ACTIVE: ContextVar[Trace | None] = ContextVar("orthosphere_trace", default=None)


def active(owner) -> Trace | None:
    """The trace of this thread's forward pass for `owner`'s model, or None."""
    trace = _ACTIVE.get()
    return trace if trace is not None and trace.owner is owner else None


@contextlib.contextmanager
def tracing(owner, **changes):
    """Within the block, this thread's forward passes of `owner`'s model use a trace with
    `changes` (recording=..., edit=...) on top of the enclosing one."""
    current = active(owner) or Trace(owner)
    token = _ACTIVE.set(replace(current, held={}, **changes))
    try:
        yield
    finally:
        _ACTIVE.reset(token)
