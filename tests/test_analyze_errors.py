"""Bad input to the analyses: each a clear error naming the input, what was expected, what to do."""
from __future__ import annotations

import numpy as np
import pytest

from orthosphere.analyze import (
    AnalysisError,
    NonFiniteError,
    analyze,
    factor_subspaces,
    neighbours,
    norm_spread,
    open_for_analysis,
    sphere_structure,
)
from orthosphere.store import IncompleteStoreError, create_store
from tests.synthetic import NOT_APPLICABLE, PlantedFactor, plane, plant_factors, write_store

N_SAMPLES, N_POS, D_MODEL = 40, 6, 8


def small_store(url, *, resid=None, labels=None, sites=("resid_pre", "resid_post")):
    if resid is None:
        resid, planted, _ = plant_factors(N_SAMPLES, N_POS, [PlantedFactor("alpha", 5, plane(D_MODEL)),
                                                             PlantedFactor("beta", 4, plane(D_MODEL, (2, 3)))])
        resid = np.stack([resid, resid], axis=1).astype("float32")
        labels = planted if labels is None else labels
    return write_store(url, {site: resid for site in sites}, labels=labels, samples_per_chunk=16)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return open_for_analysis(small_store(tmp_path_factory.mktemp("errors") / "store.zarr"))


def test_a_factor_whose_label_the_store_lacks_names_the_label_and_where_labels_come_from(dataset):
    with pytest.raises(AnalysisError) as error:
        factor_subspaces(dataset, factors=["alpha", "digit_value[role=digit]"], n_bootstrap=0)
    message = str(error.value)
    assert "'digit_value'" in message and "['alpha', 'beta']" in message and "'pos'" in message
    assert "task (name=planted)" in message and "extract with a task that labels" in message
    with pytest.raises(AnalysisError, match="needs label 'role'"):
        sphere_structure(dataset, factors=["alpha[role=digit]"])


def test_a_factor_with_a_single_class_is_refused(dataset):
    with pytest.raises(AnalysisError) as error:
        factor_subspaces(dataset, factors=["beta[beta=2]"], n_bootstrap=0)
    message = str(error.value)
    assert "factor 'beta[beta=2]' has a single class ('2', 50 tokens)" in message
    assert "at least two classes" in message
    with pytest.raises(AnalysisError, match="has no tokens"):
        factor_subspaces(dataset, factors=["alpha[beta=9]"], n_bootstrap=0)


def test_a_rank_larger_than_the_classes_allow_is_refused(dataset):
    with pytest.raises(AnalysisError) as error:
        factor_subspaces(dataset, factors=["alpha", "beta"], rank=4, n_bootstrap=0)
    message = str(error.value)
    assert "rank=4 is more than factor 'beta' allows: its 4 classes span at most 3 dimension(s)" in message
    assert "choose rank <= 3 or leave rank unset" in message
    with pytest.raises(AnalysisError, match="rank=4 is more than factor 'beta' allows"):
        sphere_structure(dataset, factors=["alpha", "beta"], rank=4)


def test_a_cap_of_zero_classes_and_an_unknown_estimator_are_refused(dataset):
    with pytest.raises(AnalysisError, match=r"max_classes=0: expected an integer >= 2, the most classes a factor keeps"):
        factor_subspaces(dataset, factors=["alpha"], max_classes=0)
    with pytest.raises(AnalysisError, match=r"max_classes=1: expected an integer >= 2"):
        analyze(dataset.attrs["url"], only=["subspaces"], options={"max_classes": 1})
    with pytest.raises(AnalysisError, match=r"estimator='ridge': expected one of \['joint', 'marginal'\]"):
        factor_subspaces(dataset, factors=["alpha"], estimator="ridge")
    with pytest.raises(AnalysisError, match=r"n_null=-1: expected an integer >= 0"):
        factor_subspaces(dataset, factors=["alpha"], n_null=-1)


def test_factor_specs_and_option_values_are_checked(dataset):
    with pytest.raises(AnalysisError, match="is not understood"):
        factor_subspaces(dataset, factors=["alpha[beta"], n_bootstrap=0)
    with pytest.raises(AnalysisError, match="condition 'beta' is not KEY=V1"):
        factor_subspaces(dataset, factors=["alpha[beta]"], n_bootstrap=0)
    with pytest.raises(AnalysisError, match="label 'beta' holds integers, but the condition gives \\['c1'\\]"):
        factor_subspaces(dataset, factors=["alpha[beta=c1]"], n_bootstrap=0)
    with pytest.raises(AnalysisError, match="given more than once"):
        factor_subspaces(dataset, factors=["alpha", "alpha"], n_bootstrap=0)
    with pytest.raises(AnalysisError, match=r"mass=1.5: expected a number in \(0, 1\]"):
        norm_spread(dataset, mass=1.5, weight_by_attention=False)
    with pytest.raises(AnalysisError, match="expected a list, not a single string"):
        norm_spread(dataset, sites="resid_pre", weight_by_attention=False)
    with pytest.raises(AnalysisError, match="bootstrap_groups=1: expected an integer >= 2"):
        factor_subspaces(dataset, bootstrap_groups=1)


