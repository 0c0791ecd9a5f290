"""Resampling units: the tokens that must be resampled together.

Tokens of one document share their context, so they are not independent: resampling them apart
makes every null and interval too narrow for a label that clusters by document (topic words, names,
code identifiers; cluster-robust inference, Cameron & Miller 2015). So a *unit* is one value of the
grouping label: every token of one document is in one unit, in whichever packed windows it lies,
and a window holding the end of document A and the start of B gives its tokens to two units (the
dependence across that one boundary is left out: chaining A and B, and every document chained to
them through a shared window, would make a typical packed corpus a single unit). A token without a
value (a packed window's BOS, padding) goes with its sample's main unit; a sample without any value
is a unit of its own.

The grouping label is ``group_by``: by default (None) ``document`` when the store holds it, else none
(``sample``: one sample a unit, as the stores of a task of independent samples are); a user's own
label ties the tokens that share one of its values. The statistics of tokens (subspaces, spheres)
resample the units of their tokens (``token_units``, ``token_groups``: each unit hashed into one of the
``bootstrap_groups`` groups of the draws; one sample a unit gives each sample the group it always
had); the replay's, which are counted per sample, resample each sample with its *main* unit, the
value holding most of its tokens (``Units.sample_key``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import dask
import dask.array as da
import numpy as np
import xarray as xr

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
GROUP_BY_HELP = ("the label whose values tie tokens into resampling units (a document across the windows it spans): "
                 "default document when the store has it, else one sample a unit ('sample')")


@dataclass(frozen=True)
class Units:
    """The resampling units of a store's tokens under grouping label `label` ("sample" for one sample a
    unit). `values`: the label's distinct values, sorted (unit k is values[k]); `sample_key` (sample,):
    each sample's main unit, len(values) + the sample's coordinate for a sample without any value."""

    label: str
    values: np.ndarray
    sample_key: np.ndarray
    missing: object = None

    @property
    def token_keys(self) -> np.ndarray:
        """Every unit a token belongs to: the label's values and the samples without any value."""
        return np.union1d(np.arange(len(self.values)), self.sample_key)

    @property
    def n_units(self) -> int:
        return len(self.token_keys)

    @property
    def n_sample_units(self) -> int:
        """The units of the per-sample statistics (each sample with its main unit)."""
        return len(np.unique(self.sample_key))

    def occupied_groups(self, seed: int, n_groups: int) -> int:
        """How many of n_groups groups hold a unit."""
        return len(np.unique(bootstrap_group(self.token_keys, seed, n_groups)))

    def attrs(self, seed: int, n_groups: int) -> dict:
        """What a results group says of its resampling: the label, the units and the groups they fill."""
        return {"group_by": self.label, "n_units": self.n_units, "occupied_groups": self.occupied_groups(seed, n_groups)}


def bootstrap_group(keys: np.ndarray, seed: int, n_groups: int) -> np.ndarray:
    """A seeded hash (splitmix64) of each unit key into one of n_groups groups."""
    z = (np.uint64(seed) << np.uint64(32)) ^ np.asarray(keys).astype(np.uint64)
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(n_groups)).astype("int64")


def token_units(dataset: xr.Dataset, units: Units) -> da.Array:
    """Lazy (sample, pos) int64: the key of each token's unit (one of ``Units.token_keys``), in the
    label's sample chunks, whole along pos."""
    sample_key = da.from_array(units.sample_key, chunks=-1)
    if units.label == SAMPLE:
        return da.broadcast_to(sample_key[:, None], (dataset.sizes["sample"], dataset.sizes["pos"])).rechunk({1: -1})
    label = da.asarray(dataset[units.label].data).rechunk({1: -1})
    sample_key = sample_key.rechunk((label.chunks[0],))[:, None]
    return da.map_blocks(_token_keys, label, sample_key, units.values, units.missing, dtype="int64")


def token_groups(keys: da.Array, seed: int, n_groups: int) -> da.Array:
    """Lazy: the group of each token's unit (``bootstrap_group`` of its key, from ``token_units``)."""
    return keys.map_blocks(bootstrap_group, seed, n_groups, dtype="int64")


