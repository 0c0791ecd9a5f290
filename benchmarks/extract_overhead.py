"""Extraction overhead: `orthosphere extract` beside the bare forward pass over the same batches.

Builds a Llama-family model of SmolLM2-135M's shape (30 layers, d_model 576, 9 heads, 3
key-value heads, vocabulary 49152, random weights, nothing downloaded), a word-level
tokenizer and a text file whose lines are `--seq` tokens long. Then, each in a fresh process,
times the bare forward pass (transformers' default attention, logits only) and the extraction
of every site but `pattern` in float16 into a store on the same disk, over the same batches,
and prints wall and CPU seconds, the ratios extraction / bare forward and the peak resident
memory of both. The bare forward runs before and after the extraction; the ratios use their
mean. On a machine shared with other work the wall-clock ratio is noisy; the CPU-time ratio
(all threads of the process, the writer thread included) is the steadier measure of the work
extraction adds.

Usage: python benchmarks/extract_overhead.py [--batches 4] [--batch-size 8] [--seq 128] [--layers 30]
       [--threads N] [--dir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time

SHAPE = {  # SmolLM2-135M
    "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
    "vocab_size": 49152, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}


def build(directory: str, layers: int, n_lines: int, seq: int) -> tuple[str, str]:
    """The model directory (safetensors, tokenizer) and the text file; returns their paths."""
    import numpy as np
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    model_dir = os.path.join(directory, "smollm2-shape")
    config = LlamaConfig(num_hidden_layers=layers, rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, **SHAPE)
    LlamaForCausalLM(config).save_pretrained(model_dir, safe_serialization=True)
    words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(SHAPE["vocab_size"] - 3)]
    backend = Tokenizer(models.WordLevel({word: index for index, word in enumerate(words)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>").save_pretrained(model_dir)
    rng = np.random.default_rng(0)
    text = os.path.join(directory, "lines.txt")
    with open(text, "w") as handle:
        for _ in range(n_lines):
            handle.write(" ".join(words[i] for i in rng.integers(3, len(words), size=seq - 1)) + "\n")
    return model_dir, text


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_bare(model_dir: str, text: str, batch_size: int, seq: int) -> dict:
    """The forward pass alone over the batches that the extraction runs."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    began = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open(text) as handle:
        lines = [line.rstrip("\n") for line in handle if line.strip()]
    batches = []
    for first in range(0, len(lines), batch_size):
        encoded = tokenizer(lines[first:first + batch_size], return_tensors="pt", padding="max_length", max_length=seq)
        batches.append((encoded["input_ids"], encoded["attention_mask"]))
    setup = time.perf_counter() - began
    began, cpu_began = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for tokens, mask in batches:
            model(input_ids=tokens, attention_mask=mask, use_cache=False)
    return {"seconds": time.perf_counter() - began, "cpu_seconds": time.process_time() - cpu_began,
            "setup_seconds": setup, "peak_rss_mb": peak_rss_mb(),
            "tokens": int(sum(int(mask.sum()) for _, mask in batches))}


def child_extract(model_dir: str, text: str, batch_size: int, seq: int, out: str) -> dict:
    from orthosphere.extract.job import ExtractJob, extract

    began = time.perf_counter()
    result = extract(ExtractJob(model=model_dir, task=f"text:path={text},max_length={seq}", out=out, dtype="float16",
                                batch_size=batch_size, device="cpu", overwrite=True), progress=False)
    total = time.perf_counter() - began
    size = sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(out) for name in names)
    return {"seconds": result.seconds, "cpu_seconds": result.cpu_seconds, "setup_seconds": total - result.seconds,
            "peak_rss_mb": peak_rss_mb(),
            "tokens": result.tokens, "store_mb": size / 2**20}


def run_child(kind: str, arguments, model_dir: str, text: str) -> dict:
    command = [sys.executable, __file__, "--child", kind, "--model-dir", model_dir, "--text", text,
               "--batch-size", str(arguments.batch_size), "--seq", str(arguments.seq), "--dir", arguments.dir]
    if arguments.threads:
        command += ["--threads", str(arguments.threads)]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None, help="torch threads in both runs (default: torch's).")
    parser.add_argument("--dir", default=None, help="Where the model, text and store go (default: a temporary folder).")
    parser.add_argument("--child", choices=["bare", "extract"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--text", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.child and arguments.threads:
        import torch

        torch.set_num_threads(arguments.threads)
    if arguments.child == "bare":
        print(json.dumps(child_bare(arguments.model_dir, arguments.text, arguments.batch_size, arguments.seq)))
        return
    if arguments.child == "extract":
        out = os.path.join(arguments.dir, "store.zarr")
        print(json.dumps(child_extract(arguments.model_dir, arguments.text, arguments.batch_size, arguments.seq, out)))
        return

    own_dir = arguments.dir is None
    arguments.dir = arguments.dir or tempfile.mkdtemp(prefix="orthosphere-extract-bench-")
    try:
        model_dir, text = build(arguments.dir, arguments.layers, arguments.batches * arguments.batch_size, arguments.seq)
        load_before = os.getloadavg()[0]
        first = run_child("bare", arguments, model_dir, text)
        extraction = run_child("extract", arguments, model_dir, text)
        second = run_child("bare", arguments, model_dir, text)
        load_after = os.getloadavg()[0]
    finally:
        if own_dir:
            shutil.rmtree(arguments.dir, ignore_errors=True)
    bare = (first["seconds"] + second["seconds"]) / 2
    bare_cpu = (first["cpu_seconds"] + second["cpu_seconds"]) / 2
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"load average {load_before:.1f} before, {load_after:.1f} after")
    print(f"model: Llama, SmolLM2-135M shape with {arguments.layers} layers; {arguments.batches} batches of "
          f"{arguments.batch_size} x {arguments.seq} tokens ({extraction['tokens']} tokens); torch threads "
          f"{arguments.threads or 'default'}")
    print(f"bare forward        {first['seconds']:.2f} s and {second['seconds']:.2f} s (mean {bare:.2f} s; CPU "
          f"{bare_cpu:.2f} s), peak RSS {max(first['peak_rss_mb'], second['peak_rss_mb']):,.0f} MB")
    print(f"orthosphere extract {extraction['seconds']:.2f} s (CPU {extraction['cpu_seconds']:.2f} s), peak RSS "
          f"{extraction['peak_rss_mb']:,.0f} MB, store {extraction['store_mb']:,.0f} MB (float16, all sites but pattern)")
    print(f"setup (not in the ratio): bare load {first['setup_seconds']:.1f} s; extract load, hash, "
          f"create store {extraction['setup_seconds']:.1f} s")
    print(f"ratio extract / bare forward: {extraction['seconds'] / bare:.3f} wall, "
          f"{extraction['cpu_seconds'] / bare_cpu:.3f} CPU time")


if __name__ == "__main__":
    main()
