"""The norm-factor sites: norm_scale, q_norm_scale and k_norm_scale are the factors the model's own
norms multiply their centred inputs by.

For each model, the norm's input is recomputed in float64 from what the store holds (resid_pre; for a
Post-Norm model the previous block's resid_mid and feed-forward; for a QK-norm the stored attn_in
and w_q, w_k), and the stored factor must equal 1/std or 1/RMS of it, and factor * (centred input) *
gain (+ bias), with the model's own gains, must be the norm's stored output (attn_in; q and k, whose
per-head norms rotary embedding keeps). Tolerances are relative to the magnitudes compared.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from orthosphere.extract.adapters import adapter_for
from orthosphere.extract.job import ExtractJob, run_job
from orthosphere.extract.model import ConfigError, load_model
from orthosphere.store import open_store
from tests.test_extract_families import ENCODERS
from tests.test_extract_models import word_tokenizer, write_arithmetic_model, write_text
from tests.tiny_families import tiny_model

RTOL = 1e-5
"""float32 against float64: a few float32 roundings of each value, relative to its magnitude."""


def extract_store(model_dir, task, out, **options):
    """A float32 store with the default sites, loaded in memory."""
    job = ExtractJob(model=str(model_dir), task=task, out=str(out), dtype="float32", batch_size=4, device="cpu", **options)
    run_job(job, progress=False)
    return open_store(str(out)).load()


def hf_store(tmp_path, model_type, **overrides):
    """(store of a tiny model of the family over padded text, the model in float64)."""
    model = tiny_model(model_type, **overrides)
    model.save_pretrained(tmp_path / "model", safe_serialization=True)
    word_tokenizer("bert" if model_type in ENCODERS else "llama").save_pretrained(tmp_path / "model")
    text = write_text(tmp_path / "text.txt")
    store = extract_store(tmp_path / "model", f"text:path={text},max_length=12", tmp_path / "store.zarr")
    return store, copy.deepcopy(model).double()


def norm_entry(store, site):
    return next(norm for norm in store.attrs["model"]["norms"] if norm["site"] == site)


def gain_and_bias(model, entry, layer):
    """The norm's gain (as it enters: weight, 1 + weight, or 1) and bias (0 without), float64."""
    module = model.get_submodule(entry["module"].format(layer=layer))
    weight = module.weight.detach().numpy() if entry["gain"] != "none" else 0.0
    gain = {"weight": weight, "1 + weight": 1.0 + weight, "none": 1.0}[entry["gain"]]
    return gain, module.bias.detach().numpy() if entry["bias"] else 0.0


def reference_factor(x, kind, eps):
    """(1/std or 1/RMS over the last axis, the centred input), float64."""
    centred = x - x.mean(axis=-1, keepdims=True) if kind == "layer" else x
    return 1.0 / np.sqrt((centred**2).mean(axis=-1) + eps), centred


def check_factor(factor, x, entry, gain, bias, output, valid):
    """The stored factor against the float64 reference from x, and the norm rebuilt from it against
    the norm's stored output, on the valid tokens (valid indexes the leading sample, pos axes)."""
    reference, centred = reference_factor(np.asarray(x, np.float64), entry["type"], entry["eps"])
    factor = np.asarray(factor, np.float64)
    np.testing.assert_allclose(factor[valid], reference[valid], rtol=RTOL, atol=0)
    rebuilt = factor[..., None] * centred * gain + bias
    if output is not None:
        error = np.abs(rebuilt - output)[valid]
        assert (error <= RTOL * np.abs(output).max(axis=-1, keepdims=True)[valid]).all(), error.max()
    return rebuilt


def check_norm_scale(store, inputs, model):
    """norm_scale of every layer against the norm that produces attn_in; inputs[layer]: its input
    (None: no norm, the factor NaN)."""
    valid = store["valid"].values
    entry_site = "attn_input" if "attn_input" in [n["site"] for n in store.attrs["model"]["norms"]] else "resid_post"
    for layer in store["layer"].values:
        factor = store["norm_scale"].sel(layer=layer).values
        if inputs[layer] is None:
            assert np.isnan(factor).all()
            continue
        entry = norm_entry(store, entry_site)
        module_layer = layer if entry_site == "attn_input" else layer - 1
        if entry_site == "resid_post" and layer == 0:
            entry = norm_entry(store, "embedding")
        gain, bias = gain_and_bias(model, entry, module_layer)
        check_factor(factor, inputs[layer], entry, gain, bias, store["attn_in"].sel(layer=layer).values, valid)


