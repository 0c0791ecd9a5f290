"""Every chunk a store promises, checked, so that a missing or damaged chunk is never read as fill
values or reported without its name.

A store promises every chunk of every per-sample array inside a shard marked complete, every
chunk of the weight maps once they are written, and every chunk of the index coordinates.
``find_damage`` checks that each is there and has its encoded size (one listing of the store);
``find_damage(..., decode=True)`` also decodes each (checksums included). ``GuardedStore``
wraps the zarr store an opened dataset reads through: reading a promised chunk that is missing,
of the wrong size or failing its CRC-32C checksum raises ``DamagedStoreError`` naming the array
and chunk, where zarr would return fill values or a bare checksum error.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import product

import google_crc32c
import numpy as np
import zarr
from zarr.storage import WrapperStore

from .errors import DamagedStoreError, StorageFailureError
from .location import Listing, group_arrays, zarr_quietly
from .names import PROGRESS_GROUP
from .schema import WEIGHT_VARIABLES
from .state import INDEX_ARRAYS

FIXED_SIZE_CODECS = {"bytes", "crc32c"}
DIRECTORY_PROBLEM = "a directory where the chunk file should be: remove it"
LINK_PROBLEM = "a symbolic link where a chunk file should be: replace it with the file it points to, or remove it"


@dataclass(frozen=True)
class Damage:
    """One promised chunk that is missing, of the wrong size or does not decode."""

    array: str
    chunk: tuple[int, ...]
    where: str
    problem: str
    shard: int | None
    """The job shard that wrote the chunk (None: written with the store or the weight maps)."""
    listed: bool = True
    """Whether a listing of the store shows it (missing, wrong size); if not, only a read does."""

    def __str__(self) -> str:
        return f"array {self.array!r} chunk {self.chunk} ({self.where}): {self.problem}"


@dataclass(frozen=True, eq=False)
class ArrayPromise:
    """Which chunks of one array must exist, their keys, sizes and where they lie."""

    name: str
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    encoding: object
    layers: tuple[int, ...]
    size: int | None
    """Encoded bytes of every chunk, when the codecs fix it (no compression)."""
    checksum: bool
    written: bool
    """False for weight maps not written yet: no chunk is promised."""
    shard_of_chunk: np.ndarray | None
    """Per-sample arrays: the shard of each chunk along sample (-1 where not every overlapping
    shard is complete: not promised); None for arrays without a sample dim."""

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(math.ceil(n / c) for n, c in zip(self.shape, self.chunk_shape))

    def promised(self, coords: tuple[int, ...]) -> bool:
        if not self.written:
            return False
        return self.shard_of_chunk is None or self.shard_of_chunk[coords[0]] >= 0

    def shard(self, coords: tuple[int, ...]) -> int | None:
        return None if self.shard_of_chunk is None else int(self.shard_of_chunk[coords[0]])

    def key(self, coords: tuple[int, ...]) -> str:
        return f"{self.name}/{self.encoding.encode_chunk_key(coords)}"

    def where(self, coords: tuple[int, ...]) -> str:
        parts = []
        for dim, index, chunk, length in zip(self.dims, coords, self.chunk_shape, self.shape):
            if chunk >= length:
                continue
            first, last = index * chunk, min((index + 1) * chunk, length) - 1
            if dim == "layer" and chunk == 1 and index < len(self.layers):
                parts.append(f"layer {self.layers[index]}")
            elif first == last:
                parts.append(f"{dim} {first}")
            else:
                parts.append(f"{'samples' if dim == 'sample' else dim} {first}-{last}")
        return ", ".join(parts) or "the whole array"

    def coords_of(self, chunk_key: str) -> tuple[int, ...] | None:
        """The coordinates of a chunk key of this array, or None when it is not one."""
        parts = chunk_key.split(getattr(self.encoding, "separator", "/"))
        if parts[:1] == ["c"]:
            parts = parts[1:]
        try:
            coords = tuple(int(part) for part in parts)
        except ValueError:
            return None
        if len(coords) != len(self.shape) or self.encoding.encode_chunk_key(coords) != chunk_key:
            return None
        return coords

    def chunks(self) -> Iterator[tuple[int, ...]]:
        """The promised chunks' coordinates."""
        return (coords for coords in product(*(range(n) for n in self.grid)) if self.promised(coords))

    def damage(self, coords: tuple[int, ...], problem: str, listed: bool = True) -> Damage:
        return Damage(self.name, coords, self.where(coords), problem, self.shard(coords), listed)

    def check_listed(self, coords: tuple[int, ...], files: Listing) -> Damage | None:
        """The damage of the chunk as the store's listing (location.Listing) shows it: a directory or a
        symbolic link where its file should be, missing, or of the wrong size."""
        key = self.key(coords)
        if key in files.links:
            return self.damage(coords, LINK_PROBLEM)
        if key in files.directories:
            return self.damage(coords, DIRECTORY_PROBLEM)
        return self.check_size(coords, files.get(key))

    def check_size(self, coords: tuple[int, ...], size: int | None) -> Damage | None:
        """The damage of a chunk of `size` encoded bytes (None: missing), if any."""
        if size is None:
            return self.damage(coords, "missing")
        if self.size is not None and size != self.size:
            return self.damage(coords, f"has {size} bytes, expected {self.size} (truncated or overwritten)")
        return None

    def check_bytes(self, coords: tuple[int, ...], data) -> Damage | None:
        """The damage of a chunk's encoded bytes (None: missing): size, then checksum."""
        damage = self.check_size(coords, None if data is None else len(data))
        if damage is None and data is not None and self.checksum and len(data) >= 4:
            data = np.ascontiguousarray(data, dtype=np.uint8)
            damage = self.check_checksum(coords, google_crc32c.value(data[:-4]), data[-4:])
        return damage

    def check_checksum(self, coords: tuple[int, ...], computed: int, stored) -> Damage | None:
        """The damage of a chunk whose values' CRC-32C is `computed` and whose last 4 bytes are `stored`."""
        if computed != int.from_bytes(bytes(stored), "little"):
            return self.damage(coords, "fails its CRC-32C checksum (overwritten or corrupted)", listed=False)
        return None


