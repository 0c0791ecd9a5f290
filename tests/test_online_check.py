"""The replay's online check: the same draws in the model's forward pass, for the arithmetic
family and Hugging Face models; exact agreement with the offline replay; model mismatch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from orthosphere.analyze import analyze
from orthosphere.analyze.errors import AnalysisError
from orthosphere.analyze.noise import unit_noise
from orthosphere.analyze.replay import ReplayConfig, ReplayError, replay
from orthosphere.analyze.replay_blocks import ReplaySettings
from orthosphere.analyze.results import open_results, write_results
from orthosphere.errors import ParameterError
from orthosphere.extract import tasks
from orthosphere.extract.adapters import adapter_for
from orthosphere.extract.model import ArithmeticTransformer, ModelConfig, save_model
from orthosphere.extract.sources import load_source
from orthosphere.store import create_store, open_store
from orthosphere.workflows.analysis import analyze_with_online_check
from orthosphere.workflows.online_check import ModelMismatchError, noise_edit, online_check, with_online_check

SETTINGS = ReplaySettings(levels=(0.1, 0.3), n_draws=3, seed=5)


def sharpen(*weights, std=0.5, seed=0):
    """Large query and key weights, so that a random model has many sparse heads."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in weights:
            weight.copy_(std * torch.randn(weight.shape, generator=generator))


def arithmetic_model(n_layers=2, seed=0):
    torch.manual_seed(seed)
    model = ArithmeticTransformer(ModelConfig(n_layers=n_layers, d_model=32, n_heads=4, d_ff=64, norm_placement="pre"))
    for block in model.blocks:
        sharpen(block.attn.q_proj.weight, block.attn.k_proj.weight, seed=seed)
    return model.eval()


def extract(path, adapter, tokens, valid, description=None):
    """A store of q, k, v, pattern and weights; targets are the model's own clean predictions."""
    tokens, valid = torch.as_tensor(tokens, dtype=torch.long), torch.as_tensor(valid, dtype=torch.bool)
    with torch.no_grad(), adapter.capture(("q", "k", "v", "pattern")) as recording:
        pred = adapter.forward(tokens, valid).argmax(-1).numpy().astype(np.int32)
        activations = {name: value.numpy() for name, value in recording.take().items()}
    n_samples, n_pos = tokens.shape
    writer = create_store(path, model=description or adapter.describe(), task={"name": "test"}, n_samples=n_samples,
                          n_pos=n_pos, sites=("q", "k", "v", "pattern"), samples_per_chunk=8)
    writer.write(0, {"tokens": tokens.numpy().astype(np.int32), "valid": valid.numpy(), "pred": pred,
                     "target": pred, "scored": valid.numpy(), **activations})
    writer.write_weights(adapter.all_head_weights(range(adapter.n_layers)))
    writer.mark_shard_complete(0)
    writer.finish()
    return open_store(path)


def arithmetic_tokens(n=16):
    batch = tasks.generate("test", n, seed=0)
    return batch.tokens, batch.valid


def assert_agrees_with_offline(online, offline):
    """Online collapse indicators equal the offline ones instance by instance, and rates match."""
    assert online.sparse_mismatches.sum() == 0 and online.offline_mismatches.sum() == 0
    assert online.offline_collapses.sum() > 0  # the comparison is not vacuous
    np.testing.assert_array_equal(online.n_sparse, offline.n_sparse)
    np.testing.assert_allclose(online.collapse_rate, offline.collapse_rate, rtol=1e-12)


def offline_replay(ds, settings):
    return replay(ds, levels=settings.levels, n_draws=settings.n_draws, seed=settings.seed,
                  min_keys=settings.min_keys, n_bootstrap=10)


@pytest.mark.slow
def test_arithmetic_model_online_equals_offline_and_accuracy_falls(tmp_path):
    model = arithmetic_model()
    adapter = adapter_for(model)
    ds = extract(tmp_path / "s", adapter, *arithmetic_tokens())
    settings = ReplaySettings(levels=(0.1, 0.3), n_draws=3, seed=5, distribution="gaussian", targets=("q", "k"), min_keys=6)
    offline = replay(ds, **settings.as_dict(), n_bootstrap=10)
    online = online_check(ds, model, settings=settings, all_layers=True, batch_size=10)
    assert online.attrs["distribution"] == "gaussian" and online.attrs["targets"] == ["q", "k"]
    assert online.attrs["min_keys"] == 6
    assert_agrees_with_offline(online, offline)
    assert online.clean_accuracy == 1.0 and online.clean_pred_agreement == 1.0  # targets: clean predictions
    accuracy = online.accuracy.values
    assert accuracy[-1, -1] < 1.0  # 30 % noise in every layer
    assert list(online.perturbation.values) == ["layer 0", "layer 1", "all layers"]
    all_layers = online.collapse_rate_all_layers.sel(definition="collapse", layer=0)
    np.testing.assert_allclose(all_layers, online.collapse_rate.sel(definition="collapse", layer=0))  # layer 0 sees no upstream noise


