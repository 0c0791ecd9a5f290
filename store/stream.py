"""Writing consecutive blocks of samples into a store, chunk by chunk, with as few copies as possible.

``ChunkStream(writer)`` takes a shard's blocks in order (``add``) and writes them:

- an uncompressed per-sample array of a local store (bytes + CRC-32C, the default for activations)
  is written straight into its chunk files: each block's piece of a chunk goes to its offset in the
  file and extends the chunk's running checksum; the chunk's last piece pads a short last chunk
  with the fill value and appends the checksum. No block is joined with another or copied
  (a layer of a layer-major buffer is one contiguous piece), and zarr's per-chunk machinery
  is not involved. The files are byte for byte what zarr writes (tested). On a local disk's file
  system (``LOCAL_FILE_SYSTEMS``, where the kernel takes them) a piece whose memory, offset and
  length are multiples of ``DIRECT_ALIGNMENT`` is written with O_DIRECT: from the capture's buffer
  to the disk, without a copy into the page cache or the kernel's later write-back of it, which on
  long jobs cost the forward pass a third of its time (benchmarks/RESULTS.md); any other piece,
  and a piece a file system refuses, is written through the page cache;
- every other array (compressed, on object storage, or a writer without a local store) is
  regrouped into whole chunks (``ChunkAligner``) and written through ``StoreWriter.write``.

``StoreWriter.write_weights`` writes the weight maps (one layer a chunk) through the same chunk
files (``array_files``) where the store is local and uncompressed.

A chunk file is complete only after its last piece; shards are chunk-aligned and a shard is
marked complete only after its chunks, so a kill mid-chunk leaves an incomplete shard, which a
resumed job rewrites from its first chunk (the first piece truncates the file).
"""
from __future__ import annotations

import errno
import functools
import math
import os
import re
import sys
import threading
from dataclasses import dataclass, field

import google_crc32c
import numpy as np
from zarr.codecs import BytesCodec, Crc32cCodec
from zarr.core.metadata import ArrayV3Metadata

from .errors import StoreError
from .failures import describe_key, naming_failures
from .faults import crash_point

DIRECT_ALIGNMENT = 4096
"""Direct (O_DIRECT) writes need their memory address, file offset and length to be multiples of
the disk's logical block size: 4096 covers every common disk (512 or 4096)."""
LOCAL_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "bcachefs"})
"""File systems of local disks, where direct writes go to the device; on any other (network file
systems, tmpfs, FUSE, overlays) every write goes through the page cache."""


class ChunkAligner:
    """Regroups consecutive blocks of samples into blocks that cover whole chunks.

    A block given with a `release` callback is released (pop_released) once no piece of it is held.
    Blocks joined into one chunk are copied into the same buffers every time: each returned block
    is valid only until the next call (the writer writes it at once)."""

    def __init__(self, samples_per_chunk: int):
        self.chunk = samples_per_chunk
        self.pieces: list[tuple[int, dict, object]] = []
        self.released: list = []
        self.joined: dict[str, np.ndarray] = {}

    @property
    def start(self) -> int:
        return self.pieces[0][0]

    @property
    def stop(self) -> int:
        first, arrays, _ = self.pieces[-1]
        return first + _length(arrays)

    def add(self, first: int, arrays: dict, release=None) -> list[tuple[int, dict]]:
        """Take a block; return the whole chunks now complete (as one block, or none)."""
        if self.pieces and first != self.stop:
            raise RuntimeError(f"block at sample {first} does not follow the previous one, which ends at {self.stop}")
        self.pieces.append((first, arrays, release))
        boundary = self.stop // self.chunk * self.chunk
        return [self._take(boundary)] if boundary > self.start else []

    def flush(self) -> list[tuple[int, dict]]:
        """Everything held (the shard's end, which is chunk-aligned or the store's end)."""
        return [self._take(self.stop)] if self.pieces else []

    def pop_released(self) -> list:
        """The release callbacks of the blocks handed out whole since the last call."""
        released, self.released = self.released, []
        return released

    def _take(self, boundary: int) -> tuple[int, dict]:
        start, before, after = self.start, [], []
        for first, arrays, release in self.pieces:
            n = _length(arrays)
            if first + n <= boundary:
                before.append(arrays)
                if release is not None:
                    self.released.append(release)
            elif first >= boundary:
                after.append((first, arrays, release))
            else:
                cut = boundary - first
                before.append({name: values[:cut] for name, values in arrays.items()})
                after.append((boundary, {name: values[cut:] for name, values in arrays.items()}, release))
        self.pieces = after
        if len(before) == 1:
            return start, before[0]
        return start, {name: self._join(name, [block[name] for block in before]) for name in before[0]}

    def _join(self, name: str, parts: list[np.ndarray]) -> np.ndarray:
        shape = (sum(len(part) for part in parts), *parts[0].shape[1:])
        dtype = np.result_type(*parts)
        held = self.joined.get(name)
        if held is None or held.shape != shape or held.dtype != dtype:
            held = self.joined[name] = np.empty(shape, dtype)
        return np.concatenate(parts, out=held)