def check_qk_norm_scale(store, model):
    """q_norm_scale and k_norm_scale against the QK-norm of q_proj(attn_in), k_proj(attn_in); the
    rebuilt q, k have the stored ones' per-head norms (and equal them without rotary embedding)."""
    valid = store["valid"].values
    for name in ("q", "k"):
        entry = norm_entry(store, name)
        for layer in store["layer"].values:
            attn_in = store["attn_in"].sel(layer=layer).values.astype(np.float64)
            w, b = (store[f"{kind}_{name}"].sel(layer=layer).values.astype(np.float64) for kind in ("w", "b"))
            heads = np.einsum("spm,hmd->sphd", attn_in, w) + b  # (sample, pos, head, d_head)
            gain, bias = gain_and_bias(model, entry, layer)
            factor = store[f"{name}_norm_scale"].sel(layer=layer).values
            stored = store[name].sel(layer=layer).values.astype(np.float64)
            if entry["scope"] == "projection":  # one factor over all heads
                assert (factor == factor[..., :1]).all()
                rebuilt = check_factor(factor[..., 0], heads.reshape(*heads.shape[:2], -1), entry, gain, bias, None, valid)
                rebuilt = rebuilt.reshape(heads.shape)
            else:
                rebuilt = check_factor(factor, heads, entry, gain, bias, None, valid)
            if store.attrs["model"]["positions"] != "rotary":
                error = np.abs(rebuilt - stored)[valid]
                assert (error <= RTOL * np.abs(stored).max(axis=-1, keepdims=True)[valid]).all()
            norms, rebuilt_norms = np.linalg.norm(stored, axis=-1), np.linalg.norm(rebuilt, axis=-1)
            np.testing.assert_allclose(norms[valid], rebuilt_norms[valid], rtol=RTOL)


# --- the arithmetic models ------------------------------------------------------------------------

def arithmetic_store(tmp_path, placement, norm_type):
    model_dir = write_arithmetic_model(tmp_path / "model", placement=placement, norm_type=norm_type)
    store = extract_store(model_dir, "arithmetic:split=test,seed=4", tmp_path / "store.zarr", n_samples=7)
    return store, load_model(model_dir).double()


def post_norm_inputs(store, model):
    """What the norm ending block l - 1 reads, rebuilt in float64: resid_mid + ff(resid_mid); None at layer 0."""
    inputs = [None]
    for layer in store["layer"].values[1:]:
        mid = torch.from_numpy(store["resid_mid"].sel(layer=layer - 1).values.astype(np.float64))
        with torch.no_grad():
            inputs.append((mid + model.blocks[layer - 1].ff(mid)).numpy())
    return inputs


@pytest.mark.parametrize("norm_type", ["layer", "rms"])
def test_pre_norm_factor_is_the_attention_input_norms(tmp_path, norm_type):
    store, model = arithmetic_store(tmp_path, "pre", norm_type)
    assert "norm_scale" in store.attrs["sites"] and "q_norm_scale" not in store
    assert store["norm_scale"].attrs["transformer_lens"] == "1 / blocks.{layer}.ln1.hook_scale"
    check_norm_scale(store, store["resid_pre"].values.astype(np.float64).swapaxes(0, 1), model)


@pytest.mark.parametrize("norm_type", ["layer", "rms"])
@pytest.mark.slow
def test_post_norm_factor_is_the_previous_blocks_norm_and_nan_at_layer_zero(tmp_path, norm_type):
    store, model = arithmetic_store(tmp_path, "post", norm_type)
    check_norm_scale(store, post_norm_inputs(store, model), model)


@pytest.mark.parametrize("norm_type", ["layer", "rms"])
@pytest.mark.slow
def test_qkv_norm_factors_are_the_head_norms(tmp_path, norm_type):
    store, model = arithmetic_store(tmp_path, "qkv", norm_type)
    assert "norm_scale" not in store and {"q_norm_scale", "k_norm_scale"} <= set(store.attrs["sites"])
    check_qk_norm_scale(store, model)


