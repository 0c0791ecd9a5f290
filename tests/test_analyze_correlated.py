"""Factor subspaces and spheres when labels are correlated: planted random (not axis-aligned) subspaces,
unequal class counts, one label partly a function of another, a factor read on a subset of tokens
whose other tokens sit elsewhere; the null on random labels; the confounded and never-co-occurring
designs that the joint fit refuses; rare classes pooled."""
from __future__ import annotations

import logging

import numpy as np
import pytest
from sklearn.metrics import normalized_mutual_info_score

from orthosphere.analyze import AnalysisError, factor_subspaces, open_for_analysis, sphere_structure
from orthosphere.analyze.geometry import principal_angles
from tests.synthetic import (
    NOT_APPLICABLE,
    balanced_effects,
    bases_at_angles,
    correlated_labels,
    random_basis,
    skewed,
    sphere_points,
    write_store,
)

N_SAMPLES, N_POS, D_MODEL = 400, 21, 24
N_TOKENS = N_SAMPLES * (N_POS - 1)
FACTORS = ["alpha", "beta", "gamma[role=x]"]


def as_label(values: np.ndarray, applies=None) -> np.ndarray:
    """Token labels (token,) as an int16 (sample, pos) label; the start token and tokens where it
    does not apply hold the not-applicable value."""
    label = np.full((N_SAMPLES, N_POS), NOT_APPLICABLE, "int16")
    inner = values.astype("int16") if applies is None else np.where(applies, values, NOT_APPLICABLE).astype("int16")
    label[:, 1:] = inner.reshape(N_SAMPLES, N_POS - 1)
    return label


def as_layer(tokens: np.ndarray) -> np.ndarray:
    """Token vectors (token, d) as one layer (sample, pos, d); the start token elsewhere."""
    layer = np.zeros((N_SAMPLES, N_POS, D_MODEL))
    layer[:, 1:] = tokens.reshape(N_SAMPLES, N_POS - 1, D_MODEL)
    layer[:, 0, -1] = 30.0
    return layer


@pytest.fixture(scope="module")
def correlated(tmp_path_factory):
    """alpha (6 skewed classes) and beta (4; alpha mod 4 on half the tokens); gamma (5 classes) read
    only on role x, the role-y tokens offset elsewhere. Layer 0: alpha (rank 3) and beta (rank 2)
    orthogonal; layer 1: their principal angles 40 and 75 degrees; layer 2: orthogonal spheres."""
    rng = np.random.default_rng(7)
    probabilities = {"alpha": skewed(6, rng), "beta": skewed(4, rng), "gamma": skewed(5, rng)}
    alpha, beta = correlated_labels(N_TOKENS, [probabilities["alpha"], probabilities["beta"]], 0.5, rng)
    gamma = rng.choice(5, size=N_TOKENS, p=probabilities["gamma"])
    role_x = rng.random(N_TOKENS) < 0.5
    offset = 2.0 * rng.normal(size=D_MODEL)
    planted = {}

    def layer(bases, effects, noise):
        x = effects["alpha"][alpha] + effects["beta"][beta] + np.where(role_x[:, None], effects["gamma"][gamma], offset)
        return as_layer(x + noise * rng.normal(size=x.shape))

    layers = []
    for angles in ([90.0, 90.0], [40.0, 75.0]):
        bases = dict(zip(("alpha", "beta"), bases_at_angles(D_MODEL, 3, 2, angles, rng)))
        bases["gamma"] = random_basis(D_MODEL, 2, rng)
        scales = {"alpha": 1.0, "beta": 0.8, "gamma": 0.6}
        layers.append(layer(bases, {name: balanced_effects(probabilities[name], basis, scales[name], rng)
                                    for name, basis in bases.items()}, 0.05))
        planted[len(layers) - 1] = bases
    spheres = random_basis(D_MODEL, 7, rng)
    bases = {"alpha": spheres[:, :3], "beta": spheres[:, 3:5], "gamma": spheres[:, 5:]}
    radii = {"alpha": 2.0, "beta": 1.5, "gamma": 1.0}
    layers.append(layer(bases, {name: sphere_points(len(probabilities[name]), basis, radii[name], rng)
                                for name, basis in bases.items()}, 1e-3))
    roles = np.full((N_SAMPLES, N_POS), "", dtype=object)
    roles[:, 1:] = np.where(role_x, "x", "y").reshape(N_SAMPLES, N_POS - 1)
    labels = {"alpha": as_label(alpha), "beta": as_label(beta), "gamma": as_label(gamma), "role": roles}
    url = write_store(tmp_path_factory.mktemp("correlated") / "store.zarr",
                      {"resid_pre": np.stack(layers, axis=1).astype("float32")}, labels=labels, samples_per_chunk=100)
    dataset = open_for_analysis(url)
    joint = factor_subspaces(dataset, factors=FACTORS, layers=[0, 1], seed=1)
    return dataset, joint, planted, {"alpha": alpha, "beta": beta, "gamma": gamma, "role_x": role_x}


