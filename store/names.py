"""The names of what orthosphere keeps inside a store beside its arrays: the lock and its
heartbeat, files written aside before they are moved into place, the marker of a store being
replaced, and the progress record."""
from __future__ import annotations

import re
import uuid

LOCK_NAME = ".orthosphere-lock"
HEARTBEAT_NAME = ".orthosphere-lock-heartbeat"
LOCK_FILES = (LOCK_NAME, HEARTBEAT_NAME)
REPLACING_NAME = ".orthosphere-replacing"
"""Marks a store that is being cleared to be replaced (see Location.clear)."""
PARTIAL_SUFFIX = r"\.[0-9a-f]{32}\.partial"
"""How a file written aside (temporary_path) ends, as a regular expression."""
PROGRESS_GROUP = "_progress"
PROGRESS_RECORD = f"{PROGRESS_GROUP}/shard_complete"

_LOCK_FILE = re.compile(rf"({re.escape(LOCK_NAME)}|{re.escape(HEARTBEAT_NAME)})({PARTIAL_SUFFIX})?")


def temporary_path(path: str) -> str:
    """A fresh name beside `path` to write a file aside before it is moved or linked into place."""
    return f"{path}.{uuid.uuid4().hex}.partial"


def is_lock_file(name: str) -> bool:
    """Whether a file directly inside a store is the lock, its heartbeat, or one of them written
    aside (a writer killed while taking the lock or beating leaves one)."""
    return _LOCK_FILE.fullmatch(name) is not None
