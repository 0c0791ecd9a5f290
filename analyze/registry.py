"""What an analysis is: an object that declares its name, its configuration, what it reads, and how
it starts its work (a Plan, see ``plan.py``, or its result at once).

Each analysis module makes one ``Analysis`` (``norms.norm_spread``, ``replay.replay``, ...);
``results.ANALYSES`` lists them in the order they run. Calling one runs it alone on an opened store:
``norm_spread(dataset, mass=0.5)``.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import xarray as xr

from orthosphere.params import Config

from .attention import AttentionShare
from .plan import Plan, run_plans

SHARED_DESCRIPTIONS = {
    "bound": "the low and the high end of an interval",
    "other": "the factors again: the second factor of each pair",
}
"""The descriptions of coordinates several analyses' results share."""


def describe(result: xr.Dataset, descriptions: Mapping[str, str], keep: bool = False) -> xr.Dataset:
    """Set the ``description`` of each of the result's variables and coordinates that `descriptions` (or
    SHARED_DESCRIPTIONS) names; with `keep`, those that have one keep it. In place; returns `result`."""
    for name, text in {**SHARED_DESCRIPTIONS, **descriptions}.items():
        if name in result.variables and not (keep and result[name].attrs.get("description")):
            result[name].attrs["description"] = text
    return result


@dataclass(frozen=True, eq=False)
class Analysis:
    """A registered analysis.

    name: its results group; config: its configuration class (the options, their defaults and
    constraints); start(dataset, config, **earlier) -> Plan or result, where `earlier` holds the
    results of the analyses named in `takes` that ran (spheres take the fitted subspaces), and
    `share`, the call's ``attention.AttentionShare``, when `shares_attention` (the norms and norm_geometry
    read each block's attention from the replay's tasks: one computation, not three); reads:
    the store variables it may read; needs: those without which the default set leaves it out;
    summary: one line for listings.
    """

    name: str
    config: type[Config]
    start: Callable[..., Any]
    reads: tuple[str, ...]
    summary: str
    needs: tuple[str, ...] = ()
    takes: tuple[str, ...] = ()
    shares_attention: bool = False

    @property
    def defaults(self) -> dict:
        """Each option's default."""
        return self.config.defaults()

    def configure(self, options: dict | None = None) -> Config:
        """The configuration of these options (an unknown or refused one is an error naming it)."""
        return self.config.of(options, owner=f"analysis {self.name}")

    def plan(self, dataset: xr.Dataset, config: Config, share: AttentionShare | None = None, **earlier) -> Plan | Any:
        """Its work on an opened store: a Plan (run with the others' by ``run_analyses``, which hands every
        analysis the same `share`) or its result."""
        shared = {"share": share} if self.shares_attention else {}
        return self.start(dataset, config, **shared, **{name: earlier[name] for name in self.takes if name in earlier})

    def __call__(self, dataset: xr.Dataset, /, **options):
        """Run this analysis alone on an opened store; options are its configuration's parameters (and
        the results of the analyses it takes, by their names). Returns its Dataset or DataTree."""
        earlier = {name: options.pop(name) for name in self.takes if name in options}
        started = self.plan(dataset, self.configure(options), **earlier)
        result = run_plans({self.name: started})[self.name] if isinstance(started, Plan) else started
        return result if isinstance(result, (xr.Dataset, xr.DataTree)) else result.to_dataset()

    def __repr__(self) -> str:
        return f"<analysis {self.name}: {self.summary}>"
