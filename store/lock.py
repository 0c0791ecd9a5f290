"""One writer per store at a time: a lock file that names its holder, and a heartbeat.

- The lock is taken by exclusive create: a hard link of a finished file on a local or network
  filesystem (it fails if the lock exists; the lock is never half written), a conditional write on object storage (fsspec ``pipe_file(mode="create")``,
  S3's ``If-None-Match``); a backend that cannot create exclusively falls back to
  check-then-write, so the lock is read back to confirm that this writer holds it.
- Its holder replaces the heartbeat file beside it every ``HEARTBEAT_SECONDS``, in one step (a
  local rename; one PUT on object storage), so a reader never sees it empty or half written. A
  heartbeat that cannot check the lock stops its writer, loudly.
- A lock is **stale** when its holder was a process on this host that no longer runs, or when
  its heartbeat is older than ``STALE_SECONDS`` (any host: a job that died elsewhere). A stale
  lock is broken automatically, with a warning; ``break_lock=True`` (CLI ``--break-lock``) also
  breaks a lock that looks alive, for when you know its holder is dead. Locally a lock is removed
  only if it is still the one judged stale (it is moved aside in one step and compared there):
  when two writers break one lock, the second leaves the first one's new lock alone. On object
  storage the check is a read, then a remove, so two writers that break one lock at once can
  race: the second may remove the lock the first has just taken. The first then stops writing,
  loudly, at its next heartbeat, which finds the lock not its own; until then (up to
  ``HEARTBEAT_SECONDS``, and the write in progress) both may write.
- Lock and heartbeat files are never followed or written through when they are symbolic links.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from datetime import UTC, datetime

from .errors import StoreLockedError
from .failures import is_storage_failure, naming_failures
from .faults import crash_point
from .location import Location
from .names import HEARTBEAT_NAME, LOCK_NAME, is_lock_file, temporary_path

HEARTBEAT_SECONDS = 30.0
STALE_SECONDS = 600.0
"""A heartbeat older than this (20 missed beats) marks its lock stale, whatever the host."""

log = logging.getLogger("orthosphere.store")

def holder_description() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "command": " ".join(sys.argv),
        "since": _now().isoformat(timespec="seconds"),
        "token": uuid.uuid4().hex,
    }


def read_lock(location: Location) -> dict | None:
    """The lock's holder; {} when the lock file exists but cannot be read (a writer killed while
    taking it); None when there is no lock."""
    return current_lock(location)[1]


def current_lock(location: Location) -> tuple[str | None, dict | None]:
    """The lock file's text and its holder (as read_lock gives it)."""
    text = _read(location, LOCK_NAME)
    if text is None:
        return None, None
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        return text, {}
    return text, holder if isinstance(holder, dict) else {}


def stale_reason(location: Location, holder: dict) -> str | None:
    """Why the lock of `holder` is stale, or None when its holder may still be running."""
    if holder.get("host") == socket.gethostname() and not _process_runs(holder.get("pid")):
        return f"its process {holder.get('pid')} no longer runs on this host"
    age = time.time() - _last_heartbeat(location, holder)
    if age > STALE_SECONDS:
        return f"its last heartbeat was {age:.0f} s ago (a running writer beats every {HEARTBEAT_SECONDS:.0f} s)"
    return None


def live_holder(location: Location) -> dict | None:
    """The holder of a live lock another writer holds on the store (a stale lock, none, or this
    process's own: None)."""
    holder = read_lock(location)
    if not holder or _is_mine(holder) or stale_reason(location, holder) is not None:
        return None
    return holder


def acquire_lock(location: Location, break_lock: bool = False) -> dict:
    """Take the store's lock: a stale lock is broken (with a warning), a live one only with
    `break_lock`; otherwise raise StoreLockedError naming the holder and what to do. A failure of
    the storage raises StorageFailureError naming the lock file."""
    with naming_failures(location.url, f"lock file {LOCK_NAME}", writing=True):
        return _acquire_lock(location, break_lock)


