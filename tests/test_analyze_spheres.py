"""Sphere structure on planted orthogonal spheres, planted radius spread and planted cross-talk."""
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
from tests.synthetic import PlantedFactor, plane, plant_factors, weighted_band, write_store

D_MODEL = 12
N_SAMPLES, N_POS, N_LEVELS = 200, 21, 50  # 4000 tokens: 5 x 4 classes x 50 levels, twice


def planted_layers(url, layers):
    """A store whose layer l holds the factors layers[l] (list of PlantedFactor), no noise."""
    xs, components = [], []
    for factors in layers:
        x, labels, parts = plant_factors(N_SAMPLES, N_POS, factors, n_levels=N_LEVELS)
        xs.append(x)
        components.append(parts)
    write_store(url, {"resid_pre": np.stack(xs, axis=1).astype("float32")}, labels=labels, samples_per_chunk=64)
    return components


@pytest.fixture(scope="module")
def spheres(tmp_path_factory):
    """Layer 0: perfect orthogonal spheres (radii 2 and 1). Layer 1: the same planes, radii spread
    with CV 0.1 and 0.05. Layer 2: beta's plane at 60 degrees to alpha's (cross-talk), alpha's radius
    spread with CV 0.1."""
    url = tmp_path_factory.mktemp("spheres") / "store.zarr"
    alpha, beta = plane(D_MODEL, (0, 1)), plane(D_MODEL, (2, 3))
    components = planted_layers(url, [
        [PlantedFactor("alpha", 5, alpha, 2.0), PlantedFactor("beta", 4, beta, 1.0)],
        [PlantedFactor("alpha", 5, alpha, 2.0, radius_cv=0.1), PlantedFactor("beta", 4, beta, 1.0, radius_cv=0.05)],
        [PlantedFactor("alpha", 5, alpha, 2.0, radius_cv=0.1),
         PlantedFactor("beta", 4, plane(D_MODEL, (0, 1), 60.0, (2, 3)), 1.0)],
    ])
    dataset = open_for_analysis(url)
    return dataset, sphere_structure(dataset, factors=["alpha", "beta"]), components


@pytest.mark.slow
def test_orthogonal_spheres_have_zero_deviation_and_exact_fits(spheres):
    _, result, _ = spheres
    layer = result.sel(layer=0)
    assert layer["deviation"].item() < 1e-5
    np.testing.assert_allclose(layer["radius_mean"], [2.0, 1.0], rtol=1e-5)
    np.testing.assert_allclose(layer["radius_cv"], 0.0, atol=1e-5)
    np.testing.assert_allclose(layer["sphere_radius"], [2.0, 1.0], rtol=1e-5)
    np.testing.assert_allclose(layer["centre_offset"], 0.0, atol=1e-5)
    np.testing.assert_allclose(layer["fit_residual"], 0.0, atol=1e-4)
    np.testing.assert_allclose(layer["band"], 0.0, atol=0.003)
    np.testing.assert_allclose(layer["cross_term_rms"].sel(factor="alpha", other="beta"), 0.0, atol=1e-5)
    assert result["n_tokens"].item() == N_SAMPLES * (N_POS - 1)


def test_planted_radius_spread_is_recovered(spheres):
    _, result, components = spheres
    layer = result.sel(layer=1)
    np.testing.assert_allclose(layer["radius_cv"], [0.1, 0.05], rtol=1e-3)
    for name in ("alpha", "beta"):
        radii = np.linalg.norm(components[1][name][:, 1:], axis=-1)
        expected = weighted_band(radii, np.ones_like(radii))
        assert layer["band"].sel(factor=name).item() == pytest.approx(expected, abs=0.01)
    # still orthogonal: all of the deviation is radius variation
    assert layer["cross_term_share"].item() < 1e-8
    np.testing.assert_allclose(layer["radius_share"].sel(part="rest"), 0.0, atol=1e-8)
    assert layer["deviation"].item() > 0.05


def test_planted_cross_talk_gives_the_planted_cross_term_share(spheres):
    _, result, components = spheres
    alpha, beta = (components[2][name][:, 1:].reshape(-1, D_MODEL) for name in ("alpha", "beta"))
    cross = 2 * np.einsum("nd,nd->n", alpha, beta)
    radius_variance = np.var(np.einsum("nd,nd->n", alpha, alpha)) + np.var(np.einsum("nd,nd->n", beta, beta))
    share = np.mean(cross**2) / (radius_variance + np.mean(cross**2))
    layer = result.sel(layer=2)
    assert 0.1 < share < 0.9
    assert layer["cross_term_share"].item() == pytest.approx(share, abs=0.01)
    assert layer["cross_term_rms"].sel(factor="alpha", other="beta").item() == pytest.approx(
        np.sqrt(np.mean((cross / 2) ** 2)), rel=0.01)
    np.testing.assert_allclose(layer["radius_cv"], [0.1, 0.0], atol=0.01)


@pytest.mark.slow
def test_spheres_use_the_fitted_subspaces_they_are_given(spheres):
    dataset, result, _ = spheres
    tree = analyze(dataset.attrs["url"], only=["subspaces", "spheres"],
                   options={"factors": ["alpha", "beta"], "n_bootstrap": 0, "layers": [1]})
    assert tree["spheres"].attrs["bases"] == "from the subspaces results"
    np.testing.assert_allclose(tree["spheres"]["radius_cv"].values, result["radius_cv"].sel(layer=[1]).values, rtol=1e-6)
    fitted = FactorSubspaces(factors=["alpha", "beta"], layers=[1], n_bootstrap=0, n_null=0, rank=1).fit(dataset)
    given = sphere_structure(dataset, subspaces=fitted)
    assert given.attrs["bases"] == "from the subspaces results"
    assert given["subspace_rank"].values.tolist() == [[1, 1]] and given["layer"].values.tolist() == [1]
    with pytest.raises(AnalysisError, match=r"fitted otherwise than they were asked for \(rank: asked 2, fitted 1\)"):
        sphere_structure(dataset, subspaces=fitted, rank=2)
    with pytest.raises(AnalysisError, match="spheres take fitted subspaces"):
        sphere_structure(dataset, subspaces=FactorSubspaces())
    with pytest.raises(AnalysisError, match="spheres take fitted subspaces .*got Dataset"):
        sphere_structure(dataset, subspaces=factor_subspaces(dataset, factors=["alpha", "beta"], n_bootstrap=0))