def _length(arrays: dict) -> int:
    return len(next(iter(arrays.values())))


@dataclass
class ChunkFiles:
    """The chunk files of one array written directly: (sample, [layer,] rest...) with chunks of
    `samples_per_chunk` samples, one layer, everything else whole; or any array chunked along its
    first dim only (the weight maps: one layer a chunk)."""

    store: str
    """The store's URL (for messages)."""
    folder: str
    metadata: ArrayV3Metadata
    dtype: np.dtype
    fill: np.ndarray
    """One sample's fill value bytes (uint8), for the padding of a short last chunk."""
    checksums: dict = field(default_factory=dict)
    """(chunk, layer) -> running CRC-32C of the bytes written so far."""
    filled: dict = field(default_factory=dict)
    """chunk -> samples written so far."""
    made: set = field(default_factory=set)
    direct: bool = False
    """Whether aligned pieces are written with O_DIRECT (``direct_writes_work``)."""

    @property
    def n_samples(self) -> int:
        return self.metadata.shape[0]

    @property
    def samples_per_chunk(self) -> int:
        return self.metadata.chunk_grid.chunk_shape[0]

    @property
    def has_layer(self) -> bool:
        return is_layered(self.metadata)

    @property
    def sample_bytes(self) -> int:
        return self.fill.size

    def write(self, first: int, values: np.ndarray) -> list[int]:
        """Write samples [first, first + len(values)); returns the chunks completed."""
        if values.dtype != self.dtype or values.shape[1:] != tuple(self.metadata.shape[1:]):
            raise StoreError(
                f"array {os.path.basename(self.folder)!r} takes blocks of shape (n, {', '.join(map(str, self.metadata.shape[1:]))}) "
                f"and dtype {self.dtype}: got {values.shape} of dtype {values.dtype}"
            )
        completed = []
        stop = first + len(values)
        while first < stop:
            chunk = first // self.samples_per_chunk
            begin = chunk * self.samples_per_chunk
            end = min(begin + self.samples_per_chunk, self.n_samples)
            last = min(stop, end)
            self._piece(chunk, first - begin, values[: last - first])
            values, first = values[last - first:], last
            if self.filled[chunk] == end - begin:
                self._finish(chunk, end - begin)
                completed.append(chunk)
        return completed

    def pending(self) -> list[int]:
        return sorted(self.filled)

    def _piece(self, chunk: int, offset: int, values: np.ndarray) -> None:
        expected = self.filled.get(chunk, 0)
        if offset != expected:
            raise RuntimeError(
                f"samples {chunk * self.samples_per_chunk + offset}.. of {self.folder} do not follow the "
                f"chunk's previous ones (a chunk is written from its first sample, in order)"
            )
        for layer, piece in self._layers(values):
            data = np.ascontiguousarray(piece).reshape(-1).view(np.uint8)
            key = (chunk, layer)
            self.checksums[key] = google_crc32c.extend(self.checksums.get(key, 0) if offset else 0, data)
            with self._naming(chunk, layer):
                self.direct = _write_at(self._path(chunk, layer), data, offset * self.sample_bytes,
                                        truncate=offset == 0, direct=self.direct)
        self.filled[chunk] = expected + len(values)

    def _finish(self, chunk: int, n_written: int) -> None:
        padding = np.tile(self.fill, self.samples_per_chunk - n_written)
        for layer in self._layer_indices():
            key = (chunk, layer)
            checksum = google_crc32c.extend(self.checksums.pop(key), padding) if padding.size else self.checksums.pop(key)
            tail = np.concatenate([padding, np.frombuffer(int(checksum).to_bytes(4, "little"), np.uint8)])
            with self._naming(chunk, layer):
                _write_at(self._path(chunk, layer), tail, n_written * self.sample_bytes, truncate=False)
        del self.filled[chunk]

    def _layers(self, values: np.ndarray):
        if not self.has_layer:
            return [(None, values)]
        return [(layer, values[:, layer]) for layer in range(values.shape[1])]

    def _layer_indices(self):
        return [None] if not self.has_layer else range(self.metadata.shape[1])

    def _key(self, chunk: int, layer) -> str:
        """The chunk's file inside its array's folder."""
        coords = (chunk,) + (() if layer is None else (layer,)) + (0,) * (len(self.metadata.shape) - 1 - self.has_layer)
        return self.metadata.encode_chunk_key(coords)

    def _naming(self, chunk: int, layer):
        """Storage failures while writing the chunk, named (store, array, chunk)."""
        key = f"{os.path.basename(self.folder)}/{self._key(chunk, layer)}"
        return naming_failures(self.store, describe_key(key), writing=True)

    def _path(self, chunk: int, layer) -> str:
        path = os.path.join(self.folder, self._key(chunk, layer))
        folder = os.path.dirname(path)
        if folder not in self.made:
            os.makedirs(folder, exist_ok=True)
            self.made.add(folder)
        return path


