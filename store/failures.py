"""Failures of the storage under a store, named: which store, which array and chunk (or metadata,
lock or flag file), the cause and what to do.

Local file systems raise ``OSError`` (often without a file name: ``os.pwrite`` and zarr's buffered
writes); object stores raise botocore's, aiohttp's or asyncio's errors, which are not ``OSError``.
``is_storage_failure`` recognises all of them; ``storage_failure`` turns one into a
``StorageFailureError``; ``NamedFailuresStore`` wraps the zarr store every store access goes
through, so that zarr's reads and writes fail with the key they were reading or writing.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import logging

from zarr.storage import WrapperStore

from orthosphere.errors import StorageFailureError, StoreError

from .names import PROGRESS_GROUP, is_lock_file

log = logging.getLogger("orthosphere.store")

OBJECT_STORE_MODULES = ("botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "adlfs", "urllib3", "requests")
"""Packages whose exceptions are failures of the storage (an endpoint, the network), not bugs."""


def is_storage_failure(error: BaseException) -> bool:
    """Whether `error` is a failure of the storage itself: an OSError, a timeout, or an error of an
    object store's client library, or a StorageFailureError; never another of orthosphere's own."""
    if isinstance(error, StoreError):
        return isinstance(error, StorageFailureError)
    if isinstance(error, (OSError, asyncio.TimeoutError)):
        return True
    return any(kind.__module__.split(".")[0] in OBJECT_STORE_MODULES for kind in type(error).__mro__)


def describe_key(key: str) -> str:
    """A key inside a store in words: an array's chunk, a metadata file, a progress flag, the lock."""
    name = key.rsplit("/", 1)[-1]
    if is_lock_file(name):
        return f"lock file {key}"
    if name == "zarr.json":
        return f"metadata file {key}"
    array, separator, coords = key.partition("/c/")
    if not separator:
        return f"file {key}"
    chunk = "(" + ", ".join(coords.split("/")) + ")"
    if array.startswith(PROGRESS_GROUP + "/"):
        return f"progress flag {array} chunk {chunk}"
    return f"array {array!r} chunk {chunk}"


def release_after_failure(release, url: str) -> None:
    """Call release() on the way out of a failure, whose error must stay the one raised: a failure of
    the release is logged, never raised in its place."""
    try:
        release()
    except Exception as error:
        log.warning("store %s: could not release its lock after the failure that stopped the job (%s); the lock "
                    "stays until it is stale, or until a job breaks it (break_lock=True)", url,
                    " ".join(str(error).split()))


def storage_failure(url: str, what: str, error: BaseException, writing: bool) -> StorageFailureError:
    """The error for a failure of the storage while reading or writing `what` (see describe_key) of
    the store at `url`, with what to do."""
    cause = f"{type(error).__name__}: {' '.join(str(error).split()) or 'no detail given'}"
    if getattr(error, "errno", None) == errno.ENOSPC:
        advice = 'free space there, then resume the job that writes it (mode="resume")'
    elif writing:
        advice = ('once the storage works again, resume the job that writes it (mode="resume"): '
                  "nothing complete is lost")
    else:
        advice = (f"once the storage works again, retry; if it fails again, `orthosphere validate {url} --full "
                  '--reopen` lists the damaged chunks and reopens their shards for the job to rewrite with mode="resume"')
    doing = "writing" if writing else "reading"
    return StorageFailureError(f"store {url}: the storage failed {doing} {what} ({cause}); {advice}")


@contextlib.contextmanager
def naming_failures(url: str, what: str, writing: bool):
    """Turn a storage failure inside the block into a StorageFailureError naming `what` of the store."""
    try:
        yield
    except Exception as error:
        if isinstance(error, StorageFailureError) or not is_storage_failure(error):
            raise  # named already, or not the storage's
        raise storage_failure(url, what, error, writing) from error


class NamedFailuresStore(WrapperStore):
    """A zarr store whose storage failures name the store and the key (array and chunk, metadata file)."""

    def __init__(self, store, url: str):
        super().__init__(store)
        self.url = url

    def _with_store(self, store):
        return type(self)(store, self.url)

    def _naming(self, key: str, writing: bool):
        return naming_failures(self.url, describe_key(key), writing)

    async def get(self, key, prototype, byte_range=None):
        with self._naming(key, writing=False):
            return await self._store.get(key, prototype, byte_range)

    async def get_partial_values(self, prototype, key_ranges):
        key_ranges = list(key_ranges)
        with self._naming(key_ranges[0][0] if len(key_ranges) == 1 else "several keys", writing=False):
            return await self._store.get_partial_values(prototype, key_ranges)

    async def exists(self, key):
        with self._naming(key, writing=False):
            return await self._store.exists(key)

    async def set(self, key, value):
        with self._naming(key, writing=True):
            await self._store.set(key, value)

    async def set_if_not_exists(self, key, value):
        with self._naming(key, writing=True):
            return await self._store.set_if_not_exists(key, value)

    async def delete(self, key):
        with self._naming(key, writing=True):
            await self._store.delete(key)

    async def _set_many(self, values):
        await asyncio.gather(*(self.set(key, value) for key, value in values))

    async def _get_many(self, requests):
        for request in requests:
            yield request[0], await self.get(*request)
