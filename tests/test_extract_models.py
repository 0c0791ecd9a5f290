"""Model sources: tiny models of every family written to disk and loaded back, and every bad input.

The builders here (tiny random models of each family, a word-level tokenizer, a GGUF file
written with gguf.GGUFWriter) are shared by the other extraction tests.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from orthosphere.extract.families import UnsupportedModelError
from orthosphere.extract.model import ArithmeticTransformer, ConfigError, ModelConfig, save_model
from orthosphere.extract.sources import load_source

WORDS = "the a cat dog sat ran on under mat rug big small red blue and then".split()
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "<s>"]
VOCAB = SPECIALS + WORDS
SIZES = {"layers": 2, "d_model": 32, "heads": 4, "kv_heads": 2, "d_ff": 64}
TEXT_LINES = [
    "the cat sat on the mat",
    "a dog ran",
    "",
    "the big red dog sat under a small blue rug and then ran",
    "a cat",
    "the dog and the cat sat on the rug",
    "then a big cat ran on the mat",
]


def hf_config(family: str):
    """A tiny random-initialised configuration of a Hugging Face family."""
    from transformers import BertConfig, GPT2Config, LlamaConfig

    vocab = len(VOCAB)
    if family == "gpt2":
        return GPT2Config(n_embd=SIZES["d_model"], n_layer=SIZES["layers"], n_head=SIZES["heads"], n_inner=SIZES["d_ff"],
                          vocab_size=vocab, n_positions=64, bos_token_id=4, eos_token_id=4)
    if family == "llama":
        return LlamaConfig(hidden_size=SIZES["d_model"], intermediate_size=SIZES["d_ff"], num_hidden_layers=SIZES["layers"],
                           num_attention_heads=SIZES["heads"], num_key_value_heads=SIZES["kv_heads"], vocab_size=vocab,
                           max_position_embeddings=64, bos_token_id=4, eos_token_id=4, pad_token_id=0, tie_word_embeddings=False)
    if family == "bert":
        return BertConfig(hidden_size=SIZES["d_model"], num_hidden_layers=SIZES["layers"], num_attention_heads=SIZES["heads"],
                          intermediate_size=SIZES["d_ff"], vocab_size=vocab, max_position_embeddings=64, pad_token_id=0)
    raise ValueError(family)


def hf_model(family: str, seed: int = 0):
    from transformers import BertForMaskedLM, GPT2LMHeadModel, LlamaForCausalLM

    torch.manual_seed(seed)
    model_class = {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM, "bert": BertForMaskedLM}[family]
    model = model_class(hf_config(family)).eval()
    with torch.no_grad():  # a spread of biases and norm gains, so that no map is trivially zero or one
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name.lower():
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


def word_tokenizer(family: str):
    """A word-level fast tokenizer over VOCAB; BERT's adds [CLS] ... [SEP], Llama's a BOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({word: index for index, word in enumerate(VOCAB)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    if family == "bert":
        backend.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    elif family == "llama":
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 4)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]")


def write_hf_model(directory, family: str, seed: int = 0, with_tokenizer: bool = True):
    """Save a tiny model of the family (safetensors) with its tokenizer; returns the directory."""
    model = hf_model(family, seed)
    model.save_pretrained(directory, safe_serialization=True)
    if with_tokenizer:
        word_tokenizer(family).save_pretrained(directory)
    return directory


def write_arithmetic_model(directory, placement: str = "pre", seed: int = 0, **sizes):
    torch.manual_seed(seed)
    config = dict(n_layers=2, d_model=32, n_heads=4, d_ff=64, norm_placement=placement)
    config.update(sizes)
    model = ArithmeticTransformer(ModelConfig(**config))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return save_model(model, directory)


def write_text(path, lines=TEXT_LINES):
    path.write_text("\n".join(lines) + "\n")
    return path


