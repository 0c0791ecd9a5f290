"""Model sources: tiny models of every family written to disk and loaded back, and every bad input.

The builders here (tiny random models of each family, a word-level tokenizer, a GGUF file
written with gguf.GGUFWriter) are shared by the other extraction tests.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr

from orthosphere.extract.families import UnsupportedModelError
from orthosphere.extract.job import ExtractJob, run_job
from orthosphere.extract.model import ArithmeticTransformer, ConfigError, ModelConfig, save_model
from orthosphere.extract.sources import gguf_architectures, load_source
from orthosphere.store import open_store

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


def _bloom_qkv_for_gguf(tensor: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's reordering of Bloom's fused qkv rows from [q_h | k_h | v_h] per head to [all q | all k | all v]."""
    return tensor.reshape(n_heads, 3, -1, *tensor.shape[1:]).swapaxes(0, 1).reshape(tensor.shape)


GGUF_TOKENS_EXTRA = ["Ġt", "he", "Ġthe", "Ġc", "at", "<|endoftext|>"]
GGUF_MERGES = ["Ġ t", "h e", "Ġt he", "Ġ c", "a t"]
GGUF_VOCAB = 256 + len(GGUF_TOKENS_EXTRA)
GGUF_SPECIAL_ID = GGUF_VOCAB - 1
"""<|endoftext|>: the GGUF tokenizer's BOS, EOS and padding token."""
GPT2_TRANSPOSED = ("attn_qkv.weight", "ffn_down.weight", "ffn_up.weight", "attn_output.weight")
GGUF_ARCHITECTURE = {"gemma3_text": "gemma3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss",
                     "minimax_m2": "minimax-m2"}
"""model_type -> the GGUF architecture llama.cpp writes it as, where they differ."""
GGUF_EPS = 2.0 ** -17
"""A norm epsilon that the file's float32 metadata holds exactly."""
GGUF_SIZES = dict(hidden_size=SIZES["d_model"], num_hidden_layers=SIZES["layers"], num_attention_heads=SIZES["heads"])
GGUF_LLAMA_SIZES = dict(GGUF_SIZES, num_key_value_heads=SIZES["kv_heads"], intermediate_size=SIZES["d_ff"],
                        max_position_embeddings=64)
