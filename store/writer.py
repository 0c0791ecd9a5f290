"""Create a store, write blocks of samples into their shards, record progress, finish."""
from __future__ import annotations

import math

import numpy as np
import zarr
from zarr.codecs import ZstdCodec

from . import schema
from .errors import IncompleteStoreError, StoreError, StoreExistsError
from .location import Location, as_location, group_arrays, zarr_quietly
from .lock import acquire_lock, release_lock
from .provenance import provenance

PROGRESS_GROUP = "_progress"
TARGET_CHUNK_BYTES = 4 * 2**20
CODECS = ("none", "zstd")



def consolidate(group: zarr.Group) -> None:
    with zarr_quietly():
        zarr.consolidate_metadata(group.store)


def samples_per_chunk_for(variables: dict, sizes: dict, dtype: str) -> int:
    """Samples per chunk so that the largest one-layer chunk holds about 4 MB."""
    largest = max(
        math.prod(sizes[d] for d in var.dims if d not in ("sample", "layer"))
        * np.dtype(schema.resolved_dtype(var, dtype)).itemsize
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


def create_store(
    url,
    *,
    model: dict,
    task: dict,
    n_samples: int,
    n_pos: int,
    sites=schema.DEFAULT_SITES,
    layers=None,
    dtype: str = "float32",
    labels: dict | None = None,
    with_weights: bool = True,
    samples_per_chunk: int | None = None,
    n_shards: int = 1,
    codec: str = "none",
    overwrite: bool = False,
    break_lock: bool = False,
    command: str | None = None,
    storage_options: dict | None = None,
) -> StoreWriter:
    """Create an empty store of schema v1 and return its writer, which holds the store's lock."""
    location = as_location(url, storage_options)
    model = schema.check_model(model)
    sites = schema.check_sites(sites)
    dtype = schema.check_dtype(dtype)
    labels = schema.check_labels(labels or {})
    layers = _check_layers(layers, model["n_layers"])
    _check_count("n_samples", n_samples)
    _check_count("n_pos", n_pos)
    if codec not in CODECS:
        raise StoreError(f"codec {codec!r}: expected one of {list(CODECS)}")
    _make_room(location, overwrite, break_lock)

    sizes = schema.dim_sizes(model, n_samples, n_pos, len(layers))
    variables = schema.variables_for(sites, with_weights)
    if samples_per_chunk is None:
        samples_per_chunk = samples_per_chunk_for(variables, sizes, dtype)
    _check_count("samples_per_chunk", samples_per_chunk)
    shards = shard_bounds(n_samples, samples_per_chunk, n_shards)

    group = zarr.open_group(location.zarr_store(read_only=False), mode="w", zarr_format=3)
    acquire_lock(location, break_lock=True)
    compressors = None if codec == "none" else ZstdCodec(level=1)
    for name, var in variables.items():
        group.create_array(
            name,
            shape=tuple(sizes[d] for d in var.dims),
            chunks=_chunks(var.dims, sizes, samples_per_chunk),
            dtype=schema.resolved_dtype(var, dtype),
            dimension_names=var.dims,
            fill_value=0,
            compressors=compressors,
            # Activations are never all zero: skip zarr's scan for empty chunks on every write.
            config={"write_empty_chunks": True},
        )
    _create_labels(group, labels, sizes, samples_per_chunk)
    _create_index_coords(group, sizes, layers)
    progress = group.create_group(PROGRESS_GROUP)
    progress.create_array("shard_complete", shape=(len(shards),), chunks=(1,), dtype="bool", fill_value=False)
    progress.create_array("weights_written", shape=(1,), chunks=(1,), dtype="bool", fill_value=False)
    group.attrs.update(
        {
            "schema": schema.SCHEMA_VERSION,
            "model": model,
            "task": task,
            "sites": list(sites),
            "layers": layers,
            "dtype": dtype,
            "labels": labels,
            "with_weights": with_weights,
            "n_samples": n_samples,
            "n_pos": n_pos,
            "samples_per_chunk": samples_per_chunk,
            "shards": shards,
            "codec": codec,
            "complete": False,
            "provenance": provenance(command),
        }
    )
    consolidate(group)
    return StoreWriter(location, group, holds_lock=True)


def open_writer(url, *, lock: bool = True, break_lock: bool = False, storage_options: dict | None = None) -> StoreWriter:
    """Reopen an existing store for writing: with its lock (a resuming job) or without (a shard worker of the job that holds it)."""
    location = as_location(url, storage_options)
    from .reader import open_group_checked

    group = open_group_checked(location, mode="r+")
    if lock:
        acquire_lock(location, break_lock=break_lock)
    return StoreWriter(location, group, holds_lock=lock)


class StoreWriter:
    """Writes blocks of samples into a store; one shard's blocks never touch another shard's chunks."""

    def __init__(self, location: Location, group: zarr.Group, holds_lock: bool):
        self.location = location
        self.group = group
        self.attrs = dict(group.attrs)
        self.holds_lock = holds_lock

    @property
    def url(self) -> str:
        return self.location.url

    @property
    def shards(self) -> list[tuple[int, int]]:
        return [tuple(bounds) for bounds in self.attrs["shards"]]

    def shard_complete(self) -> np.ndarray:
        return self.group[f"{PROGRESS_GROUP}/shard_complete"][:]

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
        lengths = {len(values) for values in arrays.values()}
        if len(lengths) != 1:
            raise StoreError(f"arrays written together must have the same sample count, got {sorted(lengths)}")
        stop = start + lengths.pop()
        self.shard_of(start, stop)
        for name, values in arrays.items():
            target = self._array(name)
            expected = (stop - start,) + target.shape[1:]
            if tuple(np.shape(values)) != expected:
                raise StoreError(
                    f"array {name!r} has shape {tuple(np.shape(values))}: expected {expected} "
                    f"(dims {target.metadata.dimension_names}) for samples [{start}, {stop})"
                )
            target[start:stop] = np.asarray(values)

    def write_weights(self, arrays: dict) -> None:
        """Write the per-layer attention maps (all of w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o)."""
        if not self.attrs["with_weights"]:
            raise StoreError(f"store {self.url} was created with with_weights=False")
        missing = sorted(set(schema.WEIGHT_VARIABLES) - set(arrays))
        if missing:
            raise StoreError(f"write_weights needs every map; missing {missing}")
        for name in schema.WEIGHT_VARIABLES:
            target = self.group[name]
            if tuple(arrays[name].shape) != target.shape:
                raise StoreError(
                    f"weights {name!r} have shape {tuple(arrays[name].shape)}: expected {target.shape} "
                    f"(dims {target.metadata.dimension_names})"
                )
            target[...] = np.asarray(arrays[name], dtype="float32")
        self.group[f"{PROGRESS_GROUP}/weights_written"][0] = True

    def weights_written(self) -> bool:
        return bool(self.group[f"{PROGRESS_GROUP}/weights_written"][0])

    def mark_shard_complete(self, index: int) -> None:
        self.group[f"{PROGRESS_GROUP}/shard_complete"][index] = True

    def finish(self) -> None:
        """Mark the store complete (every shard done, weights written) and consolidate metadata."""
        pending = self.pending_shards()
        if pending:
            raise IncompleteStoreError(
                f"cannot finish {self.url}: {len(pending)} of {len(self.shards)} shards are not complete "
                f"(shards {pending[:10]}{'...' if len(pending) > 10 else ''}); write them, then finish"
            )
        if self.attrs["with_weights"] and not self.weights_written():
            raise IncompleteStoreError(f"cannot finish {self.url}: the attention maps were never written (write_weights)")
        self.group.attrs["complete"] = True
        self.attrs["complete"] = True
        consolidate(self.group)
        self.close()

    def close(self) -> None:
        """Give the lock back; an unfinished store stays marked incomplete."""
        if self.holds_lock:
            release_lock(self.location)
            self.holds_lock = False

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _array(self, name: str) -> zarr.Array:
        array = self.group.get(name) if name != "sample" else None
        if not isinstance(array, zarr.Array) or array.metadata.dimension_names[0] != "sample":
            raise StoreError(
                f"store {self.url} has no per-sample array {name!r}: expected one of {self.per_sample_names()}"
            )
        return array

    def per_sample_names(self) -> list[str]:
        return sorted(name for name, array in group_arrays(self.group) if name != "sample" and array.metadata.dimension_names[0] == "sample")


def _check_count(name: str, value) -> None:
    if not isinstance(value, (int, np.integer)) or value < 1:
        raise StoreError(f"{name}={value!r}: expected a positive integer")


def _check_layers(layers, n_layers: int) -> list[int]:
    """Stored layer indices, sorted and unique; each must exist in the model."""
    if layers is None:
        return list(range(n_layers))
    layers = sorted({int(layer) for layer in layers})
    outside = [layer for layer in layers if not 0 <= layer < n_layers]
    if outside or not layers:
        raise StoreError(
            f"layer(s) {outside or 'none'} out of range: the model has {n_layers} layers, "
            f"expected indices 0..{n_layers - 1}"
        )
    return layers


def _make_room(location: Location, overwrite: bool, break_lock: bool) -> None:
    """Refuse to replace an existing store unless asked; never delete what is not a store."""
    if not location.exists():
        return
    if location.is_zarr():
        if not overwrite:
            raise StoreExistsError(
                f"a store already exists at {location.url}: pass overwrite=True (CLI: --overwrite) "
                "to replace it, or resume it (CLI: --resume)"
            )
        acquire_lock(location, break_lock=break_lock)
        location.remove()
    elif not location.is_empty_dir():
        raise StoreError(
            f"{location.url} exists and is not a Zarr store; refusing to write into it or delete it: "
            "choose a new path"
        )


def _chunks(dims, sizes: dict, samples_per_chunk: int) -> tuple[int, ...]:
    """Chunks along sample only, one layer per chunk."""
    return tuple(
        samples_per_chunk if d == "sample" else 1 if d == "layer" else sizes[d] for d in dims
    )


def _create_labels(group: zarr.Group, labels: dict, sizes: dict, samples_per_chunk: int) -> None:
    for name, dtype in labels.items():
        missing = schema.label_missing_value(dtype)
        array = group.create_array(
            name,
            shape=(sizes["sample"], sizes["pos"]),
            chunks=(samples_per_chunk, sizes["pos"]),
            dtype=dtype,
            dimension_names=schema.PER_SAMPLE_DIMS,
            fill_value=missing,
        )
        array.attrs["not_applicable"] = missing
    if labels:
        # xarray reads the names listed in a variable's "coordinates" attribute as coordinates.
        group["tokens"].attrs["coordinates"] = " ".join(labels)


def _create_index_coords(group: zarr.Group, sizes: dict, layers: list[int]) -> None:
    values = {dim: np.arange(sizes[dim]) for dim in schema.DIM_NAMES if dim != "layer"}
    values["layer"] = np.asarray(layers)
    for dim, coord in values.items():
        array = group.create_array(dim, shape=coord.shape, dtype="int64", dimension_names=(dim,))
        array[...] = coord
