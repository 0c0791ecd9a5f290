"""Offline norm-perturbation replay: hand-built heads with known answers, theory, draws, bad input."""
from __future__ import annotations

import itertools
import math

import dask
import numpy as np
import pytest
import xarray as xr
from dask.callbacks import Callback

from orthosphere.analyze import kernels
from orthosphere.analyze import replay as replay_module
from orthosphere.analyze.attention import ScoreTerms
from orthosphere.analyze.errors import AnalysisError, NonFiniteError
from orthosphere.analyze.noise import unit_noise
from orthosphere.analyze.replay import ReplayError, level_at_rate, replay
from orthosphere.analyze.replay_blocks import HeadBlock, ReplaySettings, message_frame
from orthosphere.analyze.results import ANALYSES, configure, run_analyses
from orthosphere.store import create_store, open_store
from tests.reference import assert_attention_close, attention_atol, attention_float64

WEIGHT_NAMES = ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")
RELATIVE_BIAS = tuple(tuple(float(b) for b in row) for row in np.random.default_rng(7).normal(0.0, 2.0, (4, 7)))
"""A T5-style relative position bias of 4 heads by key offset -3..3: 8 positions reach past its ends."""


def write_store(path, *, q, k, v=None, w_o=None, valid=None, pattern=None, attn_scale=1.0, causal=True,
                samples_per_chunk=4, resid_pre=None):
    """A complete store holding the given (sample, layer, pos, head, d_head) arrays (and resid_pre,
    (sample, layer, pos, d_model), when given)."""
    n_samples, n_layers, n_pos, n_heads, d_head = q.shape
    d_model = w_o.shape[-1] if w_o is not None else n_heads * d_head
    model = {"family": "synthetic", "n_layers": n_layers, "d_model": d_model, "n_heads": n_heads,
             "n_kv_heads": k.shape[3], "d_head": d_head, "attn_scale": attn_scale, "causal": causal}
    sites = ("q", "k") + tuple(name for name, value in (("v", v), ("pattern", pattern), ("resid_pre", resid_pre))
                               if value is not None)
    writer = create_store(path, model=model, task={"name": "synthetic"}, n_samples=n_samples, n_pos=n_pos,
                          sites=sites, with_weights=w_o is not None, samples_per_chunk=samples_per_chunk)
    arrays = {"q": q, "k": k, "valid": np.ones((n_samples, n_pos), bool) if valid is None else valid}
    arrays |= {name: value for name, value in (("v", v), ("pattern", pattern), ("resid_pre", resid_pre)) if value is not None}
    writer.write(0, arrays)
    if w_o is not None:
        weights = {name: np.zeros(writer.group[name].shape, np.float32) for name in WEIGHT_NAMES}
        writer.write_weights(weights | {"w_o": w_o})
    writer.mark_shard_complete(0)
    writer.finish()
    return open_store(path)


def margin_head(ratios, second_score=200.0):
    """One layer, one head, two positions seen by both queries (non-causal): key 0 scores
    ratios[s] * second_score, key 1 second_score, so the margin w*/w_1 of sample s is ratios[s]."""
    n = len(ratios)
    q = np.zeros((n, 1, 2, 1, 2), np.float32)
    q[..., 0] = 1.0
    k = np.zeros((n, 1, 2, 1, 2), np.float32)
    k[:, 0, 0, 0, 0] = np.asarray(ratios) * second_score
    k[:, 0, 1, 0, 0] = second_score
    return q, k


def random_heads(n_samples=12, n_pos=8, n_heads=4, n_kv_heads=2, d_head=4, d_model=6, scale=3.0, seed=0):
    """Random q, k, v, w_o with large scores, so that many instances are sparse."""
    rng = np.random.default_rng(seed)
    q = (scale * rng.normal(size=(n_samples, 2, n_pos, n_heads, d_head))).astype(np.float32)
    k = (scale * rng.normal(size=(n_samples, 2, n_pos, n_kv_heads, d_head))).astype(np.float32)
    v = rng.normal(size=(n_samples, 2, n_pos, n_kv_heads, d_head)).astype(np.float32)
    w_o = rng.normal(size=(2, n_heads, d_head, d_model)).astype(np.float32)
    return q, k, v, w_o


def analytic_two_key_rate(ratio, level, distribution="uniform"):
    """P((1 + k1) > ratio (1 + k0)) for iid k0, k1 of RMS `level`, ratio > 1: uniform on
    (-a, a) with a = sqrt(3) level, or Gaussian (then k1 - ratio k0 ~ N(0, level^2 (1 + ratio^2)))."""
    if distribution == "gaussian":
        return 0.5 * math.erfc((ratio - 1) / (level * math.sqrt(1 + ratio**2)) / math.sqrt(2))
    a = math.sqrt(3) * level
    low, high = 1 - a, (1 + a) / ratio
    if high <= low:
        return 0.0
    return ((1 + a) * (high - low) - ratio / 2 * (high**2 - low**2)) / (2 * a) ** 2


# --- noise draws ------------------------------------------------------------------------------


def test_draws_are_a_pure_function_of_the_indices_with_the_requested_rms():
    full = unit_noise(7, "k", 3, np.arange(400), 5, 16, 4)
    subset = unit_noise(7, "k", 3, np.array([399, 2, 17]), 5, 16, 4)
    np.testing.assert_array_equal(subset, full[[399, 2, 17]])
    assert np.abs(full).max() <= math.sqrt(3)
    assert np.sqrt(np.mean(full**2)) == pytest.approx(1.0, abs=0.02)
    assert abs(full.mean()) < 0.02
    for other in (unit_noise(8, "k", 3, np.arange(400), 5, 16, 4), unit_noise(7, "m", 3, np.arange(400), 5, 16, 4),
                  unit_noise(7, "k", 4, np.arange(400), 5, 16, 4), unit_noise(7, "k", 3, np.arange(400), 6, 16, 4)):
        assert abs(np.corrcoef(full.ravel(), other.ravel())[0, 1]) < 0.02
    gaussian = unit_noise(7, "q", 0, np.arange(400), 0, 16, 4, "gaussian")
    assert gaussian.std() == pytest.approx(1.0, abs=0.02) and np.abs(gaussian).max() > math.sqrt(3)


# --- recomputed attention ---------------------------------------------------------------------