def _acquire_lock(location: Location, break_lock: bool) -> dict:
    if break_lock:
        for name in (LOCK_NAME, HEARTBEAT_NAME):
            if location.is_local and os.path.islink(location.key(name)):
                log.warning("removing the symbolic link %s (break_lock=True); its target is left alone", location.key(name))
                _remove(location, name)
    text, holder = current_lock(location)
    if holder is not None and _is_mine(holder):
        return holder
    if holder is not None:
        reason = stale_reason(location, holder)
        if reason is None and not break_lock:
            raise StoreLockedError(_locked_message(location, holder))
        log.warning("breaking the %s lock of %s held by %s (%s)", "stale" if reason else "live", location.url,
                    holder_text(holder), reason or "break_lock=True given")
        _remove_lock_if_unchanged(location, text)
    mine = holder_description()
    with contextlib.suppress(FileExistsError):  # it exists: another writer's lock, or this one's (see below)
        _create_exclusively(location, LOCK_NAME, json.dumps(mine))
    # A conditional write whose response was lost is retried and meets the lock it wrote: that lock
    # holds this job's token, and the job takes it. Any other lock is another writer's.
    if read_lock(location) != mine:
        raise StoreLockedError(f"store {location.url} was locked by another writer a moment ago; try again")
    location.write_atomic(HEARTBEAT_NAME, _beat(mine).encode())
    return mine


def release_lock(location: Location) -> None:
    """Remove the lock if this process holds it, and with it, while it is still held, every copy
    of the lock or heartbeat written aside (left by a writer killed while taking the lock, while
    beating or while breaking a lock). The heartbeat thread must be stopped first. A failure of the
    storage raises StorageFailureError naming the lock file."""
    with naming_failures(location.url, f"lock file {LOCK_NAME}", writing=True):
        _release_lock(location)


def _release_lock(location: Location) -> None:
    text, holder = current_lock(location)
    if holder is not None and _is_mine(holder):
        _remove(location, HEARTBEAT_NAME)
        for name in location.entries():
            if name not in (LOCK_NAME, HEARTBEAT_NAME) and is_lock_file(name):
                _remove(location, name)
        _remove_lock_if_unchanged(location, text)


def holds_lock(location: Location, holder: dict) -> bool:
    return read_lock(location) == holder


class Heartbeat:
    """A thread that refreshes the lock's heartbeat while its holder writes. `failure` says why the
    holder must stop writing: another writer broke the lock, or the lock could not be checked."""

    def __init__(self, location: Location, holder: dict):
        self.location, self.holder = location, holder
        self.failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="orthosphere-lock-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        url = self.location.url
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                if not holds_lock(self.location, self.holder):
                    self._fail(f"the lock of {url} was broken by another writer",
                               'resume it (mode="resume") once the other writer is done')
                    return
                self.location.write_atomic(HEARTBEAT_NAME, _beat(self.holder).encode())
            except Exception as error:
                if is_storage_failure(error):  # a storage hiccup (local or remote): the next beat tries again
                    log.warning("could not refresh the lock heartbeat of %s: %s", url, error)
                    continue
                # any other failure stops the writer, never the heartbeat alone
                self._fail(f"the lock of {url} could not be checked ({' '.join(str(error).split())})",
                           'resume it (mode="resume") once the lock file is fixed')
                return

    def _fail(self, what: str, advice: str) -> None:
        self.failure = f"{what}: this job stopped writing; {advice}"
        log.error("%s: this job stops writing", what)


def _locked_message(location: Location, holder: dict) -> str:
    if not holder:
        return (
            f"store {location.url} has an unreadable lock file ({LOCK_NAME}: a writer was killed while taking it, or "
            f"one is taking it now); it counts as stale {STALE_SECONDS:.0f} s after it was written: wait, or pass "
            "break_lock=True if no writer is running"
        )
    age = time.time() - _last_heartbeat(location, holder)
    return (
        f"store {location.url} is locked by a running writer: {holder_text(holder)}, last heartbeat {age:.0f} s ago; "
        "wait for it to finish or stop it; if you are sure it is dead, pass break_lock=True. "
        f"A lock whose heartbeat is older than {STALE_SECONDS:.0f} s is broken automatically"
    )


def holder_text(holder: dict) -> str:
    if not holder:
        return "an unknown writer"
    return (f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('since')}, "
            f"running {holder.get('command')!r}")


def _is_mine(holder: dict) -> bool:
    return holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()


