"""Norm spread on stores with planted norm distributions and planted attention."""
from __future__ import annotations

import numpy as np
import pytest

from orthosphere.analyze import attention_from_qk, norm_spread, open_for_analysis, store_attention
from orthosphere.analyze.attention import ScoreTerms
from orthosphere.analyze.inputs import as_float32
from tests.reference import attention_atol, attention_float64
from tests.synthetic import plant_norm_spread, pooled_ratio_band, weighted_band, write_store

N_SAMPLES, N_POS = 400, 9
EVEN, ODD = 0.2 / 0.9, 0.5 / 0.9  # half-widths: 90 % within +-20 % (even positions), +-50 % (odd)


def planted_pattern(n_samples, n_pos, start_share=0.5):
    """Head 0 gives each query's attention to the start token (start_share) and evenly to the even
    positions >= 2 it sees; head 1 likewise to the odd positions >= 1."""
    pattern = np.zeros((n_samples, 1, 2, n_pos, n_pos), "float32")
    for head, first in ((0, 2), (1, 1)):
        for query in range(n_pos):
            keys = list(range(first, query + 1, 2))
            pattern[:, 0, head, query, 0] = start_share if keys else 1.0
            if keys:
                pattern[:, 0, head, query, keys] = (1 - start_share) / len(keys)
    return pattern


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """Layer 0 of resid_pre and k: norms spread +-EVEN at even positions, +-ODD at odd ones; one
    kv_head read by both heads (grouped-query attention); the planted pattern."""
    half_widths = [0.0] + [EVEN if p % 2 == 0 else ODD for p in range(1, N_POS)]
    resid = plant_norm_spread(N_SAMPLES, N_POS, 8, half_widths, seed=1)
    k = plant_norm_spread(N_SAMPLES, N_POS, 4, half_widths, median=2.0, seed=2)
    sites = {"resid_pre": resid[:, None].astype("float32"), "k": k[:, None, :, None].astype("float32"),
             "pattern": planted_pattern(N_SAMPLES, N_POS)}
    url = write_store(tmp_path_factory.mktemp("norms") / "store.zarr", sites,
                      model={"n_heads": 2, "n_kv_heads": 1, "d_head": 4}, samples_per_chunk=150)
    return open_for_analysis(url), resid, k


def test_attention_weighted_spread_per_head_recovers_the_planted_bands(planted):
    dataset, _, _ = planted
    tree = norm_spread(dataset)
    for site in ("resid_pre", "k"):
        result = tree[site].to_dataset()
        assert result.attrs["weighting"] == "attention" and result.attrs["attention_source"] == "stored pattern"
        assert result["band"].sel(layer=0, head=0).item() == pytest.approx(0.2, abs=0.01)
        assert result["band"].sel(layer=0, head=1).item() == pytest.approx(0.5, abs=0.01)
    resid = tree["resid_pre"].to_dataset()
    assert resid["median_norm"].sel(layer=0).values == pytest.approx([3.0, 3.0], rel=0.01)
    assert tree["k"]["median_norm"].sel(layer=0).values == pytest.approx([2.0, 2.0], rel=0.01)
    quantiles = resid["ratio_quantile"].sel(layer=0, head=0)
    assert quantiles.sel(quantile=0.05).item() == pytest.approx(1 - 0.9 * EVEN, abs=0.01)
    assert quantiles.sel(quantile=0.95).item() == pytest.approx(1 + 0.9 * EVEN, abs=0.01)
    histogram = resid["histogram"].sel(layer=0, head=0)
    assert histogram.sum().item() == pytest.approx(1.0)
    inside = histogram.sel(ratio=slice(1 - EVEN, 1 + EVEN)).sum().item()
    assert inside == pytest.approx(1.0, abs=0.03)


def test_uniform_spread_per_layer_and_per_kv_head(planted):
    dataset, resid, k = planted
    tree = norm_spread(dataset, weight_by_attention=False, mass=0.5)
    norms = np.linalg.norm(resid[:, 1:], axis=-1)
    expected = weighted_band(norms, np.ones_like(norms), mass=0.5)
    result = tree["resid_pre"].to_dataset()
    assert result.attrs["group"] == "layer" and result["band"].dims == ("layer",)
    assert result["band"].item() == pytest.approx(expected, abs=0.01)
    assert result["weight_total"].item() == N_SAMPLES * (N_POS - 1)
    key_norms = np.linalg.norm(k[:, 1:], axis=-1)
    assert tree["k"]["band"].dims == ("layer", "kv_head")
    assert tree["k"]["band"].item() == pytest.approx(weighted_band(key_norms, np.ones_like(key_norms), 0.5), abs=0.01)


