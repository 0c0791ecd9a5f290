"""What planted i.i.d. isotropic noise does not show: directions too weak to matter (float16 rounding),
a rank test that sees what the structure test does not, pooled and binned classes in the radius
statistics."""
from __future__ import annotations

import numpy as np
import pytest

from orthosphere.analyze import AnalysisError, factor_subspaces, open_for_analysis, sphere_structure
from tests.synthetic import (
    NOT_APPLICABLE,
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


@pytest.fixture(scope="module")
def rounded(tmp_path_factory):
    """alpha (8 skewed classes on a sphere of radius 2, rank 3) and beta (5, radius 1.5, rank 2) on exactly
    orthogonal subspaces, beta = alpha mod 5 on half the tokens, no noise but float16's rounding: the
    rounding adds directions about 400 times weaker than the planted ones (10^-7 of their variance)."""
    rng = np.random.default_rng(3)
    n_tokens = N_SAMPLES * (N_POS - 1)
    alpha, beta = correlated_labels(n_tokens, [skewed(8, rng), skewed(5, rng)], 0.5, rng)
    basis = random_basis(D_MODEL, 5, rng)
    points_a, points_b = sphere_points(8, basis[:, :3], 2.0, rng), sphere_points(5, basis[:, 3:], 1.5, rng)
    x = 3.0 * rng.normal(size=D_MODEL) + points_a[alpha] + points_b[beta]
    url = write_store(tmp_path_factory.mktemp("rounded") / "store.zarr", {"resid_pre": as_layers(x[None])},
                      labels={"alpha": as_label(alpha), "beta": as_label(beta)}, samples_per_chunk=100, dtype="float16")
    return open_for_analysis(url)


def test_directions_of_float16_rounding_do_not_decide_ranks_or_angles(rounded):
    result = factor_subspaces(rounded, factors=["alpha", "beta"], seed=1)
    assert result["significance_rank"].values[0].tolist() == [7, 4]  # the rounding is significant...
    assert result["subspace_rank"].values[0].tolist() == [3, 2]  # ...but not relevant
    share = result["variance_share"].values[0]
    assert np.all(share[0, :3] > 0.01) and np.all(share[0, 3:7] < 1e-5)
    assert np.all(share[1, :2] > 0.01) and np.all(share[1, 2:4] < 1e-5)
    site_share = result["site_variance_share"].values[0]
    assert np.nansum(site_share[0, :3]) == pytest.approx(result["between_fraction"].values[0, 0], rel=1e-3)
    assert result["min_angle"].values[0, 0, 1] > 89.0
    assert result["relation"].values[0, 0, 1] == "orthogonal"


def test_a_relevance_floor_of_zero_keeps_every_significant_direction(rounded):
    result = factor_subspaces(rounded, factors=["alpha", "beta"], seed=1, relevance_floor=0.0)
    assert result["subspace_rank"].values[0].tolist() == [7, 4]
    assert result.attrs["relevance_floor"] == 0.0


@pytest.mark.parametrize("floor", [1.0, -0.1, "high"])
def test_a_relevance_floor_outside_zero_to_one_is_refused(rounded, floor):
    with pytest.raises(AnalysisError, match=rf"relevance_floor={floor!r}: expected a share in \[0, 1\)"):
        factor_subspaces(rounded, factors=["alpha"], relevance_floor=floor)
