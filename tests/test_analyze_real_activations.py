"""What planted i.i.d. isotropic noise does not show: directions too weak to matter (float16 rounding),
a rank test that sees what the structure test does not, pooled and binned classes in the radius
statistics."""
from __future__ import annotations

import numpy as np
import pytest

from orthosphere.analyze import AnalysisError, factor_subspaces, open_for_analysis, sphere_structure
from tests.synthetic import (
    NOT_APPLICABLE,
    balanced_effects,
    correlated_labels,
    random_basis,
    skewed,
    sphere_points,
    write_store,
)

N_SAMPLES, N_POS, D_MODEL = 400, 21, 24


def as_label(values: np.ndarray, n_samples: int = N_SAMPLES, n_pos: int = N_POS) -> np.ndarray:
    """Token labels (token,) as an int16 (sample, pos) label, the start token not applicable."""
    label = np.full((n_samples, n_pos), NOT_APPLICABLE, "int16")
    label[:, 1:] = values.reshape(n_samples, n_pos - 1)
    return label


def as_layers(tokens: np.ndarray, n_samples: int = N_SAMPLES, n_pos: int = N_POS) -> np.ndarray:
    """Token vectors (layer, token, d) as (sample, layer, pos, d); the start token elsewhere."""
    n_layers, _, d = tokens.shape
    x = np.zeros((n_samples, n_layers, n_pos, d))
    x[:, :, 1:] = np.moveaxis(tokens.reshape(n_layers, n_samples, n_pos - 1, d), 0, 1)
    x[:, :, 0, -1] = 30.0
    return x


def orthogonal_spheres(rng, faint: float, noise: float, dtype: str, path) -> str:
    """alpha (8 skewed classes on a sphere of radius 2, rank 3) and beta (5, radius 1.5, rank 2) on exactly
    orthogonal subspaces, beta = alpha mod 5 on half the tokens, each with `faint` effects in directions
    of their own (alpha 4, beta 2: 10^-6 of their variance at 2e-3), `noise` per token, stored in `dtype`."""
    n_tokens = N_SAMPLES * (N_POS - 1)
    alpha, beta = correlated_labels(n_tokens, [skewed(8, rng), skewed(5, rng)], 0.5, rng)
    basis = random_basis(D_MODEL, 11, rng)
    points_a, points_b = sphere_points(8, basis[:, :3], 2.0, rng), sphere_points(5, basis[:, 3:5], 1.5, rng)
    points_a += faint * rng.normal(size=(8, 4)) @ basis[:, 5:9].T
    points_b += faint * rng.normal(size=(5, 2)) @ basis[:, 9:].T
    x = 3.0 * rng.normal(size=D_MODEL) + points_a[alpha] + points_b[beta] + noise * rng.normal(size=(n_tokens, D_MODEL))
    url = write_store(path / "store.zarr", {"resid_pre": as_layers(x[None])}, labels={"alpha": as_label(alpha), "beta": as_label(beta)},
                      samples_per_chunk=100, dtype=dtype)
    return open_for_analysis(url)


@pytest.fixture(scope="module")
def rounded(tmp_path_factory):
    """The orthogonal spheres with no noise but float16's rounding, which adds directions about 400 times
    weaker than the planted ones (10^-7 of their variance) and the same in every token of a cell."""
    return orthogonal_spheres(np.random.default_rng(3), 0.0, 0.0, "float16", tmp_path_factory.mktemp("rounded"))


@pytest.fixture(scope="module")
def faint(tmp_path_factory):
    """The orthogonal spheres with faint directions of their own, significant over a float32 noise of 1e-4."""
    return orthogonal_spheres(np.random.default_rng(3), 2e-3, 1e-4, "float32", tmp_path_factory.mktemp("faint"))


def test_directions_of_float16_rounding_do_not_decide_ranks_or_angles(rounded):
    """The draws carry the class means' rounding (rounding_inflation), so its directions are not even
    significant, and the pair reads orthogonal."""
    result = factor_subspaces(rounded, factors=["alpha", "beta"], seed=1)
    assert result["rounding_inflation"].values[0] > 10 and result["rounding_bias"].values[0] > 1
    assert result["significance_rank"].values[0].tolist() == [3, 2]
    assert result["subspace_rank"].values[0].tolist() == [3, 2]
    assert result["min_angle"].values[0, 0, 1] > 89.0
    assert result["relation"].values[0, 0, 1] == "orthogonal"


def test_faint_directions_are_significant_but_not_relevant(faint):
    result = factor_subspaces(faint, factors=["alpha", "beta"], seed=1)
    assert result["rounding_inflation"].values[0] == 1.0
    assert result["significance_rank"].values[0].tolist() == [7, 4]  # the faint directions are significant...
    assert result["subspace_rank"].values[0].tolist() == [3, 2]  # ...but not relevant
    share = result["variance_share"].values[0]
    assert np.all(share[0, :3] > 0.01) and np.all(share[0, 3:7] < 1e-5)
    assert np.all(share[1, :2] > 0.01) and np.all(share[1, 2:4] < 1e-5)
    site_share = result["site_variance_share"].values[0]
    assert np.nansum(site_share[0, :3]) == pytest.approx(result["between_fraction"].values[0, 0], rel=1e-3)
    assert result["min_angle"].values[0, 0, 1] > 89.0
    assert result["relation"].values[0, 0, 1] == "orthogonal"