def band_atol(expected: float) -> float:
    """What the histogram allows a band p computed from it against the sorted float64 reference: each
    norm, each median and the pooled cumulative (sampled at the edges) are placed within one log bin,
    so the ratio's bound 1 + p is off by at most three bins."""
    from orthosphere.analyze.histogram import BIN_WIDTH

    return (1 + expected) * np.expm1(3 * BIN_WIDTH)


@pytest.fixture(scope="module")
def heads_apart(tmp_path_factory):
    """Two layers of resid_pre and k whose norms grow with the position (by 30 % from first to last) and
    spread around that by little at positions 1-5 and much at 6-9 (a layer's own amounts), and three
    heads per layer: heads 0 and 1 attend to keys 1-5 (pulled towards the first and the last of them),
    head 2 to keys 6-9. The heads' medians differ and one head in three is wide, so that the pooled
    bands are far from the median of the per-head ones."""
    rng = np.random.default_rng(7)
    n_samples, n_layers, n_pos, n_heads = 60, 2, 10, 3
    late = np.arange(n_pos) >= 6
    spread = np.where(late, np.array([[0.4], [0.25]]), np.array([[0.03], [0.06]]))[None, :, :, None]
    log_norms = np.log(np.linspace(1.0, 1.3, n_pos))[None, None, :, None] + spread * rng.normal(size=(n_samples, n_layers, n_pos, 1))
    directions = rng.normal(size=(n_samples, n_layers, n_pos, 8))
    resid = directions / np.linalg.norm(directions, axis=-1, keepdims=True) * np.exp(log_norms)
    k = rng.normal(size=(n_samples, n_layers, n_pos, 1, 4)) * np.exp(log_norms)[..., None]
    pull = np.array([-0.5, 0.5, 0.0])[:, None] * np.arange(n_pos)
    keys = np.stack([~late, ~late, late]) & (np.arange(n_pos) > 0)  # (head, kpos)
    scores = rng.normal(size=(n_samples, n_layers, n_heads, n_pos, n_pos)) + pull[:, None, :]
    pattern = np.where(keys[:, None, :], np.exp(scores), 0.0)
    pattern /= pattern.sum(-1, keepdims=True)
    sites = {"resid_pre": resid.astype("float32"), "k": k.astype("float32"), "pattern": pattern.astype("float32")}
    url = write_store(tmp_path_factory.mktemp("heads") / "store.zarr", sites,
                      model={"n_heads": n_heads, "n_kv_heads": 1, "d_head": 4}, samples_per_chunk=25)
    norms = {site: np.linalg.norm(sites[site].astype(np.float64), axis=-1).reshape(n_samples, n_layers, n_pos)
             for site in ("resid_pre", "k")}
    received = sites["pattern"].astype(np.float64)[:, :, :, 1:, :].sum(axis=3)  # from the queries after the start
    return open_for_analysis(url), norms, received


def test_bands_pooled_per_layer_and_over_layers_match_a_sorted_reference(heads_apart):
    """band_layer pools a layer's heads, band_pooled every layer and head: each head's |x| over its own
    weighted median, weighted by the attention each key receives, against sorting in float64."""
    dataset, norms, received = heads_apart
    tree = norm_spread(dataset, sites=["resid_pre", "k"])
    for site in ("resid_pre", "k"):
        result = tree[site].to_dataset()
        groups = [[(norms[site][:, layer], received[:, layer, head]) for head in range(3)] for layer in range(2)]
        for layer in range(2):
            for head in range(3):
                expected = weighted_band(*groups[layer][head])
                assert abs(result["band"].sel(layer=layer, head=head).item() - expected) <= band_atol(expected)
            expected = pooled_ratio_band(groups[layer])
            assert abs(result["band_layer"].sel(layer=layer).item() - expected) <= band_atol(expected)
        expected = pooled_ratio_band(groups[0] + groups[1])
        assert abs(result["band_pooled"].item() - expected) <= band_atol(expected)
        assert "pooled over every layer and head" in result["band_pooled"].attrs["description"]
        assert "attention it receives" in result["band_layer"].attrs["description"]
    # what pooling changes: the median of the per-head bands (0.11) is far from the pooled band (0.32)
    resid = tree["resid_pre"].to_dataset()
    assert resid["band_pooled"].item() - float(resid["band"].median()) > 0.15