@pytest.mark.slow
def test_planted_angles_and_ranks_are_recovered_from_correlated_labels(correlated):
    _, joint, planted, _ = correlated
    angles = joint["angles"].sel(factor="alpha", other="beta").values
    np.testing.assert_allclose(angles[0, :2], [90.0, 90.0], atol=1.0)
    np.testing.assert_allclose(angles[1, :2], [40.0, 75.0], atol=1.0)
    assert joint["subspace_rank"].values.tolist() == [[3, 2, 2], [3, 2, 2]]
    for layer, bases in planted.items():  # gamma, read on half the tokens, against both
        for other in ("alpha", "beta"):
            expected = principal_angles(bases["gamma"], bases[other])
            found = joint["angles"].sel(layer=layer, factor="gamma[role=x]", other=other).values[: len(expected)]
            np.testing.assert_allclose(found, expected, atol=1.0)
    interval = joint["min_angle_ci"].sel(factor="alpha", other="beta").values
    assert np.all(interval[:, 0] <= [90.0, 40.0]) and np.all(interval[:, 1] >= [89.0, 40.0])
    interval = joint["max_angle_ci"].sel(factor="alpha", other="beta").values
    assert np.all(interval[:, 0] <= [90.0, 75.0]) and np.all(interval[:, 1] >= [89.0, 75.0])
    assert joint["relation"].sel(factor="alpha", other="beta").values.tolist() == ["orthogonal", "independent"]
    assert np.all(joint["structure_q"].values <= 0.05)


def test_the_marginal_fit_is_misled_by_the_same_labels(correlated):
    dataset, _, _, _ = correlated
    marginal = factor_subspaces(dataset, factors=FACTORS, layers=[0], estimator="marginal")
    assert marginal["min_angle"].sel(layer=0, factor="alpha", other="beta").item() < 60.0
    assert marginal["subspace_rank"].sel(layer=0, factor="beta").item() > 2


def test_orthogonal_spheres_read_on_spheres_with_correlated_labels(correlated):
    """Class points on orthogonal spheres (radii 2, 1.5, 1) with correlated labels, on the role-x tokens
    (the role-y tokens' offset has a component in every subspace: they are not on spheres): the joint
    fit's components have constant radii and no cross terms; the marginal fit's do not."""
    dataset, _, _, _ = correlated
    factors = ["alpha[role=x]", "beta[role=x]", "gamma[role=x]"]
    joint = sphere_structure(dataset, factors=factors, layers=[2])
    assert joint["subspace_rank"].values.tolist() == [[3, 2, 2]]
    assert np.all(joint["radius_cv"].values <= 0.01) and np.all(joint["radius_cv_ci"].sel(bound="high").values < 0.1)
    assert joint["sphere"].values.tolist() == [["on sphere"] * 3]
    np.testing.assert_allclose(joint["radius_mean"].values[0], [2.0, 1.5, 1.0], rtol=0.01)
    assert np.nanmax(joint["cross_term"].values) < 0.01
    marginal = sphere_structure(dataset, factors=factors, layers=[2], estimator="marginal")
    assert np.nanmax(marginal["cross_term"].values) > 0.05 and marginal.attrs["estimator"] == "marginal"


