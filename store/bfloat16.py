"""The ``bfloat16`` Zarr v3 data type: activations of models run in bfloat16, stored bit for bit.

Zarr v3's core has no bfloat16; this is the extension data type named ``bfloat16`` (the name
TensorStore and zarrs give it), each value the 2 little-endian bytes of a bfloat16, read in numpy
as ``ml_dtypes.bfloat16``. Importing ``orthosphere.store`` registers it with zarr-python, and from
then on plain ``zarr`` and ``xarray.open_zarr`` read such arrays in that process::

    import orthosphere.store  # registers the bfloat16 data type with zarr
    import xarray as xr
    q = xr.open_zarr("run.zarr")["q"].astype("float32")

(zarr-python 3.1 collects data types from a ``zarr.data_type`` entry point but never loads them,
so the import is needed; without it zarr says "No Zarr data type found that matches 'bfloat16'".)
numpy arithmetic on ml_dtypes.bfloat16 is limited (xarray's reductions refuse it): convert with
``.astype("float32")`` (exact), as ``orthosphere.store.open_store`` does for every bfloat16
variable.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from zarr.core.dtype import DataTypeValidationError, data_type_registry
from zarr.core.dtype.npy.float import BaseFloat


@functools.cache
def bfloat16_dtype() -> np.dtype:
    """numpy's bfloat16 (ml_dtypes), imported on first use: the import takes about half a second,
    which only stores and jobs that hold bfloat16 pay."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def is_bfloat16(dtype) -> bool:
    """Whether a dtype (or its name) is bfloat16, without importing ml_dtypes."""
    return str(dtype) == "bfloat16"


class _NotLoaded:
    """Stands for ml_dtypes' bfloat16 dtype class until it is imported."""


@dataclass(frozen=True, kw_only=True)
class BFloat16(BaseFloat):
    """bfloat16 (1 sign, 8 exponent, 7 fraction bits), little-endian, Zarr v3 only."""

    dtype_cls = _NotLoaded
    _zarr_v3_name = "bfloat16"
    _zarr_v2_names = ()

    @classmethod
    def _check_native_dtype(cls, dtype) -> bool:
        return is_bfloat16(dtype) and dtype == bfloat16_dtype()

    @classmethod
    def from_native_dtype(cls, dtype) -> BFloat16:
        if cls._check_native_dtype(dtype):
            return cls(endianness="little")
        raise DataTypeValidationError(f"invalid data type {dtype}: expected bfloat16 (ml_dtypes.bfloat16)")

    def to_native_dtype(self) -> np.dtype:
        return bfloat16_dtype()

    @property
    def item_size(self) -> int:
        return 2


data_type_registry.register(BFloat16._zarr_v3_name, BFloat16)
