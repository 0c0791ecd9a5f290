"""The CUDA path, checked on a machine with a GPU (prepared, not yet run: no GPU was at hand).

1. Exactness on the device: tiny random models of two families (Llama: rotary, grouped-query
   attention; Gemma 2: sliding window, soft-capping, sandwich norms) are extracted into float32
   stores on the CPU and on CUDA (TF32 off); every stored array must agree within 1e-4 of its
   magnitude, the predictions on 99 % of the tokens, and the CUDA store's q, k with its score terms
   must reproduce the CUDA model's own stored pattern (float64 reference, the suite's tolerance).
   A bfloat16 extraction (--model-dtype) must run and record its dtype.
2. Copies overlap compute: a model of SmolLM2-135M's shape (random weights) runs forward over the
   same batches bare and with every default site captured; the capture copies each value to pinned
   memory on a stream of its own. Printed: the two times (CUDA events) and their ratio; from the
   profiler's trace, the device-to-host copy time, the kernel time on the compute stream (the
   stream with the most kernel time among those that carry no device-to-host copy; kernels on
   other streams, such as the copy stream's dtype conversions, are not compute) and the overlap:
   the time both run at once, as a share of the shorter of the two (0: the copies wait for the
   compute, 1: the shorter is hidden under the other). It must reach OVERLAP_REQUIRED.

3. The analyses' attention kernels on the device (``orthosphere analyze --device cuda``): the replay
   of random sharp heads with device=cuda counts what float64 brute force counts (instances, sparse
   instances, collapses, both conditions' predictions) and its total variation is the numpy path's
   within float32 rounding; the norms weighted by the attention recomputed on the device give the
   bands of the stored float64 pattern within a histogram bin; and on a store of a small language
   model's shape (64 windows of 128 tokens, 9 / 3 heads of 64, 2 layers) the replay's time on the
   device against the numpy path's is printed.

How to run it, from the repository root, with the project installed in its virtual environment
(``pip install -e .[hf]``: torch with CUDA, transformers) on a machine with an NVIDIA GPU:

    .venv/bin/python benchmarks/cuda_check.py                 # every check on cuda, a few minutes
    .venv/bin/python benchmarks/cuda_check.py --device cuda:1 --batches 8 --batch-size 16 --seq 256
    .venv/bin/python benchmarks/cuda_check.py --device cpu    # rehearsal without a GPU (below)

``--device cpu`` rehearses the script where there is no GPU: checks 1 and 3 with the CPU in the GPU's
place (check 3 with the torch kernels on the CPU, "cpu-torch"; so it proves nothing about CUDA), check
2 skipped. Exit status 0 when every check passes,
1 when one fails (a store beyond tolerance, predictions, the pattern, the bfloat16 dtype, an
overlap below OVERLAP_REQUIRED, or an analysis kernel's count or value), 2 for bad arguments or no
CUDA device.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' tiny models

from orthosphere.analyze.attention import ScoreTerms  # noqa: E402
from orthosphere.extract.job import ExtractJob, run_job  # noqa: E402
from orthosphere.store import open_store  # noqa: E402
from tests.reference import attention_atol, attention_float64  # noqa: E402
from tests.test_extract_models import word_tokenizer, write_text  # noqa: E402
from tests.tiny_families import tiny_model  # noqa: E402

SITES = ("resid_pre", "resid_mid", "resid_post", "attn_in", "q", "k", "v", "pattern")
OVERLAP_REQUIRED = 0.5
"""Least share of the shorter of (copy time, compute time) that must run while the other runs."""


def extract_store(model_dir, text, out, device, model_dtype=None):
    job = ExtractJob(model=str(model_dir), task=f"text:path={text},max_length=12", out=str(out), sites=SITES,
                     dtype="float32", batch_size=4, device=device, model_dtype=model_dtype)
    run_job(job, progress=False)
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
            print(f"{model_type} {site}: max |{device} - cpu| {difference:.2e} (allowed {allowed:.1e})")
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
            print(f"{model_type} layer {layer}: {device} pattern vs float64 softmax of its stored q, k {difference:.2e}")
            if difference > attention_atol(largest):
                failures.append(f"{model_type} layer {layer} {device} pattern differs by {difference:.2e}")
        half = extract_store(model_dir, text, folder / f"{model_type}-bf16.zarr", device, "bfloat16")
        if half.attrs["model"]["dtype"] != "bfloat16":
            failures.append(f"{model_type} bfloat16 store records dtype {half.attrs['model']['dtype']}")
    return failures


def trace_intervals(trace: dict) -> tuple[list, dict]:
    """From the profiler's Chrome trace: device-to-host copies [(start, end)] and kernels
    {stream: [(start, end)]}, in microseconds."""
    copies, kernels = [], {}
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X":
            continue
        span = (float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0)))
        stream = event.get("args", {}).get("stream")
        if event.get("cat") == "gpu_memcpy" and "DtoH" in event.get("name", ""):
            copies.append((stream, span))
        elif event.get("cat") == "kernel":
            kernels.setdefault(stream, []).append(span)
    return copies, kernels


def merged(intervals) -> list[tuple[float, float]]:
    """The union of intervals as sorted disjoint ones."""
    union: list[list[float]] = []
    for start, end in sorted(intervals):
        if union and start <= union[-1][1]:
            union[-1][1] = max(union[-1][1], end)
        else:
            union.append([start, end])
    return [(start, end) for start, end in union]


def _length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def overlap(copies: list, kernels: dict) -> tuple[float, float, float]:
    """(copy time, compute-stream kernel time, share of the shorter of them that runs while the
    other runs); the compute stream is the one with the most kernel time among the streams that
    carry no device-to-host copy."""
    copy_streams = {stream for stream, _ in copies}
    candidates = {stream: spans for stream, spans in kernels.items() if stream not in copy_streams}
    if not copies or not candidates:
        return _length(merged(span for _, span in copies)), 0.0, 0.0
    compute = merged(max(candidates.values(), key=lambda spans: _length(merged(spans))))
    copied = merged(span for _, span in copies)
    both = sum(max(0.0, min(c1, k1) - max(c0, k0)) for c0, c1 in copied for k0, k1 in compute)
    shorter = min(_length(copied), _length(compute))
    return _length(copied), _length(compute), both / shorter if shorter > 0 else 0.0


def check_overlap(device: str, batches: int, batch_size: int, seq: int, folder: Path) -> list[str]:
    import transformers

    from orthosphere.extract.adapters import adapter_for

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
    profiler.export_chrome_trace(str(folder / "trace.json"))
    copy_time, compute_time, share = overlap(*trace_intervals(json.loads((folder / "trace.json").read_text())))
    print(f"device-to-host copies {copy_time / 1e3:.1f} ms, compute-stream kernels {compute_time / 1e3:.1f} ms, "
          f"running at once for {share:.0%} of the shorter (required {OVERLAP_REQUIRED:.0%})")
    if share < OVERLAP_REQUIRED:
        return [f"copies overlap compute for {share:.0%} of the shorter of the two only"]
    return []


def check_analysis(device: str, folder: Path) -> list[str]:
    """Check 3: the replay's counts against float64 brute force and its total variation against the
    numpy path; the norms' bands against the stored float64 pattern; the replay's time."""
    import time

    from orthosphere.analyze.replay import replay
    from tests.test_analyze_device import norm_bands_beside_a_stored_pattern, replay_beside_brute_force
    from tests.test_analyze_replay import write_store

    kernel = "cpu-torch" if torch.device(device).type == "cpu" else device
    failures = []
    on_device, on_cpu, counts, allowed = replay_beside_brute_force(folder, kernel)
    n_draws = on_device.attrs["n_draws"]
    found = {"n_instances": on_device.n_instances.values, "n_sparse": on_device.n_sparse.values,
             "collapses": on_device.collapses.sel(definition="collapse").values,
             "theory_predicted": (on_device.predicted_collapse_rate * on_device.n_sparse * n_draws).round().values,
             "exact_predicted": (on_device.exact_predicted_collapse_rate * on_device.n_sparse * n_draws).round().values}
    for name, value in found.items():
        same = np.array_equal(np.nan_to_num(value), counts[name])
        print(f"replay on {kernel}: {name} {'equals' if same else 'DIFFERS from'} float64 brute force")
        if not same:
            failures.append(f"replay {name} on {kernel} differs from float64 brute force")
    difference = float(np.abs(on_device.tv_distance - on_cpu.tv_distance).max())
    print(f"replay on {kernel}: total variation within {difference:.1e} of the numpy path's (allowed {allowed:.1e})")
    if difference > allowed:
        failures.append(f"replay total variation on {kernel} differs by {difference:.1e}")
    bands, expected = norm_bands_beside_a_stored_pattern(folder, kernel)
    difference = float(np.abs(bands["band"] - expected["band"]).max())
    print(f"norms on {kernel}: bands within {difference:.3f} of the stored float64 pattern's "
          f"(allowed one bin, {bands.attrs['ratio_bin_width']:.3f})")
    if difference > bands.attrs["ratio_bin_width"]:
        failures.append(f"norm bands on {kernel} differ by {difference:.3f}")
    rng = np.random.default_rng(0)
    shape = (64, 2, 128)
    big = write_store(folder / "lm.zarr", q=rng.normal(size=shape + (9, 64)).astype(np.float32),
                      k=rng.normal(size=shape + (3, 64)).astype(np.float32), v=rng.normal(size=shape + (3, 64)).astype(np.float32),
                      w_o=rng.normal(size=(2, 9, 64, 576)).astype(np.float32), attn_scale=0.125, samples_per_chunk=64)
    times = {}
    for name in ("cpu", kernel):
        start = time.perf_counter()
        replay(big, device=name, n_bootstrap=100)
        times[name] = time.perf_counter() - start
    print(f"replay of a language model's shape (64 x 128 tokens, 2 layers): numpy {times['cpu']:.2f} s, "
          f"{kernel} {times[kernel]:.2f} s ({times['cpu'] / times[kernel]:.1f}x)")
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="a CUDA device, or cpu to rehearse the script without one")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    rehearsal = torch.device(args.device).type == "cpu"
    if not rehearsal and not torch.cuda.is_available():
        print("no CUDA device: run this check on a machine with a GPU (or rehearse it with --device cpu)")
        sys.exit(2)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print("rehearsal on the CPU: nothing about CUDA is checked" if rehearsal else torch.cuda.get_device_name(),
          "torch", torch.__version__)
    with tempfile.TemporaryDirectory() as folder:
        failures = check_exactness(args.device, Path(folder))
        failures += check_analysis(args.device, Path(folder))
        if not rehearsal:
            failures += check_overlap(args.device, args.batches, args.batch_size, args.seq, Path(folder))
    if failures:
        print("FAILED:", *failures, sep="\n  ")
        sys.exit(1)
    print("all checks passed" + (" (CPU rehearsal)" if rehearsal else ""))


if __name__ == "__main__":
    main()
