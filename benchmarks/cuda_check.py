"""The CUDA path, checked on a machine with a GPU (prepared, not yet run: no GPU was at hand).

1. Exactness on the device: tiny random models of two families (Llama: rotary, grouped-query
   attention; Gemma 2: sliding window, soft-capping, sandwich norms) are extracted into float32
   stores on the CPU and on CUDA (TF32 off); every stored array must agree within 1e-4 of its
   magnitude, the predictions on 99 % of the tokens, and the CUDA store's q, k with its score terms
   must reproduce the CUDA model's own stored pattern (float64 reference, the suite's tolerance).
   A bfloat16 extraction (--model-dtype) must run and record its dtype.
2. Copies overlap compute: a model of SmolLM2-135M's shape (random weights) runs forward over the
   same batches bare and with every default site captured; the capture copies each value to pinned
   memory on a stream of its own. Printed: the two times (CUDA events), their ratio, and from the
   profiler the share of device-to-host copy time that overlaps kernels on the compute stream.

Usage: python benchmarks/cuda_check.py [--device cuda] [--batches 8] [--batch-size 16] [--seq 256]
Exit status 1 when a check fails.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' tiny models

from orthosphere.analyze.attention import ScoreTerms  # noqa: E402
from orthosphere.extract.job import ExtractJob, extract  # noqa: E402
from orthosphere.store import open_store  # noqa: E402
from tests.reference import attention_atol, attention_float64  # noqa: E402
from tests.test_extract_models import word_tokenizer, write_text  # noqa: E402
from tests.tiny_families import tiny_model  # noqa: E402

SITES = ("resid_pre", "resid_mid", "resid_post", "attn_in", "q", "k", "v", "pattern")


def extract_store(model_dir, text, out, device, model_dtype=None):
    job = ExtractJob(model=str(model_dir), task=f"text:path={text},max_length=12", out=str(out), sites=SITES,
                     dtype="float32", batch_size=4, device=device, model_dtype=model_dtype)
    extract(job, progress=False)
    return open_store(str(out)).load()


def check_exactness(device: str, folder: Path) -> list[str]:
    failures = []
    text = write_text(folder / "text.txt")
    for model_type in ("llama", "gemma2"):
        model_dir = folder / model_type
        tiny_model(model_type).save_pretrained(model_dir, safe_serialization=True)
        word_tokenizer("llama").save_pretrained(model_dir)
        cpu = extract_store(model_dir, text, folder / f"{model_type}-cpu.zarr", "cpu")
        gpu = extract_store(model_dir, text, folder / f"{model_type}-gpu.zarr", device)
        for site in SITES:
            difference = float(np.abs(gpu[site].values - cpu[site].values).max())
            allowed = 1e-4 * max(1.0, float(np.abs(cpu[site].values).max()))
            print(f"{model_type} {site}: max |cuda - cpu| {difference:.2e} (allowed {allowed:.1e})")
            if difference > allowed:
                failures.append(f"{model_type} {site} differs by {difference:.2e}")
        valid = cpu["valid"].values
        agreement = float((gpu["pred"].values == cpu["pred"].values)[valid].mean())
        print(f"{model_type} predictions agree on {agreement:.1%} of the tokens")
        if agreement < 0.99:
            failures.append(f"{model_type} predictions agree on {agreement:.1%} only")
        for layer in range(gpu.sizes["layer"]):
            terms = ScoreTerms.of_layer(gpu.attrs["model"], layer)
            reference, largest = attention_float64(
                gpu["q"].values[:, layer], gpu["k"].values[:, layer], valid, attn_scale=terms.scale, causal=terms.causal,
                sliding_window=terms.sliding_window, softcap=terms.softcap, alibi_slopes=terms.alibi_slopes)
            queries = valid[:, None, :, None]
            difference = float(np.abs(np.where(queries, gpu["pattern"].values[:, layer] - reference, 0)).max())
            print(f"{model_type} layer {layer}: cuda pattern vs float64 softmax of its stored q, k {difference:.2e}")
            if difference > attention_atol(largest):
                failures.append(f"{model_type} layer {layer} cuda pattern differs by {difference:.2e}")
        half = extract_store(model_dir, text, folder / f"{model_type}-bf16.zarr", device, "bfloat16")
        if half.attrs["model"]["dtype"] != "bfloat16":
            failures.append(f"{model_type} bfloat16 store records dtype {half.attrs['model']['dtype']}")
    return failures


def check_overlap(device: str, batches: int, batch_size: int, seq: int) -> None:
    import transformers

    from orthosphere.extract.capture import adapter_for

    config = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                      num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                      max_position_embeddings=2048, tie_word_embeddings=True)
    adapter = adapter_for(transformers.LlamaForCausalLM(config).to(device).eval())
    tokens = torch.randint(0, 49152, (batch_size, seq), device=device)
    valid = torch.ones_like(tokens, dtype=torch.bool)
    sites = [site for site in SITES if site != "pattern"]

    def captured_run() -> float:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.inference_mode(), adapter.capture(sites, dtype=torch.float16) as recording:
            torch.cuda.synchronize()
            start.record()
            for _ in range(batches):
                adapter.forward(tokens, valid)
                recording.take()
            stop.record()
            torch.cuda.synchronize()
        return start.elapsed_time(stop) / 1000

    def bare() -> float:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.inference_mode():
            torch.cuda.synchronize()
            start.record()
            for _ in range(batches):
                adapter.forward(tokens, valid)
            stop.record()
            torch.cuda.synchronize()
        return start.elapsed_time(stop) / 1000

    bare(), captured_run()  # warm-up
    plain, captured = bare(), captured_run()
    print(f"forward {plain:.3f} s bare, {captured:.3f} s capturing every default site: ratio {captured / plain:.2f}")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        captured_run()
    events = [e for e in profiler.events() if e.device_type.name == "CUDA"]
    copies = [(e.time_range.start, e.time_range.end) for e in events if "Memcpy DtoH" in e.name]
    kernels = [(e.time_range.start, e.time_range.end) for e in events if "Memcpy" not in e.name]
    overlapped = sum(max(0, min(c1, k1) - max(c0, k0)) for c0, c1 in copies for k0, k1 in kernels)
    total = sum(c1 - c0 for c0, c1 in copies)
    print(f"device-to-host copies: {total / 1e3:.1f} ms, {overlapped / max(total, 1):.0%} of it overlapping kernels")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: run this check on a machine with a GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    with tempfile.TemporaryDirectory() as folder:
        failures = check_exactness(args.device, Path(folder))
    check_overlap(args.device, args.batches, args.batch_size, args.seq)
    if failures:
        print("FAILED:", *failures, sep="\n  ")
        sys.exit(1)
    print("all CUDA checks passed")


if __name__ == "__main__":
    main()
