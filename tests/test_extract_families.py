"""The test of record for every supported transformers family, through the store.

For each family a tiny random-weights model (tests/tiny_families.py: sharp attention, sliding
windows shorter than the sequences, soft-capping, ALiBi, QK-norms, parallel blocks ...) is saved,
extracted over padded text of uneven lengths into a float32 store, and compared with transformers'
own eager attention, from the store alone:

- softmax of the stored q . k with the stored score terms equals the eager attention (float64
  reference against the model's float32, tolerance scaling with the logits), and so do the
  orthosphere function's float32 recomputation and the stored pattern; and that attention is
  sharp in every layer;
- resid_post[l] == resid_pre[l + 1], and the stored predictions are the model's;
- the stored maps reproduce v from attn_in, and q, k before rotary and QK-norm (and with OLMo's
  clip_qkv clamp, which the description records, for a clipping OLMo);
- the norm description is right: each described norm, at its site, gives or reads the stored
  sites; and its summary is the family's known placement;
- the block's outputs are exact: attn_out and mlp_out are what the block adds to the residual
  stream, z is the attention-weighted sum of v and, through w_o, attn_out; mlp_in and
  mlp_norm_scale are the MLP's norm's output and factor; every family provides z, attn_out and
  mlp_out, and refuses mlp_in only where it equals another site.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from orthosphere.analyze.attention import ScoreTerms, allowed_keys, store_attention
from orthosphere.errors import ConfigError
from orthosphere.extract.adapters import adapter_for
from orthosphere.extract.families import FAMILIES as DESCRIBED
from orthosphere.extract.families import OUTSIDE_BLOCKS, unsupported
from orthosphere.extract.job import ExtractJob, run_job
from orthosphere.store import open_store
from orthosphere.store.schema import MODEL_KEYS, NORM_SITES
from tests.reference import attention_atol, attention_float64
from tests.test_extract_models import word_tokenizer, write_text
from tests.tiny_families import DBRX_NO_CLIP, FAMILIES, MODERNBERT_HALF_WINDOW, NANOCHAT_HEAD_DIM, ULTRABERT_HALF_WINDOW, WINDOW, family_configs, tiny_model

ALL_SITES = ("resid_pre", "resid_mid", "resid_post", "attn_in", "q", "k", "v", "pattern")
ENCODERS = ("bert", "roberta", "distilbert", "t5", "mt5", "umt5", "xlm-roberta", "camembert", "electra", "mpnet", "modernbert",
            "ernie", "data2vec-text", "roberta-prelayernorm", "xlm-roberta-xl", "esm", "megatron-bert", "rembert", "nomic_bert",
            "gte", "jina_embeddings_v3", "eurobert", "ultrabert", "bert-generation", "esmc")
BLOCK_SITES = ("z", "attn_out", "mlp_in", "mlp_norm_scale", "mlp_out")
"""Stored too, where the family provides them (mlp_in and mlp_norm_scale are refused by some)."""
T5_FAMILIES = ("t5", "mt5", "umt5")
SHARP = 0.9
"""In every layer, the median over (query, head) of the largest attention weight, for valid queries
that may see at least SHARP_KEYS keys (fewer make any attention sharp): attention is sharp."""
SHARP_KEYS = 4

# The families' norm placements (families.md): placement, norm type, QK-norm scope, parallel blocks.
PLACEMENTS = {
    "gpt2": ("pre", "layer", None, False), "llama": ("pre", "rms", None, False),
    "mistral": ("pre", "rms", None, False), "mixtral": ("pre", "rms", None, False),
    "qwen2": ("pre", "rms", None, False), "qwen3": ("pre", "rms", "head", False),
    "olmo": ("pre", "layer", None, False), "olmo2": ("output", "rms", "projection", False),
    "gemma": ("pre", "rms", None, False), "gemma2": ("sandwich", "rms", None, False),
    "gemma3_text": ("sandwich", "rms", "head", False), "phi": ("pre", "layer", "head", True),
    "phi3": ("pre", "rms", None, False), "gpt_neox": ("pre", "layer", None, True),
    "gptj": ("pre", "layer", None, True), "stablelm": ("pre", "layer", "head", False),
    "starcoder2": ("pre", "layer", None, False), "granite": ("pre", "rms", None, False),
    "opt": ("pre", "layer", None, False), "bert": ("post", "layer", None, False),
    "roberta": ("post", "layer", None, False), "distilbert": ("post", "layer", None, False),
    "bloom": ("pre", "layer", None, False), "falcon": ("pre", "layer", None, True),
    "t5": ("pre", "rms", None, False), "mt5": ("pre", "rms", None, False), "umt5": ("pre", "rms", None, False),
    "qwen2_moe": ("pre", "rms", None, False), "qwen3_moe": ("pre", "rms", "head", False),
    "olmoe": ("pre", "rms", "projection", False), "granitemoe": ("pre", "rms", None, False),
    "helium": ("pre", "rms", None, False), "arcee": ("pre", "rms", None, False),
    "ministral": ("pre", "rms", None, False), "seed_oss": ("pre", "rms", None, False),
    "smollm3": ("pre", "rms", None, False), "olmo3": ("output", "rms", "projection", False),
    "exaone4": ("output", "rms", "head", False), "apertus": ("pre", "rms", "head", False),
    "glm4": ("sandwich", "rms", None, False), "nemotron": ("pre", "layer", None, False),
    "cohere": ("pre", "layer", None, True), "cohere2": ("pre", "layer", None, True),
    "xlm-roberta": ("post", "layer", None, False), "camembert": ("post", "layer", None, False),
    "electra": ("post", "layer", None, False), "gpt_oss": ("pre", "rms", None, False),
    "mpnet": ("post", "layer", None, False), "modernbert": ("pre", "layer", None, False),
    "glm": ("pre", "rms", None, False), "ernie4_5": ("pre", "rms", None, False),
    "ernie4_5_moe": ("pre", "rms", None, False), "jais2": ("pre", "layer", None, False),
    "vaultgemma": ("pre", "rms", None, False), "dots1": ("pre", "rms", "head", False),
    "glm4_moe": ("pre", "rms", "head", False), "flex_olmo": ("output", "rms", "projection", False),
    "ernie": ("post", "layer", None, False), "data2vec-text": ("post", "layer", None, False),
    "roberta-prelayernorm": ("pre", "layer", None, False), "xlm-roberta-xl": ("pre", "layer", None, False),
    "gpt_bigcode": ("pre", "layer", None, False),
    "ministral3": ("pre", "rms", None, False), "esm": ("pre", "layer", None, False),
    "solar_open": ("pre", "rms", None, False), "mellum": ("pre", "rms", "head", False),
    "cohere2_moe": ("pre", "layer", None, True), "persimmon": ("pre", "layer", "head", False),
    "biogpt": ("pre", "layer", None, False), "gpt_neo": ("pre", "layer", None, False),
    "phimoe": ("pre", "layer", None, False), "cwm": ("pre", "rms", None, False), "mpt": ("pre", "layer", None, False),
    "codegen": ("pre", "layer", None, True), "modernbert-decoder": ("pre", "layer", None, False),
    "minimax_m2": ("pre", "rms", "projection", False), "internlm3": ("pre", "rms", None, False),
    "exaone": ("pre", "rms", None, False), "dbrx": ("pre", "layer", None, False),
    "megatron-bert": ("pre", "layer", None, False), "rembert": ("post", "layer", None, False),
    "nomic_bert": ("post", "layer", None, False), "gte": ("post", "layer", None, False),
    "jina_embeddings_v3": ("post", "layer", None, False), "eurobert": ("pre", "rms", None, False),
    "ultrabert": ("pre", "rms", None, False), "bert-generation": ("post", "layer", None, False),
    "esmc": ("pre", "layer", "projection", False), "xglm": ("pre", "layer", None, False),
    "openai-gpt": ("post", "layer", None, False), "ctrl": ("pre", "layer", None, False),
    "iquestcoder": ("pre", "rms", None, False), "nanochat": ("pre", "rms", "head", False),
    "hunyuan_v1_dense": ("pre", "rms", "head", False), "hunyuan_v1_moe": ("pre", "rms", "head", False),
    "apertus1p5_text": ("pre", "rms", "head", False), "gemma3": ("sandwich", "rms", "head", False),
    "mistral3": ("pre", "rms", None, False), "llava": ("pre", "rms", None, False), "qwen2_5_vl": ("pre", "rms", None, False),
    "qwen2_vl": ("pre", "rms", None, False), "qwen3_vl": ("pre", "rms", "head", False),
}
# Score terms of the tiny configs: sliding windows per layer, soft-cap, scales that are not 1/sqrt(d_head).
WINDOWS = {"gemma3": [WINDOW, None], "mistral3": [WINDOW, WINDOW], "mistral": [WINDOW, WINDOW], "mixtral": [WINDOW, WINDOW], "phi3": [WINDOW, WINDOW],
           "starcoder2": [WINDOW, WINDOW], "qwen2": [None, WINDOW], "gemma2": [WINDOW, None],
           "gemma3_text": [WINDOW, None], "ministral": [WINDOW, WINDOW], "olmo3": [WINDOW, None],
           "exaone4": [WINDOW, None], "cohere2": [WINDOW, None], "gpt_oss": [WINDOW, None],
           "modernbert": [None, MODERNBERT_HALF_WINDOW + 1], "vaultgemma": [WINDOW, None],
           "ministral3": [WINDOW, WINDOW], "mellum": [WINDOW, None], "cohere2_moe": [WINDOW, None],
           "gpt_neo": [None, WINDOW], "phimoe": [WINDOW, WINDOW],
           "cwm": [WINDOW, None], "modernbert-decoder": [WINDOW, None], "ultrabert": [ULTRABERT_HALF_WINDOW + 1, None]}
GAIN_FREE = ("olmo", "nanochat")
"""Families whose norms have no gain."""
SOFTCAPPED = ("gemma2", "vaultgemma")
SCALES = {"nanochat": [NANOCHAT_HEAD_DIM**-0.5] * 2, "gpt2": [8**-0.5, 8**-0.5 / 2], "granite": [0.3, 0.3], "granitemoe": [0.3, 0.3], "opt": [1.0, 1.0],
          "esm": [1.0, 1.0], "gpt_neo": [1.0, 1.0], "codegen": [0.5, 0.5], "gemma2": [0.25, 0.25],
          **{model_type: [1.0, 1.0] for model_type in T5_FAMILIES}}
BLOOM_SLOPES = [0.25, 0.0625, 0.015625, 0.00390625]


def test_every_family_has_a_tiny_model():
    assert set(FAMILIES) == set(DESCRIBED)


def extracted(model_type: str, folder, model):
    """(model_type, store of `model` over padded text of uneven lengths, loaded in memory, the model
    loaded from the same files with eager attention)."""
    import transformers

    model.save_pretrained(folder / "model", safe_serialization=True)
    word_tokenizer("bert" if model_type in ENCODERS else "llama").save_pretrained(folder / "model")
    text = write_text(folder / "text.txt")
    provided = adapter_for(model).sites
    sites = ALL_SITES + tuple(site for site in BLOCK_SITES if site in provided)
    job = ExtractJob(model=str(folder / "model"), task=f"text:path={text},max_length=12", out=str(folder / "store.zarr"),
                     sites=sites, dtype="float32", batch_size=4, device="cpu")
    run_job(job, progress=False)
    eager = getattr(transformers, family_configs()[model_type][2]).from_pretrained(
        folder / "model", attn_implementation="eager").eval()
    return model_type, open_store(str(folder / "store.zarr")).load(), eager


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(model_type, store, eager model) of the family's tiny model."""
    return extracted(request.param, tmp_path_factory.mktemp(request.param), tiny_model(request.param))