def test_uniform_bands_pool_tokens_counted_once(heads_apart):
    """Without attention weighting: resid_pre has one group per layer (band_layer is the layer's band),
    k one per kv_head; band_pooled pools the layers, each token over its own layer's median."""
    dataset, norms, _ = heads_apart
    tree = norm_spread(dataset, sites=["resid_pre", "k"], weight_by_attention=False, mass=0.8)
    ones = np.ones_like(norms["resid_pre"][:, 0, 1:])
    for site in ("resid_pre", "k"):
        result = tree[site].to_dataset()
        groups = [(norms[site][:, layer, 1:], ones) for layer in range(2)]
        for layer in range(2):
            expected = weighted_band(*groups[layer], mass=0.8)
            assert abs(result["band_layer"].sel(layer=layer).item() - expected) <= band_atol(expected)
        expected = pooled_ratio_band(groups, mass=0.8)
        assert abs(result["band_pooled"].item() - expected) <= band_atol(expected)
        assert "each token counting once" in result["band_pooled"].attrs["description"]


def test_float16_stores_with_norms_beyond_float16_squares(tmp_path):
    half_widths = [0.0] + [EVEN] * (N_POS - 1)
    resid = plant_norm_spread(N_SAMPLES, N_POS, 8, half_widths, median=1000.0, start_norm=5000.0)
    dataset = open_for_analysis(write_store(tmp_path / "half.zarr", {"resid_pre": resid[:, None]}, dtype="float16"))
    result = norm_spread(dataset, weight_by_attention=False)["resid_pre"]
    assert result["median_norm"].item() == pytest.approx(1000.0, rel=0.01)
    assert result["band"].item() == pytest.approx(0.2, abs=0.01)


def test_float16_blocks_become_float32_with_numpys_values_for_every_bit_pattern():
    every = np.arange(2**16, dtype=np.uint16).view(np.float16).reshape(16, 64, 64)[:, ::2]  # strided, NaN and Inf included
    found = as_float32(every)
    assert found.dtype == np.float32 and found.shape == every.shape
    np.testing.assert_array_equal(found.view(np.uint32), every.astype(np.float32).view(np.uint32))  # bit for bit
    assert as_float32(found) is found


def test_the_start_token_is_excluded_unless_asked(planted):
    dataset, _, _ = planted
    with_start = norm_spread(dataset, sites=["resid_pre"], exclude_start=False)["resid_pre"]
    # the start token (norm 100) takes half of every head's attention: the median moves onto it
    assert with_start["median_norm"].sel(layer=0, head=0).item() > 10
    without = norm_spread(dataset, sites=["resid_pre"])["resid_pre"]
    assert without["median_norm"].sel(layer=0, head=0).item() == pytest.approx(3.0, rel=0.01)


