"""Scale benchmark of the analyses: norms + subspaces + spheres over a synthetic store several
times larger than a Dask worker's memory limit, on a LocalCluster.

Prints, side by side in one run:
- the throughput of a raw pass that only reads and sums every array the analyses read, once;
- the throughput of the analyses (bytes of activations they read, each pass counted, per second)
  and its ratio to the raw pass, per analysis and for the three together (target >= 0.7);
- the wall time of the analyses against that of reading the store once;
- the peak resident memory of each worker (sampled), the bytes workers spilled to disk, and
  whether any worker was restarted (killed).

    python benchmarks/analyze_scale.py                       # 2 GB store, 2 workers of 512 MB
    python benchmarks/analyze_scale.py --size-gb 4 --memory-limit 1GB
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from pathlib import Path

import dask
import numpy as np
from distributed import Client, LocalCluster

from orthosphere.analyze import factor_subspaces, norm_spread, open_for_analysis, sphere_structure
from orthosphere.store import create_store

N_LAYERS, N_POS, D_MODEL, N_HEADS, D_HEAD = 4, 32, 128, 4, 32
SITES = ("resid_pre", "q", "k")
FACTORS = ["alpha", "beta", "pos"]
READS = {"norms": ("resid_pre", "q", "k"), "subspaces": ("resid_pre",), "spheres": ("resid_pre",)}
"""The site arrays each analysis reads once (norms reads q and k to recompute the attention)."""


def run_analyses(dataset) -> dict[str, float]:
    """Seconds of each analysis, as `orthosphere analyze --only norms,subspaces,spheres` runs them
    (spheres take the bases of the subspaces)."""
    seconds = {}
    started = time.perf_counter()
    norm_spread(dataset, sites=["resid_pre", "k"])
    seconds["norms"] = time.perf_counter() - started
    started = time.perf_counter()
    subspaces = factor_subspaces(dataset, factors=FACTORS, n_bootstrap=50)
    seconds["subspaces"] = time.perf_counter() - started
    started = time.perf_counter()
    spheres = sphere_structure(dataset, factors=FACTORS, subspaces=subspaces)
    seconds["spheres"] = time.perf_counter() - started
    assert spheres.attrs["bases"] == "from the subspaces results"
    return seconds


def build_store(path: Path, size_gb: float, seed: int = 0) -> str:
    """A store of random activations, written in chunk blocks, with planted structure in resid_pre:
    random class means of alpha (10 classes) and beta (8), and a rank-6 positional code (sines and
    cosines of three frequencies), as a trained model's positional subspace."""
    per_sample = 4 * N_LAYERS * N_POS * (D_MODEL + 2 * N_HEADS * D_HEAD)
    n_samples = int(size_gb * 2**30 / per_sample)
    model = {"family": "synthetic", "n_layers": N_LAYERS, "d_model": D_MODEL, "n_heads": N_HEADS,
             "n_kv_heads": N_HEADS, "d_head": D_HEAD, "attn_scale": D_HEAD**-0.5, "causal": True}
    writer = create_store(path, model=model, task={"name": "benchmark"}, n_samples=n_samples, n_pos=N_POS,
                          sites=SITES, labels={"alpha": "int16", "beta": "int16"}, overwrite=True)
    rng = np.random.default_rng(seed)
    means = {"alpha": rng.normal(size=(10, D_MODEL)), "beta": rng.normal(size=(8, D_MODEL))}
    angles = np.arange(N_POS)[:, None] * np.array([0.1, 0.3, 0.9])
    positional = np.concatenate([np.sin(angles), np.cos(angles)], axis=1) @ rng.normal(size=(6, D_MODEL))
    block = writer.attrs["samples_per_chunk"] * 4
    for start in range(0, n_samples, block):
        n = min(block, n_samples - start)
        labels = {name: rng.integers(0, len(value), size=(n, N_POS)).astype("int16") for name, value in means.items()}
        resid = rng.normal(size=(n, N_LAYERS, N_POS, D_MODEL)).astype("float32")
        resid += sum(means[name][labels[name]][:, None] for name in means).astype("float32")
        resid += positional.astype("float32")[None, None]
        heads = (n, N_LAYERS, N_POS, N_HEADS, D_HEAD)
        writer.write(start, {"resid_pre": resid, "q": rng.normal(size=heads).astype("float32"),
                             "k": rng.normal(size=heads).astype("float32"), "valid": np.ones((n, N_POS), bool),
                             **labels})
    writer.write_weights({name: np.asarray(writer.group[name][...]) for name in
                          ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")})
    writer.mark_shard_complete(0)
    writer.finish()
    return str(path)


class MemoryWatch:
    """Samples every worker's resident memory in a background thread; keeps each worker's peak."""

    def __init__(self, client: Client, interval: float = 0.2):
        self.client, self.interval = client, interval
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import psutil

        while not self._stop.is_set():
            try:
                for worker, rss in self.client.run(lambda: psutil.Process().memory_info().rss).items():
                    self.peaks[worker] = max(self.peaks.get(worker, 0), rss)
            except Exception:  # a worker restarting: the restart check reports it
                pass
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def spilled_bytes(client: Client) -> int:
    """Bytes the workers wrote to disk when spilling, since they started."""

    def written(dask_worker):
        metrics = getattr(dask_worker.data, "cumulative_metrics", {})
        return sum(value for (label, unit), value in metrics.items() if "disk-write" in label and unit == "bytes")

    return int(sum(client.run(written).values()))


def site_bytes(dataset, site: str) -> int:
    return int(dataset[site].nbytes)


def raw_pass(dataset) -> float:
    """Seconds to read and sum every site array once."""
    started = time.perf_counter()
    dask.compute([dataset[site].data.sum(dtype="float64") for site in SITES])
    return time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0, help="store size (default 2)")
    parser.add_argument("--memory-limit", default="512MB", help="memory limit of each worker (default 512MB)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write the store (default: a temporary directory)")
    args = parser.parse_args()
    directory = Path(args.dir or tempfile.mkdtemp(prefix="analyze-scale-"))
    try:
        started = time.perf_counter()
        url = build_store(directory / "store.zarr", args.size_gb)
        dataset = open_for_analysis(url)
        total = sum(site_bytes(dataset, site) for site in SITES)
        print(f"store: {total / 2**30:.2f} GiB of activations ({dataset.sizes['sample']} samples, {N_LAYERS} layers, "
              f"{N_POS} positions, d_model {D_MODEL}, {N_HEADS} heads of {D_HEAD}), written in "
              f"{time.perf_counter() - started:.0f} s")
        with LocalCluster(n_workers=args.workers, threads_per_worker=1, memory_limit=args.memory_limit,
                          dashboard_address=None) as cluster, Client(cluster) as client:
            limit = next(iter(client.scheduler_info()["workers"].values()))["memory_limit"]
            print(f"cluster: {args.workers} workers x 1 thread, memory limit {limit / 2**20:.0f} MiB each "
                  f"(store = {total / limit:.1f} x one worker's limit)")
            workers_before = set(client.scheduler_info()["workers"])
            raw_pass(dataset)  # warm the page cache and the workers alike for both passes
            raw_seconds = raw_pass(dataset)
            raw_rate = total / raw_seconds
            print(f"raw pass (read + sum {', '.join(SITES)}): {raw_seconds:.1f} s, {raw_rate / 2**20:.0f} MiB/s")
            with MemoryWatch(client) as watch:
                seconds = run_analyses(dataset)
            for name, elapsed in seconds.items():
                read = sum(site_bytes(dataset, site) for site in READS[name])
                rate = read / elapsed
                print(f"{name:<10} {elapsed:6.1f} s, reads {read / 2**30:.2f} GiB: {rate / 2**20:5.0f} MiB/s, "
                      f"ratio to the raw pass {rate / raw_rate:.2f}")
            read = sum(site_bytes(dataset, site) for name in READS for site in READS[name])
            together = sum(seconds.values())
            print(f"all three  {together:6.1f} s, reads {read / 2**30:.2f} GiB: {read / together / 2**20:5.0f} MiB/s, "
                  f"ratio to the raw pass {read / together / raw_rate:.2f}; wall time {together / raw_seconds:.1f} x "
                  "one raw pass over the store")
            peaks = ", ".join(f"{peak / 2**20:.0f}" for peak in watch.peaks.values())
            restarted = set(client.scheduler_info()["workers"]) != workers_before
            print(f"peak worker memory (MiB): {peaks} (limit {limit / 2**20:.0f}); spilled to disk: "
                  f"{spilled_bytes(client) / 2**20:.0f} MiB; worker restarted: {'yes' if restarted else 'no'}")
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
