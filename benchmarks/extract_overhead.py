"""Extraction overhead: `orthosphere extract` of packed windows beside the bare forward pass over the same windows.

Builds, with nothing downloaded: a Llama-family model of SmolLM2-135M's shape (30 layers, d_model
576, 9 heads, 3 key-value heads, d_ff 1536, vocabulary 49152, random weights, float32
safetensors), a corpus of real-looking prose (paragraphs drawn from a word-bigram chain over this
repository's own documentation, one a line) and a byte-level BPE tokenizer trained on it (BOS
<s>, EOS </s>). Then, each in a fresh process with the machine's default torch threads (or
--threads): the bare forward (load the model and tokenizer, tokenise and pack the corpus into the
same windows -- documents joined by EOS, BOS per window -- and run transformers' default attention,
logits only), and `extract` of those windows with every default site, in float16 and in bfloat16.
Each repeat runs bare, the extractions, bare (the extractions' order reversed in even repeats, so
that none always follows another's writes); a ratio uses the mean of the bare runs around it, and
the summary gives the median over repeats.

Further extractions (``--kinds``, float16): ``all-sites``, every default site plus z, attn_out,
mlp_in, mlp_norm_scale and mlp_out (the block's outputs, one forward pass); ``half`` and
``half-pred``, every default site of the first half of the layers, without the predictions (the
forward pass stops after the last of them) and with them (the whole forward pass runs).

Printed: wall and CPU seconds; the loop (extraction's batches) / bare forward; the whole command
(each child process from its start: imports, loading, set-up and forward passes) / the bare one;
extraction's set-up (imports, load, hash, tokenise, create the store, write the weights and token
arrays: whole less loop) / the bare one's (imports, load, tokenise); stored bytes per real token /
the sites' bytes per token; and the peak resident memory of extraction at --windows and 4x as many
windows (flat in the number of windows when the write queue bounds memory); with half and half-pred,
the loop of the extraction that stops early over the one that runs the whole model.

Usage: python benchmarks/extract_overhead.py [--windows 32] [--batch-size 8] [--context 128] [--layers 30]
       [--repeats 2] [--threads N] [--dir DIR] [--kinds float16,bfloat16,all-sites,half,half-pred]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.perf_counter()  # a child's "whole" runs from here (the standard library aside): imports, set-up, forward

SHAPE = {  # SmolLM2-135M
    "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
    "vocab_size": 49152, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
SPECIALS = ["<pad>", "<s>", "</s>"]
REPOSITORY = Path(__file__).resolve().parent.parent
SOURCES = ("README.md", "store/SCHEMA.md", "benchmarks/RESULTS.md")
DEFAULT_KINDS = ("float16", "bfloat16")
KINDS = DEFAULT_KINDS + ("all-sites", "half", "half-pred")
NEW_SITES = ("z", "attn_out", "mlp_in", "mlp_norm_scale", "mlp_out")


def prose(n_paragraphs: int, seed: int = 0) -> list[str]:
    """Paragraphs of 40-240 words from a word-bigram chain over the repository's documentation."""
    import numpy as np

    words = re.findall(r"[A-Za-z][A-Za-z'-]*|[.,;:]", " ".join((REPOSITORY / name).read_text() for name in SOURCES))
    following: dict[str, list[str]] = {}
    for first, second in zip(words, words[1:]):
        following.setdefault(first, []).append(second)
    starts = [word for word in following if word[0].isupper()]
    rng = np.random.default_rng(seed)
    paragraphs = []
    for _ in range(n_paragraphs):
        word, text = starts[rng.integers(len(starts))], []
        for _ in range(int(rng.integers(40, 240))):
            text.append(word)
            options = following.get(word) or starts
            word = options[rng.integers(len(options))]
        paragraphs.append(re.sub(r" ([.,;:])", r"\1", " ".join(text)).rstrip(",;:") + ".")
    return paragraphs