def promises(group: zarr.Group, attrs: dict, shard_complete: np.ndarray, weights_written: bool) -> dict[str, ArrayPromise]:
    """What each array of the store promises, given which shards are complete."""
    shards = [tuple(bounds) for bounds in attrs.get("shards", [])]
    layers = tuple(attrs.get("layers", ()))
    result = {}
    for name, array in group_arrays(group):
        if name.startswith(PROGRESS_GROUP):
            continue
        dims = tuple(array.metadata.dimension_names or ())
        metadata = array.metadata
        chunk_shape = tuple(metadata.chunk_grid.chunk_shape)
        codecs = [codec.to_dict()["name"] for codec in metadata.codecs]
        size = None
        if set(codecs) <= FIXED_SIZE_CODECS and np.dtype(array.dtype).kind not in "OTU":
            size = math.prod(chunk_shape) * np.dtype(array.dtype).itemsize + 4 * ("crc32c" in codecs)
        if dims[:1] == ("sample",) and name not in INDEX_ARRAYS:
            written, shard_of_chunk = True, _shard_of_chunks(array.shape[0], chunk_shape[0], shards, shard_complete)
        elif name in WEIGHT_VARIABLES:
            written, shard_of_chunk = weights_written, None
        elif name in INDEX_ARRAYS:
            written, shard_of_chunk = True, None
        else:
            continue  # an array this version does not know: no promise to check
        result[name] = ArrayPromise(name, dims, tuple(array.shape), chunk_shape, metadata.chunk_key_encoding, layers,
                                    size, "crc32c" in codecs, written, shard_of_chunk)
    return result


