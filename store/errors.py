"""The store's errors (defined with every other in ``orthosphere.errors``)."""
from orthosphere.errors import (  # noqa: F401
    DamagedStoreError,
    IncompleteStoreError,
    StorageFailureError,
    StoreError,
    StoreExistsError,
    StoreLockedError,
    StoreNotFoundError,
)
