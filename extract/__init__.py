"""orthosphere.extract: models -> activations (model family, tasks, adapters and capture, batch jobs).

Called as a function, ``orthosphere.extract(model, data, out, ...)`` runs an extraction and returns
the store (``orthosphere.extract.api.extract``).
"""
import sys
import types

from .defaults import DEFAULT_BATCH_SIZE

__all__ = ["DEFAULT_BATCH_SIZE"]


class _ExtractPackage(types.ModuleType):
    """This package, callable as ``orthosphere.extract.api.extract`` (imported on the first call, so that
    importing the package stays light)."""

    def __call__(self, *args, **kwargs):
        from .api import extract

        return extract(*args, **kwargs)


sys.modules[__name__].__class__ = _ExtractPackage