def _write_at(path: str, data: np.ndarray, offset: int, truncate: bool, direct: bool = False) -> bool:
    """Write data's bytes at offset in the file, directly to the disk when `direct` and aligned;
    returns whether direct writes still work here (False once the file system refused one)."""
    if direct and _aligned(data, offset):
        try:
            _write_bytes(path, data, offset, truncate, os.O_DIRECT)
            return True
        except OSError as error:  # this file system refuses direct writes after all
            if error.errno != errno.EINVAL:
                raise
            direct = False
    _write_bytes(path, data, offset, truncate, 0)
    return direct


def _write_bytes(path: str, data: np.ndarray, offset: int, truncate: bool, mode: int) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else 0) | os.O_NOFOLLOW | mode
    try:
        descriptor = os.open(path, flags, 0o666)  # as open(path, "wb"): the umask decides
    except OSError as error:  # a link where the chunk goes: replaced by the chunk, never written through
        if error.errno != errno.ELOOP or not truncate:
            raise
        os.unlink(path)
        descriptor = os.open(path, flags, 0o666)
    try:
        view, written = memoryview(data), 0
        while written < len(view):
            written += os.pwrite(descriptor, view[written:], offset + written)
    finally:
        os.close(descriptor)


def _aligned(data: np.ndarray, offset: int) -> bool:
    return data.ctypes.data % DIRECT_ALIGNMENT == 0 and data.nbytes % DIRECT_ALIGNMENT == 0 \
        and offset % DIRECT_ALIGNMENT == 0


@functools.lru_cache(maxsize=64)
def direct_writes_work(folder: str) -> bool:
    """Whether files in the (existing) folder take direct writes: Linux, a local disk's file
    system (``LOCAL_FILE_SYSTEMS``), and a probe block written with O_DIRECT. Cached per folder."""
    if not hasattr(os, "O_DIRECT") or file_system_type(folder) not in LOCAL_FILE_SYSTEMS:
        return False
    probe = os.path.join(folder, f".direct-write-probe-{os.getpid()}-{threading.get_ident()}")
    block = np.zeros(2 * DIRECT_ALIGNMENT, np.uint8)
    start = -block.ctypes.data % DIRECT_ALIGNMENT
    try:
        _write_bytes(probe, block[start: start + DIRECT_ALIGNMENT], 0, True, os.O_DIRECT)
        return True
    except OSError:
        return False
    finally:
        if os.path.lexists(probe):
            os.remove(probe)