CLIP_QKV = 2.0
"""OLMo's clip_qkv for the clipped variant: below the largest |q|, |k|, |v| entries, so the clamp bites."""


CLIPPED = {"olmo": dict(clip_qkv=CLIP_QKV),
           "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=CLIP_QKV))}
"""The config overrides of the clipped variants: OLMo's clip_qkv, DBRX's in its attention sub-config."""


@pytest.fixture(scope="module", params=list(CLIPPED))
def clipped(request, tmp_path_factory):
    """(model_type, store, eager model) of a tiny OLMo or DBRX that clamps q, k and v to +-CLIP_QKV."""
    model_type = request.param
    return extracted(model_type, tmp_path_factory.mktemp(f"{model_type}-clipped"), tiny_model(model_type, **CLIPPED[model_type]))


def eager_run(model, store):
    tokens = torch.from_numpy(store["tokens"].values).long()
    valid = torch.from_numpy(store["valid"].values).long()
    with torch.no_grad():
        output = model(input_ids=tokens, attention_mask=valid, output_attentions=True)
    logits = output.logits.numpy() if hasattr(output, "logits") else None  # T5's encoder has no head
    return torch.stack(output.attentions, dim=1).double().numpy(), logits


def terms_of(store, layer) -> dict:
    return reference_terms(store.attrs["model"], layer)


def reference_terms(description: dict, layer) -> dict:
    """A layer's score terms from a model description, as attention_float64's keywords."""
    terms = ScoreTerms.of_layer(description, layer)
    return {"attn_scale": terms.scale, "causal": terms.causal, "sliding_window": terms.sliding_window,
            "softcap": terms.softcap, "alibi_slopes": terms.alibi_slopes, "relative_bias": terms.relative_bias,
            "sink_logits": terms.sink_logits}


def test_stored_q_k_with_the_score_terms_are_the_models_eager_attention(family):
    assert_exact(*family)


def assert_exact(model_type, store, eager):
    """softmax of the stored q . k with the stored score terms (float64), the orthosphere function's
    float32 recomputation and the stored pattern all equal the model's eager attention, on padded
    batches of uneven lengths."""
    pattern, _ = eager_run(eager, store)
    valid = store["valid"].values
    assert not valid.all() and len(set(valid.sum(axis=1))) > 2  # padded batches of uneven lengths
    queries = valid[:, None, :, None]
    recomputed = store_attention(store.drop_vars("pattern").chunk({"sample": 4})).values
    for layer in range(store.sizes["layer"]):
        q, k = store["q"].values[:, layer], store["k"].values[:, layer]
        reference, largest = attention_float64(q, k, valid, **terms_of(store, layer))
        atol = attention_atol(largest)
        for found in (pattern[:, layer], recomputed[:, layer], store["pattern"].values[:, layer]):
            np.testing.assert_allclose(np.where(queries, found, 0), np.where(queries, reference, 0), rtol=0, atol=atol,
                                       err_msg=f"{model_type}, layer {layer}")


def test_attention_is_sharp_in_every_layer(family):
    model_type, store, _ = family
    valid = store["valid"].values
    for layer in range(store.sizes["layer"]):
        reference, _ = attention_float64(store["q"].values[:, layer], store["k"].values[:, layer], valid,
                                         **terms_of(store, layer))
        seeing_many = valid & (allowed_keys(valid, ScoreTerms.of_layer(store.attrs["model"], layer)).sum(-1) >= SHARP_KEYS)
        sharpness = np.median(reference.max(axis=-1).transpose(0, 2, 1)[seeing_many])  # over those queries and heads
        assert sharpness >= SHARP, f"{model_type}: attention in layer {layer} is not sharp (median max {sharpness:.2f})"


def test_sliding_windows_are_shorter_than_the_sequences(family):
    model_type, store, _ = family
    windows = store.attrs["model"]["score"]["sliding_window"]
    if any(windows):
        lengths = store["valid"].values.sum(axis=1)
        assert (lengths > WINDOW).sum() >= 2


def test_score_terms_are_the_configs(family):
    model_type, store, _ = family
    score = store.attrs["model"]["score"]
    assert score["sliding_window"] == WINDOWS.get(model_type, [None, None])
    assert score["softcap"] == ([20.0, 20.0] if model_type in SOFTCAPPED else [None, None])
    np.testing.assert_allclose(score["scale"], SCALES.get(model_type, [8**-0.5] * 2), rtol=1e-12)
    assert score["alibi_slopes"] == ([BLOOM_SLOPES] * 2 if model_type in ("bloom", "mpt") else None)  # 4 heads: the same slopes


def test_residual_stream_is_one_stream_and_predictions_are_the_models(family):
    model_type, store, eager = family
    resid_pre, resid_post = store["resid_pre"].values, store["resid_post"].values
    np.testing.assert_array_equal(resid_post[:, :-1], resid_pre[:, 1:])
    _, logits = eager_run(eager, store)
    valid = store["valid"].values
    if logits is None:
        assert "pred" not in store and store.attrs["model"]["lm_head"] is False
        return
    assert store.attrs["model"]["lm_head"] is True
    np.testing.assert_array_equal(store["pred"].values[valid], logits.argmax(-1)[valid])


def _close(found, expected, scale_of=None):
    """float32 model values against a float64 reconstruction, to 1e-5 of their magnitude."""
    scale = max(1.0, float(np.abs(expected if scale_of is None else scale_of).max()))
    np.testing.assert_allclose(np.asarray(found, np.float64), np.asarray(expected, np.float64), rtol=0, atol=1e-5 * scale)


def _mapped(store, name, layer):
    """attn_in @ w[h] + b[h] in float64: (sample, pos, head, d_head), clamped to +-clip_qkv where the
    description has it (OLMo clamps the projections before anything else)."""
    attn_in = store["attn_in"].values[:, layer].astype(np.float64)
    mapped = np.einsum("spm,hmd->sphd", attn_in, store[f"w_{name}"].values[layer]) + store[f"b_{name}"].values[layer]
    clip = store.attrs["model"].get("clip_qkv")
    return mapped if clip is None else np.clip(mapped, -clip, clip)


def _norm_module(model, store, site, layer):
    entry = next((n for n in store.attrs["model"]["norms"] if n["site"] == site), None)
    return None if entry is None else (entry, model.get_submodule(entry["module"].format(layer=layer)))


def _apply_head_norm(norm, x: np.ndarray) -> np.ndarray:
    """A q/k norm applied as the model does: per head on (batch, head, pos, d_head), or over the projection."""
    entry, module = norm
    tensor = torch.from_numpy(x.astype(np.float32))
    with torch.no_grad():
        if entry["scope"] == "projection":
            return module(tensor.flatten(2)).view(tensor.shape).numpy()
        return module(tensor.transpose(1, 2)).transpose(1, 2).numpy()


def assert_head_site_from_the_maps(store, eager, name, layer):
    """The stored q, k or v of `layer` is its weight map applied to attn_in, followed by the site's
    described norm; q and k then turn by rotary embedding (identity at position 0, norms kept but for
    the attention factor of a YaRN rope, GPT-OSS's, on both). A norm after rotary embedding (HunYuan)
    turns its input before its gain: the norms then compare with the gain divided out."""
    expected = _mapped(store, name, layer)
    norm = _norm_module(eager, store, name, layer)
    if norm is not None:
        expected = _apply_head_norm(norm, expected)
    if name != "v":
        expected = expected * getattr(getattr(eager.base_model, "rotary_emb", None), "attention_scaling", 1.0)
    stored = store[name].values[:, layer]
    if name != "v" and store.attrs["model"]["positions"] == "rotary":
        _close(stored[:, 0], expected[:, 0])
        gain = _gain_after_rotary(norm, expected.shape[-2:])
        _close(np.linalg.norm(stored / gain, axis=-1), np.linalg.norm(expected / gain, axis=-1))
    else:
        _close(stored, expected)


def _gain_after_rotary(norm, shape) -> np.ndarray | float:
    """The gain (head, d_head) of a q or k norm that acts after rotary embedding; 1 for any other."""
    if norm is None or not norm[0].get("after_rotary") or norm[0]["gain"] == "none":
        return 1.0
    weight = norm[1].weight.detach().double().numpy()
    gain = 1 + weight if norm[0]["gain"] == "1 + weight" else weight
    return np.broadcast_to(gain.reshape(shape) if gain.size == np.prod(shape) else gain, shape)


def test_weight_maps_reproduce_q_k_v_before_rotary_and_qk_norm(family):
    model_type, store, eager = family
    clip = store.attrs["model"].get("clip_qkv")
    assert clip is None or clip == DBRX_NO_CLIP  # the tiny configs do not clip (DBRX's clamps far out): the maps are linear
    for layer in range(store.sizes["layer"]):
        for name in ("q", "k", "v"):
            assert_head_site_from_the_maps(store, eager, name, layer)


@pytest.fixture(scope="module")
def multi_query_bigcode(tmp_path_factory):
    """(model_type, store, eager model) of a tiny GPTBigCode with one key/value head (StarCoder's layout)."""
    return extracted("gpt_bigcode", tmp_path_factory.mktemp("bigcode-mq"), tiny_model("gpt_bigcode", multi_query=True))


def test_a_multi_query_gpt_bigcode_splits_its_fused_projection_and_stays_exact(multi_query_bigcode):
    """multi_query fuses [all q | k | v] with one key/value head (the tiny model of the family has one
    per head, [q_h | k_h | v_h]): both read exactly."""
    model_type, store, eager = multi_query_bigcode
    assert store.attrs["model"]["n_kv_heads"] == 1 and store.attrs["model"]["multi_query"] is True
    assert store.sizes["kv_head"] == 1
    assert_exact(*multi_query_bigcode)
    for layer in range(store.sizes["layer"]):
        for name in ("q", "k", "v"):
            assert_head_site_from_the_maps(store, eager, name, layer)


@pytest.mark.parametrize("n_heads", [4, 6, 12])
def test_mpt_slopes_are_its_alibi_bias(n_heads):
    """MPT's bias is slope * (key position - last position): the described slopes give it exactly, also
    for head counts that are not a power of two (MPT interleaves two sets of slopes)."""
    import transformers
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    from orthosphere.extract.families import _mpt_slopes

    config = transformers.MptConfig(d_model=8 * n_heads, n_heads=n_heads)
    slopes = np.array(_mpt_slopes(config, n_heads))
    bias = build_mpt_alibi_tensor(n_heads, 7, config.attn_config.alibi_bias_max)[:, 0, :].double().numpy()
    expected = slopes[:, None] * (np.arange(7) - 6)  # float64; MPT's float32 product rounds it (2^-0.5 slopes at 12 heads)
    np.testing.assert_allclose(bias, expected, rtol=2 * np.finfo(np.float32).eps, atol=0)
    assert len(set(slopes)) == n_heads


def test_a_clipping_model_says_so_and_stays_exact(clipped):
    """clip_qkv clamps q, k, v after the projections: the description records it (DBRX's from its attention
    sub-config), the weight maps reproduce the stored sites only with the clamp, and attention stays exact."""
    model_type, store, eager = clipped
    assert store.attrs["model"]["clip_qkv"] == CLIP_QKV
    assert np.abs(store["q"].values[:, :, 0]).max() == pytest.approx(CLIP_QKV)  # rotary is the identity at position 0
    unclipped = np.einsum("spm,hmd->sphd", store["attn_in"].values[:, 0].astype(np.float64), store["w_q"].values[0])
    assert np.abs(unclipped).max() > 2 * CLIP_QKV  # the clamp bites
    for layer in range(store.sizes["layer"]):
        for name in ("q", "k", "v"):
            assert_head_site_from_the_maps(store, eager, name, layer)
    assert_exact(model_type, store, eager)


RECORDED_SITES = ("embedding", "mlp_input", "mlp_output", "resid_post", "final")
"""Norm sites whose input or output is no stored site: the test records them in the model's own pass."""


def recorded_norms(model, store) -> dict:
    """(site, layer) -> (input, output) in float32 of the described norm modules at RECORDED_SITES in
    one eager pass over the store's tokens (layer None for the embedding and final norms), as
    (sample, pos, d_model) (OPT flattens sample and pos around its MLP)."""
    records, hooks = {}, []
    blocks = range(store.sizes["layer"])
    shape = store["resid_pre"].shape[:1] + store["resid_pre"].shape[2:]
    for entry in (norm for norm in store.attrs["model"]["norms"] if norm["site"] in RECORDED_SITES):
        for layer in [None] if entry["site"] in OUTSIDE_BLOCKS else blocks:
            module = model.get_submodule(entry["module"].format(layer=layer))
            hooks.append(module.register_forward_hook(
                lambda _m, inputs, output, key=(entry["site"], layer): _record(records, key, inputs[0], output, shape)))
    with torch.no_grad():
        model(input_ids=torch.from_numpy(store["tokens"].values).long(),
              attention_mask=torch.from_numpy(store["valid"].values).long())
    for hook in hooks:
        hook.remove()
    return records


def _record(records: dict, key, norm_input, output, shape) -> None:
    """Keep a norm's call: the first for the embedding norm, the last for the others (NanoChat's one module
    is both its embedding and its final norm)."""
    if key[0] != "embedding" or key not in records:
        records[key] = (norm_input.numpy().reshape(shape), output.numpy().reshape(shape))


def test_every_described_norm_gives_the_stored_sites(family):
    """Each entry of the norm description, at its site: applied to the stored stream it reads, its
    module gives the stored stream it writes (attn_input -> attn_in, attn_output and resid_mid ->
    resid_mid; q/k/v -> the stored q, k, v from the weight maps, which
    test_weight_maps_reproduce_q_k_v_before_rotary_and_qk_norm checks for the same family and every
    layer, so they count as checked here); where that stream is not stored, the module, recorded in
    the model's own pass, reads the stored stream the description says (mlp_input: resid_mid, or
    resid_pre in parallel blocks; final: the last resid_post) or writes it (embedding: resid_pre of
    layer 0; mlp_output: resid_post - resid_mid; resid_post)."""
    model_type, store, eager = family
    description = store.attrs["model"]
    sites = {norm["site"] for norm in description["norms"]}
    assert sites <= set(NORM_SITES)
    records = recorded_norms(eager, store)
    valid = store["valid"].values
    stream = {name: store[name].values for name in ("resid_pre", "resid_mid", "resid_post")}
    group = description["n_heads"] // description["n_kv_heads"]
    checked = set()
    for layer in range(store.sizes["layer"]):
        resid_pre, resid_mid, resid_post = (stream[name][:, layer] for name in ("resid_pre", "resid_mid", "resid_post"))
        norm_in = _norm_module(eager, store, "attn_input", layer)
        _close(store["attn_in"].values[:, layer], resid_pre if norm_in is None else _apply(norm_in[1], resid_pre))
        v = np.repeat(store["v"].values[:, layer].astype(np.float64), group, axis=2)
        z = np.einsum("shqk,skhd->sqhd", store["pattern"].values[:, layer].astype(np.float64), v)
        attention_out = np.einsum("sqhd,hdm->sqm", z, store["w_o"].values[layer]) + store["b_o"].values[layer]
        norm_out = _norm_module(eager, store, "attn_output", layer)
        if norm_out is not None:
            attention_out = _apply(norm_out[1], attention_out)
        norm_mid = _norm_module(eager, store, "resid_mid", layer)
        expected_mid = resid_pre + attention_out if norm_mid is None else _apply(norm_mid[1], resid_pre + attention_out)
        _close(resid_mid, expected_mid, scale_of=resid_pre)
        checked |= {"attn_input", "attn_output", "resid_mid"}
        if "mlp_input" in sites:
            _close(records["mlp_input", layer][0][valid], (resid_pre if description["parallel"] else resid_mid)[valid])
            checked.add("mlp_input")
        if "mlp_output" in sites:
            _close(records["mlp_output", layer][1][valid], (resid_post - resid_mid)[valid], scale_of=resid_post[valid])
            checked.add("mlp_output")
        if "resid_post" in sites:
            _close(records["resid_post", layer][1][valid], resid_post[valid])
            checked.add("resid_post")
    checked |= sites & {"q", "k", "v"}  # checked in every layer by the weight-map test (see the docstring)
    if "embedding" in sites:
        _close(records["embedding", None][1][valid], stream["resid_pre"][:, 0][valid])
        checked.add("embedding")
    if "final" in sites:
        _close(records["final", None][0][valid], stream["resid_post"][:, -1][valid])
        checked.add("final")
    assert sites <= checked, f"{model_type}: norms at {sorted(sites - checked)} were not checked"


def _apply(module, x):
    with torch.no_grad():
        return module(torch.from_numpy(np.asarray(x, np.float32))).numpy()


def test_norm_description_is_the_familys_placement(family):
    model_type, store, _ = family
    description = store.attrs["model"]
    found = (description["norm_placement"], description["norm_type"], description["qk_norm"], description["parallel"])
    assert found == PLACEMENTS[model_type]
    assert description["v_norm"] is None and description["causal"] is (model_type not in ENCODERS)
    assert set(description) <= set(MODEL_KEYS) | {key.rpartition(".")[2] for key in DESCRIBED[model_type].extra_config}
    gains = {norm["gain"] for norm in description["norms"]}
    assert gains == ({"none"} if model_type in GAIN_FREE else {DESCRIBED[model_type].norm_gain})


@pytest.mark.parametrize("model_type", FAMILIES)
def test_edit_qkv_changes_the_attention_as_it_enters_the_score(model_type):
    adapter = adapter_for(tiny_model(model_type, seed=2))
    tokens = torch.tensor([[4, 5, 7, 6, 9, 8, 10, 11], [4, 6, 8, 6, 5, 12, 13, 7]])
    valid = torch.ones_like(tokens, dtype=torch.bool)
    with torch.no_grad(), adapter.capture(["q", "k", "v", "pattern"]) as recording:
        adapter.forward(tokens, valid)
        plain = recording.take()
        with adapter.edit_qkv(lambda layer, q, k, v: (q * 3.0, k, v * 2.0) if layer == 1 else (q, k, v)):
            adapter.forward(tokens, valid)
            edited = recording.take()
        adapter.forward(tokens, valid)
        after = recording.take()
    torch.testing.assert_close(edited["q"][:, 1], 3.0 * plain["q"][:, 1])
    torch.testing.assert_close(edited["v"][:, 1], 2.0 * plain["v"][:, 1])
    torch.testing.assert_close(edited["q"][:, 0], plain["q"][:, 0])
    torch.testing.assert_close(after["q"], plain["q"])  # the edit ends with its block
    terms = ScoreTerms.of_layer(adapter.describe(), 1)
    expected, largest = attention_float64(edited["q"][:, 1].numpy(), plain["k"][:, 1].numpy(), valid.numpy(),
                                          attn_scale=terms.scale, causal=terms.causal, sliding_window=terms.sliding_window,
                                          softcap=terms.softcap, alibi_slopes=terms.alibi_slopes,
                                          relative_bias=terms.relative_bias, sink_logits=terms.sink_logits)
    np.testing.assert_allclose(edited["pattern"][:, 1].numpy(), expected, rtol=0, atol=attention_atol(largest))


def _falcon_split(attention, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Falcon's own split of a fused projection (batch, seq, out) into q, k, v (batch, seq, heads, head_dim): its
    ``_split_heads`` where transformers has one, else what its forward hands the attention function (transformers
    5.25 splits inline), the projection replaced by the identity so that the forward splits `fused` itself."""
    if hasattr(attention, "_split_heads"):
        return attention._split_heads(fused)
    from unittest import mock

    from transformers.models.falcon import modeling_falcon

    seen = {}

    def recording(module, query, key, value, *args, **kwargs):
        seen.update(q=query.transpose(1, 2), k=key.transpose(1, 2), v=value.transpose(1, 2))
        return torch.zeros(*query.shape[:1], query.shape[2], query.shape[1], query.shape[3]), None

    attention.query_key_value = torch.nn.Identity()
    with mock.patch.object(modeling_falcon, "eager_attention_forward", recording):
        attention(fused, None)
    return seen["q"], seen["k"], seen["v"]


@pytest.mark.parametrize("variant", [dict(new_decoder_architecture=True, num_kv_heads=2), dict(multi_query=True),
                                     dict(multi_query=False)])
def test_grouped_layout_splits_a_fused_projection_as_falcon_does(variant):
    """[q of the group's heads | k | v] per key/value group: Falcon's three layouts (grouped, multi-query,
    per head), against Falcon's own split."""
    import transformers

    from orthosphere.extract.families import split_heads_rows

    config = transformers.FalconConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, alibi=True, **variant)
    attention = transformers.models.falcon.modeling_falcon.FalconAttention(config, layer_idx=0)
    fused = torch.randn(2, 5, attention.query_key_value.out_features)
    q, k, v = _falcon_split(attention, fused)
    n_kv = attention.num_kv_heads
    rows = split_heads_rows("grouped", 4, n_kv, 8)
    torch.testing.assert_close(fused[..., torch.as_tensor(rows["q"])], q, rtol=0, atol=0)
    group = 4 // n_kv
    for name, value in (("k", k), ("v", v)):  # Falcon's own split repeats them for the new architecture
        expected = value if value.shape[2] == n_kv else value[:, :, ::group]
        torch.testing.assert_close(fused[..., torch.as_tensor(rows[name])], expected, rtol=0, atol=0)


@pytest.mark.parametrize("n_heads", [4, 8, 16])
def test_codegen_layout_splits_a_fused_projection_as_codegen_does(n_heads):
    """[q | v | k] of consecutive heads in each of CodeGen's 4 model-parallel shards, against its own split."""
    from orthosphere.extract.families import split_heads_rows

    d_head = 8
    fused = torch.randn(2, 5, 3 * n_heads * d_head)
    query, value, key = fused.view(2, 5, 4, -1).split(n_heads * d_head // 4, dim=-1)  # CodeGenAttention.forward's split
    rows = split_heads_rows("codegen", n_heads, n_heads, d_head)
    for name, expected in (("q", query), ("k", key), ("v", value)):
        torch.testing.assert_close(fused[..., torch.as_tensor(rows[name])], expected.reshape(2, 5, n_heads, d_head), rtol=0, atol=0)


def test_error_messages_name_files_that_exist():
    """The messages that point at the family descriptions name the file by its path in the repository."""
    root = Path(__file__).resolve().parents[1]
    named = re.findall(r"[\w/]+\.py", unsupported("model 'x'"))
    capture_source = (root / "extract" / "adapters" / "base.py").read_text()
    named += re.findall(r'"([\w/]+\.py) \(module', capture_source)
    assert named and all((root / path).is_file() for path in named), named


@pytest.mark.parametrize("model_type, reason", [("deberta-v2", "content-to-position"), ("deberta", "content-to-position"),
                                                ("jetmoe", "attention experts"), ("xlnet", "two-stream"),
                                                ("diffllama", "differential attention"), ("deepseek_v3", "latent attention"),
                                                ("mamba", "no attention"), ("jamba", "state-space")])
def test_families_whose_score_the_store_cannot_describe_are_refused_with_the_reason(model_type, reason):
    import transformers

    from orthosphere.errors import UnsupportedModelError
    from orthosphere.extract.families import REFUSED, family_for

    assert set(REFUSED) <= set(transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES)  # each a real model_type
    with pytest.raises(UnsupportedModelError, match=rf"model_type '{model_type}' is not supported: .*{reason}"):
        family_for(model_type)


def test_gpt_oss_sinks_are_described_and_take_their_share_of_the_attention():
    """The description's sink logits are the model's, and the attention without them is not the model's:
    the score term is needed (and test_stored_q_k_with_the_score_terms_are_the_models_eager_attention shows
    it suffices)."""
    model = tiny_model("gpt_oss")
    adapter = adapter_for(model)
    sinks = adapter.describe()["score"]["sink_logits"]
    for layer in range(2):
        assert sinks[layer] == model.model.layers[layer].self_attn.sinks.tolist()
    tokens = torch.tensor([[4, 5, 7, 6, 9, 8, 10, 11, 12, 5]])
    valid = torch.ones_like(tokens, dtype=torch.bool)
    with torch.no_grad(), adapter.capture(["q", "k", "pattern"]) as recording:
        adapter.forward(tokens, valid)
        captured = recording.take()
    terms = reference_terms(adapter.describe(), 0)
    without = {**terms, "sink_logits": None}
    q, k = captured["q"][:, 0].numpy(), captured["k"][:, 0].numpy()
    with_sinks, _ = attention_float64(q, k, valid.numpy(), **terms)
    plain, _ = attention_float64(q, k, valid.numpy(), **without)
    pattern = captured["pattern"][:, 0].double().numpy()
    assert np.abs(pattern - plain).max() > 0.1
    np.testing.assert_allclose(pattern, with_sinks, rtol=0, atol=1e-4)


def test_a_gpt_oss_whose_sinks_are_not_finite_is_refused_naming_the_layer():
    from orthosphere.errors import UnsupportedModelError

    model = tiny_model("gpt_oss")
    with torch.no_grad():
        model.model.layers[1].self_attn.sinks[2] = float("nan")
    with pytest.raises(UnsupportedModelError, match=r"layer 1 of this gpt_oss model .*self_attn.sinks.*one finite logit per head"):
        adapter_for(model)


@pytest.mark.parametrize("sinks", [[[0.0] * 4], [[0.0] * 3, [0.0] * 3], [[0.0, 1.0, float("inf"), 2.0]] * 2, "sinks"],
                         ids=["one-layer", "three-heads", "not-finite", "not-numbers"])
def test_malformed_sink_logits_are_refused(sinks):
    from orthosphere.store.errors import StoreError
    from orthosphere.store.schema import check_model

    score = {"scale": [0.5, 0.5], "sliding_window": [None, None], "softcap": [None, None], "alibi_slopes": None,
             "sink_logits": sinks}
    model = {"n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 4, "d_head": 8, "score": score}
    with pytest.raises(StoreError, match=r"score.sink_logits=.*expected per layer \(2\) one finite sink logit per head \(4\)"):
        check_model(model)


@pytest.mark.parametrize("model_type, change, term", [
    ("gpt_oss", lambda model: model.model.layers[1].self_attn.sinks.add_(1.0), "sink_logits"),
    ("mpnet", lambda model: model.mpnet.encoder.relative_attention_bias.weight.add_(1.0), "relative_bias"),
])
def test_a_score_term_that_no_longer_matches_the_description_is_refused(model_type, change, term):
    """The description is read once; a forward pass whose attention is called with other sink logits or
    another relative position bias (weights changed since) is refused, not recorded."""
    from orthosphere.errors import UnsupportedModelError

    model = tiny_model(model_type)
    adapter = adapter_for(model)
    with torch.no_grad():
        change(model)
    tokens = torch.tensor([[4, 5, 7, 6, 9, 8]])
    with torch.no_grad(), adapter.capture(["q"]), pytest.raises(UnsupportedModelError, match=rf"attends with .*'{term}'"):
        adapter.forward(tokens, torch.ones_like(tokens, dtype=torch.bool))


def test_a_mixture_of_experts_checkpoint_lacking_experts_is_refused(tmp_path):
    """A Qwen2-MoE directory without one expert's tensor (stored one per expert, fused on loading) would run
    with a random expert: refused, naming the fused tensor."""
    from safetensors.torch import load_file, save_file

    from orthosphere.extract.model import ConfigError
    from orthosphere.extract.sources import load_source

    directory = tmp_path / "qwen2_moe"
    tiny_model("qwen2_moe").save_pretrained(directory, safe_serialization=True)
    weights = load_file(directory / "model.safetensors")
    del weights["model.layers.1.mlp.experts.0.down_proj.weight"]
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"tensor model.layers.1.mlp.experts.down_proj has the shape \(3, 32, 16\) "
                                          r"there but Qwen2MoeForCausalLM expects \(4, 32, 16\).*lacking an expert"):
        load_source(directory, device="cpu")


def test_a_family_read_by_another_familys_class_keeps_its_own_config_names(tmp_path):
    """EXAONE's checkpoints name their sizes as its config class does (num_layers, layer_norm_epsilon) and are read
    by Llama's model class: loaded through the checkpoint's own config class, the model has the file's layers and
    epsilon, not Llama's defaults."""
    import json

    from orthosphere.extract.sources import load_source

    directory = tmp_path / "exaone"
    tiny_model("exaone", rms_norm_eps=1e-3).save_pretrained(directory, safe_serialization=True)
    config = json.loads((directory / "config.json").read_text())
    for canonical, own in (("num_hidden_layers", "num_layers"), ("rms_norm_eps", "layer_norm_epsilon"),
                           ("hidden_act", "activation_function")):
        config[own] = config.pop(canonical)
    (directory / "config.json").write_text(json.dumps(config))
    model = load_source(directory, device="cpu").adapter.model
    assert type(model).__name__ == "LlamaForCausalLM" and len(model.model.layers) == 2
    assert model.model.layers[0].input_layernorm.variance_epsilon == 1e-3


def test_a_multimodal_model_with_another_language_model_is_refused_naming_it():
    """Mistral 3 is read as its Mistral language model: one with a Llama language model is refused, naming both."""
    from orthosphere.errors import UnsupportedModelError

    model = tiny_model("mistral3", text_config=family_configs()["mistral3"][1]["text_config"] | dict(model_type="llama"))
    with pytest.raises(UnsupportedModelError, match="mistral3 whose language model is 'llama': orthosphere reads mistral3 "
                                                    "with a 'mistral' language model"):
        adapter_for(model)


def test_gpt_sw3_is_read_as_gpt2(tmp_path):
    """GPT-SW3's checkpoints are GPT-2 models whose config says model_type "gpt-sw3": read by GPT-2's family,
    exactly as a GPT-2 checkpoint."""
    import json

    from orthosphere.extract.sources import load_source

    directory = tmp_path / "gpt-sw3"
    tiny_model("gpt2").save_pretrained(directory, safe_serialization=True)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"model_type": "gpt-sw3"}))
    loaded = load_source(directory, device="cpu")
    assert type(loaded.adapter.model).__name__ == "GPT2LMHeadModel" and loaded.adapter.spec.model_type == "gpt2"
    assert loaded.describe()["norm_placement"] == "pre" and loaded.describe()["n_layers"] == 2