def _permute_for_gguf(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (transformers undoes it on loading)."""
    return weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


GGUF_TOKENS_EXTRA = ["Ġt", "he", "Ġthe", "Ġc", "at", "<|endoftext|>"]
GGUF_MERGES = ["Ġ t", "h e", "Ġt he", "Ġ c", "a t"]
GPT2_TRANSPOSED = ("attn_qkv.weight", "ffn_down.weight", "ffn_up.weight", "attn_output.weight")


def _gguf_tensor(gguf_name: str, tensor: np.ndarray, config, family: str) -> np.ndarray:
    """A weight as llama.cpp's converter stores it."""
    if family == "llama" and gguf_name.endswith("attn_q.weight"):
        return _permute_for_gguf(tensor, config.num_attention_heads)
    if family == "llama" and gguf_name.endswith("attn_k.weight"):
        return _permute_for_gguf(tensor, config.num_key_value_heads)
    if family == "gpt2" and gguf_name.endswith(GPT2_TRANSPOSED):
        return tensor.T
    return tensor


def write_gguf(path, model, with_tokenizer: bool = True):
    """A float32 GGUF of `model` (a tiny LlamaForCausalLM or GPT2LMHeadModel from gguf_model),
    with a byte-level BPE tokenizer, written the way llama.cpp's converter does."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    family, config = model.config.model_type, model.config
    tokens = list(bytes_to_unicode().values()) + GGUF_TOKENS_EXTRA
    assert len(tokens) == config.vocab_size, "the GGUF test model needs vocab_size = len(tokens)"
    writer = gguf.GGUFWriter(str(path), family)
    writer.add_name("orthosphere-tiny")
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    if family == "llama":
        writer.add_context_length(config.max_position_embeddings)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    else:
        writer.add_context_length(config.n_positions)
        writer.add_feed_forward_length(4 * config.hidden_size)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
    if with_tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types([1] * (len(tokens) - 1) + [3])
        writer.add_token_merges(GGUF_MERGES)
        writer.add_eos_token_id(len(tokens) - 1)
        writer.add_bos_token_id(len(tokens) - 1)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if family == "llama" else gguf.MODEL_ARCH.GPT2,
                                     config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None or (family == "gpt2" and name == "lm_head.weight"):  # GPT-2 ties it to wte
            continue
        writer.add_tensor(gguf_name, np.ascontiguousarray(_gguf_tensor(gguf_name, tensor.float().numpy(), config, family)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_model(family: str = "llama", seed: int = 0):
    """A tiny model whose vocabulary fits write_gguf's tokenizer. transformers reads a GPT-2
    GGUF with GPT-2's fixed 1024 positions and 4 * d_model feed-forward width, so those stay."""
    torch.manual_seed(seed)
    vocab = 256 + len(GGUF_TOKENS_EXTRA)
    if family == "llama":
        from transformers import LlamaForCausalLM

        config = hf_config("llama")
        config.vocab_size, config.bos_token_id, config.eos_token_id = vocab, vocab - 1, vocab - 1
        return LlamaForCausalLM(config).eval()
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=SIZES["d_model"], n_layer=SIZES["layers"], n_head=SIZES["heads"], vocab_size=vocab,
                        bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    return GPT2LMHeadModel(config).eval()


# --- tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_hugging_face_directory_loads_with_its_tokenizer(tmp_path, family):
    write_hf_model(tmp_path / family, family)
    loaded = load_source(tmp_path / family, device="cpu")
    description = loaded.describe()
    assert description["family"] == family
    assert description["n_layers"] == 2 and description["d_model"] == 32 and description["n_heads"] == 4
    assert description["n_kv_heads"] == (2 if family == "llama" else 4)
    assert description["causal"] is (family != "bert")
    assert description["norm_placement"] == ("post" if family == "bert" else "pre")
    assert description["norm_type"] == ("rms" if family == "llama" else "layer")
    assert description["attn_scale"] == pytest.approx(8 ** -0.5)
    assert len(description["weights_sha256"]) == 64 and description["format"] == "safetensors"
    ids = loaded.tokenizer.encode("the cat sat")
    words = [t for t in loaded.tokenizer.token_strings(ids) if t in WORDS]
    assert words == ["the", "cat", "sat"]
    reference = hf_model(family)
    tokens = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(loaded.adapter.forward(tokens), reference(input_ids=tokens).logits)


def test_arithmetic_checkpoint_loads_with_the_character_tokenizer(tmp_path):
    write_arithmetic_model(tmp_path / "model", placement="qkv", norm_type="rms")
    loaded = load_source(tmp_path / "model", device="cpu")
    description = loaded.describe()
    assert description["family"] == "arithmetic" and description["norm_placement"] == "qkv"
    assert description["norm_type"] == "rms" and description["format"] == "orthosphere"
    assert loaded.tokenizer.encode("[1+2=3]") == [13, 1, 10, 2, 14, 3, 15]
    assert loaded.tokenizer.token_strings([13, 1, 16]) == ["[", "1", ""]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_gguf_file_loads_with_its_tokenizer_and_the_same_weights(tmp_path, family):
    reference = gguf_model(family)
    path = write_gguf(tmp_path / "tiny.gguf", reference)
    loaded = load_source(path, device="cpu")
    description = loaded.describe()
    assert description["format"] == "gguf" and description["family"] == family
    assert description["n_kv_heads"] == (2 if family == "llama" else 4)
    ids = loaded.tokenizer.encode(" the cat")
    assert loaded.tokenizer.token_strings(ids) == ["Ġthe", "Ġc", "at"]
    tokens = torch.tensor([ids + [3, 70, 200]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.adapter.forward(tokens), reference(input_ids=tokens).logits, atol=1e-6, rtol=0)


def test_weights_hash_tells_models_apart(tmp_path):
    write_hf_model(tmp_path / "a", "gpt2", seed=0)
    write_hf_model(tmp_path / "b", "gpt2", seed=1)
    write_hf_model(tmp_path / "c", "gpt2", seed=0)
    digests = [load_source(tmp_path / name, device="cpu").describe()["weights_sha256"] for name in "abc"]
    assert digests[0] != digests[1] and digests[0] == digests[2]


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type,reason", [("mamba", "a new transformers family is a few lines"),
                                               ("bart", "extract/families.py"), (None, "few lines")])