@pytest.mark.slow
def test_the_online_check_joins_the_results_tree_under_replay(tmp_path):
    model = arithmetic_model()
    extract(tmp_path / "s", adapter_for(model), *arithmetic_tokens(8))
    replay_config = ReplayConfig(levels=(0.1, 0.3), n_draws=2, n_bootstrap=10)
    tree = analyze(str(tmp_path / "s"), analyses=["replay"], replay={"levels": [0.1, 0.3], "n_draws": 2}, n_bootstrap=10)
    write_results(with_online_check(tree, str(tmp_path / "s"), model, replay_config, all_layers=True), tmp_path / "results")
    online = open_results(tmp_path / "results")["replay/online"].to_dataset()
    assert online.offline_mismatches.sum() == 0 and online.offline_collapses.sum() > 0
    assert list(online.level.values) == [0.1, 0.3] and online.attrs["n_draws"] == 2
    with pytest.raises(ReplayError, match="include the replay analysis"):
        analyze_with_online_check(str(tmp_path / "s"), tmp_path / "none", analyses=["norms"], online_model=model)
    assert not (tmp_path / "none").exists()


@pytest.mark.slow
def test_analyze_verb_with_online_check(tmp_path):
    from click.testing import CliRunner

    from orthosphere.workflows.cli import main

    model = arithmetic_model()
    extract(tmp_path / "s", adapter_for(model), *arithmetic_tokens(8))
    save_model(model, tmp_path / "model")
    arguments = ["analyze", str(tmp_path / "s"), "--out", str(tmp_path / "results"), "--only", "replay", "--bootstrap", "10",
                 "--option", "replay.levels=[0.1,0.3]", "--option", "replay.n_draws=2", "--option", "replay.min_keys=3",
                 "--online", str(tmp_path / "model"),
                 "--online-samples", "6"]
    outcome = CliRunner().invoke(main, arguments)
    assert outcome.exit_code == 0, outcome.output
    results = open_results(tmp_path / "results")
    online = results["replay/online"].to_dataset()
    assert online.attrs["n_samples"] == 6 and "all layers" in online.perturbation.values
    assert online.offline_mismatches.sum() == 0 and online.sparse_mismatches.sum() == 0
    assert results["replay"].attrs["min_keys"] == online.attrs["min_keys"] == 3
    other = save_model(arithmetic_model(n_layers=3), tmp_path / "other")
    outcome = CliRunner().invoke(main, arguments[:-3] + [str(other)])
    assert outcome.exit_code != 0 and "does not match the store" in outcome.output


def test_the_injected_noise_is_the_replays_draw(tmp_path):
    model = arithmetic_model()
    adapter = adapter_for(model)
    tokens, valid = arithmetic_tokens(4)
    ds = extract(tmp_path / "s", adapter, tokens, valid)
    samples = np.arange(4)
    with torch.no_grad(), adapter.edit_qkv(noise_edit(SETTINGS, [1], samples, draw=2, level=0.3)), \
            adapter.capture(("q", "k", "v"), [0, 1]) as recording:
        adapter.forward(torch.as_tensor(tokens, dtype=torch.long))
        noisy = {name: value.numpy() for name, value in recording.take().items()}
    n_pos = tokens.shape[1]
    for site, target in (("q", "q"), ("k", "k"), ("v", "m")):
        kappa = 0.3 * unit_noise(5, target, 1, samples, 2, n_pos, 4)
        np.testing.assert_allclose(noisy[site][:, 1], ds[site].sel(layer=1).values * (1 + kappa[..., None]), rtol=1e-6)
        np.testing.assert_array_equal(noisy[site][:, 0], ds[site].sel(layer=0).values)


@pytest.mark.slow
def test_the_online_check_counts_the_instances_the_replay_counts(tmp_path):
    """Sparse instances need min_keys allowed keys online as offline: a causal model's first
    positions, sparse with two or three keys, count with min_keys=2 only."""
    model = arithmetic_model()
    ds = extract(tmp_path / "s", adapter_for(model), *arithmetic_tokens(4))
    n_sparse = {}
    for min_keys in (2, 4):
        settings = ReplaySettings(levels=(0.3,), n_draws=1, seed=5, min_keys=min_keys)
        online = online_check(ds, model, settings=settings)
        assert online.attrs["min_keys"] == min_keys and online.sparse_mismatches.sum() == 0
        np.testing.assert_array_equal(online.n_sparse, offline_replay(ds, settings).n_sparse)
        n_sparse[min_keys] = int(online.n_sparse.sum())
    assert n_sparse[2] > n_sparse[4] > 0


