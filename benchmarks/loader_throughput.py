"""TokenLoader throughput against a raw sequential read of the same arrays, in one run.

A synthetic float32 store larger than the shuffle buffer; the loader with full shuffling through
a DataLoader of 2 workers; tokens/s, GB/s, their ratio, and the workers' peak memory. The loader
runs in a fresh process (spawned), so that its workers' memory is theirs, not what this process
held when it wrote the store (a forked worker's peak counts its parent's pages).
Usage: python benchmarks/loader_throughput.py [MB ...]  (store sizes, default 64 256)
"""
from __future__ import annotations

import multiprocessing
import resource
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.synthetic writes the store

from orthosphere.data import TokenLoader  # noqa: E402
from orthosphere.store import open_store  # noqa: E402
from tests.synthetic import write_store  # noqa: E402

D_MODEL, N_POS, BUFFER_TOKENS = 512, 128, 2**15


def make_store(folder: str, megabytes: int) -> str:
    n_samples = megabytes * 2**20 // (N_POS * D_MODEL * 4)
    x = np.random.default_rng(0).normal(size=(n_samples, 1, N_POS, D_MODEL)).astype("float32")
    return write_store(f"{folder}/store-{megabytes}.zarr", {"resid_pre": x}, with_weights=False, samples_per_chunk=16)


def raw_read(url: str) -> tuple[int, float]:
    import zarr

    array = zarr.open_group(url, mode="r")["resid_pre"]
    start, tokens = time.perf_counter(), 0
    for first in range(0, array.shape[0], array.chunks[0]):
        tokens += np.asarray(array[first:first + array.chunks[0], 0]).shape[0] * N_POS
    return tokens, time.perf_counter() - start


def loader_read(url: str) -> tuple[int, float, float, int, float]:
    """Tokens and seconds of one epoch through 2 workers (the workers' start included), the seconds
    after the first batch, the buffer's bytes and the workers' peak RSS (MB)."""
    loader = TokenLoader(url, [("resid_pre", 0)], batch_size=4096, buffer_tokens=BUFFER_TOKENS, seed=0, exclude_start=False)
    start, tokens, first = time.perf_counter(), 0, None
    for batch in loader.dataloader(num_workers=2):
        tokens += batch.shape[0]
        first = first or (time.perf_counter(), batch.shape[0])
    seconds = time.perf_counter() - start
    return (tokens, seconds, time.perf_counter() - first[0], loader.buffer_bytes,
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**10)


def main(sizes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        for megabytes in sizes:
            url = make_store(folder, megabytes)
            open_store(url)
            raw_tokens, raw_seconds = raw_read(url)
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as fresh:
                tokens, seconds, steady, buffer, peak = fresh.submit(loader_read, url).result()
            bytes_per_token = D_MODEL * 4
            print(f"store {megabytes} MB, buffer {buffer / 2**20:.0f} MB: raw {raw_tokens / raw_seconds:,.0f} tokens/s "
                  f"({raw_tokens * bytes_per_token / raw_seconds / 1e9:.2f} GB/s); loader (2 workers, full shuffle) "
                  f"{tokens / seconds:,.0f} tokens/s ({tokens * bytes_per_token / seconds / 1e9:.2f} GB/s): "
                  f"{raw_seconds / seconds * tokens / raw_tokens:.2f}x (after the first batch, the workers' start left out: "
                  f"{raw_seconds / steady * (tokens - 4096) / raw_tokens:.2f}x); workers' peak RSS {peak:.0f} MB")


if __name__ == "__main__":
    main([int(size) for size in sys.argv[1:]] or [64, 256])
