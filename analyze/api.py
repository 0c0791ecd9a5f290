"""Analysis from Python: ``orthosphere.analyze(store, out=None, *, analyses=None, **options)``.

The analyses and their options are those of ``orthosphere analyze`` (see ``orthosphere.analyze``):
a keyword goes to every chosen analysis that takes it (``layers=[0, 1]``, ``seed=3``), and a
keyword named after an analysis, with a dict, to that analysis only (``replay={"n_draws": 8}``).
"""
from __future__ import annotations

import os
from collections.abc import Iterable

import xarray as xr

from .results import ANALYSES
from .results import analyze as run_analyses


def analyze(store: str | os.PathLike, out: str | os.PathLike | None = None, *,
            analyses: str | Iterable[str] | None = None, overwrite: bool = False,
            storage_options: dict | None = None, out_storage_options: dict | None = None, **options) -> xr.DataTree:
    """Run the chosen analyses (default: every one the store can feed) on the complete store and
    return the results tree; with `out`, also write it there."""
    names = analyses.split(",") if isinstance(analyses, str) else None if analyses is None else list(analyses)
    flat = {}
    for key, value in options.items():
        if key in ANALYSES and isinstance(value, dict):
            flat.update({f"{key}.{option}": setting for option, setting in value.items()})
        else:
            flat[key] = value
    return run_analyses(os.fspath(store), None if out is None else os.fspath(out), only=names, options=flat,
                        storage_options=storage_options, out_storage_options=out_storage_options, overwrite=overwrite)