def test_attention_recomputed_from_q_k_matches_the_model_softmax(tmp_path):
    rng = np.random.default_rng(5)
    n_samples, n_pos = 40, 7
    q = rng.normal(size=(n_samples, 1, n_pos, 4, 3)).astype("float32")
    k = rng.normal(size=(n_samples, 1, n_pos, 2, 3)).astype("float32")
    valid = np.ones((n_samples, n_pos), bool)
    valid[::3, 5:] = False
    scale = 0.7
    reference, largest = attention_float64(q[:, 0], k[:, 0], valid, attn_scale=scale, causal=True)
    atol = attention_atol(largest)
    pattern = attention_from_qk(q[:, 0], k[:, 0], valid, ScoreTerms(scale, causal=True))
    np.testing.assert_allclose(pattern, reference, rtol=0, atol=atol)
    reference = reference.astype("float32")
    resid = rng.normal(size=(n_samples, 1, n_pos, 6)).astype("float32")
    model = {"attn_scale": scale, "n_heads": 4, "n_kv_heads": 2, "d_head": 3}
    recomputed = open_for_analysis(write_store(tmp_path / "qk.zarr", {"resid_pre": resid, "q": q, "k": k},
                                               valid=valid, model=model, samples_per_chunk=16))
    stored = open_for_analysis(write_store(tmp_path / "pattern.zarr", {"resid_pre": resid,
                                                                      "pattern": reference[:, None]},
                                           valid=valid, model=model, samples_per_chunk=16))
    np.testing.assert_allclose(store_attention(recomputed).values, reference[:, None], rtol=0, atol=atol)
    from_qk = norm_spread(recomputed, sites=["resid_pre"])["resid_pre"]
    from_pattern = norm_spread(stored, sites=["resid_pre"])["resid_pre"]
    assert from_qk.attrs["attention_source"] == "recomputed from q, k"
    np.testing.assert_allclose(from_qk["band"].values, from_pattern["band"].values, rtol=1e-5)
    np.testing.assert_allclose(from_qk["weight_total"].values, from_pattern["weight_total"].values, rtol=1e-5)


def test_results_say_which_norm_produced_each_site(tmp_path):
    """From the store's norm description (here a QK-Norm Qwen3-like one), and from a store that
    states only its placement (the arithmetic Post-Norm)."""
    from orthosphere.analyze.description import describe_norms, normalised_by

    rng = np.random.default_rng(2)
    sites = {"resid_pre": rng.normal(size=(4, 1, 5, 8)), "attn_in": rng.normal(size=(4, 1, 5, 8)),
             "q": rng.normal(size=(4, 1, 5, 2, 4)), "k": rng.normal(size=(4, 1, 5, 2, 4))}
    norms = [{"site": "attn_input", "type": "rms", "scope": "d_model"}, {"site": "q", "type": "rms", "scope": "head"},
             {"site": "k", "type": "rms", "scope": "head"}, {"site": "final", "type": "rms", "scope": "d_model"}]
    model = {"norm_placement": "pre", "qk_norm": "head", "v_norm": None, "parallel": False, "norms": norms}
    tree = norm_spread(open_for_analysis(write_store(tmp_path / "s.zarr", sites, model=model)), weight_by_attention=False)
    found = {site: tree[site].attrs["normalised_by"] for site in sites}
    assert found == {"resid_pre": "", "attn_in": "rms norm over d_model", "q": "rms norm per head", "k": "rms norm per head"}
    assert describe_norms(model) == ("pre-norm; QK-norm per head; norms at attn_input (rms), q (rms), k (rms), "
                                     "final (rms)")
    post = {"norm_placement": "post", "norm_type": "layer"}
    assert normalised_by(post, "resid_mid") == "layer norm over d_model"
    assert normalised_by(post, "resid_pre") == "layer norm over d_model of the previous block (layer 0: no norm)"
    assert normalised_by(post, "attn_in") == "" and normalised_by({"norm_placement": "qkv", "norm_type": "rms"}, "v") != ""


def test_log_histogram_slots_every_value_as_the_definition_says():
    """Each value lands in slot floor((log v - LOG_LOW) / BIN_WIDTH) + 1, zeros, NaN and values below
    e^LOG_LOW in slot 0, infinities and values above e^LOG_HIGH in the last; weights add, groups keep
    their own rows; without weights or groups every value counts once in one row."""
    from orthosphere.analyze.histogram import BIN_WIDTH, LOG_LOW, N_SLOTS, log_histogram
    rng = np.random.default_rng(5)
    values = np.exp(rng.uniform(-25.0, 25.0, 3000)).astype("float32")
    values[:30] = [0.0] * 10 + [np.nan] * 10 + [np.inf] * 10
    weights, groups = rng.random(3000), rng.integers(0, 4, 3000)
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log(values.astype("float64"))
    expected_slot = np.where(np.isfinite(logs), np.floor((logs - LOG_LOW) / BIN_WIDTH) + 1, np.where(logs == np.inf, N_SLOTS - 1, 0))
    expected_slot = np.clip(expected_slot, 0, N_SLOTS - 1).astype(int)
    on_an_edge = np.isfinite(logs) & (np.abs((logs - LOG_LOW) / BIN_WIDTH - np.round((logs - LOG_LOW) / BIN_WIDTH)) < 1e-3)
    keep = ~on_an_edge  # float32's log may round across a bin edge there
    expected = np.zeros((4, N_SLOTS))
    np.add.at(expected, (groups[keep], expected_slot[keep]), weights[keep])
    np.testing.assert_allclose(log_histogram(values[keep], weights[keep], groups[keep], 4), expected, atol=1e-12)
    plain = log_histogram(values[keep])
    assert plain.shape == (1, N_SLOTS) and plain.dtype == np.float64
    np.testing.assert_array_equal(plain[0], np.bincount(expected_slot[keep], minlength=N_SLOTS))