def _process_runs(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True  # another user's process, or no pid to check: assume it runs
    return True


def _now() -> datetime:
    return datetime.now(UTC)


def _beat(holder: dict) -> str:
    return json.dumps({"token": holder.get("token"), "at": time.time()})


def _last_heartbeat(location: Location, holder: dict) -> float:
    """When the holder last showed life (seconds since the epoch): its heartbeat when it is this
    holder's, else when it took the lock, else when the lock file was written."""
    try:
        beat = json.loads(_read(location, HEARTBEAT_NAME) or "{}")
        if isinstance(beat, dict) and beat.get("token") and beat.get("token") == holder.get("token"):
            return float(beat["at"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        pass
    try:
        return datetime.fromisoformat(holder["since"]).timestamp()
    except (KeyError, TypeError, ValueError):
        return _modified(location, LOCK_NAME)


# --- files that are never followed through symbolic links ---------------------------------

def _read(location: Location, name: str) -> str | None:
    path = location.key(name)
    if location.is_local:
        try:
            descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as error:
            _refuse_link(location, name, error)
            raise
        with os.fdopen(descriptor, "r", errors="replace") as handle:
            return handle.read()
    try:
        return location.fs.cat_file(path).decode(errors="replace")
    except FileNotFoundError:
        return None


def _create_exclusively(location: Location, name: str, text: str) -> None:
    """Write the file only if it does not exist (FileExistsError otherwise). Locally it is a hard
    link of a finished file written aside, so the file never exists half written. The file written
    aside may vanish before it is linked (another writer took the lock and cleared the store, or
    released it, which removes such files, meanwhile): that too is a FileExistsError."""
    path = location.key(name)
    if not location.is_local:
        location.fs.pipe_file(path, text.encode(), mode="create")
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    aside = temporary_path(path)
    with os.fdopen(os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "w") as handle:
        handle.write(text)
    crash_point("lock-written-aside")
    try:
        os.link(aside, path)  # fails if the lock exists, even as a symbolic link
    except FileNotFoundError:
        raise FileExistsError(errno.EEXIST, "the store was cleared by another writer while the lock was taken",
                              path) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside)


def _remove_lock_if_unchanged(location: Location, judged: str | None) -> None:
    """Remove the lock if it still holds `judged`, the text read when it was judged stale (or
    ours): another writer may have broken it and taken the lock since, and that lock stays.
    Locally the lock is moved aside in one step, compared there and put back if it changed. On
    object storage it is read again, then removed: a lock taken between the two is removed too,
    and its holder stops at its next heartbeat (see the module's docstring)."""
    if not location.is_local:
        if _read(location, LOCK_NAME) == judged:
            _remove(location, LOCK_NAME)
        return
    aside = temporary_path(LOCK_NAME)
    try:
        os.rename(location.key(LOCK_NAME), location.key(aside))
    except FileNotFoundError:
        return
    try:
        if _read(location, aside) != judged:
            os.link(location.key(aside), location.key(LOCK_NAME))  # put back; fails if a third writer took the lock
    except FileExistsError:
        log.warning("the lock of %s was taken by a third writer while it was being broken; the writer whose lock "
                    "it replaced stops at its next heartbeat", location.url)
    finally:
        os.unlink(location.key(aside))


def _remove(location: Location, name: str) -> None:
    """Remove the file (a symbolic link itself, never its target)."""
    try:
        if location.is_local:
            os.unlink(location.key(name))
        else:
            location.fs.rm_file(location.key(name))
    except FileNotFoundError:
        pass


def _modified(location: Location, name: str) -> float:
    path = location.key(name)
    try:
        if location.is_local:
            return os.lstat(path).st_mtime
        return location.fs.modified(path).timestamp()
    except (OSError, NotImplementedError, AttributeError):
        return time.time()


def _refuse_link(location: Location, name: str, error: OSError) -> None:
    if error.errno == errno.ELOOP or os.path.islink(location.key(name)):
        raise StoreLockedError(
            f"the lock file {location.key(name)} of store {location.url} is a symbolic link: orthosphere never "
            "follows or writes through one; pass break_lock=True to remove the link (its target is "
            "left alone), or remove it yourself"
        ) from None
