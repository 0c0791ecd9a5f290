"""Checkpoints without a language-model head: encoders saved without their task head (the common
sentence-embedding BERT, with or without its pooler) and T5, read as its encoder.

Such a model's store holds every activation but ``pred``, and says so (``model.lm_head`` false, in
``info`` too); analyses that need predictions are left out of the default set and refused by name.
A checkpoint whose body lacks a tensor is still refused, head or no head.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from orthosphere.analyze import analyze
from orthosphere.analyze.errors import AnalysisError
from orthosphere.analyze.results import ANALYSES, chosen_analyses
from orthosphere.extract.job import ExtractJob, run_job
from orthosphere.extract.model import ConfigError
from orthosphere.extract.sources import load_source
from orthosphere.store import open_store
from orthosphere.store.errors import StoreError
from orthosphere.store.reader import format_info, info
from orthosphere.store.schema import check_model
from tests.test_extract_models import word_tokenizer, write_text
from tests.tiny_families import tiny_config, tiny_model

HEADLESS = {"bert": "BertModel", "roberta": "RobertaModel", "distilbert": "DistilBertModel", "mpnet": "MPNetModel",
            "xlm-roberta": "XLMRobertaModel", "electra": "ElectraModel", "modernbert": "ModernBertModel",
            "ernie": "ErnieModel", "data2vec-text": "Data2VecTextModel", "roberta-prelayernorm": "RobertaPreLayerNormModel",
            "xlm-roberta-xl": "XLMRobertaXLModel", "esm": "EsmModel", "megatron-bert": "MegatronBertModel",
            "rembert": "RemBertModel", "nomic_bert": "NomicBertModel", "gte": "GteModel",
            "jina_embeddings_v3": "JinaEmbeddingsV3Model", "eurobert": "EuroBertModel", "ultrabert": "UltrabertModel",
            "esmc": "EsmcModel"}
WITHOUT_POOLER = ("distilbert", "electra", "modernbert", "eurobert", "ultrabert", "esmc")
SITES = ("resid_pre", "resid_mid", "resid_post", "attn_in", "q", "k", "v")


def saved(model, directory):
    model.save_pretrained(directory, safe_serialization=True)
    word_tokenizer("bert").save_pretrained(directory)
    return directory


def base_model(family: str, full, pooler: bool):
    """The body of `full` (a tiny ...ForMaskedLM) as the family's class without a head, with a
    freshly initialised pooler when `pooler` (as sentence-embedding checkpoints carry one)."""
    import transformers

    base_class = getattr(transformers, HEADLESS[family])
    base = base_class(full.config, add_pooling_layer=True) if pooler else base_class(full.config)
    missing, unexpected = base.load_state_dict(getattr(full, full.base_model_prefix).state_dict(), strict=False)
    assert not unexpected and all(key.startswith("pooler.") for key in missing)
    return base.eval()


def extracted_store(directory, folder):
    text = write_text(folder / "text.txt")
    out = folder / f"{directory.name}.zarr"
    run_job(ExtractJob(model=str(directory), task=f"text:path={text},max_length=12", out=str(out), sites=SITES,
                       dtype="float32", batch_size=4, device="cpu"), progress=False)
    return out


@pytest.mark.parametrize("pooler", [False, True], ids=["no-pooler", "pooler"])
@pytest.mark.parametrize("family", HEADLESS)
def test_an_encoder_without_its_head_stores_the_same_activations_and_no_pred(tmp_path, family, pooler):
    if pooler and family in WITHOUT_POOLER:
        pytest.skip(f"{HEADLESS[family]} has no pooler")
    full = tiny_model(family)
    with_head = extracted_store(saved(full, tmp_path / "with-head"), tmp_path)
    headless_dir = saved(base_model(family, full, pooler), tmp_path / "headless")
    loaded = load_source(headless_dir, device="cpu")
    assert loaded.describe()["architecture"] == HEADLESS[family] and loaded.describe()["lm_head"] is False
    headless = extracted_store(headless_dir, tmp_path)
    expected, found = open_store(str(with_head)).load(), open_store(str(headless)).load()
    assert "pred" in expected and "pred" not in found
    for site in SITES:  # the same model code on the same weights: the same numbers
        np.testing.assert_array_equal(found[site].values, expected[site].values, err_msg=site)
    summary = info(str(headless))
    assert summary["model"]["lm_head"] is False and "pred" not in summary["arrays"]
    assert f"pred      none: the model ({HEADLESS[family]}) has no language-model head" in format_info(summary)


def sentence_transformers_directory(model, directory, body: str = ""):
    """A sentence-transformers directory as all-mpnet-base-v2's: the body (no head, no prefix) in
    folder `body` ("": the directory itself), mean pooling, normalisation."""
    import json

    saved(model, directory / body)
    modules = [{"idx": 0, "name": "0", "path": body, "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32,
                                                                      "pooling_mode_mean_tokens": True}))
    (directory / "2_Normalize").mkdir()
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 384, "do_lower_case": False}))
    return directory


@pytest.mark.parametrize("body", ["", "0_Transformer"], ids=["all-mpnet-base-v2-layout", "transformer-subfolder"])
def test_a_sentence_transformers_directory_loads_as_its_base_model(tmp_path, body):
    """An all-mpnet-base-v2-like directory (weights without `mpnet.`, no head, modules.json, 1_Pooling/)
    stores what the masked-LM model's body computes; an older layout's transformer subfolder is found."""
    from safetensors import safe_open

    full = tiny_model("mpnet")
    directory = sentence_transformers_directory(base_model("mpnet", full, pooler=True), tmp_path / "st", body)
    with safe_open(directory / body / "model.safetensors", "pt") as weights:
        assert not any(key.startswith("mpnet.") for key in weights.keys())
    assert load_source(directory, device="cpu").describe()["architecture"] == "MPNetModel"
    found = open_store(str(extracted_store(directory, tmp_path))).load()
    expected = open_store(str(extracted_store(saved(full, tmp_path / "with-head"), tmp_path))).load()
    for site in SITES:
        np.testing.assert_array_equal(found[site].values, expected[site].values, err_msg=site)


def test_a_sentence_transformers_directory_without_a_transformer_module_is_refused(tmp_path):
    directory = sentence_transformers_directory(base_model("mpnet", tiny_model("mpnet"), pooler=False), tmp_path / "st",
                                                "0_Transformer")
    (directory / "modules.json").write_text('[{"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]')
    with pytest.raises(ConfigError, match=r"has no config.json and its modules.json names 0 Transformer modules: "
                                          r"expected one .* give that folder"):
        load_source(directory, device="cpu")


def test_analyses_leave_accuracy_out_without_predictions_and_refuse_it_by_name(tmp_path):
    store = extracted_store(saved(base_model("bert", tiny_model("bert"), pooler=False), tmp_path / "headless"), tmp_path)
    dataset = open_store(str(store))
    with pytest.raises(AnalysisError, match=r"holds no predictions \(pred\): BertModel has no language-model head"):
        analyze(str(store), analyses=["accuracy"])
    assert {analysis.name for analysis in chosen_analyses(dataset)} == set(ANALYSES) - {"accuracy"}


@pytest.mark.parametrize("headless", [False, True], ids=["with-head", "headless"])
def test_a_checkpoint_whose_body_lacks_a_tensor_is_refused(tmp_path, headless):
    from safetensors.torch import load_file, save_file

    full = tiny_model("bert")
    directory = saved(base_model("bert", full, pooler=True) if headless else full, tmp_path / "bert")
    weights = load_file(directory / "model.safetensors")
    name = ("" if headless else "bert.") + "encoder.layer.1.attention.self.key.weight"
    del weights[name]
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=rf"checkpoint {directory} lacks 1 tensor\(s\) that \w+ needs.*"
                                          r"encoder.layer.1.attention.self.key.weight.*complete checkpoint"):
        load_source(directory, device="cpu")


def test_a_t5_checkpoint_is_read_as_its_encoder(tmp_path):
    import transformers

    torch.manual_seed(0)
    seq2seq = transformers.T5ForConditionalGeneration(tiny_config("t5")).eval()
    loaded = load_source(saved(seq2seq, tmp_path / "t5"), device="cpu")
    description = loaded.describe()
    assert description["architecture"] == "T5EncoderModel" and description["lm_head"] is False
    assert description["positions"] == "relative" and description["norm_type"] == "rms"
    encoder = dict(seq2seq.encoder.named_parameters())
    for name, parameter in loaded.adapter.model.encoder.named_parameters():
        torch.testing.assert_close(parameter, encoder[name], rtol=0, atol=0)
    relative, reach = description["score"]["relative_bias"], description["score"]["relative_bias"]["max_offset"]
    assert relative["table_of_layer"] == [0, 0]  # T5 passes layer 0's bias on
    with torch.no_grad():  # query 2 of 5: keys at offsets -2..2
        offsets = seq2seq.encoder.block[0].layer[0].SelfAttention.compute_bias(5, 5)[0, :, 2, :].numpy()
    np.testing.assert_array_equal(np.asarray(relative["tables"][0], np.float32)[:, reach - 2: reach + 3], offsets)


def test_umt5_has_a_bias_per_layer():
    from orthosphere.extract.adapters import adapter_for

    relative = adapter_for(tiny_model("umt5")).describe()["score"]["relative_bias"]
    assert relative["table_of_layer"] == [0, 1] and len(relative["tables"]) == 2
    assert relative["tables"][0] != relative["tables"][1]


@pytest.mark.parametrize("relative, problem", [
    ({"max_offset": 2, "tables": [[[0.0] * 5] * 4], "table_of_layer": [0]}, r"table_of_layer=\[0\] is not one index"),
    ({"max_offset": 2, "tables": [[[0.0] * 4] * 4], "table_of_layer": [0, 0]}, r"shape \(1, 4, 4\), expected .*5 offsets"),
    ({"max_offset": 2, "tables": [[[0.0] * 5] * 3], "table_of_layer": [0, 0]}, r"shape \(1, 3, 5\), expected .*4 heads"),
    ({"max_offset": 2, "tables": [[[0.0] * 5] * 4], "table_of_layer": [0, 1]}, r"index of the 1 table\(s\)"),
    ({"max_offset": 0, "tables": [[[0.0]] * 4], "table_of_layer": [0, 0]}, "max_offset=0 is not a positive integer"),
    ({"max_offset": 2, "tables": [[[float("nan")] * 5] * 4], "table_of_layer": [0, 0]}, "not finite"),
    ({"max_offset": 2, "tables": [["a"] * 5] * 4, "table_of_layer": [0, 0]}, "not an array of numbers"),
    ({"tables": [], "table_of_layer": [0, 0]}, "has other keys"),
    ("bias", "has other keys"),
])
def test_a_malformed_relative_bias_is_refused(relative, problem):
    score = {"scale": [1.0, 1.0], "sliding_window": [None, None], "softcap": [None, None], "alibi_slopes": None,
             "relative_bias": relative}
    model = {"n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 4, "d_head": 8, "score": score}
    with pytest.raises(StoreError, match=rf"score.relative_bias: .*{problem}.*SCHEMA.md"):
        check_model(model)
