"""Subpackages that are also functions: ``orthosphere.extract(...)`` and ``orthosphere.analyze(...)``."""
from __future__ import annotations

import importlib
import sys
import types


class CallableModule(types.ModuleType):
    """A module whose call is the function named by its ``__call_target__`` ("module:function"),
    imported on the first call (so that importing the module stays light)."""

    def __call__(self, *args, **kwargs):
        module, _, function = self.__call_target__.partition(":")
        return getattr(importlib.import_module(module), function)(*args, **kwargs)


def make_callable(name: str, target: str) -> None:
    """Let the module `name` be called as the function `target`."""
    module = sys.modules[name]
    module.__class__ = CallableModule
    module.__call_target__ = target
