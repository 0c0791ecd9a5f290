"""Fault injection for the crash tests: ``ORTHOSPHERE_CRASH_AT=POINT[:N]`` kills the process with
SIGKILL the N-th time (default: the first) it reaches the named point.

The points, in the order a job meets them: ``lock-written-aside`` (a local lock written beside
its place, not yet linked into it), ``lock-taken``, ``root-written``, ``array-created`` (after
each array), ``progress-created`` (store created, metadata not yet consolidated),
``store-created``, ``samples-written`` (after each block of a corpus's token arrays, written
before the shards run), ``chunk-written`` (after each block that completes a chunk, every array
of it written), ``shard-complete``, ``before-finish``, ``finish-consolidated`` (metadata
consolidated, ``complete`` not yet set), ``finished`` (complete, lock not yet released);
replacing a store (``mode="overwrite"``, or a remnant created afresh) meets ``clearing`` after each
entry it removes, then ``cleared``.
"""
from __future__ import annotations

import os
import signal
from collections import Counter

CRASH_VARIABLE = "ORTHOSPHERE_CRASH_AT"

_counts: Counter = Counter()


def crash_point(name: str) -> None:
    """SIGKILL this process if ORTHOSPHERE_CRASH_AT names this point and count; a no-op otherwise."""
    wanted = os.environ.get(CRASH_VARIABLE)
    if not wanted or wanted.partition(":")[0] != name:
        return
    _counts[name] += 1
    if _counts[name] == int(wanted.partition(":")[2] or 1):
        os.kill(os.getpid(), signal.SIGKILL)
