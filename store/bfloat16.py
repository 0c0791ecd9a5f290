"""The ``bfloat16`` Zarr v3 data type: activations of models run in bfloat16, stored bit for bit.

Zarr v3's core has no bfloat16; this is the extension data type named ``bfloat16`` (the name
TensorStore and zarrs use), each value the 2 little-endian bytes of a bfloat16, read in numpy as
``ml_dtypes.bfloat16``. orthosphere registers it with zarr-python through the ``zarr.data_type``
entry point, so that, wherever orthosphere is installed, plain ``zarr`` and
``xarray.open_zarr`` read such arrays without importing orthosphere. numpy arithmetic on
ml_dtypes.bfloat16 is limited (xarray's reductions refuse it): convert first with
``ds.q.astype("float32")`` (exact), as ``orthosphere.store.open_store`` does for every bfloat16
variable.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
from zarr.core.dtype import DataTypeValidationError, data_type_registry
from zarr.core.dtype.npy.float import BaseFloat

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True, kw_only=True)
class BFloat16(BaseFloat):
    """bfloat16 (1 sign, 8 exponent, 7 fraction bits), little-endian, Zarr v3 only."""

    dtype_cls = type(BFLOAT16)
    _zarr_v3_name = "bfloat16"
    _zarr_v2_names = ()

    @classmethod
    def from_native_dtype(cls, dtype) -> BFloat16:
        if dtype == BFLOAT16:
            return cls(endianness="little")
        raise DataTypeValidationError(f"invalid data type {dtype}: expected {BFLOAT16}")

    def to_native_dtype(self) -> np.dtype:
        return BFLOAT16

    @property
    def item_size(self) -> int:
        return 2


# Known in this process even where the entry point is not installed (a source checkout).
data_type_registry.register(BFloat16._zarr_v3_name, BFloat16)
