"""The store: one Zarr v3 group of schema v1 per extraction job, opened lazily with xarray."""
from .errors import (
    DamagedStoreError,
    IncompleteStoreError,
    StoreError,
    StoreExistsError,
    StoreLockedError,
    StoreNotFoundError,
)
from .lifecycle import create_store
from .reader import format_info, info, open_store, read_attrs, validate
from .schema import DEFAULT_SITES, SCHEMA_VERSION, SITES
from .writer import StoreWriter, open_writer

__all__ = [
    "DEFAULT_SITES",
    "SCHEMA_VERSION",
    "SITES",
    "DamagedStoreError",
    "IncompleteStoreError",
    "StoreError",
    "StoreExistsError",
    "StoreLockedError",
    "StoreNotFoundError",
    "StoreWriter",
    "create_store",
    "format_info",
    "info",
    "open_store",
    "open_writer",
    "read_attrs",
    "validate",
]
