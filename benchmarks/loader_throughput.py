"""TokenLoader throughput against a raw sequential read of the same array, side by side in one run.

For each store size (a synthetic float32 store larger than the shuffle buffer, written block by
block): the store's pages are dropped from the page cache (posix_fadvise DONTNEED on every file;
the share still cached is printed, so that a drop that did not work shows), the array is read raw
(one process, chunk by chunk, through zarr), the pages are dropped again, and the loader reads one
epoch with full shuffling through a DataLoader of 2 workers, in a fresh process (spawned, so that
its workers' peak memory is theirs, not this process's). Then the same with the store in the page
cache (read once before each). Repeated, alternating. Printed: tokens/s,
GB/s, loader / raw with the workers' start-up counted and without it (timed from the moment the
last worker had started), and the peak RSS of the loader's process and of its largest worker.
Usage: python benchmarks/loader_throughput.py [--buffer-mb 128] [--repeats 2] [--dir DIR] [MB ...]
(store sizes, default 1024 4096)
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import mmap
import multiprocessing
import os
import resource
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from orthosphere.data import TokenLoader
from orthosphere.store import create_store

D_MODEL, N_POS, SAMPLES_PER_CHUNK, WORKERS, BATCH_SIZE = 512, 128, 16, 2, 4096
TOKEN_BYTES = D_MODEL * 4
MODEL = {"family": "synthetic", "source": "planted", "norm_placement": "none", "norm_type": "layer",
         "attn_scale": 0.125, "causal": True, "n_layers": 1, "n_heads": 8, "n_kv_heads": 8, "d_head": 64,
         "d_model": D_MODEL}


def make_store(folder: str, megabytes: int) -> str:
    """A complete store of one site, written 256 samples (64 MB) at a time."""
    url = os.path.join(folder, f"store-{megabytes}.zarr")
    n_samples = megabytes * 2**20 // (N_POS * TOKEN_BYTES)
    rng, valid = np.random.default_rng(0), np.ones((256, N_POS), bool)
    with create_store(url, model=MODEL, task={"name": "planted"}, n_samples=n_samples, n_pos=N_POS,
                      sites=("resid_pre",), with_weights=False, samples_per_chunk=SAMPLES_PER_CHUNK) as writer:
        for start in range(0, n_samples, 256):
            count = min(256, n_samples - start)
            block = rng.standard_normal((count, 1, N_POS, D_MODEL), dtype=np.float32)
            writer.write(start, {"resid_pre": block, "valid": valid[:count], "scored": valid[:count]})
        writer.mark_shard_complete(0)
        writer.finish()
    return url


def store_files(url: str) -> list[str]:
    return [os.path.join(folder, name) for folder, _, names in os.walk(url) for name in names]


def drop_pages(url: str) -> float:
    """Ask the kernel to drop the store's pages from the page cache (written back first: dirty pages
    stay); the share of them still cached."""
    for path in store_files(url):
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)
    return cached_share(url)


def cached_share(url: str) -> float:
    """The share of the store's pages in the page cache (mincore on a mapping of each file)."""
    libc, page = ctypes.CDLL(None, use_errno=True), mmap.PAGESIZE
    cached = total = 0
    for path in store_files(url):
        size = os.path.getsize(path)
        if not size:
            continue
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY) as mapping:
            pages = (ctypes.c_ubyte * -(-size // page))()
            address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
            if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), pages) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            cached += sum(flag & 1 for flag in pages)
            total += len(pages)
    return cached / max(total, 1)


def raw_read(url: str) -> tuple[int, float]:
    """Tokens and seconds of a sequential read, chunk by chunk, through zarr."""
    import zarr

    array = zarr.open_group(url, mode="r")["resid_pre"]
    start, tokens = time.perf_counter(), 0
    for first in range(0, array.shape[0], array.chunks[0]):
        tokens += np.asarray(array[first:first + array.chunks[0], 0]).shape[0] * N_POS
    return tokens, time.perf_counter() - start


def _note_start(started, worker_id: int) -> None:
    started[worker_id] = time.monotonic()


def loader_read(url: str, buffer_tokens: int) -> dict:
    """One epoch through 2 workers: tokens, seconds with the workers' start-up and after it (from the
    last worker's start), the buffer's bytes, and the peak RSS (MB) of this process and of its workers."""
    loader = TokenLoader(url, [("resid_pre", 0)], batch_size=BATCH_SIZE, buffer_tokens=buffer_tokens, seed=0,
                         exclude_start=False)
    started = multiprocessing.Array("d", WORKERS)
    batches = loader.dataloader(num_workers=WORKERS, worker_init_fn=functools.partial(_note_start, started))
    tokens, begin = 0, time.monotonic()
    for batch in batches:
        tokens += batch.shape[0]
    end = time.monotonic()
    return {"tokens": tokens, "seconds": end - begin, "after_start": end - max(started), "buffer": loader.buffer_bytes,
            "own_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
            "workers_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**10}


def measure(url: str, megabytes: int, buffer_tokens: int, cold: bool) -> None:
    """The raw read and the loader side by side, each from the store out of the page cache (`cold`)
    or in it (read once before)."""
    prepare = drop_pages if cold else lambda url: (raw_read(url), cached_share(url))[1]
    cached = prepare(url)
    raw_tokens, raw_seconds = raw_read(url)
    cached_loader = prepare(url)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as fresh:
        run = fresh.submit(loader_read, url, buffer_tokens).result()
    raw_rate, rate, steady = raw_tokens / raw_seconds, run["tokens"] / run["seconds"], run["tokens"] / run["after_start"]
    print(f"store {megabytes} MB, buffer {run['buffer'] / 2**20:.0f} MB, {'out of' if cold else 'in'} the page cache "
          f"({cached:.1%} / {cached_loader:.1%} cached), load {os.getloadavg()[0]:.1f}: raw {raw_rate:,.0f} tokens/s "
          f"({raw_rate * TOKEN_BYTES / 1e9:.2f} GB/s); loader {rate:,.0f} tokens/s ({rate * TOKEN_BYTES / 1e9:.2f} GB/s) "
          f"= {rate / raw_rate:.2f}x, after the workers' start {steady:,.0f} tokens/s = {steady / raw_rate:.2f}x "
          f"(start-up {run['seconds'] - run['after_start']:.2f} s of {run['seconds']:.2f} s); peak RSS: loader's "
          f"process {run['own_rss']:.0f} MB, largest worker {run['workers_rss']:.0f} MB", flush=True)
    assert run["tokens"] == raw_tokens, (run["tokens"], raw_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes", nargs="*", type=int, default=[1024, 4096], help="store sizes in MB")
    parser.add_argument("--buffer-mb", type=int, default=128, help="the shuffle buffer (one window) in MB")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where the stores are written (default: a temporary folder)")
    arguments = parser.parse_args()
    buffer_tokens = arguments.buffer_mb * 2**20 // TOKEN_BYTES
    with tempfile.TemporaryDirectory(dir=arguments.dir) as folder:
        for megabytes in arguments.sizes:
            url = make_store(folder, megabytes)
            for _ in range(arguments.repeats):
                for cold in (True, False):
                    measure(url, megabytes, buffer_tokens, cold)


if __name__ == "__main__":
    main()
