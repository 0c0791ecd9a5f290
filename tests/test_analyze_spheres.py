"""Sphere structure on planted class points: on orthogonal spheres, with their radii spread, and with
the two subspaces at 60 degrees (cross terms)."""
from __future__ import annotations

import numpy as np
import pytest

from orthosphere.analyze import (
    AnalysisError,
    FactorSubspaces,
    analyze,
    factor_subspaces,
    open_for_analysis,
    sphere_structure,
)
from tests.synthetic import circle, crossed_design, plane, write_store

D_MODEL = 12
N_SAMPLES, N_POS = 240, 21  # 4800 tokens: 6 x 4 classes, 200 of each pair
RADII = {"alpha": 2.0, "beta": 1.0}
SPREAD = 0.4


def alpha_radii(spread: float) -> np.ndarray:
    """alpha's six class radii: 2 (1 +- spread), alternately."""
    return RADII["alpha"] * (1 + spread * np.where(np.arange(6) % 2 == 0, 1.0, -1.0))


def planted(url, noise: float = 0.05):
    """Layer 0: alpha (6 classes) and beta (4) on circles of radius 2 and 1 in orthogonal planes.
    Layer 1: alpha's radii spread +-40 % over its classes. Layer 2: beta's plane at 60 degrees to alpha's."""
    a, b = crossed_design(N_SAMPLES, N_POS, [6, 4])
    rng = np.random.default_rng(0)
    layers = []
    for spread, tilt in ((0.0, 0.0), (SPREAD, 0.0), (0.0, 60.0)):
        points_a = alpha_radii(spread)[:, None] * circle(6) @ plane(D_MODEL, (0, 1)).T
        points_b = RADII["beta"] * circle(4) @ plane(D_MODEL, (2, 3) if tilt == 0 else (0, 1), tilt, (2, 3)).T
        x = points_a[np.maximum(a, 0)] + points_b[np.maximum(b, 0)] + noise * rng.normal(size=a.shape + (D_MODEL,))
        x[:, 0] = 0.0
        x[:, 0, -1] = 30.0
        layers.append(x)
    labels = {"alpha": np.where(a >= 0, a, -1).astype("int16"), "beta": np.where(b >= 0, b, -1).astype("int16")}
    for label in labels.values():
        label[:, 0] = np.iinfo("int16").min
    write_store(url, {"resid_pre": np.stack(layers, axis=1).astype("float32")}, labels=labels, samples_per_chunk=60)
    return labels


@pytest.fixture(scope="module")
def spheres(tmp_path_factory):
    url = tmp_path_factory.mktemp("spheres") / "store.zarr"
    planted(url)
    dataset = open_for_analysis(url)
    return dataset, sphere_structure(dataset, factors=["alpha", "beta"])


def test_orthogonal_spheres_read_on_spheres(spheres):
    _, result = spheres
    layer = result.sel(layer=0)
    assert layer["sphere"].values.tolist() == ["on sphere", "on sphere"]
    np.testing.assert_allclose(layer["radius_mean"], [2.0, 1.0], rtol=1e-3)
    np.testing.assert_allclose(layer["radius_cv"], 0.0, atol=2e-3)
    assert np.all(layer["radius_cv_ci"].sel(bound="high").values < result.attrs["radius_cv_tolerance"])
    np.testing.assert_allclose(layer["class_radius"].sel(factor="alpha").values, 2.0, rtol=5e-3)
    pair = layer.sel(factor="alpha", other="beta")
    assert pair["cross_term"].item() < 0.01 and pair["cross_term_p"].item() > 0.05
    assert pair["min_angle"].item() > 89.0 and pair["relation"].item() == "orthogonal"


def test_radii_spread_over_classes_read_off_sphere_with_their_spread(spheres):
    _, result = spheres
    layer = result.sel(layer=1)
    assert layer["sphere"].values.tolist() == ["off sphere", "on sphere"]
    np.testing.assert_allclose(layer["radius_cv"].sel(factor="alpha"), SPREAD, atol=0.005)  # classes equally frequent
    low, high = layer["radius_cv_ci"].sel(factor="alpha").values
    assert low <= SPREAD <= high and high - low < 0.05
    np.testing.assert_allclose(layer["class_radius"].sel(factor="alpha").values[:6], alpha_radii(SPREAD), rtol=5e-3)
    assert layer["sphere_null_p"].sel(factor="alpha").item() <= 0.01


def test_subspaces_at_sixty_degrees_have_their_planted_cross_term(spheres):
    _, result = spheres
    pair = result.sel(layer=2, factor="alpha", other="beta")
    # every pair of classes meets equally often: the rms of 2 cos(60) (a . b') over the circles' points,
    # over sqrt(|a|^2 |b|^2) = 2 x 1: cos(60) times the rms cosine between two independent circle points
    cosines = circle(6) @ circle(4).T
    expected = np.cos(np.radians(60.0)) * np.sqrt(np.mean(cosines**2))
    assert pair["cross_term"].item() == pytest.approx(expected, abs=0.005)
    low, high = pair["cross_term_ci"].values
    assert low <= expected <= high and pair["cross_term_p"].item() <= 0.01
    assert pair["min_angle"].item() == pytest.approx(60.0, abs=0.5)
    assert result["sphere"].sel(layer=2).values.tolist() == ["on sphere", "on sphere"]


