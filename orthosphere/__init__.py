"""orthosphere: store what trained transformers compute inside their attention layers, and analyse it offline.

The Python API (each name imported on first use, so ``import orthosphere`` stays light and needs no
torch)::

    import orthosphere
    store = orthosphere.extract(model, orthosphere.corpus.jsonl("c.jsonl", context=128), "runs/store.zarr")
    tree = orthosphere.analyze("runs/store.zarr", "runs/results.zarr", analyses=["norms", "subspaces"])
    orthosphere.report("runs/results.zarr", out="runs/report")   # or a list of results

- ``extract(model, data, out, ...)``: ``orthosphere.extract.api``; ``analyze(store, out, ...)``:
  ``orthosphere.analyze.api``; ``corpus`` and ``tasks``: the data objects ``extract`` reads;
- ``open_store``, ``validate``, ``info`` (``orthosphere.store``), ``open_results``
  (``orthosphere.analyze``), ``report`` (``orthosphere.workflows.report.write_report``),
  ``TokenLoader`` (``orthosphere.data``, training on a store), ``verify(store, model)``
  (``orthosphere.extract.verify``: a store recomputed in part from its model), ``atlas``
  (``orthosphere.workflows.atlas``: many models over one corpus, compared); ``errors``: every error,
  in one hierarchy.

The stages are the subpackages ``orthosphere.extract``, ``orthosphere.store``,
``orthosphere.analyze`` and ``orthosphere.workflows``, each in its own folder of the repository.
"""
from __future__ import annotations

import importlib
from importlib.metadata import version

__version__ = version("orthosphere")

_SUBMODULES = ("extract", "analyze", "store", "workflows", "corpus", "tasks", "data", "errors")
_DEFINED_IN = {
    "open_store": "orthosphere.store", "validate": "orthosphere.store", "info": "orthosphere.store",
    "open_results": "orthosphere.analyze", "TokenLoader": "orthosphere.data", "verify": "orthosphere.extract.verify",
    "atlas": "orthosphere.workflows.atlas",
}
"""The API's functions and classes by the module that defines them under the same name."""
__all__ = [*_SUBMODULES, *_DEFINED_IN, "report"]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"orthosphere.{name}")
    if name in _DEFINED_IN:
        return getattr(importlib.import_module(_DEFINED_IN[name]), name)
    if name == "report":
        from orthosphere.workflows.report import write_report

        return write_report
    raise AttributeError(f"module 'orthosphere' has no attribute {name!r}")
