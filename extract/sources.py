"""Load a model for extraction: the project's checkpoints, Hugging Face directories, GGUF files.

``load_source(path, device, model_dtype)`` returns a ``LoadedModel``: the model's adapter
(``adapters``), its tokenizer (or None: such a model reads only corpora of token ids, with the
special tokens its config.json names) and, from ``describe()``, its description for the store,
which adds where the model came from and a SHA-256 of its weights (hashing.py: computed once per
version of the files) so that a resumed job can tell a different model apart. ``model_dtype``
(float32, bfloat16 or float16; default float32) is the dtype the model is loaded and run in; the
description records it.

- A directory whose ``config.json`` says ``"family": "arithmetic"``: the project's own
  arithmetic transformer (``config.json`` + ``model.safetensors``); its tokenizer maps the
  task's characters to ids.
- Any other directory: a Hugging Face checkpoint of a supported ``model_type`` (the families
  of ``families.py``) with safetensors weights, loaded with its language-model head; an encoder
  checkpoint without its head (and T5, read as its encoder) is loaded without one, and its store
  holds no ``pred``. A checkpoint that lacks any other tensor the model needs is refused (never
  silently random-initialised). A sentence-transformers directory is such a checkpoint (its
  body's weights without the base model's prefix, no head); one whose transformer module sits in
  a subfolder (``modules.json`` naming it, as older ones' ``0_Transformer/``) is read from there.
- A ``.gguf`` file of an architecture that transformers reads from GGUF and whose model_type is a
  family (``gguf_architectures()``, derived from transformers and the gguf package at run time):
  loaded by transformers (``gguf_file=``) as that family's language-model class, dequantised to
  float32 (``model_dtype`` does not apply); it must carry its tokenizer. It is described exactly as
  the same model loaded from a directory but for its source, format and weights' hash. What the
  file does not state keeps transformers' config defaults (a GPT-2 GGUF has GPT-2's 1024 positions
  and 4 * d_model feed-forward width, a Falcon one is multi-query). Refused, naming the file: an
  architecture transformers does not read, reads as a model_type without a family, cannot map the
  tensors of (e.g. "mistral") or reads as another model than the file's (T5: ``GGUF_MISREAD``), a
  tensor type the gguf package cannot dequantise, a tensor the model needs that the file lacks.

Nothing runs remote code and nothing is unpickled (``.bin``/``.pt`` weights are refused).
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from orthosphere.store.schema import ACTIVATION_DTYPES

from .adapters import Adapter, adapter_for
from .families import FAMILIES, REFUSED, UnsupportedModelError, family_for
from .hashing import files_sha256, tensors_sha256
from .model import CONFIG_FILE, WEIGHTS_FILE, ArithmeticTransformer, ConfigError, load_model
from .tasks import CHARACTERS, PAD_ID, TOKEN_ID, token_ids

SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth")
GGUF_MAGIC = b"GGUF"
SENTENCE_TRANSFORMERS_MODULES = "modules.json"
MODEL_DTYPES = ACTIVATION_DTYPES
"""The dtypes a model is loaded and run in: those a store holds, so that a model's activations can be stored in
the dtype it computed them in."""


class Tokenizer:
    """Text to token ids, and ids back to token strings (for the `token_str` label); bos_id and
    eos_id are the start and end tokens it knows as special tokens (None: none; `lacks_special`
    says why, for errors)."""

    name = ""
    lacks_special = "the tokenizer has none"
    pad_id = 0
    bos_id: int | None = None
    eos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str], special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text, with the special tokens the tokenizer adds to a text (BOS, [CLS]
        ... [SEP]) or without them."""
        raise NotImplementedError

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A text's token ids without special tokens, and each token's start and end character offsets."""
        raise ConfigError(f"a whole text file (document=file) is tokenised with character offsets, which {self.name} "
                          "does not give: use a fast tokenizer (tokenizer.json) or document=line")

    def special_affixes(self) -> tuple[list[int], list[int]]:
        """The special tokens the tokenizer adds before and after a text's own."""
        return [], []

    def token_strings(self, ids) -> list[str]:
        raise NotImplementedError

    def sha256(self) -> str:
        """A SHA-256 of what the tokenizer turns text into (vocabulary, rules, special tokens), so that
        a resumed job can tell a different tokenizer of the same class apart (a slow Hugging Face
        tokenizer without its vocabulary files: its vocabulary and special tokens only)."""
        return hashlib.sha256(self._definition().encode()).hexdigest()

    def _definition(self) -> str:
        raise NotImplementedError


