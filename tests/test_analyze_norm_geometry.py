"""Normalisation geometry on stores with planted answers: a massive dimension, a sink head, a known
norm growth, a known spread of norm_scale."""
from __future__ import annotations

import numpy as np
import pytest

from orthosphere.analyze import attention_from_qk, open_for_analysis
from orthosphere.analyze.attention import ScoreTerms
from orthosphere.analyze.norm_geometry import norm_geometry
from orthosphere.errors import AnalysisError
from tests.synthetic import write_store

N_SAMPLES, N_POS, D_MODEL, D_HEAD = 40, 17, 16, 4
MASSIVE_DIM, MASSIVE_VALUE, GROWTH = 5, 500.0, 2.0
SCALE_CV = (0.1, 0.3)  # the planted coefficient of variation of norm_scale in layers 0 and 1


def planted_sites(seed: int = 0) -> dict[str, np.ndarray]:
    """Layer 1's residual stream is layer 0's times GROWTH, with one massive dimension on the start
    token; head 0 of both layers attends to the start token only, head 1 uniformly."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(N_SAMPLES, N_POS, D_MODEL))
    resid = np.stack([base, GROWTH * base], axis=1)
    resid[:, 1, 0, MASSIVE_DIM] = MASSIVE_VALUE
    signs = np.where(np.arange(N_POS) % 2 == 0, 1.0, -1.0)
    scale = np.stack([np.broadcast_to(1 + cv * signs, (N_SAMPLES, N_POS)) for cv in SCALE_CV], axis=1)
    q = np.zeros((N_SAMPLES, 2, N_POS, 2, D_HEAD))
    k = rng.normal(size=(N_SAMPLES, 2, N_POS, 2, D_HEAD))
    q[:, :, :, 0, 0] = 10.0
    k[:, :, :, 0, :] = 0.0
    k[:, :, 0, 0, 0] = 10.0  # head 0's score on the start token: 10 * 10 / sqrt(4) = 50
    return {"resid_pre": resid, "norm_scale": scale, "q": q, "k": k}


def uniform_attention_on_start() -> float:
    """Mean attention on the start token of a causal head attending uniformly, over queries 1..N_POS-1."""
    return float(np.mean(1 / np.arange(2, N_POS + 1)))


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    url = write_store(tmp_path_factory.mktemp("geometry") / "store.zarr", planted_sites(), samples_per_chunk=10)
    return norm_geometry(open_for_analysis(url))


def test_a_planted_massive_dimension_is_found(planted):
    assert planted["massive_max"].values[1] == MASSIVE_VALUE
    assert planted["top_dimension"].values[1, 0] == MASSIVE_DIM
    assert planted["top_dimension_value"].values[1, 0] == MASSIVE_VALUE
    assert planted["max_position"].values[1] == 0
    median = GROWTH * 0.6745  # the median |x_i| of N(0, GROWTH^2)
    assert planted["massive_ratio"].values[1] == pytest.approx(MASSIVE_VALUE / median, rel=0.05)
    assert planted["massive_ratio"].values[0] < 10
    assert planted["start_norm_ratio"].values[1] > 50 > planted["start_norm_ratio"].values[0]
    low, high = planted["start_norm_ratio_ci"].values[1]
    assert low <= planted["start_norm_ratio"].values[1] <= high


def test_a_planted_sink_is_counted(planted):
    np.testing.assert_allclose(planted["sink_attention"].sel(head=0), 1.0, atol=1e-6)
    np.testing.assert_allclose(planted["sink_attention"].sel(head=1), uniform_attention_on_start(), rtol=1e-5)
    np.testing.assert_array_equal(planted["sink_share"], [0.5, 0.5])
    np.testing.assert_array_equal(planted["sink_share_ci"], [[0.5, 0.5], [0.5, 0.5]])
    assert planted["sink_share_pooled"].item() == 0.5
    # head 0 is sparse at every query; head 1's largest attention is 1 / (position + 1)
    np.testing.assert_array_equal(planted["sparse_share"], [0.5, 0.5])
    assert planted.attrs["attention_source"] == "recomputed from q, k"


def test_planted_growth_and_norm_scale_spread_are_recovered(planted):
    assert planted["growth_per_layer"].item() == pytest.approx(GROWTH, rel=1e-5)
    low, high = planted["growth_per_layer_ci"].values
    assert low == pytest.approx(GROWTH, rel=1e-5) and high == pytest.approx(GROWTH, rel=1e-5)
    assert planted["norm_growth"].values[1] == pytest.approx(GROWTH, rel=3e-3)
    assert planted["median_norm"].values[0] == pytest.approx(np.sqrt(D_MODEL - 0.5), rel=0.05)  # chi's median
    np.testing.assert_allclose(planted["norm_scale_cv"], SCALE_CV, rtol=1e-5)
    assert planted["norm_scale_cv_pooled"].item() == pytest.approx(np.mean(SCALE_CV), rel=1e-5)


def test_a_stored_pattern_gives_the_attention_measures_of_q_and_k(tmp_path, planted):
    sites = planted_sites()
    terms = ScoreTerms(scale=1 / np.sqrt(D_HEAD), causal=True)
    valid = np.ones((N_SAMPLES, N_POS), bool)
    pattern = np.stack([attention_from_qk(sites["q"][:, layer], sites["k"][:, layer], valid, terms) for layer in (0, 1)],
                       axis=1)
    url = write_store(tmp_path / "pattern.zarr", {"resid_pre": sites["resid_pre"], "pattern": pattern})
    from_pattern = norm_geometry(open_for_analysis(url))
    assert from_pattern.attrs["attention_source"] == "stored pattern"
    np.testing.assert_allclose(from_pattern["sink_attention"], planted["sink_attention"], rtol=1e-5)
    np.testing.assert_array_equal(from_pattern["sparse_share"], planted["sparse_share"])
    assert "norm_scale_cv" not in from_pattern  # not stored: not measured


def test_a_store_without_the_site_is_refused_by_name(tmp_path):
    url = write_store(tmp_path / "q-only.zarr", {"q": planted_sites()["q"]})
    with pytest.raises(AnalysisError, match="no site 'resid_pre'.*option site"):
        norm_geometry(open_for_analysis(url))
    with pytest.raises(AnalysisError, match="site='q': expected a residual site"):
        norm_geometry(open_for_analysis(url), site="q")