def test_summarise_matches_a_per_group_reference():
    """summarise (all groups at once) against each group's own np.interp cdf: quantiles by bisection of
    that cdf, the band as the smallest p holding the mass, the ratio histogram from cdf differences;
    an empty group, medians 0 and inf (NaN but total), one filled slot, slots 0 and last filled."""
    from orthosphere.analyze.histogram import EDGES, LOG_HIGH, LOG_LOW, N_SLOTS, log_histogram, summarise
    rng = np.random.default_rng(3)
    counts = np.zeros((7, N_SLOTS))
    counts[1, 5000] = 2.0
    counts[2, [0, 9000]] = [3.0, 1.0]
    counts[3, [-1, 9000]] = [3.0, 1.0]
    values = np.exp(rng.normal([[0.0], [3.0], [19.5]], [[0.3], [0.1], [1.0]], (3, 500)))
    values[0, :20] = 0.0
    counts[4:] = log_histogram(values, rng.random(values.shape), np.repeat(np.arange(3), 500).reshape(3, 500), 3)
    mass, quantiles, edges = 0.9, (0.1, 0.5, 0.9), np.linspace(0.0, 2.0, 21)
    got = summarise(counts.reshape(7, 1, N_SLOTS), mass=mass, quantiles=quantiles, ratio_edges=edges)
    assert got["histogram"].shape == (7, 1, 20) and got["quantile"].shape == (7, 1, 3)
    got = {name: value[:, 0] for name, value in got.items()}

    def cdf(cumulative, value):
        return np.interp(np.log(value), EDGES, cumulative) if value > 0 else 0.0

    def quantile(cumulative, target):
        if target <= cumulative[0] or target > cumulative[-1]:
            return 0.0 if target <= cumulative[0] else np.inf
        low, high = LOG_LOW, LOG_HIGH
        for _ in range(100):
            middle = (low + high) / 2
            low, high = (low, middle) if cdf(cumulative, np.exp(middle)) >= target else (middle, high)
        return np.exp(high)

    def held(cumulative, centre, p):
        return cdf(cumulative, centre * (1 + p)) - cdf(cumulative, centre * (1 - p))

    for group, row in enumerate(counts):
        total = row.sum()
        cumulative = row[0] + np.concatenate([[0.0], np.cumsum(row[1:-1])])
        assert got["total"][group] == pytest.approx(total, rel=1e-12)
        median = quantile(cumulative, 0.5 * total)
        if not 0 < median < np.inf:
            assert group in (0, 2, 3) and all(np.isnan(got[name][group]).all() for name in got if name != "total")
            continue
        np.testing.assert_allclose(got["median"][group], median, rtol=1e-9)
        np.testing.assert_allclose(got["quantile"][group], [quantile(cumulative, q * total) / median for q in quantiles], rtol=1e-9)
        below = np.array([cdf(cumulative, median * edge) for edge in edges])
        np.testing.assert_allclose(got["histogram"][group], np.diff(below) / total, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(got["beyond"][group], 1 - below[-1] / total, rtol=1e-9, atol=1e-12)
        p, centre = got["band"][group], got["median"][group]
        if group == 6:  # 90 % needs p > 2, and median (1 + 2) passes e^20
            assert np.isnan(p) and held(cumulative, centre, 1.0) < mass * total and centre * 3 > np.exp(LOG_HIGH)
        else:
            assert held(cumulative, centre, p) >= mass * total > held(cumulative, centre, p * (1 - 1e-9))