def build(directory: str, layers: int, n_paragraphs: int) -> tuple[str, str]:
    """The model directory (safetensors and tokenizer) and the corpus (one paragraph a line)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    paragraphs = prose(n_paragraphs)
    Path(directory).mkdir(parents=True, exist_ok=True)  # a --dir that does not exist yet
    corpus = os.path.join(directory, "corpus.txt")
    Path(corpus).write_text("\n".join(paragraphs) + "\n")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(paragraphs, trainers.BpeTrainer(vocab_size=4096, special_tokens=SPECIALS, show_progress=False))
    model_dir = os.path.join(directory, "smollm2-shape")
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=layers, rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, **SHAPE)
    LlamaForCausalLM(config).save_pretrained(model_dir, safe_serialization=True)
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>").save_pretrained(model_dir)
    return model_dir, corpus


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def packed_windows(tokenizer, corpus: str, context: int, windows: int):
    """The windows extraction stores: documents without special tokens, EOS between them, BOS per window."""
    import torch

    with open(corpus) as handle:
        documents = [line.rstrip("\n") for line in handle if line.strip()]
    stream = []
    for ids in tokenizer(documents, add_special_tokens=False)["input_ids"]:
        stream += ids + [tokenizer.eos_token_id]
    body = context - 1
    rows = torch.tensor(stream[: windows * body]).reshape(windows, body)
    return torch.cat([torch.full((windows, 1), tokenizer.bos_token_id), rows], dim=1)


def child_bare(model_dir: str, corpus: str, context: int, windows: int, batch_size: int) -> dict:
    """Load, tokenise and pack, then the forward pass alone over the windows that extraction runs."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = packed_windows(AutoTokenizer.from_pretrained(model_dir), corpus, context, windows)
    began, cpu_began = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for first in range(0, windows, batch_size):
            batch = tokens[first: first + batch_size]
            model(input_ids=batch, attention_mask=torch.ones_like(batch), use_cache=False)
    seconds = time.perf_counter() - began
    whole = time.perf_counter() - STARTED
    return {"whole": whole, "setup": whole - seconds, "seconds": seconds, "cpu_seconds": time.process_time() - cpu_began,
            "peak_rss_mb": peak_rss_mb(), "tokens": int(tokens.numel())}