def test_recomputed_attention_matches_the_models_own_pattern_with_padding(tmp_path):
    torch = pytest.importorskip("torch")
    from orthosphere.extract.model import ArithmeticTransformer, ModelConfig

    torch.manual_seed(0)
    model = ArithmeticTransformer(ModelConfig(n_layers=2, d_model=16, n_heads=2, d_ff=32, norm_placement="qkv")).eval()
    tokens = torch.randint(0, 16, (6, 9))
    seen = {}
    for layer, block in enumerate(model.blocks):
        for name in ("q", "k", "v", "pattern"):
            getattr(block.attn, f"hook_{name}").register_forward_hook(
                lambda _m, _i, out, key=(name, layer): seen.__setitem__(key, out.detach().numpy()))
    with torch.no_grad():
        model(tokens)
    stack = lambda name: np.stack([seen[name, layer] for layer in range(2)], axis=1)  # noqa: E731
    valid = np.ones((6, 9), bool)
    valid[:3, 6:] = False  # right padding: a causal model never lets a valid query see it
    ds = write_store(tmp_path / "s", q=stack("q"), k=stack("k"), v=stack("v"), pattern=stack("pattern"),
                     valid=valid, attn_scale=model.config.attn_scale)
    for layer in range(2):
        recomputed = HeadBlock(ds.q.sel(layer=layer).values, ds.k.sel(layer=layer).values, ds.valid.values,
                               ScoreTerms(ds.attrs["model"]["attn_scale"], True), 0.95, min_keys=2).pattern
        stored = ds.pattern.sel(layer=layer).values
        query_valid = np.broadcast_to(valid[:, None, :, None], stored.shape)
        for pattern in (recomputed, stored):  # both float32 patterns against the float64 one
            assert_attention_close(pattern, ds.q.sel(layer=layer).values, ds.k.sel(layer=layer).values, valid,
                                   attn_scale=ds.attrs["model"]["attn_scale"], causal=True, where=query_valid)
        assert np.all(recomputed[:3, :, :, 6:] == 0)


# --- hand-built heads with known answers ------------------------------------------------------


def test_noise_below_the_margin_never_collapses_and_above_it_always_does():
    ratios = np.linspace(1.1, 2.0, 10)
    q, k = margin_head(ratios)
    block = HeadBlock(q[:, 0], k[:, 0], np.ones((10, 2), bool), ScoreTerms(1.0, False), 0.95, min_keys=2)
    assert block.sparse.all() and np.all(block.winner == 0)
    # Worst case for uniform noise of bound a: k0 -> 1 - a, k1 -> 1 + a; collapse iff (1+a)/(1-a) > ratio.
    critical = (ratios - 1) / (ratios + 1)
    zeros = np.zeros((10, 2, 1))
    for factor, expected in ((0.99, False), (1.01, True)):
        kk = np.stack([-factor * critical, factor * critical], axis=1)[:, :, None]
        effects = block.perturb(zeros, kk)
        for name in ("collapse", "theory_predicted", "exact_predicted"):
            assert np.all(effects[name] == expected), name
    # The study: uniform noise whose bound sqrt(3) * level stays below the smallest margin never collapses.
    settings = ReplaySettings(levels=(0.9 * critical.min() / math.sqrt(3),), n_draws=200, targets=("k",), min_keys=2)
    below = _study(block, settings)
    assert below["collapse"] == 0


def _study(block, settings, layer=0):
    """Collapse and strict counts of a HeadBlock over every draw at the first level."""
    counts = {"collapse": 0, "strict": 0, "instances": 0}
    n_samples, _, n_pos = block.instance.shape
    samples = np.arange(n_samples)
    for draw in range(settings.n_draws):
        kappa = {t: settings.levels[0] * settings.kappa(t, layer, samples, draw, n_pos, n)
                 for t, n in (("q", block.n_heads), ("k", block.n_kv_heads))}
        effects = block.perturb(kappa["q"], kappa["k"])
        counts["collapse"] += int(effects["collapse"].sum())
        counts["strict"] += int(effects["strict"].sum())
        counts["instances"] += int(block.sparse.sum())
    return counts


@pytest.mark.parametrize("distribution", ["uniform", "gaussian"])
@pytest.mark.slow
def test_measured_collapse_rate_matches_the_analytic_rate_for_a_known_margin_distribution(tmp_path, distribution):
    ratios = np.random.default_rng(1).uniform(1.02, 1.3, size=64)
    q, k = margin_head(ratios)
    ds = write_store(tmp_path / "s", q=q, k=k, causal=False, samples_per_chunk=16)
    levels = (0.03, 0.08, 0.15)
    result = replay(ds, levels=levels, n_draws=150, targets=("k",), n_bootstrap=50, distribution=distribution,
                    min_keys=2)
    measured = result.collapse_rate.sel(definition="collapse", layer=0, head=0).values
    for level, rate in zip(levels, measured):
        expected = np.mean([analytic_two_key_rate(r, level, distribution) for r in ratios])
        error = math.sqrt(max(expected * (1 - expected), 1e-4) / (len(ratios) * 150))
        assert abs(rate - expected) < 4 * error, (level, rate, expected)
    assert measured[0] < measured[1] < measured[2] and measured[2] > 0.2
    # Keys only: the first-order theorem is the exact condition, so both predict every collapse and no other.
    for name in ("theory_recall", "theory_precision", "exact_recall", "exact_precision"):
        assert np.all(result[name].values == 1.0), name
    for name in ("predicted_collapse_rate", "exact_predicted_collapse_rate"):
        np.testing.assert_allclose(result[name].sel(layer=0, head=0), measured)


def test_query_noise_never_collapses_a_head(tmp_path):
    q, k, v, w_o = random_heads()
    ds = write_store(tmp_path / "s", q=q, k=k, v=v, w_o=w_o, attn_scale=0.5)
    result = replay(ds, levels=(0.1, 0.3, 0.55), n_draws=10, targets=("q",), n_bootstrap=10)
    assert result.n_sparse.sum() > 50
    assert result.collapses.sum() == 0 and result.predicted_collapse_rate.max() == 0
    assert result.exact_predicted_collapse_rate.max() == 0
    for name in ("theory_recall", "theory_precision", "exact_recall_pooled", "exact_precision_pooled"):
        assert np.isnan(result[name]).all(), name  # nothing collapsed, nothing predicted: undefined
    assert result.tv_distance.sel(instances="all").min() > 0  # the temperature changes, the winner does not
    assert np.all(np.isinf(result.collapse_level.values))


def test_value_noise_changes_the_output_linearly_and_never_the_pattern(tmp_path):
    q, k, v, w_o = random_heads()
    ds = write_store(tmp_path / "s", q=q, k=k, v=v, w_o=w_o, attn_scale=0.5)
    levels = (0.01, 0.05, 0.2)
    result = replay(ds, levels=levels, n_draws=40, targets=("m",), n_bootstrap=10)
    assert result.collapses.sum() == 0 and result.tv_distance.max() == 0
    change = result.output_change.values  # (instances, level, layer, head)
    per_unit_noise = change / np.asarray(levels)[:, None, None]
    np.testing.assert_allclose(per_unit_noise, np.broadcast_to(per_unit_noise[:, :1], change.shape), rtol=1e-5)
    # A sparse head's output is its winner's message, so the relative change is the noise's RMS.
    sparse = result.output_change.sel(instances="sparse", level=0.2)
    assert float(sparse.mean()) == pytest.approx(0.2, rel=0.1)


