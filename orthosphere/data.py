"""Stores as training data: ``orthosphere.data.TokenLoader`` (needs PyTorch: the ``train`` extra).

The loader reads the store format, so it lives in ``store/loader.py``; this module is its public
face, and imports PyTorch only when the loader is asked for, so ``orthosphere`` stays importable
without it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orthosphere.store.loader import TokenLoader

__all__ = ["TokenLoader"]


def __getattr__(name: str):
    if name != "TokenLoader":
        raise AttributeError(f"module 'orthosphere.data' has no attribute {name!r}")
    try:
        from orthosphere.store.loader import TokenLoader
    except ModuleNotFoundError as error:
        if error.name != "torch":
            raise
        raise ModuleNotFoundError("orthosphere.data.TokenLoader needs torch, which is not installed: install the "
                                  "train extra (pip install 'orthosphere[train]')", name="torch") from None
    return TokenLoader
