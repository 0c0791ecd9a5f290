"""A store over its life, decided in one place: what a job may do with what is at its location in
its mode (create a store where there is none, replace one, resume one, or leave a complete one
alone), the job's identity a resumed store must match, and the store's chunk size. ``writer``
only writes: it never decides what may be done with what is at the location.

A job calls ``check_location`` before it loads its model, so that a refusal costs nothing, and
``open_for_job`` when it has the store's identity, which looks at the location again (something
may have been written there meanwhile) and acts: it takes the store's lock, clears what it
replaces, and has the new store written, or reopens the store it resumes. ``create_store`` is the
same for a store made outside a job.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass

from orthosphere.errors import JobMismatchError, StoreError, StoreExistsError

from .faults import crash_point
from .location import Location, as_location
from .lock import acquire_lock, holder_text, live_holder
from .names import LOCK_FILES
from .reader import not_a_store_error
from .schema import bytes_per_sample, dim_sizes, holds_pred, variables_for
from .state import ABSENT, DAMAGED, EMPTY, FOREIGN_ZARR, REMNANT, STORE, Found, inspect
from .writer import NewStore, StoreWriter, check_room, new_store, open_writer, samples_per_chunk_for, write_store

log = logging.getLogger("orthosphere.store")

MODES = ("new", "resume", "overwrite")
"""What a job asks of its location: a new store (nothing may be there), to resume the store there
(or create it where there is none), or to overwrite what it finds."""
CREATED, RECREATED, REPLACED, RESUMED, COMPLETE = "created", "recreated", "replaced", "resumed", "complete"
"""What a job did with its location: created a store where there was none, created one afresh over
a remnant (mode="resume"), replaced a store (mode="overwrite"), reopened one to resume it, or
found it complete and whole."""

CHUNK_ROW_BYTES = 256 * 2**20
"""Most memory that one chunk of every site and layer may take (the writer holds up to one)."""
IDENTITY_KEYS = ("model", "task", "sites", "layers", "dtype", "labels", "n_samples", "n_pos", "pred")
"""Store attributes that must match for a job to resume a store."""
IDENTITY_IGNORED = {"model": ("source",), "task": ("path",)}
"""Where a model or file lives may change between runs; its SHA-256 may not."""


@dataclass(frozen=True)
class Opened:
    """A job's store, opened: its writer, holding the lock (None when the store is complete and
    whole: nothing to do), what was done to get it (CREATED, RECREATED, REPLACED, RESUMED or
    COMPLETE) and its number of shards."""

    url: str
    writer: StoreWriter | None
    outcome: str
    n_shards: int

    @property
    def news(self) -> str:
        """What was done, in words."""
        return {
            CREATED: f"writing the store at {self.url}",
            RECREATED: f"{self.url} held a store whose creation or replacement was interrupted: created it afresh; "
                       f"writing the store at {self.url}",
            REPLACED: f"writing the store at {self.url}",
            RESUMED: f"resuming the extraction into {self.url}",
            COMPLETE: f"store {self.url} is already complete: nothing to do",
        }[self.outcome]


def check_location(location: Location, mode: str) -> None:
    """Refuse now what ``open_for_job`` would refuse at the location in `mode` (one of MODES)."""
    _decide(location, inspect(location), mode)


def open_for_job(location: Location, mode: str, identity: dict, new: NewStore, break_lock: bool = False,
                 command: str | None = None) -> Opened:
    """The store of a job whose `identity` (IDENTITY_KEYS) asks for the store `new` at `location`
    in `mode` (one of MODES), opened for writing; or the error that says why not. A store that the
    job resumes must have been made by the same job. `break_lock` breaks a lock that looks alive
    (a stale one is broken anyway); `command` is recorded in a new store."""
    found = inspect(location)
    outcome = _decide(location, found, mode)
    if outcome != RESUMED:
        return Opened(location.url, _create(location, found, new, break_lock, command), outcome,
                      len(new.attributes["shards"]))
    check_same_job(location.url, found.attrs, identity)
    writer = _reopen(location, break_lock)
    return Opened(location.url, writer, RESUMED if writer is not None else COMPLETE, len(found.attrs["shards"]))


def create_store(url, *, overwrite: bool = False, break_lock: bool = False, command: str | None = None,
                 storage_options: dict | None = None, **description) -> StoreWriter:
    """Create an empty store of schema v1 and return its writer, which holds the store's lock.
    `description`: the keywords of ``writer.new_store`` (model, task, n_samples, n_pos, sites, ...).

    overwrite=True replaces a store (or the remnant of an interrupted creation) at `url`;
    break_lock=True breaks a lock that looks alive (a stale one is broken anyway)."""
    new = new_store(**description)
    location = as_location(url, storage_options)
    found = inspect(location)
    _decide(location, found, "overwrite" if overwrite else "new")
    return _create(location, found, new, break_lock, command)


def _decide(location: Location, found: Found, mode: str) -> str:
    """What a job in `mode` does with what was found at the location (CREATED, RECREATED, REPLACED
    or RESUMED), or the error that says why it may not: an existing store needs mode="resume" or
    mode="overwrite", a damaged one mode="overwrite", and what is not a store is never touched."""
    if mode not in MODES:
        raise StoreError(f"mode={mode!r}: expected one of {list(MODES)}")
    _refuse_foreign(location, found)
    if not found.is_ours:
        return CREATED
    if mode == "overwrite":
        return REPLACED
    if found.kind == DAMAGED:
        raise not_a_store_error(location, DAMAGED)
    if mode == "resume":
        return RESUMED if found.kind == STORE else RECREATED
    raise StoreExistsError(_exists_message(location, found))


def _create(location: Location, found: Found, new: NewStore, break_lock: bool, command: str | None) -> StoreWriter:
    """The new store written at the location, after its lock is taken and what was found there
    (a store or a remnant of one) cleared."""
    check_room(location, new)
    holder = acquire_lock(location, break_lock=break_lock)
    crash_point("lock-taken")
    if found.is_ours:
        location.clear(keep=LOCK_FILES)
        crash_point("cleared")
    return write_store(location, new, holder, command)


def _refuse_foreign(location: Location, found: Found) -> None:
    """Raise unless the URL holds nothing, or a store (or remnant) that a job may replace."""
    if found.kind in (ABSENT, EMPTY) or found.is_ours:
        return
    kind = "a Zarr store that orthosphere did not write" if found.kind == FOREIGN_ZARR else "not a Zarr store"
    raise StoreError(f"{location.url} exists and is {kind}; refusing to write into it or delete it: choose a new path")


def _exists_message(location: Location, found: Found) -> str:
    """What to do about a store (or a remnant of one) where a new one was to be created."""
    holder = live_holder(location)
    if found.kind == REMNANT and holder is not None:
        return (
            f"a store is being created at {location.url} now by a running writer: {holder_text(holder)}; wait for it to "
            'finish (mode="resume" then completes whatever it left), or write elsewhere'
        )
    if found.kind == REMNANT:
        return (
            f"{location.url} holds a store whose creation or replacement was interrupted (nothing in it can be resumed): "
            'pass mode="resume" to create it afresh, or mode="overwrite"'
        )
    state = "complete" if found.attrs.get("complete") else "incomplete"
    if holder is not None:
        return (
            f"a store is being written at {location.url} now ({state}) by a running writer: {holder_text(holder)}; "
            'wait for it to finish (mode="resume" then completes whatever it left), or write elsewhere'
        )
    return (
        f'a store already exists at {location.url} ({state}): pass mode="resume" to continue the job that made it, '
        'or mode="overwrite" to replace it'
    )


def check_same_job(url: str, attrs: dict, identity: dict) -> None:
    """Refuse to resume a store made by another job, naming the first attribute that differs."""
    attrs = {**attrs, "pred": holds_pred(attrs)}  # stores written before the attribute existed say it so
    for key in sorted(IDENTITY_KEYS, key=lambda key: key != "n_samples"):  # a changed count changes the task's too: name it first
        stored, wanted = _normalised(attrs.get(key)), _normalised(identity[key])
        for ignored in IDENTITY_IGNORED.get(key, ()):
            if isinstance(stored, dict) and isinstance(wanted, dict):
                stored.pop(ignored, None)
                wanted.pop(ignored, None)
        difference = _first_difference(stored, wanted, key)
        if difference is not None:
            name, old, new = difference
            raise JobMismatchError(f"store {url} was made by a different job: its {name} is {_short(old)}, this job's is {_short(new)}")


def _reopen(location: Location, break_lock: bool) -> StoreWriter | None:
    """The store's writer, holding its lock, with the shards of damaged chunks reopened; None
    when the store is complete and whole."""
    writer = open_writer(location, lock=True, break_lock=break_lock)
    restored = writer.restore_metadata()
    if restored:
        log.warning("%s: the metadata of array(s) %s was missing; restored from the store's consolidated metadata",
                    location.url, restored)
    files = location.list_files()
    blocked = writer.obstacles(files)
    if blocked:
        writer.close()
        shown = ", ".join(blocked[:3]) + (", ..." if len(blocked) > 3 else "")
        raise StoreError(f"store {location.url} cannot be resumed: {len(blocked)} chunk path(s) inside it hold a directory "
                         f"where the chunk file should be ({shown}): remove them, then resume the job again (mode=\"resume\")")
    damage = writer.find_damage(files=files)
    if damage:
        shards = writer.reopen(damage)
        log.warning("%s: %d chunk(s) of complete shards are missing or damaged, e.g. %s; rewriting %s",
                    location.url, len(damage), damage[0], f"shard(s) {shards}" if shards else f"array(s) {sorted({item.array for item in damage})}")
    elif writer.is_finished():
        writer.close()
        return None
    return writer


def chunk_samples(model: dict, n_samples: int, n_pos: int, sites, n_layers: int, dtype: str, batch_size: int,
                  n_shards: int = 1) -> int:
    """Samples per chunk: the store's ~4 MB target, capped so that one chunk of every site and
    layer fits in CHUNK_ROW_BYTES and that there are at least n_shards chunks (shards are whole
    chunks), and aligned with the batch (a multiple or a divisor of the batch size) so that
    batches fill whole chunks without being copied together."""
    sizes = dim_sizes(model, n_samples, n_pos, n_layers)
    variables = variables_for(sites, with_weights=False, pred=model.get("lm_head", True))
    row = bytes_per_sample(variables, sizes, dtype)
    samples = max(1, min(samples_per_chunk_for(variables, sizes, dtype), CHUNK_ROW_BYTES // row,
                         math.ceil(n_samples / n_shards)))
    if samples >= n_samples:
        return n_samples
    if samples >= batch_size:
        return samples - samples % batch_size
    return max(d for d in range(1, samples + 1) if batch_size % d == 0)


def _normalised(value):
    return json.loads(json.dumps(value))


def _first_difference(old, new, name):
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            difference = _first_difference(old.get(key), new.get(key), f"{name}.{key}")
            if difference is not None:
                return difference
        return None
    return None if old == new else (name, old, new)


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
