"""Rank collapse and angular step on stores with planted values."""
from __future__ import annotations

import numpy as np

from orthosphere.analyze import neighbours, open_for_analysis
from tests.synthetic import plant_neighbours, write_store

PLANTED = ((0.5, 10.0), (0.1, 35.0))  # (rank collapse, angular step in degrees) of layers 0 and 1


def test_planted_rank_collapse_and_angular_step_are_recovered(tmp_path):
    pairs = [plant_neighbours(60, 9, 12, collapse, step, seed=layer) for layer, (collapse, step) in enumerate(PLANTED)]
    pre = np.stack([pre for pre, _ in pairs], axis=1).astype("float32")
    post = np.stack([post for _, post in pairs], axis=1).astype("float32")
    dataset = open_for_analysis(write_store(tmp_path / "store.zarr", {"resid_pre": pre, "resid_post": post},
                                            samples_per_chunk=25))
    result = neighbours(dataset)
    np.testing.assert_allclose(result["rank_collapse"], [0.5, 0.1], atol=1e-5)
    np.testing.assert_allclose(result["rank_collapse_std"], 0.0, atol=1e-4)
    np.testing.assert_allclose(result["angular_step"], [10.0, 35.0], atol=1e-3)
    np.testing.assert_allclose(result["log_norm_ratio"], 0.0, atol=1e-6)
    assert result["n_sequences"].values.tolist() == [60, 60]
    assert result["n_tokens"].values.tolist() == [60 * 8] * 2
    # the start token (the same vector before and after, far from the rest) changes both when kept
    with_start = neighbours(dataset, exclude_start=False, layers=[1])
    assert with_start["rank_collapse"].item() > 0.5
    assert with_start["n_tokens"].item() == 60 * 9
