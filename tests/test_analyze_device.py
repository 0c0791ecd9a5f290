"""The attention kernels on a torch device (``device``), checked with torch's CPU ("cpu-torch"): each
float32 result against a float64 reference, the replay's counts against float64 brute force, and the
device option's bad inputs."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from orthosphere.analyze import ANALYSES, norm_spread, open_for_analysis
from orthosphere.analyze.attention import ScoreTerms
from orthosphere.analyze.device import resolve_device
from orthosphere.analyze.errors import AnalysisError
from orthosphere.analyze.options import parse_assignment
from orthosphere.analyze.replay import replay
from orthosphere.analyze.replay_blocks import message_frame
from tests.reference import assert_attention_close, attention_atol, attention_float64
from tests.test_analyze_replay import RELATIVE_BIAS, brute_force_conditions, random_heads, write_store

torch = pytest.importorskip("torch")
from orthosphere.analyze.torch_kernels import TorchAttention, TorchHeadBlock  # noqa: E402

TERMS = [
    ScoreTerms(0.5, True, sliding_window=3, softcap=2.0),
    ScoreTerms(0.5, True, alibi_slopes=(0.5, 0.25, 0.125, 0.0625)),
    ScoreTerms(0.5, False),
    ScoreTerms(1.0, False, relative_bias=RELATIVE_BIAS),
    ScoreTerms(0.5, True, sink_logits=(1.0, -2.0, 0.5, 3.0)),
]
TERM_IDS = ["window-softcap", "alibi", "bidirectional", "relative-bias", "sinks"]


def reference_terms(terms: ScoreTerms) -> dict:
    return dict(attn_scale=terms.scale, causal=terms.causal, sliding_window=terms.sliding_window,
                softcap=terms.softcap, alibi_slopes=terms.alibi_slopes, relative_bias=terms.relative_bias,
                sink_logits=terms.sink_logits)


@pytest.mark.parametrize("terms", TERMS, ids=TERM_IDS)
def test_the_torch_block_is_the_models_attention_and_its_changes_against_float64(terms):
    """Clean attention, max attention, winners, entropy, the sparse rows' dot products and bias, and
    one draw's total variation and output change: grouped-query heads, left padding (a causal query
    that may see no key), each score type."""
    q, k, v, w_o = random_heads(n_samples=3, scale=1.0)
    q, k, v = q[:, 0], k[:, 0], v[:, 0]
    valid = np.ones((3, 8), bool)
    valid[0, :3] = False
    frame = message_frame(w_o[0])
    block = TorchHeadBlock(TorchAttention(q, k, valid, terms, "cpu-torch"), 0.5, v, frame, min_keys=2)
    reference = reference_terms(terms)
    clean, clean_logit = attention_float64(q, k, valid, **reference)
    atol = attention_atol(clean_logit)
    pattern = block.attention.permute(1, 2, 3, 0).numpy()
    assert_attention_close(pattern, q, k, valid, **reference)
    seen = clean.sum(-1) > 0  # (sample, head, qpos) queries with a key
    np.testing.assert_allclose(block.max_attention[seen], clean.max(-1)[seen], rtol=0, atol=atol)
    top_two = np.sort(clean, axis=-1)[..., -2:]
    decided = seen & (top_two[..., 1] - top_two[..., 0] > 2 * atol)
    np.testing.assert_array_equal(block.winner[decided], clean.argmax(-1)[decided])
    entropy = -(clean * np.log(np.where(clean > 0, clean, 1))).sum(-1)
    np.testing.assert_allclose(block.entropy()[seen], entropy[seen], rtol=0, atol=8 * atol * (1 + np.log(8) + clean_logit))
    (sample, head, query), dots, bias, winner = block.sparse_rows()
    assert len(sample) > 0
    kv = head // 2
    expected_dots = np.einsum("rkd,rd->kr", k[sample, :, kv].astype(np.float64), q[sample, query, head].astype(np.float64))
    allowed = bias > -np.inf
    np.testing.assert_allclose(np.where(allowed, dots, 0), np.where(allowed, terms.scale * expected_dots, 0), rtol=0,
                               atol=1e-5 * max(1.0, np.abs(expected_dots).max()))
    rng = np.random.default_rng(4)
    kq, kk, km = rng.uniform(-0.3, 0.3, (3, 8, 4)), rng.uniform(-0.3, 0.3, (3, 8, 2)), rng.uniform(-0.3, 0.3, (3, 8, 2))
    effects = block.attention_change(kq, kk, km)
    noisy, noisy_logit = attention_float64(q * (1 + kq[..., None]), k * (1 + kk[..., None]), valid, **reference)
    atol = attention_atol(max(clean_logit, noisy_logit))
    np.testing.assert_allclose(effects["tv"], 0.5 * np.abs(noisy - clean).sum(-1), rtol=0, atol=8 * atol)
    assert effects["tv"].max() > 0.05
    messages = np.einsum("skhd,hde->shke", np.repeat(v, 2, axis=2).astype(np.float64), frame)
    clean_out = np.einsum("shij,shjm->shim", clean, messages)
    noisy_out = np.einsum("shij,shjm->shim", noisy, messages * (1 + np.repeat(km, 2, axis=2).transpose(0, 2, 1))[..., None])
    reach = np.linalg.norm(messages, axis=-1).sum(-1, keepdims=True)
    for found, output, weight_error in ((effects["output_change_sq"], noisy_out - clean_out, 2 + np.abs(km).max()),
                                        (block.output_sq, clean_out, 1)):
        norm, error = np.linalg.norm(output, axis=-1), weight_error * atol * reach
        np.testing.assert_array_less(np.abs(found - norm**2), 2 * norm * error + error**2)


@pytest.mark.parametrize("terms", TERMS[:2] + [ScoreTerms(0.7, True)], ids=TERM_IDS[:2] + ["causal"])
def test_the_attention_each_key_receives_on_the_device_against_float64(terms):
    q, k, _, _ = random_heads(n_samples=4, scale=1.0)
    q, k = q[:, 0], k[:, 0]
    valid = np.ones((4, 8), bool)
    valid[1, 5:] = False
    mask = valid.copy()
    mask[:, 0] = False  # the start token is not analysed
    received = TorchAttention(q, k, valid, terms, "cpu-torch").received(mask)
    pattern, largest = attention_float64(q, k, valid, **reference_terms(terms))
    expected = np.einsum("shqk,sq->shk", pattern, mask) * mask[:, None, :]
    np.testing.assert_allclose(received, expected, rtol=0, atol=8 * attention_atol(largest))


def replay_beside_brute_force(folder, device: str):
    """The replay of random sharp heads (6 samples, 8 positions, right padding) with `device` and
    with numpy, the float64 brute-force counts of the same draws (every decision of the fixture
    stands beyond float32 rounding), and what float32 rounding allows the total variation between the
    two paths (each within 8 keys' attention tolerances of float64)."""
    q, k, v, w_o = random_heads(n_samples=6)
    valid = np.ones((6, 8), bool)
    valid[:2, 6:] = False
    levels, n_draws, seed = (0.1, 0.3, 0.8), 4, 1
    ds = write_store(folder / "heads.zarr", q=q, k=k, v=v, w_o=w_o, valid=valid, attn_scale=0.5)
    options = dict(levels=levels, n_draws=n_draws, seed=seed, targets=("q", "k"), n_bootstrap=5)
    counts = brute_force_conditions(q, k, valid, scale=0.5, levels=levels, n_draws=n_draws, seed=seed, min_keys=4)
    largest = max(attention_float64(q[:, layer], k[:, layer], valid, attn_scale=0.5, causal=True)[1] for layer in range(2))
    allowed = 2 * 8 * attention_atol(largest * (1 + np.sqrt(3) * levels[-1]) ** 2)
    return replay(ds, device=device, **options), replay(ds, **options), counts, allowed


def norm_bands_beside_a_stored_pattern(folder, device: str):
    """The norms of k weighted by the attention recomputed on `device`, and those weighted by the
    stored float64 pattern of the same q, k."""
    q, k, _, _ = random_heads(n_samples=8, scale=1.0)
    valid = np.ones((8, 8), bool)
    ds = write_store(folder / "qk.zarr", q=q, k=k, attn_scale=0.5)
    pattern = np.stack([attention_float64(q[:, layer], k[:, layer], valid, attn_scale=0.5, causal=True)[0]
                        for layer in range(2)], axis=1).astype(np.float32)
    stored = write_store(folder / "pattern.zarr", q=q, k=k, pattern=pattern, attn_scale=0.5)
    return (norm_spread(open_for_analysis(ds.attrs["url"]), sites=["k"], device=device)["k"],
            norm_spread(open_for_analysis(stored.attrs["url"]), sites=["k"])["k"])


def test_the_replay_on_the_device_counts_what_float64_brute_force_counts(tmp_path):
    """Counts equal float64 brute force; the total variation equals the numpy path's within float32 rounding."""
    on_device, on_cpu, counts, allowed = replay_beside_brute_force(tmp_path, "cpu-torch")
    assert on_device.attrs["device"] == "cpu-torch" and on_cpu.attrs["device"] == "cpu"
    for name in ("n_instances", "n_sparse", "n_instances_trivial", "n_sparse_trivial"):
        np.testing.assert_array_equal(on_device[name], counts[name], err_msg=name)
    np.testing.assert_array_equal(on_device.collapses.sel(definition="collapse"), counts["collapses"])
    for rule in ("theory", "exact"):
        np.testing.assert_array_equal(on_device[f"{rule}_false_alarm"], counts[f"{rule}_predicted"] - counts[f"{rule}_hits"])
    np.testing.assert_allclose(on_device.tv_distance, on_cpu.tv_distance, rtol=0, atol=allowed)
    np.testing.assert_array_equal(on_device.collapses, on_cpu.collapses)  # both equal the brute force


def test_norms_weighted_by_attention_recomputed_on_the_device(tmp_path):
    """The same bands as with the stored float64 pattern, within the histogram's bin width."""
    found, expected = norm_bands_beside_a_stored_pattern(tmp_path, "cpu-torch")
    assert found.attrs["attention_source"] == "recomputed from q, k"
    assert expected.attrs["attention_source"] == "stored pattern"
    np.testing.assert_allclose(found["weight_total"], expected["weight_total"], rtol=1e-5)
    np.testing.assert_allclose(found["band"], expected["band"], rtol=0, atol=found.attrs["ratio_bin_width"])


def test_norm_geometry_on_the_device_reads_what_a_stored_float64_pattern_gives(tmp_path):
    """Sinks and sparse queries from the attention recomputed with torch equal those of the stored float64
    pattern of the same q, k: the start token's attention within float32's tolerance over the queries
    summed, the sparse share exactly (no largest attention of the fixture lies within 1e-4 of 0.95)."""
    from orthosphere.analyze.norm_geometry import norm_geometry

    q, k, _, _ = random_heads(n_samples=8, scale=2.0)
    valid = np.ones((8, 8), bool)
    valid[:3, 6:] = False
    resid = np.random.default_rng(2).normal(size=(8, 2, 8, 16)).astype(np.float32)  # d_model: n_heads x d_head
    patterns = [attention_float64(q[:, layer], k[:, layer], valid, attn_scale=0.5, causal=True) for layer in range(2)]
    pattern = np.stack([found[0] for found in patterns], axis=1)
    largest = pattern.max(axis=-1)[np.broadcast_to(valid[:, None, None, :], pattern.shape[:-1])]
    assert np.abs(largest - 0.95).min() > 1e-4 and (largest >= 0.95).any() and (largest < 0.95).any()
    recomputed = write_store(tmp_path / "qk.zarr", q=q, k=k, valid=valid, attn_scale=0.5, resid_pre=resid)
    stored = write_store(tmp_path / "pattern.zarr", q=q, k=k, valid=valid, pattern=pattern.astype(np.float32),
                         attn_scale=0.5, resid_pre=resid)
    found = norm_geometry(open_for_analysis(recomputed.attrs["url"]), device="cpu-torch", interval_groups=4)
    expected = norm_geometry(open_for_analysis(stored.attrs["url"]), interval_groups=4)
    assert found.attrs["attention_source"] == "recomputed from q, k" and expected.attrs["attention_source"] == "stored pattern"
    allowed = 8 * attention_atol(max(largest_logit for _, largest_logit in patterns))
    np.testing.assert_allclose(found.sink_attention, expected.sink_attention, rtol=0, atol=allowed)
    np.testing.assert_array_equal(found.sparse_share, expected.sparse_share)
    assert 0 < float(expected.sparse_share.min()) and 0 < float(expected.sink_attention.min())


@pytest.mark.parametrize("value, message", [
    ("tpu", "option device='tpu': expected auto, cpu \\(numpy\\), cpu-torch"),
    ("cuda:x", "option device='cuda:x': expected auto"),
    (3, "option device=3: expected auto"),
])
def test_a_device_of_the_wrong_form_is_refused_naming_the_option(value, message):
    with pytest.raises(AnalysisError, match=message):
        resolve_device(value)
    if isinstance(value, str):
        with pytest.raises(AnalysisError, match=message.replace("option device", "option replay.device")):
            parse_assignment(f"replay.device={value}", ANALYSES.values())


def test_cuda_without_a_gpu_or_without_torch_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(AnalysisError, match="device='cuda': torch sees no CUDA device .* use device=cpu"):
        resolve_device("cuda")
    assert resolve_device("auto") == "cpu"
    q, k, _, _ = random_heads(n_samples=2)
    ds = write_store(tmp_path / "s", q=q, k=k)
    with pytest.raises(AnalysisError, match="device='cuda:1': torch sees no CUDA device"):
        replay(ds, device="cuda:1", n_draws=2)
    with pytest.raises(AnalysisError, match="device='cuda': torch sees no CUDA device"):
        norm_spread(ds, sites=["k"], device="cuda")
    monkeypatch.setitem(sys.modules, "torch", None)  # torch not installed
    with pytest.raises(AnalysisError, match="device='cuda' runs the attention kernels with torch, which is not "
                                            "installed: .* or use device=cpu"):
        resolve_device("cuda")
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"


def test_the_cli_runs_the_kernels_where_device_says(tmp_path):
    from click.testing import CliRunner

    from orthosphere.analyze import open_results
    from orthosphere.workflows.cli import main

    q, k, v, w_o = random_heads(n_samples=4)
    ds = write_store(tmp_path / "s", q=q, k=k, v=v, w_o=w_o, attn_scale=0.5)
    runner = CliRunner()
    common = ["analyze", ds.attrs["url"], "--only", "replay", "--option", "replay.n_draws=2", "--bootstrap", "5"]
    result = runner.invoke(main, common + ["--out", str(tmp_path / "r"), "--device", "cpu-torch"])
    assert result.exit_code == 0, result.output
    assert open_results(str(tmp_path / "r"))["replay"].attrs["device"] == "cpu-torch"
    result = runner.invoke(main, common + ["--out", str(tmp_path / "default")])
    assert result.exit_code == 0, result.output
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert open_results(str(tmp_path / "default"))["replay"].attrs["device"] == expected
    result = runner.invoke(main, common + ["--out", str(tmp_path / "x"), "--device", "tpu"])
    assert result.exit_code != 0 and "option device='tpu': expected auto, cpu (numpy)" in result.output


@pytest.mark.skipif(bool(__import__("glob").glob("/dev/nvidia[0-9]*")), reason="a machine with an NVIDIA device")
def test_auto_without_a_gpu_device_leaves_torch_unimported():
    import subprocess

    code = ("import sys; from orthosphere.analyze.device import resolve_device; "
            "print(resolve_device('auto'), 'torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split() == \
        ["cpu", "False"]