def file_system_type(path: str) -> str | None:
    """The type of the file system holding path (Linux's mount table), None where unknown."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as handle:
            mounts = handle.read().splitlines()
    except OSError:
        return None
    path, found, longest = os.path.realpath(path), None, -1
    for line in mounts:
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not rest:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda code: chr(int(code[1], 8)), parts[4])  # a space is \040
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) > longest:
            found, longest = rest.split()[0], len(point)
    return found


def chunk_files(writer, name: str) -> ChunkFiles | None:
    """How to write the per-sample array `name` directly into its chunk files, or None where
    zarr must (see ``array_files``)."""
    location = getattr(writer, "location", None)
    if location is None:
        return None
    return array_files(location, name, writer.per_sample_array(name))


def plain_chunk_files(location, array) -> bool:
    """Whether the array's chunk files are its values' bytes followed by their CRC-32C, one file a
    block of samples (and one layer): a local store, uncompressed (bytes + crc32c codecs),
    little-endian, chunked along its first dim only [and layer]."""
    if not location.is_local or sys.byteorder != "little":
        return False
    metadata = array.metadata
    codecs = metadata.codecs
    if len(codecs) != 2 or not isinstance(codecs[0], BytesCodec) or not isinstance(codecs[1], Crc32cCodec):
        return False
    shape, chunks, has_layer = metadata.shape, metadata.chunk_grid.chunk_shape, is_layered(metadata)
    if chunks[1 + has_layer:] != shape[1 + has_layer:] or (has_layer and chunks[1] != 1):
        return False
    dtype = np.dtype(array.dtype)
    return dtype.itemsize == 1 or dtype.byteorder != ">"


def array_files(location, name: str, array) -> ChunkFiles | None:
    """How to write the store's array `name` directly into its chunk files, or None where zarr
    must (see ``plain_chunk_files``)."""
    if not plain_chunk_files(location, array):
        return None
    metadata = array.metadata
    shape, has_layer, dtype = metadata.shape, is_layered(metadata), np.dtype(array.dtype)
    fill = np.full(math.prod(shape[1 + has_layer:]), array.fill_value, dtype=dtype).view(np.uint8)
    folder = os.path.join(location.local_path, name)
    return ChunkFiles(location.url, folder, metadata, dtype, fill, direct=direct_writes_work(folder))


def is_layered(metadata: ArrayV3Metadata) -> bool:
    """Whether the array's second dim is layer (chunked one layer a chunk)."""
    dims = metadata.dimension_names
    return len(dims) > 1 and dims[1] == "layer"


class ChunkStream:
    """Writes one shard's consecutive blocks: directly into chunk files where it can (see the
    module's docstring), through whole-chunk zarr writes otherwise."""

    def __init__(self, writer):
        self.writer = writer
        self.aligner = ChunkAligner(writer.attrs["samples_per_chunk"])
        self.direct: dict[str, ChunkFiles | None] = {}
        self.released: list = []

    def add(self, first: int, arrays: dict, release=None) -> None:
        """Write the block of samples [first, first + n), or hold what must wait for a whole chunk.
        `release` is called (pop_released) once nothing of the block is held."""
        direct = {name: values for name, values in arrays.items() if self._files(name) is not None}
        held = {name: values for name, values in arrays.items() if name not in direct}
        if direct:
            self.writer.note_written(first, first + _length(arrays), direct)
        completed = False
        for name, values in direct.items():
            completed |= bool(self.direct[name].write(first, np.asarray(values)))
        if direct:  # the block is written but for its small rest: hold copies of that, give the buffers back
            held = {name: np.array(values) for name, values in held.items()}
            self.released += [release] if release is not None else []
            release = None
        if held:
            completed |= self._write(self.aligner.add(first, held, release))
        elif release is not None:
            self.released.append(release)
        if completed:
            crash_point("chunk-written")

    def flush(self) -> None:
        """Write everything held: the shard's end, which ends a chunk."""
        if self._write(self.aligner.flush()):
            crash_point("chunk-written")
        pending = {name: files.pending() for name, files in self.direct.items() if files is not None and files.pending()}
        if pending:
            raise RuntimeError(f"chunks left unfinished at the end of a shard: {pending}")

    def pop_released(self) -> list:
        released, self.released = self.released + self.aligner.pop_released(), []
        return released

    def _files(self, name: str) -> ChunkFiles | None:
        if name not in self.direct:
            self.direct[name] = chunk_files(self.writer, name)
        return self.direct[name]

    def _write(self, blocks) -> bool:
        for first, arrays in blocks:
            self.writer.write(first, arrays)
        return bool(blocks)