def test_output_change_in_the_heads_frame_equals_the_direct_messages():
    q, k, v, w_o = random_heads(n_samples=3)
    block = HeadBlock(q[:, 0], k[:, 0], np.ones((3, 8), bool), ScoreTerms(0.5, True), 0.95, v[:, 0],
                      message_frame(w_o[0]), min_keys=2)
    rng = np.random.default_rng(3)
    kq, kk, km = rng.uniform(-0.2, 0.2, (3, 8, 4)), rng.uniform(-0.2, 0.2, (3, 8, 2)), rng.uniform(-0.2, 0.2, (3, 8, 2))
    effects = block.attention_change(kq, kk, km)
    heads_kv = np.arange(4) // 2
    messages = np.einsum("sjhd,hdm->shjm", v[:, 0][:, :, heads_kv].astype(np.float64), w_o[0].astype(np.float64))
    # Float64 references; each float32 result within what weights off by attention_atol allow (tests/reference.py).
    clean, clean_logit = attention_float64(q[:, 0], k[:, 0], np.ones((3, 8), bool), attn_scale=0.5, causal=True)
    noisy, noisy_logit = attention_float64(q[:, 0] * (1 + kq[..., None]), k[:, 0] * (1 + kk[..., None]),
                                           np.ones((3, 8), bool), attn_scale=0.5, causal=True)
    atol = attention_atol(max(clean_logit, noisy_logit))
    clean_out = np.einsum("shij,shjm->shim", clean, messages)
    noisy_out = np.einsum("shij,shjm->shim", noisy, messages * (1 + km[:, :, heads_kv].transpose(0, 2, 1))[..., None])
    reach = np.linalg.norm(messages, axis=-1).sum(-1, keepdims=True)  # |sum_j e_j m_j| <= max_j |e_j| * reach
    for found, output, weight_error in ((effects["output_change_sq"], noisy_out - clean_out, 2 + np.abs(km).max()),
                                        (block.output_sq, clean_out, 1)):
        norm, error = np.linalg.norm(output, axis=-1), weight_error * atol * reach
        np.testing.assert_array_less(np.abs(found - norm**2), 2 * norm * error + error**2)
    np.testing.assert_allclose(effects["tv"], 0.5 * np.abs(noisy - clean).sum(-1), rtol=0, atol=8 * atol)  # 8 keys


@pytest.mark.parametrize("terms", [
    ScoreTerms(0.5, True, sliding_window=3, softcap=2.0),
    ScoreTerms(0.5, True, alibi_slopes=(0.5, 0.25, 0.125, 0.0625)),
    ScoreTerms(0.5, False),
    ScoreTerms(1.0, False, relative_bias=RELATIVE_BIAS),
    ScoreTerms(0.5, True, sink_logits=(1.0, -2.0, 0.5, 3.0)),
], ids=["window-softcap", "alibi", "bidirectional", "relative-bias", "sinks"])
def test_clean_and_perturbed_attention_are_the_one_functions_of_the_scaled_queries_and_keys(terms):
    """The replay's clean pattern is the model's attention of q, k with the score terms, and its
    perturbed one that of the noised q, k: total variation and collapses (every instance with two
    keys or more counted as sparse, so that arg-max changes are collapses) against float64."""
    q, k, _, _ = random_heads(n_samples=3, scale=1.0)
    q, k = q[:, 0], k[:, 0]
    valid = np.ones((3, 8), bool)
    valid[0, :3] = False  # left padding: a causal query there may see no key
    reference = dict(attn_scale=terms.scale, causal=terms.causal, sliding_window=terms.sliding_window,
                     softcap=terms.softcap, alibi_slopes=terms.alibi_slopes, relative_bias=terms.relative_bias,
                     sink_logits=terms.sink_logits)
    block = HeadBlock(q, k, valid, terms, 0.0, min_keys=2)
    assert_attention_close(block.pattern, q, k, valid, **reference)
    empty = ~valid[:, None, :, None] if terms.causal else np.zeros((3, 1, 8, 1), bool)
    assert np.all(np.where(empty, block.pattern, 0) == 0) and np.isfinite(block.pattern).all()
    rng = np.random.default_rng(4)
    kq, kk = rng.uniform(-0.3, 0.3, (3, 8, 4)), rng.uniform(-0.3, 0.3, (3, 8, 2))
    effects = block.perturb(kq, kk) | block.attention_change(kq, kk, np.zeros_like(kk))
    # float64 references (tests/reference.py): each entry within atol, so the total variation over 8 keys within 8 atol
    clean, clean_logit = attention_float64(q, k, valid, **reference)
    noisy, noisy_logit = attention_float64(q * (1 + kq[..., None]), k * (1 + kk[..., None]), valid, **reference)
    atol = attention_atol(max(clean_logit, noisy_logit))
    np.testing.assert_allclose(effects["tv"], 0.5 * np.abs(noisy - clean).sum(-1), rtol=0, atol=8 * atol)
    assert effects["tv"].max() > 0.05  # the noise moves the attention

    def decided(pattern):  # no near-tie of the top two that float32 rounding could flip
        top_two = np.sort(pattern, axis=-1)[..., -2:]
        return top_two[..., 1] - top_two[..., 0] > 2 * atol

    clear = decided(clean) & decided(noisy) & block.instance
    moved = noisy.argmax(-1) != clean.argmax(-1)
    np.testing.assert_array_equal(effects["collapse"][clear], moved[clear])
    assert clear[block.instance].mean() > 0.9 and moved[clear].any()


def test_entropy_histogram_and_counts_of_known_heads_leave_out_the_trivial_first_positions(tmp_path):
    # Head 0 attends uniformly (all scores equal), head 1 one-hot on key 0 (huge score). Causal:
    # query i sees i + 1 keys, so position 0 is never an instance, and positions 1 and 2 (2 and 3
    # keys) are trivial instances by default (min_keys=4).
    n_samples, n_pos = 2, 6
    q = np.zeros((n_samples, 1, n_pos, 2, 1), np.float32)
    q[..., 1, 0] = 1.0
    k = np.zeros((n_samples, 1, n_pos, 2, 1), np.float32)
    k[:, 0, 0, 1, 0] = 1000.0
    ds = write_store(tmp_path / "s", q=q, k=k, causal=True)
    for min_keys, first in ((4, 3), (2, 1)):  # 2: every query that can switch (the behaviour before the minimum)
        options = {} if min_keys == 4 else {"min_keys": min_keys}
        result = replay(ds, levels=(0.1,), n_draws=2, targets=("k",), n_bootstrap=5, **options).sel(layer=0)
        assert result.attrs["min_keys"] == min_keys
        counted, trivial = n_samples * (n_pos - first), n_samples * (first - 1)
        entropy = result.entropy.values
        assert entropy[0] == pytest.approx(np.mean(np.log(np.arange(first + 1, n_pos + 1))))
        assert entropy[1] == pytest.approx(0.0, abs=1e-9)
        hist = result.max_attention_hist.values
        assert hist.sum(axis=1).tolist() == [counted] * 2 and hist[1, -1] == counted
        assert result.n_instances.values.tolist() == [counted] * 2
        assert result.n_sparse.values.tolist() == [0, counted]
        assert result.n_instances_trivial.values.tolist() == [trivial] * 2
        assert result.n_sparse_trivial.values.tolist() == [0, trivial]  # uniform over 2 or 3 keys is not sparse


