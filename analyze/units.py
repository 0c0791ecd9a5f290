"""Resampling units: the samples whose tokens must be resampled together.

Tokens of one document share their context, so they are not independent: resampling them apart
makes every null and interval too narrow for a label that clusters by document (topic words, names,
code identifiers; cluster-robust inference, Cameron & Miller 2015). A packed corpus spreads a
document over several windows, and a window holding the end of document A and the start of B ties
A and B together. So a *unit* is a connected component of the graph joining each sample to the
values of the grouping label among its tokens: every sample of one document, and every document
chained to it through a shared window, is one unit (``chained_units``).

The grouping label is ``group_by``: by default (None) ``document`` when the store holds it, else none
(``sample``: one sample a unit, as the stores of a task of independent samples are); a user's own
label ties the samples that share one of its values. The units are hashed into the
``bootstrap_groups`` groups of the draws (``unit_groups``): each unit by its first sample, so that
one sample a unit gives each sample the group it always had.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import dask
import dask.array as da
import numpy as np
import xarray as xr
from scipy import sparse
from scipy.sparse.csgraph import connected_components

from orthosphere.params import Text

from .errors import AnalysisError
from .factors import applies, missing_value, store_labels
from .inputs import store_url

log = logging.getLogger("orthosphere.analyze")

DOCUMENT = "document"
"""The corpus label of a token's document (``store/SCHEMA.md``): the default grouping label."""
SAMPLE = "sample"
"""``group_by`` for one sample a unit."""
MIN_UNITS = 2
"""Fewer units than this leave nothing to resample: the draws' nulls and intervals would be meaningless."""
GROUP_BY = Text("a label name, or 'sample' for one sample a unit")
GROUP_BY_HELP = ("the label whose values tie samples into resampling units (documents chained across windows): "
                 "default document when the store has it, else one sample a unit ('sample')")


@dataclass(frozen=True)
class Units:
    """Each sample's resampling unit: `key` (sample,) is the sample coordinate of the unit's first sample;
    `label` the grouping label ("sample" for one sample a unit)."""

    label: str
    key: np.ndarray

    @property
    def n_units(self) -> int:
        return len(np.unique(self.key))

    def occupied_groups(self, seed: int, n_groups: int) -> int:
        """How many of n_groups groups hold a unit."""
        return len(np.unique(unit_groups(self, seed, n_groups)))

    def attrs(self, seed: int, n_groups: int) -> dict:
        """What a results group says of its resampling: the label, the units and the groups they fill."""
        return {"group_by": self.label, "n_units": self.n_units, "occupied_groups": self.occupied_groups(seed, n_groups)}


def bootstrap_group(samples: np.ndarray, seed: int, n_groups: int) -> np.ndarray:
    """A seeded hash (splitmix64) of each sample index into one of n_groups groups."""
    z = (np.uint64(seed) << np.uint64(32)) ^ np.asarray(samples).astype(np.uint64)
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(n_groups)).astype("int64")


def unit_groups(units: Units, seed: int, n_groups: int) -> np.ndarray:
    """(sample,) the group of each sample: its unit's key hashed (``bootstrap_group``)."""
    return bootstrap_group(units.key, seed, n_groups)


def grouping_label(dataset: xr.Dataset, group_by: str | None) -> str:
    """The grouping label `group_by` names (None: ``document`` when the store holds it, else ``sample``),
    checked against the store's labels."""
    labels = store_labels(dataset)
    if group_by is None:
        return DOCUMENT if DOCUMENT in labels else SAMPLE
    if group_by != SAMPLE and group_by not in labels:
        raise AnalysisError(
            f"group_by={group_by!r}: store {store_url(dataset)} has no label {group_by!r}; its labels are {labels}. "
            f"Name the label whose values tie samples together (e.g. {DOCUMENT!r}), or {SAMPLE!r} for one sample a unit"
        )
    return group_by