def test_unknown_architecture_lists_the_supported_ones(tmp_path, model_type, reason):
    directory = tmp_path / str(model_type)
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
    (directory / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match=rf"{model_type!r}.*arithmetic.*gpt2.*llama.*qwen3.*bert.*t5.*{reason}"):
        load_source(directory, device="cpu")


def _tiny_config(name, **options):
    import transformers

    return getattr(transformers, name)(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, vocab_size=30,
                                       **options)


@pytest.mark.parametrize("model_class,config,reason", [
    ("FalconForCausalLM", _tiny_config("FalconConfig", alibi=True), "Falcon with alibi=True.*bfloat16"),
    ("Gemma3ForCausalLM", _tiny_config("Gemma3TextConfig", head_dim=8, use_bidirectional_attention=True),
     "Gemma 3 with use_bidirectional_attention=True.*expected the causal model"),
    ("BloomForCausalLM", _tiny_config("BloomConfig", apply_residual_connection_post_layernorm=True),
     "Bloom with apply_residual_connection_post_layernorm=True"),
    ("BertForMaskedLM", _tiny_config("BertConfig", is_decoder=True), "BERT configured as a decoder"),
])
def test_families_and_configurations_that_cannot_be_exact_are_refused(model_class, config, reason):
    import transformers

    from orthosphere.extract.capture import adapter_for

    model = getattr(transformers, model_class)(config)
    with pytest.raises(UnsupportedModelError, match=reason):
        adapter_for(model)


def test_checkpoint_missing_tensors_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    directory = write_hf_model(tmp_path / "llama", "llama")
    weights = load_file(directory / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"lacks 1 tensor\(s\).*model.layers.1.self_attn.k_proj.weight.*complete checkpoint"):
        load_source(directory, device="cpu")


def test_model_dtype_loads_and_describes_the_model_in_it(tmp_path):
    directory = write_hf_model(tmp_path / "llama", "llama")
    loaded = load_source(directory, device="cpu", model_dtype="bfloat16")
    assert loaded.describe()["dtype"] == "bfloat16"
    assert {p.dtype for p in loaded.adapter.model.parameters()} == {torch.bfloat16}
    with pytest.raises(ConfigError, match="model dtype 'int8': expected one of"):
        load_source(directory, device="cpu", model_dtype="int8")


def test_model_dtype_with_a_gguf_file_is_refused(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", gguf_model())
    with pytest.raises(ConfigError, match="--model-dtype bfloat16 with the GGUF file.*dequantised to float32"):
        load_source(path, device="cpu", model_dtype="bfloat16")


def test_a_dtype_the_device_cannot_run_is_refused(tmp_path, monkeypatch):
    """A CUDA device without bfloat16 (simulated: this test never touches a GPU)."""
    write_arithmetic_model(tmp_path / "model")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    with pytest.raises(ConfigError, match="device cuda cannot compute in bfloat16.*--model-dtype float16 or float32"):
        load_source(tmp_path / "model", device="cuda", model_dtype="bfloat16")


def test_directory_without_config_or_weights(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        load_source(empty, device="cpu")
    write_hf_model(tmp_path / "model", "gpt2")
    (tmp_path / "model" / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="has no weights: expected model.safetensors"):
        load_source(tmp_path / "model", device="cpu")
    (tmp_path / "model" / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ConfigError, match="never unpickles"):
        load_source(tmp_path / "model", device="cpu")
    write_arithmetic_model(tmp_path / "arith")
    (tmp_path / "arith" / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="has no model.safetensors"):
        load_source(tmp_path / "arith", device="cpu")


def test_unknown_or_absent_device(tmp_path):
    write_arithmetic_model(tmp_path / "model")
    with pytest.raises(ConfigError, match="device 'gpu7'.*expected auto, cpu, cuda or cuda:N"):
        load_source(tmp_path / "model", device="gpu7")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device; use --device cpu"):
            load_source(tmp_path / "model", device="cuda")


def test_missing_path_and_non_gguf_file(tmp_path):
    with pytest.raises(ConfigError, match="not found: expected a model directory"):
        load_source(tmp_path / "nowhere", device="cpu")
    (tmp_path / "weights.txt").write_text("hello")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        load_source(tmp_path / "weights.txt", device="cpu")


def test_gguf_without_tokenizer_is_refused(tmp_path):
    path = write_gguf(tmp_path / "bare.gguf", gguf_model(), with_tokenizer=False)
    with pytest.raises(ConfigError, match="holds no tokenizer"):
        load_source(path, device="cpu")


def test_unsupported_hugging_face_class_is_refused():
    from transformers import GPT2Model

    from orthosphere.extract.capture import adapter_for

    with pytest.raises(UnsupportedModelError, match="expected GPT2LMHeadModel"):
        adapter_for(GPT2Model(hf_config("gpt2")))


def test_damaged_safetensors_index_is_a_clear_error(tmp_path):
    directory = write_hf_model(tmp_path / "llama", "llama")
    (directory / "model.safetensors").unlink()
    (directory / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not a safetensors index"):
        load_source(directory)