def test_the_collapse_rate_and_level_count_only_instances_with_min_keys(tmp_path):
    """Queries 1 and 2 (2 and 3 keys) are sparse on a near-tie (scores 100 and 97) that key noise
    breaks; later queries are one-hot on a score of 1000. With the default minimum nothing
    collapses; with min_keys=2 the collapses are exactly the draws where 97 (1 + kk_1) > 100 (1 + kk_0)."""
    n_samples, n_pos, level, n_draws = 4, 6, 0.1, 20
    q = np.zeros((n_samples, 1, n_pos, 1, 2), np.float32)
    q[:, 0, :3, 0, 0] = 1.0
    q[:, 0, 3:, 0, 1] = 1.0
    k = np.zeros((n_samples, 1, n_pos, 1, 2), np.float32)
    k[:, 0, :, 0, 0] = -1000.0
    k[:, 0, 0, 0] = (100.0, 1000.0)
    k[:, 0, 1, 0, 0] = 97.0
    ds = write_store(tmp_path / "s", q=q, k=k, causal=True)
    options = dict(levels=(level,), n_draws=n_draws, targets=("k",), n_bootstrap=20, seed=2)
    default = replay(ds, **options).sel(layer=0, head=0)
    assert int(default.n_sparse) == n_samples * 3 and int(default.n_sparse_trivial) == n_samples * 2
    assert int(default.collapses.sum()) == 0 and np.isinf(default.collapse_level.sel(definition="collapse"))
    every = replay(ds, min_keys=2, **options).sel(layer=0, head=0)
    assert int(every.n_sparse) == n_samples * 5 and int(every.n_sparse_trivial) == 0
    kk = np.stack([level * unit_noise(2, "k", 0, np.arange(n_samples), draw, n_pos, 1)[:, :2, 0]
                   for draw in range(n_draws)])  # (draw, sample, key 0 / 1)
    switched = 97.0 * (1 + kk[..., 1]) > 100.0 * (1 + kk[..., 0])
    expected = 2 * int(switched.sum())  # queries 1 and 2 see the same two keys
    assert 0 < expected and int(every.collapses.sel(definition="collapse", level=level)) == expected
    assert float(every.collapse_rate.sel(definition="collapse", level=level)) == expected / (n_samples * 5 * n_draws)
    assert np.isfinite(every.collapse_level.sel(definition="collapse"))


# --- Theorem 7, draws, chunking ----------------------------------------------------------------


def test_theorem_7_differs_from_the_exact_rule_only_by_the_second_order_cross_term():
    # w* = 1.0, w_1 = 0.9: exact collapse iff 1.0 (1 + k*) < 0.9 (1 + k1); q noise cancels.
    q, k = margin_head([1.0 / 0.9], second_score=0.9)
    block = HeadBlock(q[:, 0], k[:, 0], np.ones((1, 2), bool), ScoreTerms(40.0, False), 0.95, min_keys=2)
    kk = np.array([[[-0.05], [0.05]]])  # exact: 0.95 < 0.945 is false -> no collapse
    kq = np.full((1, 2, 1), -0.5)  # first order: 1.0 (0.45) < 0.9 (0.55) = 0.495 -> predicted
    effects = block.perturb(kq, kk)
    assert not effects["collapse"].any() and effects["theory_predicted"].all() and not effects["exact_predicted"].any()
    assert not block.perturb(np.zeros_like(kq), kk)["theory_predicted"].any()


@pytest.mark.parametrize("terms, kq, collapses", [
    (ScoreTerms(1.0, True), -0.6, False),  # query noise scales both scores: 4 > 0
    (ScoreTerms(1.0, True, alibi_slopes=(5.0,)), -0.6, True),  # but not the bias: 4 - 5 < 0
    (ScoreTerms(1.0, True), -1.5, True),  # a factor 1 + kq < 0 reverses the order: -5 < 0
], ids=["cancels", "alibi", "reversed"])
def test_the_exact_condition_holds_unless_alibi_or_a_reversed_query_breaks_the_cancellation(terms, kq, collapses):
    """Query 1 sees key 0 (w = 10) and key 1 (w = 0): sparse on key 0 (scores 10 and 0, or 5 and 0
    with ALiBi's bias -5 on key 0). No key noise, so the exact condition never predicts a collapse."""
    q = np.ones((1, 2, 1, 1), np.float32)
    k = np.array([10.0, 0.0], np.float32).reshape(1, 2, 1, 1)
    block = HeadBlock(q, k, np.ones((1, 2), bool), terms, 0.95, min_keys=2)
    assert block.sparse[0, 0, 1] and block.winner[0, 0, 1] == 0
    noise = np.zeros((1, 2, 1))
    effects = block.perturb(noise + kq, noise)
    assert effects["collapse"][0, 0, 1] == collapses and not effects["exact_predicted"].any()
    assert effects["theory_predicted"][0, 0, 1] == collapses  # the first order keeps kq, and follows here


@pytest.mark.slow
def test_collapse_grows_monotonically_and_theorem_7_misses_and_false_alarms_where_the_exact_condition_does_not(tmp_path):
    q, k, v, w_o = random_heads(n_samples=16)
    ds = write_store(tmp_path / "s", q=q, k=k, v=v, w_o=w_o, attn_scale=0.5)
    result = replay(ds, levels=(0.005, 0.05, 0.3), n_draws=20, n_bootstrap=100)
    collapses = result.collapses.values
    assert np.all(np.diff(collapses, axis=1) >= 0) and collapses[0, -1].sum() > 0
    assert np.all(collapses[1] <= collapses[0])  # strict collapses are collapses
    assert collapses[0, :2].sum() == 0  # nothing collapses below 5 %: recall and precision are undefined there
    for name in ("theory_recall_pooled", "theory_precision_pooled", "exact_recall_pooled", "exact_precision_pooled"):
        assert np.isnan(result[name].values[:2]).all(), name
    # At 30 % the first order's cross term kq (w_t* kk_t* - w_t kk_t) matters; query noise cancels in the exact condition.
    assert 0.5 < result.theory_recall_pooled.values[-1] < 0.95 and 0.5 < result.theory_precision_pooled.values[-1] < 0.95
    assert result.theory_missed.sum() > 0 and result.theory_false_alarm.sum() > 0
    assert result.exact_recall_pooled.values[-1] == 1 and result.exact_precision_pooled.values[-1] == 1
    pooled = result.collapse_level_pooled.sel(definition="collapse").item()
    low, high = result.collapse_level_pooled_ci.sel(definition="collapse").values
    assert 0.05 < pooled < 0.3 and low <= pooled <= high
    rates = result.collapse_rate_pooled.sel(definition="collapse").values
    assert rates[1] < 0.01 <= rates[2]