def hugging_face_model(kind):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=40, n_positions=16)
        model = transformers.GPT2LMHeadModel(config)
        for block in model.transformer.h:
            sharpen(block.attn.c_attn.weight[:, :64])
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, vocab_size=40, max_position_embeddings=16)
        model = transformers.LlamaForCausalLM(config)
        for layer in model.model.layers:
            sharpen(layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight)
    return model.eval()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.slow
def test_hugging_face_model_online_equals_offline(tmp_path, kind):
    model = hugging_face_model(kind)
    generator = np.random.default_rng(0)
    tokens = generator.integers(0, 40, size=(12, 12))
    valid = np.ones((12, 12), bool)
    valid[:4, 9:] = False  # right padding, masked by the model's attention mask
    ds = extract(tmp_path / "s", adapter_for(model), tokens, valid)
    online = online_check(ds, model, settings=SETTINGS, batch_size=12)
    assert_agrees_with_offline(online, offline_replay(ds, SETTINGS))
    assert online.clean_accuracy == 1.0


@pytest.mark.parametrize("model_type", ["gemma2", "bloom", "mistral", "falcon"])
@pytest.mark.slow
def test_the_replay_perturbs_exactly_the_models_score(tmp_path, model_type):
    """Soft-capping and a sliding window (Gemma 2), ALiBi (Bloom), a window on every layer (Mistral),
    noise put in before Falcon's rotary embedding: the offline replay's collapses, from the stored q,
    k and score terms, are the model's own."""
    from tests.tiny_families import tiny_model

    model = tiny_model(model_type, seed=1)
    tokens = np.random.default_rng(0).integers(5, 21, size=(8, 12))
    valid = np.ones((8, 12), bool)
    valid[:3, 9:] = False
    ds = extract(tmp_path / "s", adapter_for(model), tokens, valid)
    settings = ReplaySettings(levels=(0.2, 0.5), n_draws=3, seed=5)
    online = online_check(ds, model, settings=settings, batch_size=8)
    assert_agrees_with_offline(online, offline_replay(ds, settings))


@pytest.mark.slow
def test_the_online_check_loads_the_model_in_the_stores_dtype(tmp_path):
    tokens, valid = arithmetic_tokens(4)
    path = save_model(arithmetic_model(), tmp_path / "model")
    loaded = load_source(path, "cpu", model_dtype="bfloat16")
    ds = extract(tmp_path / "s", loaded.adapter, tokens, valid, loaded.describe())
    assert ds.attrs["model"]["dtype"] == "bfloat16"
    online = online_check(ds, path, settings=ReplaySettings(levels=(0.1,), n_draws=1), device="cpu")
    assert online.clean_pred_agreement == 1.0
    with pytest.raises(ModelMismatchError, match="dtype: store 'bfloat16', model 'float32'"):
        online_check(ds, arithmetic_model(), settings=SETTINGS)


@pytest.mark.slow
def test_a_model_that_is_not_the_stores_is_a_clear_error(tmp_path):
    tokens, valid = arithmetic_tokens(4)
    model = arithmetic_model()
    ds = extract(tmp_path / "s", adapter_for(model), tokens, valid)
    with pytest.raises(ModelMismatchError, match="n_layers: store 2, model 3"):
        online_check(ds, arithmetic_model(n_layers=3), settings=SETTINGS)
    # Same architecture, other weights: the weights' checksum in the store's description tells them apart.
    first, second = save_model(model, tmp_path / "a"), save_model(arithmetic_model(seed=1), tmp_path / "b")
    described = extract(tmp_path / "t", adapter_for(model), tokens, valid, load_source(first, "cpu").describe())
    assert online_check(described, first, settings=ReplaySettings(levels=(0.1,), n_draws=1)).offline_mismatches.sum() == 0
    with pytest.raises(ModelMismatchError, match="weights_sha256"):
        online_check(described, second, settings=SETTINGS)


def test_bad_online_options_are_clear_errors(tmp_path):
    model = arithmetic_model()
    ds = extract(tmp_path / "s", adapter_for(model), *arithmetic_tokens(4))
    with pytest.raises(AnalysisError, match=r"holds layers \[0, 1\]"):
        online_check(ds, model, settings=SETTINGS, layers=[2])
    with pytest.raises(ParameterError, match=r"^max_samples=0: expected an integer >= 1 \(a number of samples\)"):
        online_check(ds, model, settings=SETTINGS, max_samples=0)
    with pytest.raises(ParameterError, match=r"^batch_size=2.5: expected an integer >= 1 \(a number of samples\)"):
        online_check(ds, model, settings=SETTINGS, batch_size=2.5)
    with pytest.raises(ReplayError, match=r"lacks \['w_o'\]"):
        online_check(ds.drop_vars("w_o"), model, settings=SETTINGS)
