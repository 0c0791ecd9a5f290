"""Choosing the adapter of a loaded model: the arithmetic transformers' or that of a transformers family."""
from __future__ import annotations

import threading

from torch import nn

from ..families import UnsupportedModelError, family_for, unsupported
from ..model import ArithmeticTransformer
from .arithmetic import ArithmeticAdapter
from .base import Adapter
from .huggingface import HuggingFaceAdapter

ADAPTER_ATTRIBUTE = "_orthosphere_adapter"
_ADAPTERS_LOCK = threading.Lock()


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter of a loaded model (one per model, kept on it: its stateless hooks are installed
    once and go with the model); any other architecture is an UnsupportedModelError."""
    with _ADAPTERS_LOCK:
        adapter = getattr(model, ADAPTER_ATTRIBUTE, None)
        if adapter is None:
            adapter = _new_adapter(model)
            setattr(model, ADAPTER_ATTRIBUTE, adapter)
        return adapter


def _new_adapter(model: nn.Module) -> Adapter:
    if isinstance(model, ArithmeticTransformer):
        return ArithmeticAdapter(model)
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) is None:
        raise UnsupportedModelError(unsupported(f"a {type(model).__name__} (neither a transformers model nor an "
                                                "orthosphere arithmetic model)"))
    model_type = config.model_type
    family = family_for(model_type)
    accepted = [name for name in (family.lm_class, family.base_class) if name is not None]
    if type(model).__name__ not in accepted:
        raise UnsupportedModelError(
            f"{type(model).__name__} is not supported for {model_type}: expected {' or '.join(accepted)} (the "
            "language-model head gives the predictions; a class without a head stores none)"
        )
    return HuggingFaceAdapter(model, family)