def _shard_of_chunks(n_samples: int, chunk: int, shards: list[tuple[int, int]], complete: np.ndarray) -> np.ndarray:
    """For each chunk along sample, the first shard it overlaps when every shard it overlaps is
    complete, else -1 (shards are contiguous and sorted)."""
    starts = np.arange(math.ceil(n_samples / chunk)) * chunk
    stops = np.minimum(starts + chunk, n_samples)
    if not shards:
        return np.full(len(starts), -1, dtype=np.int64)
    bounds = np.asarray(shards, dtype=np.int64)
    first = np.searchsorted(bounds[:, 1], starts, side="right")  # the first shard ending after the chunk starts
    last = np.searchsorted(bounds[:, 0], stops, side="left") - 1  # the last shard starting before it stops
    unfinished = np.concatenate([[0], np.cumsum(~np.asarray(complete, dtype=bool))])
    whole = (first <= last) & (unfinished[np.maximum(last, first - 1) + 1] == unfinished[first])
    return np.where(whole, first, -1)


def find_damage(group: zarr.Group, promised: dict[str, ArrayPromise], files: Listing,
                decode: bool = False, decode_strings: bool = True) -> list[Damage]:
    """Every promised chunk that is missing or of the wrong size (`files`: the store's listing),
    and with `decode`, every one that does not decode (`group` opened on a GuardedStore, so that
    a checksum failure is reported as such). Chunks whose size the codecs do not fix (strings: the
    labels' token_str, role ...) are decoded unless `decode_strings` is False (opening a store for
    reading: its reads check every chunk's checksum anyway): their size says nothing of a truncation."""
    damage = []
    for name, promise in promised.items():
        decoded = decode or (decode_strings and promise.size is None)
        array = group[name] if decoded else None
        for coords in promise.chunks():
            found = promise.check_listed(coords, files)
            if found is None and decoded:
                found = _decode_damage(array, promise, coords)
            if found is not None:
                damage.append(found)
    return damage


def obstacles(promised: dict[str, ArrayPromise], files: Listing) -> list[str]:
    """The paths inside the store of the directories that stand where any chunk of its arrays
    goes, promised or not (`files`: its location.Listing): a job writing that chunk would fail."""
    found = []
    for directory in sorted(files.directories):
        name, _, chunk_key = directory.partition("/")
        promise = promised.get(name)
        if promise is not None and promise.coords_of(chunk_key) is not None:
            found.append(directory)
    return found


def _decode_damage(array: zarr.Array, promise: ArrayPromise, coords: tuple[int, ...]) -> Damage | None:
    selection = tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(coords, promise.chunk_shape, promise.shape))
    try:
        array[selection]
    except DamagedStoreError as error:
        return error.damage[0]
    except StorageFailureError:
        raise  # the storage failed reading it: no verdict on the chunk
    except Exception as error:  # whatever the codecs raise on bytes that are not theirs
        return promise.damage(coords, f"does not decode ({type(error).__name__}: {error})", listed=False)
    return None


def guarded_group(location, promised: dict[str, ArrayPromise]) -> zarr.Group:
    """The store's root group, read through a GuardedStore."""
    with zarr_quietly():
        return zarr.open_group(GuardedStore(location.zarr_store(read_only=True), location.url, promised), mode="r",
                               zarr_format=3)


class GuardedStore(WrapperStore):
    """A zarr store whose reads of promised chunks raise DamagedStoreError when the chunk is
    missing, of the wrong size or fails its checksum."""

    def __init__(self, store, url: str, promised: dict[str, ArrayPromise]):
        super().__init__(store)
        self.url = url
        self.promised = promised

    def _with_store(self, store):
        return type(self)(store, self.url, self.promised)

    async def get(self, key, prototype, byte_range=None):
        value = await self._store.get(key, prototype, byte_range)
        found = self._promise_of(key)
        if found is None:
            return value
        promise, coords = found
        if value is None or byte_range is None:
            damage = promise.check_bytes(coords, None if value is None else value.as_numpy_array())
            if damage is not None:
                raise DamagedStoreError.of(self.url, damage)
        return value

    def _promise_of(self, key: str):
        name, _, chunk_key = key.rpartition("/")
        while name:
            promise = self.promised.get(name)
            if promise is not None:
                coords = promise.coords_of(key[len(name) + 1:])
                return (promise, coords) if coords is not None and promise.promised(coords) else None
            name, _, _ = name.rpartition("/")
        return None
