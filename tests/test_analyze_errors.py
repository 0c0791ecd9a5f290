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
        factor_subspaces(dataset, factors=["alpha", "digit_value[role=digit]"])
    message = str(error.value)
    assert "'digit_value'" in message and "['alpha', 'beta']" in message and "'pos'" in message
    assert "task (name=planted)" in message and "extract with a task that labels" in message
    with pytest.raises(AnalysisError, match="needs label 'role'"):
        sphere_structure(dataset, factors=["alpha[role=digit]"])


def test_a_factor_with_a_single_class_is_refused(dataset):
    with pytest.raises(AnalysisError) as error:
        factor_subspaces(dataset, factors=["beta[beta=2]"])
    message = str(error.value)
    assert "factor 'beta[beta=2]' has a single class ('2', 50 tokens)" in message
    assert "at least two classes" in message
    with pytest.raises(AnalysisError, match="has no tokens"):
        factor_subspaces(dataset, factors=["alpha[beta=9]"])


def test_a_rank_larger_than_the_classes_allow_is_refused(dataset):
    with pytest.raises(AnalysisError) as error:
        factor_subspaces(dataset, factors=["alpha", "beta"], rank=4)
    message = str(error.value)
    assert "rank=4 is more than factor 'beta' allows: its 4 classes span at most 3 dimension(s)" in message
    assert "choose rank <= 3 or leave rank unset" in message
    with pytest.raises(AnalysisError, match="rank=4 is more than factor 'beta' allows"):
        sphere_structure(dataset, factors=["alpha", "beta"], rank=4)


def test_a_cap_of_zero_classes_and_an_unknown_estimator_are_refused(dataset):
    with pytest.raises(AnalysisError, match=r"max_classes=0: expected an integer >= 2, the most classes a factor keeps"):
        factor_subspaces(dataset, factors=["alpha"], max_classes=0)
    with pytest.raises(AnalysisError, match=r"max_classes=1: expected an integer >= 2"):
        analyze(dataset.attrs["url"], analyses=["subspaces"], max_classes=1)
    with pytest.raises(AnalysisError, match=r"estimator='ridge': expected one of \['joint', 'marginal'\]"):
        factor_subspaces(dataset, factors=["alpha"], estimator="ridge")
    with pytest.raises(AnalysisError, match=r"n_null=-1: expected an integer >= 0"):
        factor_subspaces(dataset, factors=["alpha"], n_null=-1)


def test_factor_specs_and_option_values_are_checked(dataset):
    with pytest.raises(AnalysisError, match="is not understood"):
        factor_subspaces(dataset, factors=["alpha[beta"])
    with pytest.raises(AnalysisError, match="condition 'beta' is not KEY=V1"):
        factor_subspaces(dataset, factors=["alpha[beta]"])
    with pytest.raises(AnalysisError, match="label 'beta' holds integers, but the condition gives \\['c1'\\]"):
        factor_subspaces(dataset, factors=["alpha[beta=c1]"])
    with pytest.raises(AnalysisError, match="given more than once"):
        factor_subspaces(dataset, factors=["alpha", "alpha"])
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
        factor_subspaces(dataset, site="attn_in")
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
        analyze(url, analyses=["neighbours"])


