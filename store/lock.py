"""One writer per store at a time: a lock file that names its holder."""
from __future__ import annotations

import json
import os
import socket
import sys
from datetime import UTC, datetime

from .errors import StoreLockedError
from .location import Location

LOCK_NAME = ".orthosphere-lock"


def holder_description() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "command": " ".join(sys.argv),
        "since": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def read_lock(location: Location) -> dict | None:
    path = location.key(LOCK_NAME)
    if not location.fs.exists(path):
        return None
    with location.fs.open(path, "r") as handle:
        return json.load(handle)


def _is_mine(holder: dict) -> bool:
    return holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()


def is_stale(holder: dict) -> bool:
    """A lock is stale when its holder was a process on this host that no longer runs."""
    if holder.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def acquire_lock(location: Location, break_lock: bool = False) -> dict:
    """Take the store's lock, or explain who holds it and how to break a stale one."""
    holder = read_lock(location)
    if holder is not None and _is_mine(holder):
        return holder
    if holder is not None and not break_lock:
        stale = is_stale(holder)
        state = "a process that no longer runs (stale lock)" if stale else "a running writer"
        advice = (
            "break it with break_lock=True (CLI: --break-lock)"
            if stale
            else "wait for it to finish, or stop it first; break_lock=True only if you are sure it is dead"
        )
        raise StoreLockedError(
            f"store {location.url} is locked by {state}: pid {holder.get('pid')} on "
            f"{holder.get('host')}, since {holder.get('since')}, running {holder.get('command')!r}; {advice}"
        )
    mine = holder_description()
    _write_lock(location, mine, exclusive=holder is None)
    return mine


def _write_lock(location: Location, holder: dict, exclusive: bool) -> None:
    path = location.key(LOCK_NAME)
    payload = json.dumps(holder)
    if location.is_local and exclusive:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            raise StoreLockedError(
                f"store {location.url} was locked by another writer a moment ago; try again later"
            ) from None
        with os.fdopen(descriptor, "w") as handle:
            handle.write(payload)
        return
    with location.fs.open(path, "w") as handle:
        handle.write(payload)


def release_lock(location: Location) -> None:
    holder = read_lock(location)
    if holder is not None and _is_mine(holder):
        location.fs.rm(location.key(LOCK_NAME))
