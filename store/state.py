"""What lies at a store's URL, read from the files themselves (no zarr): nothing, an empty folder,
a store whose creation (or replacement) was interrupted, a created store, or something else.

A store is created root first (zarr.json with every attribute), then its arrays, then its
progress record ``_progress/shard_complete``: a store is *created* once that record exists. Before,
it is a *remnant* that a job may replace, because nothing was written into it: it holds the lock
files of the job that made it (perhaps only one written aside, by a job killed while taking the
lock), or a root with the schema attribute, and no chunk of any per-sample array. Replacing a
store first writes the marker ``.orthosphere-replacing``, then clears the store, the marker last:
a store being replaced is a remnant at every instant, whatever a kill leaves of it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from .errors import StoreError
from .failures import naming_failures
from .location import Location
from .names import PROGRESS_GROUP, PROGRESS_RECORD, REPLACING_NAME, is_lock_file

INDEX_ARRAYS = ("sample", "pos", "layer", "head", "kv_head")
"""Arrays written when the store is created (their chunks say nothing about samples)."""

ABSENT, EMPTY, REMNANT, STORE, DAMAGED, FOREIGN_ZARR, FOREIGN = (
    "absent", "empty", "remnant", "store", "damaged", "foreign zarr", "foreign")


@dataclass(frozen=True)
class Found:
    """What is at a store's URL: its kind (one of the names above), its root attributes and
    whether its metadata is consolidated."""

    kind: str
    attrs: dict = field(default_factory=dict)
    consolidated: bool = False

    @property
    def is_ours(self) -> bool:
        """Whether a job may replace it (mode="overwrite"; mode="resume" for a remnant)."""
        return self.kind in (REMNANT, STORE, DAMAGED)


def inspect(location: Location) -> Found:
    """What is at the location; a failure of the storage raises StorageFailureError naming the store."""
    with naming_failures(location.url, "its listing and root metadata", writing=False):
        return _inspect(location)


def _inspect(location: Location) -> Found:
    if location.is_local and location.is_link_to_nothing():
        raise StoreError(f"{location.url} is a symbolic link to a path that does not exist: fix or remove the link")
    if not location.exists():
        return Found(ABSENT)
    if not location.is_dir():
        return Found(FOREIGN)
    names = location.entries()
    if not names:
        return Found(EMPTY)
    if REPLACING_NAME in names:
        return Found(REMNANT)
    root = _root_document(location) if "zarr.json" in names else None
    attrs = root.get("attributes") or {} if isinstance(root, dict) else {}
    consolidated = isinstance(root, dict) and root.get("consolidated_metadata") is not None
    has_schema = "schema" in attrs
    if has_schema and location.fs.exists(location.key(f"{PROGRESS_RECORD}/zarr.json")):
        return Found(STORE, attrs, consolidated)
    has_lock = any(is_lock_file(name) for name in names)
    empty_group = root is not None and not attrs and all(name == "zarr.json" or is_lock_file(name) for name in names)
    if (has_lock or has_schema or empty_group) and not _holds_samples(location, names):
        return Found(REMNANT, attrs, consolidated)
    if has_schema:
        return Found(DAMAGED, attrs, consolidated)
    return Found(FOREIGN_ZARR if root is not None else FOREIGN, attrs, consolidated)


def _root_document(location: Location) -> dict | None:
    """The root zarr.json, or {} when it cannot be read as JSON."""
    try:
        document = json.loads(location.fs.cat_file(location.key("zarr.json")))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return document if isinstance(document, dict) else {}


def _holds_samples(location: Location, names: list[str]) -> bool:
    """Whether any array but the index coordinates holds a chunk (a store's data, never a remnant)."""
    candidates = [name for name in names
                  if name not in ("zarr.json", PROGRESS_GROUP, *INDEX_ARRAYS) and not is_lock_file(name)]
    return any(location.fs.exists(location.key(f"{name}/c")) for name in candidates)
