"""Store write throughput beside a plain numpy.save of the same bytes to the same disk.

Prints, for float16 and float32 activation blocks, MB/s of `StoreWriter.write` (uncompressed
store, the default) and of `numpy.save`, and their ratio (store / numpy; 1.0 = as fast as a raw
dump). Usage: python benchmarks/store_write.py [--samples N] [--dir DIR]
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time

import numpy as np

from orthosphere.store import create_store

MODEL = {"family": "benchmark", "n_layers": 8, "d_model": 512, "n_heads": 8, "n_kv_heads": 8, "d_head": 64}
SITES = ["resid_pre", "attn_in", "q", "k", "v"]
N_POS = 64


def blocks(n_samples: int, samples_per_chunk: int, dtype: str, rng):
    """Chunk-sized blocks of random activations for every site."""
    shapes = {
        "resid_pre": (MODEL["n_layers"], N_POS, MODEL["d_model"]),
        "attn_in": (MODEL["n_layers"], N_POS, MODEL["d_model"]),
        "q": (MODEL["n_layers"], N_POS, MODEL["n_heads"], MODEL["d_head"]),
        "k": (MODEL["n_layers"], N_POS, MODEL["n_kv_heads"], MODEL["d_head"]),
        "v": (MODEL["n_layers"], N_POS, MODEL["n_kv_heads"], MODEL["d_head"]),
    }
    template = {site: rng.standard_normal((samples_per_chunk,) + shape, dtype=np.float32).astype(dtype) for site, shape in shapes.items()}
    for start in range(0, n_samples, samples_per_chunk):
        n = min(samples_per_chunk, n_samples - start)
        yield start, {site: values[:n] for site, values in template.items()}


def time_store(directory: str, n_samples: int, dtype: str) -> tuple[float, int, int]:
    """Seconds to write every block through the store, bytes written, samples per chunk."""
    url = os.path.join(directory, f"bench-{dtype}.zarr")
    writer = create_store(url, model=MODEL, task={"name": "benchmark"}, n_samples=n_samples, n_pos=N_POS, sites=SITES, dtype=dtype, with_weights=False)
    spc = writer.attrs["samples_per_chunk"]
    data = list(blocks(n_samples, spc, dtype, np.random.default_rng(0)))
    written = sum(v.nbytes for _, block in data for v in block.values())
    os.sync()
    began = time.perf_counter()
    for start, block in data:
        writer.write(start, block)
    os.sync()
    elapsed = time.perf_counter() - began
    writer.mark_shard_complete(0)
    writer.finish()
    shutil.rmtree(url)
    return elapsed, written, spc


def time_numpy(directory: str, n_samples: int, dtype: str, spc: int) -> float:
    """Seconds to numpy.save the same blocks, one file per site and block."""
    data = list(blocks(n_samples, spc, dtype, np.random.default_rng(0)))
    os.sync()
    began = time.perf_counter()
    for start, block in data:
        for site, values in block.items():
            np.save(os.path.join(directory, f"{site}-{start}.npy"), values)
    os.sync()
    elapsed = time.perf_counter() - began
    for name in os.listdir(directory):
        if name.endswith(".npy"):
            os.remove(os.path.join(directory, name))
    return elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    directory = tempfile.mkdtemp(dir=args.dir, prefix="orthosphere-bench-")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}")
    print(f"{'dtype':<8} {'MB':>8} {'store MB/s':>11} {'numpy MB/s':>11} {'store/numpy':>12}")
    try:
        for dtype in ("float16", "float32"):
            store_times, numpy_times = [], []
            for _ in range(args.repeats):
                store_elapsed, written, samples_per_chunk = time_store(directory, args.samples, dtype)
                store_times.append(store_elapsed)
                numpy_times.append(time_numpy(directory, args.samples, dtype, samples_per_chunk))
            megabytes = written / 1e6
            store_rate, numpy_rate = megabytes / min(store_times), megabytes / min(numpy_times)
            print(f"{dtype:<8} {megabytes:>8.0f} {store_rate:>11.0f} {numpy_rate:>11.0f} {store_rate / numpy_rate:>12.2f}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
