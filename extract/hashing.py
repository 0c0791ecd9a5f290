"""SHA-256 of a model's weights or a corpus's files, computed once and remembered (a model handed
over in memory: from its tensors, each time).

A store records the SHA-256 of the model and the corpus it was made from, so that a resumed job
can tell them apart from others. Hashing a large checkpoint costs about as long as loading it, so
each digest is remembered in a small JSON file keyed by the files' paths, sizes, modification
times and inodes (any change to a file changes one of them): ``$ORTHOSPHERE_CACHE`` if set, else
``$XDG_CACHE_HOME/orthosphere`` (``~/.cache/orthosphere``). A cache that cannot be read or
written is ignored: the files are hashed again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger("orthosphere.extract")

CACHE_FILE = "sha256.json"
CACHE_ENTRIES = 256
"""The most digests remembered (the oldest are forgotten first)."""


def cache_folder() -> Path:
    folder = os.environ.get("ORTHOSPHERE_CACHE")
    if folder:
        return Path(folder)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "orthosphere"


def files_sha256(paths) -> str:
    """SHA-256 over the files' bytes, in order; remembered while the files stay unchanged."""
    key = json.dumps([_identity(path) for path in paths])
    cache = _read_cache()
    if key in cache:
        return cache[key]
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(2**24), b""):
                digest.update(block)
    cache[key] = digest.hexdigest()
    _write_cache(cache)
    return cache[key]


def tensors_sha256(model) -> str:
    """SHA-256 over a module's state (each tensor's name, dtype, shape and bytes, in name order)."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _identity(path) -> list:
    status = os.stat(path)
    return [os.path.abspath(path), status.st_size, status.st_mtime_ns, status.st_ino]


def _read_cache() -> dict:
    try:
        cache = json.loads((cache_folder() / CACHE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _write_cache(cache: dict) -> None:
    """Write the cache whole and atomically (concurrent writers may lose an entry, never corrupt it)."""
    kept = dict(list(cache.items())[-CACHE_ENTRIES:])
    folder, temporary = cache_folder(), None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=folder, prefix=".sha256-")
        with os.fdopen(handle, "w") as out:
            json.dump(kept, out)
        os.replace(temporary, folder / CACHE_FILE)
    except OSError as error:
        log.debug("could not remember a SHA-256 in %s: %s", folder, error)
        if temporary is not None and os.path.exists(temporary):
            os.unlink(temporary)