@pytest.mark.parametrize("placement,missing", [("none", ["norm_scale", "q_norm_scale"]), ("qkv", ["norm_scale"]),
                                               ("pre", ["q_norm_scale", "k_norm_scale"])])
def test_a_model_without_the_norm_leaves_its_factor_out_and_refuses_it(tmp_path, placement, missing):
    adapter = adapter_for(load_model(write_arithmetic_model(tmp_path / "model", placement=placement)))
    assert not set(missing) & set(adapter.check_sites(None))
    for site in missing:
        with pytest.raises(ConfigError, match=rf"site\(s\) \['{site}'\] cannot be provided by this arithmetic model.*"
                                              r"factors of norms this model does not have.*extract/families.py"):
            adapter.check_sites(["resid_pre", site])


# --- transformers families ------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["gpt2", "llama", "qwen3", "gemma2", "gemma3_text", "phi", "t5"])
@pytest.mark.slow
def test_pre_and_sandwich_norm_factors_of_transformers_families(tmp_path, model_type):
    store, model = hf_store(tmp_path, model_type)
    check_norm_scale(store, store["resid_pre"].values.astype(np.float64).swapaxes(0, 1), model)
    if store.attrs["model"]["qk_norm"]:
        check_qk_norm_scale(store, model)
    else:
        assert "q_norm_scale" not in store and "k_norm_scale" not in store


@pytest.mark.slow
def test_olmo2_has_qk_norm_factors_over_the_projection_and_no_norm_scale(tmp_path):
    store, model = hf_store(tmp_path, "olmo2")
    assert store.attrs["model"]["qk_norm"] == "projection" and "norm_scale" not in store
    check_qk_norm_scale(store, model)


@pytest.mark.slow
def test_bert_norm_factor_is_the_embedding_norm_then_the_previous_blocks(tmp_path):
    store, model = hf_store(tmp_path, "bert")
    embeddings = model.bert.embeddings
    tokens = torch.from_numpy(store["tokens"].values).long()
    with torch.no_grad():
        first = (embeddings.word_embeddings(tokens) + embeddings.position_embeddings.weight[: tokens.shape[1]]
                 + embeddings.token_type_embeddings.weight[0])
        inputs = [first.numpy()]
        for layer in store["layer"].values[1:]:
            block = model.bert.encoder.layer[layer - 1]
            mid = torch.from_numpy(store["resid_mid"].sel(layer=layer - 1).values.astype(np.float64))
            inputs.append((block.output.dense(block.intermediate(mid)) + mid).numpy())
    check_norm_scale(store, inputs, model)


@pytest.mark.slow
def test_opt_post_norm_factor_reads_its_flattened_stream(tmp_path):
    store, model = hf_store(tmp_path, "opt", do_layer_norm_before=False)
    inputs = [None]
    for layer in store["layer"].values[1:]:
        block = model.model.decoder.layers[layer - 1]
        mid = torch.from_numpy(store["resid_mid"].sel(layer=layer - 1).values.astype(np.float64))
        with torch.no_grad():
            inputs.append((mid + block.fc2(block.activation_fn(block.fc1(mid)))).numpy())
    check_norm_scale(store, inputs, model)


def test_an_encoder_without_its_head_reads_layer_zeros_factor_from_its_embedding_norm():
    import transformers

    full = tiny_model("bert")
    base = transformers.BertModel(full.config, add_pooling_layer=False).eval()
    base.load_state_dict(full.bert.state_dict())
    adapter = adapter_for(base)
    tokens = torch.arange(5, 17).reshape(2, 6)
    with torch.no_grad(), adapter.capture(["norm_scale"]) as recording:
        adapter.forward(tokens, torch.ones_like(tokens, dtype=torch.bool))
        factor = recording.take()["norm_scale"][:, 0].numpy()
    embeddings = copy.deepcopy(base.embeddings).double()
    with torch.no_grad():
        summed = (embeddings.word_embeddings(tokens) + embeddings.position_embeddings.weight[:6]
                  + embeddings.token_type_embeddings.weight[0]).numpy()
    reference, _ = reference_factor(summed, "layer", embeddings.LayerNorm.eps)
    np.testing.assert_allclose(factor, reference, rtol=RTOL, atol=0)
