"""Where a store lives: a local path or any fsspec URL (memory://, s3://, ...)."""
from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass, field

import fsspec
from zarr.storage import FsspecStore, LocalStore


@dataclass(frozen=True)
class Location:
    """A store's URL with the filesystem options that reach it."""

    url: str
    storage_options: dict = field(default_factory=dict)

    @property
    def is_local(self) -> bool:
        return "://" not in self.url or self.url.startswith("file://")

    @property
    def local_path(self) -> str:
        return os.path.abspath(self.url.removeprefix("file://"))

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        if self.is_local:
            return fsspec.filesystem("file")
        return fsspec.core.url_to_fs(self.url, **self.storage_options)[0]

    @property
    def root(self) -> str:
        """The store's path inside its filesystem."""
        if self.is_local:
            return self.local_path
        return fsspec.core.url_to_fs(self.url, **self.storage_options)[1]

    def zarr_store(self, read_only: bool):
        if self.is_local:
            return LocalStore(self.local_path, read_only=read_only)
        return FsspecStore.from_url(
            self.url, storage_options=self.storage_options or None, read_only=read_only
        )

    def key(self, name: str) -> str:
        """Path of a file inside the store."""
        return f"{self.root.rstrip('/')}/{name}"

    def exists(self) -> bool:
        return self.fs.exists(self.root)

    def is_zarr(self) -> bool:
        return self.fs.exists(self.key("zarr.json"))

    def is_empty_dir(self) -> bool:
        return self.fs.isdir(self.root) and not self.fs.ls(self.root)

    def remove(self) -> None:
        self.fs.rm(self.root, recursive=True)

    def size_bytes(self) -> int:
        return int(self.fs.du(self.root, total=True))


def as_location(url, storage_options: dict | None = None) -> Location:
    if isinstance(url, Location):
        return url
    return Location(os.fspath(url), dict(storage_options or {}))


def group_arrays(group) -> list:
    """(name, array) of a zarr group's arrays, without zarr's warning about our lock file."""
    with zarr_quietly():
        return list(group.arrays())


@contextlib.contextmanager
def zarr_quietly():
    """Silence zarr's warnings about consolidated metadata (not yet in the v3 spec) and our lock file."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Consolidated metadata")
        warnings.filterwarnings("ignore", message="Object at .orthosphere-lock")
        yield
