"""Reading a per-sample array's chunks into memory the caller gives, with as few copies as possible.

An uncompressed per-sample array of a local store (bytes + CRC-32C, the default for activations;
``stream.plain_chunk_files``) is read one chunk file at a time: one system call puts the chunk's
values where the caller wants them (the loader's window), and their checksum is verified once,
without zarr's per-chunk machinery, its fresh buffers or the guarded store's second checksum pass.
A chunk that is missing, of the wrong size or fails its checksum raises ``DamagedStoreError``
naming it, as the guarded reads do. Every other array (compressed, on object storage, chunked
otherwise) is read through zarr's guarded reads and copied.
"""
from __future__ import annotations

import os

import google_crc32c
import numpy as np

from .errors import DamagedStoreError
from .failures import describe_key, naming_failures
from .integrity import ArrayPromise
from .stream import is_layered, plain_chunk_files


class ChunkReader:
    """Chunks (a block of samples, one layer) of one per-sample array of a store opened with
    ``guarded_group``; `promise` says what each chunk file must hold."""

    def __init__(self, location, group, name: str, promise: ArrayPromise):
        self.array, self.promise, self.url = group[name], promise, location.url
        metadata = self.array.metadata
        self.dtype = np.dtype(self.array.dtype)
        self.layered = is_layered(metadata)
        self.samples_per_chunk = metadata.chunk_grid.chunk_shape[0]
        self.sample_bytes = int(np.prod(metadata.shape[1 + self.layered:])) * self.dtype.itemsize
        self.folder = os.path.join(location.local_path, name) if plain_chunk_files(location, self.array) else None

    def read(self, chunk: int, layer: int | None, out: np.ndarray) -> None:
        """The samples of chunk `chunk` (along sample) at layer index `layer` (None: an array without
        layers) into `out`: C-contiguous, of the array's dtype, holding exactly those samples."""
        start = chunk * self.samples_per_chunk
        n_samples = min(self.samples_per_chunk, self.array.shape[0] - start)
        if out.dtype != self.dtype or not out.flags.c_contiguous or out.nbytes != n_samples * self.sample_bytes:
            raise ValueError(f"chunk {chunk} of {self.array.name!r} needs a contiguous {self.dtype} buffer of "
                             f"{n_samples * self.sample_bytes} bytes, got {out.dtype} of {out.nbytes}")
        if self.folder is None:
            where = (slice(start, start + n_samples),) + (() if layer is None else (layer,))
            out.reshape(-1)[...] = np.asarray(self.array[where]).reshape(-1)
            return
        self._read_file(chunk, layer, out.reshape(-1).view(np.uint8), (self.samples_per_chunk - n_samples) * self.sample_bytes)

    def advise(self, chunk: int, layer: int | None) -> None:
        """Ask the kernel to read the chunk's file into the page cache in the background (plain chunk
        files where the platform has posix_fadvise; a no-op otherwise)."""
        if self.folder is None or not hasattr(os, "posix_fadvise"):
            return
        try:
            descriptor = os.open(self._path(self._coords(chunk, layer)), os.O_RDONLY)
        except OSError:
            return  # reading it will say what is wrong
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(descriptor)

    def _coords(self, chunk: int, layer: int | None) -> tuple[int, ...]:
        coords = (chunk,) + (() if layer is None else (layer,))
        return coords + (0,) * (len(self.array.shape) - len(coords))

    def _path(self, coords: tuple[int, ...]) -> str:
        return os.path.join(self.folder, self.array.metadata.encode_chunk_key(coords))

    def _read_file(self, chunk: int, layer: int | None, values: np.ndarray, padding_bytes: int) -> None:
        """The chunk file's values into `values`; the padding of a short last chunk and the checksum aside."""
        coords = self._coords(chunk, layer)
        padding, checksum = np.empty(padding_bytes, np.uint8), np.empty(4, np.uint8)
        with naming_failures(self.url, describe_key(self.promise.key(coords)), writing=False):
            try:
                descriptor = os.open(self._path(coords), os.O_RDONLY)
            except FileNotFoundError:
                raise DamagedStoreError.of(self.url, self.promise.damage(coords, "missing")) from None
            try:
                damage = self.promise.check_size(coords, os.fstat(descriptor).st_size)
                if damage is None:
                    read_exactly(descriptor, [values, padding, checksum])
                    damage = self.promise.check_checksum(
                        coords, google_crc32c.extend(google_crc32c.value(values), padding), checksum)
            finally:
                os.close(descriptor)
        if damage is not None:
            raise DamagedStoreError.of(self.url, damage)


def read_exactly(descriptor: int, buffers: list[np.ndarray]) -> None:
    """Fill the buffers (uint8, in order) from the file's start, with as few system calls as the
    kernel allows (one, for a whole file in the page cache)."""
    views, offset = [memoryview(buffer) for buffer in buffers if buffer.size], 0
    while views:
        count = os.preadv(descriptor, views, offset)
        if count == 0:
            raise OSError(f"file ended {sum(view.nbytes for view in views)} bytes early (changed while read)")
        offset += count
        while views and count >= views[0].nbytes:
            count -= views.pop(0).nbytes
        if count:
            views[0] = views[0][count:]
