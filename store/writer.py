"""Write a store: create it, write blocks of samples into their shards, record progress, finish.

Only the mechanics: whether a store may be created, replaced or resumed where it goes is decided
by ``lifecycle``, which takes the store's lock (and clears what it replaces) before ``write_store``
writes a new store there.

Crash safety: the root (zarr.json with every attribute) is written first, then the arrays, then
the progress record, and the metadata is consolidated, so that whatever a kill leaves is either a
created store or a remnant that a job may replace (see ``state``). A shard is marked complete only
after its chunks are written; ``complete`` is set last, in the same write as the consolidated
metadata, and only after a check that every chunk of every shard is there. Every chunk ends with a
CRC-32C checksum.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
from dataclasses import dataclass

import numpy as np
import psutil
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec

from .errors import DamagedStoreError, IncompleteStoreError, StoreError, StoreLockedError
from .failures import release_after_failure
from .faults import crash_point
from .integrity import Damage, find_damage, guarded_group, obstacles, promises
from .location import Listing, Location, as_location, commit_metadata, group_arrays
from .lock import Heartbeat, acquire_lock, release_lock
from .names import PROGRESS_GROUP, is_lock_file
from .provenance import provenance
from .reader import consolidated_arrays, open_group_checked
from .schema import (
    DEFAULT_SITES,
    DIM_NAMES,
    PER_SAMPLE_DIMS,
    SCHEMA_VERSION,
    SITE_VARIABLES,
    WEIGHT_VARIABLES,
    bytes_per_sample,
    check_dtype,
    check_labels,
    check_model,
    check_sites,
    dim_sizes,
    holds_pred,
    item_size,
    label_missing_value,
    model_layers,
    resolved_dtype,
    transformer_lens_hook,
    variables_for,
)
from .stream import array_files

TARGET_CHUNK_BYTES = 4 * 2**20
CODECS = ("none", "zstd")
COORDINATE_BLOCK = 2**20
"""Index coordinates are written this many values at a time (memory stays flat in the sample count)."""
INDEX_DTYPE = "int64"
"""The index coordinates' dtype (sample, pos, layer, head, kv_head)."""
SPACE_MARGIN = 0.05
"""Room asked for beyond what the store will take: file-system metadata, the job's temporary files."""
METADATA_BYTES = 4096
"""An array's metadata file (zarr.json), at most: the store's space check counts this much for each."""
STRING_LABEL_BYTES = 16
"""A string label's bytes a position, before compression: the space check's upper estimate."""

log = logging.getLogger("orthosphere.store")