def resampling_units(dataset: xr.Dataset, group_by: str | None) -> Units:
    """Each sample's resampling unit (``chained_units`` over the grouping label; one pass over that label)."""
    label = grouping_label(dataset, group_by)
    samples = np.asarray(dataset["sample"].values)
    if label == SAMPLE:
        return Units(SAMPLE, samples)
    array = da.asarray(dataset[label].data)
    missing = missing_value(dataset, label)
    starts = np.concatenate([[0], np.cumsum(array.chunks[0])[:-1]])
    blocks = array.rechunk({1: -1}).to_delayed().ravel()
    found = dask.compute(*[dask.delayed(_sample_values)(block, int(start), missing) for block, start in zip(blocks, starts)])
    first = chained_units(len(samples), [rows for rows, _ in found], [values for _, values in found])
    return Units(label, samples[first])


def _sample_values(block: np.ndarray, start: int, missing) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (sample, value) pairs of one block of a label where it applies (samples counted from
    the store's first)."""
    block = np.asarray(block)
    present = applies(block, missing)
    rows = np.nonzero(present)[0] + start
    values, codes = np.unique(block[present], return_inverse=True)
    pairs = np.unique(rows.astype("int64") * max(len(values), 1) + codes.ravel())
    return pairs // max(len(values), 1), values[pairs % max(len(values), 1)]


def chained_units(n_samples: int, rows: list[np.ndarray], values: list[np.ndarray]) -> np.ndarray:
    """(sample,) index of the first sample of each sample's unit: the connected components of the graph
    joining sample rows[i][j] to label value values[i][j] (samples without a value are units alone)."""
    rows = np.concatenate(rows) if rows else np.zeros(0, "int64")
    every = np.concatenate(values) if values else np.zeros(0)
    distinct, codes = np.unique(every, return_inverse=True)
    size = n_samples + len(distinct)
    edges = sparse.coo_matrix((np.ones(len(rows)), (rows, n_samples + codes.ravel())), shape=(size, size))
    _, component = connected_components(edges, directed=False)
    component = component[:n_samples]
    first = np.full(component.max() + 1 if n_samples else 0, n_samples)
    np.minimum.at(first, component, np.arange(n_samples))
    return first[component]


def check_units(units: Units, url: str) -> None:
    """Refuse fewer than MIN_UNITS units to resample."""
    if units.n_units < MIN_UNITS:
        raise AnalysisError(
            f"store {url} holds {units.n_units} resampling unit ({_described(units)}): the nulls and intervals "
            f"need at least {MIN_UNITS} independent units to resample; analyse a store of more documents, or give "
            f"group_by={SAMPLE!r} only if its samples are independent"
        )


def resampled(units: Units, url: str, otherwise: str) -> bool:
    """Whether the units can be resampled (MIN_UNITS or more); if not, log a warning saying what happens
    `otherwise` instead."""
    if units.n_units >= MIN_UNITS:
        return True
    log.warning("store %s holds %d resampling unit (%s): nothing to resample, so %s; analyse a store of more "
                "documents, or give group_by=%r only if its samples are independent", url, units.n_units,
                _described(units), otherwise, SAMPLE)
    return False


def warn_fewer_units_than_groups(units: Units, seed: int, n_groups: int, url: str) -> None:
    """Log a warning when the units are fewer than the groups: some groups stay empty, and the draws
    resample only as many as there are units."""
    if units.n_units < n_groups:
        log.warning("store %s holds %d resampling units (%s), fewer than bootstrap_groups=%d: only %d groups are "
                    "resampled, and the nulls and intervals are coarser; analyse more documents or lower "
                    "bootstrap_groups", url, units.n_units, _described(units), n_groups,
                    units.occupied_groups(seed, n_groups))


def _described(units: Units) -> str:
    return "one sample a unit" if units.label == SAMPLE else f"samples tied by label {units.label!r}, chained across windows"
