"""Where a store came from: package, commit, torch, command line, time."""
from __future__ import annotations

import hashlib
import importlib
import subprocess
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None if result.returncode == 0 else None


PACKAGES = ("orthosphere", "orthosphere.extract", "orthosphere.extract.adapters", "orthosphere.store", "orthosphere.analyze",
            "orthosphere.workflows")
"""The package's modules (pyproject's packages), whose sources ``code_fingerprint`` reads."""


def code_fingerprint() -> str:
    """A SHA-256 over the package's Python sources, as installed here: two processes running different
    orthosphere code (another version, another commit, an edit not committed) differ in it."""
    digest = hashlib.sha256()
    for name in PACKAGES:
        folder = Path(importlib.import_module(name).__file__).resolve().parent
        for path in sorted(folder.glob("*.py")):
            digest.update(f"{name}/{path.name}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def provenance(command: str | None = None) -> dict:
    return {
        "package_version": _version("orthosphere"),
        "git_commit": _git_commit(),
        "torch_version": _version("torch"),
        "command": command if command is not None else " ".join(sys.argv),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }
