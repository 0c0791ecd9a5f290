"""Factor subspaces and principal angles on stores with planted subspaces at known angles."""
from __future__ import annotations

import numpy as np
import pytest

from orthosphere.analyze import AnalysisError, factor_subspaces, open_for_analysis
from orthosphere.analyze.geometry import principal_angles
from orthosphere.analyze.units import bootstrap_group
from tests.synthetic import PlantedFactor, plane, plant_factors, write_store

PLANTED_ANGLES = (0.0, 30.0, 60.0, 90.0)
D_MODEL = 16


def planted_angle_store(url, *, noise=0.05, n_samples=300, n_pos=21):
    """Layer l holds factor alpha (5 classes, radius 2) in the plane of axes 0, 1 and factor beta
    (4 classes, radius 1) in that plane tilted by PLANTED_ANGLES[l] towards axes 2, 3. Head 0 of every
    layer reads exactly alpha's plane (and two axes no factor uses); head 1 reads axes alpha never
    touches."""
    layers = []
    for angle in PLANTED_ANGLES:
        x, labels, _ = plant_factors(n_samples, n_pos, [
            PlantedFactor("alpha", 5, plane(D_MODEL, (0, 1)), radius=2.0, as_strings=True),
            PlantedFactor("beta", 4, plane(D_MODEL, (0, 1), angle, (2, 3)), radius=1.0),
        ], noise=noise, seed=len(layers))
        layers.append(x)
    w_q = np.zeros((len(PLANTED_ANGLES), 2, D_MODEL, 4), "float32")
    w_q[:, 0, [0, 1, 8, 9], [0, 1, 2, 3]] = [1.0, 2.0, 1.0, 1.0]
    w_q[:, 1, [4, 5, 6, 7], [0, 1, 2, 3]] = 1.0
    w_k = np.zeros((len(PLANTED_ANGLES), 2, D_MODEL, 4), "float32")
    w_k[:, :, [2, 3, 10, 11], [0, 1, 2, 3]] = 1.0
    resid = np.stack(layers, axis=1).astype("float32")
    return write_store(url, {"resid_pre": resid}, labels=labels, weights={"w_q": w_q, "w_k": w_k},
                       model={"n_heads": 2, "n_kv_heads": 2, "d_head": 4}, samples_per_chunk=64)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    url = planted_angle_store(tmp_path_factory.mktemp("angles") / "store.zarr")
    dataset = open_for_analysis(url)
    return dataset, factor_subspaces(dataset, factors=["alpha", "beta"], seed=3)


@pytest.mark.slow
def test_planted_principal_angles_are_recovered_within_one_degree(planted):
    _, result = planted
    angles = result["angles"].sel(factor="alpha", other="beta")
    for layer, planted_angle in enumerate(PLANTED_ANGLES):
        np.testing.assert_allclose(angles.sel(layer=layer).values[:2], planted_angle, atol=1.0)
    np.testing.assert_allclose(result["angles"].sel(factor="beta", other="alpha").values, angles.values)
    assert result["subspace_rank"].values.tolist() == [[2, 2]] * 4


def test_intervals_bracket_the_planted_angles_and_the_relation_is_named(planted):
    """Little noise: narrow intervals around the planted angles, and each relation shown."""
    _, result = planted
    pair = result.sel(factor="alpha", other="beta")
    planted_angles = np.array(PLANTED_ANGLES)
    for name in ("min_angle_ci", "max_angle_ci"):
        low, high = pair[name].values.T
        assert np.all(low <= planted_angles + 0.5) and np.all(high >= planted_angles - 0.5), name
        assert np.all(high - low < 2.0), name
    np.testing.assert_allclose(pair["min_angle_estimate"].values, planted_angles, atol=1.0)
    for name in ("min_angle", "max_angle"):  # every estimate inside its own interval
        low, high = pair[f"{name}_ci"].values.T
        assert np.all((low <= pair[f"{name}_estimate"].values) & (pair[f"{name}_estimate"].values <= high)), name
    assert pair["relation"].values.tolist() == ["dependent", "independent", "independent", "orthogonal"]
    claims = dict(zip(pair["claim"].values, pair["claim_q"].values.T))
    assert claims["dependent"][0] <= 0.05 and claims["orthogonal"][3] <= 0.05 and np.all(claims["independent"][1:3] <= 0.05)
    assert result["relation"].sel(factor="alpha", other="alpha").values.tolist() == [""] * 4
    np.testing.assert_allclose(result["overlap"].sel(factor="alpha", other="beta").values,
                               np.cos(np.radians(planted_angles)) ** 2, atol=0.01)
    assert np.all(result["structure_q"].values <= 1e-3)
    # each factor's singular values stand far above the noise's at the steps that found them
    noise = result["noise_singular_value"].isel(component=slice(0, 2))
    assert np.all((result["whitened_singular_value"].isel(component=slice(0, 2)) > 10 * noise) | noise.isnull())
    assert np.all(result["noise_singular_value"].isel(component=2).notnull())  # the step that found the rank


def test_explained_variance_rank_and_between_fraction(planted):
    _, result = planted
    explained = result["explained"].sel(factor="alpha")
    assert np.all(explained.sel(component=1) > 0.999)
    np.testing.assert_allclose(explained.sel(component=0), 0.5, atol=0.01)  # a circle: two equal directions
    # alpha holds radius 2 of |x|^2 = 4 + 1 + 16 * 0.05^2: its share of the variance
    np.testing.assert_allclose(result["between_fraction"].sel(factor="alpha", layer=3), 4 / (4 + 1 + 16 * 0.0025),
                               atol=0.01)
    assert result["n_classes"].values.tolist() == [5, 4]
    assert result.attrs["classes"]["alpha"] == ["c0", "c1", "c2", "c3", "c4"]
    basis = result["basis"].sel(layer=0, factor="alpha").values
    np.testing.assert_allclose(np.abs(basis[:2]).sum(), np.abs(basis).sum(), rtol=0.01)


def test_angles_with_each_heads_read_subspace(planted):
    _, result = planted
    q_alpha = result["q_angles"].sel(factor="alpha")
    np.testing.assert_allclose(q_alpha.sel(head=0).values[:, :2], 0.0, atol=1.0)
    np.testing.assert_allclose(q_alpha.sel(head=1).values[:, :2], 90.0, atol=1.0)
    np.testing.assert_allclose(result["q_overlap"].sel(factor="alpha", head=0), 1.0, atol=0.01)
    # keys read axes 2, 3, where beta leans by the planted angle: angles 90 - planted
    k_beta = result["k_min_angle"].sel(factor="beta", kv_head=0).values
    np.testing.assert_allclose(k_beta, 90.0 - np.array(PLANTED_ANGLES), atol=1.0)


def test_fixed_rank_and_restricted_factors(planted):
    dataset, _ = planted
    restricted = ["alpha[beta=0|1]", "beta[alpha=c0|c3]"]
    # alpha's classes c0, c3 occur only where beta applies too, and c1, c2, c4 only where it does not:
    # jointly, their contrast is confounded with the difference between those kinds of tokens
    with pytest.raises(AnalysisError, match="cannot separate factors"):
        factor_subspaces(dataset, factors=restricted, rank=1, n_bootstrap=0, layers=[3])
    result = factor_subspaces(dataset, factors=restricted, estimator="marginal", rank=1, n_bootstrap=0,
                              n_null=0, layers=[3])
    assert result["subspace_rank"].values.tolist() == [[1, 1]]
    assert result["n_tokens"].sel(factor="alpha[beta=0|1]").item() == 300 * 20 // 2
    assert result["n_tokens"].sel(factor="beta[alpha=c0|c3]").item() == 300 * 20 * 2 // 5
    assert np.isnan(result["min_angle_ci"].values).all() and np.isnan(result["structure_p"].values).all()
    assert result["relation"].values.ravel().tolist() == [""] * 4
    assert result["shared_tokens"].sel(factor="alpha[beta=0|1]", other="beta[alpha=c0|c3]").item() == 300 * 20 * 2 * 2 // 20


def test_the_position_determines_the_crossed_labels_so_only_the_marginal_fit_reads_all_three(planted):
    dataset, _ = planted  # the crossed design cycles alpha and beta with the position
    with pytest.raises(AnalysisError, match=r"cannot separate factors \['alpha', 'beta', 'pos'\]"):
        factor_subspaces(dataset, factors=["alpha", "beta", "pos"], rank=1, n_bootstrap=0, layers=[3])
    result = factor_subspaces(dataset, factors=["alpha", "beta", "pos"], estimator="marginal", rank=1, n_bootstrap=0,
                              n_null=0, layers=[3])
    assert result["n_classes"].sel(factor="pos").item() == 20
    assert result.attrs["estimator"] == "marginal" and np.isnan(result["condition_number"].item())
    # the position determines alpha (not the other way): NMI = H(alpha) / mean(H(alpha), H(pos))
    np.testing.assert_allclose(result["label_nmi"].sel(factor="alpha", other="pos"),
                               np.log(5) / ((np.log(5) + np.log(20)) / 2), rtol=1e-9)


