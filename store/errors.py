"""Errors a user can act on: each names the input, what was expected and what to do."""


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