def kind_options(kind: str, n_layers: int) -> dict:
    """The extraction's dtype and options of a kind (see the module docstring)."""
    from orthosphere.store.schema import DEFAULT_SITES, NORM_SCALE_SITES

    if kind in DEFAULT_KINDS:
        return {"dtype": kind}
    if kind == "all-sites":  # the Llama's defaults: it has no QK-norm
        defaults = tuple(site for site in DEFAULT_SITES if site not in NORM_SCALE_SITES[1:])
        return {"dtype": "float16", "sites": defaults + NEW_SITES}
    return {"dtype": "float16", "layers": tuple(range(n_layers // 2)), "pred": kind == "half-pred"}


def child_extract(model_dir: str, corpus: str, context: int, windows: int, batch_size: int, kind: str, n_layers: int,
                  out: str) -> dict:
    from orthosphere.extract.job import ExtractJob, run_job
    from orthosphere.store import info

    result = run_job(ExtractJob(model=model_dir, task=f"text:path={corpus},context={context}", out=out, n_samples=windows,
                                batch_size=batch_size, device="cpu", mode="overwrite", **kind_options(kind, n_layers)),
                     progress=False)
    whole = time.perf_counter() - STARTED
    summary = info(out)
    return {"whole": whole, "seconds": result.seconds, "cpu_seconds": result.cpu_seconds, "setup": whole - result.seconds,
            "peak_rss_mb": peak_rss_mb(), "tokens": result.tokens, "store_mb": summary["size_bytes"] / 2**20,
            "bytes_per_real_token": summary["bytes_per_real_token"], "site_bytes": summary["site_bytes_per_position"],
            "weight_mb": summary["weight_bytes"] / 2**20}


def run_child(child: str, arguments, model_dir: str, corpus: str, windows: int, kind: str = "float16") -> dict:
    command = [sys.executable, __file__, "--child", child, "--model-dir", model_dir, "--corpus", corpus,
               "--windows", str(windows), "--batch-size", str(arguments.batch_size), "--context", str(arguments.context),
               "--kind", kind, "--layers", str(arguments.layers), "--dir", arguments.dir]
    if arguments.threads:
        command += ["--threads", str(arguments.threads)]
    environment = dict(os.environ, ORTHOSPHERE_CACHE=os.path.join(arguments.dir, "cache"))
    os.sync()  # the previous child's store reaches the disk before this child's clock starts, not during it
    output = subprocess.run(command, check=True, capture_output=True, text=True, env=environment).stdout
    return json.loads(output.strip().splitlines()[-1])


def median(values) -> float:
    return statistics.median(values)


def report(arguments, repeats: list[dict], memory: dict, loads: tuple[float, float]) -> None:
    import torch

    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch "
          f"{torch.__version__}; load average {loads[0]:.1f} before, {loads[1]:.1f} after")
    first = repeats[0]
    print(f"model: Llama of SmolLM2-135M's shape with {arguments.layers} layers; {arguments.windows} packed windows of "
          f"{arguments.context} tokens ({first['bare'][0]['tokens']} tokens) in batches of {arguments.batch_size}; "
          f"torch threads {arguments.threads or f'default ({torch.get_num_threads()})'}")
    kinds = arguments.kinds
    for index, runs in enumerate(repeats):
        bare = runs["bare"]
        print(f"repeat {index + 1}: bare forward {bare[0]['seconds']:.2f} s and {bare[1]['seconds']:.2f} s "
              f"(CPU {bare[0]['cpu_seconds']:.2f} s, {bare[1]['cpu_seconds']:.2f} s); bare set-up (imports, load, "
              f"tokenise) {bare[0]['setup']:.2f} s, {bare[1]['setup']:.2f} s")
        for kind in kinds:
            run = runs[kind]
            print(f"  extract {kind:<9}: whole {run['whole']:.2f} s = set-up {run['setup']:.2f} s + loop {run['seconds']:.2f} s "
                  f"(CPU {run['cpu_seconds']:.2f} s); peak RSS {run['peak_rss_mb']:,.0f} MB")
    print("ratios (median over repeats; each against the mean of the bare runs around it):")
    for kind in kinds:
        def ratio(key, bare_key, kind=kind):
            return median(r[kind][key] / statistics.mean(b[bare_key] for b in r["bare"]) for r in repeats)

        run = repeats[0][kind]
        print(f"  {kind:<9}: loop / bare forward {ratio('seconds', 'seconds'):.3f} wall, "
              f"{ratio('cpu_seconds', 'cpu_seconds'):.3f} CPU; whole / bare whole {ratio('whole', 'whole'):.3f}; "
              f"set-up / bare set-up {ratio('setup', 'setup'):.2f}; bytes per real token / sites' bytes "
              f"{run['bytes_per_real_token'] / run['site_bytes']:.4f} ({run['bytes_per_real_token'] / 1e3:,.1f} kB vs "
              f"{run['site_bytes'] / 1e3:,.1f} kB; store {run['store_mb']:,.0f} MB besides {run['weight_mb']:,.0f} MB of weight maps)")
    if {"half", "half-pred"} <= set(kinds):
        stopped = median(r["half"]["seconds"] / r["half-pred"]["seconds"] for r in repeats)
        print(f"  stopping early at half the layers: loop / the same extraction running the whole model {stopped:.3f}")
    if memory:
        small, large = memory
        print(f"peak RSS of float16 extraction: {memory[small]:,.0f} MB at {small} windows, {memory[large]:,.0f} MB at "
              f"{large} windows; bare forward {repeats[0]['bare'][0]['peak_rss_mb']:,.0f} MB")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads in every run (default: torch's).")
    parser.add_argument("--dir", default=None, help="Where the model, corpus and stores go (default: a temporary folder).")
    parser.add_argument("--child", choices=["bare", "extract"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--kinds", default=",".join(DEFAULT_KINDS), type=lambda text: tuple(text.split(",")),
                        help=f"Extractions to run beside the bare forward, of {list(KINDS)} (see above).")
    parser.add_argument("--kind", default="float16", choices=KINDS, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    unknown = [kind for kind in arguments.kinds if kind not in KINDS]
    if unknown:
        parser.error(f"--kinds: {unknown} unknown, expected some of {list(KINDS)}")
    if arguments.child:
        if arguments.threads:
            import torch

            torch.set_num_threads(arguments.threads)
        if arguments.child == "bare":
            result = child_bare(arguments.model_dir, arguments.corpus, arguments.context, arguments.windows, arguments.batch_size)
        else:
            out = os.path.join(arguments.dir, f"store-{arguments.kind}-{arguments.windows}.zarr")
            result = child_extract(arguments.model_dir, arguments.corpus, arguments.context, arguments.windows,
                                   arguments.batch_size, arguments.kind, arguments.layers, out)
            shutil.rmtree(out, ignore_errors=True)
        print(json.dumps(result))
        return

    own_dir = arguments.dir is None
    arguments.dir = arguments.dir or tempfile.mkdtemp(prefix="orthosphere-extract-bench-")
    try:
        # enough prose for 4x the windows (about 190 tokens a paragraph)
        model_dir, corpus = build(arguments.dir, arguments.layers, max(64, 4 * arguments.windows * arguments.context // 100))
        loads = [os.getloadavg()[0]]
        repeats = []
        for index in range(arguments.repeats):
            runs = {"bare": [run_child("bare", arguments, model_dir, corpus, arguments.windows)]}
            for kind in arguments.kinds[:: 1 if index % 2 == 0 else -1]:
                runs[kind] = run_child("extract", arguments, model_dir, corpus, arguments.windows, kind)
            runs["bare"].append(run_child("bare", arguments, model_dir, corpus, arguments.windows))
            repeats.append(runs)
        memory = {}
        if "float16" in arguments.kinds:
            large = run_child("extract", arguments, model_dir, corpus, 4 * arguments.windows)
            memory = {arguments.windows: repeats[-1]["float16"]["peak_rss_mb"], 4 * arguments.windows: large["peak_rss_mb"]}
        loads.append(os.getloadavg()[0])
    finally:
        if own_dir:
            shutil.rmtree(arguments.dir, ignore_errors=True)
    report(arguments, repeats, memory, tuple(loads))


if __name__ == "__main__":
    main()
