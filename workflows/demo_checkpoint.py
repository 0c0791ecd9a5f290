"""The stand-in Hugging Face checkpoint that `workflows/configs/hf-text.toml` runs on.

orthosphere downloads nothing, so the text pipeline ships a tiny Llama-family checkpoint
(grouped-query attention, rotary positions; random weights, seeded) with a word-level tokenizer
over the words of `workflows/data/sentences.txt`. Point the pipeline's `path` at a real local
checkpoint (a directory with safetensors weights, or a .gguf file) for real results.
Rebuild it with `python -m orthosphere.workflows.demo_checkpoint`.
"""
from __future__ import annotations

from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SPECIALS = ["[PAD]", "[UNK]", "<s>"]


def vocabulary(text_file: Path) -> list[str]:
    words = sorted({word for line in text_file.read_text().splitlines() for word in line.split()})
    return SPECIALS + words


def write_demo_llama(directory: Path, text_file: Path, seed: int = 0) -> Path:
    """Save a tiny random Llama (2 layers, d_model 64, 4 heads, 2 key-value heads) and its tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = vocabulary(text_file)
    backend = Tokenizer(models.WordLevel({word: index for index, word in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", bos_token="<s>")
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(words), max_position_embeddings=128, bos_token_id=2, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


if __name__ == "__main__":
    print(write_demo_llama(HERE / "models" / "demo-llama", HERE / "data" / "sentences.txt"))
