"""Every p-value and interval of the results says the correction it enters, or that it is uncorrected."""
from __future__ import annotations

import numpy as np
import pytest

from orthosphere.analyze import open_for_analysis
from orthosphere.analyze.results import chosen_analyses, configure, run_analyses
from tests.synthetic import write_store

STATED = ("uncorrected", "Benjamini-Hochberg", "pointwise", "Monte Carlo error", "no null, interval or test")
CHECKED = ("_p", "_q", "_ci", "_mc_error")


@pytest.mark.slow
def test_every_p_value_and_interval_states_its_multiplicity(tmp_path):
    rng = np.random.default_rng(0)
    n_samples, n_pos = 64, 6
    labels = {"alpha": rng.integers(0, 3, (n_samples, n_pos)), "beta": rng.integers(0, 3, (n_samples, n_pos))}
    effects = rng.normal(size=(2, 3, 8)) * 2
    resid = effects[0][labels["alpha"]] + effects[1][labels["beta"]] + rng.normal(size=(n_samples, n_pos, 8))
    sites = {"resid_pre": resid[:, None], "q": rng.normal(size=(n_samples, 1, n_pos, 2, 4)) * 3,
             "k": rng.normal(size=(n_samples, 1, n_pos, 2, 4)) * 3, "v": rng.normal(size=(n_samples, 1, n_pos, 2, 4))}
    dataset = open_for_analysis(write_store(tmp_path / "s.zarr", sites, labels=labels))
    results = run_analyses(dataset, configure(chosen_analyses(dataset, ["subspaces", "spheres", "replay"]),
                                              {"factors": ["alpha", "beta"], "replay": {"n_draws": 2, "n_bootstrap": 20}}))
    checked = 0
    for name, tree in results.items():
        for variable in tree.to_dataset().data_vars.values():
            if variable.name.endswith(CHECKED) or variable.name.startswith(("null_", "q_", "k_")):
                description = variable.attrs.get("description", "")
                assert any(words in description for words in STATED), f"/{name} {variable.name}: {description!r}"
                checked += 1
    assert checked >= 25