MLP_IN_REFUSED = {"olmo2": "resid_mid", "phi": "attn_in", "gptj": "attn_in", "bert": "resid_mid", "roberta": "resid_mid",
                  "distilbert": "resid_mid", "xlm-roberta": "resid_mid", "camembert": "resid_mid", "electra": "resid_mid",
                  "mpnet": "resid_mid", "olmo3": "resid_mid", "exaone4": "resid_mid", "cohere": "attn_in", "cohere2": "attn_in",
                  "flex_olmo": "resid_mid", "ernie": "resid_mid", "data2vec-text": "resid_mid",
                  "cohere2_moe": "attn_in", "codegen": "attn_in", "rembert": "resid_mid", "nomic_bert": "resid_mid",
                  "gte": "resid_mid", "jina_embeddings_v3": "resid_mid", "bert-generation": "resid_mid",
                  "openai-gpt": "resid_mid"}
"""Families whose MLP input is another site: the MLP reads no norm of its own (OLMo 2), the attention's
input norm (parallel blocks) or the Post-Norm's resid_mid."""


def test_every_family_provides_the_block_outputs_and_refuses_mlp_in_only_where_it_is_another_site(family):
    model_type, store, _ = family
    assert {"z", "attn_out", "mlp_out"} <= set(store.attrs["sites"])
    assert ("mlp_in" in store.attrs["sites"]) is (model_type not in MLP_IN_REFUSED)
    for site in BLOCK_SITES:
        if site in store.attrs["sites"]:
            assert store[site].attrs["transformer_lens"].startswith(("blocks.", "1 / blocks."))


