"""TokenLoader throughput against a raw sequential read of the same arrays, in one run.

A synthetic float32 store larger than the shuffle buffer; the loader with full shuffling through
a DataLoader of 2 workers; tokens/s, GB/s, their ratio, and the process's peak memory.
Usage: python benchmarks/loader_throughput.py [MB ...]  (store sizes, default 64 256)
"""
from __future__ import annotations

import resource
import sys
import tempfile
import time

import numpy as np

from orthosphere.data import TokenLoader
from orthosphere.store import open_store
from tests.synthetic import write_store

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


def loader_read(url: str) -> tuple[int, float, int]:
    loader = TokenLoader(url, [("resid_pre", 0)], batch_size=4096, buffer_tokens=BUFFER_TOKENS, seed=0, exclude_start=False)
    start, tokens = time.perf_counter(), 0
    for batch in loader.dataloader(num_workers=2):
        tokens += batch.shape[0]
    return tokens, time.perf_counter() - start, loader.buffer_bytes


def main(sizes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        for megabytes in sizes:
            url = make_store(folder, megabytes)
            open_store(url)
            raw_tokens, raw_seconds = raw_read(url)
            tokens, seconds, buffer = loader_read(url)
            bytes_per_token = D_MODEL * 4
            peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**10
            print(f"store {megabytes} MB, buffer {buffer / 2**20:.0f} MB: raw {raw_tokens / raw_seconds:,.0f} tokens/s "
                  f"({raw_tokens * bytes_per_token / raw_seconds / 1e9:.2f} GB/s); loader (2 workers, full shuffle) "
                  f"{tokens / seconds:,.0f} tokens/s ({tokens * bytes_per_token / seconds / 1e9:.2f} GB/s): "
                  f"{raw_seconds / seconds * tokens / raw_tokens:.2f}x; worker peak RSS {peak:.0f} MB")


if __name__ == "__main__":
    main([int(size) for size in sys.argv[1:]] or [64, 256])