def test_a_relevance_floor_of_zero_keeps_every_significant_direction(faint):
    result = factor_subspaces(faint, factors=["alpha", "beta"], seed=1, relevance_floor=0.0)
    assert result["subspace_rank"].values[0].tolist() == [7, 4]
    assert result.attrs["relevance_floor"] == 0.0


def test_a_factor_whose_significant_directions_all_fall_below_the_floor_reads_below_relevance_floor(faint):
    """With a floor above every direction's share, the factors keep their significant directions and shown
    structure, but no subspace: their relation and sphere verdicts say so, not "no structure"."""
    result = factor_subspaces(faint, factors=["alpha", "beta"], seed=1, relevance_floor=0.95)
    assert result["subspace_rank"].values[0].tolist() == [0, 0]
    assert result["significance_rank"].values[0].tolist() == [7, 4] and (result["structure_q"].values[0] <= 0.05).all()
    assert result["relation"].values[0, 0, 1] == "below relevance floor"
    spheres = sphere_structure(faint, factors=["alpha", "beta"], seed=1, relevance_floor=0.95)
    assert spheres["sphere"].values[0].tolist() == ["below relevance floor"] * 2
    assert "below relevance floor" in result.attrs["relation_rule"] and "below relevance floor" in spheres.attrs["sphere_rule"]


@pytest.mark.parametrize("floor", [1.0, -0.1, "high"])
def test_a_relevance_floor_outside_zero_to_one_is_refused(rounded, floor):
    with pytest.raises(AnalysisError, match=rf"relevance_floor={floor!r}: expected a share in \[0, 1\)"):
        factor_subspaces(rounded, factors=["alpha"], relevance_floor=floor)


def test_a_factor_whose_structure_is_not_shown_has_no_subspace(tmp_path):
    """One direction of a 64-class factor, strong enough for the rank's test (which compares it with the
    noise's largest direction) but not for the structure test (which adds the noise of all 63): the
    structure test decides, so that no factor reads "no structure" and a subspace at once."""
    rng = np.random.default_rng(11)
    n_samples, n_pos, d, n_layers = 320, 21, 32, 6
    n_tokens = n_samples * (n_pos - 1)
    classes = rng.permutation(np.arange(n_tokens) % 64)
    direction = random_basis(d, 1, rng)[:, 0]
    effects = rng.normal(size=64)
    effects *= 12.0 / np.sqrt(100 * np.sum((effects - effects.mean()) ** 2))  # a weighted singular value of 12
    x = effects[classes][None, :, None] * direction + rng.normal(size=(n_layers, n_tokens, d))
    url = write_store(tmp_path / "weak.zarr", {"resid_pre": as_layers(x, n_samples, n_pos)},
                      labels={"tok": as_label(classes, n_samples, n_pos)}, samples_per_chunk=80)
    result = factor_subspaces(open_for_analysis(url), factors=["tok"], seed=2)
    unshown = result["structure_q"].values[:, 0] > result.attrs["significance"]
    significant = result["significance_rank"].values[:, 0] > 0
    assert np.any(unshown & significant)  # the two tests disagree in some layers...
    assert np.all(result["subspace_rank"].values[unshown] == 0)  # ...and the structure test decides there
    assert np.all(result["subspace_rank"].values[~unshown] == result["significance_rank"].values[~unshown])
    assert np.all(np.isnan(result["basis"].values[unshown]))


def test_a_vocabulary_on_a_sphere_reads_on_sphere_beside_its_pooled_class(tmp_path):
    """Every one of 300 Zipf-distributed token types on a sphere of radius 3: the 15 most frequent keep
    their class, the rest pool into one whose mean sits near the centre; it stays out of the radii."""
    rng = np.random.default_rng(5)
    n_tokens = N_SAMPLES * (N_POS - 1)
    probabilities = 1 / np.arange(1, 301)
    types = rng.choice(300, size=n_tokens, p=probabilities / probabilities.sum())
    points = sphere_points(300, random_basis(D_MODEL, 4, rng), 3.0, rng)
    x = points[types] + 0.3 * rng.normal(size=(n_tokens, D_MODEL))
    url = write_store(tmp_path / "zipf.zarr", {"resid_pre": as_layers(x[None])}, labels={"tok": as_label(types)},
                      samples_per_chunk=100)
    result = sphere_structure(open_for_analysis(url), factors=["tok"], max_classes=16, seed=1)
    assert result["sphere_classes"].values.tolist() == [15]
    assert result["radius_cv"].values[0, 0] < 0.05
    assert result["radius_mean"].values[0, 0] == pytest.approx(3.0, rel=0.05)
    assert result["sphere"].values[0, 0] == "on sphere"