class CharacterTokenizer(Tokenizer):
    """The arithmetic task's: one character a token."""

    name = "arithmetic-characters"
    pad_id = PAD_ID
    bos_id = TOKEN_ID["["]
    eos_id = TOKEN_ID["]"]

    def encode_batch(self, texts, special_tokens=True):
        return [token_ids(text) for text in texts]

    def token_strings(self, ids):
        return [CHARACTERS[i] if i < len(CHARACTERS) else "" for i in ids]

    def _definition(self):
        return json.dumps(["".join(CHARACTERS), self.pad_id, self.bos_id, self.eos_id])


class TokenIds(Tokenizer):
    """For a corpus given as token ids with a model that has no tokenizer files: each token's string
    is its id; the special tokens are those the model's config.json declares."""

    name = "token ids (no tokenizer)"
    lacks_special = "the model has no tokenizer files and its config.json names none"

    def __init__(self, config: dict):
        self.bos_id, self.eos_id = _declared_id(config, "bos_token_id"), _declared_id(config, "eos_token_id")
        self.pad_id = next(i for i in (_declared_id(config, "pad_token_id"), self.eos_id, 0) if i is not None)

    def token_strings(self, ids):
        return [str(int(i)) for i in ids]

    def _definition(self):
        return json.dumps([self.name, self.pad_id, self.bos_id, self.eos_id])


