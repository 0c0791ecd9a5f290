"""`orthosphere analyze`: the analyses of a store, plus the online check when a model is given.

Kept apart from the online check so that analysing needs no PyTorch: the online check (which runs
the model) is imported only when it is asked for."""
from __future__ import annotations

import logging

import xarray as xr

from orthosphere.analyze.inputs import open_for_analysis
from orthosphere.analyze.results import chosen_analyses, configure, results_tree, run_analyses, write_results
from orthosphere.errors import ReplayError

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