def test_a_layer_out_of_range_names_the_stored_layers(dataset):
    with pytest.raises(AnalysisError, match=r"layer\(s\) \[5\] not in store .*holds layers \[0, 1\] of the model's 2"):
        neighbours(dataset, layers=[0, 5])


def test_a_site_not_in_the_store_names_the_stored_sites(dataset):
    with pytest.raises(AnalysisError, match=r"no site 'v', which norm spread needs; it holds \['resid_pre', 'resid_post'\]"):
        norm_spread(dataset, sites=["v"], weight_by_attention=False)
    with pytest.raises(AnalysisError, match="no site 'attn_in', which factor subspaces needs"):
        factor_subspaces(dataset, site="attn_in", n_bootstrap=0)
    with pytest.raises(AnalysisError, match="unknown site 'resid'"):
        neighbours(dataset, step_site="resid")
    with pytest.raises(AnalysisError, match="reads a residual-stream site"):
        sphere_structure(dataset, site="pattern")


def test_attention_weighting_without_pattern_or_q_k_is_refused(dataset):
    with pytest.raises(AnalysisError, match="neither the attention pattern nor both q and k"):
        norm_spread(dataset)


def test_an_incomplete_store_is_refused(tmp_path):
    url = tmp_path / "incomplete.zarr"
    writer = create_store(url, model={"n_layers": 1, "d_model": 4, "n_heads": 1, "n_kv_heads": 1, "d_head": 4},
                          task={}, n_samples=8, n_pos=3, sites=("resid_pre",), samples_per_chunk=4, n_shards=2)
    writer.close()
    with pytest.raises(IncompleteStoreError, match="incomplete: 2 of 2 shards are missing"):
        analyze(url, only=["neighbours"])


@pytest.mark.parametrize("run", [
    lambda ds: norm_spread(ds, weight_by_attention=False),
    lambda ds: factor_subspaces(ds, factors=["alpha"], n_bootstrap=0),
    lambda ds: sphere_structure(ds, factors=["alpha", "beta"]),
    neighbours,
], ids=["norms", "subspaces", "spheres", "neighbours"])
def test_nan_and_inf_are_reported_with_where_they_are(tmp_path, run):
    resid, labels, _ = plant_factors(N_SAMPLES, N_POS, [PlantedFactor("alpha", 5, plane(D_MODEL)),
                                                        PlantedFactor("beta", 4, plane(D_MODEL, (2, 3)))])
    resid = np.stack([resid, resid], axis=1).astype("float32")
    resid[7, 1, 2, 3] = np.nan
    resid[33, 1, 4, 0] = np.inf
    dataset = open_for_analysis(small_store(tmp_path / "nan.zarr", resid=resid, labels=labels))
    with pytest.raises(NonFiniteError) as error:
        run(dataset)
    message = str(error.value)
    assert "'resid_pre' at layer(s) [1] in 2 sample(s) [7, 33]" in message
    assert "re-extract those samples" in message


def test_spheres_need_tokens_that_every_factor_reads(tmp_path):
    resid, labels, _ = plant_factors(N_SAMPLES, N_POS, [PlantedFactor("alpha", 5, plane(D_MODEL))])
    labels["gamma"] = np.where(labels["alpha"] >= 0, NOT_APPLICABLE, 3).astype("int16")
    labels["gamma"][:, 0] = [0, 1] * (N_SAMPLES // 2)
    dataset = open_for_analysis(small_store(tmp_path / "s.zarr", resid=resid[:, None].astype("float32"),
                                            labels=labels))
    with pytest.raises(AnalysisError, match="no token .* is read by every factor"):
        sphere_structure(dataset, factors=["alpha", "gamma"], exclude_start=False, estimator="marginal")


def test_unknown_analyses_and_options_are_refused(dataset):
    url = dataset.attrs["url"]
    with pytest.raises(AnalysisError, match="unknown analysis 'angles'"):
        analyze(url, only=["angles"])
    with pytest.raises(AnalysisError, match=r"option\(s\) \['factors'\] are not options of the chosen analyses"):
        analyze(url, only=["norms"], options={"factors": ["alpha"]})
    with pytest.raises(AnalysisError, match=r"\['spheres.n_bootstrap'\]"):
        analyze(url, only=["spheres"], options={"spheres.n_bootstrap": 3})