def _declared_id(config: dict, key: str) -> int | None:
    """A token id that config.json sets (the first of a list of them), else None."""
    value = config.get(key)
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class HuggingFaceTokenizer(Tokenizer):
    """A transformers tokenizer, with the special tokens it adds by default (BOS, [CLS]...). Its BOS
    is its BOS token, else its [CLS], else the model config's bos_token_id (its EOS likewise: EOS,
    [SEP], eos_token_id), each only if the tokenizer holds it as a special token: never its unknown
    token, which stands for a token it lacks, nor an ordinary token that a config's default names."""

    def __init__(self, tokenizer, config: dict | None = None):
        self.tokenizer = tokenizer
        self.name = type(tokenizer).__name__
        self.lacks_special = (f"the tokenizer ({self.name}) has none as a special token, nor does the model's "
                              "config.json name one of its special tokens")
        candidates = (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id, 0)
        self.pad_id = next(i for i in candidates if i is not None)
        special = set(tokenizer.all_special_ids) | {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
        special.discard(tokenizer.unk_token_id)
        config = config or {}
        bos = (tokenizer.bos_token_id, tokenizer.cls_token_id, _declared_id(config, "bos_token_id"))
        eos = (tokenizer.eos_token_id, tokenizer.sep_token_id, _declared_id(config, "eos_token_id"))
        self.bos_id = next((i for i in bos if i in special), None)
        self.eos_id = next((i for i in eos if i in special), None)

    def encode_batch(self, texts, special_tokens=True):
        encoded = self.tokenizer(texts, add_special_tokens=special_tokens, return_attention_mask=False, verbose=False)
        return encoded["input_ids"]

    def encode_offsets(self, text):
        if not self.tokenizer.is_fast:
            return super().encode_offsets(text)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True,
                                 return_attention_mask=False, verbose=False)
        offsets = np.asarray(encoded["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        return np.asarray(encoded["input_ids"], dtype=np.int64), offsets[:, 0], offsets[:, 1]

    def special_affixes(self):
        encoded = self.tokenizer("a", return_special_tokens_mask=True, return_attention_mask=False, verbose=False)
        ids, special = encoded["input_ids"], encoded["special_tokens_mask"]
        own = [i for i, flag in enumerate(special) if not flag] or [len(ids)]
        return ids[: own[0]], ids[own[-1] + 1:]

    def token_strings(self, ids):
        return self.tokenizer.convert_ids_to_tokens([int(i) for i in ids])

    def _definition(self):
        """A fast tokenizer's whole backend (vocabulary, rules, normalizer...). A slow one's vocabulary
        (added tokens included) and the SHA-256 of its vocabulary files (its class's
        vocab_files_names found in the folder it was loaded from: merges, a SentencePiece model's
        scores...); without such files (a tokenizer built in memory), its vocabulary alone, which
        leaves its rules and scores out."""
        if self.tokenizer.is_fast:
            backend = self.tokenizer.backend_tokenizer.to_str()
        else:
            files = self._vocabulary_files()
            backend = [json.dumps(self.tokenizer.get_vocab(), sort_keys=True), files_sha256(files) if files else None]
        return json.dumps([self.name, backend, self.pad_id, self.bos_id, self.eos_id])

    def _vocabulary_files(self) -> list[Path]:
        """The slow tokenizer's vocabulary files in the folder it was loaded from, in its class's order."""
        folder = self.tokenizer.name_or_path
        if not folder or not os.path.isdir(folder):
            return []
        candidates = (Path(folder) / name for name in self.tokenizer.vocab_files_names.values())
        return [path for path in candidates if path.is_file()]


@dataclass
class LoadedModel:
    """A model ready for extraction; describe() hashes its weights (once) for the store."""

    adapter: Adapter
    tokenizer: Tokenizer | None
    path: Path | None
    """None for a model handed over in memory (``from_model``)."""
    source_format: str
    weight_files: list[Path]
    config: dict = field(default_factory=dict)
    """The model's config.json as written (empty for a GGUF file)."""
    _description: dict | None = None

    def corpus_tokenizer(self, tokenized: bool) -> Tokenizer | None:
        """What a corpus is read with: the model's tokenizer; for token ids with a model that has
        none, TokenIds (the special tokens of its config.json)."""
        if self.tokenizer is None and tokenized:
            return TokenIds(self.config)
        return self.tokenizer

    def describe(self) -> dict:
        """The store's `model` attribute: the adapter's description, the source and its weights' SHA-256."""
        if self._description is None:
            in_memory = self.path is None
            self._description = {
                **self.adapter.describe(),
                "source": f"in memory ({type(self.adapter.model).__name__})" if in_memory else os.path.abspath(self.path),
                "format": self.source_format,
                "weights_sha256": tensors_sha256(self.adapter.model) if in_memory else files_sha256(self.weight_files),
            }
        return dict(self._description)


def check_device(device: str = "auto") -> str:
    """The device text, checked for its form only (where the model runs may be another machine)."""
    if device != "auto":
        try:
            torch.device(device)
        except RuntimeError as error:
            raise ConfigError(f"device {device!r}: {error}; expected auto, cpu, cuda or cuda:N") from None
    return device


def resolve_device(device: str = "auto") -> torch.device:
    """"auto" means CUDA when available, else the CPU; a device this machine lacks is an error."""
    if check_device(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r}: this machine has no CUDA device; use device=cpu (or auto)")
    return resolved


def model_dtype_of(name: str | None) -> torch.dtype:
    """The torch dtype of a model_dtype name (None: float32)."""
    name = name or "float32"
    if name not in MODEL_DTYPES:
        raise ConfigError(f"model dtype {name!r}: expected one of {list(MODEL_DTYPES)}")
    return getattr(torch, name)


def check_device_runs(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a dtype the device cannot compute in, before a model is loaded."""
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"device {device} cannot compute in bfloat16 (this GPU lacks it): use model_dtype=float16 "
                          "or float32")
    try:
        probe = torch.ones(2, 2, dtype=dtype, device=device)
        (probe @ probe).sum().item()
    except RuntimeError as error:
        raise ConfigError(f"device {device} cannot compute in {str(dtype).removeprefix('torch.')} ({error}): "
                          "choose another model_dtype= or device=") from None


def load_source(path, device: str = "auto", model_dtype: str | None = None) -> LoadedModel:
    """Load the model at `path` (directory or .gguf file) in eval mode on `device`, in `model_dtype`."""
    path = Path(path)
    device = resolve_device(device)
    dtype = model_dtype_of(model_dtype)
    if not path.exists():
        raise ConfigError(
            f"model {path} not found: expected a model directory (config.json and model.safetensors) "
            "or a .gguf file"
        )
    check_device_runs(device, dtype)
    if path.is_file():
        if not is_gguf(path):
            raise ConfigError(f"model {path} is a file but not a GGUF file (no GGUF magic): give a .gguf file or a model directory")
        if dtype != torch.float32:
            raise ConfigError(f"model_dtype={model_dtype} with the GGUF file {path}: GGUF weights are dequantised "
                              "to float32; leave model_dtype= out (or convert the model to safetensors)")
        loaded = _load_gguf(path, device)
    else:
        path = _model_directory(path)
        config = _read_config(path)
        if config.get("family") == "arithmetic":
            loaded = _load_arithmetic(path, device, dtype)
        else:
            loaded = _load_hugging_face(path, config, device, dtype)
    loaded.adapter.model.eval()
    return loaded


def from_model(model, tokenizer=None, device: str = "auto") -> LoadedModel:
    """A model loaded in this process, ready for extraction: a transformers model of a supported
    family (with its transformers `tokenizer`; without one it reads token-id corpora only), an
    orthosphere arithmetic model, or the adapter of either. It runs where it is (device "auto") or
    is moved to `device`, in its own dtype; its weights' hash is taken from its tensors."""
    if isinstance(model, LoadedModel):
        return model
    if isinstance(model, Adapter):
        model = model.model
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model of type {type(model).__name__}: expected a path (a model directory or .gguf file), "
                          "a loaded transformers model or an orthosphere arithmetic model")
    if device != "auto":
        model = model.to(resolve_device(device))
    adapter = adapter_for(model.eval())
    if isinstance(model, ArithmeticTransformer):
        if tokenizer is not None:
            raise ConfigError("tokenizer= with an arithmetic model: it reads the task's characters; leave tokenizer out")
        return LoadedModel(adapter, CharacterTokenizer(), None, "in-memory", [])
    config = model.config.to_dict()
    if tokenizer is not None and not hasattr(tokenizer, "convert_ids_to_tokens"):
        raise ConfigError(f"tokenizer of type {type(tokenizer).__name__}: expected a transformers tokenizer "
                          "(AutoTokenizer.from_pretrained(...)) or None")
    wrapped = None if tokenizer is None else HuggingFaceTokenizer(tokenizer, config)
    return LoadedModel(adapter, wrapped, None, "in-memory", [], config)


def is_gguf(path: Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(4) == GGUF_MAGIC


def _model_directory(directory: Path) -> Path:
    """The folder holding the model's config.json: `directory`, or, for a sentence-transformers
    directory without one, the folder of the transformer module its modules.json names."""
    modules_file = directory / SENTENCE_TRANSFORMERS_MODULES
    if (directory / CONFIG_FILE).is_file() or not modules_file.is_file():
        return directory
    try:
        modules = json.loads(modules_file.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{modules_file} is not valid JSON ({error}): expected sentence-transformers' module list") from None
    paths = [module.get("path", "") for module in modules if isinstance(module, dict)
             and str(module.get("type", "")).endswith(".Transformer")] if isinstance(modules, list) else []
    if len(paths) != 1:
        raise ConfigError(
            f"sentence-transformers directory {directory} has no {CONFIG_FILE} and its {SENTENCE_TRANSFORMERS_MODULES} "
            f"names {len(paths)} Transformer modules: expected one (sentence_transformers.models.Transformer), whose "
            "folder holds the model; give that folder"
        )
    return directory / paths[0]


def _read_config(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(
            f"model directory {directory} has no {CONFIG_FILE}: expected a model directory holding "
            f"{CONFIG_FILE} and {WEIGHTS_FILE} (or a .gguf file)"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is not valid JSON ({error}): expected the model's configuration") from None


def _load_arithmetic(directory: Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise ConfigError(f"model directory {directory} has no {WEIGHTS_FILE}: expected the weights beside {CONFIG_FILE}")
    check_safetensors([weights])
    adapter = adapter_for(load_model(directory, device=device).to(dtype))
    return LoadedModel(adapter, CharacterTokenizer(), directory, "orthosphere", [weights])


def check_safetensors(paths) -> None:
    """Raise a ConfigError naming the first weights file that is missing, truncated or not safetensors."""
    from safetensors import SafetensorError, safe_open

    for path in paths:
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except (SafetensorError, OSError) as error:
            raise ConfigError(
                f"weights file {path} cannot be read ({error}): it is truncated, damaged or not a safetensors file; "
                "copy or save the checkpoint again"
            ) from None


def _safetensors_files(directory: Path) -> list[Path]:
    single = directory / WEIGHTS_FILE
    if single.is_file():
        return [single]
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as error:
            raise ConfigError(f"{index} is not a safetensors index (JSON with a weight_map): {error}; "
                              "re-save the checkpoint with save_pretrained") from None
        return [directory / shard for shard in shards]
    pickled = [name for name in PICKLED_WEIGHTS if (directory / name).is_file()]
    if pickled:
        raise ConfigError(
            f"model directory {directory} holds only pickled weights ({pickled[0]}); orthosphere never "
            "unpickles: convert them to safetensors (model.safetensors) first"
        )
    raise ConfigError(
        f"model directory {directory} has no weights: expected {WEIGHTS_FILE} (or {SAFETENSORS_INDEX} "
        "with its shards) beside config.json"
    )


def _model_class(model_type):
    import transformers

    return getattr(transformers, family_for(model_type).lm_class)


def _load_hugging_face(directory: Path, config: dict, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    family = family_for(config.get("model_type"))
    weight_files = _safetensors_files(directory)
    check_safetensors(weight_files)
    model = _complete_model(directory, family, dtype)
    adapter = adapter_for(model.to(device))
    return LoadedModel(adapter, _directory_tokenizer(directory, config), directory, "safetensors", weight_files, config)


def _complete_model(directory: Path, family, dtype: torch.dtype):
    """The family's language-model class loaded from the checkpoint; for an encoder whose checkpoint
    lacks only its head's tensors (a sentence-embedding checkpoint), and for a family read without a
    head (T5's encoder), the class without the head, whose store holds no `pred`. A checkpoint that
    lacks any other tensor is refused: the model would run with random weights there."""
    import transformers

    if family.lm_class is not None:
        lm_class = getattr(transformers, family.lm_class)
        model, missing = _from_pretrained(lm_class, directory, dtype)
        body = [key for key in missing if key.startswith(f"{lm_class.base_model_prefix}.")]
        if not missing:
            return model
        if body or family.base_class is None:
            raise _incomplete(directory, lm_class, body or missing)
    base_class = getattr(transformers, family.base_class)
    model, missing = _from_pretrained(base_class, directory, dtype)
    if missing:
        raise _incomplete(directory, base_class, missing)
    return model


def _from_pretrained(model_class, directory: Path, dtype: torch.dtype):
    """The model and the sorted names of the tensors the checkpoint lacks; an encoder without its
    head is built without a pooler, which no stored activation depends on. The config is read by the
    checkpoint's own config class (AutoConfig), so that a family that borrows another's model class
    (InternLM3 and EXAONE read by Llama's) keeps its own names for the sizes (EXAONE's ``num_layers``)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    options = {}
    if "add_pooling_layer" in inspect.signature(model_class.__init__).parameters:
        options["add_pooling_layer"] = False
    model, info = model_class.from_pretrained(
        directory, config=config, use_safetensors=True, local_files_only=True, trust_remote_code=False, dtype=dtype,
        output_loading_info=True, ignore_mismatched_sizes=True, **options,
    )
    if info["mismatched_keys"]:
        raise _mismatched(directory, model_class, info["mismatched_keys"],
                          "the checkpoint does not match its config.json (a mixture of experts lacking an expert's "
                          "tensors, for one); give a complete checkpoint")
    return model, sorted(info["missing_keys"])


def _incomplete(source: Path, model_class, missing: list[str], advice: str = "give a complete checkpoint") -> ConfigError:
    """The refusal of a checkpoint (directory or GGUF file) that lacks tensors the model needs."""
    return ConfigError(
        f"checkpoint {source} lacks {len(missing)} tensor(s) that {model_class.__name__} needs, e.g. "
        f"{missing[:3]}: the model would run with random weights there; {advice}"
    )


def _mismatched(source: Path, model_class, mismatched, why: str) -> ConfigError:
    """The refusal of a checkpoint (directory or GGUF file) whose tensors have other shapes than the model's."""
    key, in_file, expected = sorted(mismatched)[0]
    return ConfigError(
        f"checkpoint {source}: tensor {key} has the shape {tuple(in_file)} there but {model_class.__name__} expects "
        f"{tuple(expected)} ({len(mismatched)} tensor(s) differ; the model would run with random weights there): {why}"
    )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model")


def _directory_tokenizer(directory: Path, config: dict) -> HuggingFaceTokenizer | None:
    """The directory's tokenizer, or None when it has no tokenizer files."""
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return None
    return _auto_tokenizer(directory, config)


def _auto_tokenizer(directory: Path, config: dict | None = None, **options) -> HuggingFaceTokenizer:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False, **options)
    return HuggingFaceTokenizer(tokenizer, config)


GGUF_READ_AS = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}
"""GGUF architectures that transformers reads as another model_type: the text model of a multimodal
one (transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint renames them)."""

GGUF_FILE_ARCHITECTURE = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss", "minimax_m2": "minimax-m2"}
"""transformers' names of GGUF architectures that llama.cpp's files (and the gguf package) spell otherwise."""


GGUF_MISREAD = dict.fromkeys(("t5", "umt5"), (
    "transformers reads every T5 GGUF file as a T5 with a gated ReLU feed-forward (its GGUF reader sets "
    "is_gated_act and no activation), which no released T5 is (T5 1.0: ReLU without a gate; T5 1.1, Flan-T5, "
    "mT5, UMT5: gated GELU), so its activations would not be the model's")) | {
    "gpt_oss": ("transformers' GGUF reader maps GPT-OSS's expert tensors (llama.cpp's ffn_gate_exps, ffn_up_exps, "
                "ffn_down_exps) to none of GptOssForCausalLM's fused mlp.experts tensors, so its experts would keep "
                "random weights; load GPT-OSS from its safetensors directory")}
"""model_types whose GGUF files transformers does not read as the file's model, and why."""


def gguf_architectures() -> dict[str, str]:
    """GGUF architecture -> model_type, for each architecture that transformers reads from GGUF
    (transformers.modeling_gguf_pytorch_utils.GGUF_SUPPORTED_ARCHITECTURES, whose tensor names the
    gguf package knows) and whose model_type is a family of extract/families.py, but for GGUF_MISREAD."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    named = set(gguf.MODEL_ARCH_NAMES.values())
    model_types = {GGUF_FILE_ARCHITECTURE.get(name, name): GGUF_READ_AS.get(name, name)
                   for name in GGUF_SUPPORTED_ARCHITECTURES if GGUF_FILE_ARCHITECTURE.get(name, name) in named}
    return {name: model_type for name, model_type in model_types.items()
            if model_type in FAMILIES and model_type not in GGUF_MISREAD}


def _gguf_reader(path: Path):
    """The gguf package's reader of a whole, little-endian, unsplit GGUF file (transformers reads no other)."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError) as error:  # IndexError: a file cut short in its header or tensor table
        raise ConfigError(f"{path} is not a readable GGUF file (cut short or damaged?): {error}") from None
    if reader.endianess != gguf.GGUFEndian.LITTLE:
        raise ConfigError(f"{path} is a big-endian GGUF file, which transformers does not read: convert it to "
                          "little-endian (e.g. with the gguf package's gguf-convert-endian script)")
    parts = reader.get_field("split.count")
    if parts is not None and int(parts.contents()) > 1:
        raise ConfigError(f"{path} is one part of a GGUF file split in {int(parts.contents())}: merge the parts into one "
                          "file first (llama.cpp's `llama-gguf-split --merge FIRST-PART OUT.gguf`)")
    return reader


def _gguf_metadata(reader) -> dict:
    """The GGUF file's scalar metadata (architecture, tokenizer model...)."""
    wanted = ("general.architecture", "general.name", "tokenizer.ggml.model")
    metadata = {}
    for key in wanted:
        field = reader.get_field(key)
        if field is not None:
            metadata[key] = field.contents()
    metadata["has_tokens"] = reader.get_field("tokenizer.ggml.tokens") is not None
    return metadata


def _check_gguf_architecture(path: Path, architecture) -> str:
    """The model_type of a GGUF file's architecture; an UnsupportedModelError for one that gives no
    model of a family (transformers does not read it, cannot map its tensors, or no family has its model_type)."""
    accepted = gguf_architectures()
    if architecture in accepted:
        return accepted[architecture]
    raise UnsupportedModelError(
        f"GGUF file {path} has the architecture {architecture!r}: {_why_gguf_refused(path, architecture)}; GGUF files "
        f"load for the architectures {sorted(accepted)}: give one of them, or the model as a Hugging Face directory "
        "of a supported family"
    )


def _why_gguf_refused(path: Path, architecture) -> str:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError, IndexError):
        return "transformers does not read that architecture from GGUF"
    if config.model_type in GGUF_MISREAD:
        return GGUF_MISREAD[config.model_type]
    if config.model_type in FAMILIES:
        return (f"transformers reads its configuration as model_type {config.model_type!r} but cannot map its tensors "
                f"(the gguf package names no architecture {architecture!r})")
    if config.model_type in REFUSED:
        return f"transformers reads it as model_type {config.model_type!r}, which orthosphere refuses: {REFUSED[config.model_type]}"
    return (f"transformers reads it as model_type {config.model_type!r}, which has no family in extract/families.py "
            "(module orthosphere.extract.families)")


def _check_gguf_tensor_types(path: Path, reader) -> None:
    """Refuse a tensor type the gguf package cannot dequantise, naming it (the smallest tensor of each
    type is dequantised as the test)."""
    from gguf import dequantize

    smallest = {}
    for tensor in reader.tensors:
        if tensor.tensor_type not in smallest or tensor.n_elements < smallest[tensor.tensor_type].n_elements:
            smallest[tensor.tensor_type] = tensor
    for tensor_type, tensor in smallest.items():
        try:
            dequantize(tensor.data, tensor_type)
        except NotImplementedError:
            raise ConfigError(
                f"GGUF file {path} stores tensor {tensor.name} as {tensor_type.name}, which the gguf package cannot "
                f"dequantise: re-convert the model to a type it dequantises, such as F32, F16 or Q8_0"
            ) from None


def _gguf_config(path: Path, metadata: dict, model_type: str):
    """The transformers config of a GGUF file, which must be of the model_type its architecture names
    (transformers reads a llama file whose general.name is "mistral" as a Mistral model)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True, trust_remote_code=False)
    if config.model_type != model_type:
        raise UnsupportedModelError(
            f"GGUF file {path}: transformers reads it as model_type {config.model_type!r} (from its general.name "
            f"{metadata.get('general.name')!r}), not as {model_type!r}, the model_type of its architecture "
            f"{metadata['general.architecture']!r}, and cannot map its tensors then; give the file another name "
            "(the gguf package's gguf-new-metadata --general-name)"
        )
    return config


def _load_gguf(path: Path, device: torch.device) -> LoadedModel:
    reader = _gguf_reader(path)
    metadata = _gguf_metadata(reader)
    model_type = _check_gguf_architecture(path, metadata.get("general.architecture"))
    if "tokenizer.ggml.model" not in metadata or not metadata["has_tokens"]:
        raise ConfigError(
            f"GGUF file {path} holds no tokenizer (no tokenizer.ggml.model / tokenizer.ggml.tokens metadata): "
            "transformers needs it to build the model's vocabulary; use a GGUF file converted with its tokenizer"
        )
    _check_gguf_tensor_types(path, reader)
    tokenizer = _gguf_tokenizer(path)
    config = _gguf_config(path, metadata, model_type)
    model_class = _model_class(model_type)
    model, info = model_class.from_pretrained(
        path.parent, gguf_file=path.name, config=config, local_files_only=True, trust_remote_code=False,
        dtype=torch.float32, output_loading_info=True, ignore_mismatched_sizes=True,
    )
    missing = sorted(info["missing_keys"])
    if missing:
        raise _incomplete(path, model_class, missing, "give a GGUF file converted by llama.cpp's "
                          "convert_hf_to_gguf.py with every tensor")
    if info["mismatched_keys"]:
        raise _mismatched(path, model_class, info["mismatched_keys"],
                          "transformers takes the sizes the file's metadata does not state (for Qwen2-MoE and "
                          "Qwen3-MoE, the experts' widths) from its config defaults, which this model does not have; "
                          "convert the model to safetensors instead")
    return LoadedModel(adapter_for(model.to(device)), tokenizer, path, "gguf", [path])


def _gguf_tokenizer(path: Path) -> HuggingFaceTokenizer:
    """The tokenizer transformers builds from the file's tokenizer.ggml.* metadata, or a ConfigError naming
    the file where that metadata is incomplete or of a kind transformers cannot build."""
    try:
        return _auto_tokenizer(path.parent, gguf_file=path.name)
    except Exception as error:  # noqa: BLE001 -- transformers' builder raises KeyError, IndexError, ValueError ...
        raise ConfigError(f"GGUF file {path}: its tokenizer cannot be built from its tokenizer.ggml.* metadata "
                          f"({type(error).__name__}: {error}); use a GGUF file converted with its whole tokenizer") from None