def test_a_balanced_design_gives_the_same_answers_either_way(planted):
    dataset, joint = planted
    marginal = factor_subspaces(dataset, factors=["alpha", "beta"], estimator="marginal", seed=3)
    for name in ("angles", "subspace_rank", "singular_value", "between_fraction"):
        np.testing.assert_allclose(joint[name].values, marginal[name].values, rtol=1e-6, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(joint["variance_inflation"].values, 1.0, rtol=1e-9)
    np.testing.assert_allclose(joint["label_nmi"].sel(factor="alpha", other="beta"), 0.0, atol=1e-12)
    assert joint["condition_number"].item() < 10


def test_bootstrap_is_seeded_and_groups_do_not_depend_on_chunking():
    samples = np.arange(1000)
    groups = bootstrap_group(samples, 7, 32)
    np.testing.assert_array_equal(groups[500:], bootstrap_group(samples[500:], 7, 32))
    assert not np.array_equal(groups, bootstrap_group(samples, 8, 32))
    assert np.bincount(groups, minlength=32).min() > 10


def test_principal_angles_are_accurate_at_both_ends():
    rng = np.random.default_rng(0)
    base = np.linalg.qr(rng.normal(size=(6, 6)))[0]
    for angle in (1e-5, 0.3, 45.0, 89.9999):
        theta = np.radians(angle)
        tilted = np.cos(theta) * base[:, :2] + np.sin(theta) * base[:, 2:4]
        np.testing.assert_allclose(principal_angles(base[:, :2], tilted), [angle, angle], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(principal_angles(base[:, :3], base[:, 3:4]), [90.0], rtol=1e-12)


def test_minus_one_is_a_class_and_only_the_stored_not_applicable_value_is_missing(tmp_path):
    from orthosphere.analyze.factors import Factor, discover_classes
    from orthosphere.analyze.inputs import token_mask
    from orthosphere.extract.tasks import MISSING

    carry = np.tile(np.array([MISSING, -1, 0, 1, -1, MISSING], np.int16), (4, 1))  # -1: a borrow
    resid = np.random.default_rng(0).normal(size=(4, 1, 6, 8)).astype("float32")
    dataset = open_for_analysis(write_store(tmp_path / "s.zarr", {"resid_pre": resid}, labels={"carry": carry}))
    assert dataset["carry"].attrs["not_applicable"] == MISSING
    found = discover_classes(dataset, [Factor("carry")], token_mask(dataset, exclude_start=False))
    np.testing.assert_array_equal(found.classes["carry"].values, [-1, 0, 1])


def test_text_stores_default_to_token_identity_and_position(tmp_path):
    rng = np.random.default_rng(0)
    n_samples, n_pos = 40, 12
    token = rng.zipf(1.5, (n_samples, n_pos)) % 200
    labels = {"token_str": np.char.add("t", token.astype(str)).astype(object),
              "position": np.broadcast_to(np.arange(n_pos, dtype="int16"), (n_samples, n_pos)).copy()}
    resid = rng.normal(size=(n_samples, 1, n_pos, 8)).astype("float32")
    dataset = open_for_analysis(write_store(tmp_path / "text.zarr", {"resid_pre": resid}, labels=labels))
    result = factor_subspaces(dataset, max_classes=16, rank=1, n_bootstrap=0, n_null=0)
    assert result["factor"].values.tolist() == ["token_str", "pos"]  # not `position`, which restates pos
    assert result["n_classes"].values.tolist() == [16, n_pos - 1]
    assert result["pooled_classes"].sel(factor="token_str").item() == len(np.unique(token[:, 1:])) - 15


def test_tokens_of_each_kind_get_their_own_intercept_so_the_position_keeps_its_plane(tmp_path):
    """A position code in a plane; tokens of role y, more frequent late in a sequence, sit elsewhere:
    with one intercept per role (the default when the store has `role`) the position's subspace is its
    plane, with one intercept for all the position absorbs the roles' difference."""
    rng = np.random.default_rng(8)
    n_samples, n_pos, d_model = 300, 21, 12
    plane_basis = np.linalg.qr(rng.normal(size=(d_model, 2)))[0]
    phase = 2 * np.pi * np.arange(n_pos) / n_pos
    code = np.stack([np.cos(phase), np.sin(phase)], axis=1) @ plane_basis.T
    late = np.arange(n_pos) / n_pos
    role_y = rng.random((n_samples, n_pos)) < 0.2 + 0.6 * late
    offset = 3.0 * rng.normal(size=d_model)
    x = code[None] + role_y[..., None] * offset + 0.3 * rng.normal(size=(n_samples, n_pos, d_model))
    roles = np.where(role_y, "y", "x").astype(object)
    dataset = open_for_analysis(write_store(tmp_path / "s.zarr", {"resid_pre": x[:, None].astype("float32")},
                                            labels={"role": roles}))
    for intercepts, expected in ((None, "role"), ("none", "none")):
        result = factor_subspaces(dataset, factors=["pos"], intercepts=intercepts, rank=2)
        assert result.attrs["intercepts"] == expected
        basis = result["basis"].isel(layer=0, factor=0).values[:, :2]
        tilt = principal_angles(basis, plane_basis).max()
        assert (tilt < 2.0) if expected == "role" else (tilt > 20.0), (intercepts, tilt)