def _token_keys(block: np.ndarray, sample_key: np.ndarray, values: np.ndarray, missing) -> np.ndarray:
    block = np.asarray(block)
    present = applies(block, missing)
    codes = np.searchsorted(values, np.where(present, block, values[0] if len(values) else block))
    return np.where(present, codes, np.broadcast_to(sample_key, block.shape))


def grouping_label(dataset: xr.Dataset, group_by: str | None) -> str:
    """The grouping label `group_by` names (None: ``document`` when the store holds it, else ``sample``),
    checked against the store's labels."""
    labels = store_labels(dataset)
    if group_by is None:
        return DOCUMENT if DOCUMENT in labels else SAMPLE
    if group_by != SAMPLE and group_by not in labels:
        raise AnalysisError(
            f"group_by={group_by!r}: store {store_url(dataset)} has no label {group_by!r}; its labels are {labels}. "
            f"Name the label whose values tie tokens together (e.g. {DOCUMENT!r}), or {SAMPLE!r} for one sample a unit"
        )
    return group_by


def resampling_units(dataset: xr.Dataset, group_by: str | None) -> Units:
    """The store's resampling units under the grouping label (one pass over that label)."""
    label = grouping_label(dataset, group_by)
    samples = np.asarray(dataset["sample"].values).astype("int64")
    if label == SAMPLE:
        return Units(SAMPLE, np.zeros(0, "int64"), samples)
    array = da.asarray(dataset[label].data)
    missing = missing_value(dataset, label)
    starts = np.concatenate([[0], np.cumsum(array.chunks[0])[:-1]])
    blocks = array.rechunk({1: -1}).to_delayed().ravel()
    found = dask.compute(*[dask.delayed(_sample_values)(block, int(start), missing) for block, start in zip(blocks, starts)])
    rows, values, counts = (np.concatenate([part[i] for part in found]) for i in range(3))
    distinct, codes = np.unique(values, return_inverse=True)
    return Units(label, distinct, main_units(samples, rows, codes.ravel(), counts, len(distinct)), missing)


def _sample_values(block: np.ndarray, start: int, missing) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct (sample, value) pairs of one block of a label where it applies (samples counted from
    the store's first), with their numbers of tokens."""
    block = np.asarray(block)
    present = applies(block, missing)
    rows = np.nonzero(present)[0] + start
    values, codes = np.unique(block[present], return_inverse=True)
    width = max(len(values), 1)
    pairs, counts = np.unique(rows.astype("int64") * width + codes.ravel(), return_counts=True)
    return pairs // width, values[pairs % width], counts


def main_units(samples: np.ndarray, rows: np.ndarray, codes: np.ndarray, counts: np.ndarray, n_values: int) -> np.ndarray:
    """(sample,) each sample's main unit: the code of the value holding most of its tokens (the first
    such value on a tie), n_values + the sample's coordinate where it holds no value."""
    key = n_values + samples
    order = np.lexsort((codes, -counts, rows))
    rows, codes = rows[order], codes[order]
    first = np.ones(len(rows), bool)
    first[1:] = rows[1:] != rows[:-1]
    key[rows[first]] = codes[first]
    return key


def check_units(units: Units, url: str) -> None:
    """Refuse fewer than MIN_UNITS units to resample."""
    if units.n_units < MIN_UNITS:
        raise AnalysisError(
            f"store {url} holds {units.n_units} resampling unit ({_described(units)}): the nulls and intervals "
            f"need at least {MIN_UNITS} independent units to resample; analyse a store of more documents, or give "
            f"group_by={SAMPLE!r} only if its samples are independent"
        )


def resampled(units: Units, url: str, otherwise: str) -> bool:
    """Whether the per-sample statistics' units (each sample's main unit) can be resampled (MIN_UNITS or
    more); if not, log a warning saying what happens `otherwise` instead."""
    if units.n_sample_units >= MIN_UNITS:
        return True
    log.warning("store %s holds %d resampling unit (%s): nothing to resample, so %s; analyse a store of more "
                "documents, or give group_by=%r only if its samples are independent", url, units.n_sample_units,
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
    return "one sample a unit" if units.label == SAMPLE else f"tokens tied by label {units.label!r}"
