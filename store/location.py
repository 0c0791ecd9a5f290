"""Where a store lives: a local path or any fsspec URL (memory://, s3://, ...)."""
from __future__ import annotations

import contextlib
import os
import shutil
import stat
import warnings
from dataclasses import dataclass, field

import fsspec
import zarr
from zarr.storage import FsspecStore, LocalStore

from .failures import NamedFailuresStore, describe_key, naming_failures
from .faults import crash_point
from .names import REPLACING_NAME, temporary_path


class Listing(dict):
    """A store's files, path inside the store -> bytes (a symbolic link: its own size), with the
    paths of its folders and of its symbolic links (a link to a folder is a link, not a folder)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.directories: set[str] = set()
        self.links: set[str] = set()


@dataclass(frozen=True)
class Location:
    """A store's URL with the filesystem options that reach it."""

    url: str
    storage_options: dict = field(default_factory=dict)

    @property
    def is_local(self) -> bool:
        return "://" not in self.url or self.url.startswith("file://")

    @property
    def in_memory(self) -> bool:
        """Whether the store lives in this process's memory (fsspec's memory://)."""
        return self.url.startswith("memory://")

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

    def zarr_store(self, read_only: bool) -> NamedFailuresStore:
        """The zarr store of this location; its storage failures name the store and the key."""
        if self.is_local:
            store = LocalStore(self.local_path, read_only=read_only)
        else:
            store = FsspecStore.from_url(self.url, storage_options=self.storage_options or None, read_only=read_only)
        return NamedFailuresStore(store, self.url)

    @property
    def at_filesystem_root(self) -> bool:
        """Whether the store is the whole of its filesystem (a zip file's root, reference://): its root is ""."""
        return not self.is_local and not self.root.strip("/")

    def key(self, name: str) -> str:
        """Path of a file inside the store."""
        if self.at_filesystem_root:
            return f"{self.root}{name}"  # "" + name (zip, reference://), "/" + name (memory://)
        return f"{self.root.rstrip('/')}/{name}"

    def is_link_to_nothing(self) -> bool:
        return os.path.islink(self.local_path) and not os.path.exists(self.local_path)

    def exists(self) -> bool:
        """Whether anything is there; a filesystem's root always is (ReferenceFileSystem says "" does not exist)."""
        return self.at_filesystem_root or self.fs.exists(self.root)

    def is_dir(self) -> bool:
        """Whether it is a folder; a filesystem's root always is."""
        return self.at_filesystem_root or self.fs.isdir(self.root)

    def is_zarr(self) -> bool:
        return self.fs.exists(self.key("zarr.json"))

    def is_empty_dir(self) -> bool:
        return self.is_dir() and not self.fs.ls(self.root)

    def entries(self) -> list[str]:
        """The names directly inside the store's folder."""
        if self.is_local:
            return sorted(os.listdir(self.local_path))
        return sorted(path.rstrip("/").rsplit("/", 1)[-1] for path in self.fs.ls(self.root, detail=False))

    def list_files(self) -> Listing:
        """Every file under the store (symbolic links not followed): path inside the store -> bytes,
        with the folders and symbolic links inside it."""
        with naming_failures(self.url, "its listing", writing=False):
            return self._list_files()

    def _list_files(self) -> Listing:
        listing = Listing()
        if self.is_local:
            for folder, folders, names in os.walk(self.local_path):  # a link to a folder is listed, not walked into
                inside = os.path.relpath(folder, self.local_path).replace(os.sep, "/")
                for name, is_folder in [*((name, False) for name in names), *((name, True) for name in folders)]:
                    key = name if inside == "." else f"{inside}/{name}"
                    status = os.lstat(os.path.join(folder, name))
                    if stat.S_ISLNK(status.st_mode):
                        listing.links.add(key)
                    elif is_folder:
                        listing.directories.add(key)
                        continue
                    listing[key] = status.st_size
            return listing
        found = self.fs.find(self.root, detail=True)  # object stores: no folder can stand where a file goes
        if self.at_filesystem_root:  # a zip's or reference://'s paths have no leading "/", memory://'s have one
            files = {path.lstrip("/"): entry for path, entry in found.items() if entry.get("type") != "directory"}
        else:
            prefix = self.root.rstrip("/") + "/"
            files = {path[len(prefix):]: entry for path, entry in found.items() if path.startswith(prefix)}
        listing.update((key, int(entry.get("size") or 0)) for key, entry in files.items())
        return listing

    def clear(self, keep=()) -> None:
        """Remove everything inside the store but the names in `keep`. The marker REPLACING_NAME is
        written first and removed last, so that an interrupted clear always leaves something that
        ``state`` sees as a store being replaced, whatever it has removed. The store's folder stays,
        so a store reached through a symbolic link is emptied, never unlinked."""
        self.write_atomic(REPLACING_NAME, b"")
        for name in self.entries():
            if name not in keep and name != REPLACING_NAME:
                self.remove_entry(name)
                crash_point("clearing")
        self.remove_entry(REPLACING_NAME)

    def write_atomic(self, name: str, data: bytes) -> None:
        """Replace a file inside the store in one step: a reader, or a kill, sees the old bytes or
        the new ones, never half (a local rename; one PUT on object storage)."""
        with naming_failures(self.url, describe_key(name), writing=True):
            self._write_atomic(name, data)

    def _write_atomic(self, name: str, data: bytes) -> None:
        path = self.key(name)
        if self.is_local:
            temporary = temporary_path(path)
            with open(temporary, "wb") as handle:
                handle.write(data)
            os.replace(temporary, path)
        else:
            self.fs.pipe_file(path, data)

    def remove_entry(self, name: str) -> None:
        """Remove a file or folder inside the store; a symbolic link is removed, never followed."""
        with naming_failures(self.url, describe_key(name), writing=True):
            self._remove_entry(name)

    def _remove_entry(self, name: str) -> None:
        if self.is_local:
            path = os.path.join(self.local_path, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        else:
            self.fs.rm(self.key(name), recursive=True)


def as_location(url, storage_options: dict | None = None) -> Location:
    if isinstance(url, Location):
        return url
    return Location(os.fspath(url), dict(storage_options or {}))


def commit_metadata(location: Location, attributes: dict | None = None) -> zarr.Group:
    """Consolidate the store's metadata, then update its root attributes in one more write that
    keeps the consolidated metadata: a reader never sees the new attributes without it."""
    with zarr_quietly():
        group = zarr.consolidate_metadata(location.zarr_store(read_only=False))
        if attributes:
            group.attrs.update(attributes)
    return group


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
        warnings.filterwarnings("ignore", message=r"Object at .*\.partial is not recognized")
        yield
