"""Where a store came from: package, commit, torch, command line, time."""
from __future__ import annotations

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


def provenance(command: str | None = None) -> dict:
    return {
        "package_version": _version("orthosphere"),
        "git_commit": _git_commit(),
        "torch_version": _version("torch"),
        "command": command if command is not None else " ".join(sys.argv),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }
