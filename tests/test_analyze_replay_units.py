"""The replay's intervals resample documents (a cluster bootstrap), not samples."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import xarray as xr

from orthosphere.analyze import open_for_analysis
from orthosphere.analyze.replay import ReplayConfig, _add_collapse_levels
from orthosphere.analyze.results import run_analyses
from orthosphere.analyze.units import Units
from tests.synthetic import write_store

WINDOWS_PER_DOCUMENT = 4
INSTANCES = 50


def planted_counts(rng, n_documents: int, mean_rate: float) -> tuple[list[dict], Units]:
    """One layer's per-sample counts of a replay with one draw and one level: each document's windows share
    a collapse probability drawn from Beta(2, 18 (1 - m) / m), m = `mean_rate` (documents differ far more
    than the binomial noise of one window's INSTANCES sparse instances); Theorem 7 predicts every collapse."""
    n_samples = n_documents * WINDOWS_PER_DOCUMENT
    rates = np.repeat(rng.beta(2.0, 2.0 * (1 - mean_rate) / mean_rate, n_documents), WINDOWS_PER_DOCUMENT)
    collapsed = rng.binomial(INSTANCES, rates).astype(float)
    part = {"sample_sparse": np.full(n_samples, float(INSTANCES)),
            "sample_curve": collapsed[:, None],
            "sample_collapses": np.stack([collapsed, collapsed], axis=1)[:, :, None],
            "sample_predictions": np.zeros((n_samples, 2, 3, 1))}
    part["sample_predictions"][:, :, 0, 0] = collapsed[:, None]  # predicted = measured: no misses, no false alarms
    units = Units("document", np.arange(n_documents), np.repeat(np.arange(n_documents), WINDOWS_PER_DOCUMENT))
    return [part], units


def pooled_interval(part, units: Units, seed: int) -> xr.Dataset:
    settings = SimpleNamespace(n_draws=1, curve_levels=np.array([0.1]), levels=(0.1,), seed=seed)
    result = xr.Dataset()
    _add_collapse_levels(result, part, settings, 0.01, units, 200, 0.9)
    return result


@pytest.mark.slow
def test_resampling_documents_covers_the_pooled_collapse_rate_where_resampling_windows_does_not():
    rng = np.random.default_rng(0)
    mean_rate, repeats = 0.1, 100
    covered = {"document": 0, "sample": 0}
    for repeat in range(repeats):
        part, units = planted_counts(rng, 60, mean_rate)
        for label, resampled in (("document", units), ("sample", Units("sample", np.zeros(0, "int64"), np.arange(len(units.sample_key))))):
            low, high = pooled_interval(part, resampled, repeat).collapse_rate_pooled_ci.values[0, 0]  # collapse, level 0.1
            covered[label] += low <= mean_rate <= high
    assert 0.8 <= covered["document"] / repeats <= 0.97  # 90 % intervals (percentile: a little short with 60 documents)
    assert covered["sample"] / repeats < 0.75


def test_a_perfect_prediction_has_recall_and_precision_one_in_every_resample():
    part, units = planted_counts(np.random.default_rng(1), 10, 0.2)
    result = pooled_interval(part, units, 0)
    for name in ("theory_recall_pooled_ci", "theory_precision_pooled_ci", "exact_recall_pooled_ci"):
        np.testing.assert_array_equal(result[name].values, [[1.0, 1.0]])


REPLAY = ReplayConfig(n_draws=4, n_bootstrap=50)


def replay_store(url, documents: np.ndarray) -> str:
    rng = np.random.default_rng(0)
    n_samples, n_pos = documents.shape
    q = rng.normal(size=(n_samples, 1, n_pos, 2, 4)) * 3
    k = rng.normal(size=(n_samples, 1, n_pos, 2, 4)) * 3
    return write_store(url, {"q": q, "k": k, "v": rng.normal(size=k.shape)}, labels={"document": documents.astype("int16")})


@pytest.mark.slow
def test_the_replay_resamples_the_stores_documents_and_says_a_single_one_gives_no_interval(tmp_path, caplog):
    documents = np.repeat(np.arange(6), 2)[:, None].repeat(8, axis=1)  # six documents of two windows
    dataset = open_for_analysis(replay_store(tmp_path / "six.zarr", documents))
    result = run_analyses(dataset, {"replay": REPLAY})["replay"]
    assert (result.attrs["group_by"], result.attrs["n_units"]) == ("document", 6)
    low, high = result.collapse_rate_pooled_ci.sel(definition="collapse").values.T
    rate = result.collapse_rate_pooled.sel(definition="collapse").values
    assert np.all((low <= rate) & (rate <= high))
    one = open_for_analysis(replay_store(tmp_path / "one.zarr", np.zeros_like(documents)))
    with caplog.at_level(logging.WARNING, logger="orthosphere.analyze"):
        single = run_analyses(one, {"replay": REPLAY})["replay"]
    assert "holds 1 resampling unit" in caplog.text and "the replay's intervals are NaN" in caplog.text
    assert single.attrs["resamples"] == 0 and np.isnan(single.collapse_rate_pooled_ci.values).all()


def test_a_collapse_level_read_off_a_coarse_grid_has_an_interval_that_holds_the_crossing():
    """Every resample reaches the target at the second swept level: the crossing lies between the first and the
    second, so the interval is [first, second], not the zero-width [second, second]; at the first level, [0, first]."""
    levels = np.array([0.05, 0.1, 0.3])
    n_samples = 12
    for counts, expected in (([0, 25, 50], [0.05, 0.1]), ([25, 50, 50], [0.0, 0.05])):
        collapsed = np.tile(np.asarray(counts, float), (n_samples, 1))  # (sample, level)
        part = {"sample_sparse": np.full(n_samples, float(INSTANCES)), "sample_curve": collapsed,
                "sample_collapses": np.stack([collapsed, collapsed], axis=1),
                "sample_predictions": np.zeros((n_samples, 2, 3, len(levels)))}
        units = Units("document", np.arange(n_samples), np.arange(n_samples))
        settings = SimpleNamespace(n_draws=1, curve_levels=levels, levels=tuple(levels), seed=0)
        result = xr.Dataset()
        _add_collapse_levels(result, [part], settings, 0.01, units, 50, 0.9)
        np.testing.assert_array_equal(result.collapse_level.values, [[expected[1]], [expected[1]]])
        np.testing.assert_array_equal(result.collapse_level_ci.values, [[expected], [expected]])
        np.testing.assert_array_equal(result.collapse_level_pooled_ci.values, [expected, expected])