def brute_force_conditions(q, k, valid, *, scale, levels, n_draws, seed, min_keys, threshold=0.95):
    """Float64 counts of a causal store's replay with noise on q and k (no soft-cap, no ALiBi): the
    (trivial) instances and sparse instances per (layer, head); per (level, layer, head) the
    measured collapses and, for each condition (theory: w_t (1 + kq + kk_t), exact: w_t (1 + kk_t)
    against the winner's), the predicted collapses and the hits (predicted and measured). Every
    decision is checked to stand beyond float32 rounding (else the fixture needs another seed)."""
    n_samples, n_layers, n_pos, n_heads, _ = q.shape
    group = n_heads // k.shape[3]
    counts = {name: np.zeros((len(levels), n_layers, n_heads), np.int64)
              for name in ("collapses", "theory_predicted", "theory_hits", "exact_predicted", "exact_hits")}
    counts |= {name: np.zeros((n_layers, n_heads), np.int64)
               for name in ("n_instances", "n_sparse", "n_instances_trivial", "n_sparse_trivial")}
    samples = np.arange(n_samples)
    unit = {(target, layer, draw): unit_noise(seed, target, layer, samples, draw, n_pos, n)
            for target, n in (("q", n_heads), ("k", k.shape[3])) for layer in range(n_layers) for draw in range(n_draws)}

    def beaten(scores, winner) -> bool:
        margin = np.delete(scores, winner).max() - scores[winner]
        assert abs(margin) > 1e-4 * np.abs(scores).max(), "a near-tie float32 could split either way"
        return margin > 0

    for layer, sample, head, i in np.ndindex(n_layers, n_samples, n_heads, n_pos):
        keys = np.flatnonzero(valid[sample, :i + 1])
        if not valid[sample, i] or len(keys) < 2:
            continue
        w = k[sample, layer, keys, head // group].astype(np.float64) @ q[sample, layer, i, head].astype(np.float64)
        max_attention = 1 / np.exp(scale * (w - w.max())).sum()
        assert abs(max_attention - threshold) > 1e-4
        trivial = "_trivial" if len(keys) < min_keys else ""
        counts[f"n_instances{trivial}"][layer, head] += 1
        counts[f"n_sparse{trivial}"][layer, head] += max_attention >= threshold
        if trivial or max_attention < threshold:
            continue
        winner = int(np.argmax(w))
        for (index, level), draw in itertools.product(enumerate(levels), range(n_draws)):
            kq = level * unit["q", layer, draw][sample, i, head]
            kk = level * unit["k", layer, draw][sample, keys, head // group]
            measured = beaten(w * (1 + kq) * (1 + kk), winner)
            counts["collapses"][index, layer, head] += measured
            for rule, scores in (("theory", w * (1 + kq + kk)), ("exact", w * (1 + kk))):
                predicted = beaten(scores, winner)
                counts[f"{rule}_predicted"][index, layer, head] += predicted
                counts[f"{rule}_hits"][index, layer, head] += predicted and measured
    return counts


def test_recall_and_precision_of_both_conditions_equal_float64_brute_force_counts(tmp_path):
    q, k, _, _ = random_heads(n_samples=6)
    valid = np.ones((6, 8), bool)
    valid[:2, 6:] = False  # right padding
    levels, n_draws, seed = (0.1, 0.3, 0.8), 4, 1
    ds = write_store(tmp_path / "s", q=q, k=k, valid=valid, attn_scale=0.5)
    result = replay(ds, levels=levels, n_draws=n_draws, seed=seed, targets=("q", "k"), n_bootstrap=5)
    counts = brute_force_conditions(q, k, valid, scale=0.5, levels=levels, n_draws=n_draws, seed=seed, min_keys=4)
    for name in ("n_instances", "n_sparse", "n_instances_trivial", "n_sparse_trivial"):
        np.testing.assert_array_equal(result[name], counts[name], err_msg=name)
    assert counts["n_sparse_trivial"].sum() > 0
    measured = counts["collapses"]
    np.testing.assert_array_equal(result.collapses.sel(definition="collapse"), measured)
    sparse_draws = counts["n_sparse"] * n_draws
    with np.errstate(invalid="ignore", divide="ignore"):  # NaN where nothing collapsed or nothing was predicted
        for rule, rate in (("theory", "predicted_collapse_rate"), ("exact", "exact_predicted_collapse_rate")):
            predicted, hits = counts[f"{rule}_predicted"], counts[f"{rule}_hits"]
            np.testing.assert_array_equal(result[f"{rule}_missed"], measured - hits)
            np.testing.assert_array_equal(result[f"{rule}_false_alarm"], predicted - hits)
            expected = {rate: predicted / sparse_draws, f"{rule}_recall": hits / measured,
                        f"{rule}_precision": hits / predicted,
                        f"{rule}_recall_pooled": hits.sum(axis=(1, 2)) / measured.sum(axis=(1, 2)),
                        f"{rule}_precision_pooled": hits.sum(axis=(1, 2)) / predicted.sum(axis=(1, 2))}
            for name, value in expected.items():
                np.testing.assert_allclose(result[name], value, rtol=1e-12, err_msg=name)
    # At 10 % nothing collapses and the first order alarms falsely; at 30 % it misses and alarms falsely. The
    # exact condition is exact while every 1 + kq > 0 (uniform noise below 1/sqrt(3)), not at 80 %, where a
    # factor 1 + kq < 0 turns an arg-max into an arg-min.
    pooled = {f"{rule}_{what}_pooled": result[f"{rule}_{what}_pooled"].values
              for rule in ("theory", "exact") for what in ("recall", "precision")}
    assert np.isnan(pooled["theory_recall_pooled"][0])
    assert pooled["theory_precision_pooled"][0] == 0 and np.isnan(pooled["exact_precision_pooled"][0])
    assert 0 < pooled["theory_recall_pooled"][1] < 1 and 0 < pooled["theory_precision_pooled"][1] < 1
    assert pooled["exact_recall_pooled"][1] == 1 and pooled["exact_precision_pooled"][1] == 1
    assert pooled["exact_recall_pooled"][2] < 1


@pytest.mark.slow
def test_same_seed_same_results_for_any_chunking_of_samples_and_draws(tmp_path, monkeypatch):
    q, k, v, w_o = random_heads(n_samples=10)
    results = [replay(write_store(tmp_path / f"s{size}", q=q, k=k, v=v, w_o=w_o, attn_scale=0.5, samples_per_chunk=size),
                      levels=(0.1, 0.3), n_draws=5, smooth_draws=4, seed=3, n_bootstrap=20)
               for size in (3, 10)]
    monkeypatch.setattr(replay_module, "DRAWS_PER_TASK", 2)  # the smooth draws in two tasks
    results.append(replay(open_store(tmp_path / "s3"), levels=(0.1, 0.3), n_draws=5, smooth_draws=4, seed=3,
                          n_bootstrap=20))
    for other in results[1:]:
        for name in ("n_sparse", "n_sparse_trivial", "collapses", "theory_missed", "exact_false_alarm",
                     "collapse_level_ci", "max_attention_hist"):
            np.testing.assert_array_equal(results[0][name].values, other[name].values)
        for name in ("tv_distance", "output_change", "entropy", "tv_distance_mc_error", "output_change_mc_error"):
            np.testing.assert_allclose(results[0][name], other[name], rtol=1e-9)
    other_seed = replay(open_store(tmp_path / "s3"), levels=(0.1, 0.3), n_draws=5, seed=4, n_bootstrap=20)
    assert not np.array_equal(other_seed.tv_distance.values, results[0].tv_distance.values)


def test_sub_blocks_sized_for_the_cache_give_the_results_of_one_block(tmp_path, monkeypatch):
    q, k, v, w_o = random_heads(n_samples=6)
    ds = write_store(tmp_path / "s", q=q, k=k, v=v, w_o=w_o, attn_scale=0.5, samples_per_chunk=6)
    whole = replay(ds, levels=(0.1, 0.3), n_draws=3, seed=1, n_bootstrap=20)
    for kernel_bytes in (1, 4 * 8 * 8 * 4 * 4):  # one sample a sub-block; sub-blocks of 4 and 2 samples
        monkeypatch.setattr(kernels, "KERNEL_BYTES", kernel_bytes)
        split = replay(ds, levels=(0.1, 0.3), n_draws=3, seed=1, n_bootstrap=20)
        _assert_same_replay(whole, split)


def test_norms_norm_geometry_and_replay_of_one_call_compute_each_blocks_attention_once_with_their_results_alone(
        tmp_path, monkeypatch):
    """One clean attention per (layer, block of samples) for the three analyses of a call, built inside the
    replay's tasks (never held between tasks), and each analysis's results identical to those it
    gives alone."""
    q, k, v, w_o = random_heads(n_samples=10)
    resid = np.random.default_rng(5).normal(size=(10, 2, q.shape[2], w_o.shape[-1])).astype(np.float32)
    ds = write_store(tmp_path / "s", q=q, k=k, v=v, w_o=w_o, attn_scale=0.5, samples_per_chunk=4,  # 3 blocks a layer
                     resid_pre=resid)
    options = {"norms": {"sites": ["k", "v"]}, "norm_geometry": {"interval_groups": 5},
               "replay": {"levels": [0.1, 0.3], "n_draws": 3, "n_bootstrap": 10}}
    alone = {name: run_analyses(ds, {name: ANALYSES[name].configure(options[name])})[name] for name in options}
    built = []
    build = kernels.CleanAttention.__init__

    def counted(self, *arguments):
        built.append(1)
        build(self, *arguments)

    monkeypatch.setattr(kernels.CleanAttention, "__init__", counted)
    together = run_analyses(ds, configure([ANALYSES[name] for name in options], options))
    assert len(built) == 2 * 3
    for name in options:
        xr.testing.assert_equal(together[name], alone[name])  # every value bit for bit (attrs hold the time of the run)
    assert alone["replay"]["/"].dataset.tv_distance.max() > 0
    geometry = alone["norm_geometry"]["/"].dataset
    assert 0 < geometry.sparse_share.min() and 0 < geometry.sink_attention.min()  # the shared sums are not all zero


class _Readers(Callback):
    """The number of tasks that read each block of q, k or v (results of shape (sample, pos, head, d_head))."""

    def __init__(self):
        super().__init__()
        self.counts = []

    def _posttask(self, key, result, dsk, state, id):
        if isinstance(result, np.ndarray) and result.ndim == 4:
            self.counts.append(len(state["dependents"][key]))


@pytest.mark.parametrize("only", [["norms", "replay"], ["norms"], ["norm_geometry", "replay"]])
def test_each_block_of_q_k_v_has_one_reader_in_a_call(tmp_path, only):
    """The norms take |q|, |k| (and |v|) from the tasks that read those blocks for the attention (the
    replay's, or their own when alone), and norm_geometry its attention sums: a second reader, run long
    after, would keep every block in memory until then."""
    q, k, v, w_o = random_heads(n_samples=10)
    resid = np.random.default_rng(5).normal(size=(10, 2, q.shape[2], w_o.shape[-1])).astype(np.float32)
    ds = write_store(tmp_path / "s", q=q, k=k, v=v, w_o=w_o, attn_scale=0.5, samples_per_chunk=4, resid_pre=resid)
    readers = _Readers()
    with dask.config.set(scheduler="synchronous"), readers:
        run_analyses(ds, configure([ANALYSES[name] for name in only],
                                   {"replay": {"n_draws": 3, "n_bootstrap": 10}} if "replay" in only else {}))
    assert len(readers.counts) >= 3 * 3 and set(readers.counts) == {1}  # q, k, v of 3 blocks, each read once


def _assert_same_replay(whole, split):
    assert whole.n_sparse.sum() > 0 and whole.collapses.sum() > 0
    for name in ("n_instances", "n_sparse", "n_instances_trivial", "collapses", "theory_missed", "exact_false_alarm",
                 "collapse_level_ci", "max_attention_hist"):
        np.testing.assert_array_equal(whole[name].values, split[name].values)
    for name in ("tv_distance", "output_change", "entropy", "tv_distance_mc_error", "output_change_mc_error"):
        np.testing.assert_allclose(whole[name], split[name], rtol=1e-9)


def test_without_resamples_the_interval_is_unknown_and_nan_activations_are_refused(tmp_path):
    q, k, v, w_o = random_heads(n_samples=4)
    result = replay(write_store(tmp_path / "a", q=q, k=k, v=v, w_o=w_o), levels=(0.3,), n_draws=2, n_bootstrap=0)
    assert np.isnan(result.collapse_level_ci).all() and not np.isnan(result.collapse_level).any()
    v[1, 0, 5, 1, 2] = np.inf
    with pytest.raises(NonFiniteError, match="'v' at layer\\(s\\) \\[0\\] in 1 sample\\(s\\) \\[1\\]"):
        replay(write_store(tmp_path / "v", q=q, k=k, v=v, w_o=w_o), n_draws=1)
    v[1, 0, 5, 1, 2] = 0.0
    q[2, 1, 3, 0, 0] = np.nan
    with pytest.raises(NonFiniteError, match="'q' at layer\\(s\\) \\[1\\] in 1 sample\\(s\\) \\[2\\]"):
        replay(write_store(tmp_path / "b", q=q, k=k, v=v, w_o=w_o), n_draws=1)


def test_level_at_rate_is_the_first_level_reaching_the_target_and_flags_what_the_sweep_misses():
    levels = (0.1, 0.2, 0.4)
    rates = np.array([[0.005, 0.02, 0.5], [0.02, 0.5, 0.9], [0.0, 0.001, 0.002], [np.nan] * 3])
    found = level_at_rate(levels, rates, 0.01)
    np.testing.assert_array_equal(found[:2], [0.2, 0.1])
    assert np.isinf(found[2]) and np.isnan(found[3])


def test_the_smooth_summaries_monte_carlo_error_covers_their_value_over_every_draw(tmp_path):
    """Per (instances, level, layer, head) the mean over 8 draws is within 3 of its stated standard
    errors of the mean over all 48 (fixed seed: the largest deviation is 2.8)."""
    q, k, v, w_o = random_heads(n_samples=32, n_pos=12)
    ds = write_store(tmp_path / "s", q=q, k=k, v=v, w_o=w_o, attn_scale=0.5, samples_per_chunk=32)
    options = dict(levels=(0.05, 0.2), n_draws=48, seed=2, n_bootstrap=5)
    few, every = replay(ds, smooth_draws=8, **options), replay(ds, smooth_draws=48, **options)
    assert few.attrs["smooth_draws"] == 8 and every.attrs["smooth_draws"] == 48
    for name in ("tv_distance", "output_change"):
        error = few[f"{name}_mc_error"].values
        assert np.all(error > 0)
        np.testing.assert_array_less(np.abs(few[name].values - every[name].values), 3 * error)
        assert np.median(every[f"{name}_mc_error"].values / error) < 0.5  # the error shrinks as 1/sqrt(draws)
    np.testing.assert_array_equal(few.collapses, every.collapses)  # collapses use every draw either way


def test_no_smooth_draws_leaves_out_the_smooth_summaries_and_nothing_else(tmp_path):
    """smooth_draws=0 (the atlas's default): no total variation or output change, and every other
    result as with the smooth summaries (the collapses come from the same draws)."""
    q, k, v, w_o = random_heads(n_samples=16, n_pos=12)
    ds = write_store(tmp_path / "s", q=q, k=k, v=v, w_o=w_o, attn_scale=2.0, samples_per_chunk=8)
    options = dict(levels=(0.05, 0.2), n_draws=6, seed=4, n_bootstrap=20)
    with_smooth, without = replay(ds, **options), replay(ds, smooth_draws=0, **options)
    smooth = {"tv_distance", "tv_distance_mc_error", "output_change", "output_change_mc_error"}
    assert set(with_smooth.data_vars) - set(without.data_vars) == smooth
    assert set(without.data_vars) < set(with_smooth.data_vars) and without.attrs["smooth_draws"] == 0
    assert with_smooth.n_sparse.sum() > 0 and with_smooth.collapses.sum() > 0  # the counts compared are not all zero
    for name in without.data_vars:
        np.testing.assert_array_equal(without[name].values, with_smooth[name].values, err_msg=name)


def test_two_draws_state_an_error_of_the_size_of_the_distance_to_the_mean_over_every_draw(tmp_path):
    """At the default two smooth draws, the error comes from the samples' spread between the draws
    (n_samples degrees of freedom): the distances to the mean over 48 draws, over their combined
    errors, have an RMS near 1 (fixed seed: 0.90 for the total variation, 1.34 for the output change)."""
    q, k, v, w_o = random_heads(n_samples=32, n_pos=12)
    ds = write_store(tmp_path / "s", q=q, k=k, v=v, w_o=w_o, attn_scale=0.5, samples_per_chunk=32)
    options = dict(levels=(0.05, 0.2), n_draws=48, seed=2, n_bootstrap=5)
    two, every = replay(ds, **options), replay(ds, smooth_draws=48, **options)
    assert two.attrs["smooth_draws"] == 2
    for name in ("tv_distance", "output_change"):
        error = np.hypot(two[f"{name}_mc_error"].values, every[f"{name}_mc_error"].values)
        z = (two[name].values - every[name].values) / error
        assert 0.5 < np.sqrt(np.mean(z**2)) < 2.0


def test_option_assignments_refuse_levels_that_do_not_increase_and_too_few_smooth_draws():
    from orthosphere.analyze.options import parse_assignment

    with pytest.raises(AnalysisError, match="option replay.levels=.*non-empty list of strictly increasing items"):
        parse_assignment("replay.levels=[0.1,0.05]", ANALYSES.values())
    with pytest.raises(AnalysisError, match=r"replay.smooth_draws=1: expected 0 \(no smooth summaries"):
        parse_assignment("replay.smooth_draws=1", ANALYSES.values())


# --- critical levels against the grid evaluation ------------------------------------------------


def grid_counts(block, settings, samples, layer=0):
    """The grid evaluation (the replay before critical levels): HeadBlock.perturb, the float32 softmax
    of every draw at every level; per (level, head) collapses, strict collapses and each condition's
    predictions, misses and false alarms."""
    counts = {}
    for draw, (index, level) in itertools.product(range(settings.n_draws), enumerate(settings.levels)):
        kappa = {t: level * settings.kappa(t, layer, samples, draw, block.n_pos, n)
                 for t, n in (("q", block.n_heads), ("k", block.n_kv_heads))}
        effects = block.perturb(kappa["q"], kappa["k"])
        measured = effects["collapse"]
        indicators = {"collapse": measured, "strict": effects["strict"]}
        for rule in ("theory", "exact"):
            predicted = effects[f"{rule}_predicted"]
            indicators |= {f"{rule}_predicted": predicted, f"{rule}_missed": measured & ~predicted,
                           f"{rule}_false_alarm": predicted & ~measured}
        for name, indicator in indicators.items():
            counts.setdefault(name, np.zeros((len(settings.levels), block.n_heads)))[index] += indicator.sum(axis=(0, 2))
    return counts


@pytest.mark.parametrize("terms, n_kv_heads", [
    (ScoreTerms(0.5, True), 4),
    (ScoreTerms(0.5, True, softcap=6.0), 4),
    (ScoreTerms(0.5, True, alibi_slopes=(0.5, 0.25, 0.125, 0.0625)), 4),
    (ScoreTerms(0.5, True, sliding_window=4), 4),
    (ScoreTerms(0.5, True), 2),
    (ScoreTerms(0.5, False), 1),
    (ScoreTerms(1.0, False, relative_bias=RELATIVE_BIAS), 4),
    (ScoreTerms(0.5, True, sink_logits=(1.0, -2.0, 0.5, 3.0)), 2),
], ids=["plain", "softcap", "alibi", "sliding-window", "gqa", "bidirectional-mqa", "relative-bias", "sinks"])
@pytest.mark.parametrize("distribution, levels", [
    ("uniform", (0.02, 0.05, 0.1, 0.2, 0.3, 0.6, 0.9)), ("gaussian", (0.02, 0.05, 0.1, 0.2, 0.3, 0.6, 0.9)),
    ("uniform", (0.02, 0.05, 0.1, 0.2, 0.3, 0.5)),
], ids=["uniform", "gaussian", "uniform-bounded"])
def test_critical_levels_give_the_grid_evaluations_counts_at_every_level(terms, n_kv_heads, distribution, levels):
    """Ties (two equal keys) and keys of zero score included; levels up to 0.9, where uniform noise
    reverses queries (1 + kq < 0) and a collapse need not persist; and up to 0.5, where uniform noise
    is bounded below that (0.5 sqrt(3) < 1) and the keys too far below their winner are left out (``near_keys``)."""
    q, k, _, _ = random_heads(n_samples=16, n_pos=10, n_heads=4, n_kv_heads=n_kv_heads, scale=2.0, seed=5)
    q, k = q[:, 0], k[:, 0]
    k[:, 3] = k[:, 2]  # a tie
    k[:, 5] = 0.0  # a key of zero score
    valid = np.ones((16, 10), bool)
    valid[:3, 8:] = False
    settings = ReplaySettings(levels=levels, n_draws=6, seed=3, min_keys=2, distribution=distribution, targets=("q", "k"))
    block = HeadBlock(q, k, valid, terms, 0.8, min_keys=2)
    samples = np.arange(16)
    expected = grid_counts(block, settings, samples)
    found = kernels.replay_block(q, k, valid, None, None, samples=samples, layer=0, draws=range(6),
                                  settings=ReplaySettings(**{**settings.__dict__, "sparse_threshold": 0.8}),
                                  terms=terms, n_bins=4)
    assert block.sparse.sum() > 20 and expected["collapse"].sum() > 20
    np.testing.assert_array_equal(found["collapses"][0], expected["collapse"])
    np.testing.assert_array_equal(found["collapses"][1], expected["strict"])
    for rule in ("theory", "exact"):
        for count in ("predicted", "missed", "false_alarm"):
            np.testing.assert_array_equal(found[f"{rule}_{count}"], expected[f"{rule}_{count}"], err_msg=f"{rule}_{count}")
    # the curve at the swept levels is the count there
    curve_levels = settings.curve_levels
    at_levels = np.searchsorted(curve_levels, settings.levels)
    np.testing.assert_array_equal(found["sample_curve"].sum(axis=0)[at_levels], expected["collapse"].sum(axis=1))


def test_keys_left_out_of_the_measured_and_exact_collapse_cannot_overtake_in_any_draw():
    """``near_keys``: for every key it leaves out, D(s) and C + beta s stay below zero for every s up to
    s_max and every noise within the bound (D is multilinear in u_q, u_t, u*: its largest values over the
    box lie at its corners); near-ties and a key above the winner in float64 are kept; nothing is left
    out when the noise is unbounded or can reverse a factor."""
    from orthosphere.analyze.critical import clean_differences, near_keys

    rng = np.random.default_rng(2)
    x = rng.normal(0.0, 4.0, (40, 300))
    bias = np.where(rng.random((40, 300)) < 0.1, -np.inf, rng.normal(0.0, 0.5, (40, 300)))
    winner = np.argmax(x + bias, axis=0)
    rows = np.arange(300)
    x[(winner[:5] + 1) % 40, rows[:5]] = x[winner[:5], rows[:5]] + 1e-7  # float64 near-ties above the winner
    bias[(winner[:5] + 1) % 40, rows[:5]] = bias[winner[:5], rows[:5]]
    s_max, bound = 0.3, np.sqrt(3.0)
    alpha, constant = clean_differences(x, bias, winner)
    key, row = near_keys(x, winner, alpha, constant, s_max, bound)
    assert np.all(np.diff(row) >= 0)
    kept = np.zeros(x.shape, bool)
    kept[key, row] = True
    assert kept[(winner[:5] + 1) % 40, rows[:5]].all() and not kept[winner, rows].any()
    left_out = np.isfinite(constant) & ~kept
    left_out[winner, rows] = False
    assert 0.3 < left_out.sum() / np.isfinite(constant).sum() < 0.99
    t, r = np.nonzero(left_out)
    gap = constant[t, r] - alpha[t, r]
    s = np.linspace(0.0, s_max, 61)[:, None]
    for u_q in (-bound, bound):
        for u_t in (-bound, bound):
            for u_w in (-bound, bound):
                beta = x[t, r] * u_t - x[winner[r], r] * u_w
                assert np.all((1 + s * u_q) * (alpha[t, r] + s * beta) + gap < 0)
                assert np.all(constant[t, r] + s * beta < 0)
    seen = np.isfinite(constant).sum() - 300
    assert len(near_keys(x, winner, alpha, constant, s_max, None)[0]) == seen
    assert len(near_keys(x, winner, alpha, constant, 0.6, bound)[0]) == seen  # 0.6 sqrt(3) > 1: a factor may reverse


# --- bad input --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_store(tmp_path_factory):
    q, k, v, w_o = random_heads(n_samples=4)
    return write_store(tmp_path_factory.mktemp("bad") / "s", q=q, k=k, v=v, w_o=w_o)


@pytest.mark.parametrize("options, message", [
    ({"levels": (0.0, 0.1)}, "strictly between 0 and 1"),
    ({"levels": (0.1, 1.0)}, "strictly between 0 and 1"),
    ({"levels": ()}, r"levels=\(\): expected .*non-empty list"),
    ({"levels": ("a",)}, "strictly between 0 and 1"),
    ({"levels": (0.2, 0.1)}, "strictly increasing"),
    ({"levels": (0.1, 0.1)}, "strictly increasing"),
    ({"levels": (-0.1, 0.1)}, "strictly between 0 and 1"),
    ({"smooth_draws": 1, "n_draws": 8}, r"smooth_draws=1: expected 0 \(no smooth summaries.*\) or an integer >= 2, the "
                                        "fewest .* Monte Carlo error"),
    ({"smooth_draws": True, "n_draws": 8}, "smooth_draws=True: expected 0"),
    ({"smooth_draws": 9, "n_draws": 8}, "smooth_draws=9: expected 0 or an integer from 2 to n_draws = 8"),
    ({"seed": -1}, "seed=-1: expected an integer >= 0"),
    ({"sparse_threshold": "high"}, "in \\(0, 1\\]"),
    ({"sparse_threshold": 0.0}, "in \\(0, 1\\]"),
    ({"sparse_threshold": 1.2}, "in \\(0, 1\\]"),
    ({"n_draws": 0}, "n_draws=0: expected an integer >= 1, noise draws per level"),
    ({"distribution": "cauchy"}, r"distribution='cauchy': expected one of \['uniform', 'gaussian'\]"),
    ({"targets": ("q", "x")}, r"targets=\('q', 'x'\): expected one of .* or a non-empty list .* q: queries"),
    ({"targets": ()}, r"targets=\(\): expected .*non-empty list"),
    ({"collapse_target": 1.5}, "collapse_target=1.5: expected a number strictly between 0 and 1, a rate"),
    ({"n_bootstrap": -1}, "n_bootstrap=-1: expected an integer >= 0"),
    ({"confidence": 1.5}, "confidence=1.5"),
    ({"layers": [5]}, "holds layers \\[0, 1\\]"),
    ({"min_keys": 1}, "min_keys=1: expected an integer >= 2, the fewest allowed keys"),
    ({"min_keys": 2.5}, "min_keys=2.5: expected an integer >= 2"),
    ({"min_keys": True}, "min_keys=True: expected an integer >= 2"),
    ({"min_keys": "4"}, "min_keys='4': expected an integer >= 2"),
])
def test_bad_settings_are_clear_errors(small_store, options, message):
    with pytest.raises(AnalysisError, match=message):
        replay(small_store, **({"n_draws": 1} | options))


def test_a_store_without_what_the_targets_need_is_a_clear_error(tmp_path):
    q, k, v, w_o = random_heads(n_samples=4)
    without_weights = write_store(tmp_path / "a", q=q, k=k, v=v)
    with pytest.raises(ReplayError, match=r"lacks \['w_o'\].*drop the target 'm'"):
        replay(without_weights, n_draws=1)
    result = replay(without_weights, n_draws=1, targets=("q", "k"), n_bootstrap=5)
    assert "output_change" not in result
    without_v = write_store(tmp_path / "b", q=q, k=k, w_o=w_o)
    with pytest.raises(ReplayError, match=r"lacks \['v'\]"):
        replay(without_v, n_draws=1, targets=("m",))
    with pytest.raises(ReplayError, match=r"lacks \['k'\]"):
        replay(without_v.drop_vars("k"), n_draws=1, targets=("q",))
    described = without_v.copy()
    described.attrs = {"model": {key: val for key, val in without_v.attrs["model"].items() if key != "attn_scale"}}
    with pytest.raises(ReplayError, match="attn_scale"):
        replay(described, n_draws=1, targets=("k",))