@pytest.mark.slow
def test_spheres_use_the_fitted_subspaces_they_are_given(spheres):
    dataset, result = spheres
    tree = analyze(dataset.attrs["url"], analyses=["subspaces", "spheres"], factors=["alpha", "beta"], layers=[1])
    assert tree["spheres"].attrs["subspaces"] == "from the subspaces results"
    np.testing.assert_allclose(tree["spheres"]["radius_cv"].values, result["radius_cv"].sel(layer=[1]).values, rtol=1e-6)
    fitted = FactorSubspaces(factors=["alpha", "beta"], layers=[1], rank=1).fit(dataset)
    given = sphere_structure(dataset, subspaces=fitted)
    assert given.attrs["subspaces"] == "from the subspaces results"
    assert given["subspace_rank"].values.tolist() == [[1, 1]] and given["layer"].values.tolist() == [1]
    with pytest.raises(AnalysisError, match=r"fitted otherwise than they were asked for \(rank: asked 2, fitted 1\)"):
        sphere_structure(dataset, subspaces=fitted, rank=2)
    with pytest.raises(AnalysisError, match="spheres take fitted subspaces"):
        sphere_structure(dataset, subspaces=FactorSubspaces())
    with pytest.raises(AnalysisError, match="spheres take fitted subspaces .*got Dataset"):
        sphere_structure(dataset, subspaces=factor_subspaces(dataset, factors=["alpha", "beta"], layers=[1]))


def test_without_noise_draws_the_spheres_hold_their_point_estimates(spheres):
    dataset, _ = spheres
    result = sphere_structure(dataset, factors=["alpha", "beta"], layers=[1], rank=2, n_bootstrap=0)
    assert result["sphere"].values.tolist() == [["", ""]]
    np.testing.assert_allclose(result["radius_cv"].sel(factor="alpha"), SPREAD, atol=0.005)
    assert np.isnan(result["radius_cv_ci"].values).all()


def test_only_the_claim_on_the_side_of_the_measurement_is_tested_and_corrected():
    """Per layer and factor the smaller of the two claims' p-values is kept, and Benjamini-Hochberg runs over
    those alone (one test per layer and factor); a factor without p-values stays untested."""
    from scipy.stats import false_discovery_control

    from orthosphere.analyze.spheres import directional_q

    rng = np.random.default_rng(0)
    on = rng.random((5, 3)) ** 4
    claim_p = np.stack([on, 1 - on / 2], axis=-1)  # "on" the smaller where the measurement lies below
    claim_p[1, 2] = [0.9, 0.001]
    claim_p[3, 0] = np.nan
    q = directional_q(claim_p)
    kept = np.isfinite(claim_p).all(axis=-1)
    smaller = claim_p.min(axis=-1)
    np.testing.assert_allclose(q.min(axis=-1, where=np.isfinite(q), initial=np.inf)[kept],
                               false_discovery_control(smaller[kept]))
    assert np.isnan(q[1, 2, 0]) and np.isnan(q[0, 0, 1]) and np.isnan(q[3, 0]).all()
    assert (np.isfinite(q).sum(axis=-1) == kept).all()  # one tested claim per layer and factor


def test_a_binary_factor_on_a_sphere_is_refused_a_sphere_verdict_with_the_reason(tmp_path):
    """Two classes at +-r along one direction (count-centred: their radii differ only by the counts'
    imbalance), beside a four-class circle: the binary factor's verdict is undetermined, with the reason."""
    a, b = crossed_design(N_SAMPLES, N_POS, [2, 4])
    rng = np.random.default_rng(1)
    share = np.mean(a[a >= 0] == 0)
    points_a = np.array([[1 - share], [-share]]) * 2.0 @ np.eye(D_MODEL)[:1]
    points_b = circle(4) @ plane(D_MODEL, (2, 3)).T
    x = points_a[np.maximum(a, 0)] + points_b[np.maximum(b, 0)] + 0.3 * rng.normal(size=a.shape + (D_MODEL,))
    labels = {"alpha": a.astype("int16"), "beta": b.astype("int16")}
    write_store(tmp_path / "s.zarr", {"resid_pre": x[:, None].astype("float32")}, labels=labels, samples_per_chunk=60)
    result = sphere_structure(open_for_analysis(tmp_path / "s.zarr"), factors=["alpha", "beta"])
    assert "fewer than three classes besides the pooled one" in result.attrs["sphere_refused"]["alpha"]
    assert "beta" not in result.attrs["sphere_refused"]
    assert result["sphere"].sel(factor="alpha").item() == "undetermined"
    assert result["sphere"].sel(factor="beta").item() == "on sphere"
    assert int(result["sphere_classes"].sel(factor="alpha")) == 0