def test_binned_positions_are_refused_a_sphere_with_the_reason(tmp_path):
    """Positions on a circle of radius 2 (a turn every 12 positions) in padded samples (later positions
    rarer), cut into 8 ranges: a range's mean averages points of the circle and falls inside it, so no
    verdict is given."""
    rng = np.random.default_rng(6)
    n_pos = 49
    positions = np.arange(1, n_pos)
    angle = 2 * np.pi * positions / 12
    circle_points = 2.0 * np.stack([np.cos(angle), np.sin(angle)], axis=1) @ random_basis(D_MODEL, 2, rng).T
    x = np.broadcast_to(circle_points, (N_SAMPLES, n_pos - 1, D_MODEL)).reshape(-1, D_MODEL)
    x = x + 0.1 * rng.normal(size=x.shape)
    valid = np.arange(n_pos)[None, :] < rng.integers(n_pos // 2, n_pos + 1, size=N_SAMPLES)[:, None]
    url = write_store(tmp_path / "circle.zarr", {"resid_pre": as_layers(x[None], n_pos=n_pos)}, valid=valid,
                      labels={"other": as_label(rng.integers(0, 3, N_SAMPLES * (n_pos - 1)), n_pos=n_pos)},
                      samples_per_chunk=100)
    result = sphere_structure(open_for_analysis(url), factors=["pos"], max_classes=8, seed=1)
    assert result["sphere_classes"].values.tolist() == [0]
    assert result["sphere"].values[0, 0] == "undetermined"
    assert "ranges of positions" in result.attrs["sphere_refused"]["pos"]
    assert np.isnan(result["radius_cv"].values[0, 0])
    every_position = sphere_structure(open_for_analysis(url), factors=["pos"], seed=1)  # 48 positions, 64 classes
    assert every_position["sphere_classes"].values.tolist() == [48]
    assert every_position["sphere"].values[0, 0] == "on sphere"


def test_factors_beside_rogue_dimensions_and_sink_tokens_keep_their_ranks(tmp_path):
    """Two factors (ranks 2 and 3) away from two dimensions of 8 times the others' noise, in which 1 % of
    the tokens (sinks) sit 60 units out: judged in raw coordinates the rogue dimensions' noise hides the
    factors' directions; judged against the whitened noise they are found at their rank."""
    rng = np.random.default_rng(2)
    n_samples, n_layers = 200, 8
    n_tokens = n_samples * (N_POS - 1)
    a, b = rng.integers(0, 8, n_tokens), rng.integers(0, 6, n_tokens)
    layers = []
    for _ in range(n_layers):
        basis = np.zeros((D_MODEL, 5))
        basis[2:] = random_basis(D_MODEL - 2, 5, rng)
        effects_a = balanced_effects(np.full(8, 1 / 8), basis[:, :2], 30.0 / np.sqrt(n_tokens), rng)
        effects_b = balanced_effects(np.full(6, 1 / 6), basis[:, 2:], 30.0 / np.sqrt(n_tokens), rng)
        noise = rng.normal(size=(n_tokens, D_MODEL))
        noise[:, :2] *= 8.0
        noise[rng.random(n_tokens) < 0.01, 0] += 60.0
        layers.append(effects_a[a] + effects_b[b] + noise)
    url = write_store(tmp_path / "rogue.zarr", {"resid_pre": as_layers(np.stack(layers), n_samples)},
                      labels={"a": as_label(a, n_samples), "b": as_label(b, n_samples)}, samples_per_chunk=50)
    result = factor_subspaces(open_for_analysis(url), factors=["a", "b"], seed=1)
    assert np.all(result["structure_q"].values <= 0.05)
    assert np.sum(result["subspace_rank"].values == [2, 3]) >= 15  # of 16 (judged in raw coordinates: 5 of 16)
    assert result["whitened"].values.all() and (result["whitening_understatement"].values > 1).all()
    pair = result.sel(factor="a", other="b")
    exact = (result["subspace_rank"].values == [2, 3]).all(axis=1)
    assert np.isfinite(pair["min_angle_ci"].values[exact]).all()  # the whitened estimate's draws give intervals
    assert np.sum(pair["min_angle_ci"].values[exact, 1] >= 89.0) >= exact.sum() - 2  # the planted pair is orthogonal
    assert not np.isin(pair["relation"].values, ["dependent", "independent"]).any()


def test_tokens_of_outlying_norm_are_counted(tmp_path):
    rng = np.random.default_rng(8)
    n_samples = 100
    n_tokens = n_samples * (N_POS - 1)
    labels = rng.integers(0, 3, n_tokens)
    x = np.eye(D_MODEL)[labels] + rng.normal(size=(2, n_tokens, D_MODEL))
    sinks = [rng.choice(n_tokens, 7, replace=False), rng.choice(n_tokens, 3, replace=False)]
    for layer, tokens in enumerate(sinks):
        x[layer, tokens, 0] += 100.0  # about 20 times the median norm
    url = write_store(tmp_path / "sinks.zarr", {"resid_pre": as_layers(x, n_samples)},
                      labels={"tok": as_label(labels, n_samples)}, samples_per_chunk=n_samples)
    result = factor_subspaces(open_for_analysis(url), factors=["tok"], seed=1)
    assert result["outlier_tokens"].values.tolist() == [7, 3]