GGUF_CONFIGS = {
    "llama": ("LlamaConfig", dict(GGUF_LLAMA_SIZES, rms_norm_eps=GGUF_EPS)),
    "qwen2": ("Qwen2Config", dict(GGUF_LLAMA_SIZES, rms_norm_eps=GGUF_EPS)),
    "qwen3": ("Qwen3Config", dict(GGUF_LLAMA_SIZES, rms_norm_eps=GGUF_EPS)),
    "phi3": ("Phi3Config", dict(GGUF_LLAMA_SIZES, rms_norm_eps=GGUF_EPS)),
    "stablelm": ("StableLmConfig", dict(GGUF_LLAMA_SIZES, layer_norm_eps=GGUF_EPS, use_qkv_bias=True)),
    "starcoder2": ("Starcoder2Config", dict(GGUF_LLAMA_SIZES, norm_epsilon=GGUF_EPS)),
    "gemma2": ("Gemma2Config", dict(GGUF_LLAMA_SIZES, rms_norm_eps=GGUF_EPS, head_dim=8, sliding_window=4)),
    "gemma3_text": ("Gemma3TextConfig", dict(GGUF_LLAMA_SIZES, rms_norm_eps=GGUF_EPS, head_dim=8, sliding_window=4)),
    "nemotron": ("NemotronConfig", dict(GGUF_LLAMA_SIZES, norm_eps=GGUF_EPS)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(GGUF_LLAMA_SIZES, rms_norm_eps=GGUF_EPS, num_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(GGUF_LLAMA_SIZES, rms_norm_eps=GGUF_EPS, num_experts=4, num_experts_per_tok=2,
                                         norm_topk_prob=True)),
    "minimax_m2": ("MiniMaxM2Config", dict(GGUF_LLAMA_SIZES, rms_norm_eps=GGUF_EPS, num_local_experts=4, num_experts_per_tok=2)),
    "falcon": ("FalconConfig", dict(GGUF_SIZES, max_position_embeddings=64)),
    "bloom": ("BloomConfig", dict(hidden_size=SIZES["d_model"], n_layer=SIZES["layers"], n_head=SIZES["heads"],
                                  layer_norm_epsilon=GGUF_EPS)),
    "gpt2": ("GPT2Config", dict(n_embd=SIZES["d_model"], n_layer=SIZES["layers"], n_head=SIZES["heads"],
                                layer_norm_epsilon=GGUF_EPS)),
}
"""model_type -> (config class, keywords): tiny configs that state only what a GGUF file of the
architecture states (the rest keeps the class defaults, which is how transformers reads the file: a
GPT-2 keeps its 1024 positions and 4 * d_model feed-forward width, a Falcon is multi-query, a Qwen3
keeps head_dim 128, the MoE families their experts' widths)."""


def _gguf_tensor(gguf_name: str, tensor: np.ndarray, config) -> np.ndarray:
    """A weight as llama.cpp's converter stores it (transformers reverses each of these on reading)."""
    model_type = config.model_type
    if model_type == "llama" and gguf_name.endswith("attn_q.weight"):
        return _permute_for_gguf(tensor, config.num_attention_heads)
    if model_type == "llama" and gguf_name.endswith("attn_k.weight"):
        return _permute_for_gguf(tensor, config.num_key_value_heads)
    if model_type == "gpt2" and gguf_name.endswith(GPT2_TRANSPOSED):
        return tensor.T
    if model_type == "bloom" and ".attn_qkv." in gguf_name:
        return _bloom_qkv_for_gguf(tensor, config.n_head)
    if model_type in GAIN_PLUS_ONE and gguf_name.endswith("norm.weight"):  # a gain of 1 + weight, stored whole
        return tensor + 1
    return tensor


def _gguf_metadata_value(config, key: str):
    """The config's value for a transformers config key of the GGUF mapping (None: the config has none)."""
    if key == "rope_theta":
        rope = getattr(config, "rope_parameters", None) or {}
        rope = rope.get("full_attention", rope)  # Gemma 3: one set per layer type
        return rope.get("rope_theta")
    return getattr(config, key, None)


def _write_gguf_metadata(writer, architecture: str, config) -> None:
    """The architecture's keys that transformers reads (GGUF_CONFIG_MAPPING), from the config."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    model_type = config.model_type
    mapping = GGUF_CONFIG_MAPPING[model_type if model_type in GGUF_CONFIG_MAPPING else GGUF_ARCHITECTURE[model_type]]
    for gguf_key, config_key in mapping.items():
        value = _gguf_metadata_value(config, config_key) if config_key else None
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int):
            writer.add_uint32(f"{architecture}.{gguf_key}", value)
        else:
            writer.add_float32(f"{architecture}.{gguf_key}", value)


def _write_gguf_tokenizer(writer) -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + GGUF_TOKENS_EXTRA
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(GGUF_MERGES)
    writer.add_eos_token_id(GGUF_SPECIAL_ID)
    writer.add_bos_token_id(GGUF_SPECIAL_ID)
    writer.add_pad_token_id(GGUF_SPECIAL_ID)


def _gguf_name(names, name: str) -> str | None:
    """The GGUF name of a parameter: its own or that of its name within the base model (llama.cpp names
    Bloom's "transformer.h.0..." as "h.0...")."""
    for candidate in (name, name.split(".", 1)[-1]):
        gguf_name = names.get_name(candidate, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            return gguf_name
    return None


def _gguf_tensors(names, parameter: str, tensor: np.ndarray, config) -> list[tuple[str, np.ndarray]]:
    """The GGUF tensors (name, array) llama.cpp writes for a parameter: none for one it does not know;
    a mixture of experts' fused gate and up projections as two stacks of experts (Qwen2-MoE, Qwen3-MoE, MiniMax-M2)."""
    if parameter.endswith("mlp.e_score_correction_bias"):  # MiniMax-M2's router bias
        return [(f"blk.{parameter.split('.')[2]}.exp_probs_b.bias", tensor)]
    if parameter.endswith("mlp.experts.gate_up_proj"):
        block = parameter.split(".")[2]
        gate, up = np.split(tensor, 2, axis=1)
        return [(f"blk.{block}.ffn_gate_exps.weight", gate), (f"blk.{block}.ffn_up_exps.weight", up)]
    gguf_name = _gguf_name(names, parameter)
    if gguf_name is None:
        return []
    if parameter.endswith("mlp.experts.down_proj"):
        gguf_name += ".weight"
    if parameter.endswith("shared_expert_gate.weight"):  # one row, stored as a vector
        tensor = tensor[0]
    return [(gguf_name, _gguf_tensor(gguf_name, tensor, config))]


RAW_BYTE_LIMIT = 0x3C
"""Bytes of the quantised blocks drawn below it where the gguf package cannot quantise a type: every
half-precision scale then lies in [0, 1), every byte scale far below 1, so the values are finite and small."""


def quantised(data: np.ndarray, quantisation) -> np.ndarray:
    """`data` stored as `quantisation` (a GGMLQuantizationType), as bytes: the gguf package's quantiser
    where it has one, else random blocks (RAW_BYTE_LIMIT), which gguf dequantises all the same."""
    import gguf

    try:
        return gguf.quants.quantize(data.astype(np.float32), quantisation)
    except NotImplementedError:
        rows, width = data.shape
        block, block_bytes = gguf.GGML_QUANT_SIZES[quantisation]
        rng = np.random.default_rng(int(quantisation))
        return rng.integers(0, RAW_BYTE_LIMIT, (rows, width // block * block_bytes), dtype=np.uint8)


def write_gguf(path, model, with_tokenizer: bool = True, architecture: str | None = None, name: str = "orthosphere-tiny",
               tensor_dtype=np.float32, storage=None):
    """A GGUF of `model` (from gguf_model) with a byte-level BPE tokenizer, written the way llama.cpp's
    converter does; `architecture` and `name` replace the general.architecture and general.name written,
    `tensor_dtype` the weights' storage type (for refusals), and `storage`, a function of a tensor's
    GGUF name, the quantisation type of each tensor (None: `tensor_dtype`; see quantised)."""
    import gguf

    config = model.config
    assert config.vocab_size == GGUF_VOCAB, "the GGUF test model needs the vocabulary of the GGUF tokenizer"
    true_architecture = GGUF_ARCHITECTURE.get(config.model_type, config.model_type)
    architecture = architecture or true_architecture
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(name)
    _write_gguf_metadata(writer, architecture, config)
    if with_tokenizer:
        _write_gguf_tokenizer(writer)
    arch = {arch_name: arch for arch, arch_name in gguf.MODEL_ARCH_NAMES.items()}[true_architecture]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    written = set()  # a tensor that two parameters share (T5's embeddings) is written once
    for parameter, tensor in model.state_dict().items():
        if config.tie_word_embeddings and parameter == "lm_head.weight":
            continue
        for gguf_name, stored in _gguf_tensors(names, parameter, tensor.double().numpy(), config):
            if gguf_name not in written:
                data = np.ascontiguousarray(stored, dtype=tensor_dtype)
                quantisation = None if storage is None else storage(gguf_name)
                if quantisation is None:
                    writer.add_tensor(gguf_name, data)
                else:
                    writer.add_tensor(gguf_name, quantised(data, quantisation), raw_dtype=quantisation)
                written.add(gguf_name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


GGUF_MODEL_TYPES = tuple(GGUF_CONFIGS)
GAIN_PLUS_ONE = ("gemma2", "gemma3_text", "nemotron")
"""Families whose norms' gain is 1 + weight, which llama.cpp stores whole."""
GEMMA_GAIN_GRID = 2.0 ** -12
"""Their norm weights are drawn on this grid, so that the file's float32 1 + weight gives weight back exactly."""


def gguf_model(model_type: str = "llama", seed: int = 0, **overrides):
    """A tiny random model of GGUF_CONFIGS' model_type (`overrides` replacing config values), whose
    vocabulary is write_gguf's tokenizer's, with a spread of biases and norm gains (so that no map is
    trivially zero or one)."""
    import transformers

    from orthosphere.extract.families import family_for

    torch.manual_seed(seed)
    config_class, options = GGUF_CONFIGS[model_type]
    config = getattr(transformers, config_class)(**(options | overrides), vocab_size=GGUF_VOCAB, bos_token_id=GGUF_SPECIAL_ID,
                                                 eos_token_id=GGUF_SPECIAL_ID, pad_token_id=GGUF_SPECIAL_ID)
    model = getattr(transformers, family_for(model_type).lm_class)(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name.lower():
                parameter.add_(0.1 * torch.randn_like(parameter))
            if "norm" in name and model_type in GAIN_PLUS_ONE:
                parameter.copy_(torch.round(parameter / GEMMA_GAIN_GRID) * GEMMA_GAIN_GRID)
    return model


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


def test_every_gguf_architecture_orthosphere_accepts_is_tested():
    """GGUF_CONFIGS holds one model of each architecture gguf_architectures() derives from transformers."""
    tested = {GGUF_ARCHITECTURE.get(model_type, model_type): model_type for model_type in GGUF_MODEL_TYPES}
    assert gguf_architectures() == tested


GGUF_TEXTS = [" the cat sat on the mat", " a cat the the", " the cat"]
STORE_SITES = ("resid_pre", "resid_mid", "resid_post", "attn_in", "q", "k", "v")
DESCRIBED_APART = ("source", "format", "weights_sha256")
"""What tells a GGUF-loaded model's description from the same model's loaded from a directory."""
TOKENIZER_CLASS_KEYS = ("tokenizer", "tokenizer_sha256")
"""The task attributes that name (or hash) the tokenizer's class, which the directory's copy does not keep."""


def _save_generic_tokenizer(tokenizer, directory) -> None:
    """Save a tokenizer to be loaded back as transformers' generic fast tokenizer, not as the class the
    GGUF file's was built as (GemmaTokenizer cannot load a BPE tokenizer without an unknown token). Any
    Qwen2 directory's tokenizer is loaded as Qwen2Tokenizer all the same, whose pre-tokeniser is not the
    file's byte-level one: the test compares what the tokenizers make of its texts (the stores' tokens)."""
    tokenizer.save_pretrained(directory)
    config_path = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(config | {"tokenizer_class": "TokenizersBackend"}))


def _extract_store(tmp_path, model, text) -> xr.Dataset:
    out = tmp_path / f"{Path(model).name}.zarr"
    job = ExtractJob(model=str(model), task=f"text:path={text}", out=str(out), device="cpu", sites=STORE_SITES,
                     dtype="float32", batch_size=2)
    run_job(job, progress=False)
    return open_store(str(out)).load()


@pytest.mark.parametrize("model_type", GGUF_MODEL_TYPES)
def test_gguf_file_is_the_same_model_as_its_directory(tmp_path, model_type):
    """A GGUF file loads with its tokenizer, the reference's parameters and its description, and extracts
    the same store as the model saved as a safetensors directory with that tokenizer."""
    reference = gguf_model(model_type)
    path = write_gguf(tmp_path / f"{model_type}.gguf", reference)
    loaded = load_source(path, device="cpu")
    assert type(loaded.adapter.model) is type(reference)
    parameters = loaded.adapter.model.state_dict()
    assert parameters.keys() == reference.state_dict().keys()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(parameters[name], tensor), name
    assert loaded.tokenizer.token_strings(loaded.tokenizer.encode_batch([" the cat"], special_tokens=False)[0]) == ["Ġthe", "Ġc", "at"]

    directory = tmp_path / model_type
    reference.save_pretrained(directory, safe_serialization=True)
    _save_generic_tokenizer(loaded.tokenizer.tokenizer, directory)
    from_directory = load_source(directory, device="cpu")
    tokenizers = loaded.tokenizer, from_directory.tokenizer
    assert len({(t.bos_id, t.eos_id, t.pad_id, tuple(t.special_affixes()[0])) for t in tokenizers}) == 1
    gguf_description, directory_description = loaded.describe(), from_directory.describe()
    assert gguf_description["format"] == "gguf" and directory_description["format"] == "safetensors"
    assert gguf_description["family"] == model_type
    for key in DESCRIBED_APART:
        del gguf_description[key], directory_description[key]
    assert gguf_description == directory_description

    text = write_text(tmp_path / "text.txt", GGUF_TEXTS)
    gguf_store, directory_store = _extract_store(tmp_path, path, text), _extract_store(tmp_path, directory, text)
    tasks = [{key: value for key, value in store.attrs["task"].items() if key not in TOKENIZER_CLASS_KEYS}
             for store in (gguf_store, directory_store)]
    assert tasks[0] == tasks[1]
    assert set(gguf_store.variables) == set(directory_store.variables) >= set(STORE_SITES)
    for name in gguf_store.variables:
        np.testing.assert_array_equal(gguf_store[name].values, directory_store[name].values, err_msg=name)


def test_weights_hash_tells_models_apart(tmp_path):
    write_hf_model(tmp_path / "a", "gpt2", seed=0)
    write_hf_model(tmp_path / "b", "gpt2", seed=1)
    write_hf_model(tmp_path / "c", "gpt2", seed=0)
    digests = [load_source(tmp_path / name, device="cpu").describe()["weights_sha256"] for name in "abc"]
    assert digests[0] != digests[1] and digests[0] == digests[2]


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type,reason", [("roc_bert", "a new transformers family is a few lines"),
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
    ("EsmForMaskedLM", _tiny_config("EsmConfig", position_embedding_type="absolute", pad_token_id=0, max_position_embeddings=64),
     "ESM with position_embedding_type='absolute'.*expected ESM-2's 'rotary'"),
    ("EsmForMaskedLM", _tiny_config("EsmConfig", emb_layer_norm_before=True, pad_token_id=0, position_embedding_type="rotary"),
     "ESM with emb_layer_norm_before=True"),
    ("XLMRobertaXLForMaskedLM", _tiny_config("XLMRobertaXLConfig", is_decoder=True), "XLM-RoBERTa-XL configured as a decoder"),
    ("MptForCausalLM", __import__("transformers").MptConfig(d_model=32, n_heads=4, n_layers=1, vocab_size=30,
                                                           attn_config={"clip_qkv": 6.0}), "MPT with clip_qkv=6.0 clamps"),
    ("CodeGenForCausalLM", __import__("transformers").CodeGenConfig(n_embd=36, n_head=6, n_layer=1, vocab_size=30, rotary_dim=2),
     "CodeGen with 6 heads.*multiple of 4"),
])
def test_families_and_configurations_that_cannot_be_exact_are_refused(model_class, config, reason):
    import transformers

    from orthosphere.extract.adapters import adapter_for

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
    with pytest.raises(ConfigError, match="model_dtype=bfloat16 with the GGUF file.*dequantised to float32; leave model_dtype= out"):
        load_source(path, device="cpu", model_dtype="bfloat16")


def test_a_dtype_the_device_cannot_run_is_refused(tmp_path, monkeypatch):
    """A CUDA device without bfloat16 (simulated: this test never touches a GPU)."""
    write_arithmetic_model(tmp_path / "model")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    with pytest.raises(ConfigError, match="device cuda cannot compute in bfloat16.*use model_dtype=float16 or float32"):
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
        with pytest.raises(ConfigError, match="no CUDA device; use device=cpu"):
            load_source(tmp_path / "model", device="cuda")


def test_missing_path_and_non_gguf_file(tmp_path):
    with pytest.raises(ConfigError, match="not found: expected a model directory"):
        load_source(tmp_path / "nowhere", device="cpu")
    (tmp_path / "weights.txt").write_text("hello")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        load_source(tmp_path / "weights.txt", device="cpu")


def test_gguf_without_tokenizer_is_refused(tmp_path):
    path = write_gguf(tmp_path / "bare.gguf", gguf_model(), with_tokenizer=False)
    with pytest.raises(ConfigError, match=rf"GGUF file {path} holds no tokenizer.*converted with its tokenizer"):
        load_source(path, device="cpu")


ACCEPTED = r"GGUF files load for the architectures \['bloom', 'falcon', .*'llama', .*\]: give one of them"


@pytest.mark.parametrize("architecture,why", [
    ("nonesuch", "transformers does not read that architecture from GGUF"),
    ("mamba", "transformers reads it as model_type 'mamba', which orthosphere refuses: its layers are recurrent or state-space"),
    ("gpt-oss", "transformers' GGUF reader maps GPT-OSS's expert tensors .* to none of GptOssForCausalLM's"),
    ("mistral", "transformers reads its configuration as model_type 'mistral' but cannot map its tensors .*no architecture 'mistral'"),
])
def test_gguf_architecture_without_a_family_model_is_refused(tmp_path, architecture, why):
    path = write_gguf(tmp_path / f"{architecture}.gguf", gguf_model(), architecture=architecture)
    with pytest.raises(UnsupportedModelError, match=rf"GGUF file {path} has the architecture '{architecture}': {why}.*{ACCEPTED}"):
        load_source(path, device="cpu")


def dequantisable_types() -> list:
    """Every tensor type the gguf package dequantises (one block of each tried)."""
    import gguf

    types = []
    for quantisation in gguf.GGMLQuantizationType:
        block, block_bytes = gguf.GGML_QUANT_SIZES[quantisation]
        try:
            gguf.quants.dequantize(np.zeros((1, block_bytes), np.uint8), quantisation)
        except NotImplementedError:
            continue
        types.append(quantisation)
    return types


UNPERMUTED = {"attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
              "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
"""GGUF tensors of a Llama block that transformers reads as they are (attn_q and attn_k it permutes back)."""


def test_a_gguf_mixing_every_tensor_type_the_gguf_package_dequantises_loads_each_as_gguf_dequantises_it(tmp_path):
    """One Llama file whose tensors use every type the gguf package dequantises (26 with gguf 0.19): the
    types of 256-value blocks on the feed-forward's down projections (256 wide), one a layer, the others
    in turn on every other matrix; each is the model's tensor exactly as gguf dequantises it."""
    import gguf

    types = dequantisable_types()
    wide = [t for t in types if gguf.GGML_QUANT_SIZES[t][0] > SIZES["d_model"]]
    narrow = [t for t in types if t not in wide]
    matrices = iter(range(10**6))

    def storage(name):
        if name.endswith("norm.weight"):
            return None  # vectors stay float32, as llama.cpp keeps them
        if name.endswith("ffn_down.weight"):
            return wide[int(name.split(".")[1])]
        return narrow[next(matrices) % len(narrow)]

    model = gguf_model("llama", num_hidden_layers=len(wide), intermediate_size=256)
    path = write_gguf(tmp_path / "mixed.gguf", model, storage=storage)
    reader = gguf.GGUFReader(path)
    assert {tensor.tensor_type for tensor in reader.tensors} == set(types)
    loaded = load_source(path, device="cpu").adapter.model
    compared = set()
    for tensor in reader.tensors:
        parts = tensor.name.split(".")  # blk.<layer>.<kind>.weight
        if parts[0] == "blk" and parts[2] in UNPERMUTED:
            parameter = loaded.get_parameter(f"model.layers.{parts[1]}.{UNPERMUTED[parts[2]]}.weight")
            expected = torch.tensor(gguf.dequantize(tensor.data, tensor.tensor_type).reshape(parameter.shape))
            assert torch.equal(parameter, expected.float()), tensor.name
            compared.add(tensor.tensor_type)
    assert compared == set(types)
    with torch.no_grad():
        assert torch.isfinite(loaded(input_ids=torch.tensor([[5, 6, 7, 8]])).logits).all()


def test_a_gguf_whose_tensors_differ_from_the_sizes_transformers_assumes_is_refused(tmp_path):
    """transformers reads no expert width from a Qwen2-MoE GGUF (it keeps its defaults): a model with
    other widths is refused, naming the file and a tensor, not run with random experts."""
    path = write_gguf(tmp_path / "narrow-experts.gguf", gguf_model("qwen2_moe", moe_intermediate_size=16))
    with pytest.raises(ConfigError, match=rf"checkpoint {path}: tensor model.layers.\d.mlp.\S+ has the shape .* there "
                                          r"but Qwen2MoeForCausalLM expects .*config defaults"):
        load_source(path, device="cpu")


@pytest.mark.parametrize("name", ["flan-t5-tiny", "umt5-tiny"])
def test_t5_gguf_is_refused_for_transformers_reads_another_feed_forward(tmp_path, name):
    """transformers reads a T5 GGUF's gated feed-forward as gated ReLU, whatever the model's activation
    (a file named "umt5..." as a UMT5)."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
                      vocab_size=GGUF_VOCAB)
    path = write_gguf(tmp_path / "t5.gguf", T5EncoderModel(config).eval(), name=name)
    with pytest.raises(UnsupportedModelError, match=rf"GGUF file {path} has the architecture 't5': transformers reads "
                       rf"every T5 GGUF file as a T5 with a gated ReLU feed-forward .*{ACCEPTED}"):
        load_source(path, device="cpu")


def test_gguf_that_transformers_reads_as_another_model_type_is_refused(tmp_path):
    """transformers reads a llama file named "mistral" as a Mistral model, whose tensors it cannot map."""
    path = write_gguf(tmp_path / "named.gguf", gguf_model(), name="mistral")
    with pytest.raises(UnsupportedModelError, match=rf"GGUF file {path}: transformers reads it as model_type 'mistral' "
                       r"\(from its general.name 'mistral'\), not as 'llama'.*gguf-new-metadata --general-name"):
        load_source(path, device="cpu")


def test_gguf_tensor_type_the_gguf_package_cannot_dequantise_is_refused(tmp_path):
    path = write_gguf(tmp_path / "f64.gguf", gguf_model(), tensor_dtype=np.float64)
    with pytest.raises(ConfigError, match=rf"GGUF file {path} stores tensor blk.0.attn_norm.weight as F64, which the "
                       "gguf package cannot dequantise: re-convert the model to a type it dequantises, such as F32, F16"):
        load_source(path, device="cpu")


def test_gguf_lacking_a_tensor_is_refused(tmp_path, monkeypatch):
    reference = gguf_model()
    parameters = reference.state_dict()
    del parameters["model.layers.1.self_attn.k_proj.weight"]
    monkeypatch.setattr(reference, "state_dict", lambda: parameters)
    path = write_gguf(tmp_path / "lacking.gguf", reference)
    with pytest.raises(ConfigError, match=rf"checkpoint {path} lacks 1 tensor\(s\) that LlamaForCausalLM needs, e.g. "
                       r"\['model.layers.1.self_attn.k_proj.weight'\]: the model would run with random weights there; "
                       r"give a GGUF file converted by llama.cpp's convert_hf_to_gguf.py"):
        load_source(path, device="cpu")


def test_unsupported_hugging_face_class_is_refused():
    from transformers import GPT2Model

    from orthosphere.extract.adapters import adapter_for

    with pytest.raises(UnsupportedModelError, match="expected GPT2LMHeadModel"):
        adapter_for(GPT2Model(hf_config("gpt2")))


def test_damaged_safetensors_index_is_a_clear_error(tmp_path):
    directory = write_hf_model(tmp_path / "llama", "llama")
    (directory / "model.safetensors").unlink()
    (directory / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not a safetensors index"):
        load_source(directory)


def test_a_gguf_cut_short_anywhere_before_its_tensor_data_is_refused_as_unreadable(tmp_path):
    import gguf

    whole = write_gguf(tmp_path / "whole.gguf", gguf_model())
    data = whole.read_bytes()
    end = gguf.GGUFReader(whole).data_offset
    for cut in sorted({8, 24, 194, *range(40, end, max(1, end // 12)), end - 50}):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ConfigError, match="is not a readable GGUF file"):
            load_source(tmp_path / "cut.gguf", device="cpu")


def _bpe_tokenizer_without_merges(writer) -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + GGUF_TOKENS_EXTRA
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_eos_token_id(GGUF_SPECIAL_ID)


def test_a_gguf_whose_tokenizer_metadata_is_incomplete_is_refused_naming_the_file(tmp_path, monkeypatch):
    import tests.test_extract_models as this

    monkeypatch.setattr(this, "_write_gguf_tokenizer", _bpe_tokenizer_without_merges)
    path = write_gguf(tmp_path / "no-merges.gguf", gguf_model())
    with pytest.raises(ConfigError, match=rf"GGUF file {path}: its tokenizer cannot be built from its tokenizer.ggml.\* metadata "
                                          r"\(KeyError: .*\); use a GGUF file converted with its whole tokenizer"):
        load_source(path, device="cpu")


def test_a_part_of_a_split_gguf_and_a_big_endian_gguf_are_refused_with_what_to_do(tmp_path, monkeypatch):
    import gguf

    import tests.test_extract_models as this

    written_metadata = this._write_gguf_metadata

    def with_split(writer, *arguments):
        written_metadata(writer, *arguments)
        writer.add_uint16("split.no", 0)
        writer.add_uint16("split.count", 2)

    monkeypatch.setattr(this, "_write_gguf_metadata", with_split)
    part = write_gguf(tmp_path / "model-00001-of-00002.gguf", gguf_model())
    with pytest.raises(ConfigError, match=r"is one part of a GGUF file split in 2: merge the parts into one file first "
                                          r"\(llama.cpp's `llama-gguf-split --merge"):
        load_source(part, device="cpu")
    monkeypatch.setattr(this, "_write_gguf_metadata", written_metadata)
    monkeypatch.setattr(gguf, "GGUFWriter", functools.partial(gguf.GGUFWriter, endianess=gguf.GGUFEndian.BIG))
    big = write_gguf(tmp_path / "big.gguf", gguf_model())
    with pytest.raises(ConfigError, match=r"big.gguf is a big-endian GGUF file, which transformers does not read: convert it"):
        load_source(big, device="cpu")