def test_label_association_and_the_cost_of_correlation_are_reported(correlated):
    _, joint, _, labels = correlated
    expected = normalized_mutual_info_score(labels["alpha"], labels["beta"])
    np.testing.assert_allclose(joint["label_nmi"].sel(factor="alpha", other="beta"), expected, rtol=1e-9)
    x = labels["role_x"]
    np.testing.assert_allclose(joint["label_nmi"].sel(factor="gamma[role=x]", other="alpha"),
                               normalized_mutual_info_score(labels["gamma"][x], labels["alpha"][x]), rtol=1e-9)
    assert joint["shared_tokens"].sel(factor="gamma[role=x]", other="beta").item() == x.sum()
    inflation = joint["variance_inflation"].values
    assert np.all(inflation[:2] > 1.1) and inflation[2] == pytest.approx(1.0, abs=0.05)
    assert 3 < joint["condition_number"].item() < 100


def test_strongly_associated_labels_are_logged_as_an_ill_conditioned_fit(tmp_path, caplog):
    rng = np.random.default_rng(3)
    alpha, beta = correlated_labels(N_TOKENS, [skewed(6, rng), skewed(4, rng)], 0.99, rng)
    x = as_layer(rng.normal(size=(N_TOKENS, D_MODEL)))[:, None]
    url = write_store(tmp_path / "s.zarr", {"resid_pre": x.astype("float32")},
                      labels={"alpha": as_label(alpha), "beta": as_label(beta)})
    with caplog.at_level(logging.WARNING, logger="orthosphere.analyze"):
        result = factor_subspaces(open_for_analysis(url), factors=["alpha", "beta"], rank=1, n_bootstrap=0, n_null=0)
    assert result["condition_number"].item() > 100
    message = " ".join(record.getMessage() for record in caplog.records)
    assert "ill-conditioned (condition number" in message and "alpha ~ beta: NMI" in message


def store_of_labels(path, **labels) -> object:
    rng = np.random.default_rng(0)
    x = as_layer(rng.normal(size=(N_TOKENS, D_MODEL)))[:, None].astype("float32")
    return open_for_analysis(write_store(path, {"resid_pre": x}, labels={k: as_label(v) for k, v in labels.items()}))


def test_perfectly_confounded_factors_are_refused(tmp_path):
    rng = np.random.default_rng(1)
    alpha = rng.integers(0, 5, N_TOKENS)
    dataset = store_of_labels(tmp_path / "s.zarr", alpha=alpha, copy=alpha, beta=rng.integers(0, 3, N_TOKENS))
    with pytest.raises(AnalysisError, match=r"cannot separate factors \['alpha', 'copy'\] .*drop one of them"):
        factor_subspaces(dataset, factors=["alpha", "beta", "copy"])
    with pytest.raises(AnalysisError, match="cannot separate"):
        sphere_structure(dataset, factors=["alpha", "copy"])


