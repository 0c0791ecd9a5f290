"""A job's store over its life: what is at the URL and whether a job may create, resume or replace
it, the job's identity a resumed store must match, reopening a store to resume it, and its chunk
size. Extraction calls these; ``create_store`` (writer.py) takes the same decisions with the same
messages (``exists_message``).
"""
from __future__ import annotations

import json
import logging
import math

from orthosphere.errors import JobMismatchError, StoreError, StoreExistsError

from .location import Location
from .reader import not_a_store_error
from .schema import bytes_per_sample, dim_sizes, holds_pred, variables_for
from .state import ABSENT, DAMAGED, EMPTY, FOREIGN_ZARR, REMNANT, Found, inspect

log = logging.getLogger("orthosphere.store")

CHUNK_ROW_BYTES = 256 * 2**20
"""Most memory that one chunk of every site and layer may take (the writer holds up to one)."""
IDENTITY_KEYS = ("model", "task", "sites", "layers", "dtype", "labels", "n_samples", "n_pos", "pred")
"""Store attributes that must match for a job to resume a store."""
IDENTITY_IGNORED = {"model": ("source",), "task": ("path",)}
"""Where a model or file lives may change between runs; its SHA-256 may not."""


def found_for_job(location: Location, resume: bool, overwrite: bool) -> Found:
    """What is at the location, for a job: an existing store needs resume or overwrite, a damaged
    one overwrite, and what is not a store is never touched."""
    found = inspect(location)
    refuse_foreign(location, found)
    if not found.is_ours or overwrite:
        return found
    if found.kind == DAMAGED:
        raise not_a_store_error(location, DAMAGED)
    if resume:
        return found
    raise StoreExistsError(exists_message(location, found))


def refuse_foreign(location: Location, found: Found) -> None:
    """Raise unless the URL holds nothing, or a store (or remnant) that a job may replace."""
    if found.kind in (ABSENT, EMPTY) or found.is_ours:
        return
    kind = "a Zarr store that orthosphere did not write" if found.kind == FOREIGN_ZARR else "not a Zarr store"
    raise StoreError(f"{location.url} exists and is {kind}; refusing to write into it or delete it: choose a new path")


def exists_message(location: Location, found: Found) -> str:
    """What to do about a store (or a remnant of one) where a new one was to be created."""
    if found.kind == REMNANT:
        return (
            f"{location.url} holds a store whose creation or replacement was interrupted (nothing in it can be resumed): "
            "pass resume=True (CLI: --resume) to create it afresh, or overwrite=True (CLI: --overwrite)"
        )
    state = "complete" if found.attrs.get("complete") else "incomplete"
    return (
        f"a store already exists at {location.url} ({state}): pass resume=True (CLI: --resume) to continue the job "
        "that made it, or overwrite=True (CLI: --overwrite) to replace it"
    )


def check_same_job(url: str, attrs: dict, identity: dict) -> None:
    """Refuse to resume a store made by another job, naming the first attribute that differs."""
    attrs = {**attrs, "pred": holds_pred(attrs)}  # stores written before the attribute existed say it so
    for key in IDENTITY_KEYS:
        stored, wanted = _normalised(attrs.get(key)), _normalised(identity[key])
        for ignored in IDENTITY_IGNORED.get(key, ()):
            if isinstance(stored, dict) and isinstance(wanted, dict):
                stored.pop(ignored, None)
                wanted.pop(ignored, None)
        difference = _first_difference(stored, wanted, key)
        if difference is not None:
            name, old, new = difference
            raise JobMismatchError(
                f"store {url} was made by a different job: its {name} is {_short(old)}, this job's is "
                f"{_short(new)}; resume with the original model, task, sites, layers, dtype, pred and n_samples, "
                "or pass overwrite=True (CLI: --overwrite) to replace the store"
            )


def reopen_to_resume(url, break_lock: bool, storage_options: dict | None):
    """The store's writer, holding its lock, with the shards of damaged chunks reopened; None
    when the store is complete and whole."""
    from .writer import open_writer

    writer = open_writer(url, lock=True, break_lock=break_lock, storage_options=storage_options)
    damage = writer.find_damage()
    if damage:
        shards = writer.reopen(damage)
        log.warning("%s: %d chunk(s) of complete shards are missing or damaged, e.g. %s; rewriting shard(s) %s",
                    url, len(damage), damage[0], shards)
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
    from .writer import samples_per_chunk_for

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
