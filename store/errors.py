"""Errors a user can act on: each names the input, what was expected and what to do."""
from __future__ import annotations


class StoreError(ValueError):
    """A store that cannot be created, written or read as asked."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """The URL holds no store."""


class StoreExistsError(StoreError, FileExistsError):
    """A store already exists where a new one was to be created."""


class IncompleteStoreError(StoreError):
    """Some shards of the store were never finished."""


class StoreLockedError(StoreError):
    """Another writer holds the store's lock."""


class DamagedStoreError(StoreError):
    """Chunks the store promises are missing or damaged."""

    def __init__(self, message: str, damage: list | None = None):
        super().__init__(message)
        self.damage = list(damage or [])

    def __reduce__(self):
        return type(self), (str(self), self.damage)

    @classmethod
    def of(cls, url: str, damage) -> DamagedStoreError:
        """The error for damaged chunks of the store at `url` (one Damage or a list), with what to do."""
        damage = damage if isinstance(damage, list) else [damage]
        shown = "; ".join(str(item) for item in damage[:3]) + ("; ..." if len(damage) > 3 else "")
        count = f"{len(damage)} chunk{'s' if len(damage) != 1 else ''}"
        if all(item.listed for item in damage):
            advice = (f"resume the job that wrote it (its command, with --resume) to rewrite them; "
                      f"`orthosphere validate {url}` lists every damaged chunk")
        else:
            advice = (f"`orthosphere validate {url} --full --reopen` lists every damaged chunk and reopens their "
                      "shards; then resume the job that wrote the store (its command, with --resume) to rewrite them")
        return cls(f"store {url} is damaged ({count}): {shown}. To repair it, {advice}", damage)