def test_block_outputs_are_what_the_block_adds_to_the_residual(family):
    """attn_out = resid_mid - resid_pre and mlp_out = resid_post - resid_mid (Pre-Norm, sandwich and
    output-norm families after their output norms, parallel blocks); in Post-Norm ones resid_mid =
    LN(resid_pre + attn_out) and resid_post = LN(resid_mid + mlp_out). z is pattern . v, and z @ w_o
    + b_o is attn_out before any output norm."""
    model_type, store, eager = family
    valid = store["valid"].values
    group = store.attrs["model"]["n_heads"] // store.attrs["model"]["n_kv_heads"]
    for layer in range(store.sizes["layer"]):
        pre, mid, post, attn_out, mlp_out = (store[name].values[:, layer][valid].astype(np.float64)
                                             for name in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"))
        for before, after, added, norm_site in ((pre, mid, attn_out, "resid_mid"), (mid, post, mlp_out, "resid_post")):
            norm = _norm_module(eager, store, norm_site, layer)
            if norm is None:
                _close(added, after - before, scale_of=before)
            else:
                _close(after, _apply(norm[1], before + added))
        v = np.repeat(store["v"].values[:, layer].astype(np.float64), group, axis=2)
        z = np.einsum("shqk,skhd->sqhd", store["pattern"].values[:, layer].astype(np.float64), v)
        _close(store["z"].values[:, layer][valid], z[valid])
        projected = np.einsum("sqhd,hdm->sqm", store["z"].values[:, layer].astype(np.float64),
                              store["w_o"].values[layer]) + store["b_o"].values[layer]
        norm_out = _norm_module(eager, store, "attn_output", layer)
        if norm_out is not None:
            projected = _apply(norm_out[1], projected)
        _close(attn_out, projected[valid], scale_of=attn_out)


def test_mlp_input_and_its_norm_factor_are_the_mlps_norms(family):
    """mlp_in is the MLP's norm applied to the stream it reads (resid_mid, or resid_pre in parallel
    blocks); mlp_norm_scale is that norm's factor 1 / sqrt(mean((x - m)^2) + eps) of its input (in
    Post-Norm models the norm giving resid_mid, whose input is resid_pre + attn_out)."""
    model_type, store, eager = family
    if "mlp_norm_scale" not in store.attrs["sites"]:
        return
    valid = store["valid"].values
    description = store.attrs["model"]
    post_norm = "mlp_in" not in store.attrs["sites"]
    for layer in range(store.sizes["layer"]):
        if post_norm:
            entry, _ = _norm_module(eager, store, "resid_mid", layer)
            read = store["resid_pre"].values[:, layer] + store["attn_out"].values[:, layer].astype(np.float64)
        else:
            entry, module = _norm_module(eager, store, "mlp_input", layer)
            read = store["resid_pre" if description["parallel"] else "resid_mid"].values[:, layer]
            _close(store["mlp_in"].values[:, layer][valid], _apply(module, read)[valid])
        x = np.asarray(read, np.float64)[valid]
        if entry["type"] == "layer":
            x = x - x.mean(axis=-1, keepdims=True)
        factor = 1 / np.sqrt((x**2).mean(axis=-1) + entry["eps"])
        np.testing.assert_allclose(store["mlp_norm_scale"].values[:, layer][valid], factor, rtol=1e-5)


@pytest.mark.parametrize(("model_type", "site", "named"), [("phi", "mlp_in", "equals attn_in"),
                                                          ("bert", "mlp_in", "equals resid_mid"),
                                                          ("gptj", "mlp_norm_scale", "equals norm_scale")])
def test_a_site_the_family_does_not_have_is_refused_with_the_reason(model_type, site, named):
    adapter = adapter_for(tiny_model(model_type))
    with pytest.raises(ConfigError, match=rf"\['{site}'\] cannot be provided by this {model_type} model.*{site} {named}"):
        adapter.check_sites(["resid_pre", site])


def test_notebook_views_are_the_models_attention(family):
    """ds.ortho.pattern and ds.ortho.attn_scores, recomputed from the stored q, k with the score terms
    (the stored pattern and z dropped, the store chunked along sample), for every head and for chosen
    ones, are the model's own eager attention; ds.ortho.z recomputed from them and v is the stored z."""
    model_type, store, eager = family
    pattern, _ = eager_run(eager, store)
    lazy = store.drop_vars(["pattern", "z"]).chunk({"sample": 4})
    queries = store["valid"].values[:, None, :, None]
    chosen = [1, 2]  # heads of two key/value heads in grouped-query families
    for layer in range(store.sizes["layer"]):
        _, largest = attention_float64(store["q"].values[:, layer], store["k"].values[:, layer], store["valid"].values,
                                       **terms_of(store, layer))
        atol = 2 * attention_atol(largest)  # the view and the model each within attention_atol of float64
        every = lazy.ortho.pattern(layer=layer)
        assert every.chunks[0] == lazy["q"].chunks[0] and every.attrs["transformer_lens"] == f"blocks.{layer}.attn.hook_pattern"
        scores = lazy.ortho.attn_scores(layer=layer, head=chosen).values.astype(np.float64)
        peak = scores.max(axis=-1, keepdims=True)
        softmax = np.exp(scores - peak)
        sinks = store.attrs["model"]["score"].get("sink_logits")  # a column of the softmax, not of the scores
        sink = 0 if sinks is None else np.exp(np.asarray(sinks[layer])[chosen][None, :, None, None] - peak)
        for found, expected in ((every.values, pattern[:, layer]), (softmax / (softmax.sum(axis=-1, keepdims=True) + sink),
                                                                    pattern[:, layer][:, chosen])):
            np.testing.assert_allclose(np.where(queries, found, 0), np.where(queries, expected, 0), rtol=0, atol=atol,
                                       err_msg=f"{model_type}, layer {layer}")
        z = lazy.ortho.z(layer=layer, head=chosen).values
        _close(z[store["valid"].values], store["z"].values[:, layer][:, :, chosen][store["valid"].values])


def test_a_bloom_computing_its_projections_by_slices_refuses_the_block_outputs():
    adapter = adapter_for(tiny_model("bloom", pretraining_tp=2, slow_but_exact=True))
    with pytest.raises(ConfigError, match=r"\['z', 'attn_out'\] cannot be provided by this bloom model.*"
                                          r"z is not read: with pretraining_tp > 1 and slow_but_exact=True"):
        adapter.check_sites(["q", "z", "attn_out"])


def _learned_position_table(model) -> bool:
    return any(isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in ("position_embeddings", "wpe", "embed_positions")
               for name, module in model.named_modules())


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_longest_sequence_allowed_is_the_longest_the_model_takes(model_type):
    """max_positions (what extraction refuses beyond) runs in every family, and a learned position table
    has no row for one token more (RoBERTa's and MPNet's count from their pad id + 1: fewer than the config says)."""
    from orthosphere.extract.job import max_positions

    model = tiny_model(model_type).eval()
    limit = max_positions(model)
    if limit is None:
        assert model_type in ("bloom", "mpt", *T5_FAMILIES), f"{model_type}: no limit, but positions are not relative"
        return
    vocab = model.config.get_text_config().vocab_size

    def forward(length):
        ids = torch.arange(length)[None] % (vocab - 5) + 5
        with torch.no_grad():
            return model(input_ids=ids) if not model.config.is_encoder_decoder else model(input_ids=ids, decoder_input_ids=ids[:, :2])

    forward(limit)
    if _learned_position_table(model):
        with pytest.raises((IndexError, RuntimeError)):
            forward(limit + 1)