def test_classes_that_never_co_occur_are_refused(tmp_path):
    rng = np.random.default_rng(2)
    alpha = rng.integers(0, 4, N_TOKENS)
    beta = 2 * (alpha // 2) + rng.integers(0, 2, N_TOKENS)  # alpha 0, 1 meet beta 0, 1 only; 2, 3 meet 2, 3
    dataset = store_of_labels(tmp_path / "s.zarr", alpha=alpha, beta=beta)
    with pytest.raises(AnalysisError, match="groups of their classes never occur with the rest"):
        factor_subspaces(dataset, factors=["alpha", "beta"])
    assert factor_subspaces(dataset, factors=["alpha", "beta"], estimator="marginal")["n_classes"].values.tolist() == [4, 4]


def test_a_factor_sharing_no_token_with_the_others_is_refused(correlated):
    dataset, _, _, _ = correlated
    with pytest.raises(AnalysisError, match=r"factor 'gamma\[role=x\]' shares no token .* \['alpha\[role=y\]'\]"):
        factor_subspaces(dataset, factors=["gamma[role=x]", "alpha[role=y]"])


@pytest.mark.slow
def test_random_labels_on_isotropic_noise_are_judged_at_the_stated_false_positive_rate(tmp_path):
    rng = np.random.default_rng(5)
    n_samples, n_pos, d_model, n_layers = 200, 21, 16, 40
    x = rng.normal(size=(n_samples, n_layers, n_pos, d_model)).astype("float32")
    labels = {name: rng.integers(0, size, (n_samples, n_pos)).astype("int16") for name, size in (("a", 5), ("b", 4))}
    for label in labels.values():
        label[:, 0] = NOT_APPLICABLE
    dataset = open_for_analysis(write_store(tmp_path / "noise.zarr", {"resid_pre": x}, labels=labels,
                                            samples_per_chunk=50))
    result = factor_subspaces(dataset, factors=["a", "b"], significance=0.05, seed=1)
    p = result["structure_p"].values
    assert (p <= 0.05).sum() <= 12  # 80 tests at 5 %: 4 expected, 12 or more has probability < 0.001
    assert 0.35 < p.mean() < 0.65  # p-values spread evenly: the null is neither lax nor strict
    assert np.mean(result["subspace_rank"].values == 0) >= 0.9  # noise directions are not taken for structure
    relation = result["relation"].sel(factor="a", other="b").values
    assert np.isin(relation, ["orthogonal", "dependent", "independent"]).mean() <= 0.05  # no claim beyond the rate
    # what chance gives, beside the measured angles of subspaces of noise: the null's sits where they do
    result = factor_subspaces(dataset, factors=["a", "b"], rank=2, seed=1)
    measured, null = result["min_angle"].sel(factor="a", other="b").values, result["null_min_angle"].sel(factor="a", other="b").values
    low, high = result["null_min_angle_ci"].sel(factor="a", other="b").values.T
    assert np.mean((measured >= low) & (measured <= high)) >= 0.85
    assert abs(np.median(measured) - np.median(null)) < 5.0


def test_rare_classes_are_pooled_into_one(tmp_path):
    rng = np.random.default_rng(4)
    token = rng.zipf(1.6, N_TOKENS) % 40
    dataset = store_of_labels(tmp_path / "s.zarr", token=token, beta=rng.integers(0, 3, N_TOKENS))
    values, counts = np.unique(token, return_counts=True)
    kept = np.sort(values[np.lexsort((values, -counts))][:7])
    result = factor_subspaces(dataset, factors=["token", "beta"], max_classes=8, rank=1, n_bootstrap=0, n_null=0)
    assert result["n_classes"].values.tolist() == [8, 3]
    assert result["pooled_classes"].values.tolist() == [len(values) - 7, 0]
    assert result["pooled_tokens"].sel(factor="token").item() == counts[~np.isin(values, kept)].sum()
    assert result.attrs["classes"]["token"] == [str(v) for v in kept] + [f"<{len(values) - 7} other classes>"]
    assert result["n_tokens"].sel(factor="token").item() == N_TOKENS
    every = factor_subspaces(dataset, factors=["token", "beta"], max_classes=None, rank=1, n_bootstrap=0, n_null=0)
    assert every["n_classes"].sel(factor="token").item() == len(values)


def test_positions_beyond_the_cap_are_cut_into_ranges_and_keep_their_subspace(tmp_path):
    """The position (all positions equally frequent) is cut into max_classes contiguous ranges of
    equal counts, never pooled; a planted smooth position code (a circle in a random plane) is
    found in that plane from the ranges."""
    rng = np.random.default_rng(12)
    n_samples, n_pos, d_model, n_ranges = 100, 61, 12, 10
    plane = random_basis(d_model, 2, rng)
    phase = 2 * np.pi * np.arange(n_pos) / n_pos
    code = 3.0 * np.stack([np.cos(phase), np.sin(phase)], axis=1) @ plane.T  # (pos, d)
    x = (code[None] + 0.3 * rng.normal(size=(n_samples, n_pos, d_model)))[:, None].astype("float32")
    dataset = open_for_analysis(write_store(tmp_path / "s.zarr", {"resid_pre": x}))
    result = factor_subspaces(dataset, factors=["pos"], max_classes=n_ranges)
    names = result.attrs["classes"]["pos"]
    assert names == [f"{start}-{start + 5}" for start in range(1, n_pos, 6)]  # positions 1-60, six each
    assert result["n_classes"].item() == n_ranges and result["pooled_classes"].item() == 0
    assert result["subspace_rank"].item() == 2
    basis = result["basis"].isel(layer=0, factor=0).values[:, :2]
    assert principal_angles(basis, plane).max() < 1.0