@pytest.mark.parametrize("run", [
    lambda ds: norm_spread(ds, weight_by_attention=False),
    lambda ds: factor_subspaces(ds, factors=["alpha"]),
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


@pytest.mark.parametrize("options, message", [
    ({"significance": 0.0}, r"significance=0.0: expected a number strictly between 0 and 1"),
    ({"significance": 1}, r"significance=1: expected a number strictly between 0 and 1"),
    ({"confidence": 1.0}, r"confidence=1.0: expected a number strictly between 0 and 1, e.g. 0.9"),
    ({"rank_significance": -0.1}, r"rank_significance=-0.1: expected a number strictly between 0 and 1"),
    ({"orthogonality_deg": 0}, r"orthogonality_deg=0: expected a tolerance in degrees strictly between 0 and 90"),
    ({"independence_deg": 90}, r"independence_deg=90: expected a tolerance in degrees strictly between 0 and 90"),
    ({"independence_deg": 50, "orthogonality_deg": 45}, r"the claims 'dependent' .* and 'orthogonal' .* would overlap"),
    ({"n_bootstrap": 0}, r"n_bootstrap=0 leaves no noise draws for the noise-aware rank: give n_bootstrap .* or a fixed rank"),
    ({"n_bootstrap": 50}, r"n_bootstrap=50 is too few noise draws .*: give n_bootstrap >= 200"),
    ({"radius_cv_tolerance": 0}, r"radius_cv_tolerance=0: expected a positive number"),
    ({"intercepts": 7}, r"intercepts=7: expected a label name, or 'none'"),
])
def test_the_statistics_options_are_checked(dataset, options, message):
    with pytest.raises(AnalysisError, match=message):
        factor_subspaces(dataset, factors=["alpha"], **options)


def test_too_few_null_draws_for_the_correction_are_refused(dataset):
    with pytest.raises(AnalysisError) as error:
        factor_subspaces(dataset, factors=["alpha", "beta"], n_null=50)
    message = str(error.value)
    assert "n_null=50 is too few null draws for the false-discovery correction over 4 structure tests" in message
    assert "give n_null >= 79" in message
    assert factor_subspaces(dataset, factors=["alpha", "beta"], n_null=79, layers=[0]).attrs["n_null"] == 79


def test_intercepts_must_be_a_label_that_no_factor_is_read_from(dataset):
    with pytest.raises(AnalysisError, match=r"intercepts='role': store .* has no label 'role'; its labels are \['alpha', 'beta'\]"):
        factor_subspaces(dataset, factors=["alpha"], intercepts="role")
    with pytest.raises(AnalysisError, match=r"intercepts='beta' gives each class of label 'beta' its own intercept"):
        factor_subspaces(dataset, factors=["alpha", "beta"], intercepts="beta")


def test_a_factor_whose_classes_are_all_too_rare_to_test_is_refused(tmp_path):
    """Every class of `token` lives in one sample (so in one group of samples): its noise cannot be
    resampled; all pooled, one class is left."""
    resid, labels, _ = plant_factors(N_SAMPLES, N_POS, [PlantedFactor("alpha", 5, plane(D_MODEL))])
    labels["token"] = np.repeat(np.arange(N_SAMPLES, dtype="int16")[:, None], N_POS, axis=1)
    labels["token"][:, 0] = NOT_APPLICABLE
    dataset = open_for_analysis(small_store(tmp_path / "s.zarr", resid=resid[:, None].astype("float32"), labels=labels))
    with pytest.raises(AnalysisError) as error:
        factor_subspaces(dataset, factors=["alpha", "token"])
    message = str(error.value)
    assert "factor 'token': its classes are too rare to test" in message
    assert f"{N_SAMPLES} of its {N_SAMPLES} classes have all their tokens in one of the 32 groups" in message
    assert "lower bootstrap_groups" in message
    assert factor_subspaces(dataset, factors=["alpha", "token"], rank=1, n_bootstrap=0, n_null=0)["n_classes"].values.tolist() == [5, N_SAMPLES]


def test_unknown_analyses_and_options_are_refused(dataset):
    url = dataset.attrs["url"]
    with pytest.raises(AnalysisError, match="unknown analysis 'angles'"):
        analyze(url, analyses=["angles"])
    with pytest.raises(AnalysisError, match=r"option\(s\) \['factors'\] are not options of the chosen analyses"):
        analyze(url, analyses=["norms"], factors=["alpha"])
    with pytest.raises(AnalysisError, match=r"\['spheres.mass'\]"):
        analyze(url, analyses=["spheres"], spheres={"mass": 0.8})
    with pytest.raises(AnalysisError, match=r"norms=0.8: an analysis's own options go in a dict, e.g. norms=\{'sites': ...\}"):
        analyze(url, analyses=["norms"], norms=0.8)
    with pytest.raises(AnalysisError, match=r"layers=\[\]: expected at least one layer index"):
        analyze(url, analyses=["norms"], layers=[])
    with pytest.raises(AnalysisError, match=rf"store of type Dataset: expected the path or URL of a store .*{url}"):
        analyze(dataset)