def samples_per_chunk_for(variables: dict, sizes: dict, dtype: str) -> int:
    """Samples per chunk so that the largest one-layer chunk holds about 4 MB."""
    largest = max(
        math.prod(sizes[d] for d in var.dims if d not in ("sample", "layer"))
        * item_size(var, dtype)
        for var in variables.values()
        if var.dims[0] == "sample"
    )
    return max(1, min(sizes["sample"], TARGET_CHUNK_BYTES // largest))


def shard_bounds(n_samples: int, samples_per_chunk: int, n_shards: int) -> list[list[int]]:
    """Split the samples into n_shards contiguous, chunk-aligned [start, stop) ranges."""
    n_chunks = math.ceil(n_samples / samples_per_chunk)
    n_shards = max(1, min(n_shards, n_chunks))
    edges = [round(i * n_chunks / n_shards) * samples_per_chunk for i in range(n_shards + 1)]
    return [[start, min(stop, n_samples)] for start, stop in zip(edges[:-1], edges[1:])]


@dataclass(frozen=True)
class NewStore:
    """A store to create, checked: its root attributes (all but its provenance, recorded when it is
    written) and its variables and their sizes."""

    attributes: dict
    variables: dict
    sizes: dict


def new_store(
    *,
    model: dict,
    task: dict,
    n_samples: int,
    n_pos: int,
    sites=DEFAULT_SITES,
    layers=None,
    dtype: str = "float32",
    labels: dict | None = None,
    with_weights: bool = True,
    samples_per_chunk: int | None = None,
    n_shards: int = 1,
    codec: str = "none",
    pred: bool = True,
) -> NewStore:
    """The store of schema v1 these arguments describe, or the error that names the first one that
    is wrong. pred=False leaves the model's predictions out (a job that stops the forward pass early
    has none)."""
    if not isinstance(task, dict):
        raise StoreError(f"task={task!r}: expected a dict describing the samples' data (the store's root attribute `task`)")
    model = check_model(model)
    sites = check_sites(sites)
    dtype = check_dtype(dtype)
    labels = check_labels(labels or {})
    layers = model_layers(layers, model["n_layers"])
    _check_count("n_samples", n_samples)
    _check_count("n_pos", n_pos)
    if codec not in CODECS:
        raise StoreError(f"codec {codec!r}: expected one of {list(CODECS)}")
    sizes = dim_sizes(model, n_samples, n_pos, len(layers))
    pred = holds_pred({"pred": pred, "model": model})
    variables = variables_for(sites, with_weights, pred)
    if samples_per_chunk is None:
        samples_per_chunk = samples_per_chunk_for(variables, sizes, dtype)
    _check_count("samples_per_chunk", samples_per_chunk)
    attributes = {
        "schema": SCHEMA_VERSION, "model": model, "task": task, "sites": list(sites), "layers": layers,
        "dtype": dtype, "labels": labels, "with_weights": with_weights, "n_samples": n_samples, "n_pos": n_pos,
        "samples_per_chunk": samples_per_chunk, "shards": shard_bounds(n_samples, samples_per_chunk, n_shards),
        "codec": codec, "pred": pred, "complete": False,
    }
    return NewStore(attributes, variables, sizes)


def write_store(location: Location, new: NewStore, holder: dict, command: str | None = None) -> StoreWriter:
    """Write the new store where nothing lies but its lock, which `holder` holds, and return its
    writer: the root with every attribute, then the arrays, then the progress record, then the
    consolidated metadata. A failure gives the lock back."""
    attributes, sizes = new.attributes, new.sizes
    samples_per_chunk = attributes["samples_per_chunk"]
    try:
        group = zarr.create_group(location.zarr_store(read_only=False), zarr_format=3,
                                  attributes={**attributes, "provenance": provenance(command)})
        crash_point("root-written")
        compressors = (Crc32cCodec(),) if attributes["codec"] == "none" else (ZstdCodec(level=1), Crc32cCodec())
        for name, var in new.variables.items():
            group.create_array(
                name, shape=tuple(sizes[d] for d in var.dims), chunks=_chunks(var.dims, sizes, samples_per_chunk),
                dtype=resolved_dtype(var, attributes["dtype"]), dimension_names=var.dims, fill_value=0,
                compressors=compressors, attributes=_array_attributes(name, attributes["model"]),
            )
            crash_point("array-created")
        _create_labels(group, attributes["labels"], sizes, samples_per_chunk)
        _create_index_coords(group, sizes, attributes["layers"])
        progress = group.create_group(PROGRESS_GROUP)
        progress.create_array("weights_written", shape=(1,), chunks=(1,), dtype="bool", fill_value=False)
        progress.create_array("shard_complete", shape=(len(attributes["shards"]),), chunks=(1,), dtype="bool",
                              fill_value=False)
        crash_point("progress-created")
        group = commit_metadata(location)
    except BaseException:
        release_after_failure(lambda: release_lock(location), location.url)
        raise
    return StoreWriter(location, group, holder)


def _array_attributes(name: str, model: dict) -> dict:
    """A site's TransformerLens hook (store/SCHEMA.md); other arrays carry no attributes."""
    if name not in SITE_VARIABLES:
        return {}
    return {"transformer_lens": transformer_lens_hook(name, model)}


def open_writer(url, *, lock: bool = True, break_lock: bool = False, storage_options: dict | None = None) -> StoreWriter:
    """Reopen an existing store for writing: with its lock (a resuming job) or without (a shard worker of the job that holds it)."""
    location = as_location(url, storage_options)
    group = open_group_checked(location, mode="r+")
    holder = acquire_lock(location, break_lock=break_lock) if lock else None
    return StoreWriter(location, group, holder)


class StoreWriter:
    """Writes blocks of samples into a store; one shard's blocks never touch another shard's chunks.

    A writer that holds the store's lock keeps its heartbeat going, and stops writing (raises
    StoreLockedError) if another writer broke the lock."""

    def __init__(self, location: Location, group: zarr.Group, holder: dict | None):
        self.location = location
        self.group = group
        self.attrs = dict(group.attrs)
        self.holder = holder
        self.heartbeat = Heartbeat(location, holder) if holder is not None else None
        self._written: dict[int, set[str]] = {}
        self._writable: dict[str, zarr.Array] = {}

    @property
    def url(self) -> str:
        return self.location.url

    @property
    def holds_lock(self) -> bool:
        return self.holder is not None

    @property
    def shards(self) -> list[tuple[int, int]]:
        return [tuple(bounds) for bounds in self.attrs["shards"]]

    def shard_complete(self) -> np.ndarray:
        return self.group[f"{PROGRESS_GROUP}/shard_complete"][:]

    def weights_written(self) -> bool:
        return bool(self.group[f"{PROGRESS_GROUP}/weights_written"][0])

    def pending_shards(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(~self.shard_complete())]

    def shard_of(self, start: int, stop: int) -> int:
        """The shard that holds samples [start, stop); a block may not straddle shards."""
        for index, (first, last) in enumerate(self.shards):
            if first <= start and stop <= last:
                return index
        raise StoreError(
            f"samples [{start}, {stop}) do not lie inside one shard of {self.url} "
            f"(shards: {self.shards}); write each shard's samples separately"
        )

    def write(self, start: int, arrays: dict) -> None:
        """Write samples [start, start + n) of every named array (sample first, all stored layers)."""
        self._check_lock()
        lengths = {len(values) for values in arrays.values()}
        if len(lengths) != 1:
            raise StoreError(f"arrays written together must have the same sample count, got {sorted(lengths)}")
        stop = start + lengths.pop()
        self.note_written(start, stop, arrays)
        for name, values in arrays.items():
            target = self.per_sample_array(name)
            expected = (stop - start,) + target.shape[1:]
            if tuple(np.shape(values)) != expected:
                raise StoreError(
                    f"array {name!r} has shape {tuple(np.shape(values))}: expected {expected} "
                    f"(dims {target.metadata.dimension_names}) for samples [{start}, {stop})"
                )
            target[start:stop] = np.asarray(values)

    def note_written(self, start: int, stop: int, names) -> None:
        """Record that samples [start, stop) of the named arrays are (being) written, by this writer
        or by a ChunkStream of it, so that completing their shard does not fill them."""
        self._check_lock()
        self._written.setdefault(self.shard_of(start, stop), set()).update(names)

    def write_weights(self, arrays: dict) -> None:
        """Write the per-layer attention maps (all of w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o)."""
        self._check_lock()
        if not self.attrs["with_weights"]:
            raise StoreError(f"store {self.url} was created with with_weights=False")
        missing = sorted(set(WEIGHT_VARIABLES) - set(arrays))
        if missing:
            raise StoreError(f"write_weights needs every map; missing {missing}")
        for name in WEIGHT_VARIABLES:
            target = writable(self.group, name)
            if tuple(arrays[name].shape) != target.shape:
                raise StoreError(
                    f"weights {name!r} have shape {tuple(arrays[name].shape)}: expected {target.shape} "
                    f"(dims {target.metadata.dimension_names})"
                )
            values = np.asarray(arrays[name], dtype="float32")
            files = array_files(self.location, name, target)
            if files is None:
                target[...] = values
            else:  # straight into the chunk files, zarr's bytes (store.stream): a third of the time
                files.write(0, values)
        self.group[f"{PROGRESS_GROUP}/weights_written"][0] = True

    def mark_shard_complete(self, index: int, written_elsewhere=()) -> None:
        """Record the shard complete. Per-sample arrays that neither this writer nor another one
        (`written_elsewhere`: e.g. a corpus's tokens, written by the job's coordinating process) wrote
        in the shard get their fill value (0; labels: not applicable) first, so that a complete shard
        has every chunk."""
        self._check_lock()
        start, stop = self.shards[index]
        written = self._written.pop(index, set()) | set(written_elsewhere)
        for name in sorted(set(self.per_sample_names()) - written):
            target = self.per_sample_array(name)
            for first in range(start, stop, self.attrs["samples_per_chunk"]):
                last = min(first + self.attrs["samples_per_chunk"], stop)
                target[first:last] = np.full((last - first,) + target.shape[1:], target.fill_value, dtype=target.dtype)
        self.group[f"{PROGRESS_GROUP}/shard_complete"][index] = True

    def is_finished(self) -> bool:
        """Whether the job finished: `complete` set, with the metadata consolidated."""
        return bool(self.group.attrs.get("complete")) and self.group.metadata.consolidated_metadata is not None

    def find_damage(self, decode: bool = False, decode_strings: bool = True, files: Listing | None = None) -> list[Damage]:
        """The chunks that complete shards (and written weights) promise but that are missing or
        of the wrong size (with `decode`: that do not decode; strings: see integrity.find_damage), in
        `files` (default: a listing taken now). The lock holder also removes the temporary files of
        writes that a kill interrupted (the lock's own are left to it: releasing the lock removes them)."""
        files = self.location.list_files() if files is None else files
        if self.holds_lock:
            for key in [key for key in files if key.endswith(".partial") and not is_lock_file(key)]:
                self.location.remove_entry(key)
        promised = promises(self.group, self.attrs, self.shard_complete(), self.weights_written())
        group = guarded_group(self.location, promised) if decode else self.group
        return find_damage(group, promised, files, decode=decode, decode_strings=decode_strings)

    def obstacles(self, files: Listing) -> list[str]:
        """The directories in `files` (the store's listing) that stand where chunk files of the store go: no
        write can replace them."""
        return obstacles(promises(self.group, self.attrs, self.shard_complete(), self.weights_written()), files)

    def restore_metadata(self) -> list[str]:
        """Write back the metadata (NAME/zarr.json) of every array that the root's consolidated metadata
        still describes but whose own file is gone (a deleted array folder, or its zarr.json alone), so
        that the store's readers and ``find_damage`` see the array again; returns their names."""
        self._check_lock()
        described = consolidated_arrays(self.location)
        files = self.location.list_files()
        lost = sorted(name for name in described if f"{name}/zarr.json" not in files)
        for name in lost:
            if self.location.is_local:
                os.makedirs(os.path.dirname(self.location.key(f"{name}/zarr.json")), exist_ok=True)
            self.location.write_atomic(f"{name}/zarr.json", json.dumps(described[name]).encode())
        return lost

    def reopen(self, damage: list[Damage]) -> list[int]:
        """Mark the store incomplete and the shards (or weights) holding damaged chunks unwritten,
        so that resuming the job rewrites them; index coordinates are rewritten here. Returns the
        shards reopened."""
        self._check_lock()
        self.group.attrs["complete"] = False
        self.attrs["complete"] = False
        shards = sorted({item.shard for item in damage if item.shard is not None})
        for index in shards:
            self.group[f"{PROGRESS_GROUP}/shard_complete"][index] = False
        if any(item.array in WEIGHT_VARIABLES for item in damage):
            self.group[f"{PROGRESS_GROUP}/weights_written"][0] = False
        if any(item.array in DIM_NAMES for item in damage):
            _write_index_coords(self.group, self.attrs)
        return shards

    def finish(self) -> None:
        """Mark the store complete (every shard done, weights written, every chunk there) and
        consolidate its metadata, in that order."""
        self._check_lock()
        pending = self.pending_shards()
        if pending:
            raise IncompleteStoreError(
                f"cannot finish {self.url}: {len(pending)} of {len(self.shards)} shards are not complete "
                f"(shards {pending[:10]}{'...' if len(pending) > 10 else ''}); "
                'resume the job (mode="resume") to write them and finish the store'
            )
        if self.attrs["with_weights"] and not self.weights_written():
            raise IncompleteStoreError(f"cannot finish {self.url}: the attention maps were never written (write_weights)")
        damage = self.find_damage(decode_strings=False)  # the chunks this job wrote: their sizes and listing
        if damage:
            self.reopen(damage)
            raise DamagedStoreError.of(self.url, damage)
        group = commit_metadata(self.location)
        crash_point("finish-consolidated")
        group.attrs["complete"] = True
        self.group, self.attrs["complete"] = group, True
        crash_point("finished")
        self.close()

    def close(self) -> None:
        """Give the lock back; an unfinished store stays marked incomplete."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None
        if self.holder is not None:
            release_lock(self.location)
            self.holder = None

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        """Give the lock back; after a failure, a failure to give it back is logged and the first one raised."""
        if error is None:
            self.close()
        else:
            release_after_failure(self.close, self.url)

    def _check_lock(self) -> None:
        if self.heartbeat is not None and self.heartbeat.failure:
            raise StoreLockedError(self.heartbeat.failure)

    def per_sample_array(self, name: str) -> zarr.Array:
        """The per-sample array `name`, opened for writing (every chunk written)."""
        if name not in self._writable:
            array = self.group.get(name) if name != "sample" else None
            if not isinstance(array, zarr.Array) or array.metadata.dimension_names[0] != "sample":
                raise StoreError(
                    f"store {self.url} has no per-sample array {name!r}: expected one of {self.per_sample_names()}"
                )
            self._writable[name] = writable(self.group, name)
        return self._writable[name]

    def per_sample_names(self) -> list[str]:
        return sorted(name for name, array in group_arrays(self.group) if name != "sample" and array.metadata.dimension_names[0] == "sample")


def writable(group: zarr.Group, name: str) -> zarr.Array:
    """The array, opened so that every chunk is written, even one equal to the fill value: a
    missing chunk is then always damage."""
    with zarr.config.set({"array.write_empty_chunks": True}):
        return group[name]


def _check_count(name: str, value) -> None:
    if not isinstance(value, (int, np.integer)) or value < 1:
        raise StoreError(f"{name}={value!r}: expected a positive integer")


def check_room(location: Location, new: NewStore) -> None:
    """Refuse, before anything is written, a store larger than the room where it goes (what it will
    take there, with a margin), or whose sample coordinate, which every reader loads into memory,
    would not fit in memory."""
    attributes, variables, sizes = new.attributes, new.variables, new.sizes
    dtype, samples_per_chunk = attributes["dtype"], attributes["samples_per_chunk"]
    available = psutil.virtual_memory().available
    room = _room(location, available)
    if room is not None:
        free, holder, block = room
        needed = store_footprint(variables, attributes["labels"], sizes, dtype, samples_per_chunk, len(attributes["shards"]), block)
        wanted = math.ceil(needed * (1 + SPACE_MARGIN))
        if wanted > free:
            raise StoreError(
                f"n_samples={sizes['sample']}: the store would take {_bytes(needed)} there "
                f"({_bytes(wanted)} with a {SPACE_MARGIN:.0%} margin; "
                f"{_bytes(bytes_per_sample(variables, sizes, dtype))} a sample) but {holder} {_bytes(free)} "
                "free; ask for fewer samples, sites or layers, or write it elsewhere"
            )
    per_index = np.dtype(INDEX_DTYPE).itemsize
    if per_index * sizes["sample"] > available:
        raise StoreError(
            f"n_samples={sizes['sample']}: the store's sample coordinate, which every reader "
            f"loads into memory, would need {_bytes(per_index * sizes['sample'])} ({per_index} bytes a sample) "
            f"but this machine has {_bytes(available)} of memory available; ask for fewer samples"
        )


def store_footprint(variables: dict, labels: dict, sizes: dict, dtype: str, samples_per_chunk: int, n_shards: int,
                    block: int = 1) -> int:
    """Bytes a finished store takes where every file fills whole blocks of `block` bytes: each chunk
    file (a short last chunk padded whole, its checksum), uncompressed; each array's metadata and
    the root's consolidated copy of it; the index coordinates and the progress record."""
    arrays = [(_chunks(var.dims, sizes, samples_per_chunk), [sizes[d] for d in var.dims], item_size(var, dtype))
              for var in variables.values()]
    arrays += [((samples_per_chunk, sizes["pos"]), (sizes["sample"], sizes["pos"]),
                STRING_LABEL_BYTES if label == "str" else np.dtype(label).itemsize) for label in labels.values()]
    arrays += [((min(sizes[dim], COORDINATE_BLOCK),), (sizes[dim],), np.dtype(INDEX_DTYPE).itemsize)
               for dim in DIM_NAMES]
    arrays += [((1,), (1,), 1), ((1,), (n_shards,), 1)]  # the progress record
    # each array's zarr.json, the progress group's, and the root's, which holds a copy of them all (consolidated)
    total = (len(arrays) + 1) * _whole_blocks(METADATA_BYTES, block) + _whole_blocks(len(arrays) * METADATA_BYTES, block)
    for chunk, shape, item in arrays:
        n_chunks = math.prod(math.ceil(length / size) for length, size in zip(shape, chunk))
        total += n_chunks * _whole_blocks(math.prod(chunk) * item + 4, block)
    return total


def _whole_blocks(count: int, block: int) -> int:
    return -(-count // block) * block


def _room(location: Location, available_memory: int) -> tuple[int, str, int] | None:
    """The bytes free where the store goes, what holds them (for the message) and the size of its
    blocks (every file takes whole blocks); None where unknown (object storage)."""
    if location.is_local:
        folder = location.local_path
        while not os.path.exists(folder):
            folder = os.path.dirname(folder)
        return shutil.disk_usage(folder).free, f"{folder} has", os.statvfs(folder).f_frsize or 1
    if location.in_memory:
        return available_memory, "a memory:// store lives in this process's memory, which has", 1
    return None


def _bytes(count: float) -> str:
    for unit in ("bytes", "kB", "MB", "GB", "TB", "PB"):
        if count < 1000 or unit == "PB":
            return f"{count:,.0f} {unit}" if unit == "bytes" else f"{count:,.1f} {unit}"
        count /= 1000
    return ""


def _chunks(dims, sizes: dict, samples_per_chunk: int) -> tuple[int, ...]:
    """Chunks along sample only, one layer per chunk."""
    return tuple(
        samples_per_chunk if d == "sample" else 1 if d == "layer" else sizes[d] for d in dims
    )


def _create_labels(group: zarr.Group, labels: dict, sizes: dict, samples_per_chunk: int) -> None:
    for name, dtype in labels.items():
        missing = label_missing_value(dtype)
        group.create_array(
            name,
            shape=(sizes["sample"], sizes["pos"]),
            chunks=(samples_per_chunk, sizes["pos"]),
            dtype=dtype,
            dimension_names=PER_SAMPLE_DIMS,
            fill_value=missing,
            compressors=(ZstdCodec(level=1), Crc32cCodec()),
            attributes={"not_applicable": missing},
        )
    if labels:
        # xarray reads the names listed in a variable's "coordinates" attribute as coordinates.
        group["tokens"].attrs["coordinates"] = " ".join(labels)


def _create_index_coords(group: zarr.Group, sizes: dict, layers: list[int]) -> None:
    for dim in DIM_NAMES:
        length = len(layers) if dim == "layer" else sizes[dim]
        group.create_array(dim, shape=(length,), chunks=(min(length, COORDINATE_BLOCK),), dtype=INDEX_DTYPE,
                           dimension_names=(dim,), compressors=(Crc32cCodec(),))
    _write_index_coords(group, group.attrs)


def _write_index_coords(group: zarr.Group, attrs) -> None:
    """The index coordinates' values: 0..n-1, the stored layers for `layer`."""
    for dim in DIM_NAMES:
        array = writable(group, dim)
        if dim == "layer":
            array[...] = np.asarray(attrs["layers"])
            continue
        for start in range(0, array.shape[0], COORDINATE_BLOCK):
            stop = min(start + COORDINATE_BLOCK, array.shape[0])
            array[start:stop] = np.arange(start, stop)
