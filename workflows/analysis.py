"""`orthosphere analyze`: the analyses of a store, plus the online check when a model is given.

Kept apart from the online check so that analysing needs no PyTorch: the online check (which runs
the model) is imported only when it is asked for."""
from __future__ import annotations

import json
import logging
from collections.abc import Callable

import xarray as xr

from orthosphere.analyze.inputs import open_for_analysis
from orthosphere.analyze.results import chosen_analyses, configure, results_tree, run_analyses, write_results
from orthosphere.errors import ReplayError
from orthosphere.store.location import Location, as_location

log = logging.getLogger("orthosphere.online_check")


def analyze_with_online_check(store, out, *, analyses=None, options: dict | None = None, online_model=None,
                              online_samples: int | None = None, online_device: str = "cpu", overwrite: bool = False,
                              command: str | None = None) -> xr.DataTree:
    """The analyses of `store` (`analyses` and `options` as ``orthosphere.analyze`` takes them, the
    options in one dict), plus the online check with `online_model` on `online_device` when given
    (the replay's configuration, its noise in every layer at once too), written to `out`."""
    dataset = open_for_analysis(store)
    configs = configure(chosen_analyses(dataset, analyses), options)
    if online_model is not None and "replay" not in configs:
        raise ReplayError("the online check repeats the replay's noise, but the analyses chosen hold no replay: include "
                          "the replay analysis (analyses=[..., \"replay\"])")
    tree = results_tree(dataset, run_analyses(dataset, configs), command)
    if online_model is not None:
        from .online_check import with_online_check

        log.info("online check of %s with %s on %s", store, online_model, online_device)
        tree = with_online_check(tree, store, str(online_model), configs["replay"], all_layers=True,
                                 max_samples=online_samples, device=online_device)
    return write_results(tree, out, overwrite=overwrite)


def analysis_request(**asked) -> str:
    """What makes a run's results (the analyses, their options, the online check ...), as the text
    recorded beside them: results are kept only for the same text."""
    return json.dumps(asked, sort_keys=True, default=repr)


def _request_file(results) -> tuple[Location, str]:
    """The folder of `results` (a path or fsspec URL) and the name of the file beside them,
    NAME.zarr.request.json, that records the request that made them."""
    folder, _, name = str(results).rstrip("/").rpartition("/")
    return as_location(folder or "."), f"{name}.request.json"


def kept_results(results, request: str, wanted, online: bool = False) -> bool:
    """Whether the results at `results` were made by the same `request` (recorded beside them once
    complete) and hold every `wanted` analysis (and the online check with `online`)."""
    from orthosphere.analyze import open_results

    folder, name = _request_file(results)
    try:
        if not folder.fs.isfile(folder.key(name)) or folder.fs.cat_file(folder.key(name)).decode() != request:
            return False
        tree = open_results(str(results))
    except (OSError, ValueError, KeyError):
        return False
    has_online = "replay" in tree.children and "online" in tree["replay"].children
    return set(wanted) <= set(tree.attrs.get("analyses", [])) and (not online or has_online)


def analyse_and_record(results, request: str, analyse: Callable[[], object]) -> None:
    """Run `analyse` (which writes `results`), then record `request` beside them; the old record is
    removed first, so results that a stopped run left half made are never kept."""
    folder, name = _request_file(results)
    if folder.fs.isfile(folder.key(name)):
        folder.remove_entry(name)
    analyse()
    folder.write_atomic(name, request.encode())
