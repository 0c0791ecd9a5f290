"""`orthosphere analyze`: the analyses of a store, plus the online check when a model is given.

Kept apart from the online check so that analysing needs no PyTorch: the online check (which runs
the model) is imported only when it is asked for."""
from __future__ import annotations

import logging

import xarray as xr

from orthosphere.analyze import analyze, write_results

log = logging.getLogger("orthosphere.online_check")


def analyze_with_online_check(store, out, *, online_model=None, online_samples: int | None = None,
                              online_device: str = "cpu", overwrite: bool = False, **analyze_options) -> xr.DataTree:
    """`orthosphere.analyze.analyze` of `store`, plus the online check with `online_model` on
    `online_device` when given (the replay's noise in every layer at once too), written to `out`."""
    tree = analyze(store, **analyze_options)
    if online_model is not None:
        from .online_check import with_online_check

        log.info("online check of %s with %s on %s", store, online_model, online_device)
        tree = with_online_check(tree, store, str(online_model), all_layers=True, max_samples=online_samples,
                                 device=online_device)
    return write_results(tree, out, overwrite=overwrite)
