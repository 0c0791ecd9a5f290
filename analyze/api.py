"""Analysis from Python: ``orthosphere.analyze(store, out=None, *, analyses=None, **options)``, the
one public form of the verb (``orthosphere.analyze.analyze`` is the same function).

The analyses and their options are those of ``orthosphere analyze`` (see ``orthosphere.analyze``):
a keyword goes to every chosen analysis that takes it (``layers=[0, 1]``, ``seed=3``), and a
keyword named after an analysis, with a dict, to that analysis only (``replay={"n_draws": 8}``).
"""
from __future__ import annotations

import os
from collections.abc import Iterable

import xarray as xr

from .errors import AnalysisError
from .inputs import open_for_analysis
from .results import chosen_analyses, configure, results_tree, run_analyses, write_results


def analyze(store: str | os.PathLike, out: str | os.PathLike | None = None, *,
            analyses: str | Iterable[str] | None = None, overwrite: bool = False,
            storage_options: dict | None = None, out_storage_options: dict | None = None,
            command: str | None = None, **options) -> xr.DataTree:
    """Run the chosen analyses (default: every one the store can feed) on the complete store and
    return the results tree; with `out`, also write it there (a path or fsspec URL), replacing the
    groups of these analyses in results already there for the same store (results of another store
    only with `overwrite`). `command` is recorded in the results' provenance."""
    if not isinstance(store, (str, os.PathLike)):
        raise AnalysisError(f"store of type {type(store).__name__}: expected the path or URL of a store (the analyses read "
                            "every sample of it" + (f"; this dataset's store is {store.attrs['url']!r}" if isinstance(
                                store, xr.Dataset) and "url" in store.attrs else "") + ")")
    dataset = open_for_analysis(os.fspath(store), storage_options)
    configs = configure(chosen_analyses(dataset, analyses), options)
    tree = results_tree(dataset, run_analyses(dataset, configs), command)
    if out is not None:
        tree = write_results(tree, os.fspath(out), storage_options=out_storage_options, overwrite=overwrite)
    return tree
